"""Buffered appends of job events to the Delta event log, as Flink's job-event store does.

Events are buffered and appended as one Delta commit per flush: every
``spark.ckpt.eventLog.flushIntervalMs`` by a background thread, at once when the buffer holds
``spark.ckpt.eventLog.flushMaxEvents``, and synchronously when the driver needs an event to be
durable before it goes on (attempt start, before a sink commit, at the end).

Failures: a failed append is retried ``spark.ckpt.eventLog.writeRetries`` times with a doubling
back-off from ``spark.ckpt.eventLog.retryBackoffMs`` (at most 10 s); the events stay buffered
and in order meanwhile. Only then does the writer fail (``EventLogError``), and it stops
retrying at once if the driver has been fenced in between.

Fencing: before every flush the writer checks that no newer driver attempt of the same job has
claimed its attempt marker; if one has, the flush fails with JobFencedError and nothing more is
written by this driver.

Compaction: when an append leaves ``spark.ckpt.eventLog.compactAtFiles`` files under
``COMPACT_TARGET_BYTES`` in the table, the writer compacts them (delta-rs's OPTIMIZE with that
target size: a commit that removes the small files and adds files of up to that size with the
same rows, ``dataChange=false``; larger files are left alone, so the log is not rewritten
whole each time). Delta's per-commit cost grows with the table's live files (an append at 550
files took 50 ms against 6 ms at 50), and recovery reads every file: a 1,000,000-event log
appended 500 events at a time would otherwise hold 2,000 files (scripts/sim_scale.py). The
count is the table's, so a job whose drivers die young is compacted too. A failed or
interrupted compaction changes nothing a reader sees (its files are not committed) and is
tried again after the next append; a fenced writer does not compact. Compactions by two
drivers that overlap (one stalled past its fence check) could each add a copy of the same
rows: the snapshot is refreshed just before compacting, and the reader keeps one row per
(``job_attempt``, ``seq``), which identifies an event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from deltalake import DeltaTable, write_deltalake

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import EventLogError, JobFencedError
from spark_ckpt.eventlog.events import EVENT_SCHEMA, Event, events_to_table
from spark_ckpt.faults import fault_point
from spark_ckpt.storage import Storage, delta_options, delta_table, is_delta_table

__all__ = ["EventLogWriter"]

log = logging.getLogger(__name__)

# Delta writes a log checkpoint every N commits, so loading a long log stays fast.
_TABLE_CONFIG = {"delta.checkpointInterval": "50", "delta.appendOnly": "true"}
COMPACT_TARGET_BYTES = 16 * 1024 * 1024  # files this large are done: never rewritten again
_MAX_BACKOFF_S = 10.0


class EventLogWriter:
    def __init__(
        self,
        storage: Storage,
        table_path: str,
        *,
        job_id: str,
        job_attempt: int,
        flush_interval_ms: int,
        flush_max_events: int,
        compact_at_files: int = 0,
        write_retries: int = 5,
        retry_backoff_ms: int = 200,
        is_fenced: Callable[[], bool] = lambda: False,
        on_flush: Callable[[list[Event]], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._storage = storage
        self._path = table_path
        self._uri = storage.spark_path(table_path)
        self.job_id = job_id
        self.job_attempt = job_attempt
        self._interval = flush_interval_ms / 1000.0
        self._max = flush_max_events
        self._compact_at = compact_at_files
        self._table: DeltaTable | None = None  # the open table appends go to (flush lock)
        self._is_fenced = is_fenced
        self._on_flush = on_flush
        self._clock = clock or SystemClock()
        self._retries = write_retries
        self._backoff = retry_backoff_ms / 1000.0
        self.retried = 0  # failed appends that a retry then made good
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._buffer: list[Event] = []
        self._seq = 0
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.commits = 0
        self.compactions = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if not is_delta_table(self._uri):
            DeltaTable.create(
                self._uri, EVENT_SCHEMA, mode="ignore", name="spark_ckpt_events",
                configuration=_TABLE_CONFIG, storage_options=delta_options(self._uri),
            )
        self._thread = threading.Thread(
            target=self._run, name=f"spark-ckpt-eventlog-{self.job_id}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Flush what is buffered and stop the background thread."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    # -- appending -------------------------------------------------------------------------
    def append(self, event: Event) -> None:
        self._raise_if_failed()
        with self._lock:
            self._seq += 1
            stamped = _stamp(event, self.job_id, self.job_attempt, self._seq,
                             self._clock.now_ms())
            self._buffer.append(stamped)
            full = len(self._buffer) >= self._max
        if full:
            self._wake.set()

    def flush(self) -> None:
        """Make every event appended so far durable, or raise."""
        self._raise_if_failed()
        self._flush_once()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            try:
                self._flush_once()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the driver's next call
                self._error = exc
                log.error("Job %s attempt %d: event log flush failed: %s",
                          self.job_id, self.job_attempt, exc)
                return

    def _fenced_error(self) -> JobFencedError:
        error = JobFencedError(
            f"job {self.job_id}: driver attempt {self.job_attempt} was fenced off by a "
            "newer attempt of the same job; this driver stops without committing"
        )
        self._error = error
        return error

    def _flush_once(self) -> None:
        with self._flush_lock:
            with self._lock:
                batch, self._buffer = self._buffer, []
            if not batch:
                return
            started = self._clock.monotonic_s()
            backoff = self._backoff
            attempt = 0
            while True:
                if self._is_fenced():
                    with self._lock:
                        self._buffer = batch + self._buffer
                    raise self._fenced_error()
                try:
                    fault_point("eventlog.write")
                    if self._table is None:
                        self._table = delta_table(self._uri)
                    write_deltalake(self._table, events_to_table(batch), mode="append")
                    break
                except Exception as exc:
                    self._table = None  # opened anew for the retry
                    attempt += 1
                    if attempt > self._retries:
                        with self._lock:  # keep the events: a later flush may succeed
                            self._buffer = batch + self._buffer
                        raise EventLogError(
                            f"job {self.job_id} attempt {self.job_attempt}: could not append "
                            f"{len(batch)} events to the event log at {self._uri} after "
                            f"{attempt} tries (spark.ckpt.eventLog.writeRetries="
                            f"{self._retries}); the storage keeps failing: {exc}. Submit the "
                            "job again once the storage is back: it resumes from what the log "
                            "holds"
                        ) from exc
                    log.warning("Job %s attempt %d: appending %d events to the event log "
                                "failed (try %d of %d), retrying in %.1f s: %s", self.job_id,
                                self.job_attempt, len(batch), attempt, self._retries + 1,
                                backoff, exc)
                    self._clock.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF_S)
            self.retried += 1 if attempt else 0
            self.commits += 1
            log.debug("Job %s attempt %d: flushed %d events in %.0f ms", self.job_id,
                      self.job_attempt, len(batch), (self._clock.monotonic_s() - started) * 1000)
            if self._compact_at and self._small_files() >= self._compact_at:
                self._compact()
        if self._on_flush is not None:
            self._on_flush(batch)

    def _small_files(self) -> int:
        """The table's files under the compaction target, as the last append left it."""
        if self._table is None:
            return 0
        try:
            sizes = self._table.get_add_actions(flatten=True).column("size_bytes")
        except Exception as exc:  # noqa: BLE001 - counting never fails an append
            log.warning("Job %s attempt %d: could not count the event log's files: %s",
                        self.job_id, self.job_attempt, exc)
            return 0
        return sum(1 for size in sizes.to_pylist() if size < COMPACT_TARGET_BYTES)

    def _compact(self) -> None:
        """Compact the table's small files (under the flush lock): best effort, the events
        are durable whether it happens or not."""
        if self._is_fenced():
            return  # the next flush raises JobFencedError; a fenced driver writes nothing
        started = self._clock.monotonic_s()
        try:
            fault_point("eventlog.compact")
            if self._table is None:
                self._table = delta_table(self._uri)
            self._table.update_incremental()  # plan from the newest files: see the module doc
            metrics = self._table.optimize.compact(target_size=COMPACT_TARGET_BYTES)
        except Exception as exc:  # noqa: BLE001 - a later compaction tries again
            self._table = None
            log.warning("Job %s attempt %d: compacting the event log at %s failed (the events "
                        "are durable; tried again after the next append): %s", self.job_id,
                        self.job_attempt, self._uri, exc)
            return
        self.compactions += 1
        log.info("Job %s attempt %d: compacted the event log's files (%s removed, %s added) in "
                 "%.0f ms", self.job_id, self.job_attempt, metrics.get("numFilesRemoved"),
                 metrics.get("numFilesAdded"), (self._clock.monotonic_s() - started) * 1000)

def _stamp(event: Event, job_id: str, attempt: int, seq: int, now_ms: int) -> Event:
    from dataclasses import replace

    return replace(event, job_id=job_id, job_attempt=attempt, seq=seq, time_us=now_ms * 1000)
