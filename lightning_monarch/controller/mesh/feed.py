"""Iterables that cannot travel to the workers, iterated here and fed to every rank.

Runs in the controller's process: :class:`FedLoaders` puts a ``fed.FedIterable`` in place of each
dataloader argument that cannot be pickled (a library's stream over a Python generator), and the
process's one :class:`LoaderFeed` actor serves their items to the ranks that ask, on Monarch's
actor thread, while the stage runs. Why every rank gets the same items, and how the global random
number generators follow: ``lightning_monarch.wire.fed``.

While an item is drawn, this process's global generators hold the asking rank's states; the
controller's own states are put back after. The draw is done on the thread that runs the stage,
handed to it by the actor thread (``controller.mesh.stage_thread``): no code of the user's on that
thread draws meanwhile, by construction. The ranks that ask for an item already drawn are answered
on the actor thread, which then reads no generator.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from monarch.actor import Actor, endpoint, this_proc
from torch.utils.data import DataLoader

from lightning_monarch._compat.torch import tree_flatten, tree_unflatten
from lightning_monarch.controller.mesh.payload import find_unpicklable, travel_error
from lightning_monarch.controller.mesh.stage_thread import STAGE_THREAD
from lightning_monarch.wire.codec import encode
from lightning_monarch.wire.fed import START, FedIterable, FeedAnswer, RngStates, capture_rng, restore_rng

#: The iterables being fed, by number, in this process.
_FED: dict[int, _FedIterable] = {}
_LOCK = threading.Lock()
_NUMBERS = iter(range(2**62))
_ACTOR: list[Any] = []


def _feed_actor() -> Any:
    """This process's :class:`LoaderFeed` (one per Lightning namespace, named after this module), spawned on first use."""
    with _LOCK:
        if not _ACTOR:
            _ACTOR.append(this_proc().spawn(__name__.replace(".", "_"), LoaderFeed))
        return _ACTOR[0]


class LoaderFeed(Actor):
    """Runs in the controller's process: answers the ranks' requests for the items of fed iterables."""

    @endpoint
    def next_item(self, number: int, pass_number: int, index: int, rank: int, states: RngStates) -> FeedAnswer:
        fed = _FED.get(number)
        if fed is None:
            return _ENDED
        return fed.answer(pass_number, index, rank, states)


#: The answer to a rank that asks for an item after its stage ended (it read ahead of the end).
_ENDED = FeedAnswer(error="lightning_monarch: the fed iterable belongs to a stage that ended.")


@dataclass
class _Draw:
    """One item drawn from the controller's copy, for every rank: the rank that drew it, the
    generators' states it was drawn with (those it changed) and their states after."""

    answer: FeedAnswer
    rank: int
    before: RngStates
    takers: set[int] = field(default_factory=set)


class _FedIterable:
    """One iterable the controller iterates for a stage's ``world_size`` ranks."""

    def __init__(self, iterable: Iterable[Any], world_size: int, description: str) -> None:
        self._iterable = iterable
        self._world_size = world_size
        self.description = description
        #: The passes' iterators that have not ended, by pass, and the index each yields next.
        self._iterators: dict[int, Iterator[Any]] = {}
        self._next: dict[int, int] = {}
        self._passes = 0
        self._drawn: dict[tuple[int, int], _Draw] = {}

    def answer(self, pass_number: int, index: int, rank: int, states: RngStates) -> FeedAnswer:
        """Item ``index`` of pass ``pass_number`` for ``rank`` (the pass's ``iter`` where ``index``
        is ``fed.START``), whose generators are in ``states``."""
        key = (pass_number, index)
        draw = self._drawn.get(key)
        if draw is None:
            draw = self._drawn[key] = STAGE_THREAD.run(
                lambda: self._draw(pass_number, index, rank, states), lambda: _Draw(_ENDED, rank, {})
            )
        differing = sorted(name for name, state in draw.before.items() if states[name] != state)
        draw.takers.add(rank)
        if len(draw.takers) == self._world_size:
            del self._drawn[key]
        if differing:
            return FeedAnswer(
                error=f"{self.description} draws from the global random number generators ({', '.join(differing)})"
                f" while it is iterated, and rank {rank}'s states differ from rank {draw.rank}'s at item {index}"
                f" of pass {pass_number}: under strategy='ddp' the ranks' own copies would yield other items, and"
                " under strategy='monarch' the controller iterates one copy for every rank. The ranks' generators"
                " start alike after `lightning.seed_everything(seed)` and stay alike while module code draws as"
                " much on every rank. Otherwise make the iterable picklable, so that each rank iterates its own"
                " copy (create its generator in `__iter__`, not in `__init__`), or let it draw from a generator of"
                " its own (`numpy.random.default_rng(seed)`, `torch.Generator().manual_seed(seed)`)."
            )
        return draw.answer

    def _draw(self, pass_number: int, index: int, rank: int, states: RngStates) -> _Draw:
        expected = self._passes if index == START else self._next.get(pass_number)
        if (pass_number if index == START else index) != expected:
            answer = FeedAnswer(
                error=f"lightning_monarch: rank {rank} asked {self.description} for item {index} of pass"
                f" {pass_number}, which the controller's copy cannot yield next (a bug in lightning_monarch)."
            )
            return _Draw(answer, rank, {})
        own = capture_rng()
        restore_rng(states)
        end = False
        item: Any = None
        try:
            if index == START:
                self._iterators[pass_number], self._next[pass_number] = iter(self._iterable), 0
                self._passes += 1
            else:
                self._next[pass_number] += 1
                item = next(self._iterators[pass_number])
        except StopIteration:
            end = True
            del self._iterators[pass_number], self._next[pass_number]
        except Exception:
            error = (
                f"{self.description} raised while the controller iterated it for the ranks (under"
                f" strategy='monarch' the controller iterates it, as it cannot travel):\n{traceback.format_exc()}"
            )
            return _Draw(FeedAnswer(error=error), rank, {})
        finally:
            after = capture_rng()
            restore_rng(own)
        changed = {name: state for name, state in after.items() if state != states[name]}
        try:
            encoded = None if end or index == START else encode(item)
        except Exception as error:
            answer = FeedAnswer(
                error=f"{self.description} yielded an item that cannot be pickled for the ranks, a"
                f" `{type(item).__name__}` ({type(error).__name__}: {error}). Yield tensors, arrays and other"
                " objects that pickle."
            )
            return _Draw(answer, rank, {})
        return _Draw(FeedAnswer(item=encoded, end=end, rng=changed), rank, {name: states[name] for name in changed})


