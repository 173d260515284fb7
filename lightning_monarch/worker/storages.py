"""The storages a worker holds between stages, and how a stage's storages reach every rank.

Runs in each worker process: :meth:`WorkerStorages.gather` in the ``start_stage`` endpoint,
:meth:`WorkerStorages.hold` on the loop thread once the stage ran to its end.

A stage's objects arrive as :class:`~lightning_monarch.wire.codec.Parcel` pickles whose large storages
travel apart, each named by its key (the hash of its bytes). The controller sends each storage
that rank 0 does not hold once (``codec.Shipment``): into one memory file of the controller's
(``memory_files``), which every worker on the controller's host maps without a copy (private,
copy-on-write), or in one message to rank 0. A rank that still lacks a storage then gets it from
rank 0 over the workers' own ``torch.distributed`` group (NCCL or RCCL at device speed, gloo on
CPUs), so that every rank opens the same bytes it would have unpickled from a copy of its own.
After a stage that ran to its end, every rank holds the storages of its objects that are still
alive and of its module's parameters and buffers, keyed anew (their bytes may have changed): what
the next stage's parcels name with those keys is taken from there, and nothing of it travels.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_monarch.memory_files import open_memory_file, read_at
from lightning_monarch.wire.codec import OUT_OF_BAND_BYTES, Parcel, Shipment, StorageKey, as_memoryview, storage_key
from lightning_monarch.wire.specs import TrainerConfig
from lightning_monarch.worker.process import ensure_process_group

#: The largest piece of a broadcast: small storages are sent together up to this size, and a
#: storage sent through a GPU (NCCL, RCCL) goes in pieces of it, so that staging it there takes
#: no more device memory.
_PIECE_BYTES = 64 * 2**20


class WorkerStorages:
    """Runs in each worker: the storages this process holds, by key, and those of a stage."""

    def __init__(self) -> None:
        #: What the last stage that ran to its end left, by key.
        self._held: dict[StorageKey, torch.UntypedStorage] = {}
        #: Rank 0: the storages the controller sent in a message for the next stage.
        self._received: dict[StorageKey, torch.UntypedStorage] = {}
        #: This stage's storages by key, and which of them its objects claimed already.
        self._stage: dict[StorageKey, torch.UntypedStorage] = {}
        self._claimed: set[StorageKey] = set()
        #: What the stage's objects were given, to hold after it if they still live.
        self._given: list[weakref.ref[torch.UntypedStorage]] = []
        #: The storages that map the controller's memory file, by address, while they live.
        self._mapped: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()

    def receive(self, keys: Iterable[StorageKey], blobs: list[bytes]) -> None:
        """Rank 0, before ``start_stage``: the storages the controller sent in a message."""
        for key, blob in zip(keys, blobs, strict=True):
            self._received[key] = torch.frombuffer(bytearray(blob), dtype=torch.uint8).untyped_storage()

    def gather(self, parcels: list[Parcel], shipment: Shipment, config: TrainerConfig, writes: bool) -> None:
        """Make every storage ``parcels`` name available to :meth:`take`: held from the last stage,
        from the controller's memory file where this host has it, received (rank 0), and whatever a
        rank still lacks broadcast from rank 0. Every rank takes part; the storages held from the
        last stage that this one does not name are let go. The file is mapped, private and
        copy-on-write, unless the stage ``writes`` its storages (a ``fit``): then it is read into
        memory of this process's own, which costs less than a fault per page written (measured
        with 400 MiB: 0.2-0.5 s to copy and write, against 0.8-1.0 s to write the mapped pages)."""
        keys = list(dict.fromkeys(key for parcel in parcels for key in parcel.keys))
        shipped = open_memory_file(shipment.path, shipment.identity) if shipment.path is not None else None
        try:
            found = [self._find(key, shipment, shipped, writes) for key in keys]
        finally:
            if shipped is not None:
                os.close(shipped)
        self._held, self._received = {}, {}
        if keys and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            ensure_process_group(config.accelerator, config.process_group_backend, config.timeout)
            _share_from_rank0(keys, found)
        missing = [key for key, storage in zip(keys, found, strict=True) if storage is None]
        if missing:
            raise RuntimeError(
                f"lightning_monarch: rank 0 lacks {len(missing)} of the stage's storages, which the controller"
                " counted as held there (a bug in lightning_monarch)."
            )
        self._stage = {key: storage for key, storage in zip(keys, found, strict=True) if storage is not None}
        self._claimed = set()

    def take(self, parcel: Parcel, hold: bool = True) -> list[torch.UntypedStorage]:
        """The storages to open ``parcel`` with, in the order of its keys: each the first time a
        key is taken, a copy the times after (two storages of the controller with equal bytes stay
        two storages). ``hold``: held after the stage if they still live (not a checkpoint's bytes,
        which are read once)."""
        storages = []
        for key in parcel.keys:
            storage = self._stage[key]
            if key in self._claimed:
                storage = storage.clone()
            self._claimed.add(key)
            if hold:
                self._given.append(weakref.ref(storage))
            storages.append(storage)
        return storages

    def end_of_stage(self) -> None:
        """The stage's objects were built: it no longer needs its storages by key."""
        self._stage, self._claimed = {}, set()

    def hold(self, module: Optional[nn.Module]) -> tuple[StorageKey, ...]:
        """After a stage that ran to its end: hold the storages its objects were given and still
        use, and those of ``module``'s CPU parameters and buffers, keyed by their bytes now; return
        the keys."""
        storages = [ref() for ref in self._given]
        if module is not None:
            storages += [
                tensor.untyped_storage()
                for tensor in (*module.parameters(), *module.buffers())
                if type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device.type == "cpu"
            ]
        unique = {
            storage.data_ptr(): storage
            for storage in storages
            if storage is not None and storage.device.type == "cpu" and storage.nbytes() >= OUT_OF_BAND_BYTES
        }
        self._held = {storage_key(storage): storage for storage in unique.values()}
        self._given = []
        return tuple(self._held)

    def _find(
        self, key: StorageKey, shipment: Shipment, shipped: Optional[int], writes: bool
    ) -> Optional[torch.UntypedStorage]:
        """The storage ``key``, if this rank has it: held from the last stage, received, or in the
        controller's memory file (``shipped``, open here). A stage that ``writes`` its storages
        gets memory of this process's own, never a mapping of the file, whose pages would stay
        beside the ones written."""
        held = self._held.get(key, self._received.get(key))
        if held is not None:
            return held.clone() if writes and held.data_ptr() in self._mapped else held
        offset = shipment.offsets.get(key)
        if shipped is None or offset is None:
            return None
        if writes:
            own = torch.empty(key.nbytes, dtype=torch.uint8)
            read_at(shipped, as_memoryview(own), offset)
            return own.untyped_storage()
        mapping = mmap.mmap(shipped, key.nbytes, flags=mmap.MAP_PRIVATE, offset=offset)
        mapped = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()  # keeps the mapping alive
        self._mapped[mapped.data_ptr()] = mapped
        return mapped


