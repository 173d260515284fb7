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

import torch
import torch.distributed as dist

from lightning_monarch.protocol import VISIBILITY_VARS, PreflightSpec, WorkerReport, versions

def inspect_worker(spec: PreflightSpec) -> WorkerReport:
    """Check this worker against ``spec``; a failed check is a problem in the report, not an
    exception, so that the controller can list every problem of every worker at once."""
    problems = [
        f"{name} {mine} here, {theirs} on the controller"
        for name, mine in versions().items()
        if (theirs := spec.versions.get(name)) != mine
    ]
    device, memory = "cpu", None
    visible = {name: os.environ[name] for name in VISIBILITY_VARS if name in os.environ}
    if spec.accelerator == "cuda":
        count = torch.cuda.device_count()
        if count != 1:
            pinned = ", ".join(f"{name}={value}" for name, value in visible.items()) or "no visibility variable"
            problems.append(
                f"sees {count} GPUs, expected exactly 1 (its own; {pinned}): more devices asked for than this host"
                " has, or no GPU driver here"
            )
        if count:
            properties = torch.cuda.get_device_properties(0)
            device, memory = properties.name, properties.total_memory / 2**30
    all_reduce_s = None
    try:
        all_reduce_s = _time_all_reduce(spec)
        if all_reduce_s > spec.all_reduce_limit_s:
            problems.append(f"an all-reduce of {spec.all_reduce_mib:g} MiB took {all_reduce_s:.2f} s,"
                            f" over the {spec.all_reduce_limit_s:g} s limit")
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
    )


def _time_all_reduce(spec: PreflightSpec) -> float:
    """Seconds for one all-reduce across the mesh, after a warm-up one. Starts the default process
    group (with the backend Lightning's DDP would pick) if no stage has yet; the stages then use it."""
    cuda = spec.accelerator == "cuda"
    if not dist.is_initialized():
        dist.init_process_group(spec.process_group_backend or ("nccl" if cuda else "gloo"))
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
