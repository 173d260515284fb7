"""Which code runs where, at import time: a worker process imports the shared modules and
``worker/`` only, and the controller's install step (strategy registry, accelerator routing,
Monarch's fault hook) runs in the controller alone (``controller/install.py``).

Real processes: a fit on two Monarch workers, then a probe actor in the same worker processes
reports their ``sys.modules`` and the state the install step would have changed.
``tests/test_pytorch_lightning.py`` runs the same test in ``pytorch_lightning``'s namespace.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from lightning_monarch import stop_meshes
from tests.conftest import probe_warm_workers
from tests.models import Classifier
from tests.worker_probe import LIGHTNING_PACKAGE, side_effects


def test_workers_import_no_controller_module_and_install_nothing(tmp_path: Path) -> None:
    # on new workers: those of earlier tests unpickled test modules that import controller modules
    stop_meshes()
    trainer = L.Trainer(
        strategy="monarch",
        devices=2,
        max_steps=2,
        limit_val_batches=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
    )
    trainer.fit(Classifier())
    reports = probe_warm_workers("side_effects")
    assert len(reports) == 2
    for report in reports:
        assert "lightning_monarch.worker.actor" in report["modules"]
        assert "lightning_monarch.worker.stage" in report["modules"]
        assert report["controller_modules"] == []
        assert not report["registered"]
        assert not report["fault_hook"].startswith("lightning_monarch")
        assert not report["accelerator_routed"]
        assert report["lightning_packages"] == [LIGHTNING_PACKAGE]  # the other namespace is not imported
    # the same probe, in this process, finds everything the controller's install step does
    here = side_effects()
    assert "lightning_monarch.controller.install" in here["controller_modules"]
    assert here["registered"]
    assert here["fault_hook"].startswith("lightning_monarch")  # either namespace's: the last installed
    assert here["fault_hook"].endswith(".controller.install")
    assert here["accelerator_routed"]
