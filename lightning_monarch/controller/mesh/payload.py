"""The stage's payload: its objects pickled once for the workers, and checked before any starts.

Runs on the controller. The module, datamodule, dataloaders and worker callbacks travel to the
workers pickled (``StageSpec.payload``, a ``codec.Parcel``: the pickle, with the large storages
left out and named by the hash of their bytes, which travel apart and only where the workers do not
hold them, ``controller.mesh.storages``); classes and functions travel by module path (except those
defined in ``__main__``, which cloudpickle sends by value), so the workers must be able to import
them. An object that cannot be pickled, one that pickles but cannot be read back (the parcel is
opened here once, as a worker opens it), and a class the workers cannot import are each reported
here with its path and the fix, instead of as an unpickling error on a remote process.
"""

from __future__ import annotations

import abc
import functools
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import cloudpickle
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_monarch.controller.mesh import imported_state
from lightning_monarch.wire.codec import (
    Parcel,
    TensorPickling,
    made_with_abstract_methods,
    open_where_packed,
    pack,
    reduce_without_new,
)


class _ReferenceRecorder(TensorPickling, cloudpickle.Pickler):
    """A cloudpickle pickler that notes every class and function it pickles by reference; tensors
    travel as ``lightning_monarch.wire.codec`` sends them, for the workers' ``codec.decode``.

    It leaves the controller's ``Trainer`` behind (a LightningDataModule keeps a reference to it):
    each worker attaches its own Trainer, as the controller's cannot leave this process.
    """

    def __init__(self, file: io.BytesIO, **kwargs: Any) -> None:
        super().__init__(file, **{"protocol": pickle.HIGHEST_PROTOCOL, **kwargs})
        self.references: dict[str, str] = {}
        #: The classes pickled by reference, in the order met.
        self.classes: dict[type, None] = {}

    @override
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Trainer):
            return type(None), ()
        without_new = reduce_without_new(obj, self.proto)
        if without_new is not None:
            return without_new
        reduced = super().reducer_override(obj)
        if isinstance(obj, abc.ABCMeta) and isinstance(reduced, tuple) and len(reduced) == 6:
            # a class sent by value: made with the abstract methods it has here
            reduced = (functools.partial(made_with_abstract_methods, reduced[0], obj.__abstractmethods__), *reduced[1:])
        if reduced is NotImplemented and isinstance(obj, (type, types.FunctionType)):
            module = getattr(obj, "__module__", None)
            if module and module != "__main__":
                self.references.setdefault(module, getattr(obj, "__qualname__", repr(obj)))
                if isinstance(obj, type):
                    self.classes[obj] = None
        return reduced


def pack_for_workers(objects: dict[str, Any], script_dir: Optional[str]) -> Parcel:
    """Pickle ``objects`` (named by role, e.g. ``"LightningModule"``) for the workers, once, as a
    parcel whose sources are views of their storages (no copy of the weights is made here). Its
    second part is the state of the classes and modules they refer to by reference
    (``controller.mesh.imported_state``), for the workers to take where the script changed it.

    Raises ``TypeError`` naming the object that cannot be pickled or read back, or ``ImportError``
    naming the class the workers could not import.
    """
    picklers: list[_ReferenceRecorder] = []

    def recorder(*args: Any, **kwargs: Any) -> _ReferenceRecorder:
        picklers.append(_ReferenceRecorder(*args, **kwargs))
        return picklers[-1]

    try:
        parcel = pack(
            tuple(objects.values()),
            recorder,
            then=lambda: imported_state.gather(picklers[0].classes, picklers[0].references, travel_error),
        )
    except Exception:
        for role, obj in objects.items():
            _raise_if_unpicklable(role, obj)
        raise
    _check_importable(picklers[0].references, script_dir)
    error = _open_error(parcel)
    if error is not None:
        for role, obj in objects.items():
            _raise_if_not_rebuilt(role, obj)
        raise TypeError(
            f"The stage's objects ({', '.join(objects)}) pickle for the worker processes, but reading them back"
            f" raises {type(error).__name__}: {error}. Each one alone reads back: look for objects they share."
        ) from error
    return parcel


def travel_error(obj: Any) -> Optional[Exception]:
    """Why ``obj`` cannot be pickled for the workers, or ``None`` where it can. Cheap: the large
    buffers of its tensors, arrays and ``bytes`` are left out, as a parcel leaves them."""
    pickler = _ReferenceRecorder(io.BytesIO(), buffer_callback=lambda buffer: False)
    pickler.bytes_out_of_band = True
    try:
        pickler.dump(obj)
    except Exception as error:
        return error
    finally:
        pickler.clear_memo()
    return None


