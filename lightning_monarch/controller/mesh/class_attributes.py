"""The class attributes that travel with a stage's objects, for the workers to compare with theirs.

Runs on the controller, as the stage's payload is packed (``controller.mesh.payload``). Under
``ddp`` every rank runs the user's script, so what the script (or a library it calls) changes in
an imported class holds on every rank: PINA's data module moves a problem's discretised points into
the class-level ``conditions`` of the problem's class. The workers import such a class afresh, as
the package left it. So for each class the payload pickles by reference, its data attributes
(:func:`data_attributes`) are packed after the stage's objects, in the same pickle; each worker
takes the controller's value of each one that differs from its own import's
(``worker.class_attributes``).

Not carried: the classes of the standard library, of torch (whose process-wide state
``torch_settings`` carries), of Monarch and of this package; classes implemented in C, whose
attributes a script cannot change; and an attribute whose value cannot be pickled (a lock, a
open file), which the workers keep as their import made it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

#: The top-level packages whose classes' attributes stay as the workers import them.
NOT_CARRIED = frozenset(sys.stdlib_module_names) | {"builtins", "torch", "monarch", "lightning_monarch"}
#: ``Py_TPFLAGS_HEAPTYPE``: a class made by a ``class`` statement, not by C code.
_HEAP_TYPE = 1 << 9


def carried(cls: type) -> bool:
    """Whether ``cls``'s data attributes travel: a class made in Python, outside :data:`NOT_CARRIED`."""
    module = getattr(cls, "__module__", None) or "builtins"
    return bool(cls.__flags__ & _HEAP_TYPE) and module.split(".", 1)[0] not in NOT_CARRIED


def data_attributes(cls: type) -> dict[str, Any]:
    """``cls``'s own attributes that hold data: not its methods, properties or other descriptors,
    nested classes and modules, nor Python's own (``__doc__``, the ABC caches, an ``Enum``'s
    ``_sunder_`` lookup tables)."""
    return {
        name: value
        for name, value in vars(cls).items()
        if not (name.startswith("_") and name.endswith("_"))
        and not name.startswith("_abc_")
        and not isinstance(value, (type, types.ModuleType))
        and not hasattr(type(value), "__get__")
    }


def gather(classes: Iterable[type], travel_error: Callable[[Any], Any]) -> dict[type, dict[str, Any]]:
    """The data attributes of each of ``classes`` that travel, by class; an attribute for which
    ``travel_error`` gives an error does not."""
    gathered = {}
    for cls in classes:
        if carried(cls):
            attributes = {name: value for name, value in data_attributes(cls).items() if travel_error(value) is None}
            if attributes:
                gathered[cls] = attributes
    return gathered
