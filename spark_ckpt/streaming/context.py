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
import uuid
from typing import TYPE_CHECKING, Any

from spark_ckpt.checkpoint import (
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointStorage,
    CompletedCheckpoint,
    TaskAck,
)
from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import (
    CheckpointError,
    JobDefinitionError,
    JobFencedError,
    PipelineFailedError,
)
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.options import Settings
from spark_ckpt.storage import Storage, join, stat_any
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
from spark_ckpt.streaming.twophase import SinkTransactions

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

__all__ = ["StreamingContext"]

log = logging.getLogger(__name__)

METADATA_VERSION = 1


class StreamingContext:
    """A streaming pipeline bound to an existing SparkSession (never creates one)."""

    def __init__(self, spark: SparkSession, batch_interval: float, checkpoint_dir: str,
                 name: str, *, settings: Settings | None = None,
                 clock: Clock | None = None) -> None:
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
        self.clock = clock or SystemClock()
        # lineage: "<name>-<pipeline id>" keys every sink transaction; a checkpoint directory
        # made before pipeline ids existed keeps its old ids ("<name>")
        self.pipeline_id = ""
        self.lineage = name
        self.checkpointing = False
        self.coordinator: CheckpointCoordinator | None = None
        self.checkpoint_storage: CheckpointStorage | None = None
        self.transactions: dict[str, SinkTransactions] = {}
        self.restored: CompletedCheckpoint | None = None
        self._skipped_checkpoints: list[int] = []
        self.skip_output_through: dict[str, int] = {}  # output -> last batch already visible
        self.recent_checkpoints: list[dict[str, Any]] = []

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
            self.pipeline_id = str(record.get("pipeline_id", ""))
        elif not self.pipeline_id:
            self.pipeline_id = uuid.uuid4().hex[:16]
        if self.pipeline_id:
            self.lineage = f"{self.name}-{self.pipeline_id}"
        schemas = {s.name: s.schema().json() for s in self._sources}
        for name, schema in schemas.items():
            old = self._schemas.get(name)
            if old and old != schema:
                raise JobDefinitionError(
                    f"pipeline {self.name}: source {name} was recorded with schema "
                    f"{old}, the template now gives {schema}"
                )
        body = {"name": self.name, "pipeline_id": self.pipeline_id, "sources": sources,
                "schemas": schemas,
                "outputs": {o.name: (o.sink or o.two_phase).describe()  # type: ignore[union-attr]
                            for o in self.graph.outputs},
                "operators": {op.operator: {"kind": op.kind, "keys": list(op.keys)}
                              for op in self.graph.stateful},
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
    def start(self, *, available_now: bool = False,
              restore_checkpoint: int | None = None) -> None:
        """Restore from the checkpoint, rerun unfinished batches, then tick.

        ``available_now``: process what the sources have now (in as many batches as their
        limits need), take a final checkpoint, then stop by itself.
        ``restore_checkpoint``: restore from this retained checkpoint id instead of the latest
        (``spark.ckpt.checkpoint.restoreFrom``).
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
        records = self.tracker.restore()
        for record in records:
            self._allocations[record.batch_id] = record
        self.checkpointing = self._checkpointing_wanted()
        if self.checkpointing:
            pending = self._setup_checkpointing(records, restore_checkpoint)
        else:
            committed = set(self.commits.batch_ids())
            pending = [a for a in records if a.batch_id not in committed]
        self.scheduler = JobScheduler(self)
        next_batch = max((a.batch_id for a in records), default=-1) + 1
        self._available_now = available_now
        log.info("Pipeline %s run %d: starting at batch %d; %d allocated batch(es) to rerun%s",
                 self.name, self._run, next_batch, len(pending),
                 f" ({[a.batch_id for a in pending]})" if pending else "")
        for allocation in pending:  # takes no in-flight permit: they are not the generator's
            self.scheduler.submit(allocation, recovered=True)
        self.generator = JobGenerator(self, next_batch, available_now)
        self.tracker.start()
        if self.coordinator is not None:
            self.coordinator.start()
        self.scheduler.start()
        self.generator.start()

    # -- checkpointing -------------------------------------------------------------------
    def _checkpointing_wanted(self) -> bool:
        mode = self.settings.checkpoint_enabled
        two_phase_only = [o.output_name for o in self.graph.outputs if o.sink is None]
        if mode == "false":
            if self.graph.stateful:
                raise JobDefinitionError(
                    f"pipeline {self.name}: keyed state "
                    f"({[s.operator for s in self.graph.stateful]}) needs checkpoints, but "
                    "spark.ckpt.checkpoint.enabled=false; set it to auto or true"
                )
            if two_phase_only:
                raise JobDefinitionError(
                    f"pipeline {self.name}: outputs {two_phase_only} commit in two phases and "
                    "need checkpoints, but spark.ckpt.checkpoint.enabled=false"
                )
            return False
        if self.settings.checkpoint_mode == "at_least_once" and two_phase_only:
            raise JobDefinitionError(
                f"pipeline {self.name}: outputs {two_phase_only} commit in two phases; "
                "spark.ckpt.checkpoint.mode=at_least_once has no two-phase commit (use "
                "exactly_once)"
            )
        return mode == "true" or bool(self.graph.stateful) or bool(two_phase_only)

    def _setup_checkpointing(self, records: list[BatchAllocation],
                             restore_id: int | None) -> list[BatchAllocation]:
        """Pick and restore a checkpoint; return the batches to replay after its barrier."""
        s = self.settings
        uri = s.checkpoint_dir or self.storage.spark_path(join(self.root, "checkpoints"))
        storage = self.checkpoint_storage = CheckpointStorage(uri)
        restore_id = restore_id or s.checkpoint_restore_from or None
        chosen, retained = self._choose_checkpoint(storage, restore_id)
        self.restored = chosen
        if chosen is not None and restore_id is not None:
            for cid in storage.completed_ids():
                if cid > chosen.checkpoint_id:
                    log.warning("Pipeline %s: restoring checkpoint %d abandons newer checkpoint "
                                "%d", self.name, chosen.checkpoint_id, cid)
                    storage.abandon(cid)
        operators = chosen.metadata.get("operators", {}) if chosen else {}
        for op in self.graph.stateful:
            op.configure(operators.get(op.operator))
        if s.checkpoint_mode == "exactly_once":
            sinks = chosen.metadata.get("sinks", {}) if chosen else {}
            for output in self.graph.outputs:
                if output.two_phase is None:
                    continue
                output.two_phase.lineage = self.lineage
                txns = SinkTransactions(output.two_phase, self.name)
                self.transactions[output.output_name] = txns
                txns.recover(sinks.get(output.output_name, {}).get("pending", []))
                through = output.two_phase.committed_batch()
                if through is not None and chosen is not None and \
                        through > chosen.barrier_batch:
                    self.skip_output_through[output.output_name] = through
                    log.warning("Pipeline %s: output %s already shows batches up to %d, past "
                                "restored checkpoint %d (batch %d); replayed batches up to %d "
                                "skip it", self.name, output.output_name, through,
                                chosen.checkpoint_id, chosen.barrier_batch, through)
                elif through is not None and chosen is None:
                    self.skip_output_through[output.output_name] = through
                output.two_phase.cleanup_staging()
        replay_from = chosen.barrier_batch + 1 if chosen else 0
        pending = [a for a in records if a.batch_id >= replay_from]
        if pending and pending[0].batch_id != replay_from:
            what = f"checkpoint {chosen.checkpoint_id}" if chosen else "from the start"
            raise CheckpointError(
                f"pipeline {self.name}: restoring {what} "
                f"needs the allocation of batch {replay_from}, but the oldest kept is "
                f"{pending[0].batch_id}; it cannot be replayed"
            )
        if self._skipped_checkpoints:
            log.warning("Pipeline %s: not deleting unreferenced state files this start: "
                        "checkpoint(s) %s could not be read and may only be unreachable for "
                        "now", self.name, self._skipped_checkpoints)
        else:
            self._cleanup_state(retained)
        self.coordinator = CheckpointCoordinator(
            self.name, self.pipeline_id, CheckpointConfig(
                interval_ms=s.checkpoint_interval_ms, min_pause_ms=s.checkpoint_min_pause_ms,
                max_concurrent=s.checkpoint_max_concurrent, timeout_ms=s.checkpoint_timeout_ms,
                tolerable_failures=s.checkpoint_tolerable_failures,
                retained=s.checkpoint_retained, mode=s.checkpoint_mode),
            storage, completed=list(reversed(retained)), next_id=storage.highest_id() + 1,
            listeners=list(self.transactions.values()), on_failure=self._checkpoint_failed,
            on_stats=self._checkpoint_stats, delete_files=self._delete_state_files,
            live_files=self._live_state_files, fence=self.check_fenced, clock=self.clock,
            pre_commit=self._pre_commit_sinks)
        if chosen is not None:
            log.info("Pipeline %s: restored checkpoint %d (barrier after batch %d); replaying "
                     "%d batch(es)", self.name, chosen.checkpoint_id, chosen.barrier_batch,
                     len(pending))
        return pending

    def _choose_checkpoint(self, storage: CheckpointStorage, restore_id: int | None,
                           ) -> tuple[CompletedCheckpoint | None, list[CompletedCheckpoint]]:
        """The checkpoint to restore (the latest readable one, or ``restore_id``) and the
        retained ones, newest first."""
        ids = storage.completed_ids()
        if restore_id is not None and restore_id not in ids:
            raise CheckpointError(
                f"pipeline {self.name}: expected checkpoint {restore_id} in {storage.uri}, "
                f"found completed checkpoints {ids or 'none'}"
            )
        usable: list[CompletedCheckpoint] = []
        self._skipped_checkpoints: list[int] = []
        for cid in reversed(ids):
            if restore_id is not None and cid > restore_id:
                continue
            try:
                meta = storage.read_metadata(cid, self.pipeline_id or None)
                missing = [p for p, size in zip(*_state_paths(meta), strict=True)
                           if size is None]
                if missing:
                    raise CheckpointError(
                        f"checkpoint {cid} references {len(missing)} missing state file(s), "
                        f"e.g. {missing[0]}"
                    )
            except CheckpointError as exc:
                if cid == restore_id:
                    raise
                log.warning("Pipeline %s: checkpoint %d cannot be restored (%s); falling back "
                            "to the previous one", self.name, cid, exc)
                self._skipped_checkpoints.append(cid)
                continue
            usable.append(CompletedCheckpoint(cid, int(meta["barrier_batch"]), meta))
            if len(usable) >= self.settings.checkpoint_retained:
                break
        return (usable[0] if usable else None), usable

    def _cleanup_state(self, retained: list[CompletedCheckpoint]) -> None:
        """Delete state files no retained checkpoint references (left by a crashed run)."""
        keep = {p for c in retained for p in c.state_files()}
        keep_names = {p.rsplit("/", 1)[-1] for p in keep}
        doomed = []
        for info in self.storage.list_files(join(self.root, "state"), recursive=True):
            if info.base_name not in keep_names:
                doomed.append(info.path)
        for path in doomed:
            try:
                self.storage.fs.delete_file(path)
            except OSError as exc:
                log.warning("Pipeline %s: could not delete orphan state file %s: %s",
                            self.name, path, exc)
        if doomed:
            log.info("Pipeline %s: deleted %d state file(s) no retained checkpoint references",
                     self.name, len(doomed))

    def _delete_state_files(self, paths: list[str]) -> None:
        for path in paths:
            try:
                self.storage.fs.delete_file(self.storage.fs_path(path))
            except OSError as exc:
                log.warning("Pipeline %s: could not delete state file %s: %s", self.name, path,
                            exc)

    def _pre_commit_sinks(self, checkpoint_id: int, batch_id: int,
                          ) -> dict[str, TaskAck | Exception]:
        """At the barrier of ``checkpoint_id`` after ``batch_id`` (the coordinator's thread):
        every two-phase sink's acknowledgement, or why it declined."""
        out: dict[str, TaskAck | Exception] = {}
        for name, txns in self.transactions.items():
            t0 = time.perf_counter()
            try:
                state = txns.pre_commit(checkpoint_id, batch_id)
            except Exception as exc:  # noqa: BLE001 - a declined checkpoint, not a crash
                out[f"sink:{name}"] = exc
                continue
            out[f"sink:{name}"] = TaskAck(f"sink:{name}", state, {
                "sync_ms": int((time.perf_counter() - t0) * 1000)})
        return out

    def _live_state_files(self) -> set[str]:
        return {f for op in self.graph.stateful for f in op.live_files}

    def _checkpoint_failed(self, exc: BaseException) -> None:
        log.error("%s", exc)
        self._finish(exc)

    def _checkpoint_stats(self, stats: dict[str, Any]) -> None:
        self.recent_checkpoints.append(stats)
        del self.recent_checkpoints[:-100]
        notify(self.listeners, "on_checkpoint", stats)

    def checkpoint_handles(self, operator: str, checkpoint_id: int) -> list[Any]:
        """The state handles of ``operator`` in completed checkpoint ``checkpoint_id``."""
        from spark_ckpt.state.chain import StateHandle

        if self.checkpoint_storage is None:
            raise CheckpointError(f"pipeline {self.name}: not started with checkpointing")
        meta = self.checkpoint_storage.read_metadata(checkpoint_id)
        handles = meta.get("operators", {}).get(operator, {}).get("handles", {})
        return [StateHandle.from_json(h) for _p, h in
                sorted(handles.items(), key=lambda kv: int(kv[0]))]

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
        if self.coordinator is not None:  # restores replay from the oldest retained barrier
            below = min(below, self.coordinator.oldest_barrier)
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
        if self.coordinator is not None:
            self.coordinator.stop()
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
        self.scheduler.graceful = graceful
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

    def process_available(self, timeout: float | None = None, *,
                          restore_checkpoint: int | None = None) -> list[dict[str, Any]]:
        """Start in available-now mode, wait until done, return this run's progress."""
        self.start(available_now=True, restore_checkpoint=restore_checkpoint)
        if not self.await_termination(timeout):
            self.stop(graceful=False)
            raise PipelineFailedError(f"pipeline {self.name}: not done after {timeout} s")
        return list(self.recent_progress)


def _state_paths(meta: dict[str, Any]) -> tuple[list[str], list[int | None]]:
    paths = sorted({f["path"] for op in meta.get("operators", {}).values()
                    for h in op.get("handles", {}).values() for f in h.get("files", [])})
    return paths, stat_any(paths)
