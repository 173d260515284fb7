"""A small transformer-like model with tensor parallelism on its MLPs and FSDP2 over the data
dimension, as torchtitan lays out 2-D parallelism; and the run that ``tests/test_model_parallel.py``
compares between ``MonarchModelParallelStrategy`` and Lightning's own ``ModelParallelStrategy``.

Usage (the reference, Lightning's strategy on CPU processes, gloo; every rank runs this command,
``tests.references``): ``python -m tests.tensor_parallel ROOT RUN [RUN ...]``, each ``RUN``
``DxT`` or ``DxT:FROM`` (:func:`run_reference`), all of one world size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

SEED = 5


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden)
        self.w2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = MLP(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TensorParallelTransformer(L.LightningModule):
    """Token embeddings, residual MLP blocks and a head over generated token sequences (the next
    token is a fixed function of the current one). ``configure_model`` splits each MLP across the
    tensor-parallel ranks (``w1`` by columns, ``w2`` by rows) and, with more than one data-parallel
    rank, shards each block and the root with FSDP2 over the data dimension. ``losses`` records
    this rank's training loss per step."""

    def __init__(self, vocab: int = 32, width: int = 16, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:  # outside a ModelParallelStrategy: load_from_checkpoint, one process
            return
        for block in self.blocks:
            parallelize_module(block.mlp, mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        if mesh["data_parallel"].size() > 1:
            for block in self.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self, mesh=mesh["data_parallel"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).reshape(-1, self.vocab), targets.reshape(-1))
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, self.vocab, (48, 8), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens, (tokens * 3 + 1) % self.vocab), batch_size=4, shuffle=True)


def fit(
    strategy: Strategy,
    devices: int,
    out_dir: Path,
    resume_from: Optional[str] = None,
    epochs: int = 1,
    model_class: type[TensorParallelTransformer] = TensorParallelTransformer,
    **flags: Any,
) -> tuple[L.Trainer, TensorParallelTransformer]:
    """Train a new ``model_class`` for ``epochs`` epochs, or, from ``resume_from``, one more; save
    the checkpoint ``out_dir / "model.ckpt"`` after."""
    L.seed_everything(SEED)
    model = model_class()
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        max_epochs=epochs + 1 if resume_from else epochs,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"accelerator": "cpu", **flags},
    )
    trainer.fit(model, ckpt_path=resume_from)
    trainer.save_checkpoint(out_dir / "model.ckpt")
    return trainer, model


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded ``module`` on CPU (a collective; every rank joins)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def run_reference(root: Path, run: str) -> None:
    """One run of Lightning's own ``ModelParallelStrategy``: ``DxT`` trains a new model on a
    ``D`` × ``T`` mesh, ``DxT:FROM`` resumes there from run ``FROM``'s checkpoint; rank 0 saves
    what the tests compare in ``root / run / "results.pt"`` (``:`` as ``-from-``)."""
    layout, _, source = run.partition(":")
    data, tensor = (int(size) for size in layout.split("x"))
    out = root / run.replace(":", "-from-")
    out.mkdir(parents=True, exist_ok=True)
    resume = str(root / source / "model.ckpt") if source else None
    trainer, model = fit(ModelParallelStrategy(data, tensor), data * tensor, out, resume)
    weights = full_weights(model)
    if trainer.is_global_zero:
        torch.save({"losses": model.losses, "weights": weights, "global_step": trainer.global_step}, out / "results.pt")


if __name__ == "__main__":
    # runs of one world size share the ranks' processes and their process group
    for run in sys.argv[2:]:
        run_reference(Path(sys.argv[1]), run)
    # ended here, not by the interpreter's exit: left to it, a rank once aborted as it ended, after
    # its results were saved ("terminate called without an active exception", SIGABRT)
    torch.distributed.destroy_process_group()
