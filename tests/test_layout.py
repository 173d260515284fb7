"""Which code runs where, and the shape of the package.

At import time: a worker process imports the shared modules and ``worker/`` only, and the
controller's install step (strategy registry, accelerator routing, Monarch's fault hook) runs in
the controller alone (``controller/install.py``). Real processes: a fit on two Monarch workers,
then a probe actor in the same worker processes reports their ``sys.modules`` and the state the
install step would have changed. ``tests/test_pytorch_lightning.py`` runs the same test in
``pytorch_lightning``'s namespace.

In the source: imports run one way, from the strategies to the controller (no controller module
imports a strategy, even for types, or writes a strategy's attributes: the strategies hand down
their settings and record the outcomes that come back; no worker module imports the controller or
a strategy, and no two modules import each other at run time), the rooms of ``controller/`` are
floors that import only down, and no module is over 500 lines, no class over 400.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning as L
import pytest

import lightning_monarch
from lightning_monarch import stop_meshes
from tests.conftest import probe_warm_workers
from tests.models import Classifier
from tests.worker_probe import LIGHTNING_PACKAGE, side_effects


def test_workers_import_no_controller_module_and_install_nothing(tmp_path: Path) -> None:
    # on new workers: those of earlier tests unpickled test modules that import controller modules
    stop_meshes()
    trainer = L.Trainer(
        strategy="monarch",
        devices=2,
        max_steps=2,
        limit_val_batches=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
    )
    trainer.fit(Classifier())
    reports = probe_warm_workers("side_effects")
    assert len(reports) == 2
    for report in reports:
        assert "lightning_monarch.worker.actor" in report["modules"]
        assert "lightning_monarch.worker.stage" in report["modules"]
        assert report["controller_modules"] == []
        assert not report["registered"]
        assert not report["fault_hook"].startswith("lightning_monarch")
        assert not report["accelerator_routed"]
        assert report["lightning_packages"] == [LIGHTNING_PACKAGE]  # the other namespace is not imported
    # the same probe, in this process, finds everything the controller's install step does
    here = side_effects()
    assert "lightning_monarch.controller.install" in here["controller_modules"]
    assert here["registered"]
    assert here["fault_hook"].startswith("lightning_monarch")  # either namespace's: the last installed
    assert here["fault_hook"].endswith(".controller.install")
    assert here["accelerator_routed"]


PACKAGE = Path(lightning_monarch.__file__).parent
#: The modules of the strategies, and the names the package exports them by.
STRATEGY_MODULES = frozenset(
    {"lightning_monarch.strategy", "lightning_monarch.fsdp", "lightning_monarch.model_parallel"}
)
STRATEGY_NAMES = frozenset({"MonarchStrategy", "MonarchFSDPStrategy", "MonarchModelParallelStrategy"})
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 400


def _modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def run_time_imports(source: str, for_types: bool = False) -> list[tuple[int, str]]:
    """The modules (and ``lightning_monarch.<Name>`` names) that ``source`` imports or reads at run
    time, at module level or inside a function, with their line; imports under
    ``if TYPE_CHECKING:`` are for types only, and left out unless ``for_types``."""
    tree = ast.parse(source)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if not for_types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "lightning_monarch"
        ):
            found.append((node.lineno, f"lightning_monarch.{node.attr}"))
    return found


def strategy_imports(source: str) -> list[tuple[int, str]]:
    """The imports of ``source`` that reach a strategy's module, those for types included."""
    return [
        (line, name)
        for line, name in run_time_imports(source, for_types=True)
        if name in STRATEGY_MODULES or name in {f"lightning_monarch.{strategy}" for strategy in STRATEGY_NAMES}
    ]


def test_no_controller_module_imports_a_strategy() -> None:
    # the strategies hand the controller's modules their settings (controller/settings.py)
    found = {str(path.relative_to(PACKAGE)): strategy_imports(path.read_text()) for path in _modules("controller")}
    assert {module: imports for module, imports in found.items() if imports} == {}


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    from lightning_monarch.strategy import MonarchStrategy\n",
        "from lightning_monarch import MonarchFSDPStrategy\n",
        "import lightning_monarch.model_parallel\n",
        "import lightning_monarch\n\ndef f():\n    return lightning_monarch.MonarchStrategy\n",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from lightning_monarch.strategy import MonarchStrategy\n",
    ],
)
def test_the_direction_check_finds_an_import_of_a_strategy(source: str) -> None:
    assert strategy_imports(source)


#: Attributes of a strategy that controller modules may set: Lightning's own, which its loop sets
#: on any strategy (``Strategy.setup_optimizers``), set on the controller as Lightning would.
LIGHTNINGS_STRATEGY_ATTRIBUTES = frozenset({"optimizers", "lr_scheduler_configs"})


