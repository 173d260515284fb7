"""Preflight: every worker of a mesh checks itself before the first step.

    lightning-monarch preflight --devices 2 [--accelerator gpu] [--hosts tcp://node-1:26600,...]
        [--num-nodes 2] [--all-reduce-mib 64]

Runs on the controller. ``MonarchLauncher`` runs it on every new mesh before the first stage, with
a small all-reduce; run alone, it starts a mesh as ``Trainer(strategy="monarch", ...)`` would and
prints one row per worker: host, rank, device, memory, versions, visibility and all-reduce
bandwidth. Every problem of every worker is reported in one ``PreflightError``, by host and rank:
a missing or extra device, torch/Lightning/CUDA/HIP versions that differ from the controller's,
an all-reduce that fails or is slower than its limit. On ROCm, the settings AMD documents as
causes of RCCL hangs are reported as warnings.
"""

from __future__ import annotations

import argparse
import logging
from datetime import timedelta
from typing import Optional

from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_warn

from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.controller.settings import settings_of
from lightning_monarch.errors import PreflightError
from lightning_monarch.wire.reports import WorkerReport
from lightning_monarch.wire.specs import PreflightSpec, versions


def check(
    mesh: WorkerMesh,
    accelerator: str,
    process_group_backend: Optional[str],
    all_reduce_mib: float = 1.0,
    all_reduce_limit_s: float = 60.0,
    timeout: Optional[timedelta] = None,
) -> list[WorkerReport]:
    """Check every worker of ``mesh``, whose process group it starts with ``timeout``; raise
    ``PreflightError`` listing all problems, or return the reports in rank order."""
    spec = PreflightSpec(accelerator, process_group_backend, versions(), all_reduce_mib, all_reduce_limit_s, timeout)
    reports = mesh.preflight(spec)
    mesh.checked = True
    _warn_once(reports)
    problems = [
        f"  host {report.host}, rank {report.rank}: {problem}" for report in reports for problem in report.problems
    ]
    if problems:
        raise PreflightError(
            f"{len(problems)} problem(s) on the worker mesh, found before the first step:\n" + "\n".join(problems)
        )
    return reports


def _warn_once(reports: list[WorkerReport]) -> None:
    """Each distinct warning once, with the hosts that have it."""
    hosts: dict[str, set[str]] = {}
    for report in reports:
        for warning in report.warnings:
            hosts.setdefault(warning, set()).add(report.host)
    for warning, where in hosts.items():
        rank_zero_warn(f"strategy='monarch' preflight, on {', '.join(sorted(where))}: {warning}")


def table(reports: list[WorkerReport], all_reduce_mib: float) -> str:
    """The reports as a text table, one row per worker."""
    header = (
        "host",
        "rank",
        "pid",
        "device",
        "memory GiB",
        "torch",
        "lightning",
        "cuda / hip",
        "visible",
        "all-reduce ms",
        "GB/s",
    )
    rows = [header]
    for r in reports:
        seconds = r.all_reduce_s
        rows.append(
            (
                r.host,
                str(r.rank),
                str(r.pid),
                r.device,
                f"{r.device_memory_gib:.0f}" if r.device_memory_gib is not None else "-",
                str(r.versions["torch"]),
                str(r.versions["lightning"]),
                f"{r.versions['cuda'] or '-'} / {r.versions['hip'] or '-'}",
                " ".join(f"{name}={value}" for name, value in r.visible_devices.items()) or "-",
                f"{1000 * seconds:.1f}" if seconds is not None else "failed",
                # bus bandwidth of a ring all-reduce: each rank sends and receives 2 (n-1)/n of the data
                f"{2 * (len(reports) - 1) / len(reports) * all_reduce_mib * 2**20 / seconds / 1e9:.2f}"
                if seconds
                else "-",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser`` the command's options; ``lightning-monarch preflight`` has the same ones."""
    parser.add_argument("--devices", type=int, default=1, help="workers per host, as Trainer(devices=...)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu", "cuda"])
    parser.add_argument(
        "--hosts",
        default=None,
        type=lambda text: [a.strip() for a in text.split(",") if a.strip()],
        help="comma-separated worker addresses of other hosts (tcp://node-1:26600,...), each running"
        " monarch.actor.run_worker_loop_forever; by default this host",
    )
    parser.add_argument("--num-nodes", type=int, default=None, help="as Trainer(num_nodes=...): the number of --hosts")
    parser.add_argument("--process-group-backend", default=None)
    parser.add_argument("--all-reduce-mib", type=float, default=64.0)
    parser.add_argument("--all-reduce-limit-s", type=float, default=60.0)
    return parser


def run(args: argparse.Namespace, strategy: Strategy) -> int:
    """Start ``strategy``'s mesh as its Trainer would, check it and print the table: 0 if every
    worker passed, else 1."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the Trainer's info lines are noise here

    import lightning as L

    from lightning_monarch.controller.mesh.pool import MESHES
    from lightning_monarch.controller.mesh.worker_warnings import WorkerWarnings

    num_nodes = args.num_nodes or (len(args.hosts) if args.hosts else 1)
    trainer = L.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=args.devices, num_nodes=num_nodes, logger=False
    )
    settings = settings_of(trainer.strategy)
    assert settings is not None  # the Trainer keeps the Monarch strategy it was given
    key = settings.mesh_key()
    mesh = MESHES.acquire(key)
    try:
        print(f"Starting {mesh.num_workers} worker(s) and checking them ...", flush=True)
        reports = check(mesh, key.accelerator, key.process_group_backend, args.all_reduce_mib, args.all_reduce_limit_s)
    except PreflightError as error:
        print(error)
        return 1
    finally:
        WorkerWarnings(mesh.num_workers).show_every_rank(mesh.take_warnings())  # what the workers held
        MESHES.release(key, mesh, keep=False, failed=False)
    print(table(reports, args.all_reduce_mib))
    return 0
