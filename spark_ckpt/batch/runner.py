"""The driver of one attempt at a batch job: claim, replay, recover, run, commit.

Per attempt:

1. claim attempt *n* with a create-if-absent marker (a newer attempt fences the older one);
2. replay the event log (tolerating a damaged tail; an unreadable log is set aside);
3. log ``JobAttemptStarted`` and ``JobVertexInitialized`` for new or changed vertices;
4. plan recovery (batch.recovery): validate, invalidate, walk upstream;
5. run the vertices in topological order, only the partitions the plan names
   (batch.vertex_runner), logging ``ExecutionVertexFinished`` as partitions finish;
6. commit every sink once (``SinkCommitStarted`` is durable before the commit);
7. log ``JobAttemptFinished``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spark_ckpt.batch.arrangement import exchanges
from spark_ckpt.batch.buckets import BucketedTables, job_table_prefix
from spark_ckpt.batch.cuts import (
    CutPlan,
    plan_cuts,
    planner_sampler,
    split_mode_chain,
    split_source,
)
from spark_ckpt.batch.job_progress import JobProgress
from spark_ckpt.batch.recovery import plan_recovery
from spark_ckpt.batch.unit_records import UnitRecord, load_units, units_dir
from spark_ckpt.batch.vertex_runner import VertexRunner
from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import EventLogError, JobFencedError
from spark_ckpt.eventlog.events import Event, EventType
from spark_ckpt.eventlog.reader import EventLogUnreadable, read_table
from spark_ckpt.eventlog.replay import FinishedPartition, JobHistory, replay_table
from spark_ckpt.eventlog.writer import EventLogWriter
from spark_ckpt.execution.attempt_states import ExecutionState
from spark_ckpt.execution.attempts import ExecutionRegistry
from spark_ckpt.execution.result_partition import PartitionResult
from spark_ckpt.faults import fault_point
from spark_ckpt.formats import dump_record
from spark_ckpt.session import session_conf
from spark_ckpt.sinks import Sink, make_sink, micros_timestamps
from spark_ckpt.sources.job_inputs import FileSource, decode_files, decode_splits, encode_splits
from spark_ckpt.sparkapi import is_connect, spark_api
from spark_ckpt.storage import Storage, join
from spark_ckpt.storage.fencing import Fence, client_session, interrupt_earlier_clients

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from spark_ckpt.execution.job_graph import JobGraph, JobVertex
    from spark_ckpt.options import Settings
    from spark_ckpt.sources.file_identity import FileIdentity

__all__ = ["JobResult", "JobRunner", "VertexSummary", "job_paths"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VertexSummary:
    """One vertex in a :class:`JobResult`: its partitions, how many this attempt reused from
    earlier attempts and how many it ran."""

    partitions: int
    reused: int
    ran: int
    seconds: float = 0.0  # wall time this attempt spent running the vertex
    # Spark Connect: partitions a killed client's write operations finished on the server
    # while this attempt waited for them (batch.adoption); not in ran
    adopted: int = 0
    waves: bool = False  # it runs in waves of input splits (partial aggregates, exchanges)
    mean_ms: float = 0.0  # the mean time one of its partitions took, over every attempt


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What one ``run()`` did. ``ran`` counts partitions computed by this attempt; ``job_id``
    is the run's id (``job@run_key`` when the job has a run key)."""

    job_id: str
    attempt: int
    status: str
    vertices: dict[str, VertexSummary]
    sinks: dict[str, int]
    duration_s: float
    lost: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    # What deciding cost before any vertex ran: replaying the log, checking the files of
    # finished partitions, sampling for cuts (the cost a resubmission adds to a fresh run).
    planning_s: float = 0.0
    # Durable vertices this attempt recomputed inside their consumers instead of reading
    # their kept output (which was larger than the input it came from), with the figures.
    recomputed: list[str] = dataclasses.field(default_factory=list)

    @property
    def ran(self) -> int:
        """Partitions this attempt computed, over all vertices."""
        return sum(v.ran for v in self.vertices.values())

    @property
    def reused(self) -> int:
        """Partitions this attempt took from earlier attempts' output, over all vertices."""
        return sum(v.reused for v in self.vertices.values())

    @property
    def adopted(self) -> int:
        """Partitions a killed Spark Connect client's writes finished on the server."""
        return sum(v.adopted for v in self.vertices.values())

    @property
    def reused_in_waves(self) -> int:
        """Reused partitions of vertices that run in waves of input splits (partial
        aggregates, durable exchanges): what finished waves of a killed attempt kept."""
        return reused_in_waves(self.vertices)

    @property
    def durable_share(self) -> float:
        """The share of the job's work this attempt did not run: its reused partitions
        (durable when it started) and adopted ones (a killed Spark Connect client's writes,
        which the server finished) over all, each vertex's partitions weighted by their mean
        recorded time (from the start of the unit that wrote a partition to when its files
        were recorded: a latency, close to a task's time for waves of one partition a task)."""
        return durable_share(self.vertices)

    def summary(self) -> str:
        """One line: status, attempt, what ran and what was reused, and how."""
        return (f"status={self.status} attempt={self.attempt} ran={self.ran} "
                f"reused={self.reused} adopted={self.adopted} "
                f"reused_in_waves={self.reused_in_waves} "
                f"durable_share={self.durable_share:.2f} duration={self.duration_s:.1f}s")