class FedLoaders:
    """Runs on the controller: one stage's dataloader arguments, with a ``FedIterable`` in place
    of each iterable that cannot travel; :meth:`close` lets them go after the stage."""

    def __init__(self, loaders: dict[str, Any], world_size: int, handed_at: str, refuse: Optional[str]) -> None:
        """``handed_at``: where the iterables were handed to the Trainer (a file and line), for
        messages. ``refuse``: why this stage cannot feed an iterable (a ``MonarchStrategy`` option
        that needs the workers to iterate it again), raised for one that cannot travel."""
        self._numbers: list[int] = []
        self.loaders = {
            name: self._stand_ins(name, value, world_size, handed_at, refuse) for name, value in loaders.items()
        }

    def _stand_ins(self, name: str, tree: Any, world_size: int, handed_at: str, refuse: Optional[str]) -> Any:
        leaves, spec = tree_flatten(tree)
        for position, leaf in enumerate(leaves):
            if travel_error(leaf) is None:
                continue
            where = name if len(leaves) == 1 else f"{name}[{position}]"
            leaves[position] = self._stand_in(where, leaf, world_size, handed_at, refuse)
        return tree_unflatten(leaves, spec)

    def _stand_in(self, where: str, iterable: Any, world_size: int, handed_at: str, refuse: Optional[str]) -> Any:
        found = find_unpicklable(iterable, where)
        assert found is not None  # travel_error found it
        description = f"The `{where}` iterable `{type(iterable).__qualname__}` (handed to the Trainer at {handed_at})"
        cannot_travel = (
            f"{description} cannot be pickled for the workers: {found.describe()} cannot"
            f" ({type(found.error).__name__}: {found.error})."
        )
        reason = refuse or _unfeedable(iterable)
        if reason is not None:
            raise TypeError(
                f"{cannot_travel} The controller could iterate it and feed every rank, as each rank iterates its own"
                f" copy under strategy='ddp', but {reason} Make it picklable: keep generators, open files and"
                " locks out of its attributes (create them in `__iter__`), or build it in the LightningModule's or"
                " LightningDataModule's `*_dataloader()` hook, which runs on the workers."
            ) from found.error
        number = next(_NUMBERS)
        _FED[number] = _FedIterable(iterable, world_size, description)
        if not self._numbers:
            STAGE_THREAD.open()
        self._numbers.append(number)
        return FedIterable(_feed_actor(), number, _length(iterable), description)

    def close(self) -> None:
        """The stage ended: its iterables are fed no more."""
        for number in self._numbers:
            _FED.pop(number, None)
        if self._numbers:
            STAGE_THREAD.close()
        self._numbers = []


def _unfeedable(iterable: Any) -> Optional[str]:
    """Why the ranks cannot all be fed one copy's items, or ``None``."""
    if isinstance(iterable, DataLoader):
        return (
            "it is a `DataLoader`, which Lightning gives each rank a shard of (its sampler becomes a"
            " `DistributedSampler`), and which module code may read as one (`trainer.train_dataloader.dataset`)."
        )
    return None


def _length(iterable: Any) -> Optional[int]:
    try:
        return len(iterable)
    except (TypeError, NotImplementedError):
        return None