def travelling_loggers(loggers: list[Logger]) -> list[Optional[Logger]]:
    """The Trainer's loggers as they travel to the workers: each one, or ``None`` (with a warning)
    for one that cannot be pickled, which the workers replace by a stand-in (``worker.logger``)."""
    travelling: list[Optional[Logger]] = []
    for logger in loggers:
        error = travel_error(logger)
        if error is not None:
            rank_zero_warn(
                f"The logger `{type(logger).__name__}` cannot be pickled for the worker processes under"
                f" strategy='monarch' ({type(error).__name__}: {error}): on the workers, module code's"
                " `self.logger` is a stand-in with its name, version, `save_dir`, `log_dir` and `experiment`"
                " calls, without its own attributes, and `trainer.log_dir` there is its `save_dir`. Keep what"
                " cannot be pickled out of its attributes (or drop it in `__getstate__`) to have it whole there."
            )
        travelling.append(logger if error is None else None)
    return travelling


def rebuild_error(obj: Any) -> Optional[Exception]:
    """Why ``obj`` pickles for the workers but cannot be read back, or ``None`` where it can be
    (or cannot be pickled at all, which is :func:`travel_error`'s)."""
    try:
        parcel = pack(obj, _ReferenceRecorder)
    except Exception:
        return None
    return _open_error(parcel)


def _open_error(parcel: Parcel) -> Optional[Exception]:
    try:
        open_where_packed(parcel)
    except Exception as error:
        return error
    return None


@dataclass(frozen=True)
class Unpicklable:
    """The innermost object under a root that cannot travel (be pickled, or read back), where it is, and why."""

    path: str
    obj: Any
    error: Exception

    def describe(self) -> str:
        """``datamodule.train_set._cache`` (a ``generator``: `stream` at ``file:line``), for messages."""
        what = f"a `{type(self.obj).__name__}`"
        code = getattr(self.obj, "gi_code", None) or getattr(self.obj, "__code__", None)
        if code is not None:
            what += f": `{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}` at"
            what += f" {code.co_filename}:{code.co_firstlineno}"
        return f"`{self.path}` ({what})"


def find_unpicklable(obj: Any, path: str) -> Optional[Unpicklable]:
    """Where under ``obj`` (named ``path``) pickling fails: the innermost attribute, item or module
    child that cannot be pickled although everything it holds can; ``None`` where ``obj`` pickles."""
    return _innermost(obj, path, travel_error)


