"""One timed ``fit`` of the benchmark model under one strategy; writes its figures as JSON.

    python -m lightning_monarch.benchmark.measure --mode ddp --size medium --steps 26 --out result.json

Runs in a fresh process of its own, the controller under ``monarch``, rank 0 under ``ddp``:
Lightning's ``ddp`` re-executes the running command for every other rank, so a measurement cannot
run inside the command that asks for it. ``lightning-monarch benchmark`` starts one of these per
run; the repository's full suite (``benchmarks/run_one.py``) builds on ``timed_fit``.
The first ``WARMUP_STEPS`` steps are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Sequence
from typing import Any, Optional

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from lightning_monarch import MonarchStrategy, observe_only
from lightning_monarch.benchmark.models import SIZES, BenchModel
from lightning_monarch.controller.mesh.forkserver import is_worker_process

WARMUP_STEPS = 5


def peak_rss_mib(pid: Optional[int] = None) -> float:
    """Peak resident memory (VmHWM) of a process, in MiB."""
    path = f"/proc/{pid or os.getpid()}/status"
    with open(path) as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepClock(L.Callback):
    """Records when each training batch ends and writes the times to ``path`` when training ends,
    on the global rank 0 of the Trainer it runs in: DDP's rank 0, or under ``monarch`` worker rank 0
    (a worker callback, where the steps run) or the controller (declared observe-only, to time what
    a user's controller callback sees)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.batch_ends: list[float] = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch_ends.append(time.perf_counter())

    @override
    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:  # ddp_spawn's rank 0 is not the process that called fit
            with open(self.path, "w") as handle:
                json.dump(self.batch_ends, handle)


def step_seconds(batch_ends: list[float]) -> float:
    """The time per training step after the warm-up: the time the steady steps took, over their
    count. A mean, not a median of intervals: a clock on the controller sees the workers' steps in
    bursts, as their entries arrive, and the throughput is what matters."""
    steady = batch_ends[WARMUP_STEPS:]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def worker_peak_rss_mib() -> list[float]:
    """The peak RSS of every Monarch worker process under this one, or this process's own (DDP's
    rank 0, whose other ranks measure alike)."""
    workers = [p for p in psutil.Process().children(recursive=True) if is_worker_process(p)]
    return [peak_rss_mib(p.pid) for p in workers] or [peak_rss_mib()]


def timed_fit(
    mode: str,
    size: str,
    steps: int,
    out: str,
    accelerator: str = "cpu",
    devices: int = 2,
    clock: str = "steps",
    callbacks: Sequence[L.Callback] = (),
    model_class: type[BenchModel] = BenchModel,
) -> tuple[L.Trainer, BenchModel, dict[str, Any]]:
    """One ``fit`` of ``steps`` steps of a model (a ``model_class``) seeded alike in every mode;
    rank 0's clock (written to ``out``) when this is rank 0. ``clock="steps"`` times the steps where
    they run; ``"controller"`` times them on the controller under ``monarch``, with an observe-only
    callback. ``callbacks`` run where Lightning runs them (on the controller under ``monarch``)."""
    torch.manual_seed(0)
    model = model_class(size, batches=steps + WARMUP_STEPS + 2)
    timer = StepClock(out)
    on_workers = mode == "monarch" and clock == "steps"
    trainer = L.Trainer(
        strategy=MonarchStrategy(worker_callbacks=[timer]) if on_workers else mode,
        accelerator=accelerator,
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(callback, Checkpoint) for callback in callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[*([] if on_workers else [observe_only(timer)]), *callbacks],
    )
    started = time.perf_counter()
    trainer.fit(model)
    measured: dict[str, Any] = {"fit_s": time.perf_counter() - started}
    if trainer.is_global_zero:
        with open(out) as handle:
            batch_ends = json.load(handle)
        measured.update(
            first_step_s=batch_ends[0] - started, batch_ends=batch_ends, worker_peak_rss_mib=worker_peak_rss_mib()
        )
    return trainer, model, measured


def add_arguments(parser: argparse.ArgumentParser, modes: Sequence[str]) -> argparse.ArgumentParser:
    """Give ``parser`` the options of one run (this module's and ``benchmarks/run_one.py``'s)."""
    parser.add_argument("--mode", choices=list(modes), required=True)
    parser.add_argument("--size", choices=list(SIZES), required=True)
    parser.add_argument(
        "--steps", type=int, default=100, help=f"training steps; the first {WARMUP_STEPS} are not timed"
    )
    parser.add_argument("--out", required=True, help="the JSON file to write the figures to")
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu for the Lightning modes")
    parser.add_argument("--devices", type=int, default=2)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    args = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), ("monarch", "ddp")).parse_args(
        argv
    )
    torch.set_num_threads(1)  # one core per rank in both modes, as Lightning's DDP sets for 2 ranks on 2 cores
    trainer, _, measured = timed_fit(
        args.mode, args.size, args.steps, args.out + ".clock", args.accelerator, args.devices
    )
    if trainer.is_global_zero:
        with open(args.out, "w") as handle:
            json.dump(
                {
                    "step_ms": 1000 * step_seconds(measured["batch_ends"]),
                    "first_step_s": measured["first_step_s"],
                    "fit_s": measured["fit_s"],
                },
                handle,
            )


if __name__ == "__main__":
    main()
