"""Preemption notices, as a worker process sees them.

Runs in each worker process. A host served by ``lightning-monarch serve`` (``lightning_monarch.host``)
turns the SIGTERM it gets before it is taken away into a notice file, whose path its worker
processes inherit (``host.NOTICE_VARIABLE``). A worker process of such a host ignores SIGTERM
itself, so that it lives on with its host process, and after each optimizer step of an elastic
``fit`` every worker asks, in one collective, whether any host has a notice (:func:`any_host_noticed`):
where one has, all of them park at that same step's end, and the controller goes on without the
host from there.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.host import NOTICE_VARIABLE

#: ``SIG_IGN`` in C.
_SIG_IGN = ctypes.c_void_p(1)


def serves_notices() -> bool:
    """Whether this process's host serves preemption notices."""
    return NOTICE_VARIABLE in os.environ


def ignore_sigterm() -> None:
    """Make this process ignore SIGTERM, where its host serves notices: the host process takes it
    as the notice and ends the workers when its grace is over. Python's ``signal.signal`` works
    on the main thread only, which a Monarch process keeps to itself; C's ``signal`` sets the
    process's disposition from any thread."""
    if not serves_notices():
        return
    libc: Any = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGTERM, _SIG_IGN)


def noticed() -> bool:
    """Whether this process's host got a preemption notice: the host's notice file (a memory file
    of the host process, ``lightning_monarch.host``) is no longer empty."""
    path = os.environ.get(NOTICE_VARIABLE)
    try:
        return path is not None and os.stat(path).st_size > 0
    except OSError:  # the host process is gone
        return False


def any_host_noticed(trainer: Trainer) -> bool:
    """At the end of a training batch on every rank: whether any rank's host got a preemption notice,
    asked only after an optimizer step (a batch that accumulates gradients is not a step boundary
    to resume from), by an all-reduce that every rank joins at the same batch."""
    if not lightning_compat.stepped_this_batch(trainer) or not (dist.is_available() and dist.is_initialized()):
        return False
    flag = torch.tensor([int(noticed())], device=trainer.strategy.root_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
