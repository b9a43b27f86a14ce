"""The JobScheduler: runs each batch's output jobs on Spark, in batch order, one batch at a time.

Per batch: instantiate the template from the outputs (BFS, each stream once); run every
reachable keyed operator (its state moves exactly once per batch, whatever the outputs do);
then, per output:

* without checkpointing: *stage* (Spark jobs in a job group named after pipeline and batch),
  then *commit* every output keyed by the batch id, then record the batch in ``commits/``;
  outputs a previous driver already committed for the batch are skipped;
* with checkpointing: two-phase outputs *stage* the batch as a piece of their open transaction;
  nothing is committed here. After the batch the scheduler publishes its boundary to the
  coordinator (source positions and state handles after the batch, all immutable); a checkpoint
  triggered while the next batch runs places its barrier there at once.

Threads and owners: this thread (``spark-ckpt-scheduler-<pipeline>``) owns the batch run, the
stateful operators' runtime state (:class:`~spark_ckpt.streaming.runtime.operators.
OperatorStates`, whose snapshots it publishes), the ``commits/`` log's records (it is their
only writer; the pipeline loop purges old ones through the log's lock) and the running batch's
job group (guarded by ``_lock``: the loop cancels it). It never sees the StreamingContext: it
is given its collaborators (the template's graph, the recorded inputs, the operators' state,
the sinks' transactions, the commit log it appends to, the checkpoint trigger, the fence, the
session and the clock). It takes batches from the :class:`BatchQueue` and reports only by
posting events to the pipeline loop (a batch started, completed with its in-flight slot, or
failed; the available-now end; its thread ended) and boundaries to the coordinator (and, for
a final checkpoint, by waiting on a future). A graceful stop's request comes through a
``threading.Event``; the final checkpoint's outcome (``final``, ``final_error``,
``final_taken``) is written by this thread before it ends and read by the loop after
``join()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from spark_ckpt.checkpoint.pending import Boundary, TaskAck
from spark_ckpt.errors import CheckpointError, CommitError
from spark_ckpt.faults import fault_point
from spark_ckpt.sparkapi import spark_api
from spark_ckpt.streaming.runtime.batch_queue import FINISH, STOP, BatchQueue, QueuedBatch
from spark_ckpt.streaming.runtime.pipeline_loop import (
    BatchCompleted,
    BatchFailed,
    BatchStarted,
    Finished,
    SchedulerExited,
)
from spark_ckpt.streaming.template.batch_run import BatchAllocation, BatchInputs, BatchRun

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pyspark.sql import SparkSession

    from spark_ckpt.clock import Clock
    from spark_ckpt.sinks.two_phase import SinkTransactions
    from spark_ckpt.streaming.runtime.operators import OperatorStates
    from spark_ckpt.streaming.template.stream_graph import StreamGraph

__all__ = ["CheckpointTrigger", "CommitLog", "JobScheduler", "LatestCheckpoint"]

log = logging.getLogger(__name__)


class CommitLog(Protocol):
    """The ``commits/`` log as the scheduler writes it (one record per batch)."""

    def add(self, batch_id: int, body: dict[str, Any]) -> bool:
        """Record ``batch_id`` if no record exists."""

    def put(self, batch_id: int, body: dict[str, Any]) -> None:
        """Record ``batch_id``, replacing an earlier record."""


class CheckpointTrigger(Protocol):
    """The checkpoint coordinator as the scheduler uses it: boundaries in, a final checkpoint
    out (all calls post to the coordinator's own loop)."""

    @property
    def latest_completed(self) -> tuple[int, int] | None: ...

    def publish_boundary(self, boundary: Boundary) -> None: ...

    def trigger_now(self) -> Future[int]: ...

    def completion(self, checkpoint_id: int) -> Future[str]: ...


class LatestCheckpoint(Protocol):
    """The checkpoint history as the scheduler reads it (its newest entry)."""

    def last(self) -> dict[str, Any] | None: ...


class JobScheduler:
    def __init__(self, pipeline: str, *, session: SparkSession, owner_tag: str,
                 graph: StreamGraph, inputs: BatchInputs, sources: Sequence[str],
                 operators: OperatorStates | None, transactions: Mapping[str, SinkTransactions],
                 skip_output_through: Mapping[str, int], commits: CommitLog,
                 coordinator: CheckpointTrigger | None, fence: Callable[[], None],
                 batches: BatchQueue, checkpoints: LatestCheckpoint, post: Callable[[Any], None],
                 clock: Clock, final_checkpoint_bound_s: float,
                 restored_barrier: int | None = None) -> None:
        self.pipeline = pipeline
        self._spark = session
        self._owner_tag = owner_tag  # tags every Spark operation of this run (Spark Connect)
        self._graph = graph
        self._inputs = inputs
        self._sources = tuple(sources)
        self._operators = operators
        self._transactions = transactions
        self._skip = skip_output_through
        self._commits = commits
        self._coordinator = coordinator
        self._fence = fence
        self.batches = batches
        self._checkpoints = checkpoints
        self._post = post
        self._clock = clock
        self._final_bound_s = final_checkpoint_bound_s
        self.thread = threading.Thread(target=self._loop,
                                       name=f"spark-ckpt-scheduler-{pipeline}", daemon=True)
        self._lock = threading.Lock()  # guards _running_group (the loop cancels it)
        self._running_group: str | None = None  # cancelled by stop(graceful=False)
        self._graceful = threading.Event()  # stop(graceful=True): a final checkpoint first
        # a graceful stop's final checkpoint (id, barrier batch; None: no checkpoints), or
        # the error that kept it from completing: written by this thread before it ends, read
        # by the loop after join()
        self.final: tuple[int | None, int | None] = (None, None)
        self.final_error: BaseException | None = None
        self.final_taken = False  # the final checkpoint ran to its end (or none is taken)
        self._last_start: float | None = None
        self._stopping = threading.Event()
        # the batch the next barrier goes after; -1: before the first batch (empty state)
        self.last_batch: int = restored_barrier if restored_barrier is not None else -1

    @property
    def graceful(self) -> bool:
        """Whether a stop takes a final checkpoint first (an Event: the loop sets it)."""
        return self._graceful.is_set()

    @graceful.setter
    def graceful(self, value: bool) -> None:
        if value:
            self._graceful.set()
        else:
            self._graceful.clear()

    @property
    def running_group(self) -> str | None:
        with self._lock:
            return self._running_group

    def start(self) -> None:
        self._publish_boundary(self.last_batch)  # where a barrier goes before the first batch
        if self._operators is not None:
            self._operators.hand_over(self.thread)
        self.thread.start()

    def started(self) -> bool:
        return self.thread.ident is not None

    def join(self) -> None:
        if self.started() and threading.current_thread() is not self.thread:
            self.thread.join()

    def stop(self, *, drain: bool = False) -> None:
        """Stop after the running batch; with ``drain``, after every batch already queued."""
        if not drain:
            self._stopping.set()
        self.batches.put_control(STOP)

    def cancel_running(self) -> None:
        """Cancel the running batch's Spark jobs (any thread); it fails and reruns on restart."""
        group = self.running_group
        if group:
            try:
                spark_api(self._spark).cancel_group(group)
            except Exception as exc:  # noqa: BLE001 - the stop goes on after the batch
                log.warning("Pipeline %s: could not cancel the running batch (%s): %s",
                            self.pipeline, group, exc)

    def _loop(self) -> None:
        try:
            self._run_queue()
        finally:
            self._post(SchedulerExited())

    def _run_queue(self) -> None:
        while True:
            item = self.batches.take()
            if item == FINISH:
                try:
                    self.final = self.final_checkpoint()
                    self.final_taken = True
                except BaseException as exc:  # noqa: BLE001 - handed to await_termination
                    self._post(BatchFailed(self.last_batch, exc))
                    return
                self._post(Finished())
                return
            if item == STOP or self._stopping.is_set():
                if self.graceful:
                    try:
                        self.final = self.final_checkpoint()
                        self.final_taken = True
                    except Exception as exc:  # noqa: BLE001 - a stop still stops
                        self.final_error = exc
                        log.warning("Pipeline %s: final checkpoint on stop failed: %s",
                                    self.pipeline, exc)
                return
            assert isinstance(item, QueuedBatch)
            try:
                progress = self.run_batch(item.allocation, item.recovered, item.allocation_ms)
            except BaseException as exc:  # noqa: BLE001 - handed to await_termination
                self._post(BatchFailed(item.allocation.batch_id, exc, item.holds_slot))
                return
            self._post(BatchCompleted(progress, item.holds_slot))

    # -- checkpoints ---------------------------------------------------------------------
    def _publish_boundary(self, batch_id: int) -> None:
        """The cut after ``batch_id`` (-1: before the first batch), for the coordinator."""
        coordinator = self._coordinator
        if coordinator is None:
            return
        allocation = self._inputs.allocation(batch_id) if batch_id >= 0 else None
        acks = []
        for name in self._sources:
            piece = allocation.pieces.get(name) if allocation is not None else None
            acks.append(TaskAck(f"source:{name}", {"batch": batch_id, "piece": piece}))
        if self._operators is not None:
            acks.extend(self._operators.acks(batch_id))
        coordinator.publish_boundary(Boundary(batch_id, tuple(acks), tuple(self._transactions)))

    def final_checkpoint(self) -> tuple[int | None, int | None]:
        """A checkpoint after the last batch, waited for (available-now end, graceful stop);
        its id and barrier batch (the latest completed one's if nothing happened since; None
        without checkpoints)."""
        coordinator = self._coordinator
        if coordinator is None:
            return None, None
        latest = coordinator.latest_completed  # (id, barrier batch), replaced whole
        if latest is not None and latest[1] == self.last_batch and \
                not any(t.open or t.pending for t in self._transactions.values()):
            return latest  # nothing happened since the last checkpoint
        # The coordinator aborts a checkpoint past its timeout and so resolves the future; the
        # bound here only guards against a coordinator that is stuck (a sink's commit of an
        # earlier checkpoint can hold its thread longer than one checkpoint's timeout).
        bound = self._final_bound_s
        cid = coordinator.trigger_now().result(timeout=bound)  # placed after self.last_batch
        outcome = coordinator.completion(cid).result(timeout=bound)
        if outcome != "completed":
            raise CheckpointError(f"pipeline {self.pipeline}: final checkpoint {cid} {outcome}")
        left = {name: [c for c in sorted(t.pending) if c <= cid]
                for name, t in self._transactions.items()}
        left = {name: ids for name, ids in left.items() if ids}
        if left:
            raise CommitError(
                f"pipeline {self.pipeline}: final checkpoint {cid} completed but outputs {left} "
                "did not commit (see the warnings); they commit on the next start"
            )
        return cid, self.last_batch

    # -- one batch -----------------------------------------------------------------------
    def run_batch(self, allocation: BatchAllocation, recovered: bool,
                  allocation_ms: int = 0) -> dict[str, Any]:
        name_ = self.pipeline
        b = allocation.batch_id
        started = self._clock.monotonic_s()
        wall_start = self._clock.now_ms() / 1000
        since_last = (started - self._last_start) if self._last_start is not None else None
        self._last_start = started
        run = BatchRun(self._inputs, allocation, operators=self._operators)
        api = spark_api(self._spark)
        scope = contextlib.ExitStack()  # the batch's job group, closed in the finally below
        group = f"spark_ckpt-{name_}-b{b}"
        with self._lock:
            self._running_group = group
        durations: dict[str, float] = {}
        outputs: dict[str, Any] = {}
        staged: dict[str, Any] = {}
        self._post(BatchStarted({
            "pipeline": name_, "batch_id": b, "batch_time_ms": allocation.batch_time_ms,
            "recovered": recovered}))
        try:
            scope.enter_context(api.job_group(group, f"spark_ckpt pipeline {name_} batch {b}",
                                              owner=self._owner_tag or None))
            t0 = self._clock.monotonic_s()
            reachable = {s.id for s in self._graph.reachable()}
            for op in self._graph.stateful:  # state moves once per batch, whatever outputs skip
                if op.id in reachable:
                    run.get_or_compute(op)
            durations["state"] = _ms(self._clock.monotonic_s() - t0)
            planning = 0.0
            for output in self._graph.outputs:
                name = output.output_name
                txns = self._transactions.get(name)
                if txns is None and output.sink is not None:
                    sink = output.sink
                    if sink.is_committed(b):
                        outputs[name] = {"skipped": "already committed"}
                        continue
                    finished = sink.finish_pending(b)
                    if finished is not None:
                        outputs[name] = {"finished_pending_commit": True, **finished}
                        continue
                elif b <= self._skip.get(name, -1):
                    outputs[name] = {"skipped": "already visible (committed before a restore)"}
                    continue
                elif txns is not None and name in run.chained:  # staged by the state tasks
                    piece = run.chained[name]
                    txns.staged(b, piece)
                    outputs[name] = {"staged_files": len(piece["files"]) if piece else 0,
                                     "chained": True}
                    continue
                t0 = self._clock.monotonic_s()
                df = run.get_or_compute(output)
                if df is None:
                    outputs[name] = {"skipped": "no batch (window slide)"}
                    continue
                target = txns.sink if txns is not None else output.sink
                target.prepare(df)
                t1 = self._clock.monotonic_s()
                planning += t1 - t0
                api.describe(f"spark_ckpt pipeline {name_} batch {b} output {name}")
                if txns is not None:
                    piece = txns.sink.write(df, b)
                    txns.staged(b, piece)
                    outputs[name] = {"staged_files": len(piece["files"]) if piece else 0}
                else:
                    staged[name] = output.sink.stage(df, b)
                durations[f"output.{name}"] = _ms(self._clock.monotonic_s() - t1)
            durations["planning"] = _ms(planning)
            t0 = self._clock.monotonic_s()
            run.finish_reads()  # rows counted, malformed rows to the dead-letter table
            durations["reads"] = _ms(self._clock.monotonic_s() - t0)
            fault_point("stream.batch.staged")
            t0 = self._clock.monotonic_s()
            for output in self._graph.outputs:
                name = output.output_name
                if name in staged:
                    # before each commit, not once per batch: a driver that stalled after its
                    # first output's commit must not commit the next once a newer one owns
                    # the checkpoint (that one may have purged this batch's commit marker)
                    self._fence()
                    outputs[name] = output.sink.commit(b, staged[name]) or {}
                    fault_point("stream.output.committed")
            record = {"outputs": {k: _jsonable(v) for k, v in outputs.items()},
                      "finished_ms": self._clock.now_ms(),
                      # staged for a checkpoint's two-phase commit, not yet visible: a start
                      # without checkpoints must not take the batch as done
                      "two_phase": self._coordinator is not None}
            self._fence()  # and before the commit record (replaced in checkpoint mode)
            if self._coordinator is not None:  # replays after a restore record the batch again
                self._commits.put(b, record)
            else:
                self._commits.add(b, record)
            durations["commit"] = _ms(self._clock.monotonic_s() - t0)
            fault_point("stream.batch.committed")
        finally:
            with self._lock:
                self._running_group = None
            scope.close()
            run.cleanup()
        self.last_batch = b
        self._publish_boundary(b)
        total = self._clock.monotonic_s() - started
        durations["total"] = _ms(total)
        durations["allocation"] = allocation_ms
        rows = run.stats.input_rows
        known = [r for r in rows.values() if r is not None]
        num_rows = sum(known) if len(known) == len(rows) else None
        latest = self._checkpoints.last()
        progress = {
            "pipeline": name_,
            "batch_id": b,
            "batch_time_ms": allocation.batch_time_ms,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall_start)) +
            f".{int(wall_start * 1000) % 1000:03d}Z",
            "recovered": recovered,
            "num_input_rows": num_rows,
            "input_rows_per_second": (num_rows / since_last if num_rows is not None and
                                      since_last else None),
            "processed_rows_per_second": num_rows / total if num_rows is not None and total
            else None,
            "sources": {name: {"input_rows": rows.get(name),
                               "dead_letter_rows": run.stats.dead_letters.get(name, 0)}
                        for name in self._sources},
            "streams_computed": list(run.stats.computed),
            "state": _jsonable(run.stats.state),
            "checkpoint": None if latest is None else {
                k: latest.get(k) for k in ("checkpoint_id", "status", "barrier_batch",
                                           "duration_ms", "full_bytes", "incremental_bytes")},
            "durations_ms": durations,
            "outputs": {k: _jsonable(v) for k, v in outputs.items()},
        }
        return progress  # housekeeping (the loop's) can only warn: b is committed


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)
