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
import os
import uuid
from collections.abc import Sequence
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
from spark_ckpt.formats import dump_record
from spark_ckpt.names import check_name
from spark_ckpt.options import Settings
from spark_ckpt.sinks.dead_letters import DeadLetters
from spark_ckpt.sinks.positions import (
    SinkPosition,
    past_committed_ids,
    read_positions,
    refuse_if_ahead,
)
from spark_ckpt.sinks.two_phase import SinkTransactions
from spark_ckpt.sources.delta_stream import DeltaStreamSource
from spark_ckpt.sources.file_stream import FileStreamSource
from spark_ckpt.sources.generator import GeneratorSource
from spark_ckpt.sources.receivers import QueueSource, SocketSource
from spark_ckpt.sources.source import Source
from spark_ckpt.storage import Storage, join
from spark_ckpt.storage.fencing import Fence, client_session, interrupt_earlier_clients
from spark_ckpt.streaming.runtime.allocations import AllocationStore, RecordedInputs
from spark_ckpt.streaming.runtime.batch_queue import BatchQueue, QueuedBatch
from spark_ckpt.streaming.runtime.history import RecentHistory
from spark_ckpt.streaming.runtime.housekeeping import PipelineHousekeeping
from spark_ckpt.streaming.runtime.job_generator import JobGenerator
from spark_ckpt.streaming.runtime.lifecycle import Lifecycle, PipelineState
from spark_ckpt.streaming.runtime.metalog import MetadataLog
from spark_ckpt.streaming.runtime.operators import OperatorStates
from spark_ckpt.streaming.runtime.pipeline_dir import METADATA_VERSION, read_pipeline_metadata
from spark_ckpt.streaming.runtime.pipeline_loop import (
    CheckpointFailed,
    CheckpointStats,
    PipelineLoop,
    StartFailed,
    StopRequested,
)
from spark_ckpt.streaming.runtime.progress import ProgressLog, StreamingListener
from spark_ckpt.streaming.runtime.receiver_tracker import ReceiverTracker
from spark_ckpt.streaming.runtime.restore import CheckpointRestore
from spark_ckpt.streaming.runtime.restore_requests import read_restore_request, take_restore_request
from spark_ckpt.streaming.runtime.runs import run_numbers
from spark_ckpt.streaming.runtime.scheduler import JobScheduler
from spark_ckpt.streaming.runtime.stop_control import StopControl
from spark_ckpt.streaming.template.batch_run import BatchAllocation
from spark_ckpt.streaming.template.definition import PipelineDefinition
from spark_ckpt.streaming.template.keyed import KeyedStream
from spark_ckpt.streaming.template.stream import InputStream, Stream
from spark_ckpt.streaming.template.stream_graph import StreamGraph

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = ["StreamingContext"]

log = logging.getLogger(__name__)


