"""What ``import pytorch_lightning`` costs after ``import lightning_monarch``, beside it alone.

    python -m benchmarks.namespace_import [--rounds 5]

After ``import lightning_monarch``, importing ``pytorch_lightning`` imports
``lightning_monarch.pl``: this package's modules rewritten for that namespace
(``lightning_monarch.namespaces``), in the controller and in every worker of a
``pytorch_lightning`` run. Each case is a fresh process that times the statement
``import pytorch_lightning`` alone:

- ``alone``: after ``import lightning_monarch``, with the finder that would import
  ``lightning_monarch.pl`` after ``pytorch_lightning`` taken off ``sys.meta_path``: what
  ``pytorch_lightning``'s own modules cost beyond what ``lightning_monarch`` imported already;
- ``uncached``: after ``import lightning_monarch``, the mirror's cache emptied and not written,
  so that every mirrored module is rewritten and compiled, as before the cache;
- ``cold``: the cache emptied, then written (a first run after an install or a change);
- ``warm``: the cache as the ``cold`` run wrote it (every later run).

The rounds run the four cases one after the other, so that each meets the same load; each case's
figure is its median. Python's own bytecode is cached in every case (the README's install compiles
it), and ``PYTHONDONTWRITEBYTECODE`` is unset, as in a user's shell.

Writes ``benchmarks/results/namespace_import.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import plots

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PACKAGE = ROOT / "lightning_monarch"
#: Each case's script: what it imports first, then the timed statement.
CASES = {
    "alone": "import sys, lightning_monarch; sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_AfterImport']",
    "uncached": "import sys; sys.dont_write_bytecode = True; import lightning_monarch",
    "cold": "import lightning_monarch",
    "warm": "import lightning_monarch",
}
TIMED = "import time; start = time.perf_counter(); import pytorch_lightning; print(time.perf_counter() - start)"


def empty_cache() -> None:
    """Remove every entry of the mirror's cache for this package (``MirrorCache``)."""
    for entry in [*PACKAGE.rglob("__pycache__/*.pl.pyc"), *PACKAGE.rglob("__pycache__/pl-graph.*")]:
        entry.unlink()


def seconds(case: str) -> float:
    """The seconds ``import pytorch_lightning`` took in a fresh process of ``case``."""
    if case in ("uncached", "cold"):
        empty_cache()
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(
        [sys.executable, "-c", "; ".join(filter(None, (CASES[case], TIMED)))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.split()[-1])


def plot(figures: dict[str, Any]) -> Any:
    """Each case's median seconds, ``alone`` grey."""
    figure, axis = plots.pyplot().subplots(figsize=(7, 3))
    cases = list(figures["median_s"])
    axis.barh(
        cases,
        [figures["median_s"][case] for case in cases],
        color=[plots.REFERENCE if case == "alone" else plots.MONARCH for case in cases],
    )
    for position, case in enumerate(cases):
        axis.annotate(
            f"{figures['median_s'][case]:.2f} s",
            (figures["median_s"][case], position),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    axis.invert_yaxis()
    axis.set_xlabel("seconds of `import pytorch_lightning` (median)")
    axis.set_title(f"import pytorch_lightning after import lightning_monarch ({figures['rounds']} rounds)")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    runs: dict[str, list[float]] = {case: [] for case in CASES}
    for index in range(rounds):
        for case in CASES:
            runs[case].append(round(seconds(case), 3))
        print(index, {case: values[-1] for case, values in runs.items()}, flush=True)
    figures = {
        "rounds": rounds,
        "median_s": {case: round(statistics.median(values), 3) for case, values in runs.items()},
        "runs_s": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "namespace_import.json").write_text(json.dumps(figures, indent=2))
    alone = figures["median_s"]["alone"]
    table = ["| case | `import pytorch_lightning`, s (median) | more than alone, s |", "|---|---|---|"]
    table += [f"| {case} | {value:.3f} | {value - alone:+.3f} |" for case, value in figures["median_s"].items()]
    (RESULTS / "namespace_import.md").write_text("\n".join(table) + "\n")
    plots.save(plot(figures), RESULTS / "namespace_import.png")
    print("\n".join(table))


if __name__ == "__main__":
    main()
