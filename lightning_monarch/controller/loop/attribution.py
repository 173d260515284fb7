"""Which of the controller's callbacks runs now, so that an error can name it (R6).

Runs on the controller, for a stage's ``StageSession``: the hooks of every callback of the
controller's Trainer are wrapped for the stage, so that a read of live worker state or a change of
control state where the workers did not wait names the callback and the hook that made it, and so
that a hook that touches the module mirror's tensors raises (``controller.loop.mirror_guard``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any, Optional

from lightning.pytorch import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_monarch.controller.loop.mirror_guard import MirrorGuard, is_guarded
from lightning_monarch.wire.gates import install_hook_gates
from lightning_monarch.wire.protocol import CALLBACK_HOOKS


class CallbackAttribution:
    """Runs on the controller: the controller callback whose hook runs now, and those that ran
    since the controller's loop took its last gate. Each hook of a guarded callback runs under
    ``guard`` (``controller.loop.mirror_guard``)."""

    def __init__(self, guard: MirrorGuard) -> None:
        self._guard = guard
        #: The callback whose hook runs now, and the hook.
        self.calling: Optional[tuple[Callback, str]] = None
        #: The callbacks' hooks that ran since the last gate.
        self.ran: list[tuple[Callback, str]] = []
        self._wrapped: set[int] = set()

    def wrap(self, callbacks: Iterable[Callback], undo: list[Callable[[], None]]) -> None:
        """Wrap the hooks of ``callbacks`` not wrapped yet, adding what unwraps them to ``undo``."""
        for callback in callbacks:
            if id(callback) in self._wrapped:
                continue
            self._wrapped.add(id(callback))
            hooks = [hook for hook in CALLBACK_HOOKS if is_overridden(hook, callback, Callback)]
            undo.append(install_hook_gates(callback, "controller", hooks, self._running(callback)))

    def named_ran(self) -> str:
        """The hooks that ran since the last gate, for an error: "`EarlyStopping.on_validation_end`"."""
        return (
            ", ".join(f"`{type(callback).__name__}.{hook}`" for callback, hook in self.ran) or "code on the controller"
        )

    def _running(self, callback: Callback) -> Callable[..., Any]:
        guarded = is_guarded(callback)

        def around(gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            hook = gate.split(".", 1)[1]
            previous, self.calling = self.calling, (callback, hook)
            self.ran.append(self.calling)
            try:
                with self._guard.guarding(callback, hook) if guarded else nullcontext():
                    return fn(*args, **kwargs)
            finally:
                self.calling = previous

        return around
