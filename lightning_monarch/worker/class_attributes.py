"""Class attributes the user's script changed on the controller, made on a worker for a stage.

Runs in each worker process, as a stage's objects are opened (``worker.stage``). Under ``ddp``
every rank runs the script, so what it changes in an imported class (PINA moves a problem's
discretised points into the class-level ``conditions``) holds on every rank. A worker imports the
class afresh as it unpickles the stage's objects; the controller packs each such class's data
attributes after them, in the same pickle (``controller.mesh.payload``), so that what they share
stays shared (a condition's ``problem`` is the stage's problem). Here each one that differs from
this process's takes the controller's value; :meth:`CarriedAttributes.undo` puts this process's
back when the stage ends, so that the next stage compares with the import's again.
"""

from __future__ import annotations

from typing import Any

import cloudpickle

#: A class attribute that the class did not have here.
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


class CarriedAttributes:
    """The controller's class attributes made in this process for one stage."""

    def __init__(self, attributes: dict[type, dict[str, Any]]) -> None:
        self._replaced: list[tuple[type, str, Any]] = []
        for cls, values in attributes.items():
            for name, value in values.items():
                mine = vars(cls).get(name, _MISSING)
                if mine is _MISSING or not _same(mine, value):
                    self._replaced.append((cls, name, mine))
                    setattr(cls, name, value)

    @property
    def names(self) -> list[str]:
        """The attributes made here, as ``module.Class.name``."""
        return [f"{cls.__module__}.{cls.__qualname__}.{name}" for cls, name, _ in self._replaced]

    def undo(self) -> None:
        """Put this process's values back (remove an attribute its class did not have here)."""
        for cls, name, mine in reversed(self._replaced):
            if mine is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, mine)
        self._replaced.clear()
