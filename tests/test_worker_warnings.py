"""The workers' Python warnings reach the user's terminal once each (``worker.held_warnings``,
``controller.mesh.worker_warnings``).

A user's script runs in a subprocess, as a user runs it, and the test reads its whole output: each
distinct warning line appears once, a rank-zero warning of Lightning's that the controller's own
loop raises too among them, and a warning only rank 1 raises appears, naming rank 1.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

from lightning_monarch.controller.mesh.worker_warnings import WorkerWarnings
from lightning_monarch.wire.reports import RankValue, WorkerWarning
from lightning_monarch.worker.held_warnings import HeldWarnings
from tests.conftest import ROOT

_SCRIPT = """
import os
import warnings

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_monarch  # noqa: F401 - registers strategy="monarch"


class Warns(BoringModel):
    def training_step(self, batch, batch_idx):
        warnings.warn("every rank warns in training_step")
        return super().training_step(batch, batch_idx)

    def on_train_end(self):
        if self.global_rank == 1:
            warnings.warn("only rank 1 warns in on_train_end")


if __name__ == "__main__":
    trainer = L.Trainer(strategy="monarch", accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=4,
                        limit_val_batches=2, default_root_dir=os.path.dirname(__file__), enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(Warns())
    print("FIT DONE")
"""

#: The first line of a warning as Python prints it (``path:line: Category: message``), or as
#: Lightning prints its own (``path:line: message``).
_WARNING_LINE = re.compile(r"^\S+:\d+: ")


@pytest.mark.timeout(180)
def test_each_warning_of_a_fit_shows_once(tmp_path: Path) -> None:
    script = tmp_path / "warns.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0 and "FIT DONE" in done.stdout, done.stdout[-6000:]
    lines = Counter(line for line in done.stdout.splitlines() if _WARNING_LINE.match(line))
    assert {line: count for line, count in lines.items() if count > 1} == {}, done.stdout[-6000:]
    shown = "\n".join(lines)
    assert "smaller than the logging interval" in shown  # the controller's and worker rank 0's, once
    assert "UserWarning: every rank warns in training_step\n" in shown + "\n"
    assert "UserWarning: only rank 1 warns in on_train_end (worker rank 1)" in shown


def _warning(message: str, lineno: int = 1) -> WorkerWarning:
    return WorkerWarning("builtins:UserWarning", message, "/nowhere/workers.py", lineno)


def test_the_controller_shows_each_held_warning_once_naming_the_ranks_when_not_every_rank_raised_it() -> None:
    shown = WorkerWarnings(num_workers=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        shown.show_rank0([_warning("rank 0 and 1"), _warning("rank 0 and 1")])
        shown.show_every_rank(
            [
                RankValue(0, [_warning("everyone", 2)]),
                RankValue(1, [_warning("rank 0 and 1"), _warning("everyone", 2), _warning("ranks 1 and 2", 3)]),
                RankValue(2, [_warning("everyone", 2), _warning("ranks 1 and 2", 3)]),
            ]
        )
    assert [(str(record.message), record.lineno) for record in caught] == [
        ("rank 0 and 1", 1),
        ("everyone", 2),
        ("ranks 1 and 2 (worker ranks [1, 2])", 3),
    ]
    assert all(record.filename == "/nowhere/workers.py" and record.category is UserWarning for record in caught)


def test_a_worker_holds_what_python_would_print_and_gives_it_once() -> None:
    held = HeldWarnings()
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        held.install()

        class Custom(Warning):
            pass

        for _ in range(2):
            warnings.warn("held", Custom, stacklevel=1)  # the second is a repeat at the same place: Python drops it
    taken = held.take()
    assert [(warning.category, warning.message) for warning in taken] == [
        (f"{__name__}:test_a_worker_holds_what_python_would_print_and_gives_it_once.<locals>.Custom", "held"),
    ]
    assert taken[0].filename == __file__
    assert held.take() == []
