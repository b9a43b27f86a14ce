"""The CheckpointCoordinator (seeds 000/001): triggers checkpoints on its own clock, collects
acknowledgements, completes, retains and notifies.

Threads. The coordinator's mutable state (pending checkpoints, the completed store, the shared
registry, the failure count) has one owner: the coordinator's event-loop thread. Other threads
only *post* events (acknowledge, decline, place_barrier, stop) or take triggered checkpoint ids
from :attr:`barriers`, a queue. Time comes from an injectable :class:`~spark_ckpt.clock.Clock`;
with a manual clock the loop wakes whenever a test advances it, so tests wait on events.

The protocol in the micro-batch runtime:

1. *Boundary* (the JobScheduler's thread): when a batch ends, the scheduler publishes its
   :class:`~spark_ckpt.checkpoint.pending.Boundary` (:meth:`publish_boundary`): each source's
   position and each stateful task's state handle after the batch, all durable and immutable.
2. *Trigger and barrier* (this thread): every ``interval`` (respecting the minimum pause after
   the previous checkpoint ended and the maximum of concurrent checkpoints) a PendingCheckpoint
   ``n`` is created and its barrier placed at once at the latest boundary, naming every task
   that must acknowledge; the boundary's acknowledgements are received and each two-phase sink
   pre-commits the pieces it staged up to that batch (``pre_commit``). The batch running now
   is not waited for: after a restore it is replayed from the sources, as the in-flight records
   an unaligned Flink barrier overtakes. So a checkpoint's duration does not grow with the
   batch's. (Without ``pre_commit``, the coordinator only puts ``n`` on :attr:`barriers` and an
   external placer calls :meth:`place_barrier` and :meth:`acknowledge`.)
3. *Complete* (this thread): when every task acknowledged, the metadata is written atomically,
   the checkpoint joins the store (older ones are subsumed and their unshared files deleted), the
   statistics are written, and every CheckpointListener is notified (sinks commit).
4. *Abort*: a checkpoint not complete by its deadline, declined, or whose metadata could not be
   written is aborted; listeners are told; more than ``tolerable failures`` aborts in a row
   fail the pipeline with :class:`~spark_ckpt.errors.CheckpointError`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
from spark_ckpt.checkpoint.completed import (
    CompletedCheckpoint,
    CompletedCheckpointStore,
    SharedStateRegistry,
)
from spark_ckpt.checkpoint.listener import CheckpointListener
from spark_ckpt.checkpoint.pending import (
    AckResult,
    Boundary,
    CheckpointFailureReason,
    PendingCheckpoint,
    TaskAck,
)
from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import CheckpointError
from spark_ckpt.faults import fault_point
from spark_ckpt.options import FROM_OPTIONS, Settings, defaults_from_options

__all__ = ["CheckpointConfig", "CheckpointCoordinator"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
@defaults_from_options("checkpoint_")
class CheckpointConfig:
    """The ``spark.ckpt.checkpoint.*`` options the coordinator acts on, named as the fields of
    :class:`~spark_ckpt.options.Settings` without their ``checkpoint_`` prefix; every default
    is the option's, from :data:`~spark_ckpt.options.OPTIONS`."""

    interval_ms: int = FROM_OPTIONS  # 0: no periodic checkpoints (only final ones)
    min_pause_ms: int = FROM_OPTIONS
    max_concurrent: int = FROM_OPTIONS
    timeout_ms: int = FROM_OPTIONS
    tolerable_failures: int = FROM_OPTIONS
    retained: int = FROM_OPTIONS
    history_retained: int = FROM_OPTIONS
    mode: str = FROM_OPTIONS

    @classmethod
    def from_settings(cls, settings: Settings) -> CheckpointConfig:
        """The coordinator's part of ``settings``."""
        return cls(**{f.name: getattr(settings, f"checkpoint_{f.name}")
                      for f in dataclasses.fields(cls)})


class _Stop:
    pass


