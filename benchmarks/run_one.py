"""One benchmark run: one mode, one model size, one scenario; writes its figures as JSON.

    python -m benchmarks.run_one --mode monarch --size small --steps 200 --out result.json [--scenario steady]

Modes: ``monarch`` (2 workers), ``ddp`` (Lightning's subprocess launcher, as torchrun users run
it), ``ddp_spawn``, and ``torch`` (a plain PyTorch DDP loop without Lightning: the floor). The
model and the timed ``fit`` are ``lightning_monarch.benchmark``'s, which ``lightning-monarch
benchmark`` uses too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import lightning as L
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from lightning_monarch.benchmark.measure import WARMUP_STEPS, add_arguments, peak_rss_mib, step_seconds, timed_fit
from lightning_monarch.benchmark.models import SIZES, BenchModel, SleepingModel, make_dataset, make_network


def run_steady(mode: str, size: str, steps: int, out: str, accelerator: str, devices: int) -> dict[str, Any]:
    """A cold ``fit`` (new processes), a warm one (a new Trainer in the same process: ``monarch``
    keeps its mesh, ``ddp`` its ranks, ``ddp_spawn`` starts new ones), then validate and predict."""
    _, model, cold = timed_fit(mode, size, steps, out + ".cold", accelerator, devices)
    result: dict[str, Any] = {"fit_s": cold["fit_s"], "controller_peak_rss_mib": peak_rss_mib()}  # one training run
    trainer, _, warm = timed_fit(mode, size, WARMUP_STEPS + 2, out + ".warm", accelerator, devices)
    if trainer.is_global_zero:
        result.update(
            step_ms=1000 * step_seconds(cold["batch_ends"]),
            first_step_s=cold["first_step_s"],
            warm_first_step_s=warm["first_step_s"],
            worker_peak_rss_mib=cold["worker_peak_rss_mib"],
        )
    batches = min(steps, 40)
    samples = devices * batches * SIZES[size][3]
    seconds = _timed_evaluation(_eval_trainer(mode, accelerator, devices, batches), model)
    result["validate_samples_per_s"] = samples / seconds["validate_s"]
    result["predict_samples_per_s"] = samples / seconds["predict_s"]
    return result if trainer.is_global_zero else {}


def _timed_evaluation(eval_trainer: L.Trainer, model: BenchModel) -> dict[str, float]:
    """The seconds one ``validate`` and then one ``predict`` of ``model`` take."""
    started = time.perf_counter()
    eval_trainer.validate(model, verbose=False)
    validated = time.perf_counter()
    eval_trainer.predict(model)
    return {"validate_s": validated - started, "predict_s": time.perf_counter() - validated}


def _eval_trainer(mode: str, accelerator: str, devices: int, batches: int) -> L.Trainer:
    """A new Trainer for ``validate`` and ``predict`` of ``batches`` batches (in the same processes
    as the ``fit`` before it: ``monarch`` keeps its mesh, ``ddp`` its ranks)."""
    return L.Trainer(
        strategy=mode,
        accelerator=accelerator,
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=batches,
        limit_predict_batches=batches,
    )


def run_stages(mode: str, size: str, out: str, accelerator: str, devices: int) -> dict[str, Any]:
    """What a user of a large model waits for per stage: a cold ``fit`` to its first finished step
    (new processes; 2 steps), then, warm (the same processes, a new Trainer), ``validate`` and
    ``predict`` of 2 small batches, 3 times each; the medians."""
    trainer, model, cold = timed_fit(mode, size, 2, out + ".cold", accelerator, devices)
    eval_trainer = _eval_trainer(mode, accelerator, devices, 2)
    calls = [_timed_evaluation(eval_trainer, model) for _ in range(3)]
    if not trainer.is_global_zero:
        return {}
    result = {name: statistics.median(call[name] for call in calls) for name in calls[0]}
    sent = getattr(eval_trainer.strategy, "sent_bytes", None)
    return {
        **result,
        "first_step_s": cold["first_step_s"],
        **({"predict_sent_mib": sum(sent.values()) / 2**20} if sent is not None else {}),
    }


def run_timed(
    mode: str,
    size: str,
    steps: int,
    out: str,
    accelerator: str,
    devices: int,
    clock: str = "steps",
    callbacks: Sequence[L.Callback] = (),
) -> dict[str, Any]:
    """One cold ``fit``, its steady time per step timed by ``clock`` (``measure.timed_fit``)."""
    trainer, _, measured = timed_fit(mode, size, steps, out + ".clock", accelerator, devices, clock, callbacks)
    return (
        {"step_ms": 1000 * step_seconds(measured["batch_ends"]), "fit_s": measured["fit_s"]}
        if trainer.is_global_zero
        else {}
    )


def run_defaults(mode: str, size: str, out: str, accelerator: str, devices: int) -> dict[str, Any]:
    """A whole cold ``fit`` as users run it, with Lightning's defaults: progress bar, model summary,
    ``ModelCheckpoint``, a CSV logger, the sanity check and validation every epoch; 4 epochs of
    60 batches per rank and 20 validation batches."""
    torch.manual_seed(0)
    model = BenchModel(size, batches=devices * 60)
    trainer = L.Trainer(
        strategy=mode,
        accelerator=accelerator,
        devices=devices,
        max_epochs=4,
        limit_val_batches=20,
        default_root_dir=out + ".root",
        logger=CSVLogger(out + ".root"),
    )
    started = time.perf_counter()
    trainer.fit(model)
    return {"fit_s": time.perf_counter() - started} if trainer.is_global_zero else {}


#: How long the controller's CPU time is measured on an idle mesh (``run_controller_cpu``).
IDLE_S = 10.0
#: The two fits whose difference is the measured batches (``run_controller_cpu``).
_CONTROLLER_CPU_STEPS = (50, 250)


def run_controller_cpu(size: str, out: str, devices: int) -> dict[str, Any]:
    """The controller's CPU time per training batch under ``monarch`` (every thread of its process,
    Monarch's included): the difference between a 250-step and a 50-step ``fit`` on a warm mesh,
    over the 200 steps between them. The workers' steps sleep (``SleepingModel``), as GPU workers
    wait for their devices, so that with many workers on few cores their steps stay as long.

    Also the controller's CPU time per second while the mesh stands idle (``IDLE_S`` after the
    warm-up): Monarch's supervision poll of every worker process (once a second,
    ``controller.install.SUPERVISION_POLL``), a cost per worker and per second, not per batch;
    ``beyond_idle_ms_per_batch`` is the per-batch figure without it."""
    timed_fit("monarch", size, 20, out + ".warmup", "cpu", devices, model_class=SleepingModel)
    before = _cpu_seconds()
    time.sleep(IDLE_S)
    idle_per_s = (_cpu_seconds() - before) / IDLE_S
    used, walls = [], []
    for steps in _CONTROLLER_CPU_STEPS:
        before, started = _cpu_seconds(), time.perf_counter()
        timed_fit("monarch", size, steps, out + f".{steps}", "cpu", devices, model_class=SleepingModel)
        walls.append(time.perf_counter() - started)
        used.append(_cpu_seconds() - before)
    batches = _CONTROLLER_CPU_STEPS[1] - _CONTROLLER_CPU_STEPS[0]
    idle_share = idle_per_s * (walls[1] - walls[0])
    return {
        "controller_cpu_ms_per_batch": 1000 * (used[1] - used[0]) / batches,
        "beyond_idle_ms_per_batch": 1000 * (used[1] - used[0] - idle_share) / batches,
        "idle_ms_per_s": 1000 * idle_per_s,
        "step_ms": 1000 * (walls[1] - walls[0]) / batches,
        "devices": devices,
    }


def _cpu_seconds() -> float:
    """This process's CPU time so far, user and system, every thread."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


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


