"""Lightning's two namespaces, ``lightning.pytorch`` and ``pytorch_lightning``, from one source.

Runs in every process that imports lightning_monarch: the controller and each worker.

Lightning is published under two names at the same version: ``lightning.pytorch`` (with
``lightning.fabric``) and ``pytorch_lightning`` (with ``lightning_fabric``). Lightning makes the
second from the sources of the first by rewriting their imports; the classes are distinct, and each
namespace has its own ``StrategyRegistry``, ``Trainer``, callbacks and ``LightningCLI``. This package
is written once, against ``lightning.pytorch``. ``lightning_monarch.pl`` is the same source, for
``pytorch_lightning``: when one of its modules is imported, :class:`MirrorFinder` reads the
``lightning_monarch`` module's file and compiles it with :class:`NamespaceRewriter`, which renames
``lightning.pytorch`` to ``pytorch_lightning``, ``lightning.fabric`` to ``lightning_fabric``, and
``lightning_monarch.X`` to ``lightning_monarch.pl.X``. No source is copied; the compiled code is kept
beside the package's bytecode (:class:`MirrorCache`). Line numbers and file names stay those of the
one source, so tracebacks point at it.

A module that imports no part of Lightning, itself or through another module of the package (the
errors, the codec, the doors to Monarch, torch and Python), is not mirrored: both namespaces
share it, so ``lightning_monarch.pl.WorkerError is lightning_monarch.WorkerError``.

Other packages that hold Lightning code of their own may be mirrored the same way
(:func:`mirror`): the test suite runs its models and runs in both namespaces so.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import marshal
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, Optional

#: The name of a mirrored package's copy for ``pytorch_lightning``, under the package.
SUFFIX = "pl"
#: The top-level packages of Lightning's two namespaces.
_LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")


@dataclass(frozen=True)
class Namespace:
    """One of Lightning's namespaces, and where this package's code for it lives."""

    #: The Trainer's package: ``lightning.pytorch`` or ``pytorch_lightning``.
    pytorch: str
    #: Fabric's package in the same namespace.
    fabric: str
    #: This package's modules for it.
    package: str


LIGHTNING = Namespace("lightning.pytorch", "lightning.fabric", "lightning_monarch")
PYTORCH_LIGHTNING = Namespace("pytorch_lightning", "lightning_fabric", f"lightning_monarch.{SUFFIX}")


def namespace_of(module: str) -> Namespace:
    """The namespace whose code module ``module`` (a ``__name__``) is."""
    return PYTORCH_LIGHTNING if _mirror_of(module) is not None else LIGHTNING


def namespace_of_class(cls: type) -> Optional[Namespace]:
    """The namespace whose Lightning classes ``cls`` derives from, if any."""
    for base in cls.__mro__:
        top = base.__module__.split(".")[0]
        if top in _LIGHTNING_PACKAGES:
            return LIGHTNING if top == "lightning" else PYTORCH_LIGHTNING
    return None


def refuse_other_namespace(name: str, given: Any, home: str) -> None:
    """Raise a ``TypeError`` naming both namespaces when ``given`` (an object or a class) is of
    the other namespace than ``home`` (the ``__name__`` of the module whose public ``name`` it
    was given to): ``lightning_monarch.rehearse`` given a ``pytorch_lightning.Trainer``."""
    kind = given if isinstance(given, type) else type(given)
    ours, theirs = namespace_of(home), namespace_of_class(kind)
    if theirs is not None and theirs != ours:
        raise TypeError(
            f"`{ours.package}.{name}` is for `{ours.pytorch}`, and was given {kind.__module__}.{kind.__qualname__},"
            f" of `{theirs.pytorch}`: each of Lightning's namespaces has its own classes. Use"
            f" `{theirs.package}.{name}` with `{theirs.pytorch}`."
        )


def counterpart(module: str) -> str:
    """The name of ``module`` in the other namespace: ``lightning_monarch.pl.X`` for
    ``lightning_monarch.X``, and the reverse."""
    root = _mirror_of(module)
    if root is not None:
        return root + module[len(root) + len(SUFFIX) + 1 :]
    top, _, rest = module.partition(".")
    return f"{top}.{SUFFIX}" + (f".{rest}" if rest else "")


def _mirror_of(module: str) -> Optional[str]:
    """The root ``R`` if ``module`` is ``R.pl`` or under it, else ``None``."""
    parts = module.split(".")
    return parts[0] if len(parts) > 1 and parts[1] == SUFFIX else None


def _rename_lightning(module: str) -> str:
    """A Lightning module's name in ``pytorch_lightning``'s namespace (as Lightning's own
    rewrite names it); other names unchanged."""
    for old, new in ((LIGHTNING.pytorch, PYTORCH_LIGHTNING.pytorch), (LIGHTNING.fabric, PYTORCH_LIGHTNING.fabric)):
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    return PYTORCH_LIGHTNING.pytorch if module == "lightning" else module


def source_files(roots: dict[str, Path]) -> Iterator[tuple[str, Path, Path]]:
    """Each Python file of the packages ``roots`` names, with its root and the root's directory,
    in one order: roots by name, files by path."""
    for root, directory in sorted(roots.items()):
        for path in sorted(directory.rglob("*.py")):
            yield root, directory, path


class ImportGraph:
    """Which modules of the mirrored packages need a copy: those that import Lightning, or a
    module that needs one. Built from the packages' files (:meth:`build`) once per process, or read
    from :class:`MirrorCache`."""

    def __init__(self, files: dict[str, Path], packages: set[str], mirrored: set[str]) -> None:
        #: Each module of the mirrored packages, and its file.
        self.files = files
        #: Those modules that are packages.
        self.packages = packages
        #: Those modules that need a copy.
        self.mirrored = mirrored

    @classmethod
    def build(cls, roots: dict[str, Path]) -> ImportGraph:
        """The graph of the packages ``roots`` names, from their files' imports."""
        files: dict[str, Path] = {}
        packages: set[str] = set()
        for root, directory, path in source_files(roots):
            parts = [root, *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
                packages.add(".".join(parts))
            files[".".join(parts)] = path
        imports = {name: set(cls._imports(path)) for name, path in files.items()}
        mirrored: set[str] = set()
        changed = True
        while changed:  # until no module is added: a module needs a copy if one it imports does
            before = len(mirrored)
            for name, needs in imports.items():
                if name not in mirrored and any(
                    need.split(".")[0] in _LIGHTNING_PACKAGES or need in mirrored for need in needs
                ):
                    mirrored.add(name)
            for package in packages:  # ``from package import module`` needs the package's copy
                if any(name.startswith(package + ".") for name in mirrored):
                    mirrored.add(package)
            changed = len(mirrored) != before
        return cls(files, packages, mirrored)

    def facts(self) -> tuple[dict[str, str], set[str], set[str]]:
        """The graph as :mod:`marshal` writes it; ``ImportGraph.from_facts`` reads it back."""
        return {name: str(path) for name, path in self.files.items()}, self.packages, self.mirrored

    @classmethod
    def from_facts(cls, facts: tuple[dict[str, str], set[str], set[str]]) -> ImportGraph:
        files, packages, mirrored = facts
        return cls({name: Path(path) for name, path in files.items()}, packages, mirrored)

    @staticmethod
    def _imports(path: Path) -> Iterable[str]:
        """The modules that the file at ``path`` imports, anywhere in it (in functions too)."""
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                yield node.module
                yield from (f"{node.module}.{alias.name}" for alias in node.names)

    def module_of(self, dotted: str) -> Optional[str]:
        """The longest leading part of ``dotted`` that is a module of the mirrored packages."""
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in self.files:
                return ".".join(parts[:end])
        return None

    def rename(self, dotted: str) -> str:
        """``dotted`` (a module, or a name in one) as ``pytorch_lightning``'s namespace names it."""
        module = self.module_of(dotted)
        if module is None:
            return _rename_lightning(dotted)
        if module not in self.mirrored or _mirror_of(dotted) is not None:
            return dotted
        root, _, rest = dotted.partition(".")
        return f"{root}.{SUFFIX}" + (f".{rest}" if rest else "")


#: Dotted names in strings and docstrings that may need renaming: a Lightning module, or a name
#: in a mirrored package (which :class:`NamespaceRewriter` fills in with its roots).
_LIGHTNING_NAMES = re.compile(r"\blightning\.(?:pytorch|fabric)\b(?:\.\w+)*")


class NamespaceRewriter(ast.NodeTransformer):
    """Rewrites one module's syntax tree for ``pytorch_lightning``'s namespace: its imports, the
    attribute chains through a mirrored package (``lightning_monarch.rehearse``), and the dotted
    names in its strings (``"lightning.pytorch.callbacks.ModelCheckpoint"``)."""

    def __init__(self, graph: ImportGraph, roots: Iterable[str], filename: str) -> None:
        self._graph = graph
        self._roots = frozenset(roots)
        self._filename = filename
        alternatives = "|".join(re.escape(root) for root in sorted(self._roots))
        self._names = re.compile(rf"{_LIGHTNING_NAMES.pattern}|\b(?:{alternatives})(?:\.\w+)+")

    def visit_Import(self, node: ast.Import) -> ast.Import:
        for alias in node.names:
            renamed = self._graph.rename(alias.name)
            if renamed.split(".")[0] != alias.name.split(".")[0] and alias.asname is None:
                if "." in alias.name:
                    raise ImportError(
                        f"{self._filename}:{node.lineno}: `import {alias.name}` binds `lightning`, which"
                        f" `pytorch_lightning`'s namespace has no counterpart of; write `import {alias.name} as"
                        f" <name>` or `from {alias.name} import ...`."
                    )
                alias.asname = alias.name
            alias.name = renamed
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> list[ast.ImportFrom]:
        if node.level or node.module is None:
            raise ImportError(
                f"{self._filename}:{node.lineno}: relative imports cannot be mirrored; import absolutely."
            )
        statements: list[ast.ImportFrom] = []
        for alias in node.names:  # a module of a mirrored package is imported from its own counterpart
            name = f"{node.module}.{alias.name}"
            is_module = self._graph.module_of(name) == name
            module = self._graph.rename(name).rpartition(".")[0] if is_module else self._graph.rename(node.module)
            if statements and statements[-1].module == module:
                statements[-1].names.append(alias)
            else:
                statements.append(ast.copy_location(ast.ImportFrom(module=module, names=[alias], level=0), node))
        return statements

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        chain = _dotted(node)
        if chain is None or chain.split(".")[0] not in self._roots:
            return self.generic_visit(node)
        renamed = self._graph.rename(chain)
        return _attribute_chain(renamed, node) if renamed != chain else node

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if isinstance(node.value, str):
            node.value = self._names.sub(lambda match: self._graph.rename(match.group(0)), node.value)
        return node


def _dotted(node: ast.AST) -> Optional[str]:
    """``a.b.c`` for an attribute chain on a plain name, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _attribute_chain(dotted: str, where: ast.Attribute) -> ast.AST:
    """The expression ``dotted`` (``a.b.c``), in the context and at the place of ``where``."""
    first, *rest = dotted.split(".")
    expression: ast.expr = ast.Name(id=first, ctx=ast.Load())
    for index, attr in enumerate(rest):
        last = index == len(rest) - 1
        expression = ast.Attribute(value=expression, attr=attr, ctx=where.ctx if last else ast.Load())
    return ast.fix_missing_locations(ast.copy_location(expression, where))


class _Shared(importlib.abc.Loader):
    """Loads a module that both namespaces share under its mirrored name too: the module object
    itself, with the ``__spec__`` it had (the import system sets the mirrored name's)."""

    def __init__(self, module: str) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._module)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


class MirrorCache:
    """The mirror's work kept between processes, as Python keeps bytecode: the import graph, and
    each mirrored module's code beside the module's own ``.pyc``
    (``__pycache__/strategy.cpython-311.pl.pyc``).

    Every entry starts with :attr:`key`, a digest of all that the rewrite reads: Python's magic
    number, this module's source, and the names and contents of every file of the mirrored
    packages. An entry with another key is not used; the caller compiles again and writes it anew.
    Entries are written atomically (a temporary file, renamed), and not at all where the directory
    cannot be written or ``sys.dont_write_bytecode`` is set: then each process compiles, as it
    would without a cache. Runs in every process that imports a mirrored module.
    """

    def __init__(self, roots: dict[str, Path]) -> None:
        digest = hashlib.sha256(importlib.util.MAGIC_NUMBER + Path(__file__).read_bytes())
        for root, _, path in source_files(roots):
            digest.update(f"\0{root}\0{path}\0".encode())
            digest.update(path.read_bytes())
        self.key = digest.digest()
        first = min(roots)
        #: Where the graph of these roots is kept: in the first root's ``__pycache__``.
        self.graph_entry = self.entry(roots[first] / "__init__.py").with_name(
            f"{SUFFIX}-graph.{'+'.join(sorted(roots))}.{sys.implementation.cache_tag}.marshal"
        )

    @staticmethod
    def entry(source: Path) -> Path:
        """Where the code compiled from ``source`` for the mirror is kept."""
        return Path(importlib.util.cache_from_source(str(source))).with_suffix(f".{SUFFIX}.pyc")

    def load(self, entry: Path) -> Any:
        """What ``entry`` holds if it was written under this :attr:`key`, else ``None``."""
        try:
            data = entry.read_bytes()
        except OSError:
            return None
        if not data.startswith(self.key):
            return None
        try:
            return marshal.loads(data[len(self.key) :])
        except (EOFError, ValueError, TypeError):
            return None

    def store(self, entry: Path, value: Any) -> None:
        """Write ``value`` (what :mod:`marshal` writes) to ``entry`` under this :attr:`key`."""
        if sys.dont_write_bytecode:
            return
        temporary = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        try:
            entry.parent.mkdir(exist_ok=True)
            temporary.write_bytes(self.key + marshal.dumps(value))
            os.replace(temporary, entry)
        except OSError:
            with contextlib.suppress(OSError):  # also when the directory is not one
                temporary.unlink()


class MirrorFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """On ``sys.meta_path``, first: finds ``R.pl`` and its modules for each mirrored package ``R``,
    and loads each from ``R``'s file, rewritten by :class:`NamespaceRewriter` (or from
    :class:`MirrorCache`)."""

    def __init__(self) -> None:
        self.roots: dict[str, Path] = {}

    @functools.cached_property
    def cache(self) -> MirrorCache:
        return MirrorCache(self.roots)

    @functools.cached_property
    def graph(self) -> ImportGraph:
        facts = self.cache.load(self.cache.graph_entry)
        if facts is not None:
            return ImportGraph.from_facts(facts)
        graph = ImportGraph.build(self.roots)
        self.cache.store(self.cache.graph_entry, graph.facts())
        return graph

    def reset(self) -> None:
        """Forget what was derived from :attr:`roots`, after they changed."""
        self.__dict__.pop("graph", None)
        self.__dict__.pop("cache", None)

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        root = _mirror_of(fullname)
        if root not in self.roots:
            return None
        original = counterpart(fullname)
        if original not in self.graph.files:
            return None
        if original not in self.graph.mirrored:
            return importlib.machinery.ModuleSpec(fullname, _Shared(original))
        is_package = original in self.graph.packages
        spec = importlib.machinery.ModuleSpec(
            fullname, self, origin=str(self.graph.files[original]), is_package=is_package
        )
        spec.has_location = True
        return spec

    def get_code(self, fullname: str) -> CodeType:
        """The module's code: its original file, rewritten (``python -m`` asks for it too)."""
        source = self.graph.files[counterpart(fullname)]
        entry = self.cache.entry(source)
        code = self.cache.load(entry)
        if isinstance(code, CodeType):
            return code
        filename = str(source)
        tree = ast.parse(source.read_bytes(), filename)
        tree = ast.fix_missing_locations(NamespaceRewriter(self.graph, self.roots, filename).visit(tree))
        code = compile(tree, filename, "exec", dont_inherit=True)
        self.cache.store(entry, code)
        return code

    def exec_module(self, module: ModuleType) -> None:
        exec(self.get_code(module.__name__), module.__dict__)


#: The process's one finder, first on ``sys.meta_path``.
FINDER = MirrorFinder()
sys.meta_path.insert(0, FINDER)


def mirror(root: str, directory: Path) -> None:
    """Make ``root.pl`` the ``pytorch_lightning`` namespace's copy of package ``root`` (whose
    files are in ``directory``). Call it before anything imports ``root.pl``; idempotent."""
    if FINDER.roots.get(root) != directory:
        FINDER.roots[root] = directory
        FINDER.reset()


def import_after(name: str, module: str) -> None:
    """Import ``module`` once ``name`` is imported: now, if it is; else right after the import of
    ``name`` ends, which then raises what importing ``module`` raises."""
    if name in sys.modules:
        importlib.import_module(module)
        return
    sys.meta_path.insert(0, _AfterImport(name, lambda: importlib.import_module(module)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader that the other finders find for ``name`` so that
    ``then`` runs right after the module has run, once."""

    def __init__(self, name: str, then: Callable[[], Any]) -> None:
        self._name = name
        self._then = then

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_then(module: ModuleType) -> None:
            run(module)
            self._then()

        spec.loader.exec_module = run_then  # type: ignore[method-assign]
        return spec


mirror("lightning_monarch", Path(__file__).resolve().parent)
