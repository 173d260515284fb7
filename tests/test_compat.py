"""The doors to private APIs (``lightning_monarch/_compat/``): every private name they list still
exists in the installed Lightning, Monarch, torch and Python, and no module outside them uses one:
neither a private module, class or function of those libraries nor a private attribute of their
objects (a private attribute that the package does not define itself).

An upgrade that removes or renames a private name fails here, naming it, rather than deep inside a
run. Objects are real: a Trainer after a short fit, a ModelCheckpoint, a checkpoint wrapper, a
Monarch proc mesh on this host and a SlurmJob as its constructor leaves it.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import operator
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch._compat import monarch as monarch_compat
from lightning_monarch._compat import python as python_compat
from lightning_monarch._compat import torch as torch_compat
from tests.conftest import ROOT
from tests.models import Classifier

PACKAGE = ROOT / "lightning_monarch"
#: The libraries whose private names belong behind a door.
GUARDED = ("lightning", "lightning_fabric", "torch", "monarch", "asyncio")


def _missing(objects: dict[str, Any], private_names: dict[str, tuple[str, ...]]) -> list[str]:
    """The listed names that ``objects[where]`` lacks, as ``where.name``."""
    return [
        f"{where}.{name}"
        for where, names in private_names.items()
        for name in names
        if not hasattr(objects[where], name)
    ]


def test_every_private_lightning_name_exists(tmp_path: Path) -> None:
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        limit_val_batches=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(Classifier())
    objects: dict[str, Any] = {
        "model_checkpoint": ModelCheckpoint(),
        "early_stopping": EarlyStopping(monitor="val_loss"),
        "trainer": trainer,
    }
    for where in lightning_compat.PRIVATE_NAMES.keys() - objects.keys():
        objects[where] = operator.attrgetter(where.removeprefix("trainer."))(trainer)
    assert not _missing(objects, lightning_compat.PRIVATE_NAMES), f"checked with {lightning_compat.CHECKED_WITH}"


def test_every_private_torch_and_python_name_exists() -> None:
    wrapped = torch_compat.checkpoint_wrapper(nn.Linear(2, 2))
    assert isinstance(wrapped, torch_compat.CheckpointWrapper)
    assert isinstance(torch_compat.wrapped_module(wrapped), nn.Linear)
    objects = {
        "torch.cuda": torch.cuda,
        "CheckpointWrapper": wrapped,
        "asyncio": asyncio,
        "torch.distributed.distributed_c10d": torch.distributed.distributed_c10d,
    }
    assert not _missing(objects, torch_compat.PRIVATE_NAMES), f"checked with {torch_compat.CHECKED_WITH}"
    assert not _missing(objects, python_compat.PRIVATE_NAMES), f"checked with {python_compat.CHECKED_WITH}"


def test_every_private_monarch_name_exists() -> None:
    from monarch.actor import this_host
    from monarch.job import ProcessJob, SlurmJob

    assert issubclass(monarch_compat.SupervisionError, Exception)
    # worker.breakpoints' pdb and the endpoints it calls (controller.mesh.debugger relays them)
    assert {"post_mortem", "end_debug_session", "lookupmodule"} <= set(dir(monarch_compat.PdbWrapper))
    assert [field.name for field in dataclasses.fields(monarch_compat.DebuggerWrite)] == [
        "payload",
        "function",
        "lineno",
    ]
    with monarch_compat.sync_calls():
        pass
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        objects = {
            "SlurmJob": SlurmJob(meshes={"workers": 1}),
            "ProcessJob": ProcessJob({"hosts": 1}),
            "ProcMesh": procs,
        }
        assert not _missing(objects, monarch_compat.PRIVATE_NAMES), f"checked with {monarch_compat.CHECKED_WITH}"
        assert monarch_compat.runtime_exit_handler() is not None  # what controller.interpreter_exit runs
        assert monarch_compat.ACTOR_THREADS[0] in {thread.name for thread in threading.enumerate()}
    finally:
        procs.stop().get(timeout=60)


def _private_uses(source: str, where: str) -> list[str]:
    """Private names of the guarded libraries that ``source`` (of the file ``where``) imports or
    reads: ``from torch.utils._pytree import ...``, ``from lightning... import _Loop``,
    ``torch.cuda._raw_device_count_nvml``."""
    tree = ast.parse(source)
    modules = {
        alias.asname or alias.name.split(".")[0]: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names]
            module = node.module if isinstance(node, ast.ImportFrom) else names[0]
            if not module or module.split(".")[0] not in GUARDED:
                continue
            private = [part for part in module.split(".") if part.startswith("_")]
            if isinstance(node, ast.ImportFrom):
                private += [name for name in names if name.startswith("_") and not name.startswith("__")]
            uses += [f"{where}:{node.lineno} {module}: {name}" for name in private]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and modules.get(root.id, "").split(".")[0] in GUARDED:
                uses.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return uses


def test_no_private_name_of_a_guarded_library_outside_the_doors() -> None:
    uses = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_compat" not in path.parts
        for use in _private_uses(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not uses, "private names outside lightning_monarch/_compat/:\n" + "\n".join(uses)


def _our_names(sources: list[str]) -> set[str]:
    """Every name the package defines itself: functions, classes, variables, arguments, imports,
    and attributes it sets on ``self``/``cls`` (or marks with its own ``_lightning_monarch`` prefix)."""
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if node.attr.startswith("_lightning_monarch") or (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                ):
                    names.add(node.attr)
    return names


def _foreign_private_attributes(source: str, where: str, ours: set[str]) -> list[str]:
    """``obj._name`` in ``source`` where ``_name`` is no name of the package's own: a private
    attribute of another library's object (``trainer._logger_connector``)."""
    return [
        f"{where}:{node.lineno} {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in ours
    ]


def test_no_private_attribute_of_another_librarys_object_outside_the_doors() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    ours = _our_names([path.read_text() for path in paths])
    uses = [
        use
        for path in paths
        if "_compat" not in path.parts
        for use in _foreign_private_attributes(path.read_text(), str(path.relative_to(ROOT)), ours)
    ]
    assert not uses, "private attributes of Lightning's, torch's or Monarch's objects outside _compat/:\n" + "\n".join(
        uses
    )


def test_the_attribute_scan_finds_a_foreign_private_attribute() -> None:
    source = "class A:\n    def f(self, trainer):\n        self._mine = 1\n        return trainer._logger_connector, self._mine\n"
    assert _foreign_private_attributes(source, "probe.py", _our_names([source])) == [
        "probe.py:4 trainer._logger_connector"
    ]


@pytest.mark.parametrize(
    "line, found",
    [
        ("from torch.utils._pytree import tree_map", True),
        ("from lightning.pytorch.loops.loop import _Loop", True),
        ("import torch\ntorch.cuda._raw_device_count_nvml()", True),
        ("import asyncio\nasyncio._set_running_loop(None)", True),
        ("from torch.utils.data import DataLoader\nself._loader = None", False),
    ],
)
def test_the_scan_finds_private_uses(line: str, found: bool) -> None:
    assert bool(_private_uses(line, "probe.py")) is found
