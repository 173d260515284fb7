"""The benchmark suite: every mode on every model size and scenario, side by side in one run.

    python -m benchmarks.run [--quick] [--reps 2]

Runs ``benchmarks.run_one`` in fresh processes, alternating the modes (A B C D, A B C D, ...)
so that machine noise hits them alike, and reports medians and monarch/ddp ratios against the
targets of issue 15. Writes ``benchmarks/results/latest.json``, ``latest.md`` and ``latest.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import plots

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("monarch", "ddp", "ddp_spawn", "torch")
#: Training steps per size: enough steady-state steps for a stable figure.
STEPS = {"small": 200, "medium": 60, "large": 25}
STEADY_METRICS = (
    "step_ms",
    "first_step_s",
    "warm_first_step_s",
    "controller_peak_rss_mib",
    "worker_peak_rss_mib",
    "validate_samples_per_s",
    "predict_samples_per_s",
)


@dataclass(frozen=True)
class Measure:
    """One row of the result table: a monarch/ddp ratio (higher is better for monarch), from one
    scenario's metric, and the target it is held against."""

    name: str
    scenario: str
    size: str
    metric: str
    #: ``True``: the metric is a time (ddp's over monarch's); ``False``: a rate (monarch's over ddp's).
    is_time: bool
    target: float

    @property
    def unit(self) -> str:
        """The unit of the metric's figures."""
        return {"fit_s": "s", "step_ms": "ms/step"}.get(self.metric, "samples/s")


MEASURES = [
    *(
        Measure(f"whole fit with Lightning's defaults, {size}", "defaults", size, "fit_s", True, target)
        for size, target in (("small", 0.85), ("medium", 0.95))
    ),
    *(
        Measure(f"steady training throughput, {size}", "steady", size, "step_ms", True, target)
        for size, target in (("small", 0.80), ("medium", 0.98), ("large", 1.0))
    ),
    *(
        Measure(
            f"the same, observe-only timing callback on the controller, {size}",
            "observed",
            size,
            "step_ms",
            True,
            target,
        )
        for size, target in (("small", 0.80), ("medium", 0.98), ("large", 1.0))
    ),
    *(
        Measure(f"{kind} samples/s, {size}", "steady", size, f"{kind}_samples_per_s", False, 0.90)
        for kind in ("validate", "predict")
        for size in ("small", "medium", "large")
    ),
    Measure(
        "large, ModelCheckpoint(every_n_train_steps=10), throughput", "checkpointed", "large", "step_ms", True, 1.0
    ),
]


