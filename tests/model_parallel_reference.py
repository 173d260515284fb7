"""Continues a sharded checkpoint under Lightning's own ``ModelParallelStrategy`` (one CPU process)
for one more epoch, and saves its own sharded checkpoint: the other side of
``tests/test_fsdp_checkpoints.py``'s check that both strategies read each other's checkpoints.

Usage: ``python -m tests.model_parallel_reference SRC_DIR DST_DIR``
"""

import sys

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import register_fsdp_forward_method

from tests.parity_cases import SEED, SelfShardingTransformer


class ModelParallelTransformer(SelfShardingTransformer):
    """Under ``ModelParallelStrategy`` the module itself asks FSDP2 to gather the root's
    parameters around ``training_step``, which Lightning calls instead of ``forward``."""

    def configure_model(self) -> None:
        super().configure_model()
        register_fsdp_forward_method(self, "training_step")


if __name__ == "__main__":
    source, destination = sys.argv[1:3]
    L.seed_everything(SEED)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ModelParallelTransformer(), ckpt_path=source)
    assert trainer.global_step == 6, trainer.global_step
    trainer.save_checkpoint(destination)
