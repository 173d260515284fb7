"""A smoke run of the benchmark, so the suite cannot rot, and every committed result drawn again.
Not a timed test: no figure is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.colors import to_rgba

from benchmarks import plots
from benchmarks.replot import WRITERS
from benchmarks.run import RESULTS

ROOT = Path(__file__).resolve().parent.parent
#: The results committed in ``benchmarks/results/``, each drawn on a page of the documentation.
COMMITTED = (
    "latest",
    "stages",
    "controller_cpu",
    "sharded",
    "recovery",
    "elastic",
    "death_report",
    "rehearsal",
    "fed",
    "suite",
    "exits",
    "namespace_import",
    "async_validation",
    "script_state",
)
#: Those with a reference to draw beside monarch: ``ddp``, Lightning's own, no exit guard (``exits``)
#: or ``pytorch_lightning`` without the mirror (``namespace_import``).
WITH_REFERENCE = (
    "latest",
    "stages",
    "sharded",
    "recovery",
    "elastic",
    "fed",
    "exits",
    "namespace_import",
    "async_validation",
)
#: Words of the value axis's label that name its unit.
UNITS = ("ms", "seconds", "MiB", "relative to ddp")


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


@pytest.mark.parametrize("name", COMMITTED)
def test_each_committed_result_draws_again_with_a_title_and_labelled_axes(name: str, tmp_path: Path) -> None:
    figures = json.loads((RESULTS / f"{name}.json").read_text())
    figure = WRITERS[name].plot(figures)
    suptitle = figure.get_suptitle()
    for axis in figure.axes:
        assert axis.get_title() or suptitle, f"{name}: a panel without a title"
        labels = axis.get_xlabel() + " " + axis.get_ylabel()
        assert any(unit in labels for unit in UNITS), f"{name}: no axis says its unit: {labels!r}"
    colours = {patch.get_facecolor() for axis in figure.axes for patch in axis.patches}
    assert (to_rgba(plots.REFERENCE) in colours) == (name in WITH_REFERENCE)
    plots.save(figure, tmp_path / f"{name}.png")
    assert (tmp_path / f"{name}.png").read_bytes().startswith(b"\x89PNG")
