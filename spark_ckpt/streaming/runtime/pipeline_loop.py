"""The pipeline's event loop: the one owner of a running pipeline's mutable state.

As Spark Streaming's JobGenerator runs an event loop that generates each batch's jobs, clears
old metadata after a batch completes and takes the driver's checkpoints, and as Flink's
CheckpointCoordinator runs everything on one main-thread executor, a running pipeline has one
thread that decides. It owns, and only it touches:

* the clock's schedule: when the next batch is due, and the next batch id (the
  :class:`~spark_ckpt.streaming.runtime.job_generator.JobGenerator`'s five steps run here);
* the in-flight bound: batches the generator allocated that are not done yet
  (``spark.ckpt.stream.maxBatchesInFlight``; batches a restart found allocated hold none);
* allocations: recorded (the generator's step 1) and purged after commits, both here, so the
  :class:`~spark_ckpt.streaming.runtime.allocations.AllocationStore` has one writer;
* the progress history (written here; readers on other threads get immutable snapshots; the
  checkpoint history's one writer is the coordinator's thread), the progress log, the
  listeners' calls, and the purge of old records (``commits/`` is the JobScheduler's to write:
  its log's lock serializes the purge with it);
* failures and stop: the pipeline's outcome (the first one wins) and its shutdown; a stop's
  "take a final checkpoint" reaches the scheduler through a ``threading.Event`` (its
  ``graceful``), never a bare attribute;
* stop requests from outside (``spark-ckpt stop``): looked for on the loop's clock, taken as
  a graceful stop, answered with the final checkpoint once the pipeline's threads ended
  (:mod:`spark_ckpt.streaming.runtime.stop_control`).

Every other thread only *posts* events: the JobScheduler (a batch completed or failed, the
available-now end, its thread ended), the CheckpointCoordinator (a checkpoint's statistics, a
failure), ``start()`` and the user's ``stop()``. Posting never blocks, so no thread waits on
another while holding something it needs. Time comes from an injected
:class:`~spark_ckpt.clock.Clock`: with a manual clock the loop wakes when a test advances it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol

from spark_ckpt.clock import SystemClock
from spark_ckpt.faults import fault_point
from spark_ckpt.streaming.runtime.batch_queue import FINISH

if TYPE_CHECKING:
    from spark_ckpt.clock import Clock
    from spark_ckpt.streaming.runtime.batch_queue import BatchQueue
    from spark_ckpt.streaming.runtime.job_generator import JobGenerator
    from spark_ckpt.streaming.runtime.lifecycle import Lifecycle
    from spark_ckpt.streaming.runtime.stop_control import StopControl, StopRequest

__all__ = ["BatchCompleted", "BatchFailed", "BatchStarted", "CheckpointFailed", "CheckpointStats",
           "Finished", "PipelineLoop", "SchedulerExited", "StartFailed", "StopRequested"]

log = logging.getLogger(__name__)


# -- events ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BatchStarted:
    """The scheduler starts a batch (``info`` for the listeners)."""
    info: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class BatchCompleted:
    """The scheduler committed a batch (``progress``); ``holds_slot``: an in-flight slot is
    given back."""
    progress: dict[str, Any]
    holds_slot: bool


@dataclasses.dataclass(frozen=True)
class BatchFailed:
    """A batch failed (the scheduler), or (``drain``) the next one could not be allocated."""
    batch_id: int
    error: BaseException
    holds_slot: bool = False
    drain: bool = False


@dataclasses.dataclass(frozen=True)
class Finished:
    """The available-now end: every batch ran and the final checkpoint completed."""


@dataclasses.dataclass(frozen=True)
class SchedulerExited:
    """The scheduler's thread ended: no batch of this pipeline can commit any more."""


@dataclasses.dataclass(frozen=True)
class CheckpointStats:
    """A checkpoint ended (the coordinator recorded it in the history): tell the listeners."""
    stats: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class CheckpointFailed:
    error: BaseException


@dataclasses.dataclass(frozen=True)
class StartFailed:
    """``start()`` failed after the pipeline's threads began to start."""
    error: BaseException


@dataclasses.dataclass(frozen=True)
class StopRequested:
    """The user's ``stop()``: ``graceful`` takes a final checkpoint after the running batch;
    ``cancel`` cancels the running batch (it reruns on restart)."""
    graceful: bool
    cancel: bool