def reused_in_waves(vertices: dict[str, VertexSummary]) -> int:
    return sum(v.reused for v in vertices.values() if v.waves)


def durable_share(vertices: dict[str, VertexSummary]) -> float:
    """Reused and adopted partitions over all, each weighted by its vertex's mean recorded
    partition time (a vertex with none recorded weighs as the others' mean; with none at all,
    partitions count alike)."""
    known = [v.mean_ms for v in vertices.values() if v.mean_ms > 0]
    fallback = sum(known) / len(known) if known else 1.0

    def weight(v: VertexSummary) -> float:
        return v.mean_ms if v.mean_ms > 0 else fallback

    total = sum(v.partitions * weight(v) for v in vertices.values())
    kept = sum((v.reused + v.adopted) * weight(v) for v in vertices.values())
    return kept / total if total > 0 else 0.0


def _mean_ms(durations: list[int]) -> float:
    return sum(durations) / len(durations) if durations else 0.0


def job_paths(storage: Storage, job_id: str) -> dict[str, str]:
    job_dir = storage.path(job_id)
    return {
        "job": job_dir,
        "events": join(job_dir, "events"),
        "attempts": join(job_dir, "attempts"),
        "results": join(job_dir, "results"),
    }


def job_summaries(storage: Storage) -> list[dict[str, Any]]:
    """One summary per job under a work directory (``storage``), by job id: attempts,
    status, the last event's time (us), finished partitions, events; a job whose log cannot be
    read says so (status "log unreadable", ``problem`` why); a job with no event yet is left
    out."""
    from pyarrow.fs import FileSelector, FileType

    from spark_ckpt.eventlog.reader import read_events
    from spark_ckpt.eventlog.replay import replay

    rows: list[dict[str, Any]] = []
    if not storage.exists(storage.root):
        return rows
    for info in sorted(storage.fs.get_file_info(FileSelector(storage.root)),
                       key=lambda i: i.base_name):
        if info.type != FileType.Directory or "." in info.base_name:
            continue
        try:
            read = read_events(storage, job_paths(storage, info.base_name)["events"])
        except (EventLogUnreadable, EventLogError) as exc:
            rows.append({"job_id": info.base_name, "attempts": None, "status": "log unreadable",
                         "last_event_us": None, "finished_partitions": None, "events": None,
                         "problem": str(exc)})
            continue
        if not read.events:
            continue
        h = replay(read.events)
        status = "completed" if h.completed else (
            h.attempts[h.last_attempt].status if h.attempts else "?")
        rows.append({"job_id": info.base_name, "attempts": len(h.attempts), "status": status,
                     "last_event_us": read.events[-1].time_us,
                     "finished_partitions": len(h.finished), "events": h.events,
                     "problem": None})
    return rows


