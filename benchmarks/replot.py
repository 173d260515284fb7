"""Draw every benchmark's plot again from the figures it wrote, without running a benchmark.

    python -m benchmarks.replot

For each ``benchmarks/results/<name>.json`` there is, its benchmark's ``plot`` draws the figure
and ``<name>.png`` is written beside it: after a change to how a plot is drawn, the pages of the
documentation show the change with the figures they quote.
"""

from __future__ import annotations

import json
from types import ModuleType

from benchmarks import (
    async_validation,
    controller_cpu,
    death_report,
    elastic,
    exits,
    fed,
    monarch_knobs,
    namespace_import,
    plots,
    recovery,
    rehearsal,
    run,
    script_state,
    sharded,
    stages,
    suite,
)
from benchmarks.run import RESULTS

#: Each results file's name, and the benchmark that wrote it (``run`` writes ``latest`` and, with
#: ``--quick``, ``quick``).
WRITERS: dict[str, ModuleType] = {
    "latest": run,
    "quick": run,
    "stages": stages,
    "controller_cpu": controller_cpu,
    "sharded": sharded,
    "recovery": recovery,
    "elastic": elastic,
    "death_report": death_report,
    "monarch_knobs": monarch_knobs,
    "rehearsal": rehearsal,
    "fed": fed,
    "suite": suite,
    "exits": exits,
    "namespace_import": namespace_import,
    "async_validation": async_validation,
    "script_state": script_state,
}


def main() -> None:
    for name, benchmark in WRITERS.items():
        figures = RESULTS / f"{name}.json"
        if figures.exists():
            plots.save(benchmark.plot(json.loads(figures.read_text())), RESULTS / f"{name}.png")
            print(f"drew {RESULTS / name}.png from {figures.name}")


if __name__ == "__main__":
    main()
