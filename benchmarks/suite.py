"""The test suite's time: the README's test command on a clean clone, as CI runs it.

    python -m benchmarks.suite [--runs 3] [--revision HEAD]

Each run clones ``--revision`` of this repository into a new temporary directory (whose path does
not say "lightning": Lightning prints a warning raised in a file whose path says it as its own,
which ``tests/test_worker_warnings.py`` would see) and runs ``.ci/run`` there, which runs the
README's second command: a new virtual environment, the install, then ``python -m pytest``.
Nothing is reused from this checkout or an earlier run, not even a cache: pip's and uv's are turned
off (``PIP_NO_CACHE_DIR``, ``UV_NO_CACHE``), since CI's machine starts without them. pytest writes
a JUnit report (``PYTEST_ADDOPTS``), from which come pytest's own time and each test file's time
(the sum of its tests' setup, call and teardown, on the one pytest-xdist process that ran the
file). The install's time is the rest of the wall time.

The budget (issue 40) is 10 minutes in all and 8 for pytest; each figure is also given as a
ratio to its budget, since this machine's noise moves the seconds from run to run.

Writes ``benchmarks/results/suite.json`` (every run, its ten slowest files, the slowest run),
``suite.md`` and ``suite.png``.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from benchmarks import plots
from benchmarks.run import write_results

ROOT = Path(__file__).resolve().parent.parent
#: Seconds: the whole command, and pytest alone.
BUDGET = {"wall_s": 600.0, "pytest_s": 480.0}
SLOWEST = 10
#: The install's bars; pytest's are monarch's blue. Grey is kept for a ddp reference, which a suite has none of.
INSTALL = "tab:orange"


def file_times(report: Path) -> dict[str, float]:
    """Seconds per test file in a JUnit report, slowest first."""
    times: collections.Counter[str] = collections.Counter()
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((part for part in module if part.startswith("test_")), ".".join(module))
        times[f"{name}.py"] += float(case.get("time", 0))
    return dict(times.most_common())


def failed_tests(report: Path) -> dict[str, str]:
    """Each failed or erroring test of a JUnit report, with the first line of its message."""
    failed = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        for outcome in ("failure", "error"):
            found = case.find(outcome)
            if found is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                failed[name] = (found.get("message") or "").splitlines()[0][:300] if found.get("message") else outcome
    return failed


def one_run(revision: str) -> dict[str, Any]:
    """Clone ``revision`` into a new directory, run ``.ci/run`` there, and time it."""
    with tempfile.TemporaryDirectory(prefix="suite_clone_") as scratch:
        clone = Path(scratch) / "clone"
        subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", revision], check=True)
        report = Path(scratch) / "junit.xml"
        environment = {
            **os.environ,
            "PYTEST_ADDOPTS": f"--junitxml={report}",
            "PIP_NO_CACHE_DIR": "1",
            "UV_NO_CACHE": "1",
        }
        environment.pop("VIRTUAL_ENV", None)
        started = time.monotonic()
        done = subprocess.run(["bash", ".ci/run"], cwd=clone, env=environment, capture_output=True, text=True)
        wall = time.monotonic() - started
        if not report.exists():
            raise RuntimeError(f".ci/run wrote no JUnit report (exit {done.returncode}):\n{done.stdout[-3000:]}")
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        assert suite is not None
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        pytest_s = float(suite.get("time", 0))
        files = file_times(report)
        failed = failed_tests(report)
    return {
        "revision": revision,
        "exit_code": done.returncode,
        "wall_s": wall,
        "pytest_s": pytest_s,
        "install_s": wall - pytest_s,
        "counts": counts,
        "slowest_files": dict(list(files.items())[:SLOWEST]),
        "files_s": sum(files.values()),
        "failed": failed,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    slowest = max(runs, key=lambda run: run["wall_s"])
    return {
        "slowest_run": {key: slowest[key] for key in ("wall_s", "pytest_s", "install_s")},
        "of_budget": {key: slowest[key] / limit for key, limit in BUDGET.items()},
        "all_passed": all(run["exit_code"] == 0 for run in runs),
    }


def table(figures: dict[str, Any]) -> str:
    lines = ["| run | wall | install | pytest | tests | exit |", "|---|---|---|---|---|---|"]
    for index, run in enumerate(figures["runs"], 1):
        counts = run["counts"]
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        lines.append(
            f"| {index} | {run['wall_s']:.0f} s | {run['install_s']:.0f} s | {run['pytest_s']:.0f} s | "
            f"{passed} passed, {counts['skipped']} skipped | {run['exit_code']} |"
        )
    of_budget = figures["summary"]["of_budget"]
    lines.append("")
    lines.append(
        f"Slowest run: {of_budget['wall_s']:.2f} of the 10-minute budget, pytest {of_budget['pytest_s']:.2f} of its 8 minutes."
    )
    lines.append("")
    lines.append("| slowest files (slowest run) | seconds |")
    lines.append("|---|---|")
    slowest = max(figures["runs"], key=lambda run: run["wall_s"])
    lines.extend(f"| `{name}` | {seconds:.0f} |" for name, seconds in slowest["slowest_files"].items())
    return "\n".join(lines)


def plot(figures: dict[str, Any]) -> Any:
    """Left: each run's install and pytest time against the budget; right: the slowest run's ten
    slowest files."""
    runs = figures["runs"]
    figure, (left, right) = plots.pyplot().subplots(1, 2, figsize=(10, 3.4))
    labels = [f"run {index}" for index in range(1, len(runs) + 1)]
    installs = [run["install_s"] for run in runs]
    left.barh(labels, installs, color=INSTALL, label="install")
    left.barh(labels, [run["pytest_s"] for run in runs], left=installs, color=plots.MONARCH, label="pytest")
    left.axvline(BUDGET["wall_s"], color="black", linestyle="--", linewidth=1, label="budget (10 min)")
    left.invert_yaxis()
    left.set_xlabel("seconds, the README's test command on a clean clone")
    left.set_title("The suite's wall time")
    left.legend(fontsize=7, loc="lower right")
    slowest = max(runs, key=lambda run: run["wall_s"])
    names, seconds = zip(*slowest["slowest_files"].items(), strict=True)
    right.barh(names, seconds, color=plots.MONARCH)
    right.tick_params(axis="y", labelsize=7)
    right.invert_yaxis()
    right.set_xlabel("seconds in the file's tests (one pytest-xdist process)")
    right.set_title("The ten slowest files, slowest run")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--revision", default="HEAD", help="the commit to clone (committed changes only)")
    args = parser.parse_args()
    revision = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", args.revision], check=True, capture_output=True, text=True
    ).stdout.strip()
    runs = []
    for index in range(args.runs):
        runs.append(one_run(revision))
        print(f"run {index + 1}: {runs[-1]['wall_s']:.0f} s, pytest {runs[-1]['pytest_s']:.0f} s", flush=True)
        for name, message in runs[-1]["failed"].items():
            print(f"  failed: {name}: {message}", flush=True)
    figures = {"revision": revision, "budget": BUDGET, "runs": runs, "summary": summarize(runs)}
    write_results("suite", figures, table(figures), plot)


if __name__ == "__main__":
    main()
