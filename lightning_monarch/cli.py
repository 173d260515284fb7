"""``lightning-monarch``: the plugin's command line, with ``info``, ``preflight``, ``benchmark``, ``rehearse``,
``convert`` and ``serve``.

Runs in the user's shell on the controller's machine (``python -m lightning_monarch`` is the same),
but ``serve``, which runs on each worker host.

- ``info`` builds the Trainer that ``Trainer(strategy="monarch", ...)`` would build and asks its
  strategy what it would start (``MonarchStrategy._settings().mesh_key()``), so the two cannot disagree. It
  starts no worker and initializes no GPU in this process: GPUs are counted through NVML (or
  amdsmi on ROCm), as Lightning does.
- ``preflight`` starts the mesh and checks every worker (``lightning_monarch.controller.features.preflight``).
- ``benchmark`` times ``monarch`` against ``ddp`` on this machine (``lightning_monarch.benchmark``).
- ``rehearse`` rehearses the ``fit`` of a LightningCLI config on its workers
  (``lightning_monarch.rehearse``) and prints the report, as a table or as JSON; a config whose
  classes are ``pytorch_lightning``'s runs in that namespace (``lightning_monarch.pl``).
- ``convert`` turns a sharded checkpoint directory (the sharded strategies) into one Lightning
  checkpoint file, in this process alone (``lightning_monarch.convert_sharded_checkpoint``).
- ``serve`` makes this machine a worker host at an address, whose SIGTERM is a preemption notice
  for elastic training (``lightning_monarch.host``).

Bad input is rejected before anything starts, with the fix in the message. Exit codes: 0 done,
1 a check or a run failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import platform
import socket
import sys
from collections.abc import Iterator
from functools import partial
from importlib.metadata import version
from typing import Any, Optional, Union

import lightning as L
import torch
import yaml
from lightning.fabric.accelerators.cuda import num_cuda_devices
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_monarch
from lightning_monarch import host, namespaces
from lightning_monarch.benchmark.compare import BenchmarkError, compare
from lightning_monarch.benchmark.models import SIZES
from lightning_monarch.controller.features import preflight
from lightning_monarch.controller.features.rehearsal import DEFAULT_STEPS
from lightning_monarch.devices import VISIBILITY_VARS, visibility
from lightning_monarch.strategy import MonarchStrategy
from lightning_monarch.wire.specs import versions

PROG = "lightning-monarch"
_GPU = ("gpu", "cuda")

Devices = Union[int, str, list[int]]


class UsageError(Exception):
    """Input that cannot work: the command exits with code 2 and this message."""


def _devices_argument(text: str) -> Devices:
    """``--devices`` as ``Trainer(devices=...)`` takes it: a count, ``auto`` or GPU indices ``0,1``."""
    if text == "auto":
        return text
    try:
        return int(text) if "," not in text else [int(index) for index in text.split(",") if index.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give the number of workers per host (--devices 2), GPU indices (--devices 0,1) or auto"
        ) from None


def describe(
    devices: Devices, accelerator: str, num_nodes: int = 1, process_group_backend: Optional[str] = None
) -> dict[str, Any]:
    """Versions, this host's devices, and what ``Trainer(strategy="monarch", ...)`` would start.

    Runs in this process and starts nothing. The workers, their backend and the GPU each is pinned
    to come from the strategy of a real Trainer built with these arguments; on several hosts each
    host pins its workers from its own visibility mask, so only the device indices are known here.
    """
    arguments = f"accelerator={accelerator!r}, devices={devices!r}" + (
        f", num_nodes={num_nodes}" if num_nodes != 1 else ""
    )
    call = f"Trainer(strategy={_strategy_argument(process_group_backend)}, {arguments})"
    strategy = MonarchStrategy(process_group_backend=process_group_backend)
    # Hosts other than this one come from `MonarchStrategy(hosts=...)`, which connects to them at
    # `Trainer(...)` time; every host runs the same local ranks, each pinned from its host's own
    # mask, so on several hosts this one's mask says nothing of theirs.
    with _mask_of_this_host(applies=num_nodes == 1):
        try:
            L.Trainer(
                strategy=strategy,
                accelerator=accelerator,
                devices=devices,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
        except (TypeError, ValueError) as error:  # how Lightning rejects some `devices` values
            raise UsageError(f"`{call}`: {error}") from error
        key = strategy._settings().mesh_key()
    backend = key.process_group_backend
    pins = [dict([pin]) for pin in key.pins] if key.pins is not None and num_nodes == 1 else None
    return {
        "versions": {
            "python": platform.python_version(),
            **versions(),
            "torchmonarch": version("torchmonarch"),
            "lightning_monarch": lightning_monarch.__version__,
        },
        "host": {
            "name": socket.gethostname(),
            "cpus": os.cpu_count(),
            "gpus": num_cuda_devices(),
            "visibility": visibility(os.environ),
        },
        "trainer": {
            "call": call,
            "accelerator": key.accelerator,
            "process_group_backend": f"{backend} (RCCL)" if backend == "nccl" and torch.version.hip else backend,
            "num_nodes": num_nodes,
            "workers_per_host": key.per_host,
            "workers": key.per_host * num_nodes,
            "device_indices": list(key.gpu_indices) if key.gpu_indices is not None else None,
            "pins": pins,
        },
    }


@contextlib.contextmanager
def _mask_of_this_host(applies: bool) -> Iterator[None]:
    """This process's visibility variables, hidden while ``applies`` is false: the strategy pins the
    workers of this host from them, and the workers of other hosts pin from their own."""
    hidden = {} if applies else {name: os.environ.pop(name) for name in VISIBILITY_VARS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def _strategy_argument(process_group_backend: Optional[str]) -> str:
    if process_group_backend is None:
        return "'monarch'"
    return f"MonarchStrategy(process_group_backend={process_group_backend!r})"


def render_info(info: dict[str, Any]) -> str:
    """``describe``'s answer as text."""
    found = info["versions"]
    trainer = info["trainer"]
    host = info["host"]
    lines = ["Versions"]
    lines += [
        f"  {name:<18}{found[name] or '-'}"
        for name in ("python", "torch", "cuda", "hip", "lightning", "torchmonarch", "lightning_monarch")
    ]
    lines += ["", f"This host ({host['name']})", f"  {host['cpus']} CPUs, {host['gpus']} GPU(s) visible to torch"]
    visibility = " ".join(f"{name}={value}" for name, value in host["visibility"].items())
    lines.append(f"  visibility variables: {visibility or 'none set'}")
    where = (
        "on this host"
        if trainer["num_nodes"] == 1
        else (
            f"({trainer['workers_per_host']} on each of {trainer['num_nodes']} hosts, which MonarchStrategy(hosts=...)"
            " names: a SlurmJob, KubernetesJob, ProcessJob, HostMesh or worker addresses)"
        )
    )
    lines += [
        "",
        f"{trainer['call']} would start",
        f"  {trainer['workers']} worker process(es) {where}",
        f"  accelerator {trainer['accelerator']}, backend {trainer['process_group_backend']}",
    ]
    lines.append(f"  {'local rank':<12}pinned to")
    for rank in range(trainer["workers_per_host"]):
        if trainer["device_indices"] is None:
            pinned = "- (CPU worker: no device to pin)"
        elif trainer["pins"] is not None:
            pinned = " ".join(f"{name}={value}" for name, value in trainer["pins"][rank].items())
        else:
            pinned = f"GPU index {trainer['device_indices'][rank]} within each host's own visibility mask"
        lines.append(f"  {rank:<12}{pinned}")
    lines += ["", f"No worker was started. `{PROG} preflight` starts them and checks each one."]
    return "\n".join(lines)


