"""What the user's script changed in imported classes and modules, made on a worker for a stage.

Runs in each worker process, as a stage's objects are opened (``worker.stage``). Under ``ddp``
every rank runs the script, so what it changes in an imported class or module (PINA moves a
problem's discretised points into the class-level ``conditions``; ``scvi.settings.seed = 0``) holds
on every rank. A worker imports them afresh as it unpickles the stage's objects; the controller packs
their state after them, in the same pickle (``controller.mesh.imported_state``), so that what they
share stays shared (a condition's ``problem`` is the stage's problem). Here each value that differs
from this process's takes the controller's: a class's or module's attribute is replaced, and an
object's setting is set as the script set it (through its property's setter, whose side effects run
as they did there: scvi's seeds its generators). :meth:`CarriedState.undo` puts this process's values
back when the stage ends, so that the next stage compares with the import's again. A value that
could not be pickled is refused where what this process holds there does not fit its description
(``wire.specs.described``): the script set it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import cloudpickle

from lightning_monarch.wire.specs import ImportedState, Untravelled, type_name

#: An attribute that its holder did not have here.
_MISSING = object()


def _same(mine: Any, theirs: Any) -> bool:
    """Whether two values hold the same data: they compare equal, or else pickle alike (a value
    whose ``==`` is its identity, or gives no single truth, as an array's)."""
    try:
        if bool(mine == theirs):
            return True
    except Exception:
        pass
    try:
        return cloudpickle.dumps(mine) == cloudpickle.dumps(theirs)
    except Exception:
        return False


def _fits(mine: Any, theirs: Any) -> bool:
    """Whether ``mine`` is what ``theirs``, a value or its ``Untravelled`` description, says: the
    same value, or a value of the described type whose items fit the description's."""
    if not isinstance(theirs, Untravelled):
        return _same(mine, theirs)
    if type_name(type(mine)) != theirs.type:
        return False
    if theirs.items is None:
        return True
    if isinstance(mine, dict):
        pairs = list(mine.items())
        return len(pairs) == len(theirs.items) and all(
            _fits(key, their_key) and _fits(value, their_value)
            for (key, value), (their_key, their_value) in zip(pairs, theirs.items, strict=True)
        )
    return len(mine) == len(theirs.items) and all(map(_fits, mine, theirs.items))


class CarriedState:
    """The controller's imported state made in this process for one stage."""

    def __init__(self, state: ImportedState) -> None:
        self._replaced: list[tuple[Any, str, Any]] = []
        for held, values in state.attributes.items():
            holder = _holder(held)
            self._take(holder, values, vars(holder).get)
        for named, values in state.settings.items():
            settings = _holder(named)
            self._take(settings, values, functools.partial(getattr, settings))
        for key, untravelled in state.untravelled.items():
            holder = _holder(key)
            for name, (theirs, why) in untravelled.items():
                mine = getattr(holder, name, _MISSING) if isinstance(key, tuple) else vars(holder).get(name, _MISSING)
                if mine is _MISSING or not _fits(mine, theirs):
                    self.undo()
                    raise _changed_beyond_pickling(key, name, theirs.type, why, mine)

    def _take(self, holder: Any, values: dict[str, Any], own: Callable[[str, Any], Any]) -> None:
        """Set each of ``values`` on ``holder`` where ``own(name, _MISSING)``, this process's, differs."""
        for name, value in values.items():
            mine = own(name, _MISSING)
            if mine is _MISSING or not _same(mine, value):
                self._replaced.append((holder, name, mine))
                setattr(holder, name, value)

    def undo(self) -> None:
        """Put this process's values back (remove an attribute its holder did not have here)."""
        for holder, name, mine in reversed(self._replaced):
            if mine is _MISSING:
                delattr(holder, name)
            else:
                setattr(holder, name, mine)
        self._replaced.clear()


def _holder(key: Any) -> Any:
    """The class of an :class:`ImportedState` key, the module it names, or the settings object
    that a ``(module, name)`` key names."""
    if isinstance(key, tuple):
        return getattr(importlib.import_module(key[0]), key[1])
    return importlib.import_module(key) if isinstance(key, str) else key


def _changed_beyond_pickling(key: Any, name: str, theirs: str, why: str, mine: Any) -> TypeError:
    """The error for an attribute the script set to a value that cannot be pickled (``theirs``, its
    type's name, and ``why``) where this process's import holds ``mine``."""
    where = key if isinstance(key, str) else ".".join(key) if isinstance(key, tuple) else type_name(key)
    held = "nothing" if mine is _MISSING else f"a `{type_name(type(mine))}`"
    return TypeError(
        f"The script set `{where}.{name}` on the controller to a `{theirs}`, which cannot be pickled ({why}), so"
        f" the workers cannot take it; their import holds {held} there. Under ddp every rank's script would have"
        " set it. Set it in a hook that runs on the workers (the module's or datamodule's `setup`), or give it a"
        " value that can be pickled."
    )