class JobRunner:
    """Runs one attempt of a job: claims it, replays the event log, plans, runs what is
    missing. Takes the job's graph and id, not the user's BatchJob."""

    def __init__(self, graph: JobGraph, run_id: str, spark: SparkSession,
                 settings: Settings, clock: Clock | None = None) -> None:
        self.run_id = run_id
        self.clock = clock or SystemClock()  # markers' and events' timestamps
        self.explaining = False  # explain(): writes nothing in the job's directory
        self.graph = graph.copy()  # a run decides parallelism and cuts on its own copy
        self.spark = spark
        self.settings = settings
        self.storage = Storage(settings.work_dir)
        self.paths = job_paths(self.storage, run_id)
        self.registry = ExecutionRegistry()
        self.finished: dict[tuple[str, int], FinishedPartition] = {}
        self._finished_lock = threading.Lock()
        self.ran: dict[str, int] = {}
        self.adopted: dict[str, int] = {}
        # Spark Connect: the units earlier attempts left running (batch.adoption), and the
        # markers of those attempts, not interrupted until their units are adopted or not
        self.left_running: list[UnitRecord] = []
        self._deferred: dict[int, str] = {}
        # the last attempt that logged each partition finished: never taken from the units of
        # that attempt or earlier ones (batch.adoption)
        self.once_finished: dict[tuple[str, int], int] = {}
        self.seconds: dict[str, float] = {}
        self.attempt = 0
        self.writer: EventLogWriter | None = None
        self.problems: list[str] = []
        self.source_schemas: dict[str, Any] = {}
        self.changed_inputs: set[tuple[str, int]] = set()
        # what identified each file of each file source (recorded, or found now), by path
        self.input_files: dict[str, dict[str, FileIdentity]] = {}
        self.deferred_events: list[Event] = []
        self.cut_plan: CutPlan | None = None
        self.fence = Fence(self.storage, self.paths["job"], f"job {run_id}")

    # -- attempt claim and fencing ---------------------------------------------------------
    def _attempt_marker(self, n: int) -> str:
        return join(self.paths["attempts"], f"{n:05d}.json")

    def _claim_attempt(self) -> int:
        existing = [int(i.base_name[:5]) for i in
                    self.storage.list_files(self.paths["attempts"], recursive=False)
                    if i.base_name[:5].isdigit() and i.base_name.endswith(".json")]
        n = max(existing, default=0) + 1
        while True:
            body = {"job_id": self.run_id, "attempt": n, "host": socket.gethostname(),
                    "pid": os.getpid(), "started_ms": self.clock.now_ms(),
                    **client_session(self.spark, self._owner_tag(n))}
            if self.storage.create_exclusive(self._attempt_marker(n),
                                             dump_record("job-attempt", 1, body)):
                return n
            n += 1

    def _owner_tag(self, attempt: int) -> str:
        return f"spark_ckpt-{self.run_id}-a{attempt}"

    @property
    def owner_tag(self) -> str:
        """The tag of every Spark operation of this attempt (on Spark Connect)."""
        return self._owner_tag(self.attempt)

    def _is_fenced(self) -> bool:
        # The fence alone decides (a Delta commit, a CAS where Delta's is): two drivers
        # started at once can commit their claims in the other order than they numbered
        # their attempts, and a second rule (attempt n+1's marker exists) fenced both.
        return self.fence.is_fenced()

    def _check_fenced(self) -> None:
        if self._is_fenced():
            raise JobFencedError(
                f"job {self.run_id}: driver attempt {self.attempt} was fenced off by a "
                "newer attempt of the same job; this driver stops without committing"
            )

    def _archive(self, path: str, reason: str) -> None:
        target = f"{path}.{reason}-{self.clock.now_ms() // 1000}"
        if self.storage.exists(path):
            self.storage.move(path, target)
            log.warning("Job %s: moved %s to %s (%s)", self.run_id, path, target, reason)

    # -- events ----------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        assert self.writer is not None
        self.writer.append(event)

    def _on_flush(self, batch: list[Event]) -> None:
        if any(e.type is EventType.EXECUTION_VERTEX_FINISHED for e in batch):
            fault_point("partition.finished")

    # -- the attempt -----------------------------------------------------------------------
    def run(self, *, fresh: bool = False) -> JobResult:
        started = self.clock.monotonic_s()
        self.graph.validate()
        # Claimed before a fresh start archives anything: attempt numbers keep growing across
        # fresh starts, so a driver still running an older attempt finds itself fenced.
        self.attempt = self._claim_attempt()
        self.fence.claim(f"attempt {self.attempt}")
        try:
            return self._run_claimed(started, fresh)
        finally:
            self.release_earlier(set(self._deferred))

    def _interrupt_or_defer(self, history: JobHistory) -> None:
        """Interrupt what the last earlier attempts left running on a Spark Connect server,
        except the attempts whose recorded run units may finish partitions this one needs
        (batch.adoption): those are deferred until their vertex comes (Adoption.adopt).
        Only records of attempts this event log knows (a fresh start or a log set aside
        forgets them with it), and only units with a partition not logged finished by the
        unit's attempt or a later one."""
        earlier = range(max(1, self.attempt - 3), self.attempt)
        if self.settings.batch_adopt_operations and spark_api(self.spark).session_id():
            known = {n for n in earlier if n in history.attempts}
            try:
                records = load_units(self.storage, self.paths["job"], known)
            except Exception as exc:  # noqa: BLE001 - a speed-up: interrupt and run instead
                log.warning("Job %s attempt %d: cannot list the run units earlier attempts "
                            "recorded (%s); interrupting what they left running",
                            self.run_id, self.attempt, exc)
                records = []
            self.left_running = [r for r in records if any(
                history.ever_finished.get((r.vertex, p), 0) < r.attempt for p in r.parts)]
        self._deferred = {r.attempt: self._attempt_marker(r.attempt)
                          for r in self.left_running}
        interrupt_earlier_clients(
            self.spark, self.storage,
            [self._attempt_marker(n) for n in earlier if n not in self._deferred],
            "job-attempt", f"Job {self.run_id} attempt {self.attempt}")

    def release_earlier(self, attempts: set[int]) -> None:
        """Interrupt what ``attempts`` (earlier ones whose units this one meant to adopt) still
        run on the server: their units were adopted, or read other inputs, or are not needed."""
        markers = [self._deferred.pop(n) for n in sorted(attempts) if n in self._deferred]
        if markers:
            interrupt_earlier_clients(self.spark, self.storage, markers, "job-attempt",
                                      f"Job {self.run_id} attempt {self.attempt}")

    def _run_claimed(self, started: float, fresh: bool) -> JobResult:
        job_id = self.run_id
        if fresh:  # what earlier attempts still run writes into what is set aside: stop it
            self._interrupt_or_defer(JobHistory())
            self._archive(self.paths["events"], "archived")
            self._archive(self.paths["results"], "archived")
            self._archive(units_dir(self.paths["job"]), "archived")
        try:
            history = self._load_history()
        except BaseException:
            self._interrupt_or_defer(JobHistory())  # nothing known: interrupt them all
            raise
        self._interrupt_or_defer(history)
        if history.completed:
            log.info("Job %s already completed in attempt %d; nothing to do (attempt %d)",
                     job_id, max(a.attempt for a in history.attempts.values()
                                 if a.status == "succeeded"), self.attempt)
            return JobResult(job_id, self.attempt, "already-complete", {},
                             dict(history.sink_committed), self.clock.monotonic_s() - started,
                             problems=self.problems)
        self.writer = EventLogWriter(
            self.storage, self.paths["events"], job_id=job_id, job_attempt=self.attempt,
            flush_interval_ms=self.settings.event_log_flush_interval_ms,
            flush_max_events=self.settings.event_log_flush_max_events,
            compact_at_files=self.settings.event_log_compact_at_files,
            write_retries=self.settings.event_log_write_retries,
            retry_backoff_ms=self.settings.event_log_retry_backoff_ms,
            is_fenced=self._is_fenced, on_flush=self._on_flush,
            clock=self.clock,
        )
        self.writer.start()
        progress = JobProgress(job_id, self.settings.progress)
        # Spark's Parquet writer takes the timestamp format from the session only (not from a
        # write option), so microseconds, as Delta wants them, are set for the run.
        try:
            with micros_timestamps(self.spark), self._local_listing():
                result = self._run_attempt(history, progress, started)
        except BaseException as exc:
            progress.close()
            self._fail(exc)
            raise
        progress.close()
        return result

    @contextlib.contextmanager
    def _local_listing(self) -> Iterator[None]:
        """Spark lists the paths of a read in a Spark job of its own when there are more than
        ``spark.sql.sources.parallelPartitionDiscovery.threshold`` (32) of them, and this
        runner hands Spark explicit file lists (a source's split, a vertex's result files:
        often more than 32) where a user hands one directory. On local disks that job costs
        far more than the stats it parallelizes (0.5-0.7 s against 0.13 s for each analysis
        of a 50 + 50 file join on Spark Connect), and every analysis (schema, explain, the
        write) pays it again; so for the run, when the work directory and every file source
        are local, the threshold covers the lists. Object stores keep the parallel listing."""
        vertices = self.graph.vertices.values()
        local = self.storage.local and all(
            isinstance(v.source, FileSource) and Storage(v.source.path).local
            for v in vertices if v.is_source) and all(
            Storage(spec.path).local for v in vertices for spec in v.sinks)
        if not local:
            yield
            return
        threshold = 1 << 20
        with session_conf(self.spark, "spark.sql.sources.parallelPartitionDiscovery.threshold",
                          str(threshold), required=False,  # a speed-up: a server may refuse
                          enough=lambda before: before.isdigit() and int(before) >= threshold):
            yield

    def _load_history(self) -> JobHistory:
        try:
            table, _version, problems = read_table(self.storage, self.paths["events"],
                                                   repair=True,  # this driver appends next
                                                   clock=self.clock)
        except EventLogUnreadable as exc:
            self.problems.append(str(exc))
            log.error("Job %s: %s; keeping it aside and starting fresh", self.run_id, exc)
            self._archive(self.paths["events"], "unreadable")
            self._archive(self.paths["results"], "orphaned")
            self._archive(units_dir(self.paths["job"]), "orphaned")
            return JobHistory()
        self.problems.extend(problems)
        return replay_table(table)

    def _fail(self, exc: BaseException) -> None:
        if self.writer is None:
            return
        if not isinstance(exc, JobFencedError):
            try:
                self._emit(Event(EventType.JOB_ATTEMPT_FINISHED,
                                 {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}))
                self.writer.close()
            except Exception as close_exc:  # noqa: BLE001 - the log may be what failed
                log.warning("Job %s attempt %d: could not log the failure: %s",
                            self.run_id, self.attempt, close_exc)
        log.error("Job %s attempt %d failed: %s", self.run_id, self.attempt, exc)

    def _run_attempt(self, history: JobHistory, progress: JobProgress,
                     started: float) -> JobResult:
        job_id = self.run_id
        mode = "recovery" if history.events else "fresh"
        self._emit(Event(EventType.JOB_ATTEMPT_STARTED, {
            "mode": mode, "spark_app_id": spark_api(self.spark).app_id(),
            "host": socket.gethostname(), "pid": os.getpid(),
            "previous_attempts": sorted(history.attempts),
        }))
        assert self.writer is not None
        self.writer.flush()
        fault_point("attempt.started")
        log.info("Job %s attempt %d started (%s; %d events replayed)", job_id, self.attempt,
                 mode, history.events)

        # durable exchanges' tables a killed driver of this job left in a lasting catalog
        # (a Hive metastore, a Spark Connect server)
        BucketedTables(self.spark, lambda: "", job_table_prefix(job_id)).drop_leftovers()
        splits = self._initialize_vertices(history)
        fault_point("vertex.initialized")

        committing = set(history.sink_started) | set(history.sink_committed)
        recomputed = self._recompute_instead(history, splits)
        fingerprints = {v.id: v.fingerprint() for v in self.graph.topological()}
        plan = plan_recovery(self.graph, history, fingerprints, committing,
                             changed_inputs=self.changed_inputs)
        for key in plan.lost:
            self._emit(Event(EventType.EXECUTION_VERTEX_RESET, {"reason": "output missing"},
                             vertex_id=key[0], partition=key[1]))
        for key in plan.invalidated:
            self._emit(Event(EventType.EXECUTION_VERTEX_RESET,
                             {"reason": "upstream output lost, input replaced or vertex "
                                        "changed"},
                             vertex_id=key[0], partition=key[1]))
        # Rewritten input files are recorded as they are now only after the resets they
        # cause: a crash in between finds them changed again, never forgotten.
        self.writer.flush()
        for event in self.deferred_events:
            self._emit(event)
        self.finished = dict(plan.finished)
        total_to_run = sum(len(p) for p in plan.to_run.values())
        self.release_earlier({r.attempt for r in self.left_running}
                             - {r.attempt for r in self.left_running
                                if set(r.parts) & set(plan.to_run.get(r.vertex, ()))})
        self.once_finished = dict(history.ever_finished)
        log.info("Job %s attempt %d: reusing %d finished partitions, running %d (%s)", job_id,
                 self.attempt, plan.reused, total_to_run,
                 ", ".join(f"{v}: {len(p)}" for v, p in plan.to_run.items()) or "nothing")

        planning_s = self.clock.monotonic_s() - started
        sinks = {s.name: make_sink(s, job_id, clock=self.clock) for v in self.graph.live_vertices()
                 for s in v.sinks}
        runner = VertexRunner(self, splits, self.source_schemas, sinks, progress)
        for vertex in self.graph.live_vertices():
            if self.graph.is_virtual(vertex.id):
                continue
            reused = sum(1 for p in range(vertex.parallelism) if (vertex.id, p) in self.finished)
            progress.vertex(vertex.id, vertex.parallelism, reused)
            parts = plan.to_run.get(vertex.id, [])
            if not parts:
                continue
            t0 = self.clock.monotonic_s()
            self._check_fenced()  # a newer attempt may have finished and removed results
            try:
                adopted = runner.run(vertex, parts)
            except Exception:
                self._check_fenced()  # the failure of a fenced driver is its fencing
                raise
            self.seconds[vertex.id] = self.clock.monotonic_s() - t0
            self.ran[vertex.id] = len(parts) - adopted
            self.adopted[vertex.id] = adopted
            self.writer.flush()
            fault_point("vertex.finished")

        committed = self._commit_sinks(history, sinks)
        summaries = {
            v.id: VertexSummary(
                partitions=v.parallelism,
                reused=sum(1 for p in range(v.parallelism) if (v.id, p) in plan.finished),
                ran=self.ran.get(v.id, 0),
                seconds=round(self.seconds.get(v.id, 0.0), 3),
                adopted=self.adopted.get(v.id, 0),
                waves=bool(v.partial_of or v.exchange_of),
                mean_ms=_mean_ms([f.duration_ms for (vid, _p), f in self.finished.items()
                                  if vid == v.id]),
            )
            for v in self.graph.live_vertices() if not self.graph.is_virtual(v.id)
        }
        ran = sum(s.ran for s in summaries.values())
        self._emit(Event(EventType.JOB_ATTEMPT_FINISHED, {
            "status": "succeeded", "ran": ran, "reused": plan.reused,
            "lost": len(plan.lost), "invalidated": len(plan.invalidated),
            "adopted": sum(v.adopted for v in summaries.values()),
            "reused_in_waves": reused_in_waves(summaries),
            "durable_share": round(durable_share(summaries), 4),
        }))
        self.writer.close()
        fault_point("attempt.finished")
        duration = self.clock.monotonic_s() - started
        log.info("Job %s attempt %d succeeded in %.1f s: ran %d partitions, reused %d",
                 job_id, self.attempt, duration, ran, plan.reused)
        if self.settings.batch_cleanup_on_success:
            self.storage.delete_dir(self.paths["results"])
            self.storage.delete_dir(units_dir(self.paths["job"]))
        return JobResult(job_id, self.attempt, "succeeded", summaries, committed, duration,
                         lost=plan.lost, problems=self.problems,
                         planning_s=round(planning_s, 3), recomputed=recomputed)

    def _recompute_instead(self, history: JobHistory, splits: dict[str, list[Any]]) -> list[str]:
        """Never worse than starting over: a durable vertex that runs split by split from a
        file source, whose kept output is larger than the input it was computed from, is
        recomputed inside its consumers this attempt rather than read back (reading it would
        cost more than the work it saves). Its kept files stay for later attempts."""
        decisions = []
        live = {v.id for v in self.graph.live_vertices()}
        for vertex in self.graph.live_vertices():
            if vertex.sinks or vertex.is_source or not vertex.durable or \
                    vertex.declared_durable is True or vertex.partial_of is not None or \
                    vertex.bucket_for is not None or \
                    not split_mode_chain(self.graph, vertex):
                continue  # durable=True by hand is the user's word
            source = split_source(self.graph, vertex)
            kept = [p for p in range(vertex.parallelism) if (vertex.id, p) in history.finished]
            if not kept or source not in splits:
                continue
            readers_done = all((c, q) in history.finished
                               for c, _ in self.graph.consumers(vertex.id) if c in live
                               for q in range(self.graph.vertices[c].parallelism))
            if readers_done:
                continue
            files = {o.path: o.size for p in kept for o in history.finished[(vertex.id, p)].outputs
                     if o.kind == "result"}
            kept_bytes = sum(files.values())
            input_bytes = sum(size for p in kept for _path, size in splits[source][p])
            if kept_bytes > input_bytes and self._deterministic(vertex, splits):
                vertex.durable = False
                decisions.append(
                    f"{vertex.id}: kept output of {len(kept)} partitions is {kept_bytes:,} bytes, "
                    f"more than the {input_bytes:,} bytes of {source} they came from: "
                    "recomputed inside its consumers instead of read back")
                log.warning("Job %s attempt %d: %s", self.run_id, self.attempt,
                            decisions[-1])
        return decisions

    def _deterministic(self, vertex: JobVertex, splits: dict[str, list[Any]]) -> bool:
        """True when recomputing the vertex gives the rows its kept output holds: consumers
        that already read those must agree with the ones that read recomputed rows."""
        planner = VertexRunner(self, splits, self.source_schemas, {}, None)  # type: ignore[arg-type]
        planner.planning = "inline"
        try:
            df = planner.compute_inline(vertex.id, [0])
            return spark_api(self.spark).deterministic(df) is True
        except Exception:  # noqa: BLE001 - cannot tell: keep reading what was kept
            return False

    def _initialize_vertices(self, history: JobHistory) -> dict[str, list[Any]]:
        """Log JobVertexInitialized for new or changed vertices; decide file source splits
        and schemas (Spark infers a schema once, at the first attempt; later ones reuse it),
        then where the job becomes durable (batch.cuts; recorded with each vertex)."""
        splits: dict[str, list[Any]] = {}
        states: dict[str, dict[str, Any]] = {}
        deferred: set[str] = set()
        for vertex in self.graph.live_vertices():
            if isinstance(vertex.source, FileSource):
                states[vertex.id], changed = self._source_state(vertex, history, splits)
                if changed:
                    deferred.add(vertex.id)
        self.cut_plan = self._plan_cuts(history, splits)
        for vertex in self.graph.live_vertices():
            fingerprint = vertex.fingerprint()
            recorded = history.vertices.get(vertex.id)
            same = recorded is not None and recorded.get("fingerprint") == fingerprint \
                and vertex.id not in deferred and \
                recorded.get("parallelism") == vertex.parallelism
            if same:
                continue
            if recorded is not None and recorded.get("fingerprint") != fingerprint:
                log.warning("Job %s: vertex %s changed since attempt that recorded it; its "
                            "finished partitions and everything downstream will run again",
                            self.run_id, vertex.id)
            payload: dict[str, Any] = {
                "fingerprint": fingerprint, "parallelism": vertex.parallelism,
                "descriptor": vertex.descriptor(),
                "coordinator_state": states.get(vertex.id, {"checkpoint_id": -1}),
            }
            if vertex.id in self.cut_plan.cuts:
                payload["cut"] = self.cut_plan.cuts[vertex.id].record()
            event = Event(EventType.JOB_VERTEX_INITIALIZED, payload, vertex_id=vertex.id)
            if vertex.id in deferred:
                self.deferred_events.append(event)
            else:
                self._emit(event)
        assert self.writer is not None
        self.writer.flush()
        return splits

    def _source_state(self, vertex: JobVertex, history: JobHistory,
                      splits: dict[str, list[Any]]) -> tuple[dict[str, Any], bool]:
        """A file source's splits and schema (recorded, or decided now); True when its record
        must be logged again: files rewritten since they were recorded, or a record of event
        format 1 completed with what identifies its files now."""
        from pyspark.sql.types import StructType

        assert isinstance(vertex.source, FileSource)
        fingerprint = vertex.fingerprint()
        recorded = history.vertices.get(vertex.id)
        same = recorded is not None and recorded.get("fingerprint") == fingerprint
        changed_files = False
        if same and recorded is not None:
            splits[vertex.id] = decode_splits(recorded["coordinator_state"]["splits"])
            files = decode_files(recorded["coordinator_state"]["splits"])
            before = dict(files)
            changed = vertex.source.changed_splits(
                vertex.id, splits[vertex.id], files,
                refuse=self.settings.batch_on_input_changed == "fail")
            if changed:  # rewritten files: what read them runs again, nothing else
                log.warning("Job %s: input files of source %s changed since they were "
                            "recorded (splits %s); the partitions that read them and "
                            "everything downstream run again", self.run_id,
                            vertex.id, sorted(changed))
                self.changed_inputs |= {(vertex.id, j) for j in changed}
            # the splits are logged again with what was found (rewritten files, or a record
            # of event format 1 completed), but only after the resets they cause (see
            # _run_attempt)
            changed_files = files != before
        else:
            declared = vertex.declared_parallelism
            files = vertex.source.identify()
            splits[vertex.id] = vertex.source.discover(
                declared if isinstance(declared, int) else None, files)
        self.input_files[vertex.id] = files
        if vertex.auto_parallelism:
            self.graph.set_parallelism(vertex.id, len(splits[vertex.id]))
        state: dict[str, Any] = {"checkpoint_id": -1,
                                 "splits": encode_splits(splits[vertex.id], files)}
        schema = (recorded or {}).get("coordinator_state", {}).get("schema") if same else None
        if schema:
            self.source_schemas[vertex.id] = StructType.fromJson(json.loads(schema))
        else:
            self.source_schemas[vertex.id] = vertex.source.resolve(
                self.spark, vertex.id, splits[vertex.id])
        state["schema"] = self.source_schemas[vertex.id].json()
        return state, changed_files

    def _plan_cuts(self, history: JobHistory, splits: dict[str, list[Any]]) -> CutPlan:
        """Decide every vertex's durability (batch.cuts), reusing the decisions recorded for
        unchanged vertices; samples run as Spark jobs of their own group."""
        t0 = self.clock.monotonic_s()
        recorded = {}
        for vid, entry in history.vertices.items():
            vertex = self.graph.vertices.get(vid)
            if "cut" in entry and (vertex is None  # an inserted partial: its figures
                                   or entry.get("fingerprint") == vertex.fingerprint()):
                recorded[vid] = entry["cut"]
        planner = VertexRunner(self, splits, self.source_schemas, {}, None)  # type: ignore[arg-type]
        planner.planning = "inline"
        # the caller's job group is back after it
        with spark_api(self.spark).job_group(
                f"spark_ckpt-{self.run_id}-a{self.attempt}-plan",
                f"spark_ckpt job {self.run_id}: sampling for durable cuts",
                owner=self.owner_tag):
            plan = plan_cuts(self.graph, planner_sampler(planner, splits),
                             max_ratio=self.settings.batch_cut_max_percent / 100.0,
                             mode=self.settings.batch_cuts, recorded=recorded,
                             exchanges=planner.exchanges_supported
                             if self.settings.batch_exchange_cuts else None,
                             exchange_min_bytes=self.settings.batch_exchange_min_bytes,
                             partitions_per_wave=self.settings.batch_partitions_per_wave,
                             map_side=self.settings.batch_map_side_partials
                             and not is_connect(self.spark))
        self.graph.validate()
        log.info("Job %s attempt %d: planned durable cuts in %.1f s\n%s", self.run_id,
                 self.attempt, self.clock.monotonic_s() - t0, plan.text(list(self.graph.ids())))
        return plan

    def explain(self) -> CutPlan:
        """Plan the job as ``run()`` would (reading, never writing, its event log) and list
        the Spark exchanges each vertex's job keeps."""
        self.explaining = True
        self.graph.validate()
        try:
            table, _version, _problems = read_table(self.storage, self.paths["events"])
            history = replay_table(table)
        except EventLogUnreadable:
            history = JobHistory()
        splits: dict[str, list[Any]] = {}
        for vertex in self.graph.live_vertices():
            if isinstance(vertex.source, FileSource):
                self._source_state(vertex, history, splits)
        plan = self._plan_cuts(history, splits)
        runner = VertexRunner(self, splits, self.source_schemas, {}, None)  # type: ignore[arg-type]
        runner.planning = "explain"
        for vertex in self.graph.live_vertices():
            cut = plan.cuts.get(vertex.id)
            if cut is None or self.graph.is_virtual(vertex.id):
                continue
            try:
                df = runner.arranged(vertex, list(range(vertex.parallelism)))
                cut.exchanges = exchanges(df)
            except Exception as exc:  # noqa: BLE001 - shows where run() would fail
                cut.exchanges = [f"(cannot plan: {exc})"]
        runner.tables.drop_all()
        plan.order = list(self.graph.ids())
        return plan

    # -- partitions finishing (called from poller and wave threads) ------------------------
    def partition_finished(self, result: PartitionResult) -> bool:
        """Record a finished partition once; False for duplicates and stale attempts."""
        key = (result.vertex_id, result.partition)
        execution = self.registry.get(result.attempt_id)
        if execution is None:
            return False  # from an earlier driver attempt
        with self._finished_lock:
            if key in self.finished:
                return False
            if not execution.machine.move_to(ExecutionState.FINISHED):
                return False
            self.finished[key] = FinishedPartition(
                result.vertex_id, result.partition, result.attempt_id, self.attempt,
                result.rows, result.finished_ms - result.started_ms,
                outputs=result.outputs, schema=result.schema, shared=result.shared,
            )
        payload = result.body()
        payload["job_id"] = self.run_id
        payload["coordinator_state"] = {"checkpoint_id": -1}
        payload["io"] = {"output_rows": result.rows, "output_bytes": result.bytes}
        payload["accumulators"] = {}
        self._emit(Event(
            EventType.EXECUTION_VERTEX_FINISHED, payload, vertex_id=result.vertex_id,
            partition=result.partition, attempt_id=result.attempt_id, rows=result.rows,
            bytes=result.bytes, duration_ms=result.finished_ms - result.started_ms,
        ))
        log.debug("Job %s attempt %d: partition %s/%d finished (%s, %d rows)",
                  self.run_id, self.attempt, result.vertex_id, result.partition,
                  result.attempt_id, result.rows)
        return True

    # -- sinks -----------------------------------------------------------------------------
    def _commit_sinks(self, history: JobHistory, sinks: dict[str, Sink]) -> dict[str, int]:
        assert self.writer is not None
        committed: dict[str, int] = {}
        for vertex in self.graph.live_vertices():
            for spec in vertex.sinks:
                sink = sinks[spec.name]
                if spec.name in history.sink_committed:
                    committed[spec.name] = history.sink_committed[spec.name]
                    continue
                version = history.sink_started.get(spec.name)
                if version is not None and sink.is_committed(version):
                    log.info("Job %s: sink %s commit v%d had landed before the crash",
                             self.run_id, spec.name, version)
                    details: dict[str, Any] = {"recovered": True}
                else:
                    if version is None:
                        version = sink.next_version()
                    # once each: the partitions of a wave share its files
                    files = list({o.path: o for p in range(vertex.parallelism)
                                  for o in self.finished[(vertex.id, p)].outputs
                                  if o.kind == "sink" and o.target == spec.name}.values())
                    self._emit(Event(EventType.SINK_COMMIT_STARTED,
                                     {"sink": spec.name, "version": version,
                                      "files": len(files), "kind": spec.kind,
                                      "path": spec.path},
                                     vertex_id=vertex.id))
                    self.writer.flush()  # durable before the table changes
                    fault_point("sink.commit.started")
                    t0 = self.clock.monotonic_s()
                    details = sink.commit(files, version)
                    details["duration_ms"] = int((self.clock.monotonic_s() - t0) * 1000)
                    fault_point("sink.committed")
                    log.info("Job %s attempt %d: committed sink %s v%d (%d files)",
                             self.run_id, self.attempt, spec.name, version, len(files))
                self._emit(Event(EventType.SINK_COMMITTED,
                                 {"sink": spec.name, "version": version, **details},
                                 vertex_id=vertex.id))
                self.writer.flush()
                committed[spec.name] = version
        return committed
