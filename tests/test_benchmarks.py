"""A smoke run of the benchmark, so the suite cannot rot. Not a timed test: no figure is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_benchmark_run_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run_one",
            "--mode",
            "monarch",
            "--size",
            "small",
            "--steps",
            "12",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=280,
    )
    result = json.loads(out.read_text())
    assert {
        "step_ms",
        "first_step_s",
        "warm_first_step_s",
        "controller_peak_rss_mib",
        "worker_peak_rss_mib",
        "validate_samples_per_s",
        "predict_samples_per_s",
    } <= set(result)
    assert len(result["worker_peak_rss_mib"]) == 2
