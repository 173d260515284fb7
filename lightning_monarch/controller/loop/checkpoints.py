"""Sharded checkpoint directories (``MonarchModelParallelStrategy``, ``MonarchFSDPStrategy``), on the controller.

Runs on the controller, and the converter in any single process (no workers, no process group).
A sharded checkpoint is a directory: the workers' shards in PyTorch's distributed checkpoint
format (``torch.distributed.checkpoint``, DCP; the module's state under ``state_dict``, each
optimizer's under ``optimizer_<i>``, see ``worker.checkpoints``) and Lightning's metadata (loops,
callbacks, hyper-parameters, LR schedulers...) in ``meta.pt``. That is the layout of Lightning's
own ``ModelParallelStrategy`` (``save_distributed_checkpoint=True``), which loads it too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

#: Lightning's name for the metadata file of a sharded checkpoint (``lightning.fabric.utilities.load``).
METADATA_FILENAME = "meta.pt"
#: The key of the module's state among the shards, as under ``ModelParallelStrategy``.
_MODULE_KEY = "state_dict"
_OPTIMIZER_PREFIX = "optimizer_"


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (Lightning's test: it holds ``meta.pt``)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILENAME))


def prepare_directory(path: Union[str, Path]) -> Path:
    """The absolute path of an empty directory for a new sharded checkpoint at ``path``: the file
    or the earlier sharded checkpoint there is removed, so that no shard of another number of
    workers is left beside the new ones."""
    directory = Path(path).absolute()
    if directory.is_file():
        directory.unlink()
    elif is_sharded_checkpoint(directory):
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def check_module_keys(path: Union[str, Path], module: nn.Module, strict: bool = True) -> None:
    """Raise if the sharded checkpoint at ``path`` was not written for ``module``: it must hold
    every key of the module's state dict and, with ``strict`` (``module.strict_loading``), no
    other. Reads only the checkpoint's DCP metadata, no tensor."""
    prefix = f"{_MODULE_KEY}."
    saved = {
        key[len(prefix) :]
        for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata
        if key.startswith(prefix)
    }
    expected = set(module.state_dict())
    missing = sorted(expected - saved)
    unexpected = sorted(saved - expected) if strict else []
    if missing or unexpected:
        raise RuntimeError(
            f"`ckpt_path={str(path)!r}` is a sharded checkpoint of another model than `{type(module).__name__}`:"
            f" missing keys {missing}, unexpected keys {unexpected}. Resume from a checkpoint this model"
            " wrote, or build the model the checkpoint was written for."
        )


def convert_sharded_checkpoint(src_dir: Union[str, Path], dst_file: Union[str, Path]) -> None:
    """Write the sharded checkpoint directory ``src_dir`` as one Lightning checkpoint file, ``dst_file``.

    ``src_dir`` comes from ``MonarchModelParallelStrategy``, ``MonarchFSDPStrategy`` or Lightning's
    ``ModelParallelStrategy``; the file is for inference: ``MyModel.load_from_checkpoint(dst_file)``.

    Runs in this process alone, on its CPU, with no worker: the full weights (and optimizer
    state) must fit in its memory, and the disk next to ``dst_file`` must hold them twice while it
    runs. The file has Lightning's metadata, the full ``state_dict`` and the ``optimizer_states``
    (keyed by parameter name, as FSDP2 writes them).
    """
    if not is_sharded_checkpoint(src_dir):
        raise FileNotFoundError(
            f"`convert_sharded_checkpoint({str(src_dir)!r}, ...)`: no sharded checkpoint there (a directory with"
            f" `{METADATA_FILENAME}`). Give the directory that `trainer.save_checkpoint(path)` or `ModelCheckpoint`"
            " wrote under `MonarchFSDPStrategy`."
        )
    destination = Path(dst_file).absolute()
    destination.parent.mkdir(parents=True, exist_ok=True)
    checkpoint: dict[str, Any] = torch.load(os.path.join(src_dir, METADATA_FILENAME), map_location="cpu")
    with tempfile.TemporaryDirectory(dir=destination.parent) as scratch:
        full = os.path.join(scratch, "full.pt")
        dcp_to_torch_save(src_dir, full)
        tensors = torch.load(full, map_location="cpu", mmap=True)
        checkpoint["state_dict"] = tensors.pop(_MODULE_KEY)
        optimizers = sorted(
            (key for key in tensors if key.startswith(_OPTIMIZER_PREFIX)),
            key=lambda key: int(key[len(_OPTIMIZER_PREFIX) :]),
        )
        if optimizers:
            checkpoint["optimizer_states"] = [tensors.pop(key) for key in optimizers]
        torch.save(checkpoint, destination)
