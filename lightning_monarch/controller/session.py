"""The controller's side of the lockstep for one Trainer stage (L2-L5 in ``protocol``).

Runs on the controller. A :class:`StageSession` puts gates on the user's LightningModule and
LightningDataModule and a gate callback first in the Trainer's callbacks, so that the real
Lightning loop running here drives the workers' loops hook by hook. User hooks never run here:
at each gate the session sends an ``Advance`` and runs only Lightning's base implementation,
fed with what the workers returned.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_monarch import _compat
from lightning_monarch.controller.callbacks import READS_WORKERS_ITSELF, check_controller_callbacks
from lightning_monarch.controller.metrics import MetricOrigins, mirror_metrics
from lightning_monarch.controller.mesh import WorkerMesh
from lightning_monarch.controller.mirrors import OptimizerMirror, WorkerLoaders, optimizer_mirrors, plan_loaders
from lightning_monarch.controller.predictions import PredictionCollector
from lightning_monarch.gates import GateCallback, install_hook_gates
from lightning_monarch.protocol import (
    DATAMODULE_HOOKS,
    METRIC_VIEWS,
    MODULE_HOOKS,
    RESULT_HOOKS,
    SNAPSHOT_GATE,
    Advance,
    CheckpointState,
    Finish,
    Peek,
    RankStats,
    WorkerReply,
    control_state,
    gate_id,
)

_BASES = {"module": LightningModule, "datamodule": LightningDataModule}

#: Gates of a training batch whose only result is the step's outputs (automatic optimization).
_STEP_GATES = frozenset({"module.optimizer_step", "module.training_step"})
#: Callback hooks that Lightning calls inside a training step, with the loss or after it.
_IN_STEP_CALLBACK_HOOKS = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")


class LockstepError(RuntimeError):
    """The controller's loop and the workers' loops reached different hooks."""


class StageSession:
    """Runs on the controller: drives the workers through one stage in step with the local loop."""

    def __init__(self, trainer: Trainer, mesh: WorkerMesh, module: LightningModule,
                 datamodule: Optional[LightningDataModule], worker_callbacks: list[Callback],
                 sharded: bool = False) -> None:
        self._trainer = trainer
        #: Whether the workers shard the module (``parallelism="fsdp"``): its weights never come here.
        self._sharded = sharded
        self._worker_callbacks = worker_callbacks
        self._mesh = mesh
        self._objects = {"module": module, "datamodule": datamodule}
        self._gate_callback = GateCallback(self.around)
        self._wait: dict[str, bool] = {}
        self._step_deferrable: Optional[bool] = None
        self._deferred = False
        self._unanswered = False
        self._control: dict[str, Any] = {}
        self._replay: Optional[deque[tuple[str, Any]]] = None
        # Results of hooks the workers ran inside another hook, for the controller to take when its
        # own loop calls that hook later (``estimated_stepping_batches`` in ``configure_optimizers``
        # makes a worker build its train dataloader early).
        self._ahead: dict[str, deque[Any]] = {}
        self._eval_outputs: deque[dict[str, Any]] = deque()
        self._position = 0
        self._state: Optional[tuple[int, CheckpointState]] = None
        self.loaders = WorkerLoaders(self.peek)
        self.predictions = PredictionCollector()
        #: Which metric each tensor of the controller's metric views stands for.
        self.metric_origins = MetricOrigins()
        self.final_state: Optional[CheckpointState] = None

    @contextmanager
    def installed(self) -> Iterator["StageSession"]:
        """Gates, the metrics mirror and the gate callback for the duration of the stage."""
        module, datamodule = self._objects["module"], self._objects["datamodule"]
        undo = [install_hook_gates(module, "module", MODULE_HOOKS, self.around)]
        if datamodule is not None:
            undo.append(install_hook_gates(datamodule, "datamodule", DATAMODULE_HOOKS, self.around))
        if self._worker_callbacks or is_overridden("on_save_checkpoint", module, LightningModule):
            undo.append(install_hook_gates(module, "checkpoint", ["on_save_checkpoint"], self._on_save_checkpoint))
        undo.append(mirror_metrics(self._trainer, self))
        self._trainer.callbacks.insert(0, self._gate_callback)
        try:
            yield self
        finally:
            self._trainer.callbacks.remove(self._gate_callback)
            for step in reversed(undo):
                step()

    # ----- gates -----------------------------------------------------------------------------

    def around(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs at every gated hook call on the controller (L2-L5)."""
        if self._replay is not None:
            return self._nested(gate, fn, args, kwargs)
        if self._ahead.get(gate):
            return self._materialize(gate, self._ahead[gate].popleft())
        self._deferred = gate in _STEP_GATES and self._defers_step()
        wait = not self._deferred and (self._must_wait(gate) or self._must_answer(gate))
        replies = self._advance(Advance(gate, self._control_changes(), wait))
        if self._deferred:
            self._unanswered = True
            self._mesh.flush()
        if gate == SNAPSHOT_GATE:
            self._mesh.snapshot(self._trainer.current_epoch)
        self._replay = deque(replies[0].nested if replies else ())
        try:
            if replies is not None and gate == "callback.on_train_batch_end":
                _fill_outputs(args[0], replies[0].result)
            if gate in RESULT_HOOKS and replies is not None:
                return self._result(gate, replies)
            if self._deferred and gate == "module.training_step":
                return _pending_loss()
            return self._base(gate, fn)(*args, **kwargs)
        finally:
            for nested_gate, value in self._replay:
                self._ahead.setdefault(nested_gate, deque()).append(value)
            self._replay = None
            self._deferred = False

    def _base(self, gate: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Lightning's own implementation of a gated hook, bound to the controller's object; for a
        callback gate, the gate's no-op ``fn``."""
        owner, hook = gate.split(".", 1)
        return getattr(_BASES[owner], hook).__get__(self._objects[owner]) if owner in _BASES else fn

    def _nested(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        assert self._replay is not None
        if gate not in RESULT_HOOKS:
            return self._base(gate, fn)(*args, **kwargs)
        if self._deferred and gate == "module.training_step":
            return _pending_loss()
        if not self._replay or self._replay[0][0] != gate:
            recorded = self._replay[0][0] if self._replay else "nothing"
            raise LockstepError(f"The controller called `{gate}` inside a hook where the workers called {recorded}.")
        return self._materialize(gate, self._replay.popleft()[1])

    def closure_runs(self) -> int:
        """How many times the workers ran the optimizer closure in the hook being replayed."""
        if self._deferred:
            return 1
        return sum(gate == "module.training_step" for gate, _ in self._replay or ())

    def _must_wait(self, gate: str) -> bool:
        """Whether the controller needs anything back from gate ``gate`` (L4): the result or the
        effects of user code, or the state a controller callback on that hook may read (not one that
        asks the workers itself, ``READS_WORKERS_ITSELF``). A hook the user did not override returns
        what Lightning's base implementation returns here. A module hook also waits for the worker
        callbacks of the same hook, which run just before it."""
        if gate not in self._wait:
            owner, hook = gate.split(".", 1)
            if gate == "module.optimizer_step":
                wait = True
            elif owner in _BASES:
                wait = is_overridden(hook, self._objects[owner], _BASES[owner]) or (
                    owner == "module" and _any_overrides(hook, self._worker_callbacks)
                )
            else:
                controller_callbacks = [
                    cb for cb in self._trainer.callbacks
                    if cb is not self._gate_callback and not isinstance(cb, READS_WORKERS_ITSELF)
                ]
                wait = _any_overrides(hook, controller_callbacks)
            self._wait[gate] = wait
        return self._wait[gate]

    def _defers_step(self) -> bool:
        """Whether a training step's ``optimizer_step`` (or, while gradients accumulate, its
        ``training_step``) may go without waiting (L4): nothing on the controller needs the step's
        outputs before the callbacks' ``on_train_batch_end``. That holds under automatic
        optimization with Lightning's own ``optimizer_step``, optimizers that call the closure
        once, no gradient scaler, and no controller callback on a hook inside the step."""
        if self._step_deferrable is None:
            module = self._objects["module"]
            self._step_deferrable = (
                module.automatic_optimization
                and not is_overridden("optimizer_step", module, LightningModule)
                and all(getattr(optimizer, "single_closure", False) for optimizer in self._trainer.optimizers)
                and getattr(self._trainer.precision_plugin, "scaler", None) is None
                and not any(self._must_wait(gate_id("callback", hook)) for hook in _IN_STEP_CALLBACK_HOOKS)
            )
        return self._step_deferrable

    def _must_answer(self, gate: str) -> bool:
        """A training batch whose step went unanswered gets its reply at its last gate, before the
        controller's loop decides whether to go on: user code on the workers may have asked to stop."""
        return gate == "module.on_train_batch_end" and self._unanswered

    def _control_changes(self) -> dict[str, Any]:
        """The control state the controller changed since it last took the workers' (L3)."""
        current = control_state(self._trainer)
        changes = {name: value for name, value in current.items() if self._control.get(name, _UNSET) != value}
        self._control = current
        return changes

    def _result(self, gate: str, replies: list[WorkerReply]) -> Any:
        if gate == "module.predict_step":
            self.predictions.add([reply.result for reply in replies])
        if gate == "module.configure_callbacks":
            check_controller_callbacks(_as_list(replies[0].result))
        return self._materialize(gate, replies[0].result)

    def _materialize(self, gate: str, value: Any) -> Any:
        hook = gate.split(".", 1)[1]
        if hook == "training_step":
            return _trainable(value)
        if hook == "predict_step":
            return value.output
        if hook == "configure_optimizers":
            return optimizer_mirrors(value, self.closure_runs, self.checkpoint_state)
        if hook.endswith("_dataloader"):
            return plan_loaders(value, hook.split("_", 1)[0], self.loaders)
        return value

    # ----- messages --------------------------------------------------------------------------

    def _advance(self, command: Any) -> Optional[list[WorkerReply]]:
        replies = self._mesh.advance(command)
        self._position += 1
        if replies:
            self._apply(replies[0])
        return replies

    def _apply(self, reply: WorkerReply) -> None:
        trainer = self._trainer
        for name, value in reply.control.items():
            setattr(trainer, name, value)
        self._control = dict(reply.control)
        self._unanswered = False
        for call in reply.logger_calls:
            logger = trainer.loggers[call.logger_index]
            target = logger.experiment if call.method.startswith("experiment.") else logger
            getattr(target, call.method.rsplit(".", 1)[-1])(*call.args, **call.kwargs)
            if call.method == "log_metrics":
                logger.save()
        for mirror, groups in zip(trainer.optimizers, reply.param_groups or ()):
            if isinstance(mirror, OptimizerMirror):  # not Lightning's stand-in when there is no optimizer
                mirror.update_hyperparameters(groups)
        if reply.manual_steps is not None:
            _compat.manual_step_progress(trainer).load_state_dict(reply.manual_steps)
        self._eval_outputs.extend(reply.eval_outputs)

    def peek(self) -> WorkerReply:
        """Let the workers run up to their next gate; return rank 0's reply."""
        replies = self._advance(Peek())
        assert replies is not None
        return replies[0]

    def next_eval_outputs(self) -> dict[str, Any]:
        """The next value the workers' ``update_eval_epoch_metrics`` returned on rank 0."""
        if not self._eval_outputs:
            self.peek()
        if not self._eval_outputs:
            raise LockstepError("The controller's evaluation loop ended an epoch that the workers did not end.")
        return self._eval_outputs.popleft()

    @property
    def worker_pids(self) -> list[int]:
        """The process IDs of the workers, in rank order."""
        return list(self._mesh.pids)

    def read_metrics(self, view: str) -> dict[str, Any]:
        """Rank 0's ``trainer.<view>`` at the point both loops have reached."""
        values = self._mesh.read_metrics(view)
        self.metric_origins.remember(view, values)
        return values

    def collective(self, kind: str, view: str, key: str, options: dict[str, Any]) -> Any:
        """``trainer.strategy.<kind>`` run by every worker on its own ``trainer.<view>[key]``, where
        both loops have reached; rank 0's result."""
        return self._mesh.collective(kind, view, key, options)

    def metric_on_every_rank(self, view: str, key: str) -> list[Any]:
        """Every rank's ``trainer.<view>[key]``, in rank order, where both loops have reached."""
        return [answer.value for answer in self._mesh.metric_on_every_rank(view, key)]

    def read_stats(self) -> list[RankStats]:
        """Every rank's stats (``worker.stats``) at the point both loops have reached, in rank order."""
        return self._mesh.read_stats()

    def checkpoint_state(self) -> CheckpointState:
        """Rank 0's model, optimizer and scheduler state here; read once per loop position. After
        a training stage, the state it ended with."""
        if self.final_state is not None:
            return self.final_state
        if self._state is None or self._state[0] != self._position:
            self._state = (self._position, self._mesh.checkpoint_state())
        return self._state[1]

    def _on_save_checkpoint(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        checkpoint = args[0] if args else kwargs["checkpoint"]
        edited = self._mesh.on_save_checkpoint(checkpoint)
        checkpoint.clear()
        checkpoint.update(edited)

    def full_state_dict(self) -> dict[str, Any]:
        """The sharded module's full state dict, gathered by the workers: where both loops have
        reached during the stage, the final one after it (while the mesh keeps the shards)."""
        return self._mesh.full_state_dict()

    def save_sharded_checkpoint(self, path: str, optimizers: bool) -> dict[str, Any]:
        """Let the workers write their shards into the directory ``path`` (``worker.checkpoints``),
        where both loops have reached during the stage, the final ones after it; return rank 0's
        worker callbacks' state."""
        return self._mesh.save_sharded_checkpoint(path, optimizers)

    def finish(self, trained: bool) -> None:
        """Let the workers finish the stage; take their final metrics and rank 0's module attributes,
        and after training their final state, which the controller's module then holds. A sharded
        module's weights stay on the workers: the controller's module goes to the meta device."""
        self._advance(Finish())
        for view in METRIC_VIEWS:
            getattr(self._trainer, view)
        module = self._objects["module"]
        attributes = self._mesh.module_attributes()
        vars(module).update(attributes.values)
        if attributes.dropped:
            reasons = "; ".join(f"`{name}` ({why})" for name, why in sorted(attributes.dropped.items()))
            rank_zero_warn(
                f"`{type(module).__name__}`: the workers' module has public attributes that cannot be pickled:"
                f" {reasons}. After the stage, the controller's module takes rank 0's public attributes, as"
                " the module of a `ddp` script's rank 0 would have them, but not these: it keeps its own. Make"
                " them picklable, or keep them out of the public attributes (a name that starts with `_`)."
            )
        if trained and self._sharded:
            module.to("meta")
        elif trained:
            self.final_state = self._mesh.checkpoint_state()
            if set(self.final_state.model) != set(module.state_dict()):
                # ``configure_model`` changed the module on the workers (compiled, wrapped or grew
                # layers): the controller's module takes rank 0's submodules, as DDP's rank 0 has them.
                for name, child in self._mesh.module_children().items():
                    setattr(module, name, child)
            module.load_state_dict(self.final_state.model)


_UNSET = object()


def _any_overrides(hook: str, callbacks: list[Callback]) -> bool:
    return hasattr(Callback, hook) and any(is_overridden(hook, callback, Callback) for callback in callbacks)


def _fill_outputs(outputs: Any, worker_outputs: Any) -> None:
    """Give the controller's ``on_train_batch_end`` callbacks the batch outputs that rank 0
    computed, in the dict that Lightning passes them, before any of them runs."""
    if isinstance(outputs, dict) and isinstance(worker_outputs, dict):
        outputs.clear()
        outputs.update(worker_outputs)


def _pending_loss() -> torch.Tensor:
    """The loss of a training step whose result the workers send later (L4)."""
    return torch.zeros((), requires_grad=True)


def _as_list(callbacks: Any) -> list[Callback]:
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _trainable(output: Any) -> Any:
    """A training step's loss as the controller's loop needs it: a leaf that accepts ``backward``.

    The real backward ran on the workers; the controller's loop still calls ``backward`` on the
    value it got, which must not fail.
    """
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output.requires_grad_()
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": _trainable(output["loss"])}
    return output
