"""pdb in a worker, driven from the controller's own stdin (issue 42, ``worker.breakpoints`` and
``controller.mesh.debugger``): a controller script whose stdin is a pipe, as a user's terminal
would be, runs fits whose ranks stop in pdb, on one warm mesh, and then one with its stdin at its
end. Under Monarch's own hook every one of these fits hung until it was killed."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from lightning_monarch import MonarchStrategy, WorkerError
from tests.conftest import ROOT
from tests.models import Classifier
from tests.references import environment
from tests.test_failures import _trainer

pytestmark = pytest.mark.timeout(300)

#: The controller: each fit prints what it gave, between lines that name it.
CONTROLLER = """
import pdb, time
import lightning as L
import pytorch_lightning
import torch
import lightning_monarch
import lightning_monarch.pl
from lightning_monarch import MonarchStrategy
from lightning_monarch.controller.mesh.pool import MESHES
from tests.models import Classifier
from tests.pl.models import Classifier as PlClassifier


def stopping(base):
    class Stops(base):
        def __init__(self, ranks=(1,), fails=False):
            super().__init__()
            self.ranks, self.fails = ranks, fails

        def training_step(self, batch, batch_idx):
            if self.trainer.global_rank in self.ranks and batch_idx == 2:
                secret = f"secret-of-rank-{self.trainer.global_rank}"
                if self.fails:
                    culprit = 41
                    raise ValueError(f"bad batch {culprit + 1}")
                if self.trainer.global_rank == 0:
                    pdb.set_trace()
                else:
                    breakpoint()
            return super().training_step(batch, batch_idx)

    return Stops


STOPS = {L: stopping(Classifier), pytorch_lightning: stopping(PlClassifier)}


