"""Parity: the same seeded runs under Lightning's ``ddp`` and under ``monarch`` give the same results.

Weights, metrics, logged CSV rows, checkpoints and the module's hook order are compared for
equality: both run the same DDP arithmetic on CPU with gloo, so they must agree bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_ddp_reference
from tests.parity_cases import CASES, comparable_checkpoint, run_case

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_ddp_reference(tmp_path_factory.mktemp("ddp"), list(CASES))


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
        for index, (mine, theirs) in enumerate(zip(ours, reference)):
            assert_same(mine, theirs, f"{where}[{index}]")
    else:
        assert ours == reference, f"{where}: {ours!r} != {reference!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_same_results_as_ddp(case: str, ddp_results: Path, tmp_path: Path) -> None:
    ours = run_case(case, "monarch", tmp_path)
    reference = torch.load(ddp_results / case / "results.pt", weights_only=False)
    assert ours is not None
    assert_same(ours, reference, case)
    written = _files(tmp_path, "**/*.ckpt")
    assert written == _files(ddp_results / case, "**/*.ckpt")
    for name in written:
        assert_same(comparable_checkpoint(tmp_path / name), comparable_checkpoint(ddp_results / case / name), name)
    predictions = _files(tmp_path, "predictions/*.pt")
    assert predictions == _files(ddp_results / case, "predictions/*.pt")
    for name in predictions:
        assert_same(torch.load(tmp_path / name), torch.load(ddp_results / case / name), name)
    max_epochs = {"early_stopping": 8, "configure_callbacks": 6, "min_epochs": 6, "min_steps": 6}
    if case in max_epochs:
        assert ours["current_epoch"] < max_epochs[case], "EarlyStopping on the controller stopped the workers early"
    if case == "hooks":
        trace, reference_trace = (json.loads((path / "trace.json").read_text()) for path in (tmp_path, ddp_results / case))
        assert trace == reference_trace
