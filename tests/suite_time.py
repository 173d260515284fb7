"""The suite's own report of its time against the budget, printed after pytest ends (issue 60).

The README's test command must end within :data:`BUDGET_S` on a clean clone of the development
machine, install included. This report makes a change that goes over it visible in CI's log the
first time: pytest's wall time, the setup before it (measured from when ``.venv`` was made, where
that was moments before: a clean clone's run of the README command), their sum against the budget,
the test time each of pytest-xdist's processes spent (where one ends long after the other, the
files are badly spread: ``SLOWEST_FIRST`` in ``tests/conftest.py``), and the ten files whose tests
took longest. A report, not a failing test: the machine's noise is some 20%.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

#: Seconds the README's test command may take, install included.
BUDGET_S = 600
#: A ``.venv`` made longer than this before pytest started was not made by this run.
_SETUP_AT_MOST_S = 1800


class SuiteTime:
    """Runs in pytest's main process: the suite's wall time and each file's test time."""

    def __init__(self, root: Path) -> None:
        self.started = time.time()
        #: Written once, when ``python -m venv`` makes the environment (the folder itself changes later).
        self._venv = root / ".venv" / "pyvenv.cfg"
        self._files: Counter[str] = Counter()
        self._processes: Counter[str] = Counter()

    def add(self, report: Any) -> None:
        """A test report (setup, call or teardown): its time counts for its file."""
        self._files[report.nodeid.split("::", 1)[0]] += report.duration
        node = getattr(report, "node", None)  # the pytest-xdist process that ran it
        self._processes[node.gateway.id if node is not None else "main"] += report.duration

    def lines(self) -> list[str]:
        """The report."""
        wall = time.time() - self.started
        setup = self._setup()
        total = wall + (setup or 0.0)
        verdict = f"over it by {total - BUDGET_S:.0f} s" if total > BUDGET_S else f"{BUDGET_S - total:.0f} s to spare"
        what = f"pytest {wall:.0f} s" + (f" + setup {setup:.0f} s (since .venv was made)" if setup else "")
        spent = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in sorted(self._processes.items()))
        lines = [
            f"suite time: {what} = {total:.0f} s, budget {BUDGET_S} s: {verdict}",
            f"test time by process: {spent}",
            "slowest files (test time):",
        ]
        lines += [f"  {seconds:6.0f} s  {name}" for name, seconds in self._files.most_common(10)]
        return lines

    def _setup(self) -> Optional[float]:
        """Seconds from the making of ``.venv`` to pytest's start, where this run made it."""
        if not self._venv.exists():
            return None
        setup = self.started - self._venv.stat().st_mtime
        return setup if 0 < setup < _SETUP_AT_MOST_S else None
