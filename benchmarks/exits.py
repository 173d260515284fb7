"""How the controller's process ends after a correct fit, with and without the exit guard.

    python -m benchmarks.exits [--runs 50] [--forced 3]

Issue 58: a controller that trained correctly sometimes aborted at exit (``FATAL: exception not
rethrown``, exit code 134) when Monarch's driver thread outlived Monarch's last exit handler
(``lightning_monarch.controller.interpreter_exit``). Each run is ``tests.test_exit.CONTROLLER``:
a one-epoch fit of ``tests.models.Classifier`` on 2 CPU workers, in a process of its own. Two arms:

- ``guarded``: this package as it ships;
- ``unguarded``: the same, with the guard's exit handler unregistered (:data:`UNGUARDED`).

Runs go two at a time, one of each arm side by side, so that both meet the same load. ``natural``
runs are what this machine gives (``--runs`` pairs); ``forced`` runs hold Monarch's driver thread
past Monarch's window and slow the interpreter's finalization (``--forced`` pairs), as
``tests/test_exit.py`` does. Each run gives its exit code, the seconds from the fit's end to the
process's end, and whether its output (the workers' forwarded output included) holds an abort
message.

Writes ``benchmarks/results/exits.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks import plots
from tests.test_exit import CONTROLLER

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: Put before the controller's script for the ``unguarded`` arm: the guard's handler never runs.
UNGUARDED = """
import atexit
import lightning_monarch
from lightning_monarch.controller import interpreter_exit
atexit.unregister(interpreter_exit.end_monarch)
"""
ARMS = {"guarded": CONTROLLER, "unguarded": UNGUARDED + CONTROLLER}
#: What an abort leaves in a process's output, the controller's or a worker's.
ABORTS = ("FATAL:", "Aborted", "core dumped", "panicked")


def pair(schedule: str) -> dict[str, dict[str, Any]]:
    """One run of each arm, side by side: each one's exit code, fit-end-to-exit seconds and abort flag."""
    with tempfile.TemporaryDirectory() as directory:
        outputs = {arm: Path(directory) / arm for arm in ARMS}
        running = {
            arm: subprocess.Popen(
                [sys.executable, "-c", script, "lightning_monarch-first", "fit", "return", schedule],
                cwd=ROOT,
                stdout=outputs[arm].open("w"),
                stderr=subprocess.STDOUT,
            )
            for arm, script in ARMS.items()
        }
        ended: dict[str, float] = {}
        deadline = time.monotonic() + 300
        while len(ended) < len(running) and time.monotonic() < deadline:
            for arm, process in running.items():
                if arm not in ended and process.poll() is not None:
                    ended[arm] = time.time()
            time.sleep(0.02)
        runs = {}
        for arm, process in running.items():
            if arm not in ended:
                process.kill()
                process.wait()
                ended[arm] = time.time()
            text = outputs[arm].read_text(errors="replace")
            stage_end = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("stage ended")]
            runs[arm] = {
                "exit_code": process.returncode,
                "seconds": round(ended[arm] - stage_end[0], 3) if stage_end else None,
                "abort_message": any(abort in text for abort in ABORTS),
            }
        return runs


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Exit codes counted, abort messages counted, and the seconds' median and maximum."""
    seconds = sorted(run["seconds"] for run in runs if run["seconds"] is not None)
    return {
        "runs": len(runs),
        "exit_codes": dict(Counter(str(run["exit_code"]) for run in runs)),
        "abort_messages": sum(run["abort_message"] for run in runs),
        "median_s": seconds[len(seconds) // 2] if seconds else None,
        "max_s": seconds[-1] if seconds else None,
        "seconds": seconds,
    }


def plot(figures: dict[str, Any]) -> Any:
    """Fit-end-to-exit seconds per arm and schedule, each box labelled with its exit codes."""
    figure, axis = plots.pyplot().subplots(figsize=(7, 3.5))
    labels, data, colors = [], [], []
    for schedule in ("natural", "forced"):
        for arm in ARMS:
            result = figures[schedule][arm]
            codes = ", ".join(f"{count}×{code}" for code, count in sorted(result["exit_codes"].items()))
            labels.append(f"{arm}, {schedule}\nexit codes: {codes}")
            data.append(result["seconds"])
            colors.append(plots.MONARCH if arm == "guarded" else plots.REFERENCE)
    boxes = axis.boxplot(data, orientation="horizontal", patch_artist=True, widths=0.6)
    for box, color in zip(boxes["boxes"], colors, strict=True):
        box.set_facecolor(color)
    axis.set_yticks(range(1, len(labels) + 1), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel("seconds from the fit's end to the process's end")
    axis.set_title(
        f"Controller exits: {figures['pairs']['natural']} natural and {figures['pairs']['forced']} forced pairs"
    )
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="natural pairs (one run of each arm)")
    parser.add_argument("--forced", type=int, default=3, help="forced pairs")
    arguments = parser.parse_args()
    figures: dict[str, Any] = {"pairs": {"natural": arguments.runs, "forced": arguments.forced}}
    for schedule, count in figures["pairs"].items():
        runs = []
        for index in range(count):
            runs.append(pair(schedule))
            print(schedule, index, runs[-1], flush=True)
        figures[schedule] = {arm: summary([run[arm] for run in runs]) for arm in ARMS}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "exits.json").write_text(json.dumps(figures, indent=2))
    table = [
        "| schedule | arm | runs | exit codes | abort messages | median s | max s |",
        "|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {schedule} | {arm} | {result['runs']} | {result['exit_codes']} | {result['abort_messages']} "
        f"| {result['median_s']} | {result['max_s']} |"
        for schedule in figures["pairs"]
        for arm, result in figures[schedule].items()
    ]
    (RESULTS / "exits.md").write_text("\n".join(table) + "\n\n(seconds: from the fit's end to the process's end)\n")
    plots.save(plot(figures), RESULTS / "exits.png")
    print("\n".join(table))


if __name__ == "__main__":
    main()
