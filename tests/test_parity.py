"""Parity: the same seeded runs under Lightning's ``ddp`` and under ``monarch`` give the same results.

Weights, metrics, logged CSV rows, checkpoints and the module's hook order are compared for
equality: both run the same DDP arithmetic on CPU with gloo, so they must agree bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_monarch.strategy import DEFAULT_MAX_AHEAD
from tests.conftest import run_ddp_reference
from tests.parity_cases import CASES, FAILING_CASES, comparable_checkpoint, run_case

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_ddp_reference(tmp_path_factory.mktemp("ddp"), list(CASES))


@pytest.fixture(scope="module")
def ddp_failures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ddp-failures")
    # one reference run each: its failing rank 0 leaves the other ranks in a collective that fails
    for case in FAILING_CASES:
        run_ddp_reference(directory, [case], fails=True)
    return directory


def _files(root: Path, pattern: str) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.glob(pattern))


def assert_same(ours: Any, reference: Any, where: str = "") -> None:
    """Recursive equality, tensors compared bitwise."""
    if isinstance(reference, torch.Tensor):
        assert isinstance(ours, torch.Tensor), where
        assert ours.dtype == reference.dtype and torch.equal(ours, reference), f"{where}: {ours} != {reference}"
    elif isinstance(reference, dict):
        assert set(ours) == set(reference), f"{where}: keys {sorted(ours)} != {sorted(reference)}"
        for key in reference:
            assert_same(ours[key], reference[key], f"{where}.{key}")
    elif isinstance(reference, (list, tuple)):
        assert len(ours) == len(reference), f"{where}: {len(ours)} != {len(reference)}"
        for index, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
            assert_same(mine, theirs, f"{where}[{index}]")
    else:
        assert ours == reference, f"{where}: {ours!r} != {reference!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_same_results_as_ddp(case: str, ddp_results: Path, tmp_path: Path) -> None:
    assert_same_as_ddp(case, ddp_results, tmp_path)


#: Cases run again with other leads of the workers: lockstep, one batch, and no limit (a whole
#: epoch), where the default lead is not the only one that must give ``ddp``'s results.
OTHER_LEADS = (
    "plain",
    "hooks",
    "step_outputs",
    "stop_in_step",
    "early_stopping",
    "accumulation_scheduler",
    "iterable_dataset",
    "loop_flags",
    "metric_views",
    "controller_stops",
    "manual_gan",
    "resume",
)


@pytest.mark.parametrize("max_ahead", [0, 1, None], ids=["lockstep", "one-batch", "unbounded"])
@pytest.mark.parametrize("case", OTHER_LEADS)
def test_same_results_with_other_leads(case: str, max_ahead: Optional[int], ddp_results: Path, tmp_path: Path) -> None:
    assert_same_as_ddp(case, ddp_results, tmp_path, max_ahead)


@pytest.mark.parametrize(
    ("case", "max_ahead"), [("worker_fails", 4), ("worker_fails", 0), ("on_exception_checkpoint", 4)]
)
def test_a_worker_failure_leaves_what_ddp_leaves(case: str, max_ahead: int, ddp_failures: Path, tmp_path: Path) -> None:
    """Rank 0 raises at step 6 while it runs ahead: the controller replays every entry before the
    failure, then raises it, so the logged rows and checkpoints are those of ``ddp`` failing there;
    with ``OnExceptionCheckpoint``, its file holds rank 0's state as it failed, as ddp's rank 0 writes it."""
    assert_same_as_ddp(case, ddp_failures, tmp_path, max_ahead)
    assert (tmp_path / "checkpoints" / "on_exception.ckpt").exists() == (case == "on_exception_checkpoint")


def assert_same_as_ddp(case: str, reference_dir: Path, tmp_path: Path, max_ahead: Any = DEFAULT_MAX_AHEAD) -> None:
    ours = run_case(case, "monarch", tmp_path, max_ahead)
    reference = torch.load(reference_dir / case / "results.pt", weights_only=False)
    assert ours is not None
    assert_same(ours, reference, case)
    written = _files(tmp_path, "**/*.ckpt")
    assert written == _files(reference_dir / case, "**/*.ckpt")
    for name in written:
        assert_same(comparable_checkpoint(tmp_path / name), comparable_checkpoint(reference_dir / case / name), name)
    predictions = _files(tmp_path, "predictions/*.pt")
    assert predictions == _files(reference_dir / case, "predictions/*.pt")
    for name in predictions:
        assert_same(torch.load(tmp_path / name), torch.load(reference_dir / case / name), name)
    max_epochs = {"early_stopping": 8, "configure_callbacks": 6, "min_epochs": 6, "min_steps": 6}
    if case in max_epochs:
        assert ours["current_epoch"] < max_epochs[case], "EarlyStopping on the controller stopped the workers early"
    if case == "hooks":
        trace, reference_trace = (
            json.loads((path / "trace.json").read_text()) for path in (tmp_path, reference_dir / case)
        )
        assert trace == reference_trace
