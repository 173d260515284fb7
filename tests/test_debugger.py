"""pdb in a worker, driven from the controller's own stdin (issue 42, ``worker.breakpoints``,
``worker.pdb_barrier`` and ``controller.mesh.debugger``): a controller script whose stdin is a
terminal (a pseudo-terminal the test types into) runs fits whose ranks stop in pdb, on one warm
mesh, then a session longer than the collectives' timeout, and one that meets the end of the input
(Ctrl-D). Under Monarch's own hook every one of these fits hung until it was killed."""

from __future__ import annotations

import os
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
from datetime import timedelta
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
        def __init__(self, ranks=(1,), fails=False, late=0):
            super().__init__()
            self.ranks, self.fails, self.late = ranks, fails, late

        def validation_step(self, batch, batch_idx):
            if self.trainer.global_rank in self.ranks and batch_idx == 0:
                secret = f"secret-of-rank-{self.trainer.global_rank}"
                breakpoint()
            return super().validation_step(batch, batch_idx)

        def training_step(self, batch, batch_idx):
            if self.trainer.global_rank in self.ranks and batch_idx == 2:
                secret = f"secret-of-rank-{self.trainer.global_rank}"
                if self.late:
                    time.sleep(self.late)
                    return super().training_step(batch, batch_idx)
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


def fit(name, module_options, namespace=L, val_batches=0, **options):
    print(f"=== {name}", flush=True)
    L.seed_everything(7)
    module = STOPS[namespace](**module_options)
    strategy = MonarchStrategy(**options) if namespace is L else lightning_monarch.pl.MonarchStrategy(**options)
    trainer = namespace.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1,
                        limit_train_batches=4, limit_val_batches=val_batches, logger=False, enable_checkpointing=False,
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
fit("longer than the timeout", {}, timeout=timedelta(seconds=3))
fit("in validation", {}, val_batches=2, timeout=timedelta(seconds=3))
fit("end of input", {}, timeout=timedelta(seconds=3))
fit("late without pdb", {"late": 6}, timeout=timedelta(seconds=3))
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
    "!__import__('time').sleep(6)",  # a session twice the collectives' timeout
    "p secret",
    "c",
    "c",  # in validation_step: the sanity check's,
    "c",  # the training step's,
    "!__import__('time').sleep(6)",  # and the epoch's, while the others log with sync_dist
    "c",
]
#: The end of the input on a terminal: Ctrl-D at the start of a line.
END_OF_INPUT = "\x04"


def sections(output: str) -> dict[str, str]:
    """The controller's output, by the fit that printed it."""
    return {match[0]: match[1] for match in re.findall(r"=== (.+)\n(.*?--- \1 [^\n]*)", output, re.S)}


def workers(section: str) -> str:
    return re.search(r"on workers (\[.*\])", section)[1]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    script = tmp_path_factory.mktemp("debugger") / "debug_me.py"
    script.write_text(CONTROLLER)
    # the controller's stdin is a terminal, as a user's is: the typing waits in its input queue
    typed, terminal = os.openpty()
    os.write(typed, ("".join(line + "\n" for line in TYPED) + END_OF_INPUT).encode())
    try:
        controller = subprocess.run(
            [sys.executable, str(script)],
            stdin=terminal,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=environment(),
            timeout=280,
        )
    finally:
        os.close(terminal)
        os.close(typed)
    assert controller.returncode == 0, controller.stderr[-3000:]
    return {**sections(controller.stdout), "whole": controller.stdout}


def test_a_breakpoint_on_rank_1_opens_pdb_on_the_controllers_stdin(session: dict[str, str]) -> None:
    one = session["one rank"]
    assert "pdb on rank 1 (" in one and "(Pdb rank 1 on " in one, one
    assert (
        "the other ranks wait before their next gradient or strategy collective, with no time limit (others time"
        " out after 30 min, `MonarchStrategy(timeout=...)`)" in one
    )
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
    assert "RAISED WorkerError[BdbQuit]: Worker rank 1 on host" in quit, quit
    assert "raised BdbQuit in `module.training_step`: pdb quit on rank 1" in quit, quit
    # the same worker processes ran the fit before the quit, held it, and ran the next one
    assert workers(session["slow session"]) == workers(quit) == workers(session["after quit"]) != "[]"
    assert "RAISED" not in session["after quit"]