def strategy_writes(source: str) -> list[tuple[int, str]]:
    """The assignments of ``source`` to an attribute of something named a strategy (``strategy.x``,
    ``self._strategy.x``, ``trainer.strategy.x``, ``setattr(strategy, ...)``), with their line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
            if ast.unparse(node.args[0]).endswith("strategy"):
                found.append((node.lineno, ast.unparse(node)))
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and ast.unparse(target.value).endswith("strategy")
                and target.attr not in LIGHTNINGS_STRATEGY_ATTRIBUTES
            ):
                found.append((node.lineno, ast.unparse(target)))
    return found


def test_no_controller_module_writes_a_strategys_attributes() -> None:
    # what the launcher and the features produce goes back as a StageOutcome, which the strategy records
    found = {str(path.relative_to(PACKAGE)): strategy_writes(path.read_text()) for path in _modules("controller")}
    assert {module: writes for module, writes in found.items() if writes} == {}


@pytest.mark.parametrize(
    "source",
    [
        "strategy.num_nodes = 2\n",
        "def f(self):\n    self._strategy.world_changes += 1\n",
        "trainer.strategy._host_mesh: object = None\n",
        "setattr(self._strategy, 'restarts', 1)\n",
    ],
)
def test_the_write_check_finds_a_strategys_attribute_set(source: str) -> None:
    assert strategy_writes(source)


#: The rooms of ``controller/`` as floors, top first: a module imports its own floor and those below.
FLOORS = ("launch", "loop", "features", "mesh")


def upward_imports(floor: str, source: str) -> list[tuple[int, str]]:
    """The imports of ``source``, a module on ``floor``, that reach a floor above it, those for
    types included."""
    above = [f"lightning_monarch.controller.{upper}" for upper in FLOORS[: FLOORS.index(floor)]]
    return [
        (line, name)
        for line, name in run_time_imports(source, for_types=True)
        if any(name == room or name.startswith(f"{room}.") for room in above)
    ]


def test_the_controllers_floors_import_only_down() -> None:
    found = {
        str(path.relative_to(PACKAGE)): upward_imports(floor, path.read_text())
        for floor in FLOORS
        for path in _modules(f"controller/{floor}")
    }
    assert {module: imports for module, imports in found.items() if imports} == {}


@pytest.mark.parametrize(
    ("floor", "source"),
    [
        ("mesh", "from lightning_monarch.controller.loop.checkpoints import SnapshotDirectory\n"),
        ("features", "from lightning_monarch.controller.launch import arguments\n"),
        ("loop", "def f():\n    import lightning_monarch.controller.launch.launcher\n"),
        (
            "mesh",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_monarch.controller.features import elastic\n",
        ),
    ],
)
def test_the_floor_check_finds_an_import_from_above(floor: str, source: str) -> None:
    assert upward_imports(floor, source)


def test_the_floor_check_leaves_imports_from_below_alone() -> None:
    assert not upward_imports(
        "loop",
        "from lightning_monarch.controller.mesh import channel\nfrom lightning_monarch.controller.features import stats\n",
    )


def test_no_worker_module_imports_the_controller_or_a_strategy() -> None:
    found = {
        str(path.relative_to(PACKAGE)): [
            (line, name)
            for line, name in run_time_imports(path.read_text())
            if name.startswith("lightning_monarch.controller") or (line, name) in strategy_imports(path.read_text())
        ]
        for path in _modules("worker")
    }
    assert {module: imports for module, imports in found.items() if imports} == {}


def import_cycles(sources: dict[str, str]) -> list[list[str]]:
    """The cycles among modules (name to source) that import each other at run time."""
    graph = {}
    for name, source in sources.items():
        imported = set()
        for _, target in run_time_imports(source):
            while target and target not in sources:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(f"{target}."):  # a package's own modules
                imported.add(target)
        graph[name] = imported
    cycles, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append(path[path.index(name) :])
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    return cycles


def test_no_two_modules_import_each_other_at_run_time() -> None:
    sources = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        sources[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    assert import_cycles(sources) == []
    circle = {"a": "import b\n", "b": "def f():\n    from c import x\n", "c": "import a\n"}
    assert import_cycles(circle) == [["a", "b", "c"]]  # the check finds one through a function's import


def documented_modules(architecture: str) -> set[str]:
    """The modules that the file tree of ``docs/architecture.md`` lists, as paths from the package's
    parent (``lightning_monarch/wire/codec.py``): each line names a folder (``name/``) or a module
    under the folder two spaces less indented above it."""
    tree = architecture.split("## The file tree", 1)[1].split("```", 2)[1]
    listed: set[str] = set()
    path: list[str] = []
    for line in tree.splitlines():
        name = line.strip().split(" ", 1)[0]
        if name.endswith(("/", ".py")):
            path = [*path[: (len(line) - len(line.lstrip())) // 2], name.rstrip("/")]
            if name.endswith(".py"):
                listed.add("/".join(path))
    return listed


def test_the_docs_file_tree_lists_every_module_and_no_other() -> None:
    package = {
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.parent == PACKAGE
    }
    listed = documented_modules((PACKAGE.parent / "docs" / "architecture.md").read_text())
    assert (sorted(package - listed), sorted(listed - package)) == ([], [])


def test_the_tree_reader_follows_the_indentation() -> None:
    page = "## The file tree\n\n```\npkg/\n  a.py   one\n  sub/   two\n    b.py  three\n  c.py\n```\n"
    assert documented_modules(page) == {"pkg/a.py", "pkg/sub/b.py", "pkg/c.py"}


def test_no_module_over_500_lines_and_no_class_over_400() -> None:
    modules, classes = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = str(path.relative_to(PACKAGE))
        if source.count("\n") > MAX_MODULE_LINES:
            modules[name] = source.count("\n")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    classes[f"{name}:{node.name}"] = lines
    assert (modules, classes) == ({}, {})
