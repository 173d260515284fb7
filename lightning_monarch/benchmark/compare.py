"""``strategy="monarch"`` against ``strategy="ddp"`` on this machine: milliseconds per step.

Runs in the user's process, as ``lightning-monarch benchmark``. Every run is a fresh process
(``python -m lightning_monarch.benchmark.measure``): ``ddp`` re-executes the running command for
each rank, so it cannot run inside this one, and fresh processes give both modes the same cold
start. The modes alternate (monarch, ddp, monarch, ddp, ...) so that machine noise hits them
alike; the figures are medians. The repository's ``benchmarks/run.py`` is the full suite (more
modes, sizes and figures) on the same model and measurement.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_monarch.benchmark.measure import WARMUP_STEPS

MODES = ("monarch", "ddp")


class BenchmarkError(RuntimeError):
    """A measured run failed; the message carries the end of its output."""


@dataclass(frozen=True)
class Comparison:
    """What ``compare`` measured: per mode, ms per training step of every run, in run order."""

    size: str
    steps: int
    accelerator: str
    devices: int
    step_ms: dict[str, list[float]]

    def median_ms(self, mode: str) -> float:
        return statistics.median(self.step_ms[mode])

    @property
    def throughput_ratio(self) -> float:
        """monarch's steps per second over ddp's: 1.0 is parity, below 1 monarch is slower."""
        return self.median_ms("ddp") / self.median_ms("monarch")

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "median_ms": {mode: self.median_ms(mode) for mode in self.step_ms},
            "throughput_ratio_monarch_over_ddp": self.throughput_ratio,
        }

    def table(self) -> str:
        """The medians side by side, and the ratio."""
        runs = len(self.step_ms["monarch"])
        lines = [f"{'strategy':<10}{'ms/step':>10}   (median of {runs} run(s), {self.steps} timed steps each)"]
        lines += [f"{mode:<10}{self.median_ms(mode):>10.1f}" for mode in MODES]
        lines.append(
            f"monarch/ddp throughput: {self.throughput_ratio:.2f}"
            f" (monarch adds {self.median_ms('monarch') - self.median_ms('ddp'):.1f} ms per step)"
        )
        return "\n".join(lines)


def compare(
    size: str, steps: int, accelerator: str, devices: int, reps: int, progress: Callable[[str], None]
) -> Comparison:
    """Time ``steps`` training steps of the ``size`` model ``reps`` times per mode, alternating the
    modes; report each run to ``progress`` as it ends."""
    step_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = [mode for _ in range(reps) for mode in MODES]
    for done, mode in enumerate(order, start=1):
        # WARMUP_STEPS untimed steps, then steps + 1 batch ends make steps intervals
        result = _measure(mode, size, steps + WARMUP_STEPS + 1, accelerator, devices)
        step_ms[mode].append(result["step_ms"])
        progress(
            f"[{done}/{len(order)}] {mode}, {size}: {result['step_ms']:.1f} ms/step"
            f" (first step after {result['first_step_s']:.1f} s)"
        )
    return Comparison(size, steps, accelerator, devices, step_ms)


def _measure(mode: str, size: str, steps: int, accelerator: str, devices: int) -> dict[str, Any]:
    """One run in a fresh process. On an interrupt the run gets SIGINT too, so that it stops its
    own workers or ranks, and is killed if it has not ended after a while."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        command = [
            sys.executable,
            "-m",
            "lightning_monarch.benchmark.measure",
            "--mode",
            mode,
            "--size",
            size,
            "--steps",
            str(steps),
            "--accelerator",
            accelerator,
            "--devices",
            str(devices),
            "--out",
            str(out),
        ]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = process.communicate()
        except BaseException:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise
        if process.returncode != 0 or not out.exists():
            raise BenchmarkError(
                f"The {mode} run failed (exit code {process.returncode}); the end of its output:\n{output[-3000:]}\n"
                f"Run it alone to see all of it: {' '.join(command[:-2])} --out result.json"
            )
        return json.loads(out.read_text())
