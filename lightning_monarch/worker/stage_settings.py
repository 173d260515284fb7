"""The process-wide settings a stage makes on a worker, and their undoing when it ends.

Runs in each worker process, around each stage (``worker.stage``). A stage quiets Lightning's info
messages (the controller prints them), ignores one warning of Lightning's that does not apply to a
worker, puts the user's script folder on ``sys.path`` (as torchrun would), sets the seed variables
``seed_everything`` set on the controller, makes torch's settings that the user's script changed
(``torch_settings``) and the multiprocessing start method the controller has (Monarch's bootstrap
set ``forkserver``, which a ddp rank's DataLoaders would not use), all before the stage's objects
are unpickled, and what the script changed in the classes and modules the stage's objects refer to
(``worker.imported_state``: PINA's class-level conditions, ``scvi.settings.seed``) as they are. A
warm worker runs the next stage, or the next user's Trainer on the same mesh, in the same process:
each of these is undone when the stage ends, so that no stage inherits another's.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import sys
import warnings
from typing import Any, Optional, cast

from lightning_monarch import torch_settings
from lightning_monarch.wire.specs import ImportedState, StageSpec
from lightning_monarch.worker.imported_state import CarriedState

#: Lightning's info messages ("Initializing distributed", "`Trainer.fit` stopped") are the
#: controller's to print; a worker keeps warnings and errors only.
QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric")
#: A worker's Trainer has none of the controller's callbacks on purpose; the controller's own
#: Trainer restores their state from a checkpoint and warns itself if one is missing.
CALLBACKS_MISSING_WARNING = "Be aware that when using `ckpt_path`, callbacks used to create the checkpoint"


class StageSettings:
    """One stage's process-wide settings on a worker: :meth:`make` them, then :meth:`undo` them."""

    def __init__(self, spec: StageSpec) -> None:
        self._spec = spec
        self._levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
        self._environment = {name: os.environ.get(name) for name in spec.env}
        self._paths: list[str] = []
        self._filter: Optional[tuple[Any, ...]] = None
        self._torch: torch_settings.Values = {}
        self._torch_thread: torch_settings.Values = {}
        self._imported = CarriedState(ImportedState({}, {}))
        self._start_method = multiprocessing.get_start_method(allow_none=True)

    def make(self) -> None:
        """Make the stage's settings that hold before its objects are opened (the others:
        :meth:`make_imported_state`, :meth:`make_thread_settings`)."""
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message=re.escape(CALLBACKS_MISSING_WARNING))
        self._filter = warnings.filters[0]
        for path in reversed(self._spec.sys_path):
            if path not in sys.path:
                sys.path.insert(0, path)
                self._paths.append(path)
        _set_environment(self._spec.env)
        multiprocessing.set_start_method(self._spec.start_method, force=True)
        self._torch = torch_settings.apply(torch_settings.split(self._spec.torch_settings)[0])

    def make_thread_settings(self) -> None:
        """Runs on the thread that runs the stage, as it starts: make torch's settings that are a
        thread's (flush-denormal), which the thread that built the stage keeps as they were."""
        self._torch_thread = torch_settings.apply(torch_settings.split(self._spec.torch_settings)[1])

    def make_imported_state(self, state: ImportedState) -> None:
        """Make what the script changed in the classes and modules the stage's objects refer to
        (``worker.imported_state``): as the stage's objects are opened, before any hook runs."""
        self._imported = CarriedState(state)

    def undo(self) -> None:
        """Leave the process as it was before :meth:`make`."""
        self._imported.undo()
        torch_settings.apply(self._torch_thread)  # its values from before include the process's made
        torch_settings.apply(self._torch)
        multiprocessing.set_start_method(self._start_method, force=True)
        _set_environment(self._environment)
        for path in self._paths:
            if path in sys.path:
                sys.path.remove(path)
        if self._filter in warnings.filters:
            # an "ignore" filter removed: no warning shown before is shown again, so the warnings
            # module's caches of shown warnings stay valid
            cast(list[Any], warnings.filters).remove(self._filter)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


def _set_environment(variables: dict[str, Optional[str]]) -> None:
    """Set each of ``variables``, or unset it where its value is ``None``."""
    for name, value in variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
