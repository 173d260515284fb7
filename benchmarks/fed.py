"""Fed-stream benchmark: the cost of a training stream that the controller iterates for every rank.

    python -m benchmarks.fed [--reps 3] [--steps 60]

A library's training stream over a Python generator cannot travel to the workers; under
``monarch`` the controller iterates it and feeds every rank each item (``lightning_monarch.wire.fed``),
one round trip per rank and item. Each run (a fresh process: ``python -m benchmarks.fed --one
MODE OUT``) trains the benchmark's medium model (a step of about 30 ms here, batches of 192 × 256
floats, 196 KiB) on 2 CPU workers for ``--steps`` steps from such a stream, and times the steady
steps on rank 0 (the controller under ``monarch``): ``monarch`` with the stream fed, ``ddp`` with
each rank iterating its own copy, and ``monarch`` with the same stream made to travel (its
generator built in ``__iter__``), so that each worker iterates its own copy as a ``ddp`` rank does.
The modes alternate; the figure is the median per mode.

Writes ``benchmarks/results/fed.json`` (every run and the medians), ``fed.md`` and ``fed.png``.
"""

from __future__ import annotations

import argparse
import itertools
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

#: mode: (strategy, whether the stream travels)
MODES = {"monarch": ("monarch", False), "ddp": ("ddp", False), "monarch_travels": ("monarch", True)}
LABELS = {
    "monarch": "monarch, the stream fed",
    "monarch_travels": "monarch, the stream travels",
    "ddp": "ddp, each rank's own copy",
}
SIZE = "medium"


class Stream:
    """The benchmark's data as a stream of batches from a generator made once (``travels=False``,
    as GluonTS makes its training stream: it cannot be pickled) or at each pass (it can)."""

    def __init__(self, steps: int, travels: bool) -> None:
        self.steps, self.travels = steps, travels
        self._batches = None if travels else self._generate()

    def _generate(self) -> Any:
        from lightning_monarch.benchmark.models import SIZES, make_dataset

        features, labels = make_dataset(SIZE, self.steps).tensors
        batch = SIZES[SIZE][3]
        for start in itertools.cycle(range(0, len(features), batch)):
            yield features[start : start + batch], labels[start : start + batch]

    def __iter__(self) -> Any:
        return itertools.islice(self._generate() if self.travels else self._batches, self.steps)


def _timed_steps() -> Any:
    """A callback that notes when each training batch ends, on rank 0."""
    import lightning as L

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.ends.append(time.perf_counter())

    return StepTimes()


def run(mode: str, steps: int, out: Path) -> None:
    """One run of ``mode`` (rank 0 writes ``out``); the ``ddp`` ranks run it too."""
    import lightning as L

    import lightning_monarch  # noqa: F401 - registers strategy="monarch"
    from lightning_monarch.benchmark.models import BenchModel

    strategy, travels = MODES[mode]
    L.seed_everything(0)
    times = _timed_steps()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[times],
    )
    trainer.fit(BenchModel(SIZE, steps), train_dataloaders=Stream(steps, travels))
    if trainer.is_global_zero:
        steady = times.ends[steps // 4 :]  # after the first quarter: the mesh warm, the caches full
        step_ms = 1000 * (steady[-1] - steady[0]) / (len(steady) - 1)
        out.write_text(json.dumps({"mode": mode, "steps": len(times.ends), "step_ms": step_ms}))


def _one(mode: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        command = [sys.executable, "-m", "benchmarks.fed", "--one", mode, str(out), "--steps", str(steps)]
        subprocess.run(command, check=True, capture_output=True, timeout=900, cwd=RESULTS.parent.parent)
        return json.loads(out.read_text())


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    medians = {mode: statistics.median(run["step_ms"] for run in results) for mode, results in runs.items()}
    return {"step_ms": medians, "relative_to_ddp": {mode: medians[mode] / medians["ddp"] for mode in medians}}


def table(summary: dict[str, Any]) -> str:
    lines = ["| run | ms per step | relative to ddp |", "|---|---|---|"]
    for mode, label in LABELS.items():
        lines.append(f"| {label} | {summary['step_ms'][mode]:.1f} | {summary['relative_to_ddp'][mode]:.2f} |")
    return "\n".join(lines)


def plot(figures: dict[str, Any]) -> Any:
    """Each monarch run's ms per step above ddp's, with its ratio to ddp's."""
    summary = figures["summary"]
    figure, axis = plots.pyplot().subplots(figsize=(7, 3))
    monarch_modes = ("monarch", "monarch_travels")
    plots.pairs(
        axis,
        [LABELS[mode] for mode in monarch_modes],
        ([summary["step_ms"][mode] for mode in monarch_modes], [summary["step_ms"]["ddp"]] * len(monarch_modes)),
        [f"{summary['relative_to_ddp'][mode]:.2f} × ddp" for mode in monarch_modes],
        reference=LABELS["ddp"],
    )
    axis.legend(fontsize=8, loc="lower right")
    axis.set_xlabel("ms per training step (median of steady steps)")
    axis.set_title("A training stream over a generator, medium model, 2 CPU workers")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--one", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run(args.one[0], args.steps, Path(args.one[1]))
        return
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for rep in range(args.reps):
        for mode in MODES:
            print(f"[fed stream, {mode}, {rep + 1}/{args.reps}] ...", flush=True)
            runs[mode].append(_one(mode, args.steps))
    summary = summarize(runs)
    write_results("fed", {"summary": summary, "runs": runs}, table(summary), plot)


if __name__ == "__main__":
    main()