def fit(name, module_options, namespace=L, **options):
    print(f"=== {name}", flush=True)
    L.seed_everything(7)
    module = STOPS[namespace](**module_options)
    strategy = MonarchStrategy(**options) if namespace is L else lightning_monarch.pl.MonarchStrategy(**options)
    trainer = namespace.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1,
                        limit_train_batches=4, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    started = time.monotonic()
    try:
        trainer.fit(module)
    except Exception as error:
        print(f"RAISED {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
    print(f"--- {name} took {time.monotonic() - started:.1f} s on workers {MESHES.worker_pids()}", flush=True)
    return module


stopped = fit("one rank", {})
plain = fit("no breakpoint", {"ranks": ()})
same = all(torch.equal(a, b) for a, b in zip(stopped.state_dict().values(), plain.state_dict().values()))
print(f"WEIGHTS EQUAL {same}", flush=True)
fit("two ranks", {"ranks": (0, 1)})
fit("slow session", {}, step_timeout=2)
fit("quit", {})
fit("after quit", {"ranks": ()})
fit("post-mortem", {"fails": True}, post_mortem=True)
fit("pytorch_lightning", {}, namespace=pytorch_lightning)
fit("end of input", {})
"""

#: What the user types, session by session: the last fit finds the input at its end.
TYPED = [
    "p secret",  # one rank
    "l",
    "c",
    "p secret",  # two ranks, one after the other
    "c",
    "p secret",
    "c",
    "!__import__('time').sleep(4)",  # a session longer than the step timeout
    "c",
    "q",  # quit
    "p culprit",  # post-mortem
    "c",
    "p secret",  # pytorch_lightning's namespace
    "c",
]


def sections(output: str) -> dict[str, str]:
    """The controller's output, by the fit that printed it."""
    return {match[0]: match[1] for match in re.findall(r"=== (.+)\n(.*?--- \1 [^\n]*)", output, re.S)}


def workers(section: str) -> str:
    return re.search(r"on workers (\[.*\])", section)[1]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    script = tmp_path_factory.mktemp("debugger") / "debug_me.py"
    script.write_text(CONTROLLER)
    controller = subprocess.run(
        [sys.executable, str(script)],
        input="".join(line + "\n" for line in TYPED),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment(),
        timeout=280,
    )
    assert controller.returncode == 0, controller.stderr[-3000:]
    return {**sections(controller.stdout), "whole": controller.stdout}


def test_a_breakpoint_on_rank_1_opens_pdb_on_the_controllers_stdin(session: dict[str, str]) -> None:
    one = session["one rank"]
    assert "pdb on rank 1 (" in one and "(Pdb rank 1 on " in one, one
    assert "the other ranks wait, up to their collective's timeout (30 min, `MonarchStrategy(timeout=...)`)" in one
    assert "'secret-of-rank-1'" in one, one
    # the script's own file and lines, as under ddp (cloudpickle names the code it sends <dynamic-code>)
    assert re.search(r"> .*debug_me.py\(\d+\)training_step\(\)", one), one
    assert re.search(r"\d+\s+breakpoint\(\)\n\s*\d+\s+->\s+return super\(\).training_step", one), one
    assert "RAISED" not in one, one
    assert "WEIGHTS EQUAL True" in session["whole"]  # `c` resumed the fit bit for bit


def test_two_ranks_that_stop_at_once_are_taken_one_after_the_other(session: dict[str, str]) -> None:
    two = session["two ranks"]
    first, second = re.findall(r"pdb on rank (\d) \(", two)
    assert {first, second} == {"0", "1"}, two  # rank 0 called pdb.set_trace(), rank 1 breakpoint()
    # each session shows its own rank's local, in the order the ranks were taken
    assert re.search(rf"'secret-of-rank-{first}'.*pdb on rank {second} .*'secret-of-rank-{second}'", two, re.S), two
    assert "RAISED" not in two, two


def test_the_time_in_a_session_does_not_count_towards_the_step_timeout(session: dict[str, str]) -> None:
    slow = session["slow session"]
    assert "pdb on rank 1 (" in slow and float(re.search(r"took ([\d.]+) s", slow)[1]) > 4, slow
    assert "RAISED" not in slow, slow


def test_q_ends_the_fit_with_a_clear_error_and_the_mesh_stays_warm(session: dict[str, str]) -> None:
    quit = session["quit"]
    assert "RAISED WorkerError: Worker rank 1 on host" in quit, quit
    assert "raised BdbQuit in `module.training_step`: pdb quit on rank 1" in quit, quit
    # the same worker processes ran the fit before the quit, held it, and ran the next one
    assert workers(session["slow session"]) == workers(quit) == workers(session["after quit"]) != "[]"
    assert "RAISED" not in session["after quit"]


def test_post_mortem_opens_pdb_at_the_failing_frame_then_the_fit_raises(session: dict[str, str]) -> None:
    examined = session["post-mortem"]
    assert "Post-mortem of ValueError: bad batch 42" in examined, examined
    assert re.search(r"\(Pdb rank 1 on [^)]+\) 41\n", examined), examined
    assert "RAISED WorkerError: Worker rank 1 on host" in examined and "raised ValueError" in examined, examined


def test_pdb_on_a_worker_in_pytorch_lightnings_namespace(session: dict[str, str]) -> None:
    stopped = session["pytorch_lightning"]
    assert "pdb on rank 1 (" in stopped and "'secret-of-rank-1'" in stopped, stopped
    assert "RAISED" not in stopped, stopped


def test_a_breakpoint_with_the_input_at_its_end_quits_there(session: dict[str, str]) -> None:
    ended = session["end of input"]
    assert "no input for pdb on rank 1 (EOFError" in ended, ended
    assert "raised BdbQuit in `module.training_step`: pdb quit on rank 1" in ended, ended
    assert float(re.search(r"took ([\d.]+) s", ended)[1]) < 60


def test_both_namespaces_share_the_relay_and_its_sessions() -> None:
    # one relay per process answers both namespaces' workers; the step timeout reads its sessions
    import lightning_monarch.controller.mesh.debugger
    import lightning_monarch.pl.controller.mesh.debugger

    assert lightning_monarch.pl.controller.mesh.debugger is lightning_monarch.controller.mesh.debugger


class StopsAtABreakpoint(Classifier):
    """Calls ``breakpoint()`` in ``training_step`` on rank 1 at batch 2, as a user debugging it would."""

    def training_step(self, batch: object, batch_idx: int) -> object:
        if self.trainer.global_rank == 1 and batch_idx == 2:
            breakpoint()
        return super().training_step(batch, batch_idx)


def test_a_breakpoint_where_the_controller_takes_no_input_quits_there() -> None:
    # pytest's captured stdin refuses reads, as a notebook client that takes no input does
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 .* raised BdbQuit in `module.training_step`: pdb quit on rank 1"):
        _trainer().fit(StopsAtABreakpoint())
    assert time.monotonic() - started < 60


class LateOnRank1(Classifier):
    """Rank 1 comes to its first all-reduce 10 s late, as a rank stopped in pdb would."""

    def training_step(self, batch: object, batch_idx: int) -> object:
        if self.trainer.global_rank == 1 and batch_idx == 0:
            time.sleep(10)
        return super().training_step(batch, batch_idx)


def test_the_workers_process_group_takes_the_strategys_timeout() -> None:
    # a pdb session longer than the collective's timeout ends its peers' wait, as under ddp: it is
    # the strategy's to set, as DDPStrategy(timeout=...) sets it (it reached no process group before:
    # the workers' group starts before the stage's Trainer, which keeps it)
    with pytest.raises(WorkerError, match=r"rank 0 .* raised .*[Tt]imed out"):
        _trainer(strategy=MonarchStrategy(timeout=timedelta(seconds=3))).fit(LateOnRank1())
    with pytest.raises(TypeError, match=r"MonarchStrategy\(timeout=30\)`: give a `datetime.timedelta`"):
        MonarchStrategy(timeout=30)
