"""``MonarchLauncher``: runs one Trainer stage on a worker mesh.

Runs on the controller. Lightning hands every ``fit``/``validate``/``test``/``predict`` call to the
strategy's launcher. Bad input is rejected here before any worker starts. The mesh comes from the
warm pool (``controller.mesh.pool``) and goes back to it after a stage that ended cleanly; after any
failure or interrupt it is stopped.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_monarch import library_settings
from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch._compat.torch import tree_flatten
from lightning_monarch.controller.features import preflight
from lightning_monarch.controller.features.elastic import ElasticFit, HostsReturned, PreemptionNoticed
from lightning_monarch.controller.features.rehearsal import rehearse
from lightning_monarch.controller.loop.callbacks import CallbackPlacement, set_aside_refused
from lightning_monarch.controller.loop.mirrors import plan_loaders
from lightning_monarch.controller.loop.plan import make_plan, states_can_travel
from lightning_monarch.controller.loop.session import StageSession
from lightning_monarch.controller.mesh.cells import blocks_the_cell
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.feed import FedLoaders
from lightning_monarch.controller.mesh.payload import pack_for_workers
from lightning_monarch.controller.mesh.pool import MESHES
from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
from lightning_monarch.controller.mesh.worker_warnings import WorkerWarnings
from lightning_monarch.errors import HostsLostError, WorkerError
from lightning_monarch.wire.gates import install_hook_gates
from lightning_monarch.wire.protocol import SnapshotEpochs
from lightning_monarch.wire.specs import LoaderRef, LoggerIdentity, StageSpec, TorchRngStart, TrainerConfig

if TYPE_CHECKING:
    from lightning_monarch.strategy import MonarchStrategy

log = logging.getLogger(__name__)

_TRAINER_FN = {
    "fit": TrainerFn.FITTING,
    "validate": TrainerFn.VALIDATING,
    "test": TrainerFn.TESTING,
    "predict": TrainerFn.PREDICTING,
}
#: The loop stage each dataloader argument feeds, per Trainer method.
_LOADER_STAGES = {
    "fit": {"train_dataloaders": "train", "val_dataloaders": "val"},
    "validate": {"dataloaders": "val"},
    "test": {"dataloaders": "test"},
    "predict": {"dataloaders": "predict"},
}
#: Environment variables that make the workers' RNG match DDP ranks' (``seed_everything``); sent
#: unset too, so that a warm worker does not keep an earlier stage's seed.
_SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


class _TorchRngRecord:
    """Runs on the controller: its torch generator as the last stage ended, to tell at a stage's
    start whether the script moved it since (``specs.TorchRngStart``)."""

    def __init__(self) -> None:
        self._after_last_stage: Optional[bytes] = None

    def start(self) -> TorchRngStart:
        state = bytes(torch.get_rng_state().numpy())
        return TorchRngStart(state, changed=state != self._after_last_stage)

    def stage_ended(self) -> None:
        self._after_last_stage = bytes(torch.get_rng_state().numpy())


_TORCH_RNG = _TorchRngRecord()


class MonarchLauncher(lightning_compat.Launcher):
    """Runs on the controller: each Trainer stage on a worker mesh from the warm pool."""

    def __init__(self, strategy: MonarchStrategy) -> None:
        self._strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        """The controller is the only process Lightning sees, so notebooks work."""
        return True

    @override
    def kill(self, signum: Any) -> None:
        """Lightning asks a launcher to kill its processes on interrupt; ``launch`` always stops the
        mesh itself, on every way out, so nothing is left to kill here."""

    @override
    @blocks_the_cell
    def launch(self, function: Callable, *args: Any, trainer: Optional[Trainer] = None, **kwargs: Any) -> Any:
        assert trainer is not None
        stage = lightning_compat.stage_of(function)
        arguments = inspect.signature(function).bind(*args, **kwargs).arguments
        loader_args = _LOADER_STAGES[stage]
        for name in loader_args:
            if isinstance(arguments.get(name), LightningDataModule):
                arguments["datamodule"], arguments[name] = arguments[name], None
        module = arguments.get("model") or trainer.lightning_module
        if module is None:
            return function(**arguments)  # Lightning raises its own error for a missing model
        datamodule = arguments.get("datamodule")
        loaders = {name: arguments[name] for name in loader_args if arguments.get(name) is not None}
        strategy = self._strategy
        try:
            placement = CallbackPlacement(trainer.callbacks, strategy.worker_callbacks)  # type: ignore[attr-defined]
        except MisconfigurationException:
            strategy._keep_until_exception_handled(set_aside_refused(trainer))
            raise
        if placement.holds_checkpoints:  # the controller's Lightning will not find them for "best" and "last"
            arguments["ckpt_path"] = lightning_compat.resolve_ckpt_path(
                trainer,
                _TRAINER_FN[stage],
                arguments.get("ckpt_path"),
                model_provided=arguments.get("model") is not None,
            )
        fed = FedLoaders(
            loaders,
            len(strategy.parallel_devices or ()) * strategy.num_nodes,
            _handed_at(),
            refuse=self._refuse_feeding(stage),
        )
        try:
            with placement.applied(trainer):
                return self._launch(function, trainer, arguments, stage, module, datamodule, fed.loaders, placement)
        finally:
            fed.close()
            _TORCH_RNG.stage_ended()

    def _launch(
        self,
        function: Callable,
        trainer: Trainer,
        arguments: dict[str, Any],
        stage: str,
        module: LightningModule,
        datamodule: Optional[LightningDataModule],
        loaders: dict[str, Any],
        placement: CallbackPlacement,
    ) -> Any:
        """Run the stage on a mesh from the warm pool, its ``loaders`` as the workers get them and
        its callbacks where ``placement`` puts them."""
        spec = self._stage_spec(stage, trainer, module, datamodule, loaders, arguments, placement.workers)
        if stage == "fit" and self._strategy.rehearse:
            self._rehearse(trainer, module, datamodule, loaders)

        silence = _silence_on_exception(datamodule)
        key = self._strategy._mesh_key()
        mesh = MESHES.acquire(key)
        mesh.step_timeout = self._strategy.step_timeout
        warned = WorkerWarnings(mesh.num_workers)
        elastic = ElasticFit(self._strategy, trainer, mesh) if stage == "fit" and self._strategy.min_nodes else None
        ended_cleanly = reusable = False
        try:
            if not mesh.checked:
                preflight.check(mesh, key.accelerator, key.process_group_backend)
            if elastic is not None:
                spec = elastic.prepared(spec)
            while True:
                try:
                    session, result = self._run_stage(
                        trainer, function, arguments, spec, mesh, module, warned, elastic, placement.workers
                    )
                    break
                except HostsLostError as lost:
                    assert elastic is not None  # only an elastic fit's channel raises it
                    elastic.shrink(lost)
                except HostsReturned as returned:
                    assert elastic is not None  # raised by it
                    elastic.grow(returned)
                except PreemptionNoticed as noticed:
                    assert elastic is not None  # raised by it
                    elastic.leave(noticed)
                # the world changed: the stage goes on from the resume point
                warned.num_workers = mesh.num_workers
                elastic.resume(arguments)
                spec = elastic.prepared(
                    self._stage_spec(stage, trainer, module, datamodule, loaders, arguments, placement.workers)
                )
            warned.show_every_rank(mesh.take_warnings())
            if stage == "predict" and result is not None:
                batch_sizes = [
                    getattr(loader, "batch_size", None) for loader in tree_flatten(trainer.predict_dataloaders)[0]
                ]
                result = session.predictions.in_dataset_order(len(trainer.num_predict_batches), batch_sizes)
            if session.final_state is not None:
                placement.take_back(session.final_state.callbacks)
            ended_cleanly = True
            if session.tuner_exit is None:
                return result
        except BaseException as error:
            if isinstance(error, Exception):  # not on an interrupt: the user wants out
                _show_held_warnings(warned, mesh)
            reusable = self._strategy._rehearsing and _ready_again(error, mesh)
            self._strategy._keep_until_exception_handled(silence)
            silence = None
            raise
        finally:
            # a mesh that lost hosts is not the one the strategy asks for: the next stage starts anew
            keep = self._strategy.keep_warm and not (elastic is not None and elastic.changed)
            MESHES.release(key, mesh, keep=keep, failed=not (ended_cleanly or reusable))
            if elastic is not None:
                elastic.restore()
            if silence is not None:
                silence()
        # Lightning's handler of its tuner's exit tears the ``fit`` down here, after the workers did
        _skip_teardown_once(module, datamodule)
        raise session.tuner_exit

    def _run_stage(
        self,
        trainer: Trainer,
        function: Callable,
        arguments: dict[str, Any],
        spec: StageSpec,
        mesh: WorkerMesh,
        module: LightningModule,
        warned: WorkerWarnings,
        elastic: Optional[ElasticFit],
        worker_callbacks: list[Callback],
    ) -> tuple[StageSession, Any]:
        """Run Lightning's ``function`` with the controller's loop following the workers of
        ``mesh``, which run ``spec``; the session it ran and the function's result. A change of an
        elastic ``fit``'s world (``HostsLostError``, ``HostsReturned``, ``PreemptionNoticed``)
        leaves the mesh as it was then, for the launcher to change it and run the stage again."""
        strategy = self._strategy
        stage = spec.fn
        loader_args = _LOADER_STAGES[stage]
        snapshots = strategy._snapshot_directory()
        channel = StageChannel(
            mesh,
            spec,
            strategy.max_restarts,
            snapshots,
            lost_hosts=elastic.lost_host_check() if elastic is not None else None,
            shared_memory=strategy.shared_memory,
        )
        try:
            channel.start()
            session = StageSession(
                trainer,
                channel,
                module,
                arguments.get("datamodule"),
                worker_callbacks,
                spec.run_ahead,
                self._snapshots(),
                elastic,
                sharded=spec.trainer.sharding is not None,
                warned=warned,
            )
            strategy._attach(session)
            with session.installed():
                calling = dict(arguments)
                for name in loader_args:
                    if arguments.get(name) is not None:
                        calling[name] = plan_loaders(
                            LoaderRef.describe(arguments[name]), loader_args[name], session.loaders
                        )
                try:
                    result = function(**calling)
                except lightning_compat.TunerExit as exit:
                    result, session.tuner_exit = None, exit
                session.finish(stage)
            return session, result
        finally:
            strategy._attach(None)
            strategy.restarts += channel.restarts
            strategy.sent_bytes = dict(mesh.sent)
            if snapshots is not None:
                snapshots.remove()

    def _refuse_feeding(self, stage: str) -> Optional[str]:
        """Why this stage cannot have the controller iterate a dataloader that cannot travel, or ``None``."""
        strategy = self._strategy
        if stage == "predict":
            return "`trainer.predict` would then predict every item on every rank."
        if strategy.max_restarts:
            return (
                f"`MonarchStrategy(max_restarts={strategy.max_restarts})` resumes replaced workers, which iterate"
                " their loaders again from the resume point, and one copy iterated once cannot go back."
            )
        if strategy.min_nodes:
            return "elastic training (`MonarchStrategy(min_nodes=...)`) resumes the fit in a new world, which iterates its loaders again."
        if strategy.rehearse or strategy._rehearsing:
            return "`MonarchStrategy(rehearse=True)` would iterate it in the rehearsal first, and the fit would see later items."
        return None

    def _rehearse(
        self,
        trainer: Trainer,
        module: LightningModule,
        datamodule: Optional[LightningDataModule],
        loaders: dict[str, Any],
    ) -> None:
        """``MonarchStrategy(rehearse=True)``: rehearse the ``fit`` on its workers first, show the
        report (its warnings as warnings) and keep it in ``strategy.rehearsal``."""
        report = rehearse(trainer, module, datamodule=datamodule, **loaders)
        self._strategy.rehearsal = report
        rank_zero_info(f"lightning_monarch: rehearsal of this fit on its workers:\n{report.table()}")
        for warning in report.warnings:
            rank_zero_warn(f"lightning_monarch rehearsal: {warning}")

    def _snapshots(self) -> Optional[SnapshotEpochs]:
        """When the workers wait for a snapshot: every ``snapshot_every_n_epochs`` training epochs
        with restarts (from the second) or elastic training (from the first); ``None`` otherwise."""
        strategy = self._strategy
        if strategy.min_nodes:
            return SnapshotEpochs(strategy.snapshot_every_n_epochs, first=True)
        if strategy.max_restarts:
            return SnapshotEpochs(strategy.snapshot_every_n_epochs)
        return None

    def _stage_spec(
        self,
        stage: str,
        trainer: Trainer,
        module: LightningModule,
        datamodule: Optional[LightningDataModule],
        loaders: dict[str, Any],
        arguments: dict[str, Any],
        worker_callbacks: list[Callback],
    ) -> StageSpec:
        """Everything the workers need, checked and pickled before any of them starts: with
        ``worker_callbacks`` for their Trainer."""
        strategy = self._strategy
        profiler = trainer.profiler  # type: ignore[attr-defined]
        if not isinstance(profiler, PassThroughProfiler):
            rank_zero_warn(
                f"`Trainer(profiler={type(profiler).__name__}(...))` under strategy='monarch' profiles the"
                " controller's loop: each step's time there includes waiting for the workers, not their compute."
            )
        sharding = strategy._sharding_for_stage(module, arguments.get("ckpt_path"))
        script_dir = _script_dir()
        payload = pack_for_workers(
            {
                "LightningModule": module,
                "LightningDataModule": datamodule,
                "dataloaders": loaders,
                "worker_callbacks": worker_callbacks,
                "Trainer": lightning_compat.trainer_subclass(trainer),
            },
            script_dir,
        )
        ckpt_path = lightning_compat.resolve_ckpt_path(
            trainer, _TRAINER_FN[stage], arguments.get("ckpt_path"), model_provided=arguments.get("model") is not None
        )
        if ckpt_path is not None and "://" not in ckpt_path and not os.path.exists(ckpt_path):
            raise FileNotFoundError(
                f"`trainer.{stage}(ckpt_path={arguments.get('ckpt_path')!r})`: no checkpoint file at {ckpt_path}."
            )
        return StageSpec(
            fn=stage,
            payload=payload,
            ckpt_path=ckpt_path,
            weights_only=arguments.get("weights_only"),
            fit_loop_state=trainer.fit_loop.state_dict(),
            trainer=TrainerConfig(
                accelerator=strategy.worker_accelerator,
                devices=len(strategy.parallel_devices or ()),
                num_nodes=strategy.num_nodes,
                precision=str(trainer.precision),
                process_group_backend=strategy.process_group_backend,
                flags={**lightning_compat.trainer_flags(trainer), "sync_batchnorm": strategy.sync_batchnorm},
                ddp_kwargs=strategy.ddp_kwargs,
                sharding=sharding,
            ),
            loggers=[
                LoggerIdentity(
                    name=logger.name, version=logger.version, save_dir=logger.save_dir, log_dir=logger.log_dir
                )
                for logger in trainer.loggers
            ],
            sys_path=(script_dir,) if script_dir else (),
            env={name: os.environ.get(name) for name in _SEED_ENV},
            torch_rng=_TORCH_RNG.start(),
            library_settings=library_settings.read(),
            rehearsal=strategy._rehearsing,
            run_ahead=make_plan(
                trainer.callbacks,  # type: ignore[attr-defined]
                strategy.max_ahead,
                self._snapshots(),
                states_travel=states_can_travel(module, worker_callbacks, sharding is not None),
            ),
        )


#: The packages whose frames are the Trainer's own, not the code that called it.
_TRAINER_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_monarch", "torch", "contextlib")


def _handed_at() -> str:
    """Where the code that called the Trainer (the user's or a library's) did so: ``file:line``."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _TRAINER_PACKAGES:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "an unknown place"


