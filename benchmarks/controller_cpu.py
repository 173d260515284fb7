"""Controller scaling benchmark: the controller's CPU time per training batch, 2 to 16 workers.

    python -m benchmarks.controller_cpu [--reps 2]

Each run (``benchmarks.run_one --scenario controller_cpu``, a fresh process) trains the small
benchmark model whose steps sleep 50 ms instead of computing (``SleepingModel``), as GPU workers
wait for their devices, so that 16 workers on this 2-core machine keep their steps about as long
as 2 do, and measures the controller's CPU time per batch (every thread of its process) and its
CPU time per second on an idle mesh. Issue 28's target is a figure flat within 20 % from 2 to 16
workers: what the controller does per batch must not grow with the number of workers.

Writes ``benchmarks/results/controller_cpu.json`` (every run and the medians),
``controller_cpu.md`` and ``controller_cpu.png``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks import plots
from benchmarks.run import run_one, write_results

DEVICES = (2, 4, 8, 16)
#: (figure, what it is) for each column of the table, in ms
FIGURES = (
    ("controller_cpu_ms_per_batch", "CPU per batch, all of it"),
    ("beyond_idle_ms_per_batch", "CPU per batch beyond the idle mesh's"),
    ("idle_ms_per_s", "CPU per second, idle mesh"),
    ("step_ms", "wall time per step"),
)
TARGET = 0.20


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The medians per number of workers, and each per-batch figure's growth from the fewest
    workers to the most (largest over smallest, less one)."""
    medians = {
        devices: {figure: statistics.median(run[figure] for run in results) for figure, _ in FIGURES}
        for devices, results in runs.items()
    }
    growth = {}
    for figure in ("controller_cpu_ms_per_batch", "beyond_idle_ms_per_batch"):
        values = [row[figure] for row in medians.values()]
        growth[figure] = max(values) / min(values) - 1
    return {"medians": medians, "growth": growth}


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| workers | " + " | ".join(f"{what} (ms)" for _, what in FIGURES) + " |",
        "|---" * (len(FIGURES) + 1) + "|",
    ]
    for devices, row in summary["medians"].items():
        lines.append(f"| {devices} | " + " | ".join(f"{row[figure]:.2f}" for figure, _ in FIGURES) + " |")
    lines.append("")
    for figure, what in FIGURES[:2]:
        growth = summary["growth"][figure]
        verdict = "met" if growth <= TARGET else "not met"
        lines.append(f"- {what}: largest over smallest +{100 * growth:.0f}% (target: within 20%: {verdict})")
    return "\n".join(lines)


def plot(figures: dict[str, Any]) -> Any:
    """Both per-batch figures against the number of workers, and the target's band. ``ddp`` has no
    controller, so there is no ``ddp`` line: its rank 0 runs the loop in its own training process."""
    summary = figures["summary"]
    figure, axis = plots.pyplot().subplots(figsize=(7, 4))
    workers = [int(devices) for devices in summary["medians"]]
    for name, what in FIGURES[:2]:
        axis.plot(workers, [row[name] for row in summary["medians"].values()], marker="o", label=what)
    smallest = summary["medians"][str(workers[0])]["beyond_idle_ms_per_batch"]
    axis.axhspan(smallest, smallest * (1 + TARGET), color="tab:green", alpha=0.15, label="within 20% of 2 workers")
    axis.set_xscale("log", base=2)
    axis.set_xticks(workers, [str(count) for count in workers])
    axis.set_ylim(bottom=0)
    axis.set_xlabel("workers (processes on one 2-core host)")
    axis.set_ylabel("controller CPU per training batch (ms)")
    axis.set_title("monarch's controller: CPU per batch, workers whose steps sleep 50 ms")
    axis.legend(fontsize=8)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for devices in DEVICES:
            print(f"[controller CPU, {devices} workers, {rep + 1}/{args.reps}] ...", flush=True)
            runs.setdefault(str(devices), []).append(run_one("monarch", "small", 0, "controller_cpu", devices))
    summary = summarize(runs)
    write_results("controller_cpu", {"summary": summary, "runs": runs}, table(summary), plot)


if __name__ == "__main__":
    main()
