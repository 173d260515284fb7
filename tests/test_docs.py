"""The documentation site builds, so that it cannot rot.

``mkdocs build --strict`` turns every warning into a failure, and ``mkdocs.yml`` makes warnings of
everything that rots: a link to a missing page or anchor, a page in ``docs/`` that is not in the
nav, an included file (``--8<--``) that is gone, and an API reference entry (``::: name``) whose
object no longer exists. Runs in a subprocess, as a user's ``python -m mkdocs build`` does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_the_docs_site_builds_strict_with_the_api_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (site / "api" / "index.html").read_text()
    for name in (
        "lightning_monarch.MonarchStrategy",
        "lightning_monarch.MonarchModelParallelStrategy",
        "lightning_monarch.MonarchFSDPStrategy",
        "lightning_monarch.errors.WorkerError",
        "lightning_monarch.errors.PreflightError",
    ):
        assert f'id="{name}"' in api, f"{name} is missing from the rendered API reference"
