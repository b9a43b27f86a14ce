"""A pipeline's start: what ``StreamingContext.start()`` sets up, and the threads it starts.

:meth:`PipelineStart.start` writes the metadata and claims the run (:mod:`.run_claim`), opens
the per-batch logs and sets torn records aside, restores the allocations (ReceiverTracker),
reads where the outputs stand (:mod:`.output_positions`), sets up checkpointing
(:mod:`.checkpoint_setup`) or takes the committed batches as done, picks the batches to rerun,
builds the JobScheduler, the JobGenerator, the housekeeping and the :class:`PipelineLoop`,
and only then starts the receivers, the coordinator, the scheduler and the loop. A start that
fails before any thread runs records how the run ended (for ``spark-ckpt status``) and
leaves the pipeline FAILED; one that fails while its threads start hands the loop a
``StartFailed`` to stop what started.

Threads and owners: everything here runs on the user's thread, before any of the pipeline's
threads runs; what it builds is handed to its owner (the loop's thread: the schedule,
allocations, progress, the outcome; the JobScheduler's: the batch run, the operators' runtime
state, commit records; the coordinator's: checkpoints and their history) and its attributes
are read-only afterwards. :meth:`PipelineStart.post` (any thread, never blocks) hands an
event to the loop. It gets narrow collaborators (the definition, the run claim, the sources,
the listeners, the histories, the lifecycle), never the StreamingContext.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobFencedError
from spark_ckpt.sinks.two_phase import SinkTransactions
from spark_ckpt.storage import join
from spark_ckpt.streaming.runtime.allocations import AllocationStore, RecordedInputs
from spark_ckpt.streaming.runtime.batch_queue import BatchQueue, QueuedBatch
from spark_ckpt.streaming.runtime.checkpoint_setup import (
    checkpointing_wanted,
    checkpoints_uri,
    set_up_checkpointing,
)
from spark_ckpt.streaming.runtime.housekeeping import PipelineHousekeeping
from spark_ckpt.streaming.runtime.job_generator import JobGenerator
from spark_ckpt.streaming.runtime.metalog import MetadataLog
from spark_ckpt.streaming.runtime.operators import OperatorStates
from spark_ckpt.streaming.runtime.output_positions import (
    read_output_positions,
    refuse_staged_two_phase,
)
from spark_ckpt.streaming.runtime.pipeline_loop import (
    CheckpointFailed,
    CheckpointStats,
    PipelineLoop,
    StartFailed,
    StopRequested,
)
from spark_ckpt.streaming.runtime.progress import ProgressLog
from spark_ckpt.streaming.runtime.receiver_tracker import ReceiverTracker
from spark_ckpt.streaming.runtime.scheduler import JobScheduler
from spark_ckpt.streaming.runtime.stop_control import StopControl

if TYPE_CHECKING:
    from spark_ckpt.checkpoint import CheckpointCoordinator, CheckpointStorage, CompletedCheckpoint
    from spark_ckpt.sinks.dead_letters import DeadLetters
    from spark_ckpt.sinks.positions import SinkPosition
    from spark_ckpt.sources.source import Source
    from spark_ckpt.streaming.runtime.history import RecentHistory
    from spark_ckpt.streaming.runtime.lifecycle import Lifecycle
    from spark_ckpt.streaming.runtime.progress import StreamingListener
    from spark_ckpt.streaming.runtime.run_claim import RunClaim
    from spark_ckpt.streaming.template.batch_run import BatchAllocation
    from spark_ckpt.streaming.template.definition import PipelineDefinition

__all__ = ["PipelineStart", "set_aside_torn_records"]

log = logging.getLogger(__name__)


def set_aside_torn_records(allocations: MetadataLog, commits: MetadataLog,
                           driver_state: MetadataLog, fence: Callable[[], None]) -> None:
    """A crash mid-write on a store without atomic publish can leave the newest allocation
    or commit record torn. A torn allocation of a batch that was never submitted (no
    driver state, no commit) and a torn commit record (its batch reruns; the sinks
    recognize what they already show) are set aside; anything else stops the start."""
    ran = set(commits.batch_ids()) | set(driver_state.batch_ids())
    # only the owner moves records; the check runs again right before each move
    allocations.set_aside_torn_tail(lambda b: b not in ran, fence)
    commits.set_aside_torn_tail(lambda _b: True, fence)


class PipelineStart:
    """Sets up and starts one run of a pipeline; holds what it wired (None until then)."""

    def __init__(self, definition: PipelineDefinition, *, claim: RunClaim,
                 sources: Sequence[Source], batch_interval: float, dead_letters: DeadLetters,
                 listeners: list[StreamingListener], lifecycle: Lifecycle,
                 progress: RecentHistory, checkpoint_history: RecentHistory) -> None:
        self._definition = definition
        self._claim = claim
        self._sources = sources  # the user's thread adds to it until start()
        self._batch_interval = batch_interval
        self._dead_letters = dead_letters
        self._listeners = listeners
        self._lifecycle = lifecycle
        self._progress = progress
        self._checkpoint_history = checkpoint_history
        self.tracker: ReceiverTracker | None = None
        self.scheduler: JobScheduler | None = None
        self.generator: JobGenerator | None = None
        self.loop: PipelineLoop | None = None
        self.inputs: RecordedInputs | None = None
        self.operators: OperatorStates | None = None
        self.commits: MetadataLog | None = None
        self.driver_state: MetadataLog | None = None
        self.progress_log: ProgressLog | None = None
        self.checkpointing = False
        self.coordinator: CheckpointCoordinator | None = None
        self.checkpoint_storage: CheckpointStorage | None = None
        self.restored: CompletedCheckpoint | None = None
        self.transactions: dict[str, SinkTransactions] = {}
        self.skip_output_through: dict[str, int] = {}  # output -> last batch already visible
        self.sink_positions: dict[str, SinkPosition] = {}  # read at start, then read-only

    def start(self, available_now: bool, restore_checkpoint: int | None) -> None:
        """Set up (nothing runs yet), then start the pipeline's threads."""
        d = self._definition
        self._lifecycle.begin_start()
        try:
            pending, next_batch = self.prepare(available_now, restore_checkpoint)
        except BaseException as exc:
            log.error("Pipeline %s: start failed: %s", d.name, exc)
            self._lifecycle.start_failed(exc)
            run = self._claim.run
            if run and not isinstance(exc, JobFencedError):  # for spark-ckpt status
                StopControl(d.storage, d.root, d.name, run).record_end(
                    "failed", f"start failed: {type(exc).__name__}: {exc}", None, None,
                    d.clock.now_ms())
            raise
        # RUNNING before any thread starts, so a failure on one of them finishes the pipeline
        stop_requested = self._lifecycle.started()
        log.info("Pipeline %s run %d: starting at batch %d; %d allocated batch(es) to rerun%s",
                 d.name, self._claim.run, next_batch, len(pending),
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

    def prepare(self, available_now: bool, restore_checkpoint: int | None,
                ) -> tuple[list[BatchAllocation], int]:
        """Everything ``start()`` does before any thread runs: restore, pick the batches to
        rerun, build the generator and the scheduler. Starts nothing. Returns the batches to
        rerun and the next batch's id."""
        d, claim, s = self._definition, self._claim, self._definition.settings
        fence = claim.check_fenced
        d.graph.validate()
        d.storage.makedirs(d.root)
        claim.write_metadata()
        run = claim.claim()
        allocations = MetadataLog(d.storage, join(d.root, "allocations"), "allocation")
        allocation_store = AllocationStore(allocations)
        self.inputs = inputs = RecordedInputs(d.name, d.spark, self._dead_letters,
                                              allocation_store, s.stream_min_batches_to_retain)
        self.operators = operators = OperatorStates(
            d.snapshots, transactions=self.transactions,
            skip_output_through=self.skip_output_through)
        self.commits = commits = MetadataLog(d.storage, join(d.root, "commits"), "batch-commit")
        self.driver_state = driver_state = MetadataLog(d.storage, join(d.root, "driver"),
                                                       "driver-state")
        self.progress_log = ProgressLog(d.storage, d.root)
        set_aside_torn_records(allocations, commits, driver_state, fence)
        self.tracker = tracker = ReceiverTracker(d.name, list(self._sources), allocation_store,
                                                 d.clock)
        records = tracker.restore()
        uri = checkpoints_uri(s, d.storage, d.root)
        self.sink_positions = read_output_positions(
            d, sources=[src.name for src in self._sources], dead_letters=self._dead_letters,
            known_batches=lambda: [a.batch_id for a in records] + list(commits.batch_ids())
            + list(driver_state.batch_ids()),
            claimed_at=claim.claimed_at, checkpoints_uri=uri, fence=fence)
        self.checkpointing = checkpointing_wanted(d.name, s, d.graph)
        if self.checkpointing:
            setup = set_up_checkpointing(
                d, records, restore_checkpoint, run=run, claimed_at=claim.claimed_at,
                operators=operators, transactions=self.transactions,
                skip_output_through=self.skip_output_through,
                sink_positions=self.sink_positions, fence=fence,
                on_failure=lambda exc: self.post(CheckpointFailed(exc)),
                on_stats=self._checkpoint_stats)
            self.checkpoint_storage, self.restored = setup.storage, setup.restored
            self.coordinator, pending = setup.coordinator, setup.pending
        else:
            # each kept commit record is loaded (and so checked): a hand-edited one stops here
            kept = {b: commits.get(b) for b in commits.batch_ids()}
            committed = {b for b, record in kept.items() if record}
            refuse_staged_two_phase(d.name, d.graph.outputs, self.sink_positions, kept, uri)
            pending = [a for a in records if a.batch_id not in committed]
        batches = BatchQueue()
        self.scheduler = JobScheduler(
            d.name, session=d.spark, owner_tag=claim.owner_tag, graph=d.graph,
            inputs=inputs, sources=list(tracker.sources), operators=operators,
            transactions=self.transactions, skip_output_through=self.skip_output_through,
            commits=commits, coordinator=self.coordinator, fence=fence,
            batches=batches, checkpoints=self._checkpoint_history, post=self.post,
            clock=d.clock,
            final_checkpoint_bound_s=2 * s.checkpoint_timeout_ms / 1000 + 600,
            restored_barrier=self.restored.barrier_batch if self.restored else None)
        for allocation in pending:  # no in-flight slot: they are not the generator's
            batches.put(QueuedBatch(allocation, recovered=True))
        next_batch = max((a.batch_id for a in records), default=-1) + 1
        self.generator = JobGenerator(
            d.name, tracker=tracker, batches=batches, driver_state=driver_state,
            positions=self._positions, fence=fence, clock=d.clock,
            interval_ms=int(round(self._batch_interval * 1000)), next_batch=next_batch,
            skip_empty=s.stream_skip_empty_batches or available_now,
            time_moved=_time_moved(d.graph))
        housekeeping = PipelineHousekeeping(
            d.name, progress=self._progress, progress_log=self.progress_log,
            listeners=self._listeners, tracker=tracker,
            coordinator=self.coordinator, outputs=list(d.graph.outputs),
            commits=commits, driver_state=driver_state,
            keep_batches=max(s.stream_min_batches_to_retain, d.graph.remember_batches),
            fence=fence)
        self.loop = PipelineLoop(
            d.name, lifecycle=self._lifecycle, generator=self.generator, batches=batches,
            scheduler=self.scheduler, housekeeping=housekeeping, clock=d.clock,
            max_in_flight=s.stream_max_batches_in_flight,
            available_now=available_now,
            stop_control=StopControl(d.storage, d.root, d.name, run),
            stop_poll_ms=s.stream_stop_poll_interval_ms, recovered=len(pending))
        return pending, next_batch

    def _positions(self) -> dict[str, Any]:
        return {src.name: src.position() for src in self._sources}

    def _checkpoint_stats(self, stats: dict[str, Any]) -> None:
        """A checkpoint ended (the coordinator's thread, before its waiters are told)."""
        self._checkpoint_history.append(stats)
        self.post(CheckpointStats(stats))

    def post(self, event: Any) -> None:
        """Hand ``event`` to the pipeline loop (any thread; never blocks)."""
        assert self.loop is not None
        self.loop.post(event)


def _time_moved(graph: Any) -> Callable[[int | None], bool] | None:
    """Whether any operator's watermark moved past the one its tasks last ran with, or a
    processing-time timer of one is due (a no-data batch fires its timers), asked with the
    time a batch allocated now would have (None in an available-now run: processing time
    does not move there without input); None when the graph has no operator with timers."""
    timed = [s for s in graph.reachable() if hasattr(s, "time_moved")]
    if not timed:
        return None
    return lambda batch_time_ms: any(s.time_moved(batch_time_ms) for s in timed)
