"""The worker's half of the protocol: Lightning's real stage on a loop thread that runs ahead of the
controller, records what the controller needs at every gate, and waits only where it must (R3-R5).

Runs in each worker process. The loop thread runs ``Trainer.fit`` (or ``validate``, ``test``,
``predict``) from the moment the stage starts. At each gate it runs the hook, and rank 0 records an
``Entry`` for the controller, which fetches them in bulk; before the first gate of a batch it
waits if it is ``max_ahead`` batches ahead of the last one the controller took, and after a sync
gate it parks until the controller releases it, serving the controller's out-of-band requests
(checkpoint state, metrics, stats) meanwhile. Keeping the whole stage on one thread keeps torch's
thread-local state (grad mode, autocast, the current CUDA device) consistent.

The endpoint thread (Monarch's) and the loop thread share the state under one condition variable:
the endpoint thread hands over grants, releases and out-of-band requests, and takes the entries.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning.pytorch import Trainer

from lightning_monarch.errors import DivergenceError
from lightning_monarch.wire.codec import StorageKey, encode
from lightning_monarch.wire.protocol import (
    GATES,
    MAX_STAGED_STATES,
    NOTICE_GATE,
    OMITTED,
    SNAPSHOT_GATE,
    Entry,
    Grant,
    RankStatus,
    Release,
    RunAhead,
    set_control_state,
)
from lightning_monarch.wire.reports import PredictionShard, WorkerFailure
from lightning_monarch.wire.specs import RankSnapshot
from lightning_monarch.worker.async_validation import HandOff, ValidationServer
from lightning_monarch.worker.breakpoints import post_mortem
from lightning_monarch.worker.describe import describe_result, worker_side_result
from lightning_monarch.worker.entries import EntryRecorder
from lightning_monarch.worker.held_warnings import HELD
from lightning_monarch.worker.notices import any_host_noticed
from lightning_monarch.worker.state import RankState
from lightning_monarch.worker.stats import memory_in_use_mib
from lightning_monarch.worker.trial import Trial

#: How long rank 0 holds its entries for more once the controller asks for them, while its batches
#: start less than this apart and the controller does not need them at once (``StageLoop.fetch``):
#: a controller that keeps pace with short steps then fetches a few batches per message, not one,
#: and spends its CPU on its loop. Longer steps would bring no second batch in that time; a fetch
#: then returns whole batches (:data:`FETCH_SPAN_S`).
FETCH_LINGER_S = 0.02
#: With longer steps, how old the first entry of a fetch grows before the fetch returns the whole
#: batches it has: 30 ms steps come three to a message, and the controller's CPU per batch (its
#: own, and Monarch's per message) grows less as the steps grow longer, as they do with more
#: workers on a few cores (measured with 8 workers on 2 cores: 1.5 against 2.1 ms per batch, when
#: every batch came alone). A batch longer than this comes alone, as soon as it ends: waiting for
#: a second one would only delay the controller (measured: 228 against 307 ms per controller-timed
#: step of the large benchmark model, when every fetch lingered for more).
FETCH_SPAN_S = 0.1
#: How long a fetch waits for the batch in progress to end before it answers with this rank's
#: status instead (``StageLoop.fetch``): a batch held in a collective that a stuck peer never
#: joins never ends, and the controller, which names the ranks that stay behind when a wait
#: times out, must see how far rank 0 got, not how far its last fetch reached.
FETCH_STATUS_S = 1.0


class StageAbandoned(BaseException):
    """Raised on the loop thread, at the sync gate it is parked at, when the controller abandons
    the stage there (an elastic ``fit`` goes on in a grown world from that gate): it unwinds the
    worker's Lightning loop as an interrupt does, so that the loop thread ends."""


@dataclass(frozen=True)
class _Abandon:
    """In the inbox: abandon the stage at the sync gate (:class:`StageAbandoned`)."""


