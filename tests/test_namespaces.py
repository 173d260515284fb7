"""``lightning_monarch.namespaces``: a package's copy for ``pytorch_lightning``, made on import from
its one source (the real finder on ``sys.meta_path``, on a package written here)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

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
    namespaces.FINDER.reset()  # the import graph of the suite's own roots, built anew


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


def _import_anew(name: str) -> ModuleType:
    """``name`` imported as a new process would: no module of the package loaded, the graph not built."""
    for loaded in [loaded for loaded in sys.modules if loaded.split(".")[0] == "namespaced"]:
        del sys.modules[loaded]
    namespaces.FINDER.reset()
    return importlib.import_module(name)


@pytest.fixture
def writes_bytecode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's default, which a shell with ``PYTHONDONTWRITEBYTECODE`` set (this machine's) turns off."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)


@pytest.mark.usefixtures("writes_bytecode")
def test_the_second_import_takes_the_compiled_code_from_the_cache(
    package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled = importlib.import_module("namespaced.pl.uses")
    cache = namespaces.FINDER.cache
    assert cache.entry(package / "uses.py").name == f"uses.{sys.implementation.cache_tag}.pl.pyc"
    assert cache.entry(package / "uses.py").exists() and cache.graph_entry.exists()

    def no_rewrite(*args: object) -> None:
        raise AssertionError("the module was rewritten again")

    monkeypatch.setattr(namespaces.NamespaceRewriter, "visit", no_rewrite)
    monkeypatch.setattr(namespaces.ImportGraph, "build", no_rewrite)
    cached = _import_anew("namespaced.pl.uses")
    assert cached is not compiled and cached.CLASS_PATH == "pytorch_lightning.callbacks.ModelCheckpoint"
    assert cached.ModelCheckpoint is pytorch_lightning.callbacks.ModelCheckpoint and cached.LINE == compiled.LINE


@pytest.mark.usefixtures("writes_bytecode")
def test_a_changed_file_is_compiled_again(package: Path) -> None:
    importlib.import_module("namespaced.pl.uses")
    with (package / "plain.py").open("a") as plain:  # any file of the package: the graph may change
        plain.write("import lightning\n")
    with (package / "uses.py").open("a") as uses:
        uses.write("CHANGED = lightning.__name__\n")
    uses = _import_anew("namespaced.pl.uses")
    assert uses.CHANGED == "pytorch_lightning"
    assert uses.plain is not importlib.import_module("namespaced.plain")  # plain imports Lightning now: mirrored


@pytest.mark.parametrize("unwritable", ["dont_write_bytecode", "cache directory is a file"])
def test_without_a_writable_cache_each_import_compiles(
    unwritable: str, package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", unwritable == "dont_write_bytecode")
    if unwritable != "dont_write_bytecode":
        (package / "__pycache__").write_text("")
    assert importlib.import_module("namespaced.pl.uses").CLASS_PATH == "pytorch_lightning.callbacks.ModelCheckpoint"
    assert not namespaces.FINDER.cache.entry(package / "uses.py").exists()
    assert _import_anew("namespaced.pl.uses").CLASS_PATH == "pytorch_lightning.callbacks.ModelCheckpoint"
