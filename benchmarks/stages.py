"""Large-model stages benchmark: what a stage of a 400 MiB model costs, monarch against ddp.

    python -m benchmarks.stages [--reps 2]

The model is ``lightning_monarch.benchmark``'s ``400mib`` size (six ``Linear(4096, 4096)``, 100 M
parameters, 400 MiB in fp32) with batches of 8. Each run (``benchmarks.run_one --scenario stages``,
a fresh process) times a cold ``fit`` to its first finished step, then warm ``validate`` and
``predict`` of 2 batches, 3 times each (medians), with 2 and with 4 workers, alternating the modes
(monarch, ddp, monarch, ddp) so that the machine's noise hits both alike. A stage of such a model
under ``monarch`` costs what it costs under ``ddp`` only if its weights do not travel: once, for the
first stage, whatever the number of workers, and not at all for a warm one.

Writes ``benchmarks/results/stages.json`` (every run, the medians and the ratios), ``stages.md``
and ``stages.png``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks import plots
from benchmarks.run import run_one, write_results

SIZE = "400mib"
DEVICES = (2, 4)
#: (figure, what it times, the target for ddp's time over monarch's)
MEASURES = (
    ("validate_s", "warm validate, 2 batches", 0.90),
    ("predict_s", "warm predict, 2 batches", 0.90),
    ("first_step_s", "fit to its first finished step, cold", 0.80),
)


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One row per measure and number of workers: both modes' medians and ddp's over monarch's."""
    rows = []
    for devices, by_mode in runs.items():
        for figure, what, target in MEASURES:
            monarch = statistics.median(run[figure] for run in by_mode["monarch"])
            ddp = statistics.median(run[figure] for run in by_mode["ddp"])
            ratio = ddp / monarch
            rows.append(
                {
                    "measure": f"{what}, {devices} workers",
                    "monarch_s": monarch,
                    "ddp_s": ddp,
                    "ratio": ratio,
                    "target": target,
                    "met": ratio >= target,
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| measure (400 MiB model) | monarch (s) | ddp (s) | ddp / monarch | target | met |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row['measure']} | {row['monarch_s']:.2f} | {row['ddp_s']:.2f} | {row['ratio']:.2f}"
        f" | ≥ {row['target']:.2f} | {'yes' if row['met'] else 'no'} |"
        for row in rows
    ]
    return "\n".join(lines)


def plot(figures: dict[str, Any]) -> Any:
    """Both modes' seconds side by side for each measure, with their ratio."""
    rows = figures["rows"]
    figure, axis = plots.pyplot().subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    plots.pairs(
        axis,
        [row["measure"] for row in rows],
        ([row["monarch_s"] for row in rows], [row["ddp_s"] for row in rows]),
        [f"ddp/monarch {row['ratio']:.2f}" for row in rows],
    )
    axis.set_xlim(0, 1.25 * max(max(row["monarch_s"], row["ddp_s"]) for row in rows))
    axis.set_xlabel("seconds (medians; lower is better)")
    axis.set_title("Stages of a 400 MiB model on a 2-core CPU: monarch against ddp")
    axis.legend(loc="upper right")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for devices in DEVICES:
        for rep in range(args.reps):
            for mode in ("monarch", "ddp"):
                print(f"[{SIZE} stages, {devices} workers, {rep + 1}/{args.reps}] {mode} ...", flush=True)
                result = run_one(mode, SIZE, 0, "stages", devices)
                runs.setdefault(str(devices), {}).setdefault(mode, []).append(result)
    rows = summarize(runs)
    write_results("stages", {"rows": rows, "runs": runs}, table(rows), plot)


if __name__ == "__main__":
    main()
