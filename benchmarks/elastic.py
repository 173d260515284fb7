"""Elastic-training benchmark: host 1 of 2 (a ``ProcessJob``, 1 CPU worker each) lost mid-fit, medium model.

    python -m benchmarks.elastic

Each case runs in a fresh process; the figures go to ``benchmarks/results/elastic.json``,
``elastic.md`` and ``elastic.png``. From the death to the next finished training step:

- ``monarch, min_nodes=1``: host 1's host process and worker SIGKILLed; the controller finds
  that host's socket refusing connections (lost at once, without waiting ``connect_timeout`` for
  a new process there) and goes on with host 0's worker (kept) from the resume point at the
  epoch's start;
- ``monarch, min_nodes=1, preemption notice``: hosts served by ``lightning-monarch serve``; host
  1's host process and worker get SIGTERM, the notice a preemptible host gets before it is taken:
  the workers park at the end of their next optimizer step, and the controller goes on with host
  0's worker from there;
- ``monarch, max_restarts=1``: only host 1's worker SIGKILLed, the host lives: new processes on
  both hosts, resumed from the epoch's snapshot and the steps since replayed;
- the alternative a user has today: a new ``ddp`` run with one process fewer (doubled
  ``accumulate_grad_batches``) and ``fit(ckpt_path="last.ckpt")``, the ``last.ckpt`` the run had
  written when the host died, from its launch to its first step, not counting the time to notice
  the failure and relaunch.

Steps redone: where monarch goes on from a resume point, the steps the controller saw twice
(measured); under ``max_restarts``, which the controller sees once each, the steps the new workers
replay from the epoch's snapshot; for ``ddp``, the steps between the ``last.ckpt`` it resumes from
and the death.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning as L
import torch
from monarch.job import ProcessJob

from benchmarks import plots
from benchmarks.fresh import RESULTS, FirstStep, run_cases
from benchmarks.recovery import BATCHES, CHECKPOINT_EVERY, KILL_AT, SIZE, STEPS, KillRank1, fault_trainer
from lightning_monarch import MonarchStrategy, stop_meshes
from lightning_monarch.benchmark.models import BenchModel
from tests.served_hosts import ServedHost

#: The run of ``benchmarks.recovery``: 10 steps per epoch, the death 5 steps after the epoch-3 start.
STEPS_PER_EPOCH = BATCHES // 2
#: How long the lost host has to serve a new process (``MonarchStrategy(connect_timeout=...)``).
CONNECT_TIMEOUT_S = 5.0


def run_case(case: str, scratch: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    L.seed_everything(0)
    if case == "ddp_restart_one_fewer":
        trainer = fault_trainer("ddp", [FirstStep()], scratch / case, devices=1, accumulate_grad_batches=2)
        trainer.fit(BenchModel(SIZE, BATCHES), ckpt_path=str(scratch / "before_death.ckpt"))
        return {}
    shrink, notice = case == "monarch_shrink", case == "monarch_notice"
    killer = KillRank1(whole_host=shrink, checkpoints=scratch / case if shrink else None, notice=notice)
    with ExitStack() as hosts:
        if notice:
            served = [ServedHost(notices=True), ServedHost(notices=True)]
            for host in served:
                hosts.callback(host.stop)
                host.start()
            addresses: Any = [host.address for host in served]
        else:
            addresses = ProcessJob({"hosts": 2})
            hosts.callback(addresses.kill)
        hosts.callback(stop_meshes)
        strategy = MonarchStrategy(
            hosts=addresses,
            connect_timeout=CONNECT_TIMEOUT_S,
            **({"min_nodes": 1} if shrink or notice else {"max_restarts": 1}),
        )
        trainer = fault_trainer(strategy, [killer], scratch / case, devices=1, num_nodes=2)
        trainer.fit(BenchModel(SIZE, BATCHES))
    assert killer.killed_at is not None and killer.resumed_at is not None
    return {
        "resumed_s": killer.resumed_at - killer.killed_at,
        "steps_redone": killer.steps_redone,
        "world_changes": strategy.world_changes,
        "restarts": strategy.restarts,
        "global_step": trainer.global_step,
    }


def main() -> None:
    results = run_cases(
        "benchmarks.elastic",
        __doc__.splitlines()[0],
        run_case,
        ("monarch_shrink", "monarch_notice", "monarch_restart", "ddp_restart_one_fewer"),
        "ddp_restart_one_fewer",
    )
    if results is None:  # one case, run in this process
        return
    results["monarch_restart"]["steps_redone"] = KILL_AT % STEPS_PER_EPOCH
    results["ddp_restart_one_fewer"]["steps_redone"] = KILL_AT % CHECKPOINT_EVERY
    redone = {case: result["steps_redone"] for case, result in results.items()}
    results["setup"] = {
        "model": SIZE,
        "steps": STEPS,
        "steps_per_epoch": STEPS_PER_EPOCH,
        "killed_at_step": KILL_AT,
        "checkpoint_every": CHECKPOINT_EVERY,
        "connect_timeout_s": CONNECT_TIMEOUT_S,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "elastic.json").write_text(json.dumps(results, indent=2))
    rows = [
        (
            "monarch, `min_nodes=1`: host lost (its socket refuses connections, so no `connect_timeout` wait),"
            " going on with 1 worker",
            results["monarch_shrink"]["resumed_s"],
            redone["monarch_shrink"],
        ),
        (
            "monarch, `min_nodes=1`, hosts served by `lightning-monarch serve`: SIGTERM (preemption notice),"
            " going on with 1 worker from the next step's end",
            results["monarch_notice"]["resumed_s"],
            redone["monarch_notice"],
        ),
        (
            "monarch, `max_restarts=1`: worker dead, host alive: new processes, replay of the steps since the epoch's start",
            results["monarch_restart"]["resumed_s"],
            redone["monarch_restart"],
        ),
        (
            "`ddp` with one process fewer from `last.ckpt`: launch to first step (not counting detection)",
            results["ddp_restart_one_fewer"]["first_step_s"],
            redone["ddp_restart_one_fewer"],
        ),
    ]
    table = "\n".join(
        ["| what | seconds to the next step | steps redone |", "|---|---|---|"]
        + [f"| {what} | {seconds:.2f} | {steps} |" for what, seconds, steps in rows]
    )
    (RESULTS / "elastic.md").write_text(table + "\n")
    plots.save(plot(results), RESULTS / "elastic.png")
    print(table)


#: The plot's bars: each case, the figure it shows and its label.
_BARS = (
    ("monarch_shrink", "resumed_s", "monarch: shrink\n(host lost)"),
    ("monarch_notice", "resumed_s", "monarch: shrink\n(SIGTERM notice)"),
    ("monarch_restart", "resumed_s", "monarch: restart\n(host alive)"),
    ("ddp_restart_one_fewer", "first_step_s", "ddp: restart one\nfewer from ckpt"),
)


def plot(results: dict[str, Any]) -> Any:
    """Each case's seconds to its next step and the steps it redid, ``ddp``'s restart beside monarch's."""
    seconds = [results[case][measured] for case, measured, _ in _BARS]
    figure, axis = plots.pyplot().subplots(figsize=(8, 3.5))
    labels = [label for _, _, label in _BARS]
    axis.bar(labels, seconds, color=plots.colors(labels))
    for index, (case, _, _) in enumerate(_BARS):
        axis.annotate(
            f"{results[case]['steps_redone']} steps redone", (index, seconds[index]), ha="center", va="bottom"
        )
    axis.set_ylim(0, max(seconds) * 1.15)
    axis.set_ylabel("seconds after the death\nor SIGTERM (lower is better)")
    axis.set_title(f"Host 1 of 2 lost or preempted at step {KILL_AT}, {SIZE} model, CPU")
    return figure


if __name__ == "__main__":
    main()
