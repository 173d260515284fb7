"""The real-client tier: each library of ``tests.clients.CLIENTS`` trains as its docs show under
Lightning's ``ddp`` (one subprocess of 2 CPU ranks for the whole tier) and under ``monarch`` (the warm mesh of this
process), and the two give the same weights, metrics, checkpoints and results, bit for bit.

The libraries come with the ``clients`` extra, which the README's test command installs.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.clients import CLIENTS
from tests.references import run_reference
from tests.test_parity import assert_same

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def client_modules() -> dict[str, ModuleType]:
    """Every library of the tier, imported here once before anything starts, as a user's script
    imports its libraries first: several set environment variables when imported (OpenMP's, RDKit's,
    CUDA's), and a fork server that saw the environment without them would be replaced, at the cost
    of importing torch and Lightning again, by the first ``fit`` after each import."""
    for _, package, _, _ in CLIENTS.values():
        importlib.import_module(package)
    return {name: importlib.import_module(f"tests.clients.{name}") for name in CLIENTS}


@pytest.fixture(scope="module")
def ddp_results(client_modules: dict[str, ModuleType], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every library of the tier under ``ddp``, in one launch of 2 ranks (``tests.clients.reference``)."""
    out_dir = tmp_path_factory.mktemp("clients-ddp")
    run_reference("tests.clients.reference", out_dir, *CLIENTS, processes=2, timeout=900)
    return out_dir


@pytest.mark.parametrize("name", list(CLIENTS))
def test_a_client_library_trains_as_under_ddp(
    name: str, client_modules: dict[str, ModuleType], ddp_results: Path, tmp_path: Path
) -> None:
    reference = torch.load(ddp_results / name / "results.pt", weights_only=False)
    ours = client_modules[name].train("monarch", tmp_path / "monarch")
    assert ours is not None
    assert_same(ours, reference, name)
