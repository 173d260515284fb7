"""The real-client tier: each library of ``tests.clients.CLIENTS`` trains as its docs show under
Lightning's ``ddp`` (a subprocess of 2 CPU ranks) and under ``monarch`` (the warm mesh of this
process), and the two give the same weights, metrics, checkpoints and results, bit for bit.

The libraries come with the ``clients`` extra, which the README's test command installs.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from tests.clients import CLIENTS
from tests.conftest import run_reference
from tests.test_parity import assert_same

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("name", list(CLIENTS))
def test_a_client_library_trains_as_under_ddp(name: str, tmp_path: Path) -> None:
    reference_dir = tmp_path / "ddp"
    run_reference("tests.clients.reference", name, reference_dir)
    reference = torch.load(reference_dir / "results.pt", weights_only=False)
    ours = importlib.import_module(f"tests.clients.{name}").train("monarch", tmp_path / "monarch")
    assert ours is not None
    assert_same(ours, reference, name)
