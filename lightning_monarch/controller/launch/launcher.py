"""``MonarchLauncher``: runs one Trainer stage on a worker mesh: acquire, run, release.

Runs on the controller. Lightning hands every ``fit``/``validate``/``test``/``predict`` call to the
strategy's launcher, which the strategy made with its settings and itself as hooks
(``controller.settings``). Bad input is rejected before any worker starts, as the stage's inputs are
made (``controller.launch.stage_inputs``). The mesh comes from the warm pool
(``controller.mesh.pool``) and goes back to it after a stage that ended cleanly; after any failure
or interrupt it is stopped. An elastic ``fit`` runs until its world stops changing
(``controller.features.elastic``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.features import preflight
from lightning_monarch.controller.features.async_validation import ValidationMesh, refuse_at_fit, stops_early
from lightning_monarch.controller.features.elastic import ElasticFit
from lightning_monarch.controller.features.rehearsal import ready_again, rehearse
from lightning_monarch.controller.launch.fresh_settings import FRESH
from lightning_monarch.controller.launch.stage_inputs import LOADER_STAGES, TRAINER_FN, StageInputs
from lightning_monarch.controller.loop.callbacks import CallbackPlacement, set_aside_refused
from lightning_monarch.controller.loop.mirrors import silence_on_exception, skip_teardown_once
from lightning_monarch.controller.loop.session import StageSession
from lightning_monarch.controller.loop.validation_replay import ValidationReplay
from lightning_monarch.controller.mesh.cells import blocks_the_cell
from lightning_monarch.controller.mesh.channel import StageChannel
from lightning_monarch.controller.mesh.pool import MESHES
from lightning_monarch.controller.mesh.worker_warnings import WorkerWarnings
from lightning_monarch.controller.settings import StageOutcome, StrategyHooks, StrategySettings

if TYPE_CHECKING:
    from lightning_monarch.controller.mesh.worker_mesh import WorkerMesh
    from lightning_monarch.wire.specs import StageSpec

log = logging.getLogger(__name__)


class MonarchLauncher(lightning_compat.Launcher):
    """Runs on the controller: each Trainer stage on a worker mesh from the warm pool, as
    ``settings`` ask; what the stage produced goes back to the strategy through ``hooks``."""

    def __init__(self, settings: StrategySettings, hooks: StrategyHooks) -> None:
        self.settings, self._hooks = settings, hooks
        FRESH.read_ahead(settings)

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
        for name in LOADER_STAGES[stage]:
            if isinstance(arguments.get(name), LightningDataModule):
                arguments["datamodule"], arguments[name] = arguments[name], None
        module = arguments.get("model") or trainer.lightning_module
        if module is None:
            return function(**arguments)  # Lightning raises its own error for a missing model
        try:
            placement = CallbackPlacement(trainer.callbacks, self.settings.worker_callbacks)  # type: ignore[attr-defined]
        except MisconfigurationException:
            self._hooks._keep_until_exception_handled(set_aside_refused(trainer))
            raise
        if placement.holds_checkpoints:  # the controller's Lightning will not find them for "best" and "last"
            arguments["ckpt_path"] = lightning_compat.resolve_ckpt_path(
                trainer,
                TRAINER_FN[stage],
                arguments.get("ckpt_path"),
                model_provided=arguments.get("model") is not None,
            )
        inputs = StageInputs(self.settings, self._hooks, stage, trainer, module, arguments, placement)
        try:
            with placement.applied(trainer):
                return self._launch(function, trainer, inputs, placement)
        finally:
            inputs.close()

    def _launch(self, function: Callable, trainer: Trainer, inputs: StageInputs, placement: CallbackPlacement) -> Any:
        """Run the stage on a mesh from the warm pool, with the ``inputs`` its workers get and its
        callbacks where ``placement`` puts them."""
        settings, stage, module, datamodule = self.settings, inputs.stage, inputs.module, inputs.datamodule
        spec = inputs.spec(settings.num_nodes)
        validation = _validation_mesh(settings, trainer, inputs)
        if stage == "fit" and settings.rehearse:
            self._rehearse(trainer, module, datamodule, inputs.loaders)

        silence = silence_on_exception(datamodule)
        key = settings.mesh_key()
        mesh = MESHES.acquire(key)
        mesh.step_timeout = settings.step_timeout
        warned = WorkerWarnings(mesh.num_workers)
        elastic = ElasticFit(settings, self._hooks, trainer, mesh) if stage == "fit" and settings.min_nodes else None
        ended_cleanly = reusable = False

        def attempt(spec: StageSpec) -> tuple[StageSession, Any]:
            return self._run_stage(trainer, function, inputs, spec, mesh, warned, elastic, validation)

        try:
            if not mesh.checked:
                preflight.check(mesh, key.accelerator, key.process_group_backend, timeout=key.timeout)
            if validation is not None:
                spec = validation.start(spec)
            if elastic is None:
                session, result = attempt(spec)
            else:
                session, result = elastic.run(attempt, spec, lambda: inputs.spec(elastic.num_nodes), inputs.arguments)
            warned.show_every_rank(mesh.take_warnings())
            if stage == "predict" and result is not None:
                result = session.predictions.as_predicted_by(trainer)
            if session.final_state is not None:
                placement.take_back(session.final_state.callbacks)
            ended_cleanly = True
            if session.tuner_exit is None:
                return result
        except BaseException as error:
            if isinstance(error, Exception):  # not on an interrupt: the user wants out
                _show_held_warnings(warned, mesh)
            reusable = ready_again(error, mesh, settings.rehearsing)
            self._hooks._keep_until_exception_handled(silence)
            silence = None
            raise
        finally:
            # a mesh that lost hosts is not the one the strategy asks for: the next stage starts anew
            keep = settings.keep_warm and not (elastic is not None and elastic.changed)
            MESHES.release(key, mesh, keep=keep, failed=not (ended_cleanly or reusable))
            if elastic is not None:
                elastic.restore()
            if validation is not None:
                validation.stop(failed=not ended_cleanly)
            if silence is not None:
                silence()
        # Lightning's handler of its tuner's exit tears the ``fit`` down here, after the workers did
        skip_teardown_once(module, datamodule)
        raise session.tuner_exit

    def _run_stage(
        self,
        trainer: Trainer,
        function: Callable,
        inputs: StageInputs,
        spec: StageSpec,
        mesh: WorkerMesh,
        warned: WorkerWarnings,
        elastic: Optional[ElasticFit],
        validation: Optional[ValidationMesh],
    ) -> tuple[StageSession, Any]:
        """Run Lightning's ``function`` with the controller's loop following the workers of
        ``mesh``, which run ``spec``, and replaying the validations of ``validation``'s workers;
        the session it ran and the function's result. A change of an
        elastic ``fit``'s world (``HostsLostError``, ``HostsReturned``, ``PreemptionNoticed``)
        leaves the mesh as it was then, for the elastic feature to change it and run the stage again."""
        warned.num_workers = mesh.num_workers
        snapshots = self._hooks._snapshot_directory()
        channel = StageChannel(
            mesh,
            spec,
            self.settings.max_restarts,
            snapshots,
            lost_hosts=elastic.lost_host_check() if elastic is not None else None,
            shared_memory=self.settings.shared_memory,
        )
        try:
            channel.start()
            session = StageSession(
                trainer,
                channel,
                inputs.module,
                inputs.datamodule,
                inputs.worker_callbacks,
                spec.run_ahead,
                inputs.snapshots(),
                elastic,
                sharded=spec.trainer.sharding is not None,
                warned=warned,
            )
            self._hooks._attach(session)
            replay = None
            if validation is not None:
                replay = ValidationReplay(session, validation, channel, WorkerWarnings(mesh.num_workers))
            with session.installed(), replay.installed(trainer) if replay is not None else nullcontext():
                try:
                    result = function(**inputs.calling(session))
                except lightning_compat.TunerExit as exit:
                    result, session.tuner_exit = None, exit
                session.finish(spec.fn)
            if replay is not None:
                replay.finish()
            return session, result
        finally:
            self._hooks._attach(None)
            self._hooks._record(StageOutcome(restarts=channel.restarts, sent_bytes=dict(mesh.sent)))
            if snapshots is not None:
                snapshots.remove()

    def _rehearse(
        self,
        trainer: Trainer,
        module: LightningModule,
        datamodule: Optional[LightningDataModule],
        loaders: dict[str, Any],
    ) -> None:
        """``MonarchStrategy(rehearse=True)``: rehearse the ``fit`` on its workers first, show the
        report (its warnings as warnings) and hand it to the strategy (``strategy.rehearsal``)."""
        report = rehearse(trainer, module, datamodule=datamodule, **loaders)
        self._hooks._record(StageOutcome(rehearsal=report))
        rank_zero_info(f"lightning_monarch: rehearsal of this fit on its workers:\n{report.table()}")
        for warning in report.warnings:
            rank_zero_warn(f"lightning_monarch rehearsal: {warning}")


def _validation_mesh(settings: StrategySettings, trainer: Trainer, inputs: StageInputs) -> Optional[ValidationMesh]:
    """The second mesh of a ``fit`` with asynchronous validation, not started yet, once what it
    does not serve is refused; ``None`` for other stages, and for a module that does not validate."""
    if settings.validation != "async" or inputs.stage != "fit" or not is_overridden("validation_step", inputs.module):
        return None
    refuse_at_fit(trainer)
    return ValidationMesh(settings, stops_early(trainer))


def _show_held_warnings(warned: WorkerWarnings, mesh: Any) -> None:
    """After a failed stage, before its mesh stops: the warnings the ranks still hold. Showing
    them must not hide the failure (a warning filter may turn one into an error here)."""
    try:
        warned.show_every_rank(mesh.take_warnings())
    except Exception as error:
        log.debug("The workers' warnings after a failed stage could not be shown: %s", error)
