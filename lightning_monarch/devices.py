"""Which GPU a worker process sees: one visibility variable, read from its own host's environment.

Shared by both sides, and pure: it reads an environment mapping and ``torch.version.hip`` and never
initializes a GPU. Each GPU worker pins itself when its process starts (``worker.process``), from
the environment its host gave it, so that a mask a scheduler set on each node (SLURM's
``CUDA_VISIBLE_DEVICES``) is respected on that node. The controller computes the same pins for
the workers of its own host, whose processes inherit its environment, to refuse a bad mask before
any worker starts and to tell one warm mesh from another.

The variable: ``CUDA_VISIBLE_DEVICES`` on NVIDIA; on ROCm ``HIP_VISIBLE_DEVICES``, or whichever
visibility variable the host already narrowed the devices with (a ROCm build of torch honours
``CUDA_VISIBLE_DEVICES`` too, and ``ROCR_VISIBLE_DEVICES`` acts lower in the stack). Never two of
them: they compose (the second counts within what the first leaves), so an index meant for one
gives a worker a wrong GPU or none. With a mask (``CUDA_VISIBLE_DEVICES=2,3``), device ``i`` of
``devices=...`` is the ``i``-th device of the mask. The worker then sees its device as ``cuda:0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch._compat import torch as torch_compat

#: The variables that decide which GPUs a process sees, outermost first.
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
_ROCM_DEFAULT = "HIP_VISIBLE_DEVICES"


def visibility(environ: Mapping[str, str]) -> dict[str, str]:
    """The device-visibility variables set in ``environ``, by name."""
    return {name: environ[name] for name in VISIBILITY_VARS if name in environ}


def pin(device_index: int, environ: Mapping[str, str], rocm: bool) -> tuple[str, str]:
    """The visibility variable, and its value, that shows a process on a host with environment
    ``environ`` only the GPU ``device_index`` of ``devices=...`` (counted within the host's mask)."""
    variable = _visibility_variable(environ, rocm)
    mask = environ.get(variable)
    if mask is None:
        return variable, str(device_index)
    visible = [device.strip() for device in mask.split(",") if device.strip()]
    if device_index >= len(visible):
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', accelerator='gpu', devices=...)` asks for GPU index {device_index}, but"
            f" {variable}={mask!r} makes only {len(visible)} GPU(s) visible on this host. Ask for at most"
            f" {len(visible)} devices per host, or widen {variable}."
        )
    return variable, visible[device_index]


def _visibility_variable(environ: Mapping[str, str], rocm: bool) -> str:
    if not rocm:
        return "CUDA_VISIBLE_DEVICES"
    already = [name for name in VISIBILITY_VARS if environ.get(name) is not None]
    if len(already) > 1:
        raise MisconfigurationException(
            f"{' and '.join(f'{name}={environ[name]!r}' for name in already)} are both set. On ROCm they compose"
            " (ROCR_VISIBLE_DEVICES first, then HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES counts within what it"
            " leaves), so an index meant for one leaves a worker with a wrong GPU or none. Set only one of them"
            " before starting the Trainer."
        )
    return already[0] if already else _ROCM_DEFAULT


def host_gpu_count() -> Optional[int]:
    """How many GPUs this host has, whatever this process may see: NVML's or AMD SMI's count,
    which ignore the visibility variables and initialize no GPU; ``None`` where neither library
    is installed."""
    try:
        count = torch_compat.raw_gpu_count(rocm=torch.version.hip is not None)
    except (AttributeError, OSError, RuntimeError):  # an older torch, or no NVML / AMD SMI library
        return None
    return count if count >= 0 else None


def gpu_build() -> bool:
    """Whether this process's torch is a CUDA or ROCm build (``torch.cuda`` works on one)."""
    return torch.version.cuda is not None or torch.version.hip is not None
