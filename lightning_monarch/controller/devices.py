"""Which GPU each worker process sees: its device-visibility environment.

Runs on the controller, before the worker processes start; it reads the controller's environment
and ``torch.version.hip`` and never initializes a GPU. Each worker is pinned to one device through
its process environment: ``CUDA_VISIBLE_DEVICES`` on NVIDIA; on ROCm ``HIP_VISIBLE_DEVICES``, or
whichever visibility variable the user already narrowed the devices with (a ROCm build of torch
honours ``CUDA_VISIBLE_DEVICES`` too, and ``ROCR_VISIBLE_DEVICES`` acts lower in the stack). A
worker gets one variable only: never ``HIP_VISIBLE_DEVICES`` together with
``ROCR_VISIBLE_DEVICES``: they compose (the second counts within what the first leaves), so an
index meant for one gives a worker a wrong GPU or none. A
mask the user set (``CUDA_VISIBLE_DEVICES=2,3``) is respected: device ``i`` of ``devices=...`` is
the ``i``-th device of the mask. Each worker then sees its device as ``cuda:0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch.protocol import VISIBILITY_VARS
_ROCM_DEFAULT = "HIP_VISIBLE_DEVICES"


def pinned_environments(device_indices: list[int], environ: Mapping[str, str], rocm: bool) -> list[dict[str, str]]:
    """The visibility variable each local worker gets, in local-rank order.

    ``device_indices`` are the ``devices=`` indices (``devices=2`` is ``[0, 1]``), counted within
    what the user's mask, if any, makes visible.
    """
    variable = _visibility_variable(environ, rocm)
    mask = environ.get(variable)
    visible = [device.strip() for device in mask.split(",") if device.strip()] if mask is not None else None
    environments = []
    for index in device_indices:
        if visible is not None and index >= len(visible):
            raise MisconfigurationException(
                f"`Trainer(strategy='monarch', accelerator='gpu', devices=...)` asks for GPU index {index}, but"
                f" {variable}={mask!r} makes only {len(visible)} GPU(s) visible on this host. Ask for at most"
                f" {len(visible)} devices, or widen {variable}."
            )
        environments.append({variable: visible[index] if visible is not None else str(index)})
    return environments


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