def run_one(mode: str, size: str, steps: int, scenario: str, devices: int = 2, attempts: int = 2) -> dict[str, Any]:
    """One run in a fresh process; a run that fails is tried once more and the failure recorded."""
    failures = []
    for _ in range(attempts):
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "result.json"
            command = [
                sys.executable,
                "-m",
                "benchmarks.run_one",
                "--mode",
                mode,
                "--size",
                size,
                "--steps",
                str(steps),
                "--scenario",
                scenario,
                "--devices",
                str(devices),
                "--out",
                str(out),
            ]
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, cwd=RESULTS.parent.parent, timeout=900)
            if done.returncode == 0:
                result = json.loads(out.read_text())
                break
            failures.append(done.stderr[-2000:])
    else:
        raise RuntimeError(f"{mode} {size} {scenario} failed {attempts} times:\n{failures[-1]}")
    result["failed_attempts"] = failures
    result["wall_s"] = time.perf_counter() - started
    if isinstance(result.get("worker_peak_rss_mib"), list):
        result["worker_peak_rss_mib"] = max(result["worker_peak_rss_mib"])
    return result


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of every figure over the runs of one mode."""
    return {
        metric: statistics.median(run[metric] for run in runs)
        for metric, value in runs[0].items()
        if isinstance(value, (int, float))
    }


def summarize(runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]]) -> dict[str, Any]:
    """Medians per scenario, size and mode; the ratio and verdict of every measure."""
    found = {
        scenario: {
            size: {mode: medians(results) for mode, results in by_mode.items()} for size, by_mode in by_size.items()
        }
        for scenario, by_size in runs.items()
    }
    rows = []
    for measure in MEASURES:
        by_mode = found.get(measure.scenario, {}).get(measure.size)
        if not by_mode or "monarch" not in by_mode or "ddp" not in by_mode:
            continue
        monarch, ddp = by_mode["monarch"][measure.metric], by_mode["ddp"][measure.metric]
        ratio = ddp / monarch if measure.is_time else monarch / ddp
        rows.append(
            {
                "measure": measure.name,
                "monarch": monarch,
                "ddp": ddp,
                "ratio": ratio,
                "target": measure.target,
                "met": ratio >= measure.target,
            }
        )
    return {"medians": found, "measures": rows}


def table(summary: dict[str, Any]) -> str:
    lines = ["| measure | monarch | ddp | ratio (>1: monarch faster) | target | met |", "|---|---|---|---|---|---|"]
    for row in summary["measures"]:
        lines.append(
            f"| {row['measure']} | {row['monarch']:.4g} | {row['ddp']:.4g} | {row['ratio']:.3f}"
            f" | ≥ {row['target']:.2f} | {'yes' if row['met'] else 'no'} |"
        )
    steady = summary["medians"].get("steady", {})
    if steady:
        lines += [
            "",
            "| model | ms/step monarch / ddp / ddp_spawn / torch | first step cold, monarch / ddp (s)"
            " | first step warm, monarch / ddp (s) | peak RSS controller / worker / ddp rank (MiB) |",
            "|---|---|---|---|---|",
        ]
        for size, m in steady.items():
            lines.append(
                f"| {size} | {' / '.join(_shown(m, mode, 'step_ms') for mode in MODES)}"
                f" | {_shown(m, 'monarch', 'first_step_s')} / {_shown(m, 'ddp', 'first_step_s')}"
                f" | {_shown(m, 'monarch', 'warm_first_step_s', '{:.2f}')}"
                f" / {_shown(m, 'ddp', 'warm_first_step_s', '{:.2f}')}"
                f" | {_shown(m, 'monarch', 'controller_peak_rss_mib', '{:.0f}')}"
                f" / {_shown(m, 'monarch', 'worker_peak_rss_mib', '{:.0f}')}"
                f" / {_shown(m, 'ddp', 'worker_peak_rss_mib', '{:.0f}')} |"
            )
    return "\n".join(lines)


def _shown(medians: dict[str, Any], mode: str, metric: str, fmt: str = "{:.1f}") -> str:
    """One figure of the steady table, or "n/a" where that mode did not measure it."""
    value = medians.get(mode, {}).get(metric)
    return fmt.format(value) if value is not None else "n/a"


def plot(figures: dict[str, Any]) -> Any:
    """Each measure's speed relative to ``ddp``'s, ``ddp``'s bar (1) beside monarch's, each pair
    with both figures in their unit, and the target."""
    rows = figures["summary"]["measures"]
    units = {measure.name: measure.unit for measure in MEASURES}
    figure, axis = plots.pyplot().subplots(figsize=(11, 0.6 * len(rows) + 1.6))
    plots.pairs(
        axis,
        [row["measure"] for row in rows],
        ([row["ratio"] for row in rows], [1.0] * len(rows)),
        [f"{row['monarch']:.4g} / {row['ddp']:.4g} {units.get(row['measure'], '')}" for row in rows],
        monarch=(["tab:green" if row["met"] else "tab:red" for row in rows], "monarch (green: target met)"),
    )
    axis.scatter([row["target"] for row in rows], range(len(rows)), marker="|", s=300, color="black", label="target")
    axis.set_xlim(0, 1.45)
    axis.set_xlabel("speed relative to ddp (ddp = 1, higher: faster); beside each pair: monarch / ddp")
    axis.set_title("monarch against ddp, 2 workers on a 2-core CPU: medians of alternating runs")
    axis.legend(loc="lower right", fontsize=7)
    return figure


def write_results(stem: str, figures: dict[str, Any], markdown: str, draw: Callable[[dict[str, Any]], Any]) -> None:
    """Write one benchmark's results: ``results/<stem>.json`` (``figures``), ``<stem>.md``
    (``markdown``, also printed) and ``<stem>.png`` (drawn by ``draw`` from ``figures``)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(figures, indent=2))
    (RESULTS / f"{stem}.md").write_text(markdown + "\n")
    plots.save(draw(figures), RESULTS / f"{stem}.png")
    print(markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, steady scenario, monarch and ddp, once")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    # (scenario, size, modes, steps, devices)
    plan: list[tuple[str, str, tuple[str, ...], int, int]]
    if args.quick:
        plan, reps = [("steady", "small", ("monarch", "ddp"), 20, 2)], 1
    else:
        reps = args.reps
        plan = [("steady", size, MODES, steps, 2) for size, steps in STEPS.items()]
        plan += [("observed", size, ("monarch", "ddp"), steps, 2) for size, steps in STEPS.items()]
        plan += [("defaults", size, ("monarch", "ddp"), 0, 2) for size in ("small", "medium")]
        plan += [("checkpointed", "large", ("monarch", "ddp"), 65, 2)]
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    for scenario, size, modes, steps, devices in plan:
        for rep in range(reps):
            for mode in modes:
                print(f"[{scenario} {size} {rep + 1}/{reps}] {mode} devices={devices} ...", flush=True)
                result = run_one(mode, size, steps, scenario, devices)
                runs.setdefault(scenario, {}).setdefault(size, {}).setdefault(mode, []).append(result)
    summary = summarize(runs)
    write_results(
        "quick" if args.quick else "latest",
        {"summary": summary, "runs": runs},
        table(summary),
        plot,
    )


if __name__ == "__main__":
    main()