def _innermost(obj: Any, path: str, error_of: Callable[[Any], Optional[Exception]]) -> Optional[Unpicklable]:
    """The innermost object under ``obj`` (named ``path``) for which ``error_of`` gives an error
    although it gives none for anything the object holds; ``None`` where it gives none for ``obj``."""
    error = error_of(obj)
    if error is None:
        return None
    seen = {id(obj)}
    while True:
        for child_path, child in _children(obj, path):
            if id(child) in seen:
                continue
            seen.add(id(child))
            child_error = error_of(child)
            if child_error is not None:
                obj, path, error = child, child_path, child_error
                break
        else:
            return Unpicklable(path, obj, error)


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """What ``obj`` holds, each with its path: items, attributes, a module's submodules and tensors."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for index, value in enumerate(obj):
            yield f"{path}[{index}]", value
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for name, value in vars(obj).items():
            if isinstance(obj, nn.Module) and name in ("_modules", "_parameters", "_buffers"):
                yield from ((f"{path}.{child}", item) for child, item in value.items())
            else:
                yield f"{path}.{name}", value


def _raise_if_unpicklable(role: str, obj: Any) -> None:
    found = find_unpicklable(obj, _ROOTS[role])
    if found is None:
        return
    error = found.error
    globals_used = _unpicklable_main_globals(type(obj))
    if globals_used:
        raise TypeError(
            f"The {role} `{type(obj).__name__}` is defined in `__main__` (a notebook or the script itself), so it"
            " travels to the worker processes by value, with every `__main__` global its methods use; under"
            f" strategy='monarch' {', '.join(globals_used)} cannot be pickled ({type(error).__name__}: {error})."
            f" Move `{type(obj).__name__}` and what it uses into a module next to the notebook (e.g. `models.py`)"
            " and import it from there, or create those objects in `setup()` or `configure_model()`, which run"
            " on the workers."
        ) from error
    raise TypeError(
        f"The {role} `{type(obj).__name__}` cannot be pickled, and under strategy='monarch' it travels to"
        f" the worker processes pickled: {found.describe()} cannot ({type(error).__name__}: {error})."
        " Keep objects that cannot be pickled (open files, locks, generators, process pools, lambdas in"
        " closures) out of its attributes, or create them in `setup()` or `configure_model()`, which run"
        " on the workers."
    ) from error


def _raise_if_not_rebuilt(role: str, obj: Any) -> None:
    found = _innermost(obj, _ROOTS[role], rebuild_error)
    if found is None:
        return
    error = found.error
    raise TypeError(
        f"The {role} `{type(obj).__name__}` cannot be rebuilt on the worker processes, and under"
        f" strategy='monarch' it travels to them pickled: {found.describe()} pickles, but reading it back"
        f" raises {type(error).__name__}: {error}. Give its class a `__reduce__` that returns every argument"
        ' its constructor needs (Python\'s `pickle` documentation, "Pickling Class Instances"), or create'
        " the object in `setup()` or `configure_model()`, which run on the workers."
    ) from error


#: How the path to an object that cannot be pickled starts, by the role of the object it is in.
_ROOTS = {
    "LightningModule": "model",
    "LightningDataModule": "datamodule",
    "dataloaders": "",
    "worker_callbacks": "worker_callbacks",
    "Trainer": "trainer",
    "loggers": "trainer.loggers",
}


def _unpicklable_main_globals(cls: type) -> list[str]:
    """The ``__main__`` globals that methods of ``cls`` (and of its ``__main__`` bases) use and that
    cannot be pickled, as ``` `name` (a type) ``` strings: what cloudpickle would send with a class
    defined in a notebook."""
    main = vars(sys.modules["__main__"])
    names = {
        name
        for klass in cls.__mro__
        if klass.__module__ == "__main__"
        for member in vars(klass).values()
        for name in getattr(getattr(getattr(member, "__func__", member), "__code__", None), "co_names", ())
        if name in main
    }
    return [f"`{name}` (a {type(main[name]).__name__})" for name in sorted(names) if not _picklable(main[name])]


def _picklable(obj: Any) -> bool:
    try:
        cloudpickle.dumps(obj)
    except Exception:
        return False
    return True


def _check_importable(references: dict[str, str], script_dir: Optional[str]) -> None:
    worker_path = _worker_sys_path() | ({os.path.realpath(script_dir)} if script_dir else set())
    for module, qualname in references.items():
        root = _import_root(module)
        if root is None or root in worker_path or _worker_finds(module):
            continue
        raise ImportError(
            f"`{qualname}` from module `{module}` cannot be imported by the Monarch workers under"
            f" strategy='monarch': it is loaded from {root}, which is on this process's `sys.path` but not on the"
            " workers' (they see the working directory, the script's folder, PYTHONPATH and site-packages)."
            f" Add the folder with `PYTHONPATH={root}`, install the package with `pip install -e .`, or move"
            " the class into a module the workers can import."
        )


def _import_root(module: str) -> Optional[str]:
    """The ``sys.path`` entry ``module`` is imported from; ``None`` for built-in modules."""
    top = module.split(".", 1)[0]
    loaded = sys.modules.get(top)
    spec = getattr(loaded, "__spec__", None) or importlib.util.find_spec(top)
    if spec is None:
        return f"<no file: module `{top}` exists only in this process>"
    if spec.origin in (None, "built-in", "frozen") and not spec.submodule_search_locations:
        return None
    location = next(iter(spec.submodule_search_locations or [])) if spec.submodule_search_locations else spec.origin
    assert location is not None  # a spec without an origin has search locations, or returned above
    return os.path.realpath(os.path.dirname(location))


@functools.cache
def _worker_sys_path_for(cwd: str, pythonpath: str) -> frozenset[str]:
    output = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return frozenset(os.path.realpath(entry or cwd) for entry in json.loads(output))


def _worker_finds(module: str) -> bool:
    """Whether a process started as the workers are can find ``module`` although its folder is not
    on their ``sys.path``: an editable install (``pip install -e``) finds it through an import hook."""
    return _worker_finds_package(module.split(".", 1)[0], os.getcwd(), os.environ.get("PYTHONPATH", ""))


@functools.cache
def _worker_finds_package(package: str, cwd: str, pythonpath: str) -> bool:
    return (
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)",
                package,
            ],
            cwd=cwd,
            capture_output=True,
        ).returncode
        == 0
    )


def _worker_sys_path() -> frozenset[str]:
    """The ``sys.path`` a worker process starts with: Monarch starts it as ``python -m`` in this
    process's working directory and environment."""
    return _worker_sys_path_for(os.getcwd(), os.environ.get("PYTHONPATH", ""))
