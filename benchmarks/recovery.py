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

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_monarch import MeshFailureError, MonarchStrategy
from lightning_monarch.benchmark.models import BenchModel

RESULTS = Path(__file__).resolve().parent / "results"
#: 10 steps per epoch (20 batches, 2 ranks); the kill lands 5 steps after the epoch-3 snapshot.
SIZE, STEPS, BATCHES, KILL_AT, CHECKPOINT_EVERY = "medium", 60, 20, 35, 20


class KillRank1(L.Callback):
    """SIGKILLs worker rank 1 at step ``KILL_AT``; records when, and when the next step ended."""

    def __init__(self) -> None:
        self.killed_at: Optional[float] = None
        self.resumed_at: Optional[float] = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.killed_at is None and trainer.global_step == KILL_AT:
            os.kill(trainer.strategy.worker_pids[1], signal.SIGKILL)
            self.killed_at = time.monotonic()
        elif self.killed_at is not None and self.resumed_at is None:
            self.resumed_at = time.monotonic()


class FirstStep(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and not hasattr(self, "done"):
            self.done = True
            Path(os.environ["BENCHMARK_FIRST_STEP"]).write_text(str(time.time()))


def _trainer(strategy: Any, callbacks: list[L.Callback], checkpoints: Path, steps: int = STEPS) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[
            ModelCheckpoint(dirpath=str(checkpoints), every_n_train_steps=CHECKPOINT_EVERY, save_last=True),
            *callbacks,
        ],
    )


def run_case(case: str, scratch: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    L.seed_everything(0)
    if case == "ddp_restart_from_checkpoint":
        os.environ["BENCHMARK_FIRST_STEP"] = str(scratch / "first_step")
        trainer = _trainer("ddp", [FirstStep()], scratch / case, steps=KILL_AT + 2)
        # the last checkpoint the failed run wrote before its worker died
        trainer.fit(BenchModel(SIZE, BATCHES), ckpt_path=str(scratch / "monarch_fail" / "last.ckpt"))
        return {}
    killer = KillRank1()
    restarts = 1 if case == "monarch_restart" else 0
    trainer = _trainer(MonarchStrategy(max_restarts=restarts), [killer], scratch / case)
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


def _in_fresh_process(case: str, scratch: Path) -> dict[str, Any]:
    out = scratch / f"{case}.json"
    launched = time.time()
    subprocess.run(
        [sys.executable, "-m", "benchmarks.recovery", "--case", case, "--scratch", str(scratch), "--out", str(out)],
        check=True,
        cwd=RESULTS.parent.parent,
        timeout=600,
        capture_output=True,
    )
    result = json.loads(out.read_text()) if out.exists() else {}
    if case == "ddp_restart_from_checkpoint":
        result["first_step_s"] = float((scratch / "first_step").read_text()) - launched
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case")
    parser.add_argument("--scratch")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.case:
        result = run_case(args.case, Path(args.scratch))
        if result:
            Path(args.out).write_text(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as scratch:
        results = {
            case: _in_fresh_process(case, Path(scratch))
            for case in ("monarch_fail", "monarch_restart", "ddp_restart_from_checkpoint")
        }
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
    _plot(results, RESULTS / "recovery.png")
    print(table)


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["monarch: detect", "monarch: recover\n(replay)", "ddp: restart\nfrom checkpoint"]
    values = [
        results["monarch_fail"]["detected_s"],
        results["monarch_restart"]["resumed_s"],
        results["ddp_restart_from_checkpoint"]["first_step_s"],
    ]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.bar(labels, values, color=["tab:blue", "tab:blue", "tab:orange"])
    axis.set_ylabel("seconds after the kill (lower is better)")
    axis.set_title(f"SIGKILL of 1 of 2 CPU workers at step {KILL_AT}, {SIZE} model")
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    main()
