"""Sharded-workers benchmark: per-worker memory and time per step of ``MonarchFSDPStrategy``
against ``ddp`` replicas, and of ``MonarchModelParallelStrategy`` (tensor parallel) against
Lightning's ``ModelParallelStrategy`` with the same layout, for one model too big to ignore.

    python -m benchmarks.sharded [--reps 2] [--steps 12]

Modes, each in fresh processes, alternating (A B C, A B C, ...) so that machine noise hits them
alike; the figures are medians:

- ``monarch_fsdp``: ``MonarchFSDPStrategy(fsdp_policy={nn.Linear})``, 2 workers;
- ``monarch``: ``strategy="monarch"`` (a DDP replica per worker), 2 workers;
- ``ddp``: Lightning's ``strategy="ddp"``, 2 processes;
- ``monarch_model_parallel``: ``MonarchModelParallelStrategy`` at 1×2 (data × tensor): each pair of
  layers split across the 2 workers, the first by columns, the second by rows;
- ``model_parallel``: Lightning's ``ModelParallelStrategy`` with the same layout and plan, 2 processes.

The model is a stack of wide Linear layers trained with Adam, built in ``configure_model`` as
docs/large-models.md advises for large models: on the meta device under sharding and tensor
parallelism (each worker then allocates only its shards), in place under DDP. Rank 0 records:

- the tensors it holds when training ends: parameters, gradients and optimizer state (its shards
  under sharding), counted from the tensors themselves; about 1/N of a replica's under sharding;
- its peak RSS (VmHWM) above its RSS before the model was built: all that the model costs the
  process, the transient all-gathered layers and gradients included. glibc keeps freed blocks of
  up to 32 MiB for reuse, which inflates the peak of the runs that allocate and free whole layers
  every step (FSDP2's gathers); these runs measure memory with ``MALLOC_MMAP_THRESHOLD_`` set, so
  that freed layers go back to the system and the peak shows what was live at once. That slows
  every step, so the time per step comes from separate runs with glibc's default.

Writes ``benchmarks/results/sharded.json``, ``sharded.md`` and ``sharded.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import plots
from lightning_monarch import MonarchFSDPStrategy, MonarchModelParallelStrategy
from lightning_monarch.benchmark.measure import WARMUP_STEPS, peak_rss_mib, step_seconds

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("monarch_fsdp", "monarch", "ddp", "monarch_model_parallel", "model_parallel")
#: The tensor-parallel modes, and the layout both run: (data parallel, tensor parallel).
TENSOR_PARALLEL, LAYOUT = ("monarch_model_parallel", "model_parallel"), (1, 2)
#: 12 square layers of width 2048: 50.4 M parameters, 192 MiB in fp32.
WIDTH, DEPTH, BATCH = 2048, 12, 16
MIB = 2**20
#: For the memory runs: blocks from 1 MiB up are mapped and unmapped, never kept by glibc.
MEMORY_RUN_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MIB)}


class WideMLP(L.LightningModule):
    """``DEPTH`` square Linear layers of ``WIDTH``, built in ``configure_model``; rank 0 records
    its RSS before building them, its peak RSS and the tensors it holds when training ends
    (``rss_mib``)."""

    def __init__(self, batches: int) -> None:
        super().__init__()
        self.batches = batches
        self.rss_mib: dict[str, float] = {}

    def configure_model(self) -> None:
        self.rss_mib["before_model"] = _current_rss_mib()
        # sharded: build on the meta device; Lightning allocates each worker's shards after sharding
        device = torch.device("meta") if self.device_mesh is not None else torch.device("cpu")
        with device:
            self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
        if self.device_mesh is not None and self.device_mesh["tensor_parallel"].size() > 1:
            plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(DEPTH)}
            parallelize_module(self.layers, self.device_mesh["tensor_parallel"], plan)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(batch[0]), batch[1])

    def on_train_end(self) -> None:
        self.rss_mib["peak"] = peak_rss_mib()
        parameters = list(self.parameters())
        gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
        optimizer_state = [
            value
            for state in self.trainer.optimizers[0].state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        self.rss_mib["state"] = _local_mib(parameters + gradients + optimizer_state)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        count = 2 * self.batches * BATCH
        data = TensorDataset(
            torch.randn(count, WIDTH, generator=generator), torch.randn(count, WIDTH, generator=generator)
        )
        return DataLoader(data, batch_size=BATCH)


class BatchClock(L.Callback):
    """When each training batch ends, on the controller or on DDP's rank 0."""

    def __init__(self) -> None:
        self.batch_ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batch_ends.append(time.perf_counter())


