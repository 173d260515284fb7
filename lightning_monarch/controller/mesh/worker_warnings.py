"""The workers' Python warnings, each shown once in the controller's process.

Runs on the controller. Every worker holds the warnings it would have printed
(``worker.held_warnings``). Rank 0's arrive in its entries and show where the controller's loop
takes the entry, the point of the loop where rank 0 raised them; the other ranks' arrive when the
stage ends (or fails), and each one that rank 0 did not raise shows once, naming the ranks that
raised it unless every rank did.

A warning shows through ``warnings.warn_explicit``, with the location the worker gave it, in the
registry of the module it came from, as if this process had raised it there: the user's warning
filters apply, and Python's "once per location" rule drops a rank-zero warning of Lightning's
that the controller's own loop raised at the same place already.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from types import ModuleType
from typing import Any, Optional

from lightning_monarch.wire.reports import RankValue, WorkerWarning, class_named

#: This process's "once per location" registries for the files no module of it was loaded from
#: (code the workers got by value says ``<dynamic-code>``), kept as Python keeps a module's.
_FILE_REGISTRIES: dict[str, dict[Any, Any]] = {}


class WorkerWarnings:
    """Runs on the controller: shows the warnings of one stage's workers (or one preflight check's),
    each once."""

    def __init__(self, num_workers: int) -> None:
        #: How many ranks there are: a warning that every rank raised shows without their list.
        self.num_workers = num_workers
        self._shown: set[WorkerWarning] = set()

    def show_rank0(self, warned: Iterable[WorkerWarning]) -> None:
        """Rank 0's warnings from one of its entries, as its entry is taken."""
        for warning in warned:
            if warning not in self._shown:
                self._shown.add(warning)
                self._show(warning, "")

    def show_every_rank(self, answers: Iterable[RankValue]) -> None:
        """Every rank's held warnings (``RankValue(rank, [WorkerWarning, ...])``) at the end of the
        stage: each one not shown yet, once, with the ranks that raised it unless every rank did."""
        raised: dict[WorkerWarning, set[int]] = {}
        for answer in answers:
            for warning in answer.value:
                raised.setdefault(warning, set()).add(answer.rank)
        for warning, ranks in raised.items():
            if warning in self._shown:
                continue
            self._shown.add(warning)
            self._show(warning, "" if len(ranks) == self.num_workers else f" ({_ranks(sorted(ranks))})")

    def _show(self, warning: WorkerWarning, label: str) -> None:
        module = _MODULES.get(warning.filename)
        category = _category(warning.category)
        message = warning.message + label
        if category is None:  # a class this process does not have: shown by name
            category, message = UserWarning, f"{warning.category.split(':')[-1]}: {message}"
        if module is None:  # Python names the module after the file, as for a warning raised there
            warnings.warn_explicit(
                message,
                category,
                warning.filename,
                warning.lineno,
                registry=_FILE_REGISTRIES.setdefault(warning.filename, {}),
            )
            return
        warnings.warn_explicit(
            message,
            category,
            warning.filename,
            warning.lineno,
            module=module.__name__,
            registry=vars(module).setdefault("__warningregistry__", {}),
            module_globals=vars(module),
        )


def _ranks(ranks: list[int]) -> str:
    """As ``MeshStatsMonitor`` names them: ``worker rank 1``, ``worker ranks [1, 2]``."""
    return f"worker rank {ranks[0]}" if len(ranks) == 1 else f"worker ranks {ranks}"


class _ModulesByFile:
    """This process's modules by the file each was loaded from (the user's script is ``__main__``),
    the first loaded where several were; indexed again when a file is missing and a module was
    imported since. Warnings show at every stage, and a scan of ``sys.modules`` per warning cost
    some 7 ms."""

    def __init__(self) -> None:
        self._index: dict[str, ModuleType] = {}
        self._indexed = 0

    def get(self, filename: str) -> Optional[ModuleType]:
        if filename not in self._index and len(sys.modules) != self._indexed:
            modules = list(sys.modules.values())
            self._index = {}
            for module in reversed(modules):
                file = getattr(module, "__file__", None)
                if isinstance(file, str):
                    self._index[file] = module
            self._indexed = len(modules)
        return self._index.get(filename)


_MODULES = _ModulesByFile()


def _category(name: str) -> Optional[type[Warning]]:
    """The warning class named ``module:qualname``, if this process has imported its module."""
    found = class_named(name)
    return found if found is not None and issubclass(found, Warning) else None