class _Wake:
    """The clock moved (a manual clock advanced): look at the schedule again."""


class SchedulerControl(Protocol):
    """What the loop does to the JobScheduler (its thread runs the batches)."""

    graceful: bool  # the JobScheduler keeps it in a threading.Event
    # after a graceful stop: the final checkpoint (id, barrier batch; None: no checkpoints),
    # or the error that kept it from completing; written by the scheduler's thread before it
    # ends, read here only after join()
    final: tuple[int | None, int | None]
    final_error: BaseException | None
    final_taken: bool

    def stop(self, *, drain: bool = False) -> None: ...

    def cancel_running(self) -> None: ...

    def started(self) -> bool: ...

    def join(self) -> None: ...


class Housekeeping(Protocol):
    """The pipeline's records the loop keeps after each committed batch and checkpoint."""

    def batch_started(self, info: dict[str, Any]) -> None: ...

    def batch_completed(self, progress: dict[str, Any]) -> None:
        """History, progress line, listeners, purge of old records (failures are warnings)."""

    def checkpoint_stats(self, stats: dict[str, Any]) -> None:
        """Tell the listeners."""

    def failure(self, batch_id: int, error: BaseException, *, drain: bool) -> BaseException:
        """The pipeline's error for a failed batch (fencing reported as such)."""

    def checkpoint_failure(self, error: BaseException) -> BaseException: ...

    def shutdown(self, error: BaseException | None) -> None:
        """Stop the receivers and the coordinator, tell the listeners (no batch can commit)."""


