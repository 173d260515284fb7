"""What the script may have changed in the classes and modules a stage's objects refer to.

Runs on the controller, as the stage's payload is packed (``controller.mesh.payload``). Under
``ddp`` every rank runs the user's script, so what the script (or a library it calls) changes in an
imported class or module holds on every rank: PINA's data module moves a problem's discretised
points into the class-level ``conditions`` of the problem's class; ``scvi.settings.seed = 0`` sets
scvi-tools' settings object. The workers import those classes and modules afresh, as their packages
left them. So the payload carries, after the stage's objects and in the same pickle (what they share
stays shared), an :class:`~lightning_monarch.wire.specs.ImportedState` of:

- each class it pickles by reference: its data attributes (:func:`data_attributes`);
- the module of each class and function it pickles by reference, and the packages above it: their
  public data of Python's own types (numbers, strings, containers: not the callables they hold,
  which are code, nor the objects of other libraries' classes, a logging ``Formatter``), and the
  public settings of each object of a library's class they hold (:func:`public_settings`: its
  properties that have a setter, and its public attributes).

Each worker takes each value that differs from its own import's (``worker.imported_state``).

Not carried: what the standard library, torch (whose process-wide state ``torch_settings``
carries), Monarch and this package define; classes written in C, whose attributes a script cannot
change; a module's private names (``_cache``: a library's own bookkeeping). A value that cannot be
pickled (a lock, an open file) cannot travel: its description does (``wire.specs.described``: its
type, and a list's, tuple's or dict's items, themselves where they can be pickled), and a worker
whose import holds what another description fits refuses the stage, naming it (the script set it).
An unpicklable object replaced by another of its type cannot be told apart, and keeps the import's.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable
from typing import Any, Union

from lightning_monarch.wire.specs import ImportedState, described

#: The top-level packages whose classes and modules stay as the workers import them.
NOT_CARRIED = frozenset(sys.stdlib_module_names) | {"builtins", "torch", "monarch", "lightning_monarch"}
#: ``Py_TPFLAGS_HEAPTYPE``: a class made by a ``class`` statement, not by C code.
_HEAP_TYPE = 1 << 9


def _carried_name(module: str) -> bool:
    return module.split(".", 1)[0] not in NOT_CARRIED


def _library_class(cls: type) -> bool:
    """Whether ``cls`` is made in Python by a package outside :data:`NOT_CARRIED`."""
    return bool(cls.__flags__ & _HEAP_TYPE) and _carried_name(getattr(cls, "__module__", None) or "builtins")


def _data(name: str, value: Any) -> bool:
    """Whether ``value``, held under ``name``, is data: not a method, property or other descriptor,
    class or module, nor one of Python's own names (``__doc__``, the ABC caches, an ``Enum``'s
    ``_sunder_`` lookup tables)."""
    return not (
        (name.startswith("_") and name.endswith("_"))
        or name.startswith("_abc_")
        or isinstance(value, (type, types.ModuleType))
        or hasattr(type(value), "__get__")
    )


def data_attributes(cls: type) -> dict[str, Any]:
    """``cls``'s own attributes that hold data."""
    return {name: value for name, value in vars(cls).items() if _data(name, value)}


def public_settings(obj: Any) -> dict[str, Any]:
    """The settings of ``obj``, as its users set them: the value of each property of its class with
    a getter and a setter (one whose getter raises is left out), and its public data attributes."""
    settings = {name: value for name, value in vars(obj).items() if not name.startswith("_") and _data(name, value)}
    for cls in reversed(type(obj).__mro__):
        for name, member in vars(cls).items():
            if isinstance(member, property) and member.fget and member.fset and not name.startswith("_"):
                try:
                    settings[name] = member.fget(obj)
                except Exception:
                    settings.pop(name, None)
    return settings


def _modules(names: Iterable[str]) -> list[str]:
    """The modules ``names`` and the packages above each, that this process imported and that are carried."""
    found: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            module = ".".join(parts[:end])
            if module in sys.modules and _carried_name(module):
                found[module] = None
    return list(found)


def gather(classes: Iterable[type], modules: Iterable[str], travel_error: Callable[[Any], Any]) -> ImportedState:
    """The state of ``classes`` and of the ``modules`` (by name) that the payload refers to, and of
    the packages above them; a value for which ``travel_error`` gives an error is left out."""

    untravelled: dict[Union[type, str, tuple[str, str]], dict[str, tuple[Any, str]]] = {}

    def travelling(values: dict[str, Any], holder: Union[type, str, tuple[str, str]]) -> dict[str, Any]:
        travel = {}
        for name, value in values.items():
            error = travel_error(value)
            if error is None:
                travel[name] = value
            else:
                why = f"{type(error).__name__}: {error}"
                untravelled.setdefault(holder, {})[name] = (described(value, travel_error), why)
        return travel

    attributes: dict[Union[type, str], dict[str, Any]] = {}
    settings: dict[tuple[str, str], dict[str, Any]] = {}
    for cls in classes:
        if _library_class(cls) and (values := travelling(data_attributes(cls), cls)):
            attributes[cls] = values
    for module in _modules(modules):
        data = {}
        for name, value in vars(sys.modules[module]).items():
            if name.startswith("_") or callable(value) or not _data(name, value):
                continue  # private bookkeeping, or code (a ufunc, a model object), not a setting
            if hasattr(value, "__dict__") and _library_class(type(value)):
                if found := travelling(public_settings(value), (module, name)):
                    settings[(module, name)] = found
            elif type(value).__module__ == "builtins":
                data[name] = value
        if values := travelling(data, module):
            attributes[module] = values
    return ImportedState(attributes, settings, untravelled)
