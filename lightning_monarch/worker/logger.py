"""The logger a worker's Trainer writes to: a recorder whose calls the controller replays.

Runs in each worker. Lightning decides on each rank when to log (``log_every_n_steps``, epoch
ends) and calls the logger on rank 0 only; recording those calls and replaying them on the
controller's real loggers gives the controller exactly the writes DDP's rank 0 would make.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any, Optional, Union

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from lightning_monarch.protocol import LoggerIdentity
from lightning_monarch.worker.describe import to_cpu


class RecordingLogger(Logger):
    """Runs in each worker: records ``log_metrics`` and ``log_hyperparams`` calls on rank 0."""

    def __init__(self, identity: LoggerIdentity) -> None:
        super().__init__()
        self._identity = identity
        self._calls: list[tuple[str, tuple[Any, ...]]] = []

    @property
    def name(self) -> Optional[str]:
        return self._identity.name

    @property
    def version(self) -> Any:
        return self._identity.version

    @property
    def save_dir(self) -> Optional[str]:
        return self._identity.save_dir

    @property
    def log_dir(self) -> Optional[str]:
        return self._identity.log_dir

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self._calls.append(("log_metrics", (to_cpu(dict(metrics)), step)))

    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        self._calls.append(("log_hyperparams", (params,)))

    def drain(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The calls recorded since the last drain, oldest first."""
        calls, self._calls = self._calls, []
        return calls
