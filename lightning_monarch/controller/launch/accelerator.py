"""The controller's stand-in for the workers' GPUs.

Runs on the controller. Lightning checks that the accelerator is available on the machine that
builds the Trainer; under strategy="monarch" that machine is the controller, which needs no GPU
and must not initialize one. ``accelerator="gpu"`` or ``"cuda"`` with strategy="monarch" becomes
this accelerator, and the workers use CUDA (or HIP, on a ROCm build of torch) themselves.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_monarch.devices import gpu_build


class WorkerGPUAccelerator(Accelerator):
    """Runs on the controller: names the workers' GPUs without touching a GPU here."""

    @override
    def setup_device(self, device: torch.device) -> None:
        """The controller keeps its model mirror on the CPU."""

    @override
    def teardown(self) -> None:
        """Nothing was set up on the controller."""

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}

    @staticmethod
    @override
    def parse_devices(devices: Union[int, str, list[int]]) -> Union[int, list[int]]:
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
            return devices
        if isinstance(devices, (list, tuple)) and devices and all(isinstance(d, int) and d >= 0 for d in devices):
            return list(devices)
        raise MisconfigurationException(
            f"`Trainer(strategy='monarch', accelerator='gpu', devices={devices!r})`: `devices` must be the number of"
            " GPU workers per host as a positive int (e.g. `devices=8`) or a list of GPU indices (e.g. `devices=[0, 1]`)."
        )

    @staticmethod
    @override
    def get_parallel_devices(devices: Union[int, list[int]]) -> list[torch.device]:
        indices = range(devices) if isinstance(devices, int) else devices
        return [torch.device("cuda", index) for index in indices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        raise MisconfigurationException(
            "`Trainer(strategy='monarch', accelerator='gpu', devices='auto')`: the controller cannot count the"
            " workers' GPUs. Pass the number of GPUs per host, e.g. `devices=8`."
        )

    @staticmethod
    @override
    def is_available() -> bool:
        """Whether this process's torch is a CUDA or ROCm build. The controller needs no GPU, but the
        workers run the controller's torch build (preflight compares their versions), and a CPU
        build of torch cannot drive a GPU there either."""
        return gpu_build()

    @staticmethod
    def check_available(accelerator: str) -> None:
        """Raise, naming the fix, if GPU workers cannot run with this process's torch build."""
        if not gpu_build():
            raise MisconfigurationException(
                f"`Trainer(strategy='monarch', accelerator={accelerator!r})`: this process's torch ({torch.__version__})"
                " is a CPU-only build. The controller needs no GPU, but the workers run the same torch build as the"
                " controller (preflight compares their versions), and a CPU build cannot use their GPUs. Install a"
                " CUDA or ROCm build of torch here and on the workers' hosts, or use `accelerator='cpu'`."
            )

    @staticmethod
    @override
    def name() -> str:
        return "monarch_gpu"
