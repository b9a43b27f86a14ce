"""StreamingContext: a pipeline's template, checkpoint directory and running machinery.

    ctx = StreamingContext(spark, batch_interval=2.0, checkpoint_dir="ckpt/orders",
                           name="orders")
    orders = ctx.file_stream("orders", "landing/orders", "json", schema=ORDERS)
    orders.filter("amount > 0").join_static(customers, "customer_id") \\
          .write_delta("tables/orders_enriched", name="enriched")
    ctx.start()
    ctx.await_termination()

The checkpoint directory holds everything a restarted driver needs::

    metadata.json          the pipeline: name, sources, outputs, recorded source schemas
    runs/<n>.json          one marker per driver start (fencing: the newest run wins)
    allocations/<b>.json   what batch b reads, recorded before it runs (ReceiverTracker)
    commits/<b>.json       batch b's outputs all committed
    driver/<b>.json        driver state after batch b was submitted
    receivedData/<src>/    write-ahead log of receiver sources
    sources/<src>/         seen-files snapshots of file sources
    progress/progress.jsonl, deadletter/ (a Delta table of malformed records)
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import (
    JobDefinitionError,
    JobFencedError,
    PipelineFailedError,
)
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.options import Settings
from spark_ckpt.storage import Storage, join
from spark_ckpt.streaming.batch import BatchAllocation
from spark_ckpt.streaming.generator import JobGenerator
from spark_ckpt.streaming.graph import StreamGraph
from spark_ckpt.streaming.metalog import MetadataLog
from spark_ckpt.streaming.progress import ProgressLog, StreamingListener, notify
from spark_ckpt.streaming.receiver import QueueSource, SocketSource
from spark_ckpt.streaming.scheduler import JobScheduler
from spark_ckpt.streaming.sinks import DeadLetters
from spark_ckpt.streaming.sources import (
    DeltaStreamSource,
    FileStreamSource,
    GeneratorSource,
    Source,
)
from spark_ckpt.streaming.stream import InputStream
from spark_ckpt.streaming.tracker import ReceiverTracker

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

__all__ = ["StreamingContext"]

log = logging.getLogger(__name__)

METADATA_VERSION = 1


class StreamingContext:
    """A streaming pipeline bound to an existing SparkSession (never creates one)."""

    def __init__(self, spark: SparkSession, batch_interval: float, checkpoint_dir: str,
                 name: str, *, settings: Settings | None = None) -> None:
        if batch_interval <= 0:
            raise JobDefinitionError(
                f"pipeline {name}: expected batch_interval > 0 seconds, found {batch_interval!r}"
            )
        if not name or any(c in name for c in "/\\ "):
            raise JobDefinitionError(
                f"expected a pipeline name without '/', '\\\\' or spaces, found {name!r}"
            )
        self.spark = spark
        self.batch_interval = float(batch_interval)
        self.name = name
        self.settings = settings or Settings.from_conf(spark.conf)
        self.storage = Storage(checkpoint_dir)
        self.root = self.storage.root
        self.graph = StreamGraph()
        self.listeners: list[StreamingListener] = []
        self.dead_letters = DeadLetters(self)
        self.recent_progress: list[dict[str, Any]] = []
        self.allocation_ms: dict[int, int] = {}
        self._sources: list[Source] = []
        self._allocations: dict[int, BatchAllocation] = {}
        self._schemas: dict[str, str] = {}
        self._run: int | None = None
        self._state = "created"  # created -> running -> stopped
        self._error: BaseException | None = None
        self._terminated = threading.Event()
        self._finishing = False
        self._lock = threading.Lock()
        self.tracker: ReceiverTracker
        self.scheduler: JobScheduler
        self.generator: JobGenerator | None = None

    # -- sources -------------------------------------------------------------------------
    def _input(self, source: Source) -> InputStream:
        if self._state != "created":
            raise JobDefinitionError(f"pipeline {self.name}: add sources before start()")
        stream = InputStream(self, source)
        source.bind(self)
        self._sources.append(source)
        return stream

    def file_stream(self, name: str, path: str, format: str = "parquet",  # noqa: A002
                    schema: StructType | str | None = None, *,
                    max_files_per_batch: int | None = None,
                    max_bytes_per_batch: int | None = None,
                    options: dict[str, str] | None = None) -> InputStream:
        """New files of a directory (parquet, json or csv), oldest first."""
        return self._input(FileStreamSource(name, path, format, schema,
                                            max_files_per_batch=max_files_per_batch,
                                            max_bytes_per_batch=max_bytes_per_batch,
                                            options=options))

    def delta_stream(self, name: str, path: str, *, starting_version: int = 0,
                     max_versions_per_batch: int | None = None,
                     ignore_deletes: bool = False) -> InputStream:
        """Rows appended to a Delta table, version by version."""
        return self._input(DeltaStreamSource(name, path, starting_version=starting_version,
                                             max_versions_per_batch=max_versions_per_batch,
                                             ignore_deletes=ignore_deletes))

    def generator_stream(self, name: str, **kwargs: Any) -> InputStream:
        """Deterministic rows ``id, key, value, event_time`` (see GeneratorSource)."""
        return self._input(GeneratorSource(name, **kwargs))

    def queue_stream(self, name: str, schema: StructType | str) -> InputStream:
        """An in-process queue: ``stream.source.push(rows)`` returns once they are durable."""
        return self._input(QueueSource(name, schema))

    def socket_stream(self, name: str, host: str, port: int) -> InputStream:
        """Text lines from a TCP server, written ahead as they arrive."""
        return self._input(SocketSource(name, host, port))

    def add_listener(self, listener: StreamingListener) -> None:
        self.listeners.append(listener)

    # -- recorded state ------------------------------------------------------------------
    def recorded_schema(self, source: str) -> StructType | None:
        from pyspark.sql.types import StructType

        raw = self._schemas.get(source)
        return StructType.fromJson(json.loads(raw)) if raw else None

    def allocation(self, batch_id: int) -> BatchAllocation:
        if batch_id not in self._allocations:
            record = self.allocations.get(batch_id)
            if record is None:
                raise JobDefinitionError(
                    f"pipeline {self.name}: batch {batch_id} is no longer recorded (a window "
                    f"reaches further back than spark.ckpt.stream.minBatchesToRetain="
                    f"{self.settings.stream_min_batches_to_retain})"
                )
            self._allocations[batch_id] = BatchAllocation.from_record(record)
        return self._allocations[batch_id]

    def remember_allocation(self, allocation: BatchAllocation) -> None:
        self._allocations[allocation.batch_id] = allocation

    def positions(self) -> dict[str, Any]:
        return {s.name: s.position() for s in self._sources}

    def _metadata(self) -> None:
        path = join(self.root, "metadata.json")
        sources = {s.name: s.describe() for s in self._sources}
        if self.storage.exists(path):
            record = load_record(self.storage.read_bytes(path), "pipeline-metadata",
                                 (METADATA_VERSION,))
            if record["name"] != self.name:
                raise JobDefinitionError(
                    f"checkpoint directory {self.storage.uri} belongs to pipeline "
                    f"{record['name']!r}, not {self.name!r}"
                )
            if sorted(record["sources"]) != sorted(sources):
                raise JobDefinitionError(
                    f"pipeline {self.name}: the checkpoint records sources "
                    f"{sorted(record['sources'])}, the template declares {sorted(sources)}; "
                    "sources cannot change under a checkpoint (use a new checkpoint directory)"
                )
            self._schemas = dict(record.get("schemas", {}))
        schemas = {s.name: s.schema().json() for s in self._sources}
        for name, schema in schemas.items():
            old = self._schemas.get(name)
            if old and old != schema:
                raise JobDefinitionError(
                    f"pipeline {self.name}: source {name} was recorded with schema "
                    f"{old}, the template now gives {schema}"
                )
        body = {"name": self.name, "sources": sources, "schemas": schemas,
                "outputs": {o.name: o.sink.describe() for o in self.graph.outputs},
                "batch_interval_s": self.batch_interval}
        self._schemas = schemas
        self.storage.write_atomic(path, dump_record("pipeline-metadata", METADATA_VERSION, body))

    def _claim_run(self) -> int:
        runs = join(self.root, "runs")
        self.storage.makedirs(runs)
        while True:
            number = max(self._runs(), default=0) + 1
            body = {"pipeline": self.name, "started_ms": int(time.time() * 1000)}
            if self.storage.create_exclusive(join(runs, f"{number:08d}.json"),
                                             dump_record("pipeline-run", 1, body)):
                return number

    def _runs(self) -> list[int]:
        return [int(i.base_name[:8]) for i in
                self.storage.list_files(join(self.root, "runs"), recursive=False)
                if i.base_name.endswith(".json") and i.base_name[:8].isdigit()]

    def check_fenced(self) -> None:
        newest = max(self._runs(), default=0)
        if self._run is not None and newest > self._run:
            raise JobFencedError(
                f"pipeline {self.name}: a newer driver (run {newest}) started on this "
                f"checkpoint directory; this driver (run {self._run}) stops without committing"
            )

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, *, available_now: bool = False) -> None:
        """Restore from the checkpoint, rerun unfinished batches, then tick.

        ``available_now``: process what the sources have now (in as many batches as their
        limits need), then stop by itself.
        """
        with self._lock:
            if self._state != "created":
                raise JobDefinitionError(f"pipeline {self.name}: start() called twice")
            self._state = "running"
        self.graph.validate()
        self.storage.makedirs(self.root)
        self._metadata()
        self._run = self._claim_run()
        self.allocations = MetadataLog(self.storage, join(self.root, "allocations"), "allocation")
        self.commits = MetadataLog(self.storage, join(self.root, "commits"), "batch-commit")
        self.driver_state = MetadataLog(self.storage, join(self.root, "driver"), "driver-state")
        self.progress_log = ProgressLog(self.storage, self.root)
        self.tracker = ReceiverTracker(self.name, self._sources, self.allocations)
        self.scheduler = JobScheduler(self)
        records = self.tracker.restore()
        for record in records:
            self._allocations[record.batch_id] = record
        committed = set(self.commits.batch_ids())
        pending = [a for a in records if a.batch_id not in committed]
        next_batch = max((a.batch_id for a in records), default=-1) + 1
        self._available_now = available_now
        self._last_allocated: int | None = None
        log.info("Pipeline %s run %d: starting at batch %d; %d allocated batch(es) to rerun%s",
                 self.name, self._run, next_batch, len(pending),
                 f" ({[a.batch_id for a in pending]})" if pending else "")
        for allocation in pending:
            self.scheduler.in_flight.acquire()
            self.scheduler.submit(allocation, recovered=True)
        self.generator = JobGenerator(self, next_batch, available_now)
        self.tracker.start()
        self.scheduler.start()
        self.generator.start()

    def available_now_done(self, batch_id: int) -> bool:
        """Scheduler: after ``batch_id``, has an available-now run allocated its last batch?"""
        if not self._available_now or self.generator is None:
            return False
        last = self.generator.finished_at
        if last is not None and batch_id >= last:
            self._finish(None)
            return True
        return False

    def available_now_check(self) -> None:
        """Generator: nothing more to allocate; finish now if every batch already ran."""
        assert self.generator is not None
        last = self.generator.finished_at
        done = set(self.commits.batch_ids())
        if last is None or last < 0 or last in done:
            self._finish(None)

    def batch_completed(self, progress: dict[str, Any]) -> None:
        self.recent_progress.append(progress)
        del self.recent_progress[:-100]
        self.progress_log.append(progress)
        notify(self.listeners, "on_batch_completed", progress)
        log.info("Pipeline %s batch %d: %s rows in %d ms", self.name, progress["batch_id"],
                 progress["num_input_rows"], progress["durations_ms"]["total"])
        self._purge(progress["batch_id"])

    def _purge(self, committed: int) -> None:
        keep = max(self.settings.stream_min_batches_to_retain, self.graph.remember_batches)
        below = committed - keep + 1
        if below <= 0 or committed % 10:
            return
        old = [a for b, a in sorted(self._allocations.items()) if b < below]
        self.tracker.purge(below, old)
        self.commits.purge(below)
        self.driver_state.purge(below)
        for b in [b for b in self._allocations if b < below]:
            del self._allocations[b]

    @property
    def last_progress(self) -> dict[str, Any] | None:
        return self.recent_progress[-1] if self.recent_progress else None

    def _batch_failed(self, batch_id: int, exc: BaseException, *, drain: bool = False) -> None:
        """A batch failed (or, ``drain``, the generator could not allocate one: the batches
        already allocated still run first)."""
        if self._state == "stopping-now":
            self._finish(None)
            return
        if isinstance(exc, JobFencedError):
            error: BaseException = exc
        else:
            error = PipelineFailedError(
                f"pipeline {self.name}: batch {batch_id} failed and the pipeline stopped; it "
                f"reruns over the same input on restart: {exc}"
            )
            error.__cause__ = exc
        log.error("%s", error)
        self._finish(error, drain=drain)

    def _finish(self, error: BaseException | None, *, drain: bool = False) -> None:
        with self._lock:
            if self._finishing:
                return
            self._finishing = True
            self._error = error
            self._state = "stopped"
        if self.generator is not None:
            self.generator.stop()
        self.scheduler.stop(drain=drain)
        threading.Thread(target=self._shutdown, args=(error,), daemon=True).start()

    def _shutdown(self, error: BaseException | None) -> None:
        # await_termination returns only when no thread of this pipeline can still commit
        self.scheduler.thread.join()
        if self.generator is not None:
            self.generator.thread.join()
        self.tracker.stop()
        notify(self.listeners, "on_pipeline_terminated", error)
        self._terminated.set()

    def stop(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop: ``graceful`` finishes the running batch first; otherwise it is cancelled
        (it reruns on restart). Batches allocated but not started rerun on restart."""
        if self._state == "created":
            self._state = "stopped"
            self._terminated.set()
            return
        if self.generator is not None:
            self.generator.stop()
            self.generator.thread.join(timeout)
        if not graceful:
            self._state = "stopping-now"
            group = self.scheduler.running_group
            if group:
                self.spark.sparkContext.cancelJobGroup(group)
        self.scheduler.stop()
        self.scheduler.thread.join(timeout)
        self._finish(None)
        self._terminated.wait(timeout)

    def await_termination(self, timeout: float | None = None) -> bool:
        """Wait for the pipeline to stop; True if it did. Raises the error that stopped it."""
        stopped = self._terminated.wait(timeout)
        if stopped and self._error is not None:
            raise self._error
        return stopped

    def process_available(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Start in available-now mode, wait until done, return this run's progress."""
        self.start(available_now=True)
        if not self.await_termination(timeout):
            self.stop(graceful=False)
            raise PipelineFailedError(f"pipeline {self.name}: not done after {timeout} s")
        return list(self.recent_progress)
