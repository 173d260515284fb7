"""``lightning_monarch.namespaces``: a package's copy for ``pytorch_lightning``, made on import from
its one source (the real finder on ``sys.meta_path``, on a package written here)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytorch_lightning

from lightning_monarch import namespaces

SOURCES = {
    "__init__.py": "",
    "plain.py": "VALUE = object()\n",
    "uses.py": '''
        """See lightning.pytorch.callbacks.ModelCheckpoint and namespaced.plain."""
        import lightning
        import lightning as L
        import lightning.pytorch as lp
        from lightning.fabric.utilities.exceptions import MisconfigurationException
        from lightning.pytorch.callbacks import ModelCheckpoint

        import namespaced
        import namespaced.plain
        from namespaced import helper, plain

        CLASS_PATH = "lightning.pytorch.callbacks.ModelCheckpoint"
        MODULES = ["namespaced.helper", "namespaced.plain.VALUE", "namespaced"]
        MESSAGE = f"namespaced: {len(MODULES)} modules"
        CHAIN = namespaced.plain.VALUE
        FROM_HELPER = helper.TRAINER
        VERSION = lightning.__version__
        LINE = __import__("inspect").currentframe().f_lineno
    ''',
    "helper.py": "from lightning.pytorch import Trainer as TRAINER\n",
    "bare.py": "import lightning.pytorch\n",
}


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "namespaced"
    directory.mkdir()
    for name, source in SOURCES.items():
        (directory / name).write_text(textwrap.dedent(source).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    namespaces.mirror("namespaced", directory)
    yield directory
    for name in [name for name in sys.modules if name.split(".")[0] == "namespaced"]:
        del sys.modules[name]
    del namespaces.FINDER.roots["namespaced"]
    namespaces.FINDER.__dict__.pop("graph", None)  # the import graph of the suite's own roots, built anew


def test_imports_strings_and_chains_are_rewritten_and_lines_kept(package: Path) -> None:
    uses = importlib.import_module("namespaced.pl.uses")
    original = importlib.import_module("namespaced.uses")
    assert uses.L is uses.lightning is uses.lp is pytorch_lightning
    assert uses.ModelCheckpoint is pytorch_lightning.callbacks.ModelCheckpoint
    assert uses.MisconfigurationException.__module__ == "lightning_fabric.utilities.exceptions"
    assert uses.FROM_HELPER is pytorch_lightning.Trainer
    assert uses.helper.__name__ == "namespaced.pl.helper"
    assert uses.CLASS_PATH == "pytorch_lightning.callbacks.ModelCheckpoint"
    assert uses.MODULES == ["namespaced.pl.helper", "namespaced.plain.VALUE", "namespaced"]  # no dot, no rename
    assert uses.MESSAGE == "namespaced: 3 modules"  # a bare name in prose stays
    assert uses.__doc__ == "See pytorch_lightning.callbacks.ModelCheckpoint and namespaced.plain."
    assert uses.VERSION == pytorch_lightning.__version__
    assert uses.LINE == original.LINE and uses.__file__ == original.__file__ == str(package / "uses.py")
    assert original.L is not pytorch_lightning and original.CLASS_PATH.startswith("lightning.pytorch")


def test_a_module_without_lightning_is_shared(package: Path) -> None:
    uses = importlib.import_module("namespaced.pl.uses")
    plain = importlib.import_module("namespaced.plain")
    assert uses.plain is plain and uses.CHAIN is plain.VALUE
    assert importlib.import_module("namespaced.pl.plain") is plain
    assert plain.__spec__.name == "namespaced.plain"


def test_an_import_that_cannot_be_renamed_is_refused_with_the_fix(package: Path) -> None:
    with pytest.raises(ImportError, match=r"bare\.py:1: `import lightning\.pytorch` binds `lightning`.*write"):
        importlib.import_module("namespaced.pl.bare")


def test_a_module_that_is_not_there_is_not_found(package: Path) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("namespaced.pl.missing")