def _script_dir() -> Optional[str]:
    """The folder of the script the user ran: on its ``sys.path``, as it would be under torchrun."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.dirname(os.path.abspath(main_file)) if main_file else None


def _show_held_warnings(warned: WorkerWarnings, mesh: Any) -> None:
    """After a failed stage, before its mesh stops: the warnings the ranks still hold. Showing
    them must not hide the failure (a warning filter may turn one into an error here)."""
    try:
        warned.show_every_rank(mesh.take_warnings())
    except Exception as error:
        log.debug("The workers' warnings after a failed stage could not be shown: %s", error)


def _ready_again(error: BaseException, mesh: WorkerMesh) -> bool:
    """After a failed rehearsal: whether its workers can run the next stage as they are, with a
    new process group (``WorkerMesh.reset_world``), because an exception ended the stage on every
    rank (an out-of-memory error does on identical replicas). A rank still waiting in a collective,
    or a dead one, means the mesh is stopped, as after any failed stage."""
    if not isinstance(error, WorkerError) or not mesh.stages_ended():
        return False
    try:
        mesh.reset_world()
    except Exception as failure:  # stop it, as after any failed stage
        log.warning("The workers of the failed rehearsal could not form a new process group: %s", failure)
        return False
    return True


def _skip(gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """The datamodule's ``on_exception`` ran on the worker that failed; it must not run here too."""


def _skip_teardown_once(*objects: Any) -> None:
    """Let the next ``teardown`` of each of ``objects`` (the module, the datamodule) do nothing: it
    ran on the workers, where they were set up, and the controller's mirrors hold nothing to tear
    down. For the teardown that Lightning's handler of ``Tuner.lr_find``'s exit runs, outside the
    stage's gates."""
    for obj in objects:
        if obj is not None:
            undo: list[Callable[[], None]] = []
            undo.append(install_hook_gates(obj, "controller", ["teardown"], lambda *args, undo=undo: undo[0]()))


def _silence_on_exception(datamodule: Optional[LightningDataModule]) -> Optional[Callable[[], None]]:
    if datamodule is None:
        return None
    return install_hook_gates(datamodule, "controller", ["on_exception"], _skip)
