"""Fault-tolerance benchmark: one of 2 CPU workers SIGKILLed mid-fit, medium model.

    python -m benchmarks.recovery

Each case runs in a fresh process; the figures go to ``benchmarks/results/recovery.json``,
``recovery.md`` and ``recovery.png``:

- ``monarch, max_restarts=0``: from the kill to ``MeshFailureError`` in the controller;
- ``monarch, max_restarts=1``: from the kill to the next finished training step, the run going on
  (new processes, resumed from the snapshot at the epoch's start, and the steps since replayed);
- the alternative a user has today, restarting from the last checkpoint file: a new ``ddp`` run
  with ``fit(ckpt_path="last.ckpt")``, from its launch to its first step; the steps since that
  checkpoint are lost on top (half the checkpoint interval on average).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Optional

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from benchmarks import plots
from benchmarks.fresh import RESULTS, FirstStep, run_cases
from lightning_monarch import MeshFailureError, MonarchStrategy
from lightning_monarch.benchmark.models import BenchModel
from tests.served_hosts import process_job_host

#: 10 steps per epoch (20 batches, 2 ranks); the kill lands 5 steps after the epoch-3 snapshot.
SIZE, STEPS, BATCHES, KILL_AT, CHECKPOINT_EVERY = "medium", 60, 20, 35, 20


class KillRank1(L.Callback):
    """At step ``KILL_AT``, SIGKILLs worker rank 1 and, with ``whole_host``, its host process and
    everything it started; with ``notice``, sends SIGTERM to the host process and the worker instead
    (a preemption notice, to a host served by ``lightning-monarch serve``). With ``checkpoints``,
    keeps the ``last.ckpt`` there as it is then as ``before_death.ckpt`` beside it: what a ``ddp``
    run restarted after the death would resume from. Records when, when the first training step of
    the workers that go on ended (their process IDs changed: the controller may still take steps the
    workers recorded before the death, ahead of it, ``max_ahead``), and how many steps the
    controller saw twice (:attr:`steps_redone`)."""

    def __init__(self, whole_host: bool = False, checkpoints: Optional[Path] = None, notice: bool = False) -> None:
        self.whole_host, self.checkpoints, self.notice = whole_host, checkpoints, notice
        self.killed_at: Optional[float] = None
        self.resumed_at: Optional[float] = None
        self._pids: list[int] = []
        #: The global step at the end of every training batch where it changed.
        self._steps: list[int] = []

    @property
    def steps_redone(self) -> int:
        return len(self._steps) - len(set(self._steps))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self._steps or self._steps[-1] != trainer.global_step:
            self._steps.append(trainer.global_step)
        if self.killed_at is None and trainer.global_step == KILL_AT:
            if self.checkpoints is not None:
                shutil.copy(self.checkpoints / "last.ckpt", self.checkpoints.parent / "before_death.ckpt")
            self._pids = trainer.strategy.worker_pids
            worker = self._pids[1]
            if self.notice:
                for pid in (psutil.Process(worker).ppid(), worker):  # a served host's worker is its child
                    os.kill(pid, signal.SIGTERM)
            else:
                if self.whole_host:  # a ProcessJob host has its own session
                    os.killpg(process_job_host(1), signal.SIGKILL)
                with suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)
            self.killed_at = time.monotonic()
        elif self.killed_at is not None and self.resumed_at is None and trainer.strategy.worker_pids != self._pids:
            self.resumed_at = time.monotonic()


def fault_trainer(strategy: Any, callbacks: list[L.Callback], checkpoints: Path, **options: Any) -> L.Trainer:
    """The run of the fault-tolerance benchmarks (this one and ``benchmarks.elastic``): ``STEPS``
    steps on 2 devices unless ``options`` say otherwise, ``last.ckpt`` every ``CHECKPOINT_EVERY``."""
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[
            ModelCheckpoint(dirpath=str(checkpoints), every_n_train_steps=CHECKPOINT_EVERY, save_last=True),
            *callbacks,
        ],
        **{"devices": 2, "max_steps": STEPS, **options},
    )


def run_case(case: str, scratch: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    L.seed_everything(0)
    if case == "ddp_restart_from_checkpoint":
        trainer = fault_trainer("ddp", [FirstStep()], scratch / case, max_steps=KILL_AT + 2)
        # the last checkpoint the failed run wrote before its worker died
        trainer.fit(BenchModel(SIZE, BATCHES), ckpt_path=str(scratch / "monarch_fail" / "last.ckpt"))
        return {}
    killer = KillRank1()
    restarts = 1 if case == "monarch_restart" else 0
    trainer = fault_trainer(MonarchStrategy(max_restarts=restarts), [killer], scratch / case)
    try:
        trainer.fit(BenchModel(SIZE, BATCHES))
    except MeshFailureError:
        return {"detected_s": time.monotonic() - killer.killed_at}
    assert killer.killed_at is not None and killer.resumed_at is not None
    return {
        "resumed_s": killer.resumed_at - killer.killed_at,
        "restarts": trainer.strategy.restarts,
        "global_step": trainer.global_step,
    }


def main() -> None:
    results = run_cases(
        "benchmarks.recovery",
        __doc__.splitlines()[0],
        run_case,
        ("monarch_fail", "monarch_restart", "ddp_restart_from_checkpoint"),
        "ddp_restart_from_checkpoint",
    )
    if results is None:  # one case, run in this process
        return
    results["setup"] = {
        "model": SIZE,
        "steps": STEPS,
        "steps_per_epoch": BATCHES // 2,
        "killed_at_step": KILL_AT,
        "checkpoint_every": CHECKPOINT_EVERY,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recovery.json").write_text(json.dumps(results, indent=2))
    lost = (KILL_AT % CHECKPOINT_EVERY) or CHECKPOINT_EVERY
    table = "\n".join(
        [
            "| what | seconds |",
            "|---|---|",
            f"| monarch, `max_restarts=0`: kill to `MeshFailureError` | {results['monarch_fail']['detected_s']:.2f} |",
            f"| monarch, `max_restarts=1`: kill to the next finished step (detect, new processes, resume from"
            f" the epoch's snapshot, replay of {KILL_AT % (BATCHES // 2)} steps) | {results['monarch_restart']['resumed_s']:.2f} |",
            f"| `ddp` restarted from `last.ckpt`: launch to first step (not counting detection; {lost} steps"
            f" since the checkpoint lost) | {results['ddp_restart_from_checkpoint']['first_step_s']:.2f} |",
        ]
    )
    (RESULTS / "recovery.md").write_text(table + "\n")
    plots.save(plot(results), RESULTS / "recovery.png")
    print(table)


def plot(results: dict[str, Any]) -> Any:
    """monarch's seconds to detect and to recover beside ``ddp``'s restart from a checkpoint."""
    labels = ["monarch: detect", "monarch: recover\n(replay)", "ddp: restart\nfrom checkpoint"]
    values = [
        results["monarch_fail"]["detected_s"],
        results["monarch_restart"]["resumed_s"],
        results["ddp_restart_from_checkpoint"]["first_step_s"],
    ]
    figure, axis = plots.pyplot().subplots(figsize=(6, 3.5))
    axis.bar(labels, values, color=plots.colors(labels))
    axis.set_ylabel("seconds after the kill (lower is better)")
    axis.set_title(f"SIGKILL of 1 of 2 CPU workers at step {KILL_AT}, {SIZE} model")
    return figure


if __name__ == "__main__":
    main()
