"""Exceptions that lightning_monarch raises in the controller process.

One class per error in both of Lightning's namespaces: this module imports no part of Lightning,
so ``lightning_monarch.pl`` shares it (``lightning_monarch.namespaces``), and ``except
lightning_monarch.WorkerError`` catches a ``pytorch_lightning`` run's failure too.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Optional

from lightning_monarch.wire.reports import WorkerFailure, class_named


class WorkerError(RuntimeError):
    """A worker raised an exception; raised in the controller with the rank, host, hook and the
    remote traceback, so Lightning's ``on_exception`` and teardown run as for a local error.

    What the controller raises is :meth:`of` a failure: an instance of the worker's exception's
    class too, so that the ``except`` clause that catches it under ``ddp`` (where the user's
    process is rank 0) catches it here."""

    def __init__(self, failure: WorkerFailure) -> None:
        self._message = (
            f"Worker rank {failure.rank} on host {failure.host} raised"
            f" {failure.exception_type}{failure.where}: {failure.message}{_under_monarch(failure.message)}\n\n"
            f"Remote traceback (rank {failure.rank}):\n{failure.traceback}"
        )
        super().__init__(self._message)
        self.failure = failure

    @classmethod
    def of(cls, failure: WorkerFailure) -> WorkerError:
        """The error to raise for ``failure``: an instance of a subclass of both this class and the
        worker's exception's class, made here, with the original's arguments and attributes where it
        pickled; a plain ``WorkerError`` where that class is not one this process can have (not an
        ``Exception``, not importable here) or cannot be a base beside this one."""
        original = _original(failure)
        named = class_named(failure.exception_class) if failure.exception_class is not None else None
        base = type(original) if isinstance(original, Exception) else named
        made: Any = _made(base)
        if made is None:
            return cls(failure)
        try:  # the original class's ``__new__``: a built-in one (``OSError``'s) must make the instance
            error = base.__new__(made, *(original.args if original is not None else ()))
        except Exception:  # a ``__new__`` of its own that wants other arguments
            return cls(failure)
        if original is not None:
            vars(error).update(vars(original))
        WorkerError.__init__(error, failure)
        if original is not None:
            error.args = original.args
        return error

    def __str__(self) -> str:
        return self._message

    def __reduce__(self) -> tuple[Any, ...]:
        return WorkerError, (self.failure,)

    @property
    def rank(self) -> int:
        """The global rank of the worker that failed first."""
        return self.failure.rank


#: The subclasses :meth:`WorkerError.of` made, by the worker's exception's class.
_MADE: dict[type, Optional[type]] = {}


def _made(original: Optional[type]) -> Optional[type]:
    """``WorkerError[original]``, a subclass of both, made once; ``None`` where it cannot be."""
    if original is None or not issubclass(original, Exception) or issubclass(original, WorkerError):
        return None
    if original not in _MADE:
        try:
            _MADE[original] = type(
                f"WorkerError[{original.__qualname__}]",
                (WorkerError, original),
                {"__module__": __name__, "__qualname__": f"WorkerError[{original.__qualname__}]"},
            )
        except TypeError:  # its instances' layout conflicts with this one's (some built-in classes)
            _MADE[original] = None
    return _MADE[original]


def _original(failure: WorkerFailure) -> Optional[BaseException]:
    """The worker's exception, read back here, or ``None`` where it did not pickle or cannot be read."""
    if failure.pickled is None:
        return None
    try:
        original = pickle.loads(failure.pickled)
    except Exception:  # anything reading it back raises: its class is then found by name only
        return None
    return original if isinstance(original, BaseException) else None


def _under_monarch(message: str) -> str:
    """The fix under strategy='monarch' where a worker's error names a fix for ``strategy="ddp"``."""
    if "find_unused_parameters" in message:
        return (
            "\n\nUnder strategy='monarch', the workers' DDP takes the same keyword:"
            " `Trainer(strategy=MonarchStrategy(find_unused_parameters=True))`, or by name"
            " `Trainer(strategy='monarch_find_unused_parameters_true')` (`'ddp_monarch_find_unused_parameters_true'`"
            " for a library that reads `ddp` in the name)."
        )
    return ""


