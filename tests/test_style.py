"""Style and types, checked by the test suite so that CI fails on a new violation: ``ruff``
(lint and format) over the repository's Python, ``mypy`` over the package (both configured in
``pyproject.toml``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check"],
        ["ruff", "format", "--check"],
        ["mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_the_code_passes(command: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"`{' '.join(command)}` found:\n{result.stdout}{result.stderr}"
