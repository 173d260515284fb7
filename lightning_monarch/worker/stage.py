"""Builds one Trainer stage on a worker from the controller's :class:`StageSpec`.

Runs in each worker process. The worker's Trainer is Lightning's own, with ``DDPStrategy`` on the
torch elastic environment that Monarch set up for this rank (``ModelParallelStrategy`` when the
module is sharded, see ``worker.sharding``); it gets the controller's loop flags
(R1), a gate callback first in its callback list, and gates on the module's hooks (R2). It has
no progress bar or model summary, no checkpoint callback but a library's that runs beside its
companions, nor the callbacks installed packages register through entry points: those run once,
on the controller.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Union, cast

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint, LearningRateFinder
from lightning.pytorch.strategies import DDPStrategy

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.memory_files import MemoryFile
from lightning_monarch.wire.codec import Parcel, open_parcel
from lightning_monarch.wire.gates import GateCallback, install_hook_gates
from lightning_monarch.wire.protocol import DATAMODULE_HOOKS, MODULE_HOOKS
from lightning_monarch.wire.specs import StageSpec, TrainerConfig
from lightning_monarch.worker.async_validation import HandOff, Mark, ValidationServer
from lightning_monarch.worker.code_files import name_files
from lightning_monarch.worker.entries import EntryRecorder
from lightning_monarch.worker.logger import recording_loggers
from lightning_monarch.worker.loop import StageLoop
from lightning_monarch.worker.pdb_barrier import PdbBarrier
from lightning_monarch.worker.sharding import shard_in_configure_model, sharded_strategy
from lightning_monarch.worker.stage_settings import StageSettings
from lightning_monarch.worker.state import RankState
from lightning_monarch.worker.stats import RehearsalRecorder
from lightning_monarch.worker.storages import WorkerStorages

#: Extra keyword arguments each stage method takes on a worker.
_STAGE_KWARGS = {
    "fit": {},
    "validate": {"verbose": False},
    "test": {"verbose": False},
    "predict": {"return_predictions": False},
}


def _ddp_strategy(config: TrainerConfig, parallel_devices: Optional[list[torch.device]]) -> DDPStrategy:
    """The worker's ``DDPStrategy``, named as ``Trainer(strategy="ddp")`` names it to libraries that
    read the name (finetuning-scheduler checks it against the strategies it supports)."""
    strategy = DDPStrategy(
        cluster_environment=TorchElasticEnvironment(),
        parallel_devices=parallel_devices,
        process_group_backend=config.process_group_backend,
        timeout=config.timeout,
        **config.ddp_kwargs,
    )
    strategy.strategy_name = (  # type: ignore[attr-defined]
        "ddp_find_unused_parameters_true" if config.ddp_kwargs.get("find_unused_parameters") else "ddp"
    )
    return strategy


def build_stage(
    spec: StageSpec, rank: int, storages: WorkerStorages, kept: Optional[LightningModule], first: bool
) -> StageLoop:
    """Open the stage's objects with the storages gathered for it, build this rank's Trainer and
    return its (not yet started) loop, which holds its storages for the next stage when it ends.
    ``kept``: the sharded module of this worker's last stage, whose shards a stage that says
    ``from_shards`` loads (``worker.sharding``). ``first``: this process runs its first stage (it
    takes the controller's torch generator, ``specs.TorchRngStart``).

    A replacement worker (``spec.resume``) resumes from the snapshot's checkpoint, and every
    worker of an elastic ``fit`` that goes on in a smaller world from the checkpoint sent with the
    stage (``spec.checkpoint``), written to a memory file (``memory_files``: nothing is left behind
    if the process is killed) for Lightning's ``ckpt_path`` and closed when the stage ends; or,
    for a sharded module, from the snapshot's sharded checkpoint directory, given as
    ``ckpt_path``. The stage's process-wide settings (``worker.stage_settings``) are undone when
    it ends, or here if it cannot be built.
    """
    settings = StageSettings(spec)
    settings.make()
    try:
        return _build(spec, rank, storages, kept, first, settings)
    except BaseException:
        settings.undo()
        raise


def _build(
    spec: StageSpec,
    rank: int,
    storages: WorkerStorages,
    kept: Optional[LightningModule],
    first: bool,
    settings: StageSettings,
) -> StageLoop:
    """:func:`build_stage`, once the stage's settings are made; ``run`` undoes them."""
    objects, imported = open_parcel(spec.payload, storages.take(spec.payload))
    module, datamodule, loaders, worker_callbacks, subclass, travelled_loggers = objects
    settings.make_imported_state(imported)  # scvi's seed setter seeds torch: before the next line
    name_files(module, datamodule, *worker_callbacks)
    if spec.torch_rng is not None and (first or spec.torch_rng.changed):
        torch.set_rng_state(torch.frombuffer(bytearray(spec.torch_rng.state), dtype=torch.uint8))

    loop: StageLoop

    def around(gate, fn, args, kwargs):
        return loop.around(gate, fn, args, kwargs)

    def stop_if_abandoned(waiting_at: str) -> None:
        loop.stop_if_abandoned(waiting_at)

    config = spec.trainer
    loggers, logger_calls = recording_loggers(spec.loggers, travelled_loggers)
    # each GPU worker sees only its own device (``worker.process``): cuda:0 on every rank
    parallel_devices = [torch.device("cuda", 0)] * config.devices if config.accelerator == "cuda" else None
    # a library's Trainer subclass: its instance, made by Lightning's ``__init__`` (``specs.TrainerSubclass``)
    trainer = Trainer.__new__(subclass.cls if subclass is not None else Trainer)
    with lightning_compat.without_external_callbacks():
        Trainer.__init__(
            trainer,
            accelerator=config.accelerator,
            devices=config.devices,
            num_nodes=config.num_nodes,
            strategy=sharded_strategy(config, parallel_devices)
            if config.sharding is not None
            else _ddp_strategy(config, parallel_devices),
            # ``str(trainer.precision)`` of the controller's Trainer: one of the values Lightning's ``precision`` accepts
            precision=cast(Any, config.precision),
            callbacks=[
                *worker_callbacks[: spec.callbacks_before_gate],
                GateCallback(around),
                *worker_callbacks[spec.callbacks_before_gate :],
                *([RehearsalRecorder()] if spec.rehearsal else []),
                *([PdbBarrier(spec.pdb_barrier, config.timeout, stop_if_abandoned)] if spec.pdb_barrier else []),
            ],
            logger=loggers or False,
            # a library's checkpoint callback runs here beside its companions (``controller.loop.callbacks``)
            enable_checkpointing=any(isinstance(callback, Checkpoint) for callback in worker_callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_autolog_hparams=False,
            **config.flags,
        )
    if subclass is not None:
        vars(trainer).update(subclass.attributes)
    lightning_compat.carry_fit_progress(trainer, spec.fit_loop_state)

    def mark(gate: str, number: int, views: bool) -> None:
        loop.publish(recorder.entry(gate, recorder.arrival(), number, [], views=views))

    state = RankState(trainer, rank, worker_callbacks, module, datamodule)
    validation = _async_validation(spec, trainer, state, mark)
    install_hook_gates(module, "module", MODULE_HOOKS, around)
    for callback in worker_callbacks:
        if isinstance(callback, LearningRateFinder):  # its trial fit: ``worker.trial``
            install_hook_gates(callback, "trial", ["lr_find"], lambda gate, fn, args, kwargs: loop.trial.run(fn, *args))
    if config.sharding is not None:
        shard_in_configure_model(module, config.sharding, kept)
    if datamodule is not None:
        install_hook_gates(datamodule, "datamodule", DATAMODULE_HOOKS, around)
    ckpt_path, snapshot_file = spec.ckpt_path, None
    checkpoint = spec.resume.checkpoint if spec.resume is not None else spec.checkpoint
    if isinstance(checkpoint, str):
        ckpt_path = checkpoint  # a sharded snapshot's directory, which the controller removes
    elif isinstance(checkpoint, Parcel):
        snapshot_file = MemoryFile("lightning_monarch_snapshot.ckpt")
        with open(snapshot_file.fd, "wb", closefd=False) as file:
            file.write(open_parcel(checkpoint, storages.take(checkpoint, hold=False)))
        ckpt_path = snapshot_file.path
    storages.end_of_stage()
    stage = functools.partial(
        getattr(Trainer, spec.fn),  # Lightning's own: a subclass's override ran on the controller
        trainer,
        module,
        datamodule=datamodule,
        ckpt_path=ckpt_path,
        weights_only=spec.weights_only,
        **loaders,
        **_STAGE_KWARGS[spec.fn],
    )

    def run() -> Any:
        try:
            settings.make_thread_settings()
            return stage()
        finally:
            if snapshot_file is not None:
                snapshot_file.close()
            settings.undo()

    resume = spec.resume.ranks[rank] if spec.resume is not None else None
    recorder = EntryRecorder(
        trainer,
        rank,
        logger_calls,
        state,
        final_state=spec.fn == "fit" and config.sharding is None and not spec.serves_validation,
        hparams=dict(module.hparams),
    )
    loop = StageLoop(
        trainer,
        run,
        rank,
        recorder,
        state,
        spec.run_ahead,
        resume,
        lambda: storages.hold(state.module),
        spec.post_mortem,
    )
    loop.validation = validation
    return loop


def _async_validation(
    spec: StageSpec, trainer: Trainer, state: RankState, mark: Mark
) -> Union[HandOff, ValidationServer, None]:
    """A ``fit`` with asynchronous validation (``worker.async_validation``): a training rank hands
    its checkpoint state to its validation worker where its loop would validate (and, as a
    callback, reads the module's attributes at the fit's start and takes the controller's
    ``EarlyStopping`` decision); a validation worker serves them instead
    of training, without a sanity check (the training ranks run it). Returns either."""
    validators = spec.validators
    if validators is not None:
        hand_off = HandOff(trainer, state, validators, mark)
        trainer.fit_loop.epoch_loop.val_loop.run = hand_off  # type: ignore[method-assign]
        trainer.callbacks.append(hand_off)  # type: ignore[attr-defined]
        return hand_off
    if not spec.serves_validation:
        return None
    server = ValidationServer(trainer, state, mark)
    trainer.num_sanity_val_steps = 0
    trainer.fit_loop.run = server  # type: ignore[method-assign]
    return server
