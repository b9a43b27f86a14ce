"""What the pipeline loop keeps after each committed batch, and how it words a failure: the
progress history and log, the listeners, the purge of old records, the shutdown of the
receivers and the coordinator.

Threads and owners: every method runs on the pipeline loop's thread. It is the one writer of
the progress history (readers on other threads get immutable snapshots) and of the progress
log; it purges ``allocations/`` and ``driver/`` (their one writer) and ``commits/`` (written by
the JobScheduler: the log's lock serializes the two). Listeners are called here, in order, each
with its own copy of what it is told. The checkpoint history is not written here: its one
writer is the coordinator's thread (see :mod:`spark_ckpt.streaming.runtime.history`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobFencedError, PipelineFailedError, StateSchemaError
from spark_ckpt.faults import fault_point
from spark_ckpt.streaming.runtime.progress import notify

if TYPE_CHECKING:
    from spark_ckpt.streaming.runtime.history import RecentHistory
    from spark_ckpt.streaming.runtime.metalog import MetadataLog
    from spark_ckpt.streaming.runtime.progress import ProgressLog, StreamingListener
    from spark_ckpt.streaming.runtime.receiver_tracker import ReceiverTracker

__all__ = ["PipelineHousekeeping"]

log = logging.getLogger(__name__)


class PipelineHousekeeping:
    def __init__(self, pipeline: str, *, progress: RecentHistory, progress_log: ProgressLog,
                 listeners: list[StreamingListener],
                 tracker: ReceiverTracker, coordinator: Any, outputs: list[Any],
                 commits: MetadataLog, driver_state: MetadataLog, keep_batches: int,
                 fence: Callable[[], None]) -> None:
        self.pipeline = pipeline
        self._progress = progress
        self._progress_log = progress_log
        self._listeners = listeners
        self._tracker = tracker
        self._coordinator = coordinator  # CheckpointCoordinator | None
        self._outputs = outputs
        self._commits = commits
        self._driver_state = driver_state
        self._keep = keep_batches
        self._fence = fence

    def batch_started(self, info: dict[str, Any]) -> None:
        notify(self._listeners, "on_batch_started", copy.deepcopy(info))

    def batch_completed(self, progress: dict[str, Any]) -> None:
        """After batch ``progress["batch_id"]`` committed. The batch is committed whatever
        happens here: a failure is a warning, never "batch N failed" (which would make a user
        think N reruns), and a failed purge is retried after a later batch."""
        b = progress["batch_id"]
        self._progress.append(progress)
        try:
            self._progress_log.append(progress)
        except Exception as exc:  # noqa: BLE001 - informational record only
            log.warning("Pipeline %s batch %d committed; writing its progress line failed: %s",
                        self.pipeline, b, exc)
        notify(self._listeners, "on_batch_completed", copy.deepcopy(progress))
        log.info("Pipeline %s batch %d: %s rows in %d ms", self.pipeline, b,
                 progress["num_input_rows"], progress["durations_ms"]["total"])
        try:
            self._purge(b)
        except Exception as exc:  # noqa: BLE001 - the records stay until a later purge
            log.warning("Pipeline %s batch %d committed; purging the records of older batches "
                        "failed (tried again after a later batch): %s", self.pipeline, b, exc)

    def _purge(self, committed: int) -> None:
        below = committed - self._keep + 1
        if self._coordinator is not None:  # restores replay from the oldest retained barrier
            below = min(below, self._coordinator.oldest_barrier)
        if below <= 0 or committed % 10:
            return
        fault_point("stream.purge")
        self._tracker.purge(below)
        for output in self._outputs:
            purge_sink = getattr(output.sink, "purge", None)
            if purge_sink is not None:
                purge_sink(below)
        self._commits.purge(below)
        self._driver_state.purge(below)

    def checkpoint_stats(self, stats: dict[str, Any]) -> None:
        notify(self._listeners, "on_checkpoint", copy.deepcopy(stats))

    def failure(self, batch_id: int, error: BaseException, *, drain: bool) -> BaseException:
        """The pipeline's error for a failed batch (``drain``: the generator could not allocate
        ``batch_id``; the batches already allocated still run first)."""
        exc = self.checkpoint_failure(error)
        if isinstance(exc, JobFencedError | StateSchemaError):
            result: BaseException = exc  # a refused state schema: rerunning will not help
        elif drain:
            result = PipelineFailedError(
                f"pipeline {self.pipeline}: allocating batch {batch_id} failed and the pipeline "
                f"stopped after the batches already allocated; nothing is lost: {exc}"
            )
            result.__cause__ = exc
        else:
            result = PipelineFailedError(
                f"pipeline {self.pipeline}: batch {batch_id} failed and the pipeline stopped; "
                f"it reruns over the same input on restart: {exc}"
            )
            result.__cause__ = exc
        log.error("%s", result)
        return result

    def checkpoint_failure(self, error: BaseException) -> BaseException:
        """A failure of a driver a newer one has fenced is reported as the fencing (its cause
        attached): the newer driver's start-up removes this one's uncommitted state and staged
        files, so a task of this one fails on a missing file before its next check."""
        if isinstance(error, JobFencedError):
            return error
        try:
            self._fence()
        except JobFencedError as fenced:
            fenced.__cause__ = error
            return fenced
        except Exception:  # noqa: BLE001 - the fence cannot be read: report the failure itself
            return error
        return error

    def shutdown(self, error: BaseException | None) -> None:
        """No batch of the pipeline can commit any more: stop the rest, tell the listeners."""
        self._tracker.stop()
        if self._coordinator is not None:
            self._coordinator.stop()
        notify(self._listeners, "on_pipeline_terminated", error)