def _local_mib(tensors: list[torch.Tensor]) -> float:
    """What ``tensors`` take in this process: a sharded tensor's local shard only."""
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in tensors]
    return sum(tensor.numel() * tensor.element_size() for tensor in local) / MIB


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / MIB


def _strategy(mode: str) -> Any:
    if mode == "monarch_fsdp":
        return MonarchFSDPStrategy(fsdp_policy={nn.Linear})
    if mode == "monarch_model_parallel":
        return MonarchModelParallelStrategy(*LAYOUT)
    if mode == "model_parallel":
        return ModelParallelStrategy(*LAYOUT)
    return mode


def measure(mode: str, steps: int, out: Path) -> None:
    """One ``fit`` of ``steps`` steps under ``mode``; rank 0 writes its figures to ``out``."""
    torch.set_num_threads(1)  # one core per rank in every mode, as Lightning's DDP sets for 2 ranks on 2 cores
    torch.manual_seed(0)
    model, clock = WideMLP(batches=steps), BatchClock()
    trainer = L.Trainer(
        strategy=_strategy(mode),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(model)
    if trainer.is_global_zero:
        out.write_text(
            json.dumps(
                {
                    "step_ms": 1000 * step_seconds(clock.batch_ends),
                    "worker_rss_before_model_mib": model.rss_mib["before_model"],
                    "worker_peak_rss_mib": model.rss_mib["peak"],
                    "worker_model_mib": model.rss_mib["peak"] - model.rss_mib["before_model"],
                    "worker_state_mib": model.rss_mib["state"],
                }
            )
        )


def run_one(mode: str, steps: int, memory: bool) -> dict[str, Any]:
    """One run in fresh processes: the memory run (``MEMORY_RUN_ENV``) or the timed run."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        command = [
            sys.executable,
            "-m",
            "benchmarks.sharded",
            "--measure",
            mode,
            "--steps",
            str(steps),
            "--out",
            str(out),
        ]
        environment = {**os.environ, **(MEMORY_RUN_ENV if memory else {})}
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=RESULTS.parent.parent, timeout=900, env=environment
        )
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{mode} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians per mode: the time per step and what the tensors take from the timed runs, the
    peak RSS from the memory runs (and from the timed runs, with glibc's caching, for reference);
    and monarch_fsdp's ratios to the replicas."""

    def median(kind: str, mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[kind][mode])

    medians = {
        mode: {
            "step_ms": median("timed", mode, "step_ms"),
            "worker_state_mib": median("timed", mode, "worker_state_mib"),
            "worker_peak_rss_mib": median("memory", mode, "worker_peak_rss_mib"),
            "worker_model_mib": median("memory", mode, "worker_model_mib"),
            "worker_model_mib_glibc_default": median("timed", mode, "worker_model_mib"),
        }
        for mode in MODES
    }

    def ratios(ours: str, theirs: str) -> dict[str, float]:
        return {
            "state": medians[ours]["worker_state_mib"] / medians[theirs]["worker_state_mib"],
            "model_memory": medians[ours]["worker_model_mib"] / medians[theirs]["worker_model_mib"],
            "throughput": medians[theirs]["step_ms"] / medians[ours]["step_ms"],
        }

    parameters = DEPTH * WIDTH * (WIDTH + 1)
    return {
        "parameters": parameters,
        # fp32 parameters, gradients and Adam's two moments
        "replica_state_mib": 4 * 4 * parameters / MIB,
        "medians": medians,
        "ratios": {
            "monarch_fsdp over monarch": ratios("monarch_fsdp", "monarch"),
            "monarch_fsdp over ddp": ratios("monarch_fsdp", "ddp"),
            "monarch_model_parallel over model_parallel": ratios(*TENSOR_PARALLEL),
            "monarch_model_parallel over ddp": ratios("monarch_model_parallel", "ddp"),
        },
    }


def table(summary: dict[str, Any]) -> str:
    m = summary["medians"]
    lines = [
        "| mode | ms/step | params + grads + Adam state held (MiB) | peak RSS (MiB) | peak RSS above the start,"
        " freed memory returned / glibc's default (MiB) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {mode} | {m[mode]['step_ms']:.0f} | {m[mode]['worker_state_mib']:.0f} | {m[mode]['worker_peak_rss_mib']:.0f}"
        f" | {m[mode]['worker_model_mib']:.0f} / {m[mode]['worker_model_mib_glibc_default']:.0f} |"
        for mode in MODES
    ]
    lines += ["", "| ratio | state held | peak RSS above the start | throughput |", "|---|---|---|---|"]
    lines += [
        f"| {pair} | {ratios['state']:.2f} | {ratios['model_memory']:.2f} | {ratios['throughput']:.2f} |"
        for pair, ratios in summary["ratios"].items()
    ]
    lines += [
        "",
        f"{summary['parameters'] / 1e6:.1f} M parameters; fp32 parameters, gradients and Adam's two moments of a"
        f" replica: {summary['replica_state_mib']:.0f} MiB. Per worker, rank 0; 2 workers; the tensor-parallel"
        f" modes at {LAYOUT[0]}×{LAYOUT[1]} (data × tensor).",
    ]
    return "\n".join(lines)


def plot(figures: dict[str, Any]) -> Any:
    """Memory per worker and time per step of every mode, ``ddp`` and Lightning's own
    ``model_parallel`` beside the monarch modes."""
    summary = figures["summary"]
    m = summary["medians"]
    figure, (memory, speed) = plots.pyplot().subplots(1, 2, figsize=(13, 4.5))
    width = 0.4
    memory.bar(
        [i - width / 2 for i in range(len(MODES))],
        [m[mode]["worker_state_mib"] for mode in MODES],
        width,
        label="params + grads + Adam state held",
    )
    memory.bar(
        [i + width / 2 for i in range(len(MODES))],
        [m[mode]["worker_model_mib"] for mode in MODES],
        width,
        label="peak RSS above the start",
    )
    memory.set_xticks(range(len(MODES)), MODES, rotation=20, ha="right")
    memory.set_title("memory per worker (rank 0)")
    memory.set_ylabel("MiB per worker")
    memory.set_ylim(0, 1.35 * max(m[mode]["worker_model_mib"] for mode in MODES))
    memory.legend()
    speed.bar(MODES, [m[mode]["step_ms"] for mode in MODES], color=plots.colors(list(MODES)))
    speed.tick_params(axis="x", labelrotation=20)
    speed.set_title("speed (lower is faster; grey: Lightning's own strategies)")
    speed.set_ylabel("ms per training step (median)")
    figure.suptitle(f"{summary['parameters'] / 1e6:.0f} M parameters, Adam, 2 workers on a 2-core CPU")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help=f"training steps; the first {WARMUP_STEPS} are not timed")
    parser.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.steps, args.out)
        return
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        kind: {mode: [] for mode in MODES} for kind in ("timed", "memory")
    }
    for rep in range(args.reps):
        for kind in runs:
            for mode in MODES:
                print(f"[{rep + 1}/{args.reps}] {mode}, {kind} run ...", flush=True)
                runs[kind][mode].append(run_one(mode, args.steps, memory=kind == "memory"))
    summary = summarize(runs)
    RESULTS.mkdir(exist_ok=True)
    figures = {"summary": summary, "runs": runs}
    (RESULTS / "sharded.json").write_text(json.dumps(figures, indent=2))
    (RESULTS / "sharded.md").write_text(table(summary) + "\n")
    plots.save(plot(figures), RESULTS / "sharded.png")
    print(table(summary))


if __name__ == "__main__":
    main()