@dataclass
class _OutOfBand:
    """A request the loop thread serves while parked (R5): ``fn``'s value or error, when ``done``."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: Optional[BaseException] = None


class StageLoop:
    """Runs in each worker: one Trainer stage, run ahead of the controller (R4)."""

    def __init__(
        self,
        trainer: Trainer,
        run: Callable[[], Any],
        rank: int,
        recorder: EntryRecorder,
        state: RankState,
        plan: RunAhead,
        resume: Optional[RankSnapshot] = None,
        hold: Callable[[], tuple[StorageKey, ...]] = tuple,
        post_mortem: bool = False,
    ) -> None:
        """``hold``: after a stage that ran to its end, keep its storages for the next stage and
        return their keys (``worker.storages``). ``post_mortem``: the stage's first exception opens
        pdb at the frame that raised it, before Lightning's handlers run (``worker.breakpoints``)."""
        self._trainer = trainer
        self._run = run
        self._rank = rank
        self._recorder = recorder
        self._state = state
        self._plan = plan
        #: Set while a replacement worker catches up to the snapshot (``specs.ResumePoint``).
        self._resume = resume
        self._hold = hold
        self._post_mortem = post_mortem
        self._cond = threading.Condition()
        #: Releases and out-of-band requests, in the order the controller sent them.
        self._inbox: deque[Union[Release, _OutOfBand, _Abandon]] = deque()
        #: Rank 0's entries that the controller has not fetched yet, and when the first was recorded.
        self._entries: list[Entry] = []
        self._first_entry_at = 0.0
        #: Whether the loop thread waits: parked at a sync gate, or for credit before a batch.
        self._parked = self._credit_waiting = False
        self._ended: Optional[Entry] = None
        #: Batch starts this stage (R4), and how many of them the controller has granted (taken).
        self._started = 0
        self._granted_batches = 0
        #: When the last batch started, and how long after the one before it (rank 0's fetch lingers
        #: only while batches start less than :data:`FETCH_LINGER_S` apart).
        self._batch_started_at: Optional[float] = None
        self._batch_interval = float("inf")
        #: How many of the entries not fetched yet came before the last batch start: whole batches.
        self._whole = 0
        #: Gates run this stage (the controller compares ranks with it when one seems stuck).
        self._gates = 0
        self._predictions: list[PredictionShard] = []
        self._thread: Optional[threading.Thread] = None
        self._depth = 0
        self._nested: list[tuple[str, Any]] = []
        self._gate: Optional[str] = None
        self._failed_gate: Optional[str] = None
        self._free_running = False
        #: A worker callback's trial inside the stage (``worker.trial``); asynchronous validation's side.
        self.trial = Trial(trainer, self.around)
        self.validation: Union[HandOff, ValidationServer, None] = None

    # ----- endpoint thread -------------------------------------------------------------------

    def start(self) -> None:
        """Runs on the endpoint thread: start the stage's loop thread, in a copy of the endpoint's
        context, so that what the stage sends through Monarch (a fed loader asking the controller
        for its items, ``fed.FedIterable``) goes out as this worker's actor. Without it, Monarch
        would start a second client in the worker process for the loop thread, on a transport of
        its own (a TCP one cannot bind where the host's name resolves only to loopback)."""
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._main,), name="lightning-monarch-loop", daemon=True
        )
        self._thread.start()

    def fetch(self) -> Union[bytes, RankStatus]:
        """Runs on the endpoint thread, rank 0: the entries recorded since the last fetch, as
        one message (``codec``). Waits until there is one, or the loop waits for the controller, or
        the stage ended (then the end entry comes last). Unless the controller needs what it has
        now (the loop waits for it, the stage ended, an entry carries a checkpoint state), it then
        waits for more: while batches start less than :data:`FETCH_LINGER_S` apart, until the
        first entry is that old, so that a controller that keeps pace with short steps takes
        several batches per message; with longer steps, until the batch in progress has ended (the
        next one starts) and the first entry is :data:`FETCH_SPAN_S` old, so that it takes whole
        batches, a few per message, instead of one per gate. It returns whole batches where it has
        them (what the next batch recorded meanwhile waits for the next fetch), and everything
        where the controller needs it. A batch in progress that has not ended within
        :data:`FETCH_STATUS_S` gets this rank's status as the answer, and the entries wait; so does a
        fetch that finds none in that time, which frees the endpoint for the actor's other messages."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._entries or self._stuck() or self._ended, timeout=FETCH_STATUS_S):
                return RankStatus(self._rank, self._gates)
            if self._batch_interval < FETCH_LINGER_S:
                linger = self._first_entry_at + FETCH_LINGER_S - time.monotonic()
            else:
                if not self._cond.wait_for(lambda: self._whole > 0 or self._needed_now(), timeout=FETCH_STATUS_S):
                    return RankStatus(self._rank, self._gates)
                linger = self._first_entry_at + FETCH_SPAN_S - time.monotonic()
            self._cond.wait_for(self._needed_now, timeout=linger)
            taken = len(self._entries) if self._needed_now() or not self._whole else self._whole
            entries, self._entries, self._whole = self._entries[:taken], self._entries[taken:], 0
            self._first_entry_at = time.monotonic()  # of what is left, if anything
            self._cond.notify_all()  # rank 0 may wait to stage a checkpoint state (R6)
            if self._ended is not None:
                entries.append(self._ended)
        return encode(entries)

    def _needed_now(self) -> bool:
        """Whether the controller needs the entries recorded so far at once (under the lock)."""
        staged = any(entry.checkpoint is not None for entry in self._entries)
        awaiting = isinstance(self.validation, HandOff) and self.validation.awaiting_validators
        return self._stuck() or awaiting or self._ended is not None or staged

    def _stuck(self) -> bool:
        """Whether the loop thread waits for what only the controller can send (under the lock): a release, parked
        at a sync gate; credit, before a batch. So does a validation worker awaiting weights: it records no more."""
        if self._parked:
            return not any(isinstance(item, Release) for item in self._inbox)
        credit = self._credit_waiting and self._started >= self._granted_batches + (self._plan.max_ahead or 0)
        return credit or (isinstance(self.validation, ValidationServer) and self.validation.waiting)

    def grant(self, grant: Grant) -> None:
        """Runs on the endpoint thread: the controller took ``grant.batches`` batch starts."""
        with self._cond:
            self._granted_batches = max(self._granted_batches, grant.batches)
            self._cond.notify_all()

    def release(self, release: Release) -> None:
        """Runs on the endpoint thread: leave the sync gate this rank is parked at, or will park at
        next (a rank behind the others gets it early)."""
        with self._cond:
            self._inbox.append(release)
            self._cond.notify_all()

    def abandon(self) -> None:
        """Runs on the endpoint thread: end the stage at the sync gate this rank is parked at, or
        parks at next (:class:`StageAbandoned`); nothing if it has ended."""
        with self._cond:
            if self._ended is None:
                self._inbox.append(_Abandon())
                self._cond.notify_all()

    def _abandoned(self) -> bool:
        with self._cond:
            return any(isinstance(item, _Abandon) for item in self._inbox)

    def stop_if_abandoned(self, waiting_at: str) -> None:
        """On the loop thread, waiting at ``waiting_at`` outside a gate (``worker.pdb_barrier``):
        raise :class:`StageAbandoned` if the controller abandoned the stage."""
        if self._abandoned():
            raise StageAbandoned(f"The controller abandoned the stage at {waiting_at}.")

    def out_of_band(self, fn: Callable[[], Any]) -> Any:
        """Runs on the endpoint thread: ``fn``'s value, run on the loop thread where it is parked at
        the sync gate the controller is at (R5), or here once the stage has ended."""
        request = _OutOfBand(fn)
        with self._cond:
            ended = self._ended
            if ended is None:
                self._inbox.append(request)
                self._cond.notify_all()
        if ended is not None:
            if ended.failure is not None:
                raise RuntimeError(f"The stage failed on rank {self._rank}: {ended.failure.message}")
            return fn()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.value

    def status(self) -> RankStatus:
        """Runs on the endpoint thread: how far this rank's stage got, and why it failed, if it did."""
        with self._cond:
            return RankStatus(self._rank, self._gates, self._ended.failure if self._ended is not None else None)

    def predictions(self) -> list[PredictionShard]:
        """This rank's predictions with their dataset indices, once the stage has ended."""
        self.join(timeout=None)
        return self._predictions

    @property
    def state(self) -> RankState:
        """This rank's Trainer state, for the controller's out-of-band requests."""
        return self._state

    def join(self, timeout: Optional[float]) -> bool:
        """Runs on the endpoint thread: wait for the loop thread after the stage ended; whether it ended."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    # ----- loop thread -----------------------------------------------------------------------

    def around(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Runs on the loop thread at every gated hook call (R2-R5)."""
        if self._free_running:
            return fn(*args, **kwargs)
        if self.trial.running:
            return self.trial.through(gate, fn, args, kwargs)
        if self._resume is not None:
            return self._catch_up(gate, fn, args, kwargs)
        if self._depth:
            return self._nested_call(gate, fn, args, kwargs)
        if GATES[gate].batch_start:
            self._start_batch(GATES[gate].credit)
        arrival = self._recorder.arrival()
        self._depth, self._nested, self._gate = 1, [], gate
        try:
            result = fn(*args, **kwargs)
        except BaseException as error:
            self._free_running = True
            self._examine(error)
            self._failed_gate = self._failed_gate or gate
            raise
        finally:
            self._depth = 0
        notice = self._plan.notices and gate == NOTICE_GATE and any_host_noticed(self._trainer)
        sync = notice or self._plan.syncs_at(gate, self._trainer)
        staged = not sync and self._plan.stages_state_at(gate, self._trainer)
        if staged and self._rank == 0:
            self._wait_for_staging_room()
        entry = self._recorder.entry(
            gate,
            arrival,
            self._describe(gate, result, args),
            self._nested,
            sync=sync,
            views=gate in self._plan.views,
            staged=staged,
        )
        if notice:
            entry = dataclasses.replace(entry, notice=True)
        self._gates += 1
        self.publish(entry)
        if entry.sync:
            self._park()
        return worker_side_result(gate, result)

    def _describe(self, gate: str, result: Any, args: tuple) -> Any:
        """What rank 0's entry carries of ``result`` (``worker.describe``). Every rank keeps its
        predictions, for the controller to collect in bulk at the end of the stage."""
        kind = GATES[gate].result
        if kind == "prediction":
            shard = describe_result(gate, result, self._trainer, args, self._plan)
            self._predictions.append(shard)
            # the predictions come in bulk at the stage's end; the entry carries the output only
            # where a controller callback reads it, else a stand-in that is not ``None`` (Lightning
            # warns of a ``predict_step`` that returned ``None``, as rank 0 does where it did)
            return shard.output if gate in self._plan.outputs else OMITTED
        if kind is None or self._rank != 0:
            return None
        return describe_result(gate, result, self._trainer, args, self._plan)

    def _catch_up(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A replacement worker's Lightning resumes from the snapshot's checkpoint without entries up
        to :data:`SNAPSHOT_GATE`, where it takes back the rest of the snapshot and parks, as the workers
        it replaces did; the controller then replays what it sent them since."""
        top = not self._depth
        if top and GATES[gate].batch_start:
            self._started += 1
        self._depth += 1
        try:
            result = fn(*args, **kwargs)
        finally:
            self._depth -= 1
        if top:
            self._gates += 1
        if top and gate == SNAPSHOT_GATE:
            # ``around`` calls this method only while ``_resume`` is set, and only this line clears it
            assert self._resume is not None
            self._state.resume(self._resume)
            self._resume = None
            self._park()
        return worker_side_result(gate, result)

    def _nested_call(self, gate: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._depth += 1
        try:
            result = fn(*args, **kwargs)
        except BaseException as error:
            self._examine(error)
            self._failed_gate = self._failed_gate or gate
            raise
        finally:
            self._depth -= 1
        if GATES[gate].result is not None:
            described = self._describe(gate, result, args)
            if self._rank == 0:
                self._nested.append((gate, described))
        return worker_side_result(gate, result)

    def _start_batch(self, credit: bool) -> None:
        """Before a batch starts: count it, and for a batch that takes ``credit`` (a training batch's) wait
        while this rank is ``max_ahead`` batches ahead of the last batch the controller took (R4)."""
        limit = self._plan.max_ahead
        with self._cond:
            if limit and credit:
                self._credit_waiting = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._started < self._granted_batches + limit)
                self._credit_waiting = False
            self._started += 1
            now = time.monotonic()
            if self._batch_started_at is not None:
                self._batch_interval = now - self._batch_started_at
            self._batch_started_at = now
            self._whole = len(self._entries)
            self._cond.notify_all()

    def _wait_for_staging_room(self) -> None:
        """Rank 0, before it copies its checkpoint state into an entry: wait while
        :data:`MAX_STAGED_STATES` copies are not fetched yet (R6)."""
        with self._cond:
            self._cond.wait_for(
                lambda: sum(entry.checkpoint is not None for entry in self._entries) < MAX_STAGED_STATES
            )

    def publish(self, entry: Entry) -> None:
        """Rank 0: hand ``entry`` to the endpoint thread, with the warnings this process showed since
        the last one, for the controller to show where its loop takes the entry. The other ranks
        keep theirs until the stage ends."""
        if self._rank != 0:
            return
        shown = HELD.take()
        if shown:
            entry = dataclasses.replace(entry, warnings=shown)
        with self._cond:
            if not self._entries:
                self._first_entry_at = time.monotonic()
            self._entries.append(entry)
            self._cond.notify_all()

    def _park(self) -> None:
        """After a sync gate: serve the controller's out-of-band requests until it releases this
        rank, then apply the control state it changed (R5)."""
        with self._cond:
            self._parked = True
            self._cond.notify_all()
            while True:
                self._cond.wait_for(lambda: bool(self._inbox))
                item = self._inbox.popleft()
                if isinstance(item, Release):
                    break
                if isinstance(item, _Abandon):
                    self._parked = False
                    raise StageAbandoned(f"The controller abandoned the stage at `{self._gate}`.")
                self._cond.release()
                try:
                    item.value = item.fn()
                except Exception as error:  # handed to the endpoint thread, which raises it
                    item.error = error
                finally:
                    self._cond.acquire()
                    item.done.set()
            self._parked = False
        set_control_state(self._trainer, item.control)
        if item.plan is not None:
            self._plan = item.plan

    def _examine(self, error: BaseException) -> None:
        """With ``post_mortem``, pdb at the frame that raised ``error``, the stage's first exception,
        unless the controller abandons the stage (a peer's pdb quit, and its group with it)."""
        if self._post_mortem and isinstance(error, Exception) and not self._abandoned():
            self._post_mortem = False
            post_mortem(error)

    def _main(self) -> None:
        try:
            self._run()
            end = dataclasses.replace(self._recorder.end(), held=self._hold(), tuner_exit=self.trial.tuner_exit)
        except BaseException as error:
            self._free_running = True
            self._examine(error)
            failure = WorkerFailure.capture(error, self._rank, self._failed_gate, memory_in_use_mib(), self._gate)
            if self._rank == 0 and self._plan.saves_on_exception:  # what ``OnExceptionCheckpoint`` writes
                failure = dataclasses.replace(failure, checkpoint=self._state.failure_state())
            end = Entry(None, failure=failure)
        else:
            if any(isinstance(item, Release) for item in self._inbox):
                divergence = DivergenceError(
                    f"Worker rank {self._rank} finished the stage while the controller still had it parked at a"
                    " sync gate: the two Lightning loops diverged."
                )
                end = Entry(
                    None, failure=WorkerFailure.capture(divergence, self._rank, self._gate, memory_in_use_mib())
                )
        if self._rank == 0:
            end = dataclasses.replace(end, warnings=HELD.take())
        with self._cond:
            self._ended = end
            # requests for the end of the stage that came while this rank was finishing it (R5)
            requests = [item for item in self._inbox if isinstance(item, _OutOfBand)]
            self._inbox.clear()
            self._cond.notify_all()
        for request in requests:
            try:
                if end.failure is not None:
                    raise RuntimeError(f"The stage failed on rank {self._rank}: {end.failure.message}")
                request.value = request.fn()
            except Exception as error:  # handed to the endpoint thread, which raises it
                request.error = error
            request.done.set()
