"""What carrying the script's process state to the workers costs a warm stage's start.

    python -m benchmarks.script_state [--reps 5]

Issue 73: each stage, the controller reads torch's settings that the script changed
(``torch_settings.changed``) and packs, after the stage's objects, the data attributes of the
classes and modules they refer to by reference (``controller.mesh.imported_state.gather``); each
worker compares those with its own import's (``worker.imported_state.CarriedState``). Measured in
this process (the controller; a worker's comparison is timed here on the parcel opened as a worker
opens it) for two payloads users send: the 400 MiB benchmark model, and a datamodule holding a text
corpus (200,000 sentences and their vocabulary as Python objects, pickled in the payload) with a
class attribute the script changed. Each is held against the same payload's warm ``validate`` of
one batch with 2 workers, timed in the same run: the target is under 5 % of it.

Writes ``benchmarks/results/script_state.json`` (every repetition and the medians),
``script_state.md`` and ``script_state.png``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import cloudpickle
import lightning as L

from benchmarks import plots
from benchmarks.corpus import Corpus, CorpusData, CorpusModel
from benchmarks.run import write_results
from lightning_monarch import stop_meshes, torch_settings
from lightning_monarch.benchmark.models import BenchModel
from lightning_monarch.controller.mesh import imported_state
from lightning_monarch.controller.mesh.payload import _ReferenceRecorder, travel_error
from lightning_monarch.worker.imported_state import CarriedState

TARGET = 0.05
#: (figure, what it times) for each part of the cost, in ms
PARTS = (
    ("torch_settings_ms", "torch's settings read and compared (controller)"),
    ("imported_state_ms", "classes' and modules' state gathered and pickled (controller)"),
    ("compare_ms", "that state unpickled and compared (each worker)"),
)


def _payloads() -> dict[str, Callable[[], tuple[L.LightningModule, Any]]]:
    return {
        "400 MiB module": lambda: (BenchModel("400mib", 2), None),
        "text corpus (200,000 sentences)": lambda: (CorpusModel(), CorpusData()),
    }


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return (time.perf_counter() - start) * 1000, value


def measure(module: L.LightningModule, datamodule: Any) -> dict[str, float]:
    """One repetition: each part's ms, and the warm ``validate`` of one batch's."""
    objects = {"LightningModule": module, "LightningDataModule": datamodule}
    torch_settings.FRESH.values()
    torch_ms, _ = _timed(torch_settings.changed)
    recorder = _ReferenceRecorder(io.BytesIO(), buffer_callback=lambda buffer: False)
    recorder.bytes_out_of_band = True
    recorder.dump(tuple(objects.values()))  # as the payload's packing meets its classes
    gather_ms, state = _timed(lambda: imported_state.gather(recorder.classes, recorder.references, travel_error))
    pickle_ms, pickled = _timed(lambda: cloudpickle.dumps(state))  # at most: the payload's memo shares some
    compare_ms, carried = _timed(lambda: CarriedState(cloudpickle.loads(pickled)))
    carried.undo()
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=2,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    validate_ms, _ = _timed(lambda: trainer.validate(module, datamodule=datamodule, verbose=False))
    return {
        "torch_settings_ms": torch_ms,
        "imported_state_ms": gather_ms + pickle_ms,
        "imported_values": sum(len(values) for values in [*state.attributes.values(), *state.settings.values()]),
        "compare_ms": compare_ms,
        "warm_validate_ms": validate_ms,
    }


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """The medians per payload, and the parts' share of the warm ``validate``."""
    summary = {}
    for payload, repetitions in runs.items():
        medians = {figure: statistics.median(run[figure] for run in repetitions) for figure in repetitions[0]}
        cost = sum(medians[figure] for figure, _ in PARTS)
        summary[payload] = {**medians, "cost_ms": cost, "share": cost / medians["warm_validate_ms"]}
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| payload | " + " | ".join(f"{what} (ms)" for _, what in PARTS) + " | warm validate (ms) | share | target |",
        "|---" * (len(PARTS) + 4) + "|",
    ]
    for payload, row in summary.items():
        parts = " | ".join(f"{row[figure]:.1f}" for figure, _ in PARTS)
        met = "met" if row["share"] < TARGET else "not met"
        lines.append(
            f"| {payload} | {parts} | {row['warm_validate_ms']:.0f} | {100 * row['share']:.1f} % | < 5 %: {met} |"
        )
    return "\n".join(lines)


def plot(figures: dict[str, Any]) -> Any:
    """Each payload's parts, stacked, against 5 % of its warm ``validate``."""
    summary = figures["summary"]
    figure, axis = plots.pyplot().subplots(figsize=(8, 4))
    payloads = list(summary)
    bottom = [0.0] * len(payloads)
    for name, what in PARTS:
        values = [summary[payload][name] for payload in payloads]
        axis.bar(payloads, values, bottom=bottom, label=what)
        bottom = [low + value for low, value in zip(bottom, values, strict=True)]
    axis.scatter(
        payloads,
        [TARGET * summary[payload]["warm_validate_ms"] for payload in payloads],
        marker="_",
        s=2000,
        color="tab:red",
        label="5 % of the warm validate",
    )
    axis.set_ylabel("ms per stage start")
    axis.set_title("carrying the script's process state: its cost per stage")
    axis.legend(fontsize=7, loc="center")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        for name, make in _payloads().items():
            module, datamodule = make()
            if datamodule is not None:
                Corpus.lowercase = True  # the script's change, which the workers must see
            measure(module, datamodule)  # the mesh warm, the stage's weights held by the workers
            for rep in range(args.reps):
                print(f"[{name}, {rep + 1}/{args.reps}] ...", flush=True)
                runs.setdefault(name, []).append(measure(module, datamodule))
    finally:
        stop_meshes()
    summary = summarize(runs)
    write_results("script_state", {"summary": summary, "runs": runs}, table(summary), plot)


if __name__ == "__main__":
    main()
