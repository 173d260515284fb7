"""A dataloader that cannot travel to the workers, iterated on the controller and fed to each rank.

Shared by both sides: the controller makes a :class:`FedIterable` in place of an iterable it
cannot pickle (a library's stream over a Python generator) and serves its items
(``controller.loop.feed``); the stand-in travels in the stage's payload, and each worker's
Trainer iterates it on the loop thread.

Under ``ddp`` every rank iterates its own copy of such an iterable: Lightning shards only a
``DataLoader``'s sampler, so the copies yield the same items as long as they draw the same random
numbers. Here the controller's one copy yields each item once, for every rank, with the global
random number generators (Python's, NumPy's, torch's) set to the asking rank's states, and the
rank takes the states that drawing it left: the item and the rank's generators after it are those
of a rank's own copy. A rank whose generators differ from those the item was drawn with, in a
generator the drawing used, would have drawn another item under ``ddp``: it raises instead.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from lightning_monarch.wire.codec import decode

#: A process's global random number generators, each as the bytes of its state.
RngStates = dict[str, bytes]


def capture_rng() -> RngStates:
    """The states of this process's global generators: ``random``, NumPy's and torch's (CPU)."""
    return {
        "random": pickle.dumps(random.getstate()),
        "numpy": pickle.dumps(np.random.get_state()),
        "torch": bytes(torch.get_rng_state().numpy()),
    }


def restore_rng(states: RngStates) -> None:
    """Set the global generators named in ``states`` to them; the others stay as they are."""
    if "random" in states:
        random.setstate(pickle.loads(states["random"]))
    if "numpy" in states:
        np.random.set_state(pickle.loads(states["numpy"]))
    if "torch" in states:
        torch.set_rng_state(torch.frombuffer(bytearray(states["torch"]), dtype=torch.uint8))


#: The index that asks for a pass's iterator (``iter``) instead of an item.
START = -1


@dataclass(frozen=True)
class FeedAnswer:
    """The controller's answer to a rank asking for item ``index`` of a pass over a fed iterable:
    the item (``codec.encode``), or the end of the pass, with the states of the generators that
    drawing it changed; or why the rank cannot have it."""

    item: Optional[bytes] = None
    end: bool = False
    rng: RngStates = field(default_factory=dict)
    error: Optional[str] = None


class FedIterable:
    """Runs in each worker: stands in for the iterable ``number`` of the stage that the controller
    iterates, and yields its items as the controller's copy yields them (module docstring).

    ``length``: the iterable's ``len()`` on the controller, ``None`` where it has none (Lightning
    then ends an epoch where the items end). ``description``: the iterable, for messages.
    """

    def __init__(self, feed: Any, number: int, length: Optional[int], description: str) -> None:
        self._feed = feed
        self._number = number
        self._length = length
        self.description = description
        self._passes = 0

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"{self.description} has no length")
        return self._length

    def __iter__(self) -> Iterator[Any]:
        """A pass: the controller's copy is asked for its iterator now, as a rank's own copy would
        be (Lightning also calls ``iter`` only to check that a loader is iterable)."""
        number = self._passes
        self._passes += 1
        self._ask(number, START)
        return self._items(number)

    def _items(self, number: int) -> Iterator[Any]:
        index = 0
        while True:
            answer = self._ask(number, index)
            if answer.end:
                return
            assert answer.item is not None  # an answer that is not the end carries the item
            yield decode(answer.item)
            index += 1

    def _ask(self, number: int, index: int) -> FeedAnswer:
        rank = dist.get_rank() if dist.is_initialized() else 0
        answer: FeedAnswer = self._feed.next_item.call_one(self._number, number, index, rank, capture_rng()).get()
        if answer.error is not None:
            raise RuntimeError(answer.error)
        restore_rng(answer.rng)
        return answer

    def __repr__(self) -> str:
        return f"FedIterable({self.description})"
