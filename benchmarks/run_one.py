"""One benchmark run: one mode, one model size; writes its figures as JSON.

    python -m benchmarks.run_one --mode monarch --size small --steps 200 --out result.json

Modes: ``monarch`` (2 workers), ``ddp`` (Lightning's subprocess launcher, as torchrun users run
it), ``ddp_spawn``, and ``torch`` (a plain PyTorch DDP loop without Lightning: the floor). The
model and the timed ``fit`` are ``lightning_monarch.benchmark``'s, which ``lightning-monarch
benchmark`` uses too.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from lightning_monarch.benchmark.measure import WARMUP_STEPS, add_arguments, peak_rss_mib, step_seconds, timed_fit
from lightning_monarch.benchmark.models import SIZES, make_dataset, make_network


def run_lightning(mode: str, size: str, steps: int, out: str, accelerator: str, devices: int) -> dict[str, Any]:
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
    eval_trainer = L.Trainer(strategy=mode, accelerator=accelerator, devices=devices, logger=False, enable_progress_bar=False,
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
    args = add_arguments(parser, ("monarch", "ddp", "ddp_spawn", "torch")).parse_args()
    torch.set_num_threads(1)
    if args.mode == "torch":
        run_torch(args.size, args.steps, args.out)
        return
    result = run_lightning(args.mode, args.size, args.steps, args.out, args.accelerator, args.devices)
    if result:
        with open(args.out, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
