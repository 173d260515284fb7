"""The real-client tier: Lightning-based libraries of several fields, each trained as its own docs
show for several devices, under Lightning's ``ddp`` and under ``monarch``.

Each module here has ``train(strategy, out_dir)``: ``strategy`` is ``"ddp"`` or ``"monarch"``, which
the module turns into the names the library's users pass (``"ddp_find_unused_parameters_true"``
and its counterpart, say). It trains on tiny data made in the module (nothing is downloaded), with
every file under ``out_dir``, and returns on the global-zero process what ``tests/test_clients.py``
compares: the final weights, ``callback_metrics``, the checkpoints' contents and what else the
library hands its user; ``None`` on the other ``ddp`` ranks.

Imported by the test process, by the Monarch workers (which unpickle these modules' classes) and
by Lightning's ``ddp`` ranks through ``tests/clients/reference.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch

#: The tier: module, library, the library's package (what its users import), field, the Lightning
#: namespace the library uses.
CLIENTS: dict[str, tuple[str, str, str, str]] = {
    "gluonts": ("GluonTS", "gluonts.torch", "time series", "lightning.pytorch"),
    "pytorch_tabular": ("pytorch-tabular", "pytorch_tabular", "tabular data", "pytorch_lightning"),
    "chemprop": ("chemprop", "chemprop", "molecules", "lightning.pytorch"),
    "scvi": ("scvi-tools", "scvi", "single-cell biology", "lightning.pytorch"),
    "pyg": ("PyTorch Geometric", "torch_geometric", "graphs", "lightning.pytorch"),
    "darts": ("darts", "darts", "forecasting", "pytorch_lightning"),
    "finetuning_scheduler": ("finetuning-scheduler", "finetuning_scheduler", "fine-tuning", "lightning.pytorch"),
    "pina": ("PINA", "pina", "physics-informed learning", "lightning.pytorch"),
    "torchsurv": ("TorchSurv", "torchsurv", "survival analysis", "lightning.pytorch"),
    "monai": ("MONAI", "monai", "medical imaging", "lightning.pytorch"),
}
if sys.version_info >= (3, 11):  # matgl needs Python 3.11 (the ``clients`` extra installs it there only)
    CLIENTS["matgl"] = ("matgl", "matgl", "materials", "lightning.pytorch")


def quiet_trainer(strategy: str, out_dir: Path) -> dict[str, Any]:
    """The Trainer arguments every client's run shares: ``strategy`` on 2 CPU devices, its files
    under ``out_dir``, no logger, progress bar or model summary (the tier compares results, not
    what is drawn)."""
    return dict(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out_dir),
    )


def checkpoints(out_dir: Path) -> dict[str, Any]:
    """Every checkpoint file under ``out_dir``, by its path there, as the parity tests compare them,
    with the modules inside (a library's loss, metrics or output transform in its hyperparameters) as
    their class and state (:func:`comparable`)."""
    from tests.parity_cases import comparable_checkpoint

    return {
        str(path.relative_to(out_dir)): comparable(comparable_checkpoint(path))
        for path in sorted(out_dir.rglob("*.ckpt"))
    }


def comparable(value: Any) -> Any:
    """``value`` as ``tests.test_parity.assert_same`` compares it: a module (which compares by
    identity) as its class and state, in dicts, lists and tuples too."""
    if isinstance(value, torch.nn.Module):
        return {"class": type(value).__qualname__, "state": comparable(value.state_dict())}
    if isinstance(value, dict):
        return {key: comparable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(item) for item in value]
    return value


def results(trainer: Any, module: torch.nn.Module, out_dir: Path, **extras: Any) -> Optional[dict[str, Any]]:
    """What a client's run returns on the global-zero process: ``module``'s weights, the Trainer's
    ``callback_metrics`` and step, the checkpoints under ``out_dir``, and the library's ``extras``;
    ``None`` on the other ``ddp`` ranks, which must not read the checkpoint files while rank 0 may
    still be replacing them (a rank that left ``fit`` first found a top-k file rank 0 removed)."""
    if not trainer.is_global_zero:
        return None
    return {
        "weights": {key: value.detach().cpu().clone() for key, value in module.state_dict().items()},
        "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "checkpoints": checkpoints(out_dir),
        **extras,
    }