def _check_count(devices: Devices) -> None:
    """Raise ``UsageError`` for a number of workers below 1."""
    if isinstance(devices, int) and devices < 1:
        raise UsageError(f"--devices {devices}: give the number of workers per host, 1 or more (e.g. --devices 2).")


def _info(args: argparse.Namespace) -> int:
    """``lightning-monarch info``: print ``describe``'s answer; starts nothing."""
    _check_count(args.devices)
    if args.num_nodes < 1:
        raise UsageError(f"--num-nodes {args.num_nodes}: give the number of hosts, 1 or more.")
    info = describe(args.devices, args.accelerator, args.num_nodes, args.process_group_backend)
    print(json.dumps(info, indent=2) if args.json else render_info(info))
    return 0


def _preflight(args: argparse.Namespace) -> int:
    """``lightning-monarch preflight``: start the workers and check each one, after this host's checks."""
    _check_count(args.devices)
    strategy = MonarchStrategy(hosts=args.hosts, process_group_backend=args.process_group_backend, keep_warm=False)
    return preflight.run(args, strategy)


def _benchmark(args: argparse.Namespace) -> int:
    """``lightning-monarch benchmark``: every run in a process of its own, progress on stderr, the table on stdout."""
    _check_count(args.devices)
    if args.steps < 1 or args.reps < 1:
        raise UsageError(f"--steps {args.steps} --reps {args.reps}: give 1 or more of each (e.g. --steps 20 --reps 2).")
    plan = describe(args.devices, args.accelerator)["trainer"]  # rejects what the Trainer would, before any run
    progress = partial(print, file=sys.stderr, flush=True)
    progress(
        f"Timing {args.steps} steps of the {args.size} model under strategy='monarch' ({plan['workers']}"
        f" {plan['accelerator']} workers, {plan['process_group_backend']}) and strategy='ddp', {args.reps} time(s)"
        " each, every run in a fresh process ..."
    )
    try:
        comparison = compare(args.size, args.steps, args.accelerator, args.devices, args.reps, progress)
    except BenchmarkError as error:
        print(f"{PROG} benchmark: {error}", file=sys.stderr)
        return 1
    print(json.dumps(comparison.as_dict(), indent=2) if args.json else comparison.table())
    return 0


