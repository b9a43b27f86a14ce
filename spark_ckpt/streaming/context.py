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

import copy
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import JobDefinitionError, PipelineFailedError
from spark_ckpt.names import check_name
from spark_ckpt.options import Settings
from spark_ckpt.sinks.dead_letters import DeadLetters
from spark_ckpt.sources.delta_stream import DeltaStreamSource
from spark_ckpt.sources.delta_table import DeltaTableSource
from spark_ckpt.sources.file_stream import FileStreamSource
from spark_ckpt.sources.generator import GeneratorSource
from spark_ckpt.sources.kafka import KafkaSource
from spark_ckpt.sources.receivers import QueueSource, SocketSource
from spark_ckpt.sources.source import Source
from spark_ckpt.storage import Storage, s3
from spark_ckpt.streaming.runtime.history import RecentHistory
from spark_ckpt.streaming.runtime.lifecycle import Lifecycle, PipelineState
from spark_ckpt.streaming.runtime.pipeline_loop import StopRequested
from spark_ckpt.streaming.runtime.progress import StreamingListener
from spark_ckpt.streaming.runtime.run_claim import RunClaim
from spark_ckpt.streaming.runtime.start import PipelineStart
from spark_ckpt.streaming.template.batch_run import BatchAllocation
from spark_ckpt.streaming.template.definition import PipelineDefinition
from spark_ckpt.streaming.template.keyed import KeyedStream
from spark_ckpt.streaming.template.stream import InputStream, Stream
from spark_ckpt.streaming.template.stream_graph import StreamGraph

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from spark_ckpt.checkpoint import CheckpointCoordinator, CheckpointStorage, CompletedCheckpoint
    from spark_ckpt.sinks.positions import SinkPosition
    from spark_ckpt.sinks.two_phase import SinkTransactions
    from spark_ckpt.streaming.runtime.job_generator import JobGenerator
    from spark_ckpt.streaming.runtime.metalog import MetadataLog
    from spark_ckpt.streaming.runtime.pipeline_loop import PipelineLoop
    from spark_ckpt.streaming.runtime.progress import ProgressLog
    from spark_ckpt.streaming.runtime.receiver_tracker import ReceiverTracker
    from spark_ckpt.streaming.runtime.scheduler import JobScheduler