#: What one run measures: ``steady`` (throughput, start-up, memory, validate and predict), ``observed``
#: (throughput with an observe-only clock on the controller), ``checkpointed`` (throughput with
#: ``ModelCheckpoint(every_n_train_steps=10)``), ``defaults`` (a whole fit with Lightning's
#: defaults), ``stages`` (a large model's stages: its first step cold, warm validate and predict),
#: ``controller_cpu`` (``monarch`` only: the controller's CPU time per batch, workers sleeping).
SCENARIOS = ("steady", "observed", "checkpointed", "defaults", "stages", "controller_cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=SCENARIOS, default="steady")
    args = add_arguments(parser, ("monarch", "ddp", "ddp_spawn", "torch")).parse_args()
    torch.set_num_threads(1)
    if args.mode == "torch":
        run_torch(args.size, args.steps, args.out)
        return
    work = args.out  # a prefix for the run's files, the same on every rank: the path run.py gives
    if args.scenario == "steady":
        result = run_steady(args.mode, args.size, args.steps, work, args.accelerator, args.devices)
    elif args.scenario == "observed":
        result = run_timed(args.mode, args.size, args.steps, work, args.accelerator, args.devices, clock="controller")
    elif args.scenario == "checkpointed":
        checkpoint = ModelCheckpoint(dirpath=work + ".checkpoints", every_n_train_steps=10)
        result = run_timed(
            args.mode, args.size, args.steps, work, args.accelerator, args.devices, callbacks=[checkpoint]
        )
    elif args.scenario == "defaults":
        result = run_defaults(args.mode, args.size, work, args.accelerator, args.devices)
    elif args.scenario == "stages":
        result = run_stages(args.mode, args.size, work, args.accelerator, args.devices)
    else:
        result = run_controller_cpu(args.size, work, args.devices)
    if result:
        with open(args.out, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
