"""The checks a worker makes on itself before the first step.

Runs in each worker process, on the endpoint thread, before any stage. It reports what this
process sees (device, memory, versions) and tries one all-reduce across the mesh, so that a wrong
device, mismatched versions or a broken interconnect show up at once, by host and rank, instead
of as a hang or an obscure error deep in the first step.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lightning_monarch.devices import host_gpu_count, visibility
from lightning_monarch.wire.reports import WorkerReport
from lightning_monarch.wire.specs import PreflightSpec, versions
from lightning_monarch.worker import process

#: AMD's RCCL usage tips: peer-to-peer between PCIe-connected GPUs needs this set to 1.
RCCL_TIPS = "https://rocm.docs.amd.com/projects/rccl/en/latest/how-to/rccl-usage-tips.html"
#: AMD's multi-GPU guidance on the IOMMU (known issue "Application hangs on Multi-GPU systems").
MULTI_GPU_IOMMU = "https://rocm.docs.amd.com/projects/radeon-ryzen/en/latest/docs/install/native_linux/mgpu.html"


def inspect_worker(spec: PreflightSpec) -> WorkerReport:
    """Check this worker against ``spec``; a failed check is a problem in the report, not an
    exception, so that the controller can list every problem of every worker at once."""
    problems = [
        f"{name} {mine} here, {theirs} on the controller"
        for name, mine in versions().items()
        if (theirs := spec.versions.get(name)) != mine
    ]
    device, memory = "cpu", None
    visible = visibility(os.environ)
    warnings: list[str] = []
    if spec.accelerator == "cuda":
        count = torch.cuda.device_count()
        if process.pinning_problem is not None:
            problems.append(process.pinning_problem)
        elif count != 1:
            problems.append(device_problem(count, visible, host_gpu_count()))
        if count:
            properties = torch.cuda.get_device_properties(0)
            device, memory = properties.name, properties.total_memory / 2**30
        if torch.version.hip is not None and spec.process_group_backend in (None, "nccl"):
            warnings = rccl_warnings(os.environ, _read("/proc/cmdline"), _iommu_enabled())
    all_reduce_s = None
    try:
        all_reduce_s = _time_all_reduce(spec)
        if all_reduce_s > spec.all_reduce_limit_s:
            problems.append(
                f"an all-reduce of {spec.all_reduce_mib:g} MiB took {all_reduce_s:.2f} s,"
                f" over the {spec.all_reduce_limit_s:g} s limit"
            )
    except Exception as error:  # reported with the others; the controller raises once for all
        problems.append(f"the all-reduce failed: {type(error).__name__}: {error}")
    return WorkerReport(
        rank=int(os.environ.get("RANK", "0")),
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        device_memory_gib=memory,
        versions=versions(),
        visible_devices=visible,
        all_reduce_s=all_reduce_s,
        problems=problems,
        warnings=warnings,
    )


def device_problem(count: int, visible: Mapping[str, str], host_gpus: Optional[int]) -> str:
    """What is wrong when a GPU worker sees ``count`` devices instead of its one."""
    pinned = ", ".join(f"{name}={value}" for name, value in visible.items()) or "no visibility variable"
    if count > 1:
        return f"sees {count} GPUs, expected exactly 1 (its own; {pinned}): its visibility variable did not reach it"
    if host_gpus is None:
        return (
            f"sees no GPU ({pinned}): more `devices` asked for than this host has, or no GPU driver here;"
            " `lightning-monarch preflight --accelerator gpu` on this host lists what it has"
        )
    return (
        f"sees no GPU ({pinned}): this host has {host_gpus} GPU(s), fewer than `devices` asks for; use"
        f" `devices={host_gpus}` or fewer per host"
    )


def rccl_warnings(environ: Mapping[str, str], kernel_cmdline: str, iommu_enabled: bool) -> list[str]:
    """The settings AMD documents as causes of RCCL hangs, as found on this host."""
    warnings = []
    if environ.get("HSA_FORCE_FINE_GRAIN_PCIE") != "1":
        warnings.append(
            "HSA_FORCE_FINE_GRAIN_PCIE is not 1: with GPUs connected over PCIe (not xGMI), RCCL's peer-to-peer"
            f" transport needs it, and DDP without it can hang in its first all-reduce ({RCCL_TIPS})"
        )
    if iommu_enabled and "iommu=pt" not in kernel_cmdline.split():
        warnings.append(
            "the IOMMU is on without `iommu=pt` on the kernel command line; AMD lists the IOMMU setting under"
            f" multi-GPU applications that hang, see its guidance ({MULTI_GPU_IOMMU})"
        )
    return warnings


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _iommu_enabled() -> bool:
    groups = Path("/sys/kernel/iommu_groups")
    return groups.is_dir() and any(groups.iterdir())


def _time_all_reduce(spec: PreflightSpec) -> float:
    """Seconds for one all-reduce across the mesh, after a warm-up one. Starts the default process
    group (with the backend Lightning's DDP would pick) if no stage has yet; the stages then use it."""
    cuda = spec.accelerator == "cuda"
    process.ensure_process_group(spec.accelerator, spec.process_group_backend, spec.timeout)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tensor = torch.ones(int(spec.all_reduce_mib * 2**20 / 4), device=device)
    dist.all_reduce(tensor[:1])
    if cuda:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    dist.all_reduce(tensor)
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