class StreamingContext:
    """A streaming pipeline bound to an existing SparkSession (never creates one).

    Threads and owners. The template (graph, sources, outputs) and the pipeline's
    definition (what the template, the sources and the sinks see instead of this object) are
    built by the user's thread before ``start()`` and never change after it. ``start()`` sets
    up, on the user's thread, everything the pipeline's threads read (logs, tracker,
    transactions, coordinator, the restored checkpoint, the operators' runtime state) before
    it starts any of them, and hands each piece to its owner: the :class:`PipelineLoop`'s
    thread owns the schedule, the in-flight batches, allocations, the progress history,
    failures and stop; the JobScheduler's thread owns the batch run, the operators' runtime
    state and the commit records; the coordinator's thread owns checkpoints and their history.
    This object's ``stop()`` posts an event; its readers (``recent_progress``,
    ``last_progress``, ``recent_checkpoints``) return copies of immutable snapshots. This class
    is the user's façade and the wiring: the template, start, stop, progress.
    """

    def __init__(self, spark: SparkSession, batch_interval: float, checkpoint_dir: str,
                 name: str, *, settings: Settings | None = None,
                 clock: Clock | None = None) -> None:
        if batch_interval <= 0:
            raise JobDefinitionError(
                f"pipeline {name}: expected batch_interval > 0 seconds, found {batch_interval!r}"
            )
        check_name("pipeline name", name)
        self.batch_interval = float(batch_interval)
        # what the template, the sources and the sinks see of this pipeline (never this object)
        self._definition = PipelineDefinition(
            spark, name, settings or Settings.from_conf(spark.conf),  # type: ignore[arg-type]
            Storage(checkpoint_dir), clock or SystemClock())
        self.listeners: list[StreamingListener] = []
        self.dead_letters = DeadLetters(self._definition)
        self._progress = RecentHistory()  # one writer: the pipeline loop's thread
        self._checkpoint_history = RecentHistory()  # one writer: the coordinator's thread
        self._sources: list[Source] = []
        self._run: int | None = None
        self._claimed: Any = None  # when this run claimed the directory (storage clock)
        self._fence = Fence(self.storage, self.root, f"pipeline {name}", clock=self.clock)
        self._lifecycle = Lifecycle(name)
        self._allocation_store: AllocationStore | None = None
        self.tracker: ReceiverTracker | None = None
        self.scheduler: JobScheduler | None = None
        self.generator: JobGenerator | None = None
        self.loop: PipelineLoop | None = None
        self._inputs: RecordedInputs | None = None
        self._operators: OperatorStates | None = None
        self.owner_tag = ""  # tags every Spark operation of this run (Spark Connect)
        self.checkpointing = False
        self.coordinator: CheckpointCoordinator | None = None
        self.checkpoint_storage: CheckpointStorage | None = None
        self.transactions: dict[str, SinkTransactions] = {}
        self.restored: CompletedCheckpoint | None = None
        self.skip_output_through: dict[str, int] = {}  # output -> last batch already visible
        self.sink_positions: dict[str, SinkPosition] = {}  # read at start, then read-only

    # -- the definition (fixed once start() runs; any thread may read it) -------------------
    @property
    def spark(self) -> SparkSession:
        return self._definition.spark

    @property
    def name(self) -> str:
        return self._definition.name

    @property
    def settings(self) -> Settings:
        return self._definition.settings

    @property
    def storage(self) -> Storage:
        return self._definition.storage

    @property
    def root(self) -> str:
        return self._definition.root

    @property
    def clock(self) -> Clock:
        return self._definition.clock

    @property
    def graph(self) -> StreamGraph:
        return self._definition.graph

    @property
    def pipeline_id(self) -> str:
        return self._definition.pipeline_id

    @property
    def lineage(self) -> str:
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
        if self._inputs is None:
            raise JobDefinitionError(
                f"pipeline {self.name}: batch {batch_id} is not recorded (the pipeline has not "
                "started)")
        return self._inputs.allocation(batch_id)

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

    def _metadata(self) -> None:
        path = join(self.root, "metadata.json")
        sources = {s.name: s.describe() for s in self._sources}
        record = read_pipeline_metadata(self.storage, self.root)  # as the tools read it
        if record is not None:
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
            self._definition.schemas = dict(record.get("schemas", {}))
            self._definition.pipeline_id = str(record.get("pipeline_id", ""))
        elif not self.pipeline_id:
            self._definition.pipeline_id = uuid.uuid4().hex[:16]
        if self.pipeline_id:
            self._definition.lineage = f"{self.name}-{self.pipeline_id}"
        schemas = {s.name: s.schema().json() for s in self._sources}
        for name, schema in schemas.items():
            old = self._definition.schemas.get(name)
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
                "batch_interval_s": self.batch_interval,
                # where its checkpoints are (spark.ckpt.checkpoint.dir may put them elsewhere):
                # spark-ckpt status, cleanup and report find them without being told
                # relative when inside this directory: a copy's tools find its own
                "checkpoints": _absolute(self.settings.checkpoint_dir) or "checkpoints"}
        self._definition.schemas = schemas
        self.storage.write_atomic(path, dump_record("pipeline-metadata", METADATA_VERSION, body))

    def _claim_run(self) -> int:
        """Number this driver's run (``runs/<n>.json``) and claim the checkpoint directory
        with a fence commit, which decides ownership even where create-if-absent is not
        atomic (object stores)."""
        runs = join(self.root, "runs")
        self.storage.makedirs(runs)
        while True:
            number = max(self._runs(), default=0) + 1
            tag = f"spark_ckpt-{self.lineage}-r{number}"
            body = {"pipeline": self.name, "started_ms": self.clock.now_ms(),
                    **client_session(self.spark, tag)}
            if self.storage.create_exclusive(join(runs, f"{number:08d}.json"),
                                             dump_record("pipeline-run", 1, body)):
                self._fence.claim(f"run {number}")
                self.owner_tag = tag
                interrupt_earlier_clients(
                    self.spark, self.storage,
                    [join(runs, f"{n:08d}.json") for n in range(max(1, number - 3), number)],
                    "pipeline-run", f"Pipeline {self.name} run {number}")
                return number

    def _runs(self) -> list[int]:
        return run_numbers(self.storage, self.root)

    def check_fenced(self) -> None:
        """Raise if a newer driver claimed this checkpoint directory (any thread)."""
        if self._run is None:
            return
        if self._fence.is_fenced() or self.storage.exists(
                join(self.root, "runs", f"{self._run + 1:08d}.json")):
            raise JobFencedError(
                f"pipeline {self.name}: a newer driver started on this checkpoint directory; "
                f"this driver (run {self._run}) stops without committing"
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
        self._lifecycle.begin_start()
        try:
            pending, next_batch = self._prepare(available_now, restore_checkpoint)
        except BaseException as exc:
            log.error("Pipeline %s: start failed: %s", self.name, exc)
            self._lifecycle.start_failed(exc)
            if self._run and not isinstance(exc, JobFencedError):  # for spark-ckpt status
                StopControl(self.storage, self.root, self.name, self._run).record_end(
                    "failed", f"start failed: {type(exc).__name__}: {exc}", None, None,
                    self.clock.now_ms())
            raise
        # RUNNING before any thread starts, so a failure on one of them finishes the pipeline
        stop_requested = self._lifecycle.started()
        log.info("Pipeline %s run %d: starting at batch %d; %d allocated batch(es) to rerun%s",
                 self.name, self._run, next_batch, len(pending),
                 f" ({[a.batch_id for a in pending]})" if pending else "")
        assert self.tracker is not None and self.scheduler is not None
        assert self.loop is not None
        try:
            self.tracker.start()
            if self.coordinator is not None:
                self.coordinator.start()
            self.scheduler.start()
        except BaseException as exc:
            self._lifecycle.finish(exc)  # the outcome, before start() raises it
            self.loop.post(StartFailed(exc))  # the loop stops what started, then terminates
            self.loop.start()
            raise
        self.loop.start()
        if stop_requested:
            self.loop.post(StopRequested(graceful=False, cancel=False))

    def _prepare(self, available_now: bool, restore_checkpoint: int | None,
                 ) -> tuple[list[BatchAllocation], int]:
        """Everything ``start()`` does before any thread runs: restore, pick the batches to
        rerun, build the generator and the scheduler. Starts nothing."""
        self.graph.validate()
        self.storage.makedirs(self.root)
        self._metadata()
        self._run = self._claim_run()
        self._claimed = self._claimed_at()
        self._allocations = MetadataLog(self.storage, join(self.root, "allocations"),
                                        "allocation")
        self._allocation_store = AllocationStore(self._allocations)
        self._inputs = RecordedInputs(self.name, self.spark, self.dead_letters,
                                      self._allocation_store,
                                      self.settings.stream_min_batches_to_retain)
        self._operators = OperatorStates(self._definition.snapshots,
                                         transactions=self.transactions,
                                         skip_output_through=self.skip_output_through)
        self.commits = MetadataLog(self.storage, join(self.root, "commits"), "batch-commit")
        self.driver_state = MetadataLog(self.storage, join(self.root, "driver"), "driver-state")
        self.progress_log = ProgressLog(self.storage, self.root)
        self._set_aside_torn_records()
        self.tracker = ReceiverTracker(self.name, self._sources, self._allocation_store,
                                       self.clock)
        records = self.tracker.restore()
        self._read_sink_positions(records)
        self.checkpointing = self._checkpointing_wanted()
        if self.checkpointing:
            pending = self._setup_checkpointing(records, restore_checkpoint)
        else:
            # each kept commit record is loaded (and so checked): a hand-edited one stops here
            kept = {b: self.commits.get(b) for b in self.commits.batch_ids()}
            committed = {b for b, record in kept.items() if record}
            self._refuse_staged_two_phase(kept)
            pending = [a for a in records if a.batch_id not in committed]
        batches = BatchQueue()
        self.scheduler = JobScheduler(
            self.name, session=self.spark, owner_tag=self.owner_tag, graph=self.graph,
            inputs=self._inputs, sources=list(self.tracker.sources), operators=self._operators,
            transactions=self.transactions, skip_output_through=self.skip_output_through,
            commits=self.commits, coordinator=self.coordinator, fence=self.check_fenced,
            batches=batches, checkpoints=self._checkpoint_history, post=self._post,
            clock=self.clock,
            final_checkpoint_bound_s=2 * self.settings.checkpoint_timeout_ms / 1000 + 600,
            restored_barrier=self.restored.barrier_batch if self.restored else None)
        for allocation in pending:  # no in-flight slot: they are not the generator's
            batches.put(QueuedBatch(allocation, recovered=True))
        next_batch = max((a.batch_id for a in records), default=-1) + 1
        self.generator = JobGenerator(
            self.name, tracker=self.tracker, batches=batches, driver_state=self.driver_state,
            positions=self.positions, fence=self.check_fenced, clock=self.clock,
            interval_ms=int(round(self.batch_interval * 1000)), next_batch=next_batch,
            skip_empty=self.settings.stream_skip_empty_batches or available_now)
        housekeeping = PipelineHousekeeping(
            self.name, progress=self._progress, progress_log=self.progress_log,
            listeners=self.listeners, tracker=self.tracker,
            coordinator=self.coordinator, outputs=list(self.graph.outputs),
            commits=self.commits, driver_state=self.driver_state,
            keep_batches=max(self.settings.stream_min_batches_to_retain,
                             self.graph.remember_batches),
            fence=self.check_fenced)
        self.loop = PipelineLoop(
            self.name, lifecycle=self._lifecycle, generator=self.generator, batches=batches,
            scheduler=self.scheduler, housekeeping=housekeeping, clock=self.clock,
            max_in_flight=self.settings.stream_max_batches_in_flight,
            available_now=available_now,
            stop_control=StopControl(self.storage, self.root, self.name, self._run),
            stop_poll_ms=self.settings.stream_stop_poll_interval_ms)
        return pending, next_batch

    def _checkpoints_uri(self) -> str:
        """Where this pipeline's checkpoints are (spark.ckpt.checkpoint.dir, or inside)."""
        return _absolute(self.settings.checkpoint_dir) or \
            self.storage.spark_path(join(self.root, "checkpoints"))

    def _read_sink_positions(self, records: list[BatchAllocation]) -> None:
        """Read where every sink stands and refuse a directory they are ahead of (nothing
        runs); the positions are kept for the checkpoint set-up."""
        # a driver that lost the race to claim stops here: reading a Parquet two-phase sink's
        # position finishes a commit a crash left half done
        self.check_fenced()
        for output in self.graph.outputs:
            if output.two_phase is not None:
                output.two_phase.lineage = self.lineage
                output.two_phase.claimed_at = self._claimed
        known = max([a.batch_id for a in records] + list(self.commits.batch_ids())
                    + list(self.driver_state.batch_ids()), default=-1)
        self.sink_positions = read_positions(self.graph.outputs, self.dead_letters,
                                             [s.name for s in self._sources])
        refuse_if_ahead(self.name, self.storage.spark_path(self.root), self.sink_positions,
                        known, CheckpointStorage(self._checkpoints_uri()).highest_id())

    def _refuse_staged_two_phase(self, kept: dict[int, dict[str, Any] | None]) -> None:
        """A start without checkpoints takes a batch with a commit record as done. A run with
        checkpoints writes that record once the batch's output is *staged* for a two-phase
        commit, which only a completed checkpoint makes visible: switching checkpoints off
        after such a run would skip those batches. Refused, naming them, unless every output
        already shows them."""
        shown = [p.batch if p.batch is not None else -1 for name, p in
                 self.sink_positions.items()
                 if any(o.output_name == name and o.two_phase is not None
                        for o in self.graph.outputs)]
        if not shown:
            return
        visible = min(shown)
        # records written before they said how their output was committed: staged if this
        # directory ever checkpointed
        ever = CheckpointStorage(self._checkpoints_uri()).highest_id() > 0
        staged = sorted(b for b, record in kept.items() if record and b > visible and (
            record.get("two_phase") or ("two_phase" not in record and ever)))
        if staged:
            raise CheckpointError(
                f"pipeline {self.name}: expected every batch with a commit record to be "
                f"visible in its outputs, found batches {staged[0]}..{staged[-1]} staged by a "
                "run with checkpoints for a two-phase commit that no completed checkpoint made "
                f"visible (the outputs show batches through {visible}). Without checkpoints "
                "(spark.ckpt.checkpoint.enabled=false, or auto with no keyed state) they would "
                "count as done and their rows never appear. Nothing ran. Start once with "
                "spark.ckpt.checkpoint.enabled=true (the restore commits or replays them), "
                "then switch it off"
            )

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
        uri = self._checkpoints_uri()
        storage = self.checkpoint_storage = CheckpointStorage(uri)
        self._definition.checkpoints = storage
        # spark-ckpt restore's request, when the code or the settings name no checkpoint
        requested = None if restore_id or s.checkpoint_restore_from else \
            read_restore_request(self.storage, self.root)
        if requested is None and (restore_id or s.checkpoint_restore_from) and \
                self.storage.exists(join(self.root, "control", "restore.json")):
            log.warning("Pipeline %s: restoring checkpoint %s as the code or settings ask; a "
                        "`spark-ckpt restore` request in control/restore.json is left for a "
                        "later start (cancel it with `spark-ckpt restore CKPT_DIR --cancel`)",
                        self.name, restore_id or s.checkpoint_restore_from)
        restore_id = restore_id or s.checkpoint_restore_from or requested or None
        restore = CheckpointRestore(self.name, self.pipeline_id, self.storage, self.root,
                                    storage, retained=s.checkpoint_retained,
                                    fence=self.check_fenced)
        try:
            chosen, retained = restore.choose(restore_id)
        except CheckpointError as exc:
            if requested is None:
                raise
            raise CheckpointError(
                f"{exc} (asked by `spark-ckpt restore` in {self.storage.spark_path(self.root)}"
                "/control/restore.json; ask for another id, or cancel with `spark-ckpt "
                "restore CKPT_DIR --cancel`)") from exc
        self.restored = chosen
        operators = chosen.metadata.get("operators", {}) if chosen else {}
        assert self._operators is not None
        for op in self.graph.stateful:  # writes nothing; may refuse the declared state
            self._operators.add(op, op.configure(operators.get(op.operator)))
        if chosen is not None and restore_id is not None:
            restore.abandon_newer(chosen)  # only once nothing refused the restore
            if requested is not None:
                take_restore_request(self.storage, self.root, requested)
                log.info("Pipeline %s: restored checkpoint %d as `spark-ckpt restore` asked",
                         self.name, chosen.checkpoint_id)
        # a driver that lost the race to claim stops before it commits pending transactions
        # or deletes staged and state files: those may already be the newer owner's
        self.check_fenced()
        if s.checkpoint_mode == "exactly_once":
            sinks = chosen.metadata.get("sinks", {}) if chosen else {}
            for output in self.graph.outputs:
                if output.two_phase is None:
                    continue
                txns = SinkTransactions(output.two_phase, self.name)
                self.transactions[output.output_name] = txns
                txns.recover(sinks.get(output.output_name, {}).get("pending", []))
                through = self.sink_positions[output.output_name].batch
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
        if restore.skipped:
            log.warning("Pipeline %s: not deleting unreferenced state files this start: "
                        "checkpoint(s) %s could not be read and may only be unreachable for "
                        "now", self.name, restore.skipped)
        else:
            restore.cleanup_state(retained, self._claimed)  # checks the fence before deleting
            restore.discard_unretained(retained)
        self.coordinator = CheckpointCoordinator(
            self.name, self.pipeline_id, CheckpointConfig.from_settings(s), storage,
            completed=list(reversed(retained)),
            next_id=restore.first_checkpoint_id(self._run or 0, s.checkpoint_max_concurrent,
                                                past_committed_ids(self.sink_positions)),
            listeners=list(self.transactions.values()),
            on_failure=lambda exc: self._post(CheckpointFailed(exc)),
            on_stats=self._checkpoint_stats,
            delete_files=restore.delete_state_files,
            live_files=self._operators.live_files, fence=self.check_fenced, clock=self.clock,
            pre_commit=self._pre_commit_sinks)
        self._operators.release_to(self.coordinator.release_files)
        if chosen is not None:
            log.info("Pipeline %s: restored checkpoint %d (barrier after batch %d); replaying "
                     "%d batch(es)", self.name, chosen.checkpoint_id, chosen.barrier_batch,
                     len(pending))
        return pending

    def _claimed_at(self) -> Any:
        """When this driver claimed the checkpoint directory, by the storage's own clock (the
        modification time of its run marker): a file modified since then is not a crashed
        run's leftover but a newer driver's work (found racing two real drivers: the loser's
        start-up deleted the owner's fresh state file between its fence check and the
        deletion)."""
        if self._run is None:
            return None
        return self.storage.fs.get_file_info(
            join(self.root, "runs", f"{self._run:08d}.json")).mtime

    def _set_aside_torn_records(self) -> None:
        """A crash mid-write on a store without atomic publish can leave the newest allocation
        or commit record torn. A torn allocation of a batch that was never submitted (no
        driver state, no commit) and a torn commit record (its batch reruns; the sinks
        recognize what they already show) are set aside; anything else stops the start."""
        ran = set(self.commits.batch_ids()) | set(self.driver_state.batch_ids())
        # only the owner moves records; the check runs again right before each move
        self._allocations.set_aside_torn_tail(lambda b: b not in ran, self.check_fenced)
        self.commits.set_aside_torn_tail(lambda _b: True, self.check_fenced)

    def _pre_commit_sinks(self, checkpoint_id: int, batch_id: int,
                          ) -> dict[str, TaskAck | Exception]:
        """At the barrier of ``checkpoint_id`` after ``batch_id`` (the coordinator's thread):
        every two-phase sink's acknowledgement, or why it declined."""
        out: dict[str, TaskAck | Exception] = {}
        for name, txns in self.transactions.items():
            t0 = self.clock.monotonic_s()
            try:
                state = txns.pre_commit(checkpoint_id, batch_id)
            except Exception as exc:  # noqa: BLE001 - a declined checkpoint, not a crash
                out[f"sink:{name}"] = exc
                continue
            out[f"sink:{name}"] = TaskAck(f"sink:{name}", state, {
                "sync_ms": int((self.clock.monotonic_s() - t0) * 1000)})
        return out

    def checkpoint_handles(self, operator: str, checkpoint_id: int) -> list[Any]:
        """The state handles of ``operator`` in completed checkpoint ``checkpoint_id``."""
        return self._definition.checkpoint_handles(operator, checkpoint_id)

    @property
    def last_progress(self) -> dict[str, Any] | None:
        """The progress of the last batch this context completed (a copy; None before the
        first)."""
        return copy.deepcopy(self._progress.last())

    def _checkpoint_stats(self, stats: dict[str, Any]) -> None:
        """A checkpoint ended (the coordinator's thread, before its waiters are told)."""
        self._checkpoint_history.append(stats)
        self._post(CheckpointStats(stats))

    def _post(self, event: Any) -> None:
        """Hand ``event`` to the pipeline loop (any thread; never blocks)."""
        assert self.loop is not None
        self.loop.post(event)

    def stop(self, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop: ``graceful`` finishes the running batch first and takes a final checkpoint;
        otherwise it is cancelled (it reruns on restart). Batches allocated but not started
        rerun on restart. A no-op on a pipeline that never started, already stopped, or whose
        start failed. From a listener (the loop's own thread) it asks and returns at once."""
        state = self._lifecycle.request_stop()
        if state in (PipelineState.CREATED, PipelineState.STOPPED, PipelineState.FAILED):
            return
        if state in (PipelineState.RUNNING, PipelineState.STOPPING):  # STARTING: start()
            self._post(StopRequested(graceful=graceful, cancel=not graceful))  # stops it
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

        return bootstrap_state(self, frames)

    def process_available(self, timeout: float | None = None, *,
                          restore_checkpoint: int | None = None) -> list[dict[str, Any]]:
        """Start in available-now mode, wait until done, return this run's progress."""
        self.start(available_now=True, restore_checkpoint=restore_checkpoint)
        if not self.await_termination(timeout):
            self.stop(graceful=False)
            raise PipelineFailedError(f"pipeline {self.name}: not done after {timeout} s")
        return self.recent_progress


def _absolute(path: str) -> str:
    """A local path made absolute (a relative spark.ckpt.checkpoint.dir means the driver's
    working directory, which the tools do not know); URIs as they are."""
    if not path or "://" in path or path.startswith("file:"):
        return path
    return os.path.abspath(path)
