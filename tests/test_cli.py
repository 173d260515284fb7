"""``strategy="monarch"`` and ``MonarchStrategy`` work from a LightningCLI YAML config and from its
command line (``tests/test_pytorch_lightning.py`` runs these in ``pytorch_lightning``'s namespace),
with its arguments (asynchronous validation in the class path's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_monarch import MonarchStrategy
from tests.models import Classifier

pytestmark = pytest.mark.timeout(120)

TRAINER = """
trainer:
  accelerator: cpu
  devices: 2
  max_epochs: 1
  limit_train_batches: 2
  limit_val_batches: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
"""

STRATEGIES = {
    "registered name": "  strategy: monarch\n",
    "class path": (
        "  strategy:\n"
        "    class_path: lightning_monarch.MonarchStrategy\n"
        "    init_args:\n"
        "      process_group_backend: gloo\n"
        "      validation: async\n"
    ),
    "command line": "",
}
#: What the command line adds to the config, per form.
ARGUMENTS = {"command line": ["--trainer.strategy", "monarch"]}


@pytest.mark.parametrize("form", list(STRATEGIES))
def test_cli_config(form: str, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(TRAINER + STRATEGIES[form])
    arguments = ["fit", "--config", str(config), *ARGUMENTS.get(form, [])]
    cli = LightningCLI(Classifier, args=arguments, save_config_callback=None)
    assert isinstance(cli.trainer.strategy, MonarchStrategy)
    assert cli.trainer.global_step == 2
    # the class path's validates on a second mesh, with its logged value the training rank's would be
    assert cli.trainer.strategy.validation == ("async" if form == "class path" else "sync")
    assert "val_loss" in cli.trainer.callback_metrics
