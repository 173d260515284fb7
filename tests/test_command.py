"""The ``lightning-monarch`` command: ``info``, ``preflight`` and ``benchmark`` as real processes,
and what ``info`` says checked against what a Trainer's ``MonarchStrategy`` does with the same
arguments. Processes that the command starts (workers, ``ddp`` ranks) carry a marker in their
environment, so that none can outlive it unnoticed."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_monarch import cli
from lightning_monarch.benchmark.compare import Comparison
from lightning_monarch.devices import VISIBILITY_VARS
from lightning_monarch.wire.specs import versions
from tests.conftest import ROOT
from tests.served_hosts import ServedHost

COMMAND = str(Path(sys.executable).parent / "lightning-monarch")
MARKER = "LIGHTNING_MONARCH_TEST_COMMAND"


def run(*arguments: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the command with a marker in its environment; fail if a process carrying it is left."""
    marker = uuid.uuid4().hex
    done = subprocess.run(
        [COMMAND, *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, MARKER: marker},
    )
    deadline = time.monotonic() + 10
    while (left := _carrying(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in left:
        process.kill()
    assert not left, f"processes left behind by `lightning-monarch {' '.join(arguments)}`: {left}"
    return done


def _carrying(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == marker and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def trainer_key(**flags: Any) -> Any:
    """What the strategy of ``Trainer(strategy="monarch", **flags)`` would start."""
    return L.Trainer(strategy="monarch", logger=False, **flags).strategy._settings().mesh_key()


@pytest.fixture(autouse=True)
def lightning_log_level():
    """``cli.main`` quiets Lightning's info lines; other tests in this process keep theirs."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.timeout(60)
def test_help_lists_the_commands() -> None:
    done = run("--help")
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^    (\w+)", done.stdout, re.MULTILINE) == [
        "info",
        "preflight",
        "benchmark",
        "rehearse",
        "convert",
        "serve",
    ], done.stdout


@pytest.mark.timeout(60)
def test_info_for_gpu_workers_needs_a_gpu_build_of_torch() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_monarch",
            "info",
            "--accelerator",
            "gpu",
            "--devices",
            "2",
            "--num-nodes",
            "2",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    if torch.version.cuda or torch.version.hip:
        pytest.skip("this torch is a GPU build")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is a CPU-only build" in done.stderr and "Install a CUDA or ROCm build of torch" in done.stderr


def test_info_json_is_what_the_trainer_would_start(cuda_build: pytest.MonkeyPatch) -> None:
    cuda_build.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    info = json.loads(json.dumps(cli.describe(2, "gpu")))
    key = trainer_key(accelerator="gpu", devices=2)
    assert info["trainer"]["pins"] == [dict([pin]) for pin in key.pins]
    assert info["trainer"]["pins"] == [{"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert (info["trainer"]["workers"], info["trainer"]["workers_per_host"]) == (2, 2)
    assert info["trainer"]["accelerator"] == key.accelerator == "cuda"
    assert info["trainer"]["process_group_backend"] == "nccl"
    assert info["host"]["visibility"] == {"CUDA_VISIBLE_DEVICES": "4,5,6"}
    assert info["versions"]["torch"] == torch.__version__
    assert info["versions"]["torchmonarch"] == version("torchmonarch")


def test_info_on_several_hosts_leaves_the_pins_to_each_host(cuda_build: pytest.MonkeyPatch) -> None:
    cuda_build.setenv("CUDA_VISIBLE_DEVICES", "4")  # this machine's mask says nothing of the other hosts'
    info = cli.describe([0, 1], "gpu", num_nodes=2)
    assert info["trainer"]["pins"] is None and info["trainer"]["device_indices"] == [0, 1]
    assert (info["trainer"]["workers"], info["trainer"]["workers_per_host"]) == (4, 2)
    assert "GPU index 1 within each host's own visibility mask" in cli.render_info(info)


def test_info_text_for_cpu_workers(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["info", "--accelerator", "cpu", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    key = trainer_key(accelerator="cpu", devices=2)
    assert key.gpu_indices is None and key.per_host == 2 and key.accelerator == "cpu"
    assert "0           - (CPU worker: no device to pin)" in out
    assert "Trainer(strategy='monarch', accelerator='cpu', devices=2) would start" in out
    assert "2 worker process(es) on this host\n  accelerator cpu, backend gloo" in out
    assert f"torchmonarch      {version('torchmonarch')}" in out
    assert "No worker was started." in out


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, [{"HIP_VISIBLE_DEVICES": "0"}, {"HIP_VISIBLE_DEVICES": "1"}]),
        ({"ROCR_VISIBLE_DEVICES": "2,3"}, [{"ROCR_VISIBLE_DEVICES": "2"}, {"ROCR_VISIBLE_DEVICES": "3"}]),
    ],
)
def test_info_on_rocm(monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], expected: list[dict[str, str]]) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    for name in VISIBILITY_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    info = cli.describe(2, "gpu")
    key = trainer_key(accelerator="gpu", devices=2)
    assert info["trainer"]["pins"] == [dict([pin]) for pin in key.pins] == expected
    assert info["trainer"]["process_group_backend"] == "nccl (RCCL)"
    assert info["versions"]["hip"] == "6.3.42131"
    assert "backend nccl (RCCL)" in cli.render_info(info)


def test_info_on_rocm_rejects_two_visibility_variables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1")
    with pytest.raises(MisconfigurationException, match="are both set"):
        cli.describe(2, "gpu")
    assert cli.main(["info", "--accelerator", "gpu", "--devices", "2"]) == 2
    assert "lightning-monarch info: error: HIP_VISIBLE_DEVICES='0,1' and ROCR_VISIBLE_DEVICES='0,1' are both set" in (
        capsys.readouterr().err
    )


@pytest.mark.timeout(120)
def test_preflight_checks_every_worker_and_stops_them() -> None:
    done = run("preflight", "--devices", "2", "--all-reduce-mib", "1", timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "Starting 2 worker(s)" in done.stdout
    lines = done.stdout.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("host "))
    rows = [line.split() for line in lines[header + 1 :]]
    assert [row[1] for row in rows] == ["0", "1"], done.stdout
    assert all(row[3] == "cpu" and row[5] == versions()["torch"] for row in rows), done.stdout
    pids = [int(row[2]) for row in rows]
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.timeout(120)
def test_benchmark_times_both_strategies() -> None:
    done = run("benchmark", "--steps", "5", "--size", "small", "--reps", "1", "--accelerator", "cpu", timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "2 cpu workers, gloo" in done.stderr
    progress = re.findall(r"^\[(\d)/2\] (\w+), small: ([\d.]+) ms/step", done.stderr, re.MULTILINE)
    assert [(step, mode) for step, mode, _ in progress] == [("1", "monarch"), ("2", "ddp")], done.stderr
    table = dict(re.findall(r"^(monarch|ddp) +([\d.]+)$", done.stdout, re.MULTILINE))
    assert table == {mode: ms for _, mode, ms in progress}, done.stdout
    ratio = float(re.search(r"monarch/ddp throughput: ([\d.]+)", done.stdout).group(1))
    # the table rounds each median to 0.1 ms and the ratio to 0.01: the ratio of the unrounded
    # medians lies within what the rounded ones allow
    ddp, monarch = float(table["ddp"]), float(table["monarch"])
    assert (ddp - 0.05) / (monarch + 0.05) - 0.005 <= ratio <= (ddp + 0.05) / (monarch - 0.05) + 0.005, done.stdout


def test_the_comparison_reports_medians_and_their_ratio() -> None:
    comparison = Comparison("small", 5, "cpu", 2, {"monarch": [10.0, 14.0, 12.0], "ddp": [6.0, 5.0, 7.0]})
    summary = comparison.as_dict()
    assert summary["median_ms"] == {"monarch": 12.0, "ddp": 6.0}
    assert summary["throughput_ratio_monarch_over_ddp"] == 0.5
    assert "monarch/ddp throughput: 0.50 (monarch adds 6.0 ms per step)" in comparison.table()


def test_serve_imports_no_torch() -> None:
    """A worker host's main process only relays: ``lightning-monarch serve`` imports neither torch
    nor Lightning (which imports torch), as its worker processes do (about 4 CPU-s and 400 MiB)."""
    host = ServedHost(notices=True)
    host.start()
    try:
        assert host.process is not None
        mapped = [mapping.path for mapping in psutil.Process(host.process.pid).memory_maps()]
        assert mapped and not [path for path in mapped if "libtorch" in path]
    finally:
        host.stop()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["info", "--devices", "0"], "--devices 0: give the number of workers per host, 1 or more"),
        (["preflight", "--devices", "0"], "--devices 0: give the number of workers per host, 1 or more"),
        (["benchmark", "--steps", "0"], "--steps 0 --reps 2: give 1 or more of each"),
        (["benchmark", "--accelerator", "gpu", "--devices", "1024"], "accelerator='gpu')`: this process's torch"),
        (["preflight", "--accelerator", "cuda", "--devices", "1024"], "or use `accelerator='cpu'`"),
        (
            ["info", "--accelerator", "cpu", "--devices", "0,1"],
            "`devices` selected with `CPUAccelerator` should be an int > 0",
        ),
        (["serve", "node-1:26600"], "ADDRESS 'node-1:26600' is not a Monarch channel address"),
        (["serve", "tcp://node-1:26600", "--grace", "0"], "--grace 0: give the seconds this host lives on"),
    ],
)
def test_bad_input_exits_2_with_the_fix(arguments: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"lightning-monarch {arguments[0]}: error: ") and message in error, error


@pytest.mark.parametrize("arguments", [["benchmark", "--size", "huge"], ["info", "--devices", "two"], ["launch"]])
def test_arguments_argparse_rejects_exit_2(arguments: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit:
        cli.main(arguments)
    assert exit.value.code == 2
    assert "error: argument" in capsys.readouterr().err
