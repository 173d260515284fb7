"""The scripts under ``examples/`` run as a user runs them: ``python examples/<name>.py``.

Each example runs in its own subprocess, which is the controller and starts and stops its own
Monarch workers, with flags that keep it short. The test checks the exit code, the final line the
script prints, and that none of the script's worker processes outlives it: the conftest leak check
sees only this process's children, so the script's workers are found by a marker in their
environment, which they inherit from the script.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from lightning_monarch.controller.mesh.forkserver import is_worker_process

ROOT = Path(__file__).resolve().parent.parent

#: Environment variable that marks the worker processes of one example run.
RUN_MARKER = "LIGHTNING_MONARCH_EXAMPLE_RUN"

pytestmark = pytest.mark.timeout(240)


def run_script(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python <args>`` in the repository root, with ``env`` added to this environment; fail if
    it runs past ``timeout`` or leaves a worker process behind."""
    run_id = uuid.uuid4().hex
    try:
        completed = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            env={**os.environ, **(env or {}), RUN_MARKER: run_id},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{args} did not finish within {timeout} s:\n{_text(expired.stdout)}\n{_text(expired.stderr)}")
    finally:
        left = _stop_workers_left_by(run_id)
    assert not left, f"{args} left worker processes behind: {left}"
    return completed


def run_example(args: list[str]) -> str:
    """Run an example; return its stdout once it exited with 0."""
    completed = run_script(args)
    assert completed.returncode == 0, f"{args} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-6000:]}"
    return completed.stdout


def _text(output: str | bytes | None) -> str:
    return (output.decode(errors="replace") if isinstance(output, bytes) else output or "")[-4000:]


