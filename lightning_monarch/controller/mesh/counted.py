"""The bytes the controller sends its workers, counted where every message leaves it.

Runs on the controller. ``WorkerWorld`` hands out its workers' actor meshes only as
:class:`Counted` ones, so that no message goes around the count (``MonarchStrategy.sent_bytes``,
which the byte tests read): each endpoint call adds its arguments' pickled size, once per rank it
goes to, under the endpoint's name.

The size is counted without a copy (:func:`pickled_size`): the arguments are pickled into a sink
that keeps only lengths, the buffers of protocol 5 (``PickleBuffer``) out of band and measured
where they lie. Pickling a stage's weights again to measure them would put another copy of them in
the controller's memory at the moment it holds the most.
"""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import dataclass
from typing import Any

import cloudpickle


class _Lengths:
    """A file that keeps nothing: the bytes written to it, counted."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: Any) -> int:
        written = memoryview(data).nbytes
        self.bytes += written
        return written

    def out_of_band(self, buffer: pickle.PickleBuffer) -> None:
        """``buffer_callback``: ``buffer`` stays out of band (the call returns nothing); its length counts."""
        self.bytes += buffer.raw().nbytes


def pickled_size(args: tuple[Any, ...]) -> int:
    """The bytes of ``args`` pickled with protocol 5, counted without keeping them; with
    cloudpickle where only it pickles them, as Monarch does."""
    for pickler in (pickle.Pickler, cloudpickle.CloudPickler):
        sink = _Lengths()
        try:
            pickler(sink, protocol=5, buffer_callback=sink.out_of_band).dump(args)
        except Exception:  # what only cloudpickle pickles
            continue
        return sink.bytes
    raise pickle.PicklingError(f"neither pickle nor cloudpickle pickles the arguments {args!r:.200}")


class Counted:
    """An actor mesh (or ``world.Fanout``) whose endpoint calls are counted in ``sent``, as going
    to ``ranks`` ranks each; otherwise the mesh itself."""

    def __init__(self, mesh: Any, ranks: int, sent: Counter[str]) -> None:
        self._mesh = mesh
        self._ranks = ranks
        self._sent = sent

    def __getattr__(self, endpoint: str) -> _CountedEndpoint:
        return _CountedEndpoint(getattr(self._mesh, endpoint), endpoint, self._ranks, self._sent)


@dataclass(frozen=True)
class _CountedEndpoint:
    endpoint: Any
    name: str
    ranks: int
    sent: Counter[str]

    def _count(self, args: tuple[Any, ...], ranks: int) -> None:
        self.sent[self.name] += pickled_size(args) * ranks

    def broadcast(self, *args: Any) -> None:
        self._count(args, self.ranks)
        self.endpoint.broadcast(*args)

    def stream(self, *args: Any) -> Any:
        self._count(args, self.ranks)
        return self.endpoint.stream(*args)

    def call_one(self, *args: Any) -> Any:
        self._count(args, 1)
        return self.endpoint.call_one(*args)
