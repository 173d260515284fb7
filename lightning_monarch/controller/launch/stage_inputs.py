"""What one Trainer call gives its workers: the stage's spec, and the loaders the controller follows.

Runs on the controller, for the launcher (``controller.launch.launcher``), before any worker
starts: the call's dataloaders are shipped to the workers or, where one cannot travel, fed by this
process (``controller.mesh.feed``); the module, datamodule, loaders, worker callbacks and Trainer
class are packed (``controller.mesh.payload``); the run-ahead plan is made
(``controller.loop.plan``); and, once the stage's session runs, the controller's loop is handed
loader plans in place of the loaders (``controller.loop.mirrors``). Everything is checked and
pickled here, so that bad input is refused before a mesh is taken.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import sys
import uuid
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_monarch import torch_settings
from lightning_monarch._compat import lightning as lightning_compat
from lightning_monarch.controller.launch.fresh_settings import FRESH
from lightning_monarch.controller.loop.callbacks import CallbackPlacement
from lightning_monarch.controller.loop.mirrors import plan_loaders
from lightning_monarch.controller.loop.plan import make_plan, states_can_travel
from lightning_monarch.controller.loop.session import StageSession
from lightning_monarch.controller.loop.taken_back import back_to_its_class
from lightning_monarch.controller.mesh import debugger
from lightning_monarch.controller.mesh.feed import FedLoaders
from lightning_monarch.controller.mesh.payload import pack_for_workers, travelling_loggers
from lightning_monarch.controller.settings import StrategyHooks, StrategySettings
from lightning_monarch.wire.protocol import SnapshotEpochs
from lightning_monarch.wire.specs import LoaderRef, LoggerIdentity, StageSpec, TorchRngStart, TrainerConfig

TRAINER_FN = {
    "fit": TrainerFn.FITTING,
    "validate": TrainerFn.VALIDATING,
    "test": TrainerFn.TESTING,
    "predict": TrainerFn.PREDICTING,
}
#: The loop stage each dataloader argument feeds, per Trainer method.
LOADER_STAGES = {
    "fit": {"train_dataloaders": "train", "val_dataloaders": "val"},
    "validate": {"dataloaders": "val"},
    "test": {"dataloaders": "test"},
    "predict": {"dataloaders": "predict"},
}
#: Environment variables that make the workers' RNG match DDP ranks' (``seed_everything``); sent
#: unset too, so that a warm worker does not keep an earlier stage's seed.
_SEED_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
#: The packages whose frames are the Trainer's own, not the code that called it.
_TRAINER_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_monarch", "torch", "contextlib")


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


class StageInputs:
    """Runs on the controller: one Trainer call's inputs, as its workers and the controller's
    loop take them. ``arguments`` are the call's, by name (a datamodule given as a loader already
    moved to ``datamodule``); they stay the launcher's, which may point ``ckpt_path`` elsewhere
    before the next :meth:`spec`. :meth:`close` after the stage."""

    def __init__(
        self,
        settings: StrategySettings,
        hooks: StrategyHooks,
        stage: str,
        trainer: Trainer,
        module: LightningModule,
        arguments: dict[str, Any],
        placement: CallbackPlacement,
    ) -> None:
        self._settings, self._hooks, self.stage, self._trainer = settings, hooks, stage, trainer
        self.module, self.arguments, self._placement = module, arguments, placement
        self.worker_callbacks: list[Callback] = placement.workers
        self.datamodule: Optional[LightningDataModule] = arguments.get("datamodule")
        back_to_its_class(self.datamodule)  # the workers get its class, not the one reading what they kept
        self._fed = FedLoaders(
            {name: arguments[name] for name in LOADER_STAGES[stage] if arguments.get(name) is not None},
            len(settings.devices) * settings.num_nodes,
            _handed_at(),
            refuse=self._refuse_feeding(),
        )
        #: The call's dataloaders, by argument, each as the workers get it.
        self.loaders: dict[str, Any] = self._fed.loaders

    def close(self) -> None:
        """The stage ended: let the fed loaders go, and remember the torch generator's state."""
        self._fed.close()
        _TORCH_RNG.stage_ended()

    def snapshots(self) -> Optional[SnapshotEpochs]:
        """When the workers wait for a snapshot: every ``snapshot_every_n_epochs`` training epochs
        with restarts (from the second) or elastic training (from the first); ``None`` otherwise."""
        settings = self._settings
        if settings.min_nodes:
            return SnapshotEpochs(settings.snapshot_every_n_epochs, first=True)
        if settings.max_restarts:
            return SnapshotEpochs(settings.snapshot_every_n_epochs)
        return None

    def _before_gate(self) -> int:
        """How many worker callbacks run before the gate callback on the workers (``CallbackPlacement``)."""
        settings = self._settings
        if self.snapshots() is None:
            return self._placement.before_gate
        if settings.min_nodes:
            return self._placement.gate_first("elastic training (`MonarchStrategy(min_nodes=...)`)")
        return self._placement.gate_first(f"`MonarchStrategy(max_restarts={settings.max_restarts})`")

    def calling(self, session: StageSession) -> dict[str, Any]:
        """The arguments of the call the controller's Trainer runs in ``session``: each loader
        replaced by the plan of batches the controller's loop follows."""
        calling = dict(self.arguments)
        for name, loop_stage in LOADER_STAGES[self.stage].items():
            if self.arguments.get(name) is not None:
                calling[name] = plan_loaders(LoaderRef.describe(self.arguments[name]), loop_stage, session.loaders)
        return calling

    def _refuse_feeding(self) -> Optional[str]:
        """Why this stage cannot have the controller iterate a dataloader that cannot travel, or ``None``."""
        settings = self._settings
        if self.stage == "predict":
            return "`trainer.predict` would then predict every item on every rank."
        if settings.max_restarts:
            return (
                f"`MonarchStrategy(max_restarts={settings.max_restarts})` resumes replaced workers, which iterate"
                " their loaders again from the resume point, and one copy iterated once cannot go back."
            )
        if settings.min_nodes:
            return "elastic training (`MonarchStrategy(min_nodes=...)`) resumes the fit in a new world, which iterates its loaders again."
        if settings.rehearse or settings.rehearsing:
            return "`MonarchStrategy(rehearse=True)` would iterate it in the rehearsal first, and the fit would see later items."
        return None

    def spec(self, num_nodes: int) -> StageSpec:
        """Everything the workers of a world of ``num_nodes`` hosts need, checked and pickled
        before any of them starts."""
        settings, trainer, module, arguments = self._settings, self._trainer, self.module, self.arguments
        profiler = trainer.profiler  # type: ignore[attr-defined]
        if not isinstance(profiler, PassThroughProfiler):
            rank_zero_warn(
                f"`Trainer(profiler={type(profiler).__name__}(...))` under strategy='monarch' profiles the"
                " controller's loop: each step's time there includes waiting for the workers, not their compute."
            )
        sharding = self._hooks._sharding_for_stage(module, arguments.get("ckpt_path"))
        script_dir = _script_dir()
        # read before the loggers are pickled: a TensorBoardLogger's version is found on first read
        loggers = [
            LoggerIdentity(name=logger.name, version=logger.version, save_dir=logger.save_dir, log_dir=logger.log_dir)
            for logger in trainer.loggers
        ]
        payload = pack_for_workers(
            {
                "LightningModule": module,
                "LightningDataModule": self.datamodule,
                "dataloaders": self.loaders,
                "worker_callbacks": self.worker_callbacks,
                "Trainer": lightning_compat.trainer_subclass(trainer),
                "loggers": travelling_loggers(trainer.loggers),
            },
            script_dir,
        )
        ckpt_path = lightning_compat.resolve_ckpt_path(
            trainer,
            TRAINER_FN[self.stage],
            arguments.get("ckpt_path"),
            model_provided=arguments.get("model") is not None,
        )
        if ckpt_path is not None and "://" not in ckpt_path and not os.path.exists(ckpt_path):
            raise FileNotFoundError(
                f"`trainer.{self.stage}(ckpt_path={arguments.get('ckpt_path')!r})`: no checkpoint file at {ckpt_path}."
            )
        return StageSpec(
            fn=self.stage,
            payload=payload,
            ckpt_path=ckpt_path,
            weights_only=arguments.get("weights_only"),
            fit_loop_state=trainer.fit_loop.state_dict(),
            trainer=TrainerConfig(
                accelerator=settings.worker_accelerator,
                devices=len(settings.devices),
                num_nodes=num_nodes,
                precision=str(trainer.precision),
                process_group_backend=settings.process_group_backend,
                flags={**lightning_compat.trainer_flags(trainer), "sync_batchnorm": settings.sync_batchnorm},
                ddp_kwargs=dict(settings.ddp_kwargs),
                timeout=settings.timeout,
                sharding=sharding,
            ),
            loggers=loggers,
            sys_path=(script_dir,) if script_dir else (),
            env={name: os.environ.get(name) for name in _SEED_ENV},
            torch_rng=_TORCH_RNG.start(),
            torch_settings=torch_settings.changed(FRESH.values(settings)),
            start_method=multiprocessing.get_start_method(allow_none=True),
            callbacks_before_gate=self._before_gate(),
            rehearsal=settings.rehearsing,
            post_mortem=settings.post_mortem,
            pdb_barrier=f"lightning_monarch/pdb/{uuid.uuid4().hex}" if debugger.takes_input() else None,
            run_ahead=make_plan(
                trainer.callbacks,  # type: ignore[attr-defined]
                settings.max_ahead,
                self.snapshots(),
                states_travel=states_can_travel(module, self.datamodule, self.worker_callbacks, sharding is not None),
            ),
        )


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