__all__ = ["StreamingContext"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Wired(Generic[T]):
    """A read-only view of what ``start()`` wired (:class:`PipelineStart`'s attribute of the
    same name: None, or empty, until then)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, ctx: StreamingContext | None, owner: type) -> T:
        if ctx is None:
            return self  # type: ignore[return-value]
        return getattr(ctx._start, self.name)  # type: ignore[no-any-return]  # noqa: SLF001


class StreamingContext:
    """A streaming pipeline bound to an existing SparkSession (never creates one).

    Threads and owners. The template (graph, sources, outputs) and the pipeline's
    definition (what the template, the sources and the sinks see instead of this object) are
    built by the user's thread before ``start()`` and never change after it. ``start()``
    (:class:`PipelineStart`) sets up, on the user's thread, everything the pipeline's threads
    read (metadata and the run's claim, logs, tracker, transactions, coordinator, the restored
    checkpoint, the operators' runtime state) before it starts any of them, and hands each
    piece to its owner: the :class:`PipelineLoop`'s thread owns the schedule, the in-flight
    batches, allocations, the progress history, failures and stop; the JobScheduler's thread
    owns the batch run, the operators' runtime state and the commit records; the
    coordinator's thread owns checkpoints and their history. This object's ``stop()`` posts
    an event; its readers (``recent_progress``, ``last_progress``, ``recent_checkpoints``)
    return copies of immutable snapshots, and what the start wired (``scheduler``, ``loop``,
    ``coordinator``, ``restored`` ...) is a read-only view. This class is the user's façade and
    the wiring: the template, start, stop, progress.
    """

    # what start() wired, read-only (None, or empty, before it)
    tracker: _Wired[ReceiverTracker | None] = _Wired()
    scheduler: _Wired[JobScheduler | None] = _Wired()
    generator: _Wired[JobGenerator | None] = _Wired()
    loop: _Wired[PipelineLoop | None] = _Wired()
    commits: _Wired[MetadataLog | None] = _Wired()
    driver_state: _Wired[MetadataLog | None] = _Wired()
    progress_log: _Wired[ProgressLog | None] = _Wired()
    checkpointing: _Wired[bool] = _Wired()
    coordinator: _Wired[CheckpointCoordinator | None] = _Wired()
    checkpoint_storage: _Wired[CheckpointStorage | None] = _Wired()
    restored: _Wired[CompletedCheckpoint | None] = _Wired()
    transactions: _Wired[dict[str, SinkTransactions]] = _Wired()
    skip_output_through: _Wired[dict[str, int]] = _Wired()  # output -> last batch already visible
    sink_positions: _Wired[dict[str, SinkPosition]] = _Wired()  # read at start, then read-only

    def __init__(self, spark: SparkSession, batch_interval: float, checkpoint_dir: str,
                 name: str, *, settings: Settings | None = None,
                 clock: Clock | None = None) -> None:
        if batch_interval <= 0:
            raise JobDefinitionError(
                f"pipeline {name}: expected batch_interval > 0 seconds, found {batch_interval!r}"
            )
        check_name("pipeline name", name)
        self.batch_interval = float(batch_interval)
        s3.configure(spark.conf)  # before the first Storage: S3 from spark.hadoop.fs.s3a.*
        # what the template, the sources and the sinks see of this pipeline (never this object)
        self._definition = PipelineDefinition(
            spark, name, settings or Settings.from_conf(spark.conf),  # type: ignore[arg-type]
            Storage(checkpoint_dir), clock or SystemClock())
        self.listeners: list[StreamingListener] = []
        self.dead_letters = DeadLetters(self._definition)
        self._progress = RecentHistory()  # one writer: the pipeline loop's thread
        self._checkpoint_history = RecentHistory()  # one writer: the coordinator's thread
        self._sources: list[Source] = []
        self._lifecycle = Lifecycle(name)
        # the metadata, the run marker and the fence; then everything start() wires
        self._claim = RunClaim(self._definition, self._sources, self.batch_interval)
        self._start = PipelineStart(
            self._definition, claim=self._claim, sources=self._sources,
            batch_interval=self.batch_interval, dead_letters=self.dead_letters,
            listeners=self.listeners, lifecycle=self._lifecycle, progress=self._progress,
            checkpoint_history=self._checkpoint_history)

    @property
    def owner_tag(self) -> str:
        """Tags every Spark operation of this run (Spark Connect)."""
        return self._claim.owner_tag

    # -- the definition (fixed once start() runs; any thread may read it) -------------------
    @property
    def spark(self) -> SparkSession:
        """The SparkSession the pipeline runs on."""
        return self._definition.spark

    @property
    def name(self) -> str:
        """The pipeline's name."""
        return self._definition.name

    @property
    def settings(self) -> Settings:
        """The pipeline's ``spark.ckpt.*`` options, read once when it was built."""
        return self._definition.settings

    @property
    def storage(self) -> Storage:
        """The storage of the checkpoint directory."""
        return self._definition.storage

    @property
    def root(self) -> str:
        """The checkpoint directory's path on its storage."""
        return self._definition.root

    @property
    def clock(self) -> Clock:
        """The clock the pipeline reads time from (injected; the system clock by default)."""
        return self._definition.clock

    @property
    def graph(self) -> StreamGraph:
        """The template's graph: its inputs and outputs."""
        return self._definition.graph

    @property
    def pipeline_id(self) -> str:
        """The id the checkpoint directory keeps across runs (fixed by ``start()``; empty
        before)."""
        return self._definition.pipeline_id

    @property
    def lineage(self) -> str:
        """What keys every sink transaction: ``<name>-<pipeline id>`` (``<name>`` for a
        directory made before pipeline ids existed); fixed by ``start()``."""
        return self._definition.lineage

    # -- sources -------------------------------------------------------------------------
    def _input(self, source: Source) -> InputStream:
        if self._lifecycle.state is not PipelineState.CREATED:
            raise JobDefinitionError(f"pipeline {self.name}: add sources before start()")
        check_name(f"pipeline {self.name}: source name", source.name)
        stream = InputStream(self._definition, source)
        source.bind(self._definition)
        self._sources.append(source)
        return stream

    def file_stream(self, name: str, path: str, format: str = "parquet",
                    schema: StructType | str | None = None, *,
                    max_files_per_batch: int | None = None,
                    max_bytes_per_batch: int | None = None,
                    options: dict[str, str] | None = None) -> InputStream:
        """New files of a directory (parquet, json or csv), oldest first."""
        return self._input(FileStreamSource(name, path, format, schema,
                                            max_files_per_batch=max_files_per_batch,
                                            max_bytes_per_batch=max_bytes_per_batch,
                                            options=options))

    def delta_stream(self, name: str, path: str, *, starting_version: int | None = None,
                     max_versions_per_batch: int | None = None, ignore_deletes: bool = False,
                     ignore_changes: bool = False,
                     skip_change_commits: bool = False) -> InputStream:
        """Rows of a Delta table: its current rows first, then the rows each later version
        adds, read from its commit log (as Delta Lake's streaming source reads a table).

        A new pipeline's first batch reads the table's snapshot at its latest version (unless
        ``starting_version`` says otherwise); later batches read the commits after it. Commits
        that change no data (OPTIMIZE, compaction, VACUUM, table properties) are skipped. A
        commit that removes data files stops the pipeline with a SourceError naming the version
        and the operation, unless an option below allows it (Delta Lake's streaming options of
        the same meaning; docs/streaming.md has a table per commit kind). The table's id is
        recorded: a table deleted and created again at the path stops the pipeline, naming
        both ids.

        Args:
            name: the source's name, unique in the pipeline.
            path: the table's path or URI.
            starting_version: None (the default): the first batch reads the table's rows at
                its latest version (a snapshot: what earlier commits deleted or rewrote is not
                read), then the changes after it. A version ``k`` (Delta's
                ``startingVersion``): no snapshot; the changes of versions ``k, k+1, ...`` are
                read commit by commit (a DELETE or UPDATE among them stops the pipeline unless
                an option below allows it), the rows written before ``k`` are not. Only a new
                pipeline reads it: a restart goes on from its recorded position.
            max_versions_per_batch: at most this many versions of changes per batch (skipped
                ones count); None: every version there is. The first batch's snapshot is one
                version, read whole.
            ignore_deletes: skip commits that only remove files (Delta's ``ignoreDeletes``:
                DELETE of whole files or partitions); the deleted rows stay downstream.
            ignore_changes: also read commits that rewrite files (UPDATE, MERGE, DELETE inside
                files, overwrite) as if they appended the files they added (Delta's deprecated
                ``ignoreChanges``): rows they did not change come again.
            skip_change_commits: skip every commit that removes files, and the files it added
                (Delta's ``skipChangeCommits``): deletes and rewrites are not propagated.
        """
        return self._input(DeltaStreamSource(name, path, starting_version=starting_version,
                                             max_versions_per_batch=max_versions_per_batch,
                                             ignore_deletes=ignore_deletes,
                                             ignore_changes=ignore_changes,
                                             skip_change_commits=skip_change_commits))

    def delta_table(self, name: str, path: str) -> InputStream:
        """A Delta table beside the streams, for ``stream.join_as_of(table, on, time_column)``
        (each row with the table as of its time); read as a stream, each batch's table as of
        the version its allocation recorded (sources/delta_table.py). It runs no batch by
        itself."""
        return self._input(DeltaTableSource(name, path))

    def kafka_stream(self, name: str, bootstrap_servers: str, *,
                     topics: list[str] | None = None, pattern: str | None = None,
                     starting_offsets: str | int | dict[str, dict[Any, int]] = "latest",
                     max_offsets_per_batch: int | None = None,
                     fail_on_data_loss: bool = True, options: dict[str, str] | None = None,
                     reader: str = "auto", min_partitions: int | None = None,
                     value_format: str | None = None, value_schema: Any = None,
                     metadata_columns: list[str] | dict[str, str] | None = None
                     ) -> InputStream:
        """Records of Kafka topics, in Spark's Kafka schema (key, value, topic, partition,
        offset, timestamp, timestampType, headers), or with ``value_format="json"`` each
        value's fields (as ``from_json`` gives them) and the metadata columns asked for; each
        batch's offset ranges are recorded before it runs, and a replay reads exactly them.
        Arguments as
        :class:`~spark_ckpt.sources.kafka.KafkaSource` (docs/kafka.md)."""
        source = KafkaSource(
            name, bootstrap_servers, topics=topics, pattern=pattern,
            starting_offsets=starting_offsets, max_offsets_per_batch=max_offsets_per_batch,
            fail_on_data_loss=fail_on_data_loss, options=options, reader=reader,
            min_partitions=min_partitions, value_format=value_format,
            value_schema=value_schema, metadata_columns=metadata_columns)
        stream = self._input(source)
        if source.group_id:
            self.add_listener(_ConsumedOffsets(self, source))
        return stream

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
        """Tell ``listener`` of every batch and checkpoint from now on."""
        self.listeners.append(listener)

    def keyed(self, parent: Stream, keys: Sequence[str], *, parallelism: int | None,
              max_parallelism: int | None) -> KeyedStream:
        """The keyed stream ``parent.key_by(*keys)`` makes (streams reach the keyed layer
        through their pipeline, not by importing it)."""
        return self._definition.keyed(parent, keys, parallelism=parallelism,
                                      max_parallelism=max_parallelism)

    # -- recorded state ------------------------------------------------------------------
    def recorded_schema(self, source: str) -> StructType | None:
        """The schema recorded for ``source`` (None when none is)."""
        return self._definition.recorded_schema(source)

    def allocation(self, batch_id: int) -> BatchAllocation:
        """The recorded allocation of ``batch_id`` (any thread)."""
        if self._start.inputs is None:
            raise JobDefinitionError(
                f"pipeline {self.name}: batch {batch_id} is not recorded (the pipeline has not "
                "started)")
        return self._start.inputs.allocation(batch_id)

    @property
    def recent_progress(self) -> list[dict[str, Any]]:
        """The progress of the last 100 batches, oldest first (a copy)."""
        return self._progress.snapshot()

    @property
    def recent_checkpoints(self) -> list[dict[str, Any]]:
        """Statistics of the last 100 checkpoints, oldest first (a copy)."""
        return self._checkpoint_history.snapshot()

    def positions(self) -> dict[str, Any]:
        """Each source's current position, by source name."""
        return {s.name: s.position() for s in self._sources}

    def check_fenced(self) -> None:
        """Raise if a newer driver claimed this checkpoint directory (any thread)."""
        self._claim.check_fenced()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, *, available_now: bool = False,
              restore_checkpoint: int | None = None) -> None:
        """Restore from the checkpoint, rerun unfinished batches, then tick.

        ``available_now``: process what the sources have now (in as many batches as their
        limits need), take a final checkpoint, then stop by itself.
        ``restore_checkpoint``: restore from this retained checkpoint id instead of the latest
        (``spark.ckpt.checkpoint.restoreFrom``).
        """
        self._start.start(available_now, restore_checkpoint)

    def checkpoint_handles(self, operator: str, checkpoint_id: int) -> list[Any]:
        """The state handles of ``operator`` in completed checkpoint ``checkpoint_id``."""
        return self._definition.checkpoint_handles(operator, checkpoint_id)

    @property
    def last_progress(self) -> dict[str, Any] | None:
        """The progress of the last batch this context completed (a copy; None before the
        first)."""
        return copy.deepcopy(self._progress.last())

    def stop(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop: ``graceful`` finishes the running batch first and takes a final checkpoint;
        otherwise it is cancelled (it reruns on restart). Batches allocated but not started
        rerun on restart. A no-op on a pipeline that never started, already stopped, or whose
        start failed. From a listener (the loop's own thread) it asks and returns at once."""
        state = self._lifecycle.request_stop()
        if state in (PipelineState.CREATED, PipelineState.STOPPED, PipelineState.FAILED):
            return
        if state in (PipelineState.RUNNING, PipelineState.STOPPING):  # STARTING: start()
            self._start.post(StopRequested(graceful=graceful, cancel=not graceful))  # stops it
        if self.loop is not None and self.loop.on_loop_thread:
            return
        self._lifecycle.terminated.wait(timeout)

    def await_termination(self, timeout: float | None = None) -> bool:
        """Wait for the pipeline to stop; True if it did. Raises the error that stopped it
        (or that made ``start()`` fail)."""
        if self.loop is not None and self.loop.on_loop_thread and \
                not self._lifecycle.terminated.is_set():
            raise JobDefinitionError(
                f"pipeline {self.name}: await_termination() called from a listener would wait "
                "for the thread that runs it; call stop() there, or wait on another thread"
            )
        stopped = self._lifecycle.terminated.wait(timeout)
        error = self._lifecycle.error
        if stopped and error is not None:
            raise error
        return stopped

    def bootstrap_state(self, frames: dict[str, DataFrame]) -> int:
        """Before the first ``start()``: write each named operator's state from a DataFrame
        (its key columns and state columns, see spark_ckpt/ops/state_processor.py) as the
        pipeline's first checkpoint, which ``start()`` then restores; returns its id."""
        from spark_ckpt.streaming.runtime.bootstrap import bootstrap_state

        return bootstrap_state(self._definition, frames, write_metadata=self._claim.write_metadata)

    def process_available(self, timeout: float | None = None, *,
                          restore_checkpoint: int | None = None) -> list[dict[str, Any]]:
        """Start in available-now mode, wait until done, return this run's progress."""
        self.start(available_now=True, restore_checkpoint=restore_checkpoint)
        if not self.await_termination(timeout):
            self.stop(graceful=False)
            raise PipelineFailedError(f"pipeline {self.name}: not done after {timeout} s")
        return self.recent_progress


class _ConsumedOffsets(StreamingListener):
    """Commits to a Kafka source's consumer group where it stands after each completed
    checkpoint's barrier batch, or, in a pipeline that does not checkpoint (its outputs commit
    per batch), after each committed batch (for lag monitors only: a restart reads the
    checkpoint)."""

    def __init__(self, ctx: StreamingContext, source: KafkaSource) -> None:
        self._ctx = ctx
        self._source = source

    def on_checkpoint(self, stats: dict[str, Any]) -> None:
        batch = stats.get("barrier_batch")
        if stats.get("status") != "completed" or batch is None or batch < 0:
            return
        self._commit(int(batch), int(stats["checkpoint_id"]))

    def on_batch_completed(self, progress: dict[str, Any]) -> None:
        if self._ctx.coordinator is None:  # no checkpoints: a committed batch is visible
            self._commit(int(progress["batch_id"]), -1)

    def _commit(self, batch: int, checkpoint_id: int) -> None:
        try:
            piece = self._ctx.allocation(batch).pieces.get(self._source.name)
        except Exception as exc:  # noqa: BLE001 - informational: the next checkpoint's covers it
            log.warning("Kafka source %s: no allocation of batch %s to commit offsets from: %s",
                        self._source.name, batch, exc)
            return
        if piece is not None:
            self._source.commit_consumed(checkpoint_id, piece)
