"""Each rank's part of a sharded module's checkpoint (``MonarchModelParallelStrategy``,
``MonarchFSDPStrategy``).

Runs in each worker process. Every rank writes its own shards, in parallel, in PyTorch's
distributed checkpoint format (``torch.distributed.checkpoint``, DCP), with the keys of Lightning's
``ModelParallelStrategy`` (``save_distributed_checkpoint=True``): the module's state under
``state_dict``, each optimizer's under ``optimizer_<i>``. The controller then writes Lightning's
metadata (``meta.pt``) beside them, so the directory is the one ``ModelParallelStrategy`` writes.
Loading needs nothing here: the worker's Trainer runs ``ModelParallelStrategy``, which loads (and
reshards) such a directory given as ``ckpt_path``. With ``save_distributed_checkpoint=False`` the
ranks gather the full state instead, as that strategy does, and rank 0 writes it with the
controller's metadata into one file (:func:`save_full`).
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


def save_full(module: LightningModule, path: str, metadata: dict[str, Any], optimizers: bool) -> Optional[str]:
    """Gather the sharded ``module``'s full state (and with ``optimizers``, each optimizer's), as
    the rank's Lightning ``ModelParallelStrategy(save_distributed_checkpoint=False)`` collects it:
    a collective that every rank joins. Rank 0 writes it into the file ``path`` with the
    controller's ``metadata`` (Lightning's loops, callbacks, ...) and its worker callbacks' state,
    and returns ``path``; the other ranks ``None``."""
    trainer = module.trainer
    strategy = trainer.strategy
    checkpoint = {**metadata, "state_dict": strategy.lightning_module_state_dict()}
    if optimizers:
        checkpoint["optimizer_states"] = [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers]
    if torch.distributed.get_rank() == 0:
        callbacks = callback_states(trainer)
        if callbacks:
            checkpoint["callbacks"] = {**checkpoint.get("callbacks", {}), **callbacks}
        torch.save(checkpoint, path)
        return path
    return None
