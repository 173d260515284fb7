"""One benchmark run: one mode, one model size; writes its figures as JSON.

    python -m benchmarks.run_one --mode monarch --size small --steps 200 --out result.json

Modes: ``monarch`` (2 workers), ``ddp`` (Lightning's subprocess launcher, as torchrun users run
it), ``ddp_spawn``, and ``torch`` (a plain PyTorch DDP loop without Lightning: the floor).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Any

import lightning as L
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from benchmarks.models import SIZES, BenchModel, make_dataset, make_network

WARMUP_STEPS = 5


def peak_rss_mib(pid: int | None = None) -> float:
    """Peak resident memory (VmHWM) of a process, in MiB."""
    path = f"/proc/{pid or os.getpid()}/status"
    with open(path) as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepClock(L.Callback):
    """Records when each training batch ends; on the controller or on DDP's rank 0. Rank 0 writes
    the times to the file ``BENCHMARK_CLOCK`` names when training ends."""

    def __init__(self) -> None:
        self.batch_ends: list[float] = []
        self.worker_peak_rss: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch_ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        workers = [p for p in psutil.Process().children(recursive=True) if "bootstrap_main" in " ".join(p.cmdline())]
        self.worker_peak_rss = [peak_rss_mib(p.pid) for p in workers] or [peak_rss_mib()]
        if trainer.is_global_zero:  # ddp_spawn's rank 0 is not the process that called fit
            with open(os.environ["BENCHMARK_CLOCK"], "w") as handle:
                json.dump({"batch_ends": self.batch_ends, "worker_peak_rss": self.worker_peak_rss}, handle)


def step_seconds(batch_ends: list[float]) -> float:
    intervals = [b - a for a, b in zip(batch_ends[WARMUP_STEPS:], batch_ends[WARMUP_STEPS + 1 :])]
    return statistics.median(intervals)


#: Where the Lightning modes run: ``--accelerator gpu --devices 1`` on a GPU machine.
DEVICE = {"accelerator": "cpu", "devices": 2}


def timed_fit(mode: str, size: str, steps: int, out: str) -> tuple[L.Trainer, BenchModel, dict[str, Any]]:
    """One ``fit`` of ``steps`` steps; rank 0's clock (written by ``StepClock``) when this is rank 0."""
    os.environ["BENCHMARK_CLOCK"] = out
    model = BenchModel(size, batches=steps + WARMUP_STEPS + 2)
    trainer = L.Trainer(
        strategy=mode, **DEVICE, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[StepClock()],
    )
    started = time.perf_counter()
    trainer.fit(model)
    measured: dict[str, Any] = {"fit_s": time.perf_counter() - started}
    if trainer.is_global_zero:
        with open(out) as handle:
            clock = json.load(handle)
        measured.update(first_step_s=clock["batch_ends"][0] - started, batch_ends=clock["batch_ends"],
                        worker_peak_rss_mib=clock["worker_peak_rss"])
    return trainer, model, measured


def run_lightning(mode: str, size: str, steps: int, out: str) -> dict[str, Any]:
    """A cold ``fit`` (new processes), a warm one (a new Trainer in the same process: ``monarch``
    keeps its mesh, ``ddp`` its ranks, ``ddp_spawn`` starts new ones), then validate and predict."""
    _, model, cold = timed_fit(mode, size, steps, out + ".cold")
    result: dict[str, Any] = {"fit_s": cold["fit_s"], "controller_peak_rss_mib": peak_rss_mib()}  # one training run
    trainer, _, warm = timed_fit(mode, size, WARMUP_STEPS + 2, out + ".warm")
    if trainer.is_global_zero:
        result.update(
            step_ms=1000 * step_seconds(cold["batch_ends"]),
            first_step_s=cold["first_step_s"],
            warm_first_step_s=warm["first_step_s"],
            worker_peak_rss_mib=cold["worker_peak_rss_mib"],
        )
    batches = min(steps, 40)
    samples = DEVICE["devices"] * batches * SIZES[size][3]
    eval_trainer = L.Trainer(strategy=mode, **DEVICE, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=batches, limit_predict_batches=batches)
    started = time.perf_counter()
    eval_trainer.validate(model, verbose=False)
    result["validate_samples_per_s"] = samples / (time.perf_counter() - started)
    started = time.perf_counter()
    eval_trainer.predict(model)
    result["predict_samples_per_s"] = samples / (time.perf_counter() - started)
    return result if trainer.is_global_zero else {}


def _torch_rank(rank: int, size: str, steps: int, port: int, out: str) -> None:
    torch.set_num_threads(1)  # one core per rank, as Lightning's DDP sets for 2 ranks on 2 cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(make_network(size))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dataset = make_dataset(size, steps + WARMUP_STEPS + 2)
    loader = DataLoader(dataset, batch_size=SIZES[size][3], sampler=DistributedSampler(dataset, 2, rank, shuffle=False))
    batch_ends = []
    for step, (x, y) in enumerate(loader):
        if step >= steps:
            break
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        loss.item()
        batch_ends.append(time.perf_counter())
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"step_ms": 1000 * step_seconds(batch_ends), "worker_peak_rss_mib": [peak_rss_mib()]}, handle)
    dist.barrier()
    # Skip interpreter teardown: destroying DDP's reducer and the gloo group at exit can deadlock
    # in torch 2.13 (the reducer's destructor joins a gloo thread that waits for the GIL).
    os._exit(0)


def run_torch(size: str, steps: int, out: str) -> None:
    port = 29500 + os.getpid() % 1000
    started = time.perf_counter()
    mp.spawn(_torch_rank, args=(size, steps, port, out), nprocs=2)
    with open(out) as handle:
        result = json.load(handle)
    result["fit_s"] = time.perf_counter() - started
    with open(out, "w") as handle:
        json.dump(result, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["monarch", "ddp", "ddp_spawn", "torch"], required=True)
    parser.add_argument("--size", choices=list(SIZES), required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", required=True)
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu for the Lightning modes")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    DEVICE.update(accelerator=args.accelerator, devices=args.devices)
    torch.set_num_threads(1)
    if args.mode == "torch":
        run_torch(args.size, args.steps, args.out)
        return
    result = run_lightning(args.mode, args.size, args.steps, args.out)
    if result:
        with open(args.out, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
