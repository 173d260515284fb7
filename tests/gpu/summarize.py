"""Summarizes a run of ``tests/gpu/run_on_device.sh``: ``gpu-summary.json`` and ``gpu-summary.md``.

    python tests/gpu/summarize.py OUT_DIR COMMIT SECONDS

Reads the test report (JUnit XML), the benchmarks' JSON and the machine's description from
``OUT_DIR``; what is missing is reported as missing.
"""

from __future__ import annotations

import datetime
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any


def _tests(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome, detail = kind, (found.get("message") or "")[:400]
        cases.append(
            {"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)), "detail": detail}
        )
    return cases


def _benchmark(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    out, commit, seconds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    machine = (out / "machine.txt").read_text().strip() if (out / "machine.txt").exists() else "unknown"
    summary = {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "seconds": seconds,
        "machine": machine,
        "tests": _tests(out / "tests.xml"),
        "benchmarks": {size: _benchmark(out / f"benchmark-{size}.json") for size in ("small", "medium")},
        "stages": {mode: _benchmark(out / f"stages-{mode}.json") for mode in ("monarch", "ddp")},
    }
    (out / "gpu-summary.json").write_text(json.dumps(summary, indent=2))
    lines = [
        f"GPU run of {summary['date']}, commit `{commit}`, {seconds} s",
        "",
        "```",
        machine,
        "```",
        "",
        "| test | outcome | s | detail |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {case['test']} | {case['outcome']} | {case['seconds']:.1f} | {case['detail'].splitlines()[0] if case['detail'] else ''} |"
        for case in summary["tests"]
    ] or ["| (no test report) | missing | | |"]
    lines += ["", "| benchmark | monarch ms/step | ddp ms/step | monarch/ddp throughput |", "|---|---|---|---|"]
    for size, result in summary["benchmarks"].items():
        if result is None:
            lines.append(f"| {size} | missing | | |")
        else:
            median = result["median_ms"]
            lines.append(
                f"| {size} | {median['monarch']:.2f} | {median['ddp']:.2f}"
                f" | {result['throughput_ratio_monarch_over_ddp']:.3f} |"
            )
    lines += ["", "| 400 MiB model (s) | monarch | ddp |", "|---|---|---|"]
    stages = summary["stages"]
    for figure in ("first_step_s", "validate_s", "predict_s"):
        shown = [f"{stages[mode][figure]:.2f}" if stages[mode] else "missing" for mode in ("monarch", "ddp")]
        lines.append(f"| {figure} | {' | '.join(shown)} |")
    (out / "gpu-summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
