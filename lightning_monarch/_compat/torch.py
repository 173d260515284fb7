"""The door to torch's private API: every private torch name lightning_monarch uses.

Checked against torch 2.13 (:data:`CHECKED_WITH`); ``tests/test_compat.py`` resolves every name in
:data:`PRIVATE_NAMES`. Used on both sides.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "CHECKED_WITH",
    "CheckpointWrapper",
    "amdsmi_handle",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "default_store",
    "raw_gpu_count",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "wrapped_module",
]

#: The torch release this door was last checked against.
CHECKED_WITH = "torch 2.13"
#: Every private attribute this module reads, by the module or class that has it.
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "torch.cuda": ("_raw_device_count_nvml", "_raw_device_count_amdsmi", "_get_amdsmi_handler"),
    "CheckpointWrapper": ("_checkpoint_wrapped_module",),
    "torch.distributed.distributed_c10d": ("_get_default_store",),
}


def wrapped_module(wrapper: CheckpointWrapper) -> nn.Module:
    """The module a ``checkpoint_wrapper`` wraps."""
    return wrapper._checkpoint_wrapped_module


def raw_gpu_count(rocm: bool) -> int:
    """AMD SMI's (``rocm``) or NVML's count of this host's GPUs, which ignores the visibility
    variables and initializes no GPU; negative when the library gives none. Raises
    ``OSError``/``RuntimeError`` without the library."""
    counter = torch.cuda._raw_device_count_amdsmi if rocm else torch.cuda._raw_device_count_nvml
    return counter()


def amdsmi_handle() -> Any:
    """AMD SMI's handle of this process's current GPU, as ``torch.cuda``'s own readers get it."""
    return torch.cuda._get_amdsmi_handler()


def default_store() -> dist.Store:
    """The store of this process's default ``torch.distributed`` group, which every rank shares."""
    return dist.distributed_c10d._get_default_store()