def test_post_mortem_opens_pdb_at_the_failing_frame_then_the_fit_raises(session: dict[str, str]) -> None:
    examined = session["post-mortem"]
    assert "Post-mortem of ValueError: bad batch 42" in examined, examined
    assert re.search(r"\(Pdb rank 1 on [^)]+\) 41\n", examined), examined
    assert "RAISED WorkerError[ValueError]: Worker rank 1 on host" in examined and "raised ValueError" in examined, (
        examined
    )


def test_pdb_on_a_worker_in_pytorch_lightnings_namespace(session: dict[str, str]) -> None:
    stopped = session["pytorch_lightning"]
    assert "pdb on rank 1 (" in stopped and "'secret-of-rank-1'" in stopped, stopped
    assert "RAISED" not in stopped, stopped


def test_the_other_ranks_wait_for_a_session_longer_than_their_collectives_timeout(session: dict[str, str]) -> None:
    # they wait at the barrier before their gradients' all-reduce, whose time in pdb does not count
    # towards the timeout (3 s); without it, rank 0's all-reduce timed out
    longer = session["longer than the timeout"]
    assert "(others time out after 3 s," in longer, longer
    assert "'secret-of-rank-1'" in longer and float(re.search(r"took ([\d.]+) s", longer)[1]) > 6, longer
    assert "RAISED" not in longer, longer


def test_peers_wait_for_a_session_in_the_strategys_collectives_too(session: dict[str, str]) -> None:
    # rank 1 stops in validation_step; rank 0 goes on to the epoch's `self.log(..., sync_dist=True)`,
    # whose reduce (the worker strategy's) meets the barrier first
    validating = session["in validation"]
    assert re.search(r"> .*debug_me.py\(\d+\)validation_step\(\)", validating), validating
    assert "RAISED" not in validating and float(re.search(r"took ([\d.]+) s", validating)[1]) > 6, validating


def test_outside_pdb_the_barrier_times_out_as_the_collective_would(session: dict[str, str]) -> None:
    late = session["late without pdb"]
    assert "RAISED WorkerError[TimeoutError]: Worker rank 0 on host" in late and "raised TimeoutError" in late, late
    assert "waited 3 s before its gradients' all-reduce for ranks that never came" in late, late


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


def test_a_breakpoint_where_the_controller_takes_no_input_quits_there(capsys: pytest.CaptureFixture[str]) -> None:
    # pytest's captured stdin refuses reads, as a notebook client that takes no input does
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 .* raised BdbQuit in `module.training_step`: pdb quit on rank 1"):
        _trainer().fit(StopsAtABreakpoint())
    assert time.monotonic() - started < 60
    # no one can answer pdb here: the stage had no barrier, and the header says how long peers wait
    assert "the other ranks wait up to their collective's timeout (30 min" in capsys.readouterr().out


class LateOnRank1(Classifier):
    """Rank 1 comes to its first all-reduce 6 s late, as a rank stopped in pdb would."""

    def training_step(self, batch: object, batch_idx: int) -> object:
        if self.trainer.global_rank == 1 and batch_idx == 0:
            time.sleep(6)
        return super().training_step(batch, batch_idx)


def test_the_workers_process_group_takes_the_strategys_timeout() -> None:
    # a pdb session longer than the collective's timeout ends its peers' wait, as under ddp: it is
    # the strategy's to set, as DDPStrategy(timeout=...) sets it (it reached no process group before:
    # the workers' group starts before the stage's Trainer, which keeps it)
    with pytest.raises(WorkerError, match=r"rank 0 .* raised .*[Tt]imed out"):
        _trainer(strategy=MonarchStrategy(timeout=timedelta(seconds=3))).fit(LateOnRank1())
    with pytest.raises(TypeError, match=r"MonarchStrategy\(timeout=30\)`: give a `datetime.timedelta`"):
        MonarchStrategy(timeout=30)
