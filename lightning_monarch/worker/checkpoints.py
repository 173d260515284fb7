"""Each rank's part of a sharded checkpoint under ``MonarchFSDPStrategy``.

Runs in each worker process. Every rank writes its own shards, in parallel, in PyTorch's
distributed checkpoint format (``torch.distributed.checkpoint``, DCP), with the keys of Lightning's
``ModelParallelStrategy`` (``save_distributed_checkpoint=True``): the module's state under
``state_dict``, each optimizer's under ``optimizer_<i>``. The controller then writes Lightning's
metadata (``meta.pt``) beside them, so the directory is the one ``ModelParallelStrategy`` writes.
Loading needs nothing here: the worker's Trainer runs ``ModelParallelStrategy``, which loads (and
reshards) such a directory given as ``ckpt_path``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed
import torch.distributed.checkpoint as dcp
from lightning.pytorch import LightningModule
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from lightning_monarch.worker.state import callback_states

#: Each rank's shards, copied to the CPU before they are written, as ``ModelParallelStrategy`` does.
_SHARDED = StateDictOptions(cpu_offload=True)


def save_shards(module: LightningModule, path: str, optimizers: bool) -> Optional[dict[str, Any]]:
    """Write this rank's shards of the sharded ``module``'s state (and with ``optimizers``, of each
    of its Trainer's optimizers') into the directory ``path``: a collective that every rank joins.
    Rank 0 returns its worker callbacks' state, which the controller adds to the checkpoint's
    metadata; the other ranks ``None``."""
    trainer = module.trainer
    state: dict[str, Any] = {"state_dict": get_model_state_dict(module, options=_SHARDED)}
    if optimizers:
        state.update(
            {
                f"optimizer_{index}": get_optimizer_state_dict(module, optimizer, options=_SHARDED)
                for index, optimizer in enumerate(trainer.optimizers)
            }
        )
    dcp.save(state, checkpoint_id=path)
    return callback_states(trainer) if torch.distributed.get_rank() == 0 else None
