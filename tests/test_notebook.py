"""``examples/notebook.ipynb`` runs headless in a real Jupyter kernel: one progress bar, worker
errors shown in their cells, a kernel that survives a dead worker and an interrupt, a warm mesh
reused by the next cell, and no worker process left once the kernel has shut down, which ends with
exit code 0 (issue 58)."""

from __future__ import annotations

import queue
import re
import subprocess
import time
from dataclasses import dataclass

import nbformat
import psutil
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests.conftest import ROOT
from tests.references import environment

pytestmark = pytest.mark.timeout(600)

NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
#: The error each cell tagged ``raises-exception`` must show, in order.
EXPECTED_ERRORS = ["WorkerError[ValueError]", "MeshFailureError", "SystemExit"]
#: How long the client lets the kernel end by itself before it kills it. Jupyter's default is 5 s;
#: a quiet machine ends this kernel in about 3 s, most of it Python finalizing torch's and
#: Lightning's objects, which a loaded CI machine (two test processes on two cores) stretches past 5 s.
SHUTDOWN_WAIT_S = 30.0


def outputs(notebook: nbformat.NotebookNode, kind: str) -> list[tuple[int, nbformat.NotebookNode]]:
    return [
        (index, output)
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == kind
    ]


def text(notebook: nbformat.NotebookNode, name: str) -> str:
    return "".join(output.text for _, output in outputs(notebook, "stream") if output.name == name)


@dataclass
class Run:
    """The executed notebook, and the kernel's process, which the client shut down at the end."""

    notebook: nbformat.NotebookNode
    kernel: subprocess.Popen


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    workdir = tmp_path_factory.mktemp("notebook")
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(workdir)}}
    )
    client.km = client.create_kernel_manager()
    client.km.shutdown_wait_time = SHUTDOWN_WAIT_S
    kernels: list[subprocess.Popen] = []
    client.on_notebook_start = lambda notebook: kernels.append(client.km.provisioner.process)
    client.execute()
    return Run(notebook, kernels[0])


@pytest.fixture(scope="module")
def executed(run: Run) -> nbformat.NotebookNode:
    return run.notebook


def test_only_the_cells_that_show_a_worker_failure_have_errors(executed: nbformat.NotebookNode) -> None:
    tagged = {index for index, cell in enumerate(executed.cells) if "raises-exception" in cell.metadata.get("tags", [])}
    errors = outputs(executed, "error")
    assert [index for index, _ in errors] == sorted(tagged), [(index, error.ename) for index, error in errors]
    assert [error.ename for _, error in errors] == EXPECTED_ERRORS
    worker_error = errors[0][1].evalue
    assert "Worker rank 1 on host" in worker_error and "ValueError in `module.training_step`" in worker_error
    assert "Remote traceback (rank 1)" in worker_error
    assert re.match(r"Worker rank 1 \(pid \d+ on \S+\) died", errors[1][1].evalue)


def test_the_kernel_survives_and_reuses_the_warm_mesh(executed: nbformat.NotebookNode) -> None:
    stdout = text(executed, "stdout")
    assert "same worker processes: True" in stdout
    assert "the kernel goes on: val_acc" in stdout
    assert "new workers True" in stdout  # the interrupt stopped the workers; the next fit started new ones
    assert float(re.search(r"second fit in ([\d.]+) s", stdout).group(1)) < 5


def test_one_progress_bar_and_no_event_loop_warnings(executed: nbformat.NotebookNode) -> None:
    first_fit = next(cell for cell in executed.cells if cell.cell_type == "code" and "first_workers =" in cell.source)
    drawn = "".join(output.text for output in first_fit.outputs if output.output_type == "stream")
    # a progress bar draws its first epoch at 0% once (the first of 24 batches per worker); a bar per
    # worker would draw it again from each worker's process
    assert len(re.findall(r"Epoch 0:   0%\|\s+\| 0/24 \[00:00<\?, \?it/s\]", drawn)) == 1, drawn[-3000:]
    assert "active event loop" not in text(executed, "stderr")


def test_no_worker_process_outlives_the_kernel(executed: nbformat.NotebookNode) -> None:
    stdout = text(executed, "stdout")
    pids = [int(pid) for group in re.findall(r"workers \[([\d, ]+)\]", stdout) for pid in group.split(", ")]
    kernel = int(re.search(r"kernel process: (\d+)", stdout).group(1))
    assert pids
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in [kernel, *pids]):
        time.sleep(0.2)
    assert not [pid for pid in [kernel, *pids] if psutil.pid_exists(pid)]


def test_the_kernel_shuts_down_with_exit_code_0(run: Run) -> None:
    """The client asks the kernel to shut down and kills it if it has not ended within
    :data:`SHUTDOWN_WAIT_S`; the kernel ends by itself, through Python's exit handlers, Monarch's
    included, with code 0."""
    assert run.kernel.returncode == 0


#: A cell whose fit stops in pdb on rank 1: its module is defined in the cell, as a notebook's is.
DEBUGGED_CELL = """
import lightning as L
import lightning_monarch
from tests.models import Classifier


class StopsInPdb(Classifier):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and batch_idx == 2:
            secret = "secret-of-rank-1"
            breakpoint()
        return super().training_step(batch, batch_idx)


trainer = L.Trainer(strategy="monarch", accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=4,
                    limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(StopsInPdb())
print("fit ended at step", trainer.global_step)
lightning_monarch.stop_meshes()
"""


def test_a_breakpoint_on_a_worker_reads_the_kernels_input_box() -> None:
    # a notebook's pdb prompts through the kernel's input requests, as Python's input() does there
    manager = KernelManager(kernel_name="python3")
    manager.shutdown_wait_time = SHUTDOWN_WAIT_S
    manager.start_kernel(cwd=str(ROOT), env=environment())
    client = manager.client()
    client.start_channels()
    typed, prompts, printed = iter(["p secret", "c"]), [], []
    try:
        client.wait_for_ready(timeout=60)
        request = client.execute(DEBUGGED_CELL, allow_stdin=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                asked = client.get_stdin_msg(timeout=0.1)
                prompts.append(asked["content"]["prompt"])
                client.input(next(typed))
            except queue.Empty:
                pass
            try:
                message = client.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                continue
            if message["parent_header"].get("msg_id") != request:
                continue
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])
            elif message["msg_type"] == "error":
                printed.append("\n".join(message["content"]["traceback"]))
            elif message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                break
    finally:
        client.stop_channels()
        manager.shutdown_kernel()
    output = "".join(printed)
    assert prompts == ["(Pdb rank 1 on " + prompts[0].split(" on ", 1)[1]] * 2, prompts
    assert "pdb on rank 1 (" in output and "'secret-of-rank-1'" in output, output
    assert "fit ended at step 4" in output, output
