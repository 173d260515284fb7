"""The benchmark suite: every mode on every model size, side by side in one run.

    python -m benchmarks.run [--quick] [--reps 2]

Runs ``benchmarks.run_one`` in fresh processes, alternating the modes (A B C D, A B C D, ...)
so that machine noise hits them alike, and reports medians and monarch/ddp ratios. Writes
``benchmarks/results/latest.json``, ``latest.md`` and ``latest.png``.
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

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("monarch", "ddp", "ddp_spawn", "torch")
#: Training steps per size: enough steady-state steps for a stable median.
STEPS = {"small": 200, "medium": 60, "large": 25}
METRICS = ("step_ms", "first_step_s", "warm_first_step_s", "controller_peak_rss_mib", "worker_peak_rss_mib", "validate_samples_per_s",
           "predict_samples_per_s")


def run_one(mode: str, size: str, steps: int, attempts: int = 2) -> dict[str, Any]:
    """One run in a fresh process; a run that fails is tried once more and the failure recorded."""
    failures = []
    for _ in range(attempts):
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "result.json"
            command = [sys.executable, "-m", "benchmarks.run_one", "--mode", mode, "--size", size,
                       "--steps", str(steps), "--out", str(out)]
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, cwd=RESULTS.parent.parent, timeout=900)
            if done.returncode == 0:
                result = json.loads(out.read_text())
                break
            failures.append(done.stderr[-2000:])
    else:
        raise RuntimeError(f"{mode} {size} failed {attempts} times:\n{failures[-1]}")
    result["failed_attempts"] = failures
    result["wall_s"] = time.perf_counter() - started
    if isinstance(result.get("worker_peak_rss_mib"), list):
        result["worker_peak_rss_mib"] = max(result["worker_peak_rss_mib"])
    return result


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for size, by_mode in runs.items():
        medians = {
            mode: {metric: statistics.median(r[metric] for r in results) for metric in METRICS if metric in results[0]}
            for mode, results in by_mode.items()
        }
        monarch, ddp = medians.get("monarch", {}), medians.get("ddp", {})
        summary[size] = {
            "medians": medians,
            "throughput_ratio_monarch_over_ddp": ddp["step_ms"] / monarch["step_ms"] if monarch and ddp else None,
            "controller_added_ms_per_step": monarch["step_ms"] - ddp["step_ms"] if monarch and ddp else None,
        }
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| model | monarch ms/step | ddp ms/step | ddp_spawn ms/step | torch ms/step | monarch/ddp throughput | added ms/step"
        " | first step cold, monarch / ddp (s) | first step warm, monarch / ddp (s)"
        " | peak RSS controller / worker / ddp rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, entry in summary.items():
        m = entry["medians"]

        def get(mode: str, metric: str, fmt: str = "{:.1f}") -> str:
            value = m.get(mode, {}).get(metric)
            return fmt.format(value) if value is not None else "n/a"

        lines.append(
            f"| {size} | {get('monarch', 'step_ms')} | {get('ddp', 'step_ms')} | {get('ddp_spawn', 'step_ms')}"
            f" | {get('torch', 'step_ms')} | {entry['throughput_ratio_monarch_over_ddp']:.3f}"
            f" | {entry['controller_added_ms_per_step']:.1f} | {get('monarch', 'first_step_s')} / {get('ddp', 'first_step_s')}"
            f" | {get('monarch', 'warm_first_step_s', '{:.2f}')} / {get('ddp', 'warm_first_step_s', '{:.2f}')}"
            f" | {get('monarch', 'controller_peak_rss_mib', '{:.0f}')} / {get('monarch', 'worker_peak_rss_mib', '{:.0f}')}"
            f" / {get('ddp', 'worker_peak_rss_mib', '{:.0f}')} |"
        )
    lines += ["", "| model | validate samples/s monarch / ddp | predict samples/s monarch / ddp (predictions returned) |",
              "|---|---|---|"]
    for size, entry in summary.items():
        m = entry["medians"]
        lines.append(
            f"| {size} | {m['monarch']['validate_samples_per_s']:.0f} / {m['ddp']['validate_samples_per_s']:.0f}"
            f" | {m['monarch']['predict_samples_per_s']:.0f} / {m['ddp']['predict_samples_per_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(summary)
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.2
    for index, mode in enumerate(MODES):
        values = [summary[size]["medians"].get(mode, {}).get("step_ms", 0) for size in sizes]
        axis.bar([i + index * width for i in range(len(sizes))], values, width, label=mode)
    axis.set_xticks([i + 1.5 * width for i in range(len(sizes))], sizes)
    axis.set_ylabel("ms per training step (median, lower is better)")
    axis.set_yscale("log")
    axis.set_title("2 workers on a 2-core CPU")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, monarch and ddp, one repetition")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--sizes", nargs="*", default=list(STEPS))
    args = parser.parse_args()
    sizes = ["small"] if args.quick else args.sizes
    modes = ("monarch", "ddp") if args.quick else MODES
    reps = 1 if args.quick else args.reps
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {size: {mode: [] for mode in modes} for size in sizes}
    for size in sizes:
        for rep in range(reps):
            for mode in modes:
                print(f"[{size} {rep + 1}/{reps}] {mode} ...", flush=True)
                runs[size][mode].append(run_one(mode, size, 20 if args.quick else STEPS[size]))
    summary = summarize(runs)
    RESULTS.mkdir(exist_ok=True)
    stem = "quick" if args.quick else "latest"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    (RESULTS / f"{stem}.md").write_text(table(summary) + "\n")
    plot(summary, RESULTS / f"{stem}.png")
    print(table(summary))


if __name__ == "__main__":
    main()
