"""The Monarch actor that the controller spawns once per device.

Runs in each worker process. Its endpoints never raise: a raising endpoint that the controller
sent fire-and-forget would reach Monarch's supervision, whose default kills the controller.
Failures travel back as :class:`WorkerFailure` values instead. Monarch runs one endpoint at a time:
only ``fetch`` waits (for rank 0's next entry), and it returns whenever the loop waits for the
controller, so that the grants and releases queued behind it are never blocked.
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from lightning.pytorch import LightningModule
from monarch.actor import Actor, current_rank, endpoint

from lightning_monarch.wire.codec import StorageKey, encode
from lightning_monarch.wire.protocol import Grant, RankStatus, Release
from lightning_monarch.wire.reports import CheckpointState, RankStats, RankValue, WorkerFailure, WorkerReport
from lightning_monarch.wire.specs import (
    PreflightSpec,
    RankSnapshot,
    StageSpec,
    ValidationRequest,
    Validators,
    WorldSpec,
)
from lightning_monarch.worker import lifeline
from lightning_monarch.worker.async_validation import HandOff, ValidationServer
from lightning_monarch.worker.checkpoints import save_full, save_shards
from lightning_monarch.worker.held_warnings import HELD
from lightning_monarch.worker.loop import StageLoop
from lightning_monarch.worker.notices import noticed, serves_notices
from lightning_monarch.worker.preflight import inspect_worker
from lightning_monarch.worker.process import LOCAL_DIMENSION, leave_process_group, torch_elastic_env
from lightning_monarch.worker.sharding import full_state_dict
from lightning_monarch.worker.stage import build_stage
from lightning_monarch.worker.stats import RankStatsReader, memory_in_use_mib
from lightning_monarch.worker.storages import WorkerStorages


class MonarchWorker(Actor):
    """Runs in each worker process: one DDP rank, driven stage by stage by the controller."""

    def __init__(self) -> None:
        # What the process holds by now (torch, Lightning, Monarch: some 400,000 objects) lives as
        # long as it does: out of the cyclic garbage collector's sight, the collection at each
        # stage's end walks what the stage made only (a few ms instead of some 200 ms).
        gc.freeze()
        self._stage: Optional[StageLoop] = None
        #: The last stage's module if it was sharded: its shards exist nowhere else.
        self._shards: Optional[LightningModule] = None
        #: Whether the stage in progress shards its module (``MonarchModelParallelStrategy``).
        self._sharded = False
        self._stats = RankStatsReader()
        #: The storages this process holds between stages, and those of the stage it starts.
        self._storages = WorkerStorages()

    @property
    def _rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @endpoint
    def process_id(self) -> tuple[int, int, str]:
        """This worker's rank, process ID and host; answering at all shows the process is alive."""
        return self._rank, os.getpid(), socket.gethostname()

    @endpoint
    def hold_lifeline(self, host: str, port: int, group: str) -> tuple[int, Optional[str]]:
        """Connect to the controller's lifeline listener as this rank of ``group``: from here this
        process ends when the controller's does (``worker.lifeline``). This rank, and why it could
        not connect (``None`` where it did)."""
        try:
            lifeline.hold(host, port, lifeline.token(group, self._rank))
        except OSError as error:
            return self._rank, f"{type(error).__name__}: {error}"
        return self._rank, None

    @endpoint
    def preflight(self, spec: PreflightSpec) -> Union[WorkerReport, WorkerFailure]:
        """Check this worker before its first stage (``worker.preflight``)."""
        try:
            return inspect_worker(spec)
        except BaseException as error:
            return self._failure(error, "preflight")

    @endpoint
    def end_stage(self) -> None:
        """Drop the finished stage, so that a warm worker holds no model, optimizer or data; but
        a sharded module, whose shards exist nowhere else, until the next stage starts (for
        ``full_state_dict``)."""
        self._drop_stage()

    @endpoint
    def free_port(self) -> tuple[str, int]:
        """This host's name and a port free on it, for the world's ``MASTER_ADDR`` and ``MASTER_PORT``."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return socket.gethostname(), probe.getsockname()[1]

    @endpoint
    def join_world(self, world: WorldSpec) -> None:
        """Take this worker's torchrun environment in ``world`` (``worker.process``): when the mesh
        starts, and when elastic training changed its hosts; the next stage's ``DDPStrategy`` forms
        its process group from it."""
        point = current_rank()
        host = point[world.host_dimension] if world.host_dimension is not None else 0
        os.environ.update(torch_elastic_env(world, host, point[LOCAL_DIMENSION]))

    @endpoint
    def notice(self) -> RankValue:
        """Whether this worker's host got a preemption notice (``worker.notices``); ``None`` where
        the host serves none."""
        return RankValue(self._rank, noticed() if serves_notices() else None)

    @endpoint
    def leave_world(self) -> bool:
        """A host of the mesh was lost (elastic training, ``controller.features.elastic``), or a
        stage failed on every rank, or a rank's pdb quit: drop the stage and this process's
        ``torch.distributed`` group, whose peers are gone or left. The controller then gives the
        processes the torch elastic environment of the new world, and the next stage's
        ``DDPStrategy`` forms its group from it, in this same process. A stage parked at a sync gate
        (the world grows at an epoch's start, or a host got a preemption notice) is abandoned there;
        one waiting in a collective for a rank that leaves ends as that rank's group closes. Whether
        the stage's loop ended: a loop still running must not meet the next stage."""
        if self._stage is not None:
            self._stage.abandon()
        ended = self._drop_stage()
        leave_process_group()
        return ended

    def _drop_stage(self) -> bool:
        """Drop the stage, once its loop ended or within 5 s; whether it ended."""
        ended = True
        if self._stage is not None:
            ended = self._stage.join(timeout=5.0)
            module = self._stage.state.module  # None if the stage never ran
            self._shards = module if self._sharded else None
        self._stage = None
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return ended

    @endpoint
    def receive_storages(self, keys: list[StorageKey], blobs: list[bytes]) -> None:
        """Rank 0, before ``start_stage``: the storages of the next stage that the controller sends
        in a message (``codec.Shipment``), by key."""
        self._storages.receive(keys, blobs)

    @endpoint
    def start_stage(self, spec: StageSpec) -> Optional[WorkerFailure]:
        """Gather the stage's storages with the other ranks (``worker.storages``), build this
        rank's Trainer for it and start its loop, which runs ahead (R4)."""
        first = self._stage is None
        if self._stage is not None:
            self._stage.join(timeout=5.0)
        kept, self._shards = self._shards, None
        self._sharded = spec.trainer.sharding is not None
        try:
            self._storages.gather(
                spec.parcels(),
                spec.shipment,
                spec.trainer,
                writes=spec.fn == "fit",
            )
            self._stage = build_stage(spec, self._rank, self._storages, kept, first)
        except BaseException as error:
            return self._failure(error, "start of the stage")
        self._stage.start()
        return None

    @endpoint
    def fetch(self) -> Union[bytes, RankStatus, WorkerFailure]:
        """Rank 0's entries since the last fetch (R3), as one message (``codec``); waits for one,
        or answers with rank 0's status while its batch in progress does not end (``worker.loop``)."""
        if self._stage is None:
            return self._failure(RuntimeError("No stage was started on this worker before its first fetch."), None)
        return self._stage.fetch()

    @endpoint
    def grant(self, grant: Grant) -> None:
        """The controller took ``grant.batches`` batch starts (R4)."""
        if self._stage is not None:
            self._stage.grant(grant)

    @endpoint
    def release(self, release: Release) -> None:
        """Leave the sync gate this rank is parked at, or will park at next (R5)."""
        if self._stage is not None:
            self._stage.release(release)

    @endpoint
    def validation_idle(self) -> bool:
        """A validation worker (``worker.async_validation``): whether it takes new weights. Asked by
        its training rank, not the controller."""
        server = self._stage.validation if self._stage is not None else None
        return isinstance(server, ValidationServer) and server.idle()

    @endpoint
    def validate(self, request: Optional[ValidationRequest]) -> None:
        """A validation worker: validate the weights of ``request``, from its training rank once
        :meth:`validation_idle`; ``None``, from the controller: end the stage after the validation
        in progress."""
        server = self._stage.validation if self._stage is not None else None
        if isinstance(server, ValidationServer):
            server.offer(request)

    @endpoint
    def new_validators(self, validators: Validators) -> None:
        """A training worker of a ``fit`` with asynchronous validation: the controller replaced the
        validation workers after a failed validation (``HandOff.replace``)."""
        hand_off = self._stage.validation if self._stage is not None else None
        if isinstance(hand_off, HandOff):
            hand_off.replace(validators)

    @endpoint
    def stop_training(self) -> None:
        """A training worker of a ``fit`` with asynchronous validation: the controller's
        ``EarlyStopping`` decided to stop, on a validation it replayed (``HandOff.stop``)."""
        hand_off = self._stage.validation if self._stage is not None else None
        if isinstance(hand_off, HandOff):
            hand_off.stop()

    @endpoint
    def status(self) -> RankStatus:
        """How far this rank's stage got, and why it failed, if it did; answered at once: the
        controller asks while it waits for rank 0."""
        return self._stage.status() if self._stage is not None else RankStatus(self._rank, 0)

    @endpoint
    def take_warnings(self) -> RankValue:
        """The warnings this process showed and holds (``worker.held_warnings``): on rank 0 those
        since its last entry, on the other ranks those since the last stage's end. Answered at once."""
        return RankValue(self._rank, HELD.take())

    @endpoint
    def predictions(self) -> Union[bytes, WorkerFailure]:
        """This rank's predictions of the ended stage with their dataset indices, as one message (``codec``)."""
        if self._stage is None:
            return self._failure(RuntimeError("No stage has run on this worker."), "predictions")
        return encode(self._stage.predictions())

    @endpoint
    def read_metrics(self, view: str) -> Union[Optional[dict[str, Any]], WorkerFailure]:
        """Read ``trainer.<view>`` where the loop is parked (all ranks; rank 0's value returns)."""
        return self._out_of_band(lambda state: state.read_metrics(view), f"trainer.{view}")

    @endpoint
    def collective(self, kind: str, view: str, key: str, options: dict[str, Any]) -> Any:
        """Run a collective on this rank's own ``trainer.<view>[key]`` where the loop is parked (all
        ranks; rank 0's result returns): the controller's callback passed rank 0's value of it."""
        return self._out_of_band(lambda state: state.collective(kind, view, key, options), f"trainer.strategy.{kind}")

    @endpoint
    def metric(self, view: str, key: str) -> Union[RankValue, WorkerFailure]:
        """This rank's ``trainer.<view>[key]`` where the loop is parked."""
        return self._out_of_band(lambda state: state.metric(view, key), f"trainer.{view}[{key!r}]")

    @endpoint
    def snapshot(self, directory: Optional[str]) -> Union[RankSnapshot, WorkerFailure]:
        """This rank's part of a recovery snapshot, where the loop is parked; for a sharded module,
        its shards are written into ``directory``."""
        return self._out_of_band(lambda state: state.snapshot(directory), "snapshot")

    @endpoint
    def checkpoint_state(self) -> Union[CheckpointState, WorkerFailure]:
        """This rank's model, optimizer and LR-scheduler state where the loop is parked."""
        return self._out_of_band(lambda state: state.checkpoint_state(), "checkpoint state")

    @endpoint
    def full_state_dict(self) -> Union[Optional[dict[str, Any]], WorkerFailure]:
        """This rank's part in gathering the sharded module's full state dict (rank 0 returns it):
        where the loop is parked, or after a sharded stage from the shards this worker kept."""
        return self._on_shards(full_state_dict, "full state dict")

    @endpoint
    def save_sharded_checkpoint(self, path: str, optimizers: bool) -> Union[Optional[dict[str, Any]], WorkerFailure]:
        """This rank's part in writing a sharded checkpoint into the directory ``path``: its shards
        of the module's and, with ``optimizers``, the optimizers' state (``worker.checkpoints``);
        rank 0 returns its worker callbacks' state. Where the loop is parked, or after a sharded
        stage from the shards this worker kept."""
        return self._on_shards(lambda module: save_shards(module, path, optimizers), "sharded checkpoint")

    @endpoint
    def save_full_checkpoint(
        self, path: str, metadata: dict[str, Any], optimizers: bool
    ) -> Union[Optional[str], WorkerFailure]:
        """This rank's part in writing a sharded module's checkpoint as one file ``path``: the full
        state gathered, written by rank 0 with the controller's ``metadata`` (``worker.checkpoints``).
        Where the loop is parked, or after a sharded stage from the shards this worker kept."""
        return self._on_shards(lambda module: save_full(module, path, metadata, optimizers), "full checkpoint")

    def _on_shards(self, fn: Callable[[LightningModule], Any], what: str) -> Any:
        """Run ``fn`` on the sharded module: the running stage's, where its loop is parked, or
        the one this worker kept after a sharded stage."""
        if self._stage is None and self._shards is not None:
            shards = self._shards
            try:
                return fn(shards)
            except BaseException as error:
                return self._failure(error, what)
        return self._out_of_band(lambda state: fn(state.module), what)

    @endpoint
    def module_children(self) -> Union[dict[str, Any], WorkerFailure]:
        """The direct submodules of this rank's module (see ``RankState.module_children``)."""
        return self._out_of_band(lambda state: state.module_children(), "module children")

    @endpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> Union[dict[str, Any], WorkerFailure]:
        """Let rank 0's worker callbacks and module add to the checkpoint the controller is writing."""
        return self._out_of_band(lambda state: state.on_save_checkpoint(checkpoint), "on_save_checkpoint")

    @endpoint
    def datamodule_state_dict(self) -> Union[dict[str, Any], WorkerFailure]:
        """Rank 0's datamodule's ``state_dict``, for the checkpoint the controller is writing."""
        return self._out_of_band(lambda state: state.datamodule_state_dict(), "the datamodule's state_dict")

    @endpoint
    def read_stats(self) -> Union[RankStats, WorkerFailure]:
        """This rank's device, process and step-time stats where the loop is parked (``worker.stats``)."""
        return self._out_of_band(lambda state: self._stats.read(self._rank, state.module.trainer), "stats")

    def _out_of_band(self, fn: Callable[[Any], Any], what: str) -> Any:
        stage = self._stage
        if stage is None:
            return self._failure(RuntimeError("No stage has run on this worker."), what)
        try:
            return stage.out_of_band(lambda: fn(stage.state))
        except BaseException as error:
            return self._failure(error, what)

    def _failure(self, error: BaseException, hook: Optional[str]) -> WorkerFailure:
        return WorkerFailure.capture(error, self._rank, hook, memory_in_use_mib())
