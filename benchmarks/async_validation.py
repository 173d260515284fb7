"""Validation's cost to a fit: its wall time with synchronous and asynchronous validation against none (issue 43).

    python -m benchmarks.async_validation [--reps 3] [--epochs 10]

Issue 43 asks for asynchronous validation, on workers of their own, so that training never waits
for it; this benchmark measures it. The module's steps sleep instead of computing, as
GPU workers wait for their devices, so this machine's two cores do not set the times: a training
step sleeps :data:`TRAIN_STEP_S` (:data:`TRAIN_BATCHES` a rank an epoch), a validation step
:data:`VAL_STEP_S` (:data:`VAL_BATCHES` a rank), validation after every epoch: half an epoch's
training time, where the issue's typical run spends a tenth to a third of its time validating.
Each run is a fit on 2 CPU workers in a fresh process, timed from the first training epoch's
start (the mesh started and warm) to the end of the fit, the last validation included. The arms
take turns in each repetition, so that both meet the machine's load of the moment:

- ``none``: no validation (``limit_val_batches=0``), the training alone;
- ``sync``: validation after every epoch on the training workers, in the fit's loop, as ``ddp``
  does (``MonarchStrategy()``);
- ``async``: the same validations on 2 further workers while training goes on
  (``MonarchStrategy(validation="async")``); their mesh starts before the timed part.

The issue's target is at most 1.10 times the training alone for the asynchronous arm, where
synchronous validation costs about 1.5.

Writes ``benchmarks/results/async_validation.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import plots
from benchmarks.run import RESULTS, write_results

#: Seconds a training step sleeps, and the training batches of each rank an epoch.
TRAIN_STEP_S, TRAIN_BATCHES = 0.05, 20
#: Seconds a validation step sleeps, and the validation batches of each rank a validation.
VAL_STEP_S, VAL_BATCHES = 0.05, 10
#: Each arm's Trainer flags beyond the common ones, and its ``MonarchStrategy`` options.
ARMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "none": ({"limit_val_batches": 0}, {}),
    "sync": ({"limit_val_batches": VAL_BATCHES}, {}),
    "async": ({"limit_val_batches": VAL_BATCHES}, {"validation": "async"}),
}
#: The issue's target for the asynchronous arm: its fit's time over the training alone's.
TARGET = 1.10

#: One run, in a process of its own: ``argv`` is the arm, the epochs, the file for its figures, the
#: Trainer's flags and the strategy's options.
RUN = f"""
import json, sys, time
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_monarch

arm, epochs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]


class Sleeping(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        time.sleep({TRAIN_STEP_S})
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        time.sleep({VAL_STEP_S})
        self.log("val_loss", self.layer(batch[0]).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(2 * {TRAIN_BATCHES} * 4, 8)), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(2 * {VAL_BATCHES} * 4, 8)), batch_size=4)


@lightning_monarch.observe_only  # it reads the time only: the workers never wait for it
class Clock(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.started = time.monotonic()

    def on_fit_end(self, trainer, pl_module):
        self.seconds = time.monotonic() - self.started


clock = Clock()
strategy = lightning_monarch.MonarchStrategy(**json.loads(sys.argv[5]))
trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, callbacks=[clock],
                    num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, **json.loads(sys.argv[4]))
trainer.fit(Sleeping())
with open(out, "w") as file:
    json.dump({{"fit_s": clock.seconds, "global_step": trainer.global_step}}, file)
"""


def run(arm: str, epochs: int) -> dict[str, Any]:
    """One fit of ``arm`` in a fresh process: its figures."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        flags, options = ARMS[arm]
        command = [sys.executable, "-c", RUN, arm, str(epochs), str(out), json.dumps(flags), json.dumps(options)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=RESULTS.parent.parent, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the {arm} arm failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def summarize(runs: dict[str, list[dict[str, Any]]], epochs: int) -> dict[str, Any]:
    """Each arm's median fit time, its ratio to the training alone's, and the time the steps sleep."""
    medians = {arm: statistics.median(result["fit_s"] for result in results) for arm, results in runs.items()}
    return {
        "epochs": epochs,
        "median_fit_s": medians,
        "over_training_alone": {arm: seconds / medians["none"] for arm, seconds in medians.items()},
        "slept_s": {
            "none": epochs * TRAIN_BATCHES * TRAIN_STEP_S,
            "sync": epochs * (TRAIN_BATCHES * TRAIN_STEP_S + VAL_BATCHES * VAL_STEP_S),
            "async": epochs * TRAIN_BATCHES * TRAIN_STEP_S,
        },
    }


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| validation | fit (s), median | over the training alone | steps' sleep (s) |",
        "|---|---|---|---|",
    ]
    for arm, seconds in summary["median_fit_s"].items():
        lines.append(
            f"| {arm} | {seconds:.2f} | {summary['over_training_alone'][arm]:.2f}x | {summary['slept_s'][arm]:.1f} |"
        )
    floor = (summary["median_fit_s"]["none"] + VAL_BATCHES * VAL_STEP_S) / summary["median_fit_s"]["none"]
    lines.append("")
    lines.append(
        f"- The fit returns once its last validation ended: however asynchronous, {floor:.2f}x the training"
        f" alone at least here (the training alone's time and one validation's {VAL_BATCHES * VAL_STEP_S:.1f} s),"
        " a share that shrinks as a fit has more epochs."
    )
    lines.append(
        f"- {summary['epochs']} epochs of {TRAIN_BATCHES} training steps of {1000 * TRAIN_STEP_S:.0f} ms a rank, each"
        f" followed by {VAL_BATCHES} validation steps of {1000 * VAL_STEP_S:.0f} ms, on 2 CPU workers (and 2 more"
        f" for `async`). Target for asynchronous validation: at most {TARGET:.2f}x the training alone. The steps'"
        " sleep of `async` counts the training workers' only: the validation workers sleep meanwhile."
    )
    return "\n".join(lines)


def plot(figures: dict[str, Any]) -> Any:
    """Each arm's median fit time, with its ratio to the training alone's."""
    summary = figures["summary"]
    arms = list(summary["median_fit_s"])
    seconds = [summary["median_fit_s"][arm] for arm in arms]
    figure, axis = plots.pyplot().subplots(figsize=(7, 3))
    axis.barh(arms, seconds, color=[plots.REFERENCE if arm == "none" else plots.MONARCH for arm in arms])
    for position, arm in enumerate(arms):
        note = f"{summary['over_training_alone'][arm]:.2f}x the training alone"
        axis.annotate(note, (seconds[position], position), xytext=(4, 0), textcoords="offset points", va="center")
    none = summary["median_fit_s"]["none"]
    axis.axvline(none * TARGET, color="tab:green", linestyle="--", label=f"issue 43's target for async: {TARGET:.2f}x")
    axis.set_xlim(0, max(seconds) * 1.35)
    axis.invert_yaxis()
    axis.set_xlabel("fit's wall time (seconds, median)")
    axis.legend(fontsize=8, loc="upper right")
    figure.suptitle("Validation's cost: a fit of sleeping steps on 2 CPU workers, validating every epoch")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for rep in range(args.reps):
        for arm in ARMS:
            print(f"[async validation, {arm}, {rep + 1}/{args.reps}] ...", flush=True)
            started = time.monotonic()
            runs[arm].append(run(arm, args.epochs))
            print(f"  fit {runs[arm][-1]['fit_s']:.2f} s ({time.monotonic() - started:.0f} s in all)", flush=True)
    summary = summarize(runs, args.epochs)
    write_results("async_validation", {"summary": summary, "runs": runs}, table(summary), plot)


if __name__ == "__main__":
    main()
