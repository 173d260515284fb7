"""A stage's out-of-band requests (R5): what the controller's code asks of every worker's live state.

Runs on the controller, for a stage's ``StageSession``: collectives and reads of every rank's
metrics and stats for the strategy, the module's ``on_save_checkpoint``, the datamodule's
``state_dict`` for a checkpoint, and the sharded module's
gathers and checkpoints. Each goes to the workers only where they wait for the controller (the
session's ``require_parked`` raises elsewhere, naming the callback that asked), or after the stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.wire.reports import RankStats


class WorkerRequests:
    """Runs on the controller: one stage's requests to its parked workers."""

    def __init__(self, channel: StageChannel, require_parked: Callable[[str], None]) -> None:
        self._channel = channel
        self._require_parked = require_parked

    def collective(self, kind: str, view: str, key: str, options: dict[str, Any]) -> Any:
        """``trainer.strategy.<kind>`` run by every worker on its own ``trainer.<view>[key]``; rank 0's result."""
        self._require_parked(f"`trainer.strategy.{kind}(...)` of `trainer.{view}[{key!r}]`")
        return self._channel.ask_rank0("collective", kind, view, key, options, journal=True, everyone=True)

    def metric_on_every_rank(self, view: str, key: str) -> list[Any]:
        """Every rank's ``trainer.<view>[key]``, in rank order."""
        self._require_parked(f"every rank's `trainer.{view}[{key!r}]`")
        return [answer.value for answer in self._channel.ask_every_rank("metric", view, key)]

    def read_stats(self) -> list[RankStats]:
        """Every rank's stats (``worker.stats``), in rank order."""
        self._require_parked("the workers' stats")
        return self._channel.ask_every_rank("read_stats", journal=False)

    def on_save_checkpoint(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """The module's ``on_save_checkpoint``, run by rank 0 on the checkpoint the controller saves."""
        self._require_parked("a checkpoint")
        checkpoint = args[0] if args else kwargs["checkpoint"]
        edited = self._channel.ask_rank0("on_save_checkpoint", checkpoint, journal=True)
        checkpoint.clear()
        checkpoint.update(edited)

    def datamodule_state_dict(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
        """The datamodule's ``state_dict`` for the checkpoint the controller saves: rank 0's."""
        self._require_parked("a checkpoint (the datamodule's `state_dict`)")
        return self._channel.ask_rank0("datamodule_state_dict", journal=True)

    def full_state_dict(self) -> dict[str, Any]:
        """The sharded module's full state dict, gathered by the workers: where they wait during the
        stage, the final one after it (while the mesh keeps the shards)."""
        self._require_parked("the sharded module's full weights")
        self._require_processes("Gather them", "`trainer.strategy.gather_full_state_dict()`")
        return self._channel.ask_rank0("full_state_dict", everyone=True)

    def save_sharded_checkpoint(self, path: str, optimizers: bool) -> dict[str, Any]:
        """Let the workers write their shards into the directory ``path`` (``worker.checkpoints``),
        where they wait during the stage, the final ones after it; return rank 0's worker callbacks' state."""
        self._require_parked("a sharded checkpoint")
        self._require_processes("Save them", "`trainer.save_checkpoint(path)`")
        return self._channel.ask_rank0("save_sharded_checkpoint", path, optimizers, everyone=True)

    def save_full_checkpoint(self, path: str, metadata: dict[str, Any], optimizers: bool) -> None:
        """Let the workers gather the sharded module's full state and rank 0 write it, with
        ``metadata``, into the file ``path`` (``worker.checkpoints``), where they wait during the
        stage, the final state after it."""
        self._require_parked("a checkpoint")
        self._require_processes("Save them", "`trainer.save_checkpoint(path)`")
        self._channel.ask_rank0("save_full_checkpoint", path, metadata, optimizers, everyone=True)

    @property
    def worker_pids(self) -> list[int]:
        """The process IDs of the workers, in rank order."""
        return list(self._channel.mesh.pids)

    def _require_processes(self, action: str, call: str) -> None:
        """Raise if the stage's mesh, and a sharded module's shards with it, was stopped."""
        if self._channel.mesh.stopped:
            raise RuntimeError(
                "The worker mesh of that stage was stopped, and the module's shards with it (by"
                " `MonarchStrategy(keep_warm=False)`, `lightning_monarch.stop_meshes()`, a failure, or a stage with"
                f" other devices). {action} while the stage runs, e.g. in a callback's `on_fit_end`: {call}."
            )
