"""The worker's half of the lockstep: Lightning's real stage on a loop thread that parks at gates.

Runs in each worker process. The Monarch endpoint thread hands each controller message to the
loop thread and waits for its answer; the loop thread runs ``Trainer.fit`` (or ``validate``,
``test``, ``predict``) until the next gate, answers, and parks (L3). Keeping the whole stage on
one thread keeps torch's thread-local state (grad mode, autocast, the current CUDA device)
consistent, and running only while a message is being served keeps the worker deterministic.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from lightning.pytorch import Trainer

from lightning_monarch.protocol import (
    RESULT_HOOKS,
    SNAPSHOT_GATE,
    Advance,
    Finish,
    Peek,
    RankSnapshot,
    WorkerFailure,
    WorkerReply,
    control_state,
)
from lightning_monarch.worker.describe import describe_result, worker_side_result
from lightning_monarch.worker.state import StateReader

Command = Union[Advance, Peek, Finish]


class LockstepError(RuntimeError):
    """The controller's loop and a worker's loop reached different hooks (L1 was broken)."""


@dataclass
class _OutOfBand:
    """A request served on the loop thread while it is parked, without moving the loop."""

    fn: Callable[[], Any]


class StageLoop:
    """Runs in each worker: one Trainer stage, advanced gate by gate by the controller's messages."""

    def __init__(self, trainer: Trainer, run: Callable[[], Any], rank: int, reader: StateReader,
                 resume: Optional[RankSnapshot] = None, skipped: frozenset[str] = frozenset()) -> None:
        self._trainer = trainer
        #: Rank-local gates (``RANK_LOCAL_HOOKS``) that Lightning never calls on this rank.
        self._skipped = skipped
        #: Set while a replacement worker catches up (``protocol.ResumePoint``).
        self._resume = resume
        self._run = run
        self._rank = rank
        self._reader = reader
        self._inbox: queue.Queue[Union[Command, _OutOfBand]] = queue.Queue()
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._command: Optional[Command] = None
        self._pending: deque[Command] = deque()
        self._depth = 0
        self._nested: list[tuple[str, Any]] = []
        self._gate: Optional[str] = None
        self._failed_gate: Optional[str] = None
        self._free_running = False
        self._ended: Optional[WorkerReply] = None

    # ----- endpoint thread -------------------------------------------------------------------

    def submit(self, commands: list[Command]) -> WorkerReply:
        """Runs on the endpoint thread: serve one controller message, a burst of loop commands run
        back to back (L4), and return the answer to the last one."""
        if self._ended is not None:
            return self._answer_after_end(commands)
        if self._thread is None:
            self._pending.extend(commands[1:])
            self._thread = threading.Thread(
                target=self._main, args=(commands[0],), name="lightning-monarch-loop", daemon=True
            )
            self._thread.start()
        else:
            self._inbox.put(commands)
        last = commands[-1]
        if isinstance(last, Advance) and last.hook in self._skipped:
            # Answered now, while the loop moves on: before its next gate it may wait in a barrier
            # (Lightning's around ``prepare_data``) for the ranks that run the hook.
            return WorkerReply(rank=self._rank, hook=last.hook, skipped=True)
        return self._outbox.get()

    def out_of_band(self, fn: Callable[[], Any]) -> Any:
        """Runs on the endpoint thread: run ``fn`` on the parked loop thread and return its value.

        Used for checkpoint state, which must be read where the stage's tensors live, at the
        point the loop has reached. Once the stage has ended, ``fn`` runs here directly.
        """
        if self._ended is not None and self._ended.failure is not None:
            raise RuntimeError(f"The stage failed on rank {self._rank}: {self._ended.failure.message}")
        if self._thread is None or self._ended is not None:
            return fn()
        self._inbox.put(_OutOfBand(fn))
        value, error = self._outbox.get()
        if error is not None:
            raise error
        return value

    @property
    def reader(self) -> StateReader:
        """What this rank can tell the controller about its Trainer."""
        return self._reader

    def join(self, timeout: float) -> None:
        """Runs on the endpoint thread: wait for the loop thread after the stage ended."""
        if self._thread is not None:
            self._thread.join(timeout)

    # ----- loop thread -----------------------------------------------------------------------

    def around(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs on the loop thread at every gated hook call (L2, L3)."""
        if self._free_running:
            return fn(*args, **kwargs)
        if self._resume is not None:
            return self._catch_up(gate, fn, args, kwargs)
        if self._depth:
            return self._nested_call(gate, fn, args, kwargs)
        self._arrive(gate)
        self._depth, self._nested, self._gate = 1, [], gate
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self._free_running = True
            self._failed_gate = self._failed_gate or gate
            raise
        finally:
            self._depth = 0
        command = self._command
        assert isinstance(command, Advance)
        reply = self._reply(gate, full=command.wait, loaders=False)
        if command.wait and (self._rank == 0 or gate == "module.predict_step"):
            # only a waited reply is read: describing copies tensors to the CPU (a device sync on GPUs)
            reply.result = describe_result(gate, result, self._trainer, args)
        reply.nested = self._nested
        self._answer(reply)
        self._wait()
        return worker_side_result(gate, result)

    def _catch_up(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A replacement worker's Lightning resumes from the snapshot's checkpoint without gates up
        to :data:`SNAPSHOT_GATE`, where it takes back the rest of the snapshot; the controller's
        replayed messages then meet it at the next gate."""
        result = fn(*args, **kwargs)
        if gate == SNAPSHOT_GATE and self._resume is not None:
            self._reader.resume(self._resume)
            self._resume = None
        return worker_side_result(gate, result)

    def _nested_call(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._depth += 1
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            self._failed_gate = self._failed_gate or gate
            raise
        finally:
            self._depth -= 1
        if gate in RESULT_HOOKS and self._rank == 0 and self._waited():
            self._nested.append((gate, describe_result(gate, result, self._trainer, args)))
        return worker_side_result(gate, result)

    def _waited(self) -> bool:
        """Whether the controller reads the reply to the command being run (L4)."""
        return isinstance(self._command, Advance) and self._command.wait

    def _arrive(self, gate: str) -> None:
        """Serve messages parked in front of ``gate`` until one asks to run it."""
        while True:
            command = self._command
            if isinstance(command, Advance) and command.hook == gate:
                return
            if isinstance(command, Peek):
                self._answer(self._reply(gate, full=True, loaders=True))
            elif isinstance(command, Advance) and command.hook in self._skipped:
                pass  # a hook Lightning skips on this rank; ``submit`` answered it
            else:
                self._free_running = True
                expected = command.hook if isinstance(command, Advance) else "the end of the stage"
                raise LockstepError(
                    f"The controller's loop reached `{expected}` but worker rank {self._rank} reached"
                    f" `{gate}`. The two Lightning loops diverged; this is a bug in lightning_monarch"
                    " or a hook that changes the loop's control flow differently on each side."
                )
            self._wait()

    def _answer(self, reply: WorkerReply) -> None:
        """Send ``reply`` if its command ends a burst; the controller waits only for those (L4)."""
        if not self._pending:
            self._outbox.put(reply)

    def _wait(self) -> None:
        """Take the next command of the burst, or park until the next message; serve out-of-band
        requests meanwhile."""
        if self._pending:
            self._accept(self._pending.popleft())
            return
        while True:
            item = self._inbox.get()
            if isinstance(item, list):
                self._pending.extend(item[1:])
                self._accept(item[0])
                return
            if isinstance(item, _OutOfBand):
                try:
                    self._outbox.put((item.fn(), None))
                except Exception as error:  # handed to the endpoint thread, which raises it
                    self._outbox.put((None, error))

    def _accept(self, command: Command) -> None:
        self._command = command
        if isinstance(command, Advance):
            for name, value in command.control.items():
                setattr(self._trainer, name, value)

    def _main(self, first: Command) -> None:
        self._accept(first)
        try:
            self._run()
        except BaseException as error:
            self._free_running = True
            self._ended = WorkerReply(rank=self._rank, failure=self._failure(error))
        else:
            self._ended = self._reply(None, full=True, loaders=True)
        leftover = [self._command, *self._pending]
        self._pending.clear()
        self._outbox.put(self._answer_after_end(leftover))

    def _answer_after_end(self, commands: list[Optional[Command]]) -> WorkerReply:
        assert self._ended is not None
        advance = next((command for command in commands if isinstance(command, Advance)), None)
        if self._ended.failure is None and advance is not None:
            error = LockstepError(
                f"The controller's loop reached `{advance.hook}` but worker rank {self._rank} had"
                " already finished the stage. The two Lightning loops diverged."
            )
            return WorkerReply(rank=self._rank, failure=self._failure(error))
        return self._ended

    def _reply(self, gate: Optional[str], full: bool, loaders: bool) -> WorkerReply:
        reply = WorkerReply(rank=self._rank, hook=gate, control=control_state(self._trainer))
        if full:
            self._reader.fill(reply, loaders)
        return reply

    def _failure(self, error: BaseException) -> WorkerFailure:
        return WorkerFailure.capture(error, self._rank, self._failed_gate or self._gate)