def _stop_workers_left_by(run_id: str, grace: float = 10.0) -> list[int]:
    """Give the run's worker processes ``grace`` seconds to end, then kill the rest by PID; return
    the PIDs that had to be killed."""
    deadline = time.monotonic() + grace
    while (left := _workers_of(run_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in left:
        process.kill()
    return [process.pid for process in left]


def _workers_of(run_id: str) -> list[psutil.Process]:
    workers = []
    for process in psutil.process_iter():
        try:
            if is_worker_process(process) and process.environ().get(RUN_MARKER) == run_id:
                workers.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return workers


def final_match(pattern: str, stdout: str) -> re.Match:
    match = re.search(pattern, stdout)
    assert match, f"no line matching {pattern!r} in the output:\n{stdout[-2000:]}"
    return match


def example_module(name: str) -> types.ModuleType:
    """``examples/<name>.py`` imported into this process, for its classes (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def untrained_scores(model: torch.nn.Module, metrics: Any, dataset: Any) -> dict[str, float]:
    """``metrics`` of ``model`` as initialized with the examples' seed (0), on all of ``dataset``: the
    score the example's run must beat. Runs here, on the CPU; this process's RNG is left as it was."""
    images, labels = dataset.tensors
    with torch.no_grad():
        metrics.update(model.eval()(images), labels)
    value = metrics.compute()
    return {key: float(item) for key, item in value.items()} if isinstance(value, dict) else {"value": float(value)}


def test_image_classifier(tmp_path: Path) -> None:
    stdout = run_example(["examples/image_classifier.py", "--max-epochs", "2", "--default-root-dir", str(tmp_path)])
    match = final_match(r"Test accuracy of the best checkpoint: (\d\.\d+) \(macro F1 (\d\.\d+)\)", stdout)
    example = example_module("image_classifier")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = example.ShapesCNN()
    data = example.ShapesDataModule()
    data.setup("test")
    untrained = untrained_scores(model, model.test_metrics, data.test_set)
    # measured: trained 0.559 (F1 0.517); untrained 0.259 (F1 0.134), and 0.23-0.32 (F1 0.10-0.30) for seeds 0-4
    assert float(match[1]) > 0.4  # chance is 0.25
    assert float(match[1]) > untrained["test_acc"] + 0.15 and float(match[2]) > untrained["test_f1"] + 0.2, untrained


def test_gan(tmp_path: Path) -> None:
    # 30 of the example's 40 epochs (of 8192 points): covering the modes takes that many. Measured
    # on this build (seeded, the same each run): 8/8 modes and 69.9% within 3 std after 40 epochs;
    # 8/8 and 54.8% after 30; 5/8 and 13.9% after 20; 0-1/8 after up to 8; an untrained generator 0/8, 0.0%
    stdout = run_example(
        ["examples/gan.py", "--max-epochs", "30", "--dataset-size", "8192", "--default-root-dir", str(tmp_path)]
    )
    match = final_match(r"Modes covered: (\d)/8; samples within 3 std of a mode: (\d+\.\d)%", stdout)
    assert int(match[1]) >= 6 and float(match[2]) >= 30, match[0]


def test_transformer_lm(tmp_path: Path) -> None:
    stdout = run_example(
        [
            "examples/transformer_lm.py",
            "--max-epochs",
            "2",
            "--sentences",
            "2000",
            "--data-dir",
            str(tmp_path / "corpus"),
            "--default-root-dir",
            str(tmp_path),
        ]
    )
    match = final_match(r"Validation perplexity: (\d+\.\d+) \(a uniform guess: (\d+)\)", stdout)
    assert float(match[1]) < float(match[2])  # it learned more than the vocabulary
    assert (tmp_path / "corpus" / "wikitext-2.txt").is_file()  # written by prepare_data on a worker


def test_finetune_backbone(tmp_path: Path) -> None:
    stdout = run_example(
        [
            "examples/finetune_backbone.py",
            "--pretrain-epochs",
            "2",
            "--max-epochs",
            "6",
            "--default-root-dir",
            str(tmp_path),
        ]
    )
    match = final_match(r"test accuracy (\d\.\d+); backbone unchanged: (\w+)", stdout)
    example = example_module("finetune_backbone")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = example.DigitClassifier(num_classes=len(example.TARGET_DIGITS))
    data = example.DigitsDataModule(example.TARGET_DIGITS, train_per_class=20)
    data.setup("test")
    untrained = untrained_scores(model, model.test_acc, data.test_set)["value"]
    # measured: 0.637 after 6 fine-tuning epochs (0.632 after 4, 0.601 after 8, 0.256 after 2: not
    # yet learned); untrained 0.160, and 0.16-0.32 for seeds 0-4 (chance is 0.2)
    assert float(match[1]) > untrained + 0.25, untrained
    assert match[2] == "True"


def test_cli_one_host(tmp_path: Path) -> None:
    stdout = run_example(
        [
            "examples/cli/main.py",
            "fit",
            "--config",
            "examples/cli/monarch_1host.yaml",
            "--trainer.max_epochs",
            "3",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    final_match(r"Validation R2: -?\d+\.\d+ \(MSE \d+\.\d+", stdout)
    assert list(tmp_path.glob("lightning_logs/version_0/config.yaml")), "LightningCLI saved no config"


def test_cli_slurm_config_is_checked_before_submission(tmp_path: Path) -> None:
    """``monarch_slurm.yaml`` through ``main.py``'s own LightningCLI, as a user runs it, on a machine
    without SLURM (``PATH`` is an empty folder, so no ``sbatch`` can be found, even on a cluster).

    Everything up to the submission runs for real: the config parses against the real signatures,
    ``MonarchStrategy(hosts=SlurmJob(...))`` is instantiated, and ``Trainer(...)`` accepts
    ``accelerator="gpu"``, ``devices=8`` and ``num_nodes=2`` on this GPU-less controller (with a CUDA
    build of torch, which this CPU build stands in for) and checks
    the job before submitting it (host mesh named ``hosts`` with ``num_nodes`` hosts, one task per
    node, ``gpus_per_node`` >= ``devices``). The last check, that ``sbatch`` exists, is the one
    that fails, so nothing is submitted: any other mistake in the file fails earlier, differently.
    """
    # a CUDA build of torch, which GPU workers need, stands in for this CPU build (the only stand-in)
    cuda_build = tmp_path / "cuda_build"
    cuda_build.mkdir()
    (cuda_build / "sitecustomize.py").write_text("import torch\ntorch.version.cuda = '12.8'\n")
    completed = run_script(
        ["examples/cli/main.py", "fit", "--config", "examples/cli/monarch_slurm.yaml"],
        env={
            "PATH": str(tmp_path),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(cuda_build), os.environ.get("PYTHONPATH")])),
        },
    )
    assert completed.returncode != 0
    assert completed.stderr.rstrip().splitlines()[-1] == (
        "lightning.fabric.utilities.exceptions.MisconfigurationException: `MonarchStrategy(hosts=SlurmJob(...))`"
        " submits and watches the job with SLURM's sbatch and squeue, which this machine's PATH does not have."
        " Run the controller on a SLURM login node or inside an allocation, or use `attach_to_workers` / a list"
        " of worker addresses."
    ), completed.stderr[-4000:]
