"""What the controller's module and worker callbacks take of rank 0's at the end of a stage.

Runs on the controller, for ``StageSession.finish``. Under DDP the script's process is rank 0, so
after a stage its module and callbacks hold what rank 0's hold. The end entry of a stage carries
rank 0's public attributes of the module (with its ``hparams``) and of each worker callback
(``worker.state``): the controller's objects take them, and keep their own of those that could not
travel, with a warning that names them.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_monarch.wire.reports import Attributes, TakenBack


def take_attributes(taken: TakenBack, module: Any, worker_callbacks: list[Any]) -> None:
    """Give ``module`` and ``worker_callbacks`` (in the stage's order) rank 0's attributes."""
    _take(module, taken.module, "module")
    for callback, attributes in zip(worker_callbacks, taken.callbacks, strict=True):
        _take(callback, attributes, "callback")


def _take(obj: Any, attributes: Attributes, kind: str) -> None:
    vars(obj).update(attributes.values)
    if attributes.dropped:
        reasons = "; ".join(f"`{name}` ({why})" for name, why in sorted(attributes.dropped.items()))
        rank_zero_warn(
            f"`{type(obj).__name__}`: the workers' {kind} has public attributes that cannot be pickled:"
            f" {reasons}. After the stage, the controller's {kind} takes rank 0's public attributes, as"
            f" the {kind} of a `ddp` script's rank 0 would have them, but not these: it keeps its own. Make"
            " them picklable, or keep them out of the public attributes (a name that starts with `_`)."
        )
