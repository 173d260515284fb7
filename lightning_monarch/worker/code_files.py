"""The code a worker got by value, named after its file again, for tracebacks, warnings and pdb.

Runs in each worker process, as a stage's objects are unpickled (``worker.stage``). cloudpickle
sends a class defined in the user's script (``__main__``) by value, and names every code object
it sends ``<dynamic-code>``: a worker's traceback, a warning and pdb's ``w`` and ``l`` then name no
file, where ``ddp``'s ranks name the script and show its lines. The function's globals keep the
script's ``__file__``, so :func:`name_files` gives each such function's code that name again. Code
from a notebook cell has no file to name, and keeps ``<dynamic-code>``.
"""

from __future__ import annotations

import types
from typing import Any

#: The file name cloudpickle gives every code object it sends by value.
DYNAMIC_CODE = "<dynamic-code>"


def name_files(*objects: Any) -> None:
    """Name the file of the code sent by value in the classes of ``objects`` (and their bases)."""
    for cls in {base for obj in objects if obj is not None for base in type(obj).__mro__}:
        for value in vars(cls).values():
            for function in _functions(value):
                file = function.__globals__.get("__file__")
                if function.__code__.co_filename == DYNAMIC_CODE and isinstance(file, str):
                    function.__code__ = _named(function.__code__, file)


def _functions(value: Any) -> list[types.FunctionType]:
    """The functions a class attribute holds: itself, a static or class method's, a property's."""
    if isinstance(value, property):
        candidates = [value.fget, value.fset, value.fdel]
    else:
        candidates = [getattr(value, "__func__", value)]
    return [candidate for candidate in candidates if isinstance(candidate, types.FunctionType)]


def _named(code: types.CodeType, file: str) -> types.CodeType:
    """``code`` and the code nested in it (inner functions, comprehensions), named ``file``."""
    consts = tuple(_named(const, file) if isinstance(const, types.CodeType) else const for const in code.co_consts)
    return code.replace(co_filename=file, co_consts=consts)
