"""The documentation site builds, so that it cannot rot.

``mkdocs build --strict`` turns every warning into a failure, and ``mkdocs.yml`` makes warnings of
everything that rots: a link to a missing page or anchor, a page in ``docs/`` that is not in the
nav, an included file (``--8<--``) that is gone, and an API reference entry (``::: name``) whose
object no longer exists. Runs in a subprocess, as a user's ``python -m mkdocs build`` does.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _page_check():
    """``docs/check_pages.py``, the browser check of the README's development section, as a module."""
    spec = importlib.util.spec_from_file_location("check_pages", ROOT / "docs" / "check_pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


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
    pages = "".join(page.read_text() for page in site.rglob("*.html"))
    # every plot but that of `python -m benchmarks.run --quick`, a trial that no page quotes
    for plot in sorted(set((ROOT / "benchmarks" / "results").glob("*.png")) - {ROOT / "benchmarks/results/quick.png"}):
        assert f'src="../results/{plot.name}"' in pages, f"no page shows the benchmark plot {plot.name}"
        assert (site / "results" / plot.name).read_bytes() == plot.read_bytes()


def test_the_page_check_finds_a_link_to_no_page_or_no_heading(tmp_path: Path) -> None:
    check = _page_check()
    (tmp_path / "index.html").write_text('<h1 id="top">lightning_monarch</h1>')
    (tmp_path / "faq").mkdir()
    (tmp_path / "faq" / "index.html").write_text('<h2 id="why">why</h2>')
    with check.served(tmp_path) as origin:
        links = check.SiteLinks(origin)
        assert links.problem(f"{origin}faq/#why") is None
        assert links.problem(f"{origin}#top") is None
        assert links.problem(f"{origin}faq/#how") == "broken link: faq/#how names no heading of that page"
        assert links.problem(f"{origin}gone/") == "broken link: gone/ is no page of the site"
