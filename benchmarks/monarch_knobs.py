"""What Monarch's own liveness knobs give without the lifelines, beside what the lifelines give.

    python -m benchmarks.monarch_knobs

Issue 57 asked whether Monarch's settings alone (its orphan timeout, supervision polling and
watchdog, idle timeouts) report a dead worker on a host the controller cannot see within 5 s,
and end the workers of a killed controller within 15 s. Two hosts, each a ``lightning-monarch
serve`` in UTS and PID namespaces of its own (``tests.served_hosts.HiddenHost``), serve one worker
each of a fit whose steps take 50 ms. Each setting is measured in two cases:

- ``killed_worker``: rank 1's process is SIGKILLed; seconds until the controller's ``MeshFailureError``;
- ``killed_controller``: the controller is SIGKILLed; seconds until no worker process is left.

The controller is ``tests.test_hidden_hosts.CONTROLLER``'s (a DataLoader worker per rank).
Settings: ``lifelines`` is this package as it ships; ``monarch_defaults`` and ``monarch_tuned``
take the lifelines away (:data:`WITHOUT_LIFELINES` replaces ``Lifelines.held_by`` so that no
worker holds one), with Monarch's defaults and with :data:`TUNED` in the environment of the controller
and the hosts. A case that does not end within :data:`CAP_S` is written as the cap.

Writes ``benchmarks/results/monarch_knobs.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks import plots
from tests.served_hosts import HiddenHost
from tests.test_hidden_hosts import CONTROLLER, NAMES, left_after, training_controller

RESULTS = Path(__file__).resolve().parent / "results"
#: Monarch's settings turned down as far as a healthy run allows, for ``monarch_tuned``.
TUNED = {
    "HYPERACTOR_MESH_ORPHAN_TIMEOUT": "5s",
    "HYPERACTOR_MESH_SUPERVISION_WATCHDOG_TIMEOUT": "3s",
    "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": "500ms",
    "HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE": "2s",
    "HYPERACTOR_MESH_GET_ACTOR_STATE_MAX_IDLE": "2s",
    "HYPERACTOR_PROCESS_EXIT_TIMEOUT": "2s",
    "HYPERACTOR_CHANNEL_TCP_KEEPALIVE_IDLE": "2s",
}
SETTINGS: dict[str, tuple[bool, dict[str, str]]] = {
    "lifelines": (True, {}),
    "monarch_defaults": (False, {}),
    "monarch_tuned": (False, TUNED),
}
#: How long a case may take before it is written as this many seconds.
CAP_S = 60.0

#: Put before the controller's script (``tests.test_hidden_hosts.CONTROLLER``): no worker holds a lifeline.
WITHOUT_LIFELINES = """
from lightning_monarch.controller.mesh.lifelines import Lifelines
Lifelines.held_by = lambda self, *args: None
"""


def measure(case: str, lifelines: bool, env: dict[str, str]) -> float:
    """Seconds from the kill to its outcome in ``case``, on two fresh hidden hosts."""
    hosts = [HiddenHost(name, env) for name in NAMES]
    for host in hosts:
        host.start()
    script = textwrap.dedent(CONTROLLER) if lifelines else textwrap.dedent(WITHOUT_LIFELINES + CONTROLLER)
    try:
        with training_controller([sys.executable, "-c", script, *(host.address for host in hosts)], env) as (
            controller,
            lines,
        ):
            if case == "killed_worker":
                hosts[1].worker_processes()[0].kill()
                killed = time.monotonic()
                failed = any(line.startswith("FAILED") for line in lines)
                return min(time.monotonic() - killed, CAP_S) if failed else CAP_S
            os.killpg(controller.pid, signal.SIGKILL)
            controller.wait()
            killed = time.monotonic()
            left_after(hosts, CAP_S)
            return min(time.monotonic() - killed, CAP_S)
    finally:
        for host in hosts:
            host.stop()


def plot(figures: dict[str, Any]) -> Any:
    """Seconds per case and setting, the cap marked."""
    figure, axis = plots.pyplot().subplots(figsize=(7, 3.5))
    cases = list(next(iter(figures["settings"].values())))
    width = 0.8 / len(figures["settings"])
    colors = {"lifelines": plots.MONARCH, "monarch_defaults": plots.REFERENCE, "monarch_tuned": "tab:orange"}
    for index, (setting, seconds) in enumerate(figures["settings"].items()):
        color = colors.get(setting)
        positions = [position + index * width for position in range(len(cases))]
        axis.barh(positions, [seconds[case] for case in cases], width, label=setting, color=color)
    axis.axvline(figures["cap_s"], color="k", linestyle=":", linewidth=1)
    axis.set_yticks([position + width for position in range(len(cases))], cases)
    axis.set_xlabel(f"seconds from the kill (dotted: the {figures['cap_s']:g} s cap)")
    axis.set_title("Hosts the controller cannot see: lifelines vs Monarch's knobs")
    axis.invert_yaxis()
    axis.legend(fontsize=7)
    return figure


def main() -> None:
    figures: dict[str, Any] = {"cap_s": CAP_S, "tuned": TUNED, "settings": {}}
    for setting, (lifelines, knobs) in SETTINGS.items():
        env = {**os.environ, **knobs}
        figures["settings"][setting] = {}
        for case in ("killed_worker", "killed_controller"):
            print(f"{setting} {case} ...", flush=True)
            figures["settings"][setting][case] = measure(case, lifelines, env)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "monarch_knobs.json").write_text(json.dumps(figures, indent=2))
    table = ["| setting | killed worker: reported after s | killed controller: workers gone after s |", "|---|---|---|"]
    table += [
        f"| {setting} | {seconds['killed_worker']:.1f} | {seconds['killed_controller']:.1f} |"
        for setting, seconds in figures["settings"].items()
    ]
    (RESULTS / "monarch_knobs.md").write_text("\n".join(table) + f"\n\n(a value of {CAP_S:g} is the cap)\n")
    plots.save(plot(figures), RESULTS / "monarch_knobs.png")
    print("\n".join(table))


if __name__ == "__main__":
    main()
