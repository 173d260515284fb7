"""Process-wide settings of client libraries that a user's script sets, carried to the workers.

Both sides: the controller reads them as a stage starts (``controller.launch.launcher``), and each
worker sets them once it has opened the stage's objects (``worker.stage``). Under ``ddp`` every rank
runs the user's script, so a setting the script makes is made on every rank, and the library's
code on the ranks reads it. The workers never run the script: each setting listed here that the
library reads while it trains travels with the stage instead. ``scvi.settings.seed`` seeds the
train/validation split that scvi-tools' ``DataSplitter.setup`` makes on every rank; without it,
each worker would split the data at random.
"""

from __future__ import annotations

import sys
from typing import Any

#: Each setting as its module, the settings object in it, and the attribute.
CARRIED: tuple[tuple[str, str, str], ...] = (("scvi", "settings", "seed"),)

#: The settings of a stage: ``(module, object, attribute)`` and its value.
Settings = dict[tuple[str, str, str], Any]


def read() -> Settings:
    """Runs on the controller: the settings of :data:`CARRIED` whose library this process imported."""
    return {
        (module, name, attribute): getattr(getattr(sys.modules[module], name), attribute)
        for module, name, attribute in CARRIED
        if module in sys.modules
    }


def apply(settings: Settings) -> Settings:
    """Runs in each worker, once the stage's objects are open: make ``settings`` of the libraries
    they imported as the user's script made them on the controller. A library the stage does not
    use is not imported for its settings. Returns the values they replaced, which ``apply`` puts
    back when the stage ends (``worker.stage_settings``)."""
    replaced: Settings = {}
    for (module, name, attribute), value in settings.items():
        if module in sys.modules:
            holder = getattr(sys.modules[module], name)
            replaced[(module, name, attribute)] = getattr(holder, attribute)
            setattr(holder, attribute, value)
    return replaced