class PipelineLoop:
    def __init__(self, pipeline: str, *, lifecycle: Lifecycle, generator: JobGenerator,
                 batches: BatchQueue, scheduler: SchedulerControl, housekeeping: Housekeeping,
                 clock: Clock, max_in_flight: int,
                 available_now: bool, stop_control: StopControl | None = None,
                 stop_poll_ms: int = 1000, recovered: int = 0) -> None:
        self.pipeline = pipeline
        self._lifecycle = lifecycle
        self._generator = generator
        self._batches = batches
        self._scheduler = scheduler
        self._housekeeping = housekeeping
        self._clock = clock
        self._max_in_flight = max(1, max_in_flight)
        self._available_now = available_now
        self._control = stop_control
        self._poll_ms = stop_poll_ms
        self._events: queue.Queue[Any] = queue.Queue()
        # -- owned by the loop's thread ---------------------------------------------------
        self._ticking = False  # batches are generated (from the first tick until a stop)
        self._next_ms = 0  # when the next batch is due
        self._in_flight = 0  # batches the generator allocated that are not done
        self._cancelled = False  # the user's stop cancelled the running batch
        self._next_poll_ms = 0  # when to look for stop requests next
        # available-now, no input left: waiting for the running batches to say whether event
        # time moved (a no-data batch) before finishing
        self._awaiting_time = False
        # batches recovered at start (queued without a slot) that have not finished: they
        # may move event time too
        self._recovered = recovered
        self._external: StopRequest | None = None  # the stop request this run took
        # -- read by other threads --------------------------------------------------------
        self.stopping = threading.Event()  # a stop or a failure was handled: no new batches
        self.thread = threading.Thread(target=self._run, name=f"spark-ckpt-pipeline-{pipeline}",
                                       daemon=True)
        clock.on_advance(lambda: self._events.put(_Wake()))

    # -- any thread ---------------------------------------------------------------------------
    def post(self, event: Any) -> None:
        self._events.put(event)

    def start(self) -> None:
        self.thread.start()

    @property
    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        self._ticking = True
        self._next_ms = self._clock.now_ms()
        try:
            while True:
                event = self._next_event()
                if isinstance(event, SchedulerExited):
                    break
                if event is not None:
                    self._handle(event)
                if self._ticking:
                    self._poll_stop_requests()
                if self._ticking:
                    self._generate_if_due()
        except BaseException as exc:  # a bug here must still end the pipeline
            log.exception("Pipeline %s: the pipeline loop failed", self.pipeline)
            self._finish(exc)
            self._drain_until_scheduler_exits()
        self._end()

    def _next_event(self) -> Any:
        timeout: float | None = None
        if self._ticking and self._in_flight < self._max_in_flight and not self._awaiting_time:
            if self._available_now:
                timeout = 0
            else:
                timeout = max(0.0, (self._next_ms - self._clock.now_ms()) / 1000)
                if not isinstance(self._clock, SystemClock):  # it may jump: look again soon
                    timeout = min(timeout, 0.5)
        timeout = self._poll_timeout(timeout)
        try:
            if timeout == 0:
                return self._events.get_nowait()
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def _poll_timeout(self, timeout: float | None) -> float | None:
        if self._control is None or not self._ticking:
            return timeout
        until = max(0.0, (self._next_poll_ms - self._clock.now_ms()) / 1000)
        return until if timeout is None else min(timeout, until)

    def _poll_stop_requests(self) -> None:
        """Take a stop request for this run if one came (``spark-ckpt stop``): a graceful
        stop. A failure to look is a warning: the pipeline runs on and looks again."""
        now = self._clock.now_ms()
        if self._control is None or now < self._next_poll_ms:
            return
        self._next_poll_ms = now + self._poll_ms
        try:
            request = self._control.poll(now)
        except Exception as exc:  # noqa: BLE001 - a stop request is never worth a failure
            log.warning("Pipeline %s: looking for stop requests failed (looked for again in "
                        "%d ms): %s", self.pipeline, self._poll_ms, exc)
            return
        if request is None:
            return
        log.info("Pipeline %s run %d: stop requested from outside (request %s): finishing the "
                 "running batch, then a final checkpoint", self.pipeline, request.run,
                 request.request_id)
        fault_point("stream.stop.requested")
        self._external = request
        self._lifecycle.request_stop()
        self._stop(StopRequested(graceful=True, cancel=False))

    def _answer_stop_request(self) -> None:
        """After the pipeline's threads ended: tell the client that asked how it stopped."""
        request, control = self._external, self._control
        if request is None or control is None:
            return
        error = self._lifecycle.error
        checkpoint, barrier = self._scheduler.final
        if error is not None:
            status, message = "failed", f"the pipeline failed while stopping: {error}"
        elif self._scheduler.final_error is not None:
            status, message = "failed", (f"the final checkpoint did not complete: "
                                         f"{self._scheduler.final_error}; the batches it ran "
                                         "restart from the previous checkpoint")
        elif not self._scheduler.final_taken:
            status, message = "failed", ("stopped without a final checkpoint (a stop that "
                                         "cancels came after this request); the batches it "
                                         "ran restart from the previous checkpoint")
        elif checkpoint is None:
            status, message = "stopped", ("stopped; this pipeline takes no checkpoints (every "
                                          "batch it ran is committed)")
        else:
            status, message = "stopped", (f"stopped after batch {barrier} with checkpoint "
                                          f"{checkpoint}; restore it by id with "
                                          f"spark.ckpt.checkpoint.restoreFrom={checkpoint}")
        fault_point("stream.stop.checkpointed")
        try:
            control.answer(request, status, checkpoint if status == "stopped" else None,
                           barrier if status == "stopped" else None, message,
                           self._clock.now_ms())
        except Exception as exc:  # noqa: BLE001 - the stop itself happened
            log.error("Pipeline %s: stopped, but answering stop request %s failed: %s",
                      self.pipeline, request.request_id, exc)
            return
        fault_point("stream.stop.answered")

    def _handle(self, event: Any) -> None:
        if isinstance(event, BatchStarted):
            self._housekeeping.batch_started(event.info)
        elif isinstance(event, BatchCompleted):
            self._awaiting_time = False
            if event.holds_slot:
                self._in_flight -= 1
            else:
                self._recovered = max(0, self._recovered - 1)
            self._housekeeping.batch_completed(event.progress)
        elif isinstance(event, BatchFailed):
            self._awaiting_time = False
            if event.holds_slot:
                self._in_flight -= 1
            else:
                self._recovered = max(0, self._recovered - 1)
            if self._cancelled:  # stop(graceful=False) cancelled it: no failure
                return
            self._finish(self._housekeeping.failure(event.batch_id, event.error,
                                                    drain=event.drain), drain=event.drain)
        elif isinstance(event, CheckpointStats):
            self._housekeeping.checkpoint_stats(event.stats)
        elif isinstance(event, CheckpointFailed):
            error = self._housekeeping.checkpoint_failure(event.error)
            log.error("%s", error)
            self._finish(error)
        elif isinstance(event, Finished):
            self._finish(None)
        elif isinstance(event, StartFailed):  # start() recorded the outcome before the loop ran
            self._ticking = False
            self.stopping.set()
            self._lifecycle.finish(event.error)
            self._stop_scheduler(drain=False)
        elif isinstance(event, StopRequested):
            self._stop(event)

    def _generate_if_due(self) -> None:
        """One batch (the generator's steps) if it is due and a slot is free."""
        if self._in_flight >= self._max_in_flight or self._awaiting_time:
            return  # (awaiting: a running batch's completion says whether time moved)
        if not self._available_now and self._clock.now_ms() < self._next_ms:
            return
        generator = self._generator
        try:
            queued = generator.generate(self._next_ms)
            if queued is None and generator.time_moved is not None:
                if self._in_flight or self._recovered:  # running batches may move event
                    # time: ask after they finish
                    self._awaiting_time = self._available_now
                    if self._available_now:
                        return
                elif generator.time_moved(None if self._available_now else self._next_ms):
                    queued = generator.generate(self._next_ms, no_data=True)
        except BaseException as exc:  # noqa: BLE001 - the batches already allocated run first
            self._handle(BatchFailed(generator.next_batch, exc, drain=True))
            return
        if queued is not None:
            self._in_flight += 1
        elif self._available_now:  # the scheduler finishes after the batches queued
            self._ticking = False
            self._batches.put_control(FINISH)
            return
        self._next_ms = generator.next_tick(self._next_ms)

    def _stop(self, event: StopRequested) -> None:
        self._ticking = False
        self.stopping.set()
        self._scheduler.graceful = event.graceful
        if event.cancel:
            self._cancelled = True
            self._scheduler.cancel_running()
        self._stop_scheduler(drain=False)

    def _finish(self, error: BaseException | None, *, drain: bool = False) -> None:
        """The pipeline's outcome (the first one wins): no new batches; the scheduler leaves
        after the running batch (``drain``: after every batch already queued)."""
        self._ticking = False
        self.stopping.set()
        if self._lifecycle.finish(error):
            self._stop_scheduler(drain=drain)

    def _stop_scheduler(self, *, drain: bool) -> None:
        if self._scheduler.started():
            self._scheduler.stop(drain=drain)
        else:  # start() failed before the scheduler ran: nothing to wait for
            self._events.put(SchedulerExited())

    def _drain_until_scheduler_exits(self) -> None:
        if not self._scheduler.started():
            return
        while True:
            event = self._events.get()
            if isinstance(event, SchedulerExited):
                return
            try:
                if isinstance(event, BatchCompleted):  # committed: keep its records
                    self._housekeeping.batch_completed(event.progress)
            except Exception:  # the loop already failed; keep draining
                log.exception("Pipeline %s: housekeeping after a loop failure failed",
                              self.pipeline)

    def _end(self) -> None:
        """The scheduler's thread ended (or never started): shut the rest down, terminate."""
        try:
            self._scheduler.join()
            self._handle_queued()  # a checkpoint failure posted meanwhile still decides
            self._finish(None)  # a plain stop's outcome; a no-op after a failure
            self._housekeeping.shutdown(self._lifecycle.error)  # joins the coordinator
            self._handle_queued()  # checkpoints that ended during the shutdown
            self._answer_stop_request()
        finally:
            self._finish(None)
            self._record_end()
            self._lifecycle.terminate()

    def _record_end(self) -> None:
        if self._control is None:
            return
        error = self._lifecycle.error
        checkpoint, barrier = self._scheduler.final if self._scheduler.final_taken and \
            self._scheduler.final_error is None else (None, None)
        self._control.record_end("failed" if error is not None else "stopped",
                                 "" if error is None else f"{type(error).__name__}: {error}",
                                 checkpoint, barrier, self._clock.now_ms())

    def _handle_queued(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, CheckpointStats | CheckpointFailed | BatchCompleted):
                self._handle(event)
