"""How long a dead worker takes to reach the controller as ``MeshFailureError``, in each case.

    python -m benchmarks.death_report [--reps 3]

A worker kills itself (SIGKILL) after writing the time; the controller's ``fit`` then raises
``MeshFailureError``, and the time between is the report's delay. Cases:

- ``outside_a_collective``: rank 1 dies in ``validation_step``, where rank 0 goes on alone;
- ``inside_a_collective``: rank 1 dies in ``training_step``, while rank 0 waits for it in the
  gradient all-reduce (its gloo error arrives first and names the survivor);
- ``on_another_host``: both workers run on a Monarch host in a UTS namespace of its own, under
  another hostname, so that the controller cannot watch their processes and Monarch's supervision
  reports the death, as for a real remote host;
- ``host_cut_off``: one worker on a host across a network (``tests.served_hosts.NetworkHost``) whose
  link goes down in the middle of ``fit``, so that nothing it sends arrives and nothing is answered;
  the delay is from the cut to the controller's ``MeshFailureError``;
- ``killed_controller``: the controller is SIGKILLed in the middle of ``fit``; the delay is until
  its worker processes have ended.

Writes ``benchmarks/results/death_report.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import psutil

from benchmarks import plots
from lightning_monarch import MeshFailureError, MonarchStrategy, stop_meshes
from lightning_monarch.controller.mesh.hosts import reachable
from tests.models import Classifier
from tests.served_hosts import NetworkHost
from tests.test_hidden_hosts import report_of_a_cut

RESULTS = Path(__file__).resolve().parent / "results"
#: The name of the host that plays another machine: its own UTS and mount namespaces.
REMOTE = "lightning-monarch-remote"
ROOT = RESULTS.parent.parent


class DiesOnRank1(Classifier):
    """Rank 1 writes the time to ``stamp`` and SIGKILLs itself in ``hook`` at its second batch."""

    def __init__(self, hook: str, stamp: str) -> None:
        super().__init__()
        self.hook, self.stamp = hook, stamp

    def _maybe_die(self, hook: str, batch_idx: int) -> None:
        if hook == self.hook and batch_idx == 1 and self.global_rank == 1:
            Path(self.stamp).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._maybe_die("training_step", batch_idx)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._maybe_die("validation_step", batch_idx)
        self.log("val_loss", 0.0)  # no sync_dist: rank 0 goes on alone


def death_delay(hook: str, hosts: Optional[list[str]] = None) -> float:
    """Seconds from a worker's death to ``MeshFailureError`` in the controller."""
    with tempfile.TemporaryDirectory() as scratch:
        stamp = str(Path(scratch) / "died_at")
        trainer = L.Trainer(
            strategy=MonarchStrategy(hosts=hosts, keep_warm=False),
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            limit_train_batches=4,
            limit_val_batches=3,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        try:
            trainer.fit(DiesOnRank1(hook, stamp))
        except MeshFailureError:
            return time.time() - float(Path(stamp).read_text())
    raise RuntimeError("the worker did not die")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def remote_death_delay() -> float:
    """``death_delay`` with the workers on a host under another hostname (UTS and mount namespaces)."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    hosts_file = Path(tempfile.mkdtemp()) / "hosts"
    # the host's name resolves inside its namespace only, where torch.distributed's rendezvous needs it
    serve = (
        f"hostname {REMOTE} && (echo '127.0.0.1 {REMOTE}'; cat /etc/hosts) > {hosts_file}"
        f" && mount --bind {hosts_file} /etc/hosts && exec {sys.executable} -c 'from monarch.actor import"
        f' run_worker_loop_forever; run_worker_loop_forever(address="{address}", ca="trust_all_connections")\''
    )
    host = subprocess.Popen(["unshare", "--uts", "--mount", "--fork", "sh", "-c", serve], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not reachable(address) and time.monotonic() < deadline:
            time.sleep(0.1)
        return death_delay("training_step", hosts=[address])
    finally:
        os.killpg(host.pid, signal.SIGKILL)
        host.wait()


KILLED_CONTROLLER = """
import lightning as L, time, lightning_monarch
from tests.models import Classifier
from tests.served_hosts import NetworkHost
from tests.test_hidden_hosts import report_of_a_cut
class Announce(L.Callback):
    def on_train_batch_start(self, trainer, *args):
        print("workers", *trainer.strategy.worker_pids, flush=True)
        time.sleep(0.05)
L.Trainer(strategy="monarch", accelerator="cpu", devices=2, max_epochs=1000, logger=False, enable_progress_bar=False,
          enable_checkpointing=False, callbacks=[Announce()]).fit(Classifier())
"""


def cut_off_delay() -> float:
    """Seconds from a host's silent cut to ``MeshFailureError`` in its controller."""
    host = NetworkHost(REMOTE)
    try:
        host.start()
        return report_of_a_cut(host)[0]
    finally:
        host.stop()


def killed_controller_delay() -> float:
    """Seconds from a SIGKILL of the controller, in the middle of ``fit``, until its workers ended."""
    controller = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONTROLLER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    pids = [int(pid) for pid in next(line for line in controller.stdout if line.startswith("workers")).split()[1:]]
    controller.kill()
    killed = time.monotonic()
    controller.wait()
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
        if time.monotonic() - killed > 60:
            raise RuntimeError(f"workers {pids} outlived their controller by 60 s")
        time.sleep(0.01)
    return time.monotonic() - killed


CASES = {
    "outside_a_collective": lambda: death_delay("validation_step"),
    "inside_a_collective": lambda: death_delay("training_step"),
    "on_another_host": remote_death_delay,
    "host_cut_off": cut_off_delay,
    "killed_controller": killed_controller_delay,
}


def plot(summary: dict[str, Any]) -> Any:
    """Each case's seconds from the death to the report, median and runs. ``ddp`` has no such
    report to draw beside it."""
    figure, axis = plots.pyplot().subplots(figsize=(7, 3.5))
    names = list(summary)
    axis.barh(names, [summary[name]["median_s"] for name in names])
    for index, name in enumerate(names):
        axis.plot(summary[name]["runs_s"], [index] * len(summary[name]["runs_s"]), "k.")
    axis.set_xlabel("seconds from the death to the report (median; dots: each run)")
    axis.set_ylabel("where the worker died")
    axis.set_title("A dead worker, 2 CPU workers on a 2-core machine")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {name: [] for name in CASES}
    for rep in range(args.reps):
        for name, measure in CASES.items():
            print(f"[{rep + 1}/{args.reps}] {name} ...", flush=True)
            runs[name].append(measure())
            stop_meshes()
    summary = {
        name: {"median_s": statistics.median(values), "max_s": max(values), "runs_s": values}
        for name, values in runs.items()
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "death_report.json").write_text(json.dumps(summary, indent=2))
    table = ["| case | median s | max s | runs |", "|---|---|---|---|"] + [
        f"| {name} | {entry['median_s']:.2f} | {entry['max_s']:.2f} | {len(entry['runs_s'])} |"
        for name, entry in summary.items()
    ]
    (RESULTS / "death_report.md").write_text("\n".join(table) + "\n")
    plots.save(plot(summary), RESULTS / "death_report.png")
    print("\n".join(table))


if __name__ == "__main__":
    main()
