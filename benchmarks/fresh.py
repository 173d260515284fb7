"""Benchmark cases that each run in a fresh process, for ``benchmarks.recovery`` and
``benchmarks.elastic``: a case that fails or restarts workers must not share a process (its warm
mesh, its Monarch client) with the next one.

``python -m benchmarks.<name>`` runs every case as ``python -m benchmarks.<name> --case CASE``
(:func:`run_cases`), which writes what its run measured as JSON; a case that relaunches ``ddp``
from a checkpoint is timed from its launch to its first step (:class:`FirstStep`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import lightning as L

RESULTS = Path(__file__).resolve().parent / "results"
#: The variable that tells :class:`FirstStep` where to write the time of the first step.
_FIRST_STEP = "BENCHMARK_FIRST_STEP"


class FirstStep(L.Callback):
    """Writes the time rank 0 finished its first training step to the file ``run_cases`` names."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and not hasattr(self, "done"):
            self.done = True
            Path(os.environ[_FIRST_STEP]).write_text(str(time.time()))


def run_cases(
    module: str,
    description: str,
    run_case: Callable[[str, Path], dict[str, Any]],
    cases: Sequence[str],
    launch_timed: str,
) -> Optional[dict[str, dict[str, Any]]]:
    """With ``--case``, run that case here (``run_case``) and write its result, returning ``None``;
    else run every case of ``cases`` in a fresh ``python -m module --case ...``, in order, sharing
    a scratch directory, and return their results. ``launch_timed``: the case that gets
    ``first_step_s``, from its launch to its first step (it runs :class:`FirstStep`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--case")
    parser.add_argument("--scratch")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.case:
        result = run_case(args.case, Path(args.scratch))
        if result:
            Path(args.out).write_text(json.dumps(result))
        return None
    with tempfile.TemporaryDirectory() as scratch:
        return {case: _in_fresh_process(module, case, Path(scratch), case == launch_timed) for case in cases}


def _in_fresh_process(module: str, case: str, scratch: Path, launch_timed: bool) -> dict[str, Any]:
    out = scratch / f"{case}.json"
    first_step = scratch / "first_step"
    launched = time.time()
    subprocess.run(
        [sys.executable, "-m", module, "--case", case, "--scratch", str(scratch), "--out", str(out)],
        check=True,
        cwd=RESULTS.parent.parent,
        timeout=600,
        capture_output=True,
        env={**os.environ, _FIRST_STEP: str(first_step)},
    )
    result = json.loads(out.read_text()) if out.exists() else {}
    if launch_timed:
        result["first_step_s"] = float(first_step.read_text()) - launched
    return result