class MeshFailureError(RuntimeError):
    """A worker process or the mesh failed: a process died (killed, out of memory, crashed), or
    Monarch reported the mesh broken. ``ranks`` names the workers concerned, where known."""

    def __init__(self, message: str, ranks: tuple[int, ...] = (), detected_at: Optional[float] = None) -> None:
        super().__init__(message)
        self.ranks = ranks
        #: When the controller saw the failure (``time.monotonic()``).
        self.detected_at = time.monotonic() if detected_at is None else detected_at


class HostsLostError(MeshFailureError):
    """Hosts of the mesh were lost: their workers died, and their worker address refuses
    connections or no new process started on them within ``MonarchStrategy(connect_timeout=...)``.
    ``hosts`` names them by their place among the
    ``num_hosts`` hosts the mesh started on (the order of ``MonarchStrategy(hosts=...)``). Under
    ``MonarchStrategy(min_nodes=...)`` a ``fit`` goes on without them while enough hosts remain
    (``controller.features.elastic``); otherwise this is the error the run ends with. ``why``
    says how they were found lost (their address refuses connections, or no process started)."""

    def __init__(
        self,
        message: str,
        ranks: tuple[int, ...],
        hosts: tuple[int, ...],
        num_hosts: int,
        detected_at: float,
        why: str = "",
    ) -> None:
        super().__init__(message, ranks, detected_at)
        self.hosts = hosts
        self.num_hosts = num_hosts
        self.why = why


class WorkerTimeoutError(MeshFailureError):
    """Workers did not answer within ``MonarchStrategy(step_timeout=...)``: alive but stuck, for
    example in a collective that a peer never joined. ``ranks`` names those that did not answer."""


class _Misconfiguration(Exception):
    """Where :class:`UnreachableHostsError` takes Lightning's ``MisconfigurationException`` until
    a namespace's install step gives it (:func:`count_as_misconfiguration`)."""


class UnreachableHostsError(_Misconfiguration):
    """The workers' hosts did not connect to the controller at ``Trainer(...)`` time; the message
    names the addresses that do not accept a connection. A ``MisconfigurationException`` of each
    Lightning namespace installed in this process (each has its own class of that name)."""


def count_as_misconfiguration(exception: type[Exception]) -> None:
    """Make :class:`UnreachableHostsError` a subclass of ``exception`` too: a namespace's
    ``MisconfigurationException``, given by that namespace's install step on the controller."""
    bases = tuple(base for base in UnreachableHostsError.__bases__ if base is not _Misconfiguration)
    if exception not in bases:
        UnreachableHostsError.__bases__ = (*bases, exception)


class DivergenceError(RuntimeError):
    """The controller's Lightning loop and the workers' reached different hooks, or the controller
    changed or read what the workers had already moved past (R3, R6). The message names where."""


class ValidationFailedWarning(UserWarning):
    """A validation that ran asynchronously (``MonarchStrategy(validation="async")``) failed on the
    validation workers: it has no results, and the ``fit`` goes on. To end the ``fit`` with it
    instead, as a synchronous validation's error would: ``warnings.simplefilter("error",
    lightning_monarch.ValidationFailedWarning)``."""


class SharedAttributeError(RuntimeError):
    """Raised on a validation worker (``MonarchStrategy(validation="async")``) where a validation
    hook changed a plain attribute of the module that training hooks change too
    (``worker.module_attributes``); the controller ends the ``fit`` with it, as the ``WorkerError``
    that names it, not as a failed validation."""


class PreflightError(RuntimeError):
    """Workers failed their checks before the first step (``lightning-monarch preflight`` runs the
    same checks alone); the message lists every problem, by host and rank."""


class RehearsalError(RuntimeError):
    """A rehearsal (``lightning_monarch.rehearse``, ``MonarchStrategy(rehearse=True)``) failed on a
    worker: the message names the rank, the hook and the memory the worker had in use then;
    ``failure`` has its traceback."""

    def __init__(self, message: str, failure: WorkerFailure) -> None:
        super().__init__(f"{message}\n\nRemote traceback (rank {failure.rank}):\n{failure.traceback}")
        self.failure = failure
