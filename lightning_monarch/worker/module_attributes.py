"""The module's plain attributes under asynchronous validation (``MonarchStrategy(validation="async")``).

Runs in worker processes, on the stage's loop thread: on the training ranks at each hand-off, on
the validation workers around each validation (``worker.async_validation``). A synchronous run has
one module: what ``training_step`` sets on ``self`` (a counter, an annealed temperature) a
validation hook reads, and what a validation hook sets the training hooks read. Under asynchronous
validation the module is two, one per mesh: the checkpoint state carries its parameters, buffers
and optimizer state, and :class:`PlainAttributes` carries the rest that can travel: the public,
non-callable attributes of the module and its submodules (a torchmetrics metric's states too).
Each training rank sends those that differ from what they were when its ``fit`` started (by their
pickled bytes), and its validation worker sets them before it validates. An attribute that a
validation then changes too has two values where the synchronous run has one: the validation
worker raises :class:`~lightning_monarch.errors.SharedAttributeError`, which ends the ``fit``.
An attribute only validation changes stays on the validation worker, as a synchronous run's stays
on its module until a validation hook changes it again.
"""

from __future__ import annotations

import pickle

import cloudpickle
from torch import nn

from lightning_monarch.errors import SharedAttributeError

#: A plain attribute: the dotted path of its module in the LightningModule ("" for the
#: LightningModule itself, as ``named_modules`` names it), and its name.
Key = tuple[str, str]


class PlainAttributes:
    """Runs on a worker: the plain attributes of one rank's module, as pickled bytes."""

    def __init__(self, module: nn.Module, submodules_only: bool = False) -> None:
        """``submodules_only``: leave out the module's own attributes (``worker.state`` sends them
        at a stage's end with its ``hparams``)."""
        self._module = module
        self._submodules_only = submodules_only

    def read(self) -> dict[Key, bytes]:
        """Every plain attribute that pickles, now (with cloudpickle, as the module reached the
        workers: an instance of a class defined in a notebook travels). One that does not (a lock,
        a generator) cannot travel, and stays on each side as it is."""
        found: dict[Key, bytes] = {}
        for path, module in self._module.named_modules():
            if self._submodules_only and not path:
                continue
            for name, value in vars(module).items():
                if name.startswith("_") or name == "training" or callable(value):
                    continue
                try:
                    found[(path, name)] = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception:  # anything pickling raises: the attribute cannot travel
                    continue
        return found

    def changed_since(self, start: dict[Key, bytes]) -> dict[Key, bytes]:
        """The attributes that differ from what :meth:`read` gave at the ``fit``'s ``start``."""
        return {key: data for key, data in self.read().items() if start.get(key) != data}

    def take(self, carried: dict[Key, bytes]) -> dict[Key, bytes]:
        """Set the ``carried`` attributes (a training rank's :meth:`changed_since`); return
        every attribute as it is then, for :meth:`check_unshared`."""
        modules = dict(self._module.named_modules())
        for (path, name), data in carried.items():
            setattr(modules[path], name, pickle.loads(data))
        return self.read()

    def check_unshared(self, before: dict[Key, bytes], carried: dict[Key, bytes]) -> None:
        """After a validation that started with the attributes ``before``: raise where it changed
        an attribute that training changed too (one of ``carried``)."""
        shared = sorted(key for key, data in self.read().items() if key in carried and before.get(key) != data)
        if shared:
            names = ", ".join(f"`self.{path + '.' if path else ''}{name}`" for path, name in shared)
            raise SharedAttributeError(
                f"{names} changed in training hooks and in validation hooks. With"
                " `MonarchStrategy(validation='async')` the validation runs on other workers while training goes on,"
                " each with its own copy of the module: training's change reaches each validation, but the"
                " validation's never reaches training, as it would synchronously. Keep what validation hooks"
                " change in attributes of their own (e.g. `self.val_...`), or use `validation='sync'`."
            )