def _rehearse(args: argparse.Namespace) -> int:
    """``lightning-monarch rehearse``: the config's model, data and Trainer, as LightningCLI builds
    them, rehearsed on the Trainer's workers; exit code 1 when the rehearsal fails."""
    from lightning.pytorch.cli import LightningCLI

    if not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config}: no such file. Give the YAML config of a LightningCLI `fit`.")
    if _namespace_of_config(args.config) not in (None, namespaces.namespace_of(__name__)):
        return int(importlib.import_module(namespaces.counterpart(__name__))._rehearse(args))
    built = LightningCLI(args=["--config", args.config], run=False, save_config_callback=None)
    if not isinstance(built.trainer.strategy, MonarchStrategy):
        raise UsageError(
            f"--config {args.config}: its Trainer's strategy is {type(built.trainer.strategy).__name__}; a rehearsal"
            " runs on Monarch workers. Set `trainer.strategy: monarch` in the config."
        )
    try:
        report = lightning_monarch.rehearse(
            built.trainer,
            built.model,
            datamodule=built.datamodule,
            steps=args.steps,
            memory_limit_gib=args.memory_limit_gib,
        )
    except ValueError as error:  # the steps or the memory limit, or loaders without a length
        raise UsageError(str(error)) from None
    except lightning_monarch.RehearsalError as error:
        print(f"{PROG} rehearse: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        lightning_monarch.stop_meshes()
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    return 0


def _namespace_of_config(path: str) -> Optional[namespaces.Namespace]:
    """The Lightning namespace of a LightningCLI config's ``model`` and ``data`` classes
    (``pytorch_lightning``'s config is rehearsed by ``lightning_monarch.pl``'s copy of this
    module); ``None`` where the config names no class."""
    with open(path) as file:
        config = yaml.safe_load(file) or {}
    for section in ("model", "data"):
        named = config.get(section) if isinstance(config, dict) else None
        class_path = named.get("class_path") if isinstance(named, dict) else named
        if isinstance(class_path, str) and "." in class_path:
            module, _, name = class_path.rpartition(".")
            found = namespaces.namespace_of_class(getattr(importlib.import_module(module), name))
            if found is not None:
                return found
    return None


def _convert(args: argparse.Namespace) -> int:
    """``lightning-monarch convert``: ``convert_sharded_checkpoint`` here, no worker."""
    try:
        lightning_monarch.convert_sharded_checkpoint(args.source, args.destination)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    print(f"Wrote {args.destination}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per tool; ``preflight`` takes ``controller.features.preflight``'s options."""
    parser = argparse.ArgumentParser(prog=PROG, description="Tools for Lightning's strategy='monarch'.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    assert describe.__doc__ is not None  # documented; the descriptions are their first lines
    info = commands.add_parser(
        "info",
        help="versions, devices and what strategy='monarch' would start",
        description=describe.__doc__.splitlines()[0],
    )
    info.add_argument("--devices", type=_devices_argument, default="auto", help="as Trainer(devices=...)")
    info.add_argument("--accelerator", default="auto", choices=["auto", "cpu", *_GPU])
    info.add_argument("--num-nodes", type=int, default=1, help="as Trainer(num_nodes=...)")
    info.add_argument("--process-group-backend", default=None, help="as MonarchStrategy(process_group_backend=...)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=_info)

    checks = commands.add_parser(
        "preflight", help="start the workers and check each one", description=preflight.__doc__.splitlines()[0]
    )
    preflight.add_arguments(checks).set_defaults(run=_preflight)

    benchmark = commands.add_parser(
        "benchmark",
        help="time strategy='monarch' against 'ddp' here",
        description="Time strategy='monarch' against strategy='ddp' on this machine.",
    )
    benchmark.add_argument("--devices", type=int, default=2, help="workers (ddp: ranks) on this host")
    benchmark.add_argument("--accelerator", default="auto", choices=["auto", "cpu", *_GPU])
    benchmark.add_argument("--size", default="medium", choices=list(SIZES), help="the model's size")
    benchmark.add_argument("--steps", type=int, default=20, help="timed training steps per run, after a warm-up")
    benchmark.add_argument("--reps", type=int, default=2, help="runs per strategy, alternating")
    benchmark.add_argument("--json", action="store_true", help="print JSON")
    benchmark.set_defaults(run=_benchmark)

    rehearsal = commands.add_parser(
        "rehearse",
        help="a few real steps of a config's fit on its workers, with a memory and time projection",
        description="Rehearse the fit of a LightningCLI config on its Monarch workers and report memory, times"
        " and the run's projected time.",
    )
    rehearsal.add_argument(
        "--config", required=True, help="the LightningCLI YAML config (its trainer: strategy monarch)"
    )
    rehearsal.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps to rehearse")
    rehearsal.add_argument(
        "--memory-limit-gib", type=float, default=None, help="memory each worker may use, if less than its device's"
    )
    rehearsal.add_argument("--json", action="store_true", help="print JSON")
    rehearsal.set_defaults(run=_rehearse)

    assert lightning_monarch.convert_sharded_checkpoint.__doc__ is not None
    convert = commands.add_parser(
        "convert",
        help="a sharded checkpoint directory to one checkpoint file",
        description=lightning_monarch.convert_sharded_checkpoint.__doc__.splitlines()[0],
    )
    convert.add_argument(
        "source", help="the sharded checkpoint directory (`MonarchModelParallelStrategy`, `MonarchFSDPStrategy`)"
    )
    convert.add_argument("destination", help="the single-file Lightning checkpoint to write")
    convert.set_defaults(run=_convert)

    serve = commands.add_parser(
        "serve", help="serve as a worker host, SIGTERM as a preemption notice", description=host.DESCRIPTION
    )
    host.add_arguments(serve)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """The ``lightning-monarch`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # the Trainer's info lines are noise here; put back after
    try:
        return args.run(args)
    except (UsageError, MisconfigurationException) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the processes it started were stopped on the way out
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        lightning_log.setLevel(level)