def _share_from_rank0(keys: list[StorageKey], found: list[Optional[torch.UntypedStorage]]) -> None:
    """Every rank learns which storages some rank lacks (one all-reduce), and rank 0 broadcasts
    those; a rank that lacks one takes it, the others receive it into a scratch buffer."""
    rank = dist.get_rank()
    device = torch.device("cuda", 0) if dist.get_backend() == "nccl" else torch.device("cpu")
    lacking = torch.tensor([storage is None for storage in found], dtype=torch.uint8, device=device)
    dist.all_reduce(lacking, op=dist.ReduceOp.MAX)
    needed = [index for index, flag in enumerate(lacking.tolist()) if flag]
    for group in _pieces(needed, keys):
        total = sum(keys[index].nbytes for index in group)
        if rank == 0:
            parts = [_as_tensor(found[index]) for index in group]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            flat = torch.empty(total, dtype=torch.uint8)
        _broadcast(flat, device, rank)
        if rank == 0:
            continue
        offset = 0
        for index in group:
            nbytes = keys[index].nbytes
            if found[index] is None:
                piece = flat if len(group) == 1 else flat[offset : offset + nbytes].clone()
                found[index] = piece.untyped_storage()
            offset += nbytes


def _pieces(needed: list[int], keys: list[StorageKey]) -> list[list[int]]:
    """The needed storages in broadcast groups: a large one alone, small ones together up to
    :data:`_PIECE_BYTES`."""
    groups: list[list[int]] = []
    size = 0
    for index in needed:
        nbytes = keys[index].nbytes
        if nbytes >= _PIECE_BYTES:
            groups.append([index])
            size = _PIECE_BYTES  # the next small one starts a group of its own
            continue
        if not groups or size + nbytes > _PIECE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += nbytes
    return groups


def _as_tensor(storage: Optional[torch.UntypedStorage]) -> torch.Tensor:
    assert storage is not None  # rank 0 has every storage it is asked to share
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _broadcast(flat: torch.Tensor, device: torch.device, rank: int) -> None:
    """Broadcast ``flat`` (CPU bytes) from rank 0: directly with gloo, through the GPU in pieces
    of :data:`_PIECE_BYTES` with NCCL or RCCL."""
    if device.type == "cpu":
        dist.broadcast(flat, src=0)
        return
    for start in range(0, flat.numel(), _PIECE_BYTES):
        piece = flat[start : start + _PIECE_BYTES]
        staged = piece.to(device) if rank == 0 else torch.empty_like(piece, device=device)
        dist.broadcast(staged, src=0)
        if rank != 0:
            piece.copy_(staged)