class CheckpointCoordinator:
    def __init__(self, pipeline: str, pipeline_id: str, config: CheckpointConfig,
                 storage: CheckpointStorage, *, completed: list[CompletedCheckpoint],
                 next_id: int, listeners: list[CheckpointListener],
                 on_failure: Callable[[BaseException], None],
                 on_stats: Callable[[dict[str, Any]], None],
                 delete_files: Callable[[list[str]], None],
                 live_files: Callable[[], set[str]],
                 fence: Callable[[], None] = lambda: None,
                 clock: Clock | None = None,
                 pre_commit: Callable[[int, int], dict[str, TaskAck | Exception]] | None = None,
                 ) -> None:
        self.pipeline = pipeline
        self.pipeline_id = pipeline_id
        self.config = config
        self.storage = storage
        self.clock = clock or SystemClock()
        self.listeners = listeners
        self._on_failure = on_failure
        self._on_stats = on_stats
        self._delete_files = delete_files
        self._live_files = live_files
        self._fence = fence
        self._pre_commit = pre_commit
        # -- owned by the loop thread -------------------------------------------------------
        self.registry = SharedStateRegistry()
        self.store = CompletedCheckpointStore(config.retained, self.registry, self._discard)
        self.pending: dict[int, PendingCheckpoint] = {}
        self._dropped: set[str] = set()  # state files no live chain holds, not yet deleted
        self._boundary: Boundary | None = None  # the latest finished batch's cut
        self._notify_failed = False  # a listener failed on complete: the next one retries
        # read by other threads (ints, replaced whole): batches before the oldest retained
        # barrier are never replayed; the latest completed barrier's batch
        self.oldest_barrier = -1
        self.latest_barrier: int | None = None
        self.latest_completed: tuple[int, int] | None = None  # (id, barrier), replaced whole
        for checkpoint in completed:
            self.store.add(checkpoint)
        self._update_oldest()
        self._next_id = next_id
        self._failures = 0
        self._last_trigger_ms: int | None = None
        self._last_end_ms: int | None = None
        self._forced: list[concurrent.futures.Future[int]] = []
        self._waiters: dict[int, list[concurrent.futures.Future[str]]] = {}
        self._outcomes: dict[int, str] = {}  # the last checkpoints' outcomes, for late waiters
        # -- shared, thread-safe ------------------------------------------------------------
        self.barriers: queue.Queue[int] = queue.Queue()
        self._events: queue.Queue[Any] = queue.Queue()
        self._post_lock = threading.Lock()
        self._closed = False  # the loop ended: posted futures are answered at once
        self._started_ms = self.clock.now_ms()
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name=f"spark-ckpt-checkpoint-coordinator-{pipeline}")
        self.clock.on_advance(lambda: self._events.put(None))

    # -- called from other threads (post only) -------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._events.put(_Stop())
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join()

    def _post(self, event: Any) -> None:
        """Queue ``event`` for the loop; once the loop has ended, answer its futures at once."""
        with self._post_lock:
            if not self._closed:
                self._events.put(event)
                return
        _answer_closed(event)

    def take_barrier(self) -> int | None:
        try:
            return self.barriers.get_nowait()
        except queue.Empty:
            return None

    def publish_boundary(self, boundary: Boundary) -> None:
        """A batch ended (or the pipeline started): later barriers go at ``boundary``."""
        self._post(("boundary", boundary))

    def place_barrier(self, checkpoint_id: int, batch_id: int, tasks: set[str]) -> None:
        self._post(("barrier", checkpoint_id, batch_id, frozenset(tasks)))

    def acknowledge(self, checkpoint_id: int, ack: TaskAck) -> None:
        self._post(("ack", checkpoint_id, ack))

    def release_files(self, files: frozenset[str] | set[str]) -> None:
        """State files a running task no longer holds: deleted once no retained or pending
        checkpoint references them."""
        self._post(("release", frozenset(files)))

    def decline(self, checkpoint_id: int, task: str, reason: str) -> None:
        self._post(("decline", checkpoint_id, task, reason))

    def trigger_now(self) -> concurrent.futures.Future[int]:
        """Trigger a checkpoint at once (a final checkpoint on stop); the future gives its id."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._post(("force", future))
        return future

    def completion(self, checkpoint_id: int) -> concurrent.futures.Future[str]:
        """A future that gives "completed" or the abort reason of ``checkpoint_id``."""
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._post(("wait", checkpoint_id, future))
        return future

    # -- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run_loop()
        finally:
            with self._post_lock:
                self._closed = True
            while True:  # events posted before the close: answer their futures
                try:
                    _answer_closed(self._events.get_nowait())
                except queue.Empty:
                    break

    def _run_loop(self) -> None:
        while True:
            try:
                event = self._events.get(timeout=self._wait_s())
            except queue.Empty:
                event = None
            if isinstance(event, _Stop):
                self._stop_pending()
                return
            try:
                if event is not None:
                    self._handle(event)
                self._tick()
            except BaseException as exc:  # the pipeline must learn of it
                log.exception("Checkpoint coordinator of pipeline %s failed", self.pipeline)
                for future in self._forced:
                    future.set_exception(exc)
                self._forced.clear()
                self._stop_pending()
                self._on_failure(exc)
                return

    def _wait_s(self) -> float:
        if not isinstance(self.clock, SystemClock):
            return 0.5  # a manual clock wakes the loop when it advances
        return 0.05

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "boundary":
            self._boundary = event[1]
            for early in sorted(self.pending.values(), key=lambda p: p.checkpoint_id):
                if early.waiting is None:  # triggered before the first boundary
                    self._place(early, event[1])
        elif kind == "barrier":
            _, cid, batch, tasks = event
            pending = self.pending.get(cid)
            if pending is None:
                log.warning("Pipeline %s: barrier of checkpoint %d placed after batch %d, but "
                            "the checkpoint is no longer pending", self.pipeline, cid, batch)
                return
            pending.place_barrier(batch, self.clock.now_ms(), set(tasks))
            log.info("Pipeline %s checkpoint %d: barrier after batch %d; waiting for %d "
                     "acknowledgements", self.pipeline, cid, batch, len(tasks))
        elif kind == "ack":
            _, cid, ack = event
            self._receive_ack(cid, ack)
        elif kind == "decline":
            _, cid, task, reason = event
            pending = self.pending.get(cid)
            if pending is None:
                log.warning("Pipeline %s: late decline of checkpoint %d by %s: %s",
                            self.pipeline, cid, task, reason)
                return
            self._abort(pending, CheckpointFailureReason.DECLINED, f"{task}: {reason}")
        elif kind == "release":
            self._dropped |= event[1]
            self._sweep()
        elif kind == "force":
            self._forced.append(event[1])
        elif kind == "wait":
            _, cid, future = event
            if cid in self._outcomes:
                future.set_result(self._outcomes[cid])
            elif self.store.get(cid) is not None:
                future.set_result("completed")
            else:
                self._waiters.setdefault(cid, []).append(future)

    def _receive_ack(self, cid: int, ack: TaskAck) -> AckResult:
        pending = self.pending.get(cid)
        if pending is None:
            result = AckResult.DISCARDED if cid < self._next_id else AckResult.UNKNOWN
        else:
            result = pending.acknowledge(ack)
        if result is AckResult.SUCCESS:
            log.debug("Pipeline %s checkpoint %d: acknowledged by %s", self.pipeline, cid,
                      ack.task)
        else:
            log.warning("Pipeline %s checkpoint %d: %s acknowledgement from %s",
                        self.pipeline, cid, result.value, ack.task)
        if pending is not None and pending.fully_acknowledged:
            self._complete(pending)
        return result

    def _tick(self) -> None:
        now = self.clock.now_ms()
        for pending in list(self.pending.values()):
            if now >= pending.deadline_ms:
                self._abort(pending, CheckpointFailureReason.TIMEOUT,
                            f"not complete after {self.config.timeout_ms} ms")
        while self._forced:
            future = self._forced.pop(0)
            try:
                cid = self._trigger(self.clock.now_ms(), forced=True)
            except BaseException as exc:
                future.set_exception(exc)
                raise
            future.set_result(cid)
        if self._due(self.clock.now_ms()):
            self._trigger(self.clock.now_ms())

    def _due(self, now: int) -> bool:
        c = self.config
        if c.interval_ms <= 0 or len(self.pending) >= c.max_concurrent:
            return False
        last = self._last_trigger_ms if self._last_trigger_ms is not None else self._started_ms
        if now < last + c.interval_ms:
            return False
        if self._last_end_ms is not None and now < self._last_end_ms + c.min_pause_ms:
            return False
        if self._pre_commit is None:
            return True
        # placed at boundaries: only when there is one, and a new one (or a commit to retry)
        if self._boundary is None:
            return False
        covered = [p.barrier_batch for p in self.pending.values() if p.barrier_batch is not None]
        if self.latest_barrier is not None:
            covered.append(self.latest_barrier)
        return self._notify_failed or self._boundary.batch > max(covered, default=-1)

    def _trigger(self, now: int, *, forced: bool = False) -> int:
        cid = self._next_id
        self._next_id += 1
        self._last_trigger_ms = now
        pending = self.pending[cid] = PendingCheckpoint(cid, now,
                                                        timeout_ms=self.config.timeout_ms)
        pending.forced = forced
        log.info("Pipeline %s: triggered checkpoint %d", self.pipeline, cid)
        if self._pre_commit is None:
            self.barriers.put(cid)
        elif self._boundary is not None:
            self._place(pending, self._boundary)
        return cid

    def _place(self, pending: PendingCheckpoint, boundary: Boundary) -> None:
        """The barrier of ``pending`` at ``boundary``: take the acknowledgements fixed there,
        then let every two-phase sink pre-commit what it staged up to the boundary's batch."""
        assert self._pre_commit is not None
        cid = pending.checkpoint_id
        pending.place_barrier(boundary.batch, self.clock.now_ms(), boundary.tasks())
        log.info("Pipeline %s checkpoint %d: barrier after batch %d", self.pipeline, cid,
                 boundary.batch)
        for ack in boundary.acks:
            self._receive_ack(cid, ack)
        if not boundary.sinks:
            return
        fault_point("checkpoint.barrier")
        for task, result in self._pre_commit(cid, boundary.batch).items():
            if cid not in self.pending:
                return  # declined by an earlier sink
            if isinstance(result, Exception):
                self._abort(pending, CheckpointFailureReason.DECLINED, f"{task}: {result}")
            else:
                self._receive_ack(cid, result)

    # -- completion --------------------------------------------------------------------------
    def _complete(self, pending: PendingCheckpoint) -> None:
        cid = pending.checkpoint_id
        assert pending.barrier_batch is not None
        if self.clock.now_ms() > pending.deadline_ms and not pending.forced:  # too late
            self._abort(pending, CheckpointFailureReason.TIMEOUT,
                        f"not complete after {self.config.timeout_ms} ms")
            return
        body: dict[str, Any] = {
            "checkpoint_id": cid, "pipeline": self.pipeline, "pipeline_id": self.pipeline_id,
            "barrier_batch": pending.barrier_batch, "trigger_ms": pending.trigger_ms,
            "mode": self.config.mode, "sources": {}, "operators": {}, "sinks": {},
        }
        for ack in pending.acks.values():
            kind, _, rest = ack.task.partition(":")
            if kind == "source":
                body["sources"][rest] = ack.state
            elif kind == "sink":
                body["sinks"][rest] = ack.state
            elif kind == "op":
                op, _, pid = rest.rpartition(":")
                entry = body["operators"].setdefault(op, {"handles": {}})
                entry.update(ack.state.get("operator", {}))
                entry["handles"][pid] = ack.state["handle"]
        completed_ms = self.clock.now_ms()
        body["completed_ms"] = completed_ms
        self._fence()  # a newer driver owns the checkpoint directory: this one stops here
        try:
            size = self.storage.write_metadata(cid, body)
        except Exception as exc:  # noqa: BLE001 - storage failures are checkpoint failures
            self._abort(pending, CheckpointFailureReason.STORAGE, str(exc))
            return
        fault_point("checkpoint.completed")
        # Again after the write: a driver that stalled between the check above and the write
        # (a long GC, a frozen VM) must not go on to commit its sinks' transactions, nor leave
        # a checkpoint whose staged output the newer driver has already cleaned up.
        try:
            self._fence()
        except BaseException:
            try:
                self.storage.abandon(cid)
            except OSError as exc:
                log.warning("Pipeline %s: fenced after writing checkpoint %d and could not "
                            "abandon it: %s", self.pipeline, cid, exc)
            raise
        previous = self.store.latest
        checkpoint = CompletedCheckpoint(cid, pending.barrier_batch, body)
        del self.pending[cid]
        for older in [p for p in self.pending.values() if p.checkpoint_id < cid]:
            self._abort(older, CheckpointFailureReason.TIMEOUT, f"subsumed by checkpoint {cid}")
        self.store.add(checkpoint)
        self._update_oldest()
        self._sweep()
        self._failures = 0
        self._last_end_ms = completed_ms
        stats = self._stats(pending, "completed", None, completed_ms, previous, size)
        log.info("Completed checkpoint %d for pipeline %s after batch %d (%s state bytes, %s "
                 "incremental, in %d ms)", cid, self.pipeline, pending.barrier_batch,
                 stats["full_bytes"], stats["incremental_bytes"], stats["duration_ms"])
        self._notify_failed = False
        for listener in self.listeners:
            try:
                listener.notify_checkpoint_complete(cid)
            except Exception as exc:  # noqa: BLE001 - best effort; a later one subsumes it
                self._notify_failed = True
                log.warning("Pipeline %s checkpoint %d: listener %s failed on complete: %s",
                            self.pipeline, cid, type(listener).__name__, exc)
        self._finish(cid, "completed", stats)

    def _abort(self, pending: PendingCheckpoint, reason: CheckpointFailureReason,
               detail: str) -> None:
        cid = pending.checkpoint_id
        pending.discard()
        self.pending.pop(cid, None)
        now = self.clock.now_ms()
        self._last_end_ms = now
        self._failures += 1
        log.warning("Pipeline %s: checkpoint %d aborted: %s (%s); %d failure(s) in a row, "
                    "%d tolerated", self.pipeline, cid, reason.value, detail, self._failures,
                    self.config.tolerable_failures)
        for listener in self.listeners:
            try:
                listener.notify_checkpoint_aborted(cid)
            except Exception as exc:  # noqa: BLE001
                log.warning("Pipeline %s checkpoint %d: listener %s failed on abort: %s",
                            self.pipeline, cid, type(listener).__name__, exc)
        stats = self._stats(pending, "aborted", f"{reason.value}: {detail}", now, None, 0)
        self._finish(cid, f"aborted: {reason.value}: {detail}", stats)
        if self._failures > self.config.tolerable_failures:
            self._on_failure(CheckpointError(
                f"pipeline {self.pipeline}: {self._failures} checkpoint(s) failed in a row, "
                f"more than spark.ckpt.checkpoint.tolerableFailures="
                f"{self.config.tolerable_failures}; last: checkpoint {cid}: {reason.value} "
                f"({detail})"
            ))

    def _finish(self, cid: int, outcome: str, stats: dict[str, Any]) -> None:
        self._outcomes[cid] = outcome
        for old in [c for c in self._outcomes if c < cid - 100]:
            del self._outcomes[old]
        self.storage.write_stats(cid, stats)
        self.storage.prune_history(cid, self.config.history_retained)
        try:
            self._on_stats(stats)
        except Exception as exc:  # noqa: BLE001
            log.warning("Checkpoint statistics listener failed: %s", exc)
        for future in self._waiters.pop(cid, []):
            future.set_result(outcome)

    def _update_oldest(self) -> None:
        oldest = self.store.checkpoints[0] if self.store.checkpoints else None
        self.oldest_barrier = oldest.barrier_batch if oldest is not None else -1
        latest = self.store.latest
        self.latest_barrier = latest.barrier_batch if latest is not None else None
        self.latest_completed = (latest.checkpoint_id, latest.barrier_batch) \
            if latest is not None else None

    def _stop_pending(self) -> None:
        for pending in list(self.pending.values()):
            pending.discard()
            self.pending.pop(pending.checkpoint_id, None)
            for future in self._waiters.pop(pending.checkpoint_id, []):
                future.set_result(f"aborted: {CheckpointFailureReason.PIPELINE_STOPPED.value}")
        for futures in self._waiters.values():
            for future in futures:
                future.set_result("unknown")

    def _discard(self, checkpoint: CompletedCheckpoint, unreferenced: list[str]) -> None:
        self._dropped.update(unreferenced)
        doomed = self._sweep()
        self.storage.discard(checkpoint.checkpoint_id)
        log.info("Pipeline %s: subsumed checkpoint %d; deleted %d unshared state file(s)",
                 self.pipeline, checkpoint.checkpoint_id, doomed)

    def _sweep(self) -> int:
        """Delete dropped state files no retained checkpoint, pending checkpoint or running
        task references; keep the others for a later sweep."""
        if not self._dropped:
            return 0
        live = self._live_files()
        pending = {f["path"] for p in self.pending.values() for a in p.acks.values()
                   for f in a.state.get("handle", {}).get("files", [])}
        if self._boundary is not None:  # the next barrier may still go there
            pending |= self._boundary.state_files()
        doomed = [f for f in self._dropped
                  if f not in live and f not in pending and not self.registry.referenced(f)]
        self._dropped.difference_update(doomed)
        self._delete_files(doomed)
        return len(doomed)

    def _stats(self, pending: PendingCheckpoint, status: str, reason: str | None,
               end_ms: int, previous: CompletedCheckpoint | None,
               metadata_bytes: int) -> dict[str, Any]:
        before = set(previous.state_files()) if previous is not None else set()
        full = incremental = 0
        operators: dict[str, Any] = {}
        tasks: dict[str, Any] = {}
        for ack in pending.acks.values():
            tasks[ack.task] = ack.metrics
            handle = ack.state.get("handle")
            if handle is None:
                continue
            op = ack.task.split(":")[1]
            entry = operators.setdefault(op, {"rows": 0, "bytes": 0, "incremental_bytes": 0})
            entry["rows"] += int(handle.get("rows", 0))
            for f in handle.get("files", []):
                full += f["bytes"]
                entry["bytes"] += f["bytes"]
                if f["path"] not in before:
                    incremental += f["bytes"]
                    entry["incremental_bytes"] += f["bytes"]

        def top(metric: str) -> int:
            return max((int(m.get(metric) or 0) for m in tasks.values()), default=0)

        return {
            "checkpoint_id": pending.checkpoint_id, "pipeline": self.pipeline,
            "status": status, "reason": reason, "trigger_ms": pending.trigger_ms,
            "barrier_batch": pending.barrier_batch, "barrier_ms": pending.barrier_ms,
            "end_ms": end_ms, "duration_ms": end_ms - pending.trigger_ms,
            "full_bytes": full, "incremental_bytes": incremental,
            "metadata_bytes": metadata_bytes,
            "alignment_ms": top("alignment_ms"), "sync_ms": top("sync_ms"),
            "async_ms": top("async_ms"), "operators": operators, "tasks": tasks,
            "acknowledged": len(pending.acks),
            "waiting_for": sorted(pending.waiting or []),
        }


def _answer_closed(event: Any) -> None:
    """Resolve the future of an event the ended loop will never handle."""
    if not isinstance(event, tuple):
        return
    if event[0] == "force":
        event[1].set_exception(CheckpointError("the checkpoint coordinator has stopped"))
    elif event[0] == "wait":
        event[2].set_result("unknown")
