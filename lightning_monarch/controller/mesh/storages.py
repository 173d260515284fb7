"""The controller's side of a stage's storages: what leaves this process, once, and how.

Runs on the controller, for ``controller.mesh.worker_mesh``. A stage's parcels (``codec.Parcel``) name their
large storages by key; rank 0 told at the end of the last stage which keys it holds (``Entry.held``),
and those never travel again. Each other storage leaves the controller once, whatever the number
of workers (``codec.Shipment``):

- where rank 0 runs on this host, in one memory file (``memory_files``: shared memory without a
  name, freed with the last process that holds it, so that a controller killed while its workers
  map the file leaves nothing behind), which every worker here maps without a copy (measured with
  a 400 MiB storage and 2 workers: 0.2-0.3 s to write, 0.1 s to map and read on each worker,
  against 0.75-1.4 s for the same bytes in one Monarch message to rank 0 and 0.6-1.0 s more for
  gloo to broadcast them to the other rank);
- otherwise (rank 0 on another host, too little free memory here, or
  ``MonarchStrategy(shared_memory=False)``), in one message to rank 0.

A rank that still lacks a storage gets it from rank 0 over the workers' process group
(``worker.storages``). Before its bytes leave, each storage is hashed again: a key that no longer
matches (the controller's module changed while a stage it started ran) is an error, never a stale
weight.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import psutil
import torch
from torch import nn

from lightning_monarch.memory_files import MemoryFile, write_at
from lightning_monarch.wire.codec import Parcel, Shipment, Source, StorageKey, as_memoryview, storage_key

#: The share of this host's available memory a stage's memory file may take.
_ROOM_SHARE = 0.5
#: The storages in a memory file start at multiples of this, where a worker may map each.
_PAGE = mmap.ALLOCATIONGRANULARITY


def lacking(parcels: Iterable[Parcel], held: frozenset[StorageKey]) -> dict[StorageKey, Source]:
    """The storages of ``parcels`` that rank 0 does not hold, each once, with their bytes."""
    found: dict[StorageKey, Source] = {}
    for parcel in parcels:
        for key, source in zip(parcel.keys, parcel.sources, strict=True):
            if key not in held:
                found.setdefault(key, source)
    return found


def in_memory_file(storages: dict[StorageKey, Source]) -> Optional[tuple[MemoryFile, Shipment]]:
    """``storages`` written into a new memory file, and the shipment that tells the workers where
    each is, if this host has the room; else ``None``. The caller closes the file once every
    worker opened it (or failed)."""
    offsets, end = {}, 0
    for key in storages:
        offsets[key] = end
        end += -(-key.nbytes // _PAGE) * _PAGE
    if end > _ROOM_SHARE * psutil.virtual_memory().available:
        return None
    file = MemoryFile("lightning_monarch_storages")
    try:
        os.ftruncate(file.fd, end)
        for key, source in storages.items():
            write_at(file.fd, _verified(key, source), offsets[key])
    except BaseException:
        file.close()
        raise
    return file, Shipment(file.path, file.identity, offsets)


def copies(storages: dict[StorageKey, Source]) -> list[bytes]:
    """Each of ``storages`` as ``bytes`` for a message (Monarch sends ``bytes`` without copying them again)."""
    return [bytes(_verified(key, source)) for key, source in storages.items()]


def _verified(key: StorageKey, source: Source) -> memoryview:
    if storage_key(source) != key:
        raise RuntimeError(
            "A storage of the stage's objects changed on the controller after the stage started (a callback"
            " or another thread wrote into the module's weights while the workers ran): under strategy='monarch'"
            " the workers would get other bytes than the stage started with. Change the controller's module"
            " only between stages, e.g. `model.load_state_dict(...)` before `trainer.fit(...)`."
        )
    return as_memoryview(source)


@dataclass(frozen=True)
class KeptShards:
    """A module on the meta device whose trained weights are the shards that a mesh's workers kept
    from its last sharded stage (``MonarchFSDPStrategy``), and its parameters and buffers then. It
    stands for those weights while it is the same module with the same tensors, all still on the
    meta device, where no value can be written: a replaced parameter or buffer, or one given values
    (``to_empty``, ``load_state_dict``), ends that."""

    module: weakref.ref[nn.Module]
    tensors: dict[str, weakref.ref]

    @classmethod
    def of(cls, module: nn.Module) -> KeptShards:
        return cls(weakref.ref(module), {name: weakref.ref(tensor) for name, tensor in _tensors(module).items()})

    def stand_for(self, module: nn.Module) -> bool:
        """Whether ``module`` still stands for the kept shards."""
        tensors = _tensors(module)
        return (
            self.module() is module
            and tensors.keys() == self.tensors.keys()
            and all(self.tensors[name]() is tensor and tensor.is_meta for name, tensor in tensors.items())
        )


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}
