"""Spark Connect: taking over the writes a killed client left running on the server.

A Spark Connect client's operations outlive it: the server runs a killed client's write on to
its end, and its tasks keep committing files into the directories that client chose. So a
driver on Spark Connect records each run unit before its writes start
(:meth:`Adoption.record_unit`, a :class:`~spark_ckpt.batch.unit_records.UnitRecord`); the
next attempt, for a vertex it has to run, waits for the operations of the units whose lineage
is its own, then records the partitions their files complete, as the killed client would have
(:meth:`Adoption.adopt`). Units that read anything else are interrupted.

Thread ownership: :meth:`Adoption.adopt` runs on the job's thread before the vertex's units
start; :meth:`Adoption.record_unit` on each unit's thread. No state of its own.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING

from spark_ckpt.batch.file_watcher import FileWatcher
from spark_ckpt.batch.planning import hash_mode, reads_exchanges
from spark_ckpt.batch.unit_records import UnitRecord, write_unit
from spark_ckpt.errors import JobFencedError
from spark_ckpt.execution.attempt_states import ExecutionState
from spark_ckpt.sparkapi import spark_api
from spark_ckpt.sparkapi.committers import SUCCESS_MARKER, commits_per_task
from spark_ckpt.storage import Storage, join

if TYPE_CHECKING:
    from spark_ckpt.batch.file_watcher import UnitWrite
    from spark_ckpt.batch.job_attempt import Attempt
    from spark_ckpt.batch.job_progress import JobProgress
    from spark_ckpt.batch.lineage import Lineages
    from spark_ckpt.batch.unit_writer import UnitWriter
    from spark_ckpt.batch.vertex_frames import VertexFrames
    from spark_ckpt.execution.job_graph import JobVertex

__all__ = ["Adoption"]

log = logging.getLogger(__name__)


class Adoption:
    """Records one attempt's run units, and adopts what earlier attempts' units finish (see
    the module's docstring)."""

    def __init__(self, job: Attempt, frames: VertexFrames, lineages: Lineages,
                 writer: UnitWriter, progress: JobProgress) -> None:
        self.job = job
        self.frames = frames
        self.lineages = lineages
        self.writer = writer
        self.progress = progress

    def record_unit(self, vertex: JobVertex, parts: list[int], number: int, tag: str,
                    writes: list[UnitWrite], positional: bool = False) -> list[str] | None:
        """On Spark Connect, record the unit before its writes start, with the ids its
        operations will have (:mod:`spark_ckpt.batch.unit_records`); None when not recorded."""
        api = spark_api(self.job.spark)
        session = api.session_id()
        if not (session and self.job.settings.batch_adopt_operations) or \
                self.frames.planning is not None or self.job.explaining or \
                any(w.buckets for w in writes) or reads_exchanges(self.frames.graph, vertex):
            # a durable exchange's writes, and a vertex reading its tables (which the next
            # attempt drops at its start), are run again
            return None
        lineage = self.lineages.of(vertex)
        if lineage is None:
            return None
        operations = [str(uuid.uuid4()) for w in writes if w.mirror_of is None]
        try:
            write_unit(self.job.storage, self.job.paths["job"], UnitRecord(
                attempt=self.job.attempt, vertex=vertex.id, number=number, tag=tag,
                parts=tuple(parts), operations=tuple(operations), lineage=lineage,
                schema=self.frames.schemas[vertex.id], session=session,
                user=api.session_user() or "",
                per_task=hash_mode(vertex) and commits_per_task(self.job.spark),
                positional=positional))
        except Exception as exc:  # noqa: BLE001 - a speed-up for the next attempt only
            log.warning("Job %s attempt %d: could not record run unit %d of %s (%s); a client "
                        "killed during it leaves nothing the next one waits for",
                        self.job.run_id, self.job.attempt, number, vertex.id, exc)
            return None
        return operations

    def adopt(self, vertex: JobVertex, parts: list[int]) -> int:
        """Wait for the write operations earlier attempts left running for ``parts`` of
        ``vertex`` when they read what this attempt would read, and record the partitions
        their files complete; how many. Units that read anything else are interrupted."""
        def wanted(record: UnitRecord) -> set[int]:
            return {p for p in parts
                    if self.job.once_finished.get((vertex.id, p), 0) < record.attempt}

        records = [r for r in self.job.left_running
                   if r.vertex == vertex.id and set(r.parts) & wanted(r)]
        if not records:
            return 0
        lineage = self.lineages.of(vertex)
        other = {r.attempt for r in records if r.lineage != lineage}
        if other:
            log.info("Job %s attempt %d: the writes of %s attempt(s) %s left running read other "
                     "inputs; interrupting them", self.job.run_id, self.job.attempt,
                     vertex.id, sorted(other))
            self.job.release_earlier(other)
        api = spark_api(self.job.spark)
        before = sum((vertex.id, p) in self.job.finished for p in parts)
        clock = self.job.clock
        deadline = clock.monotonic_s() + self.job.settings.batch_adopt_max_wait_ms / 1000.0
        try:
            for record in records:
                if record.attempt in other:
                    continue
                log.info("Job %s attempt %d: waiting for the writes of %s partitions %s that "
                         "attempt %d left running on the server (operations %s)",
                         self.job.run_id, self.job.attempt, vertex.id, list(record.parts),
                         record.attempt, ", ".join(record.operations))
                try:
                    states = [api.await_operation(record.session, record.user or None, op,
                                                  max(0.0, deadline - clock.monotonic_s()),
                                                  clock=clock)
                              for op in record.operations]
                    log.info("Job %s attempt %d: the writes of %s attempt %d unit %d: %s",
                             self.job.run_id, self.job.attempt, vertex.id, record.attempt,
                             record.number, ", ".join(states))
                    self._record_left(vertex, record, states, wanted(record))
                except JobFencedError:
                    raise
                except Exception as exc:
                    if not hash_mode(vertex) and any(
                            self.job.finished.get((vertex.id, p)) is not None and
                            self.job.finished[(vertex.id, p)].job_attempt == self.job.attempt
                            for p in record.parts):
                        raise  # a wave counts whole: part of it recorded, it may not run again
                    # a speed-up: run them instead
                    log.warning("Job %s attempt %d: could not take what attempt %d's writes of "
                                "%s finished (%s); running those partitions again",
                                self.job.run_id, self.job.attempt, record.attempt, vertex.id,
                                exc)
        finally:
            self.job.release_earlier({r.attempt for r in records})
        adopted = sum((vertex.id, p) in self.job.finished for p in parts) - before
        if adopted:
            log.info("Job %s attempt %d: %s: %d partition(s) written by operations a killed "
                     "client left running, recorded without running them again",
                     self.job.run_id, self.job.attempt, vertex.id, adopted)
        return adopted

    def _record_left(self, vertex: JobVertex, record: UnitRecord, states: list[str],
                     wanted: set[int]) -> None:
        """Record what one earlier unit's files complete, as its own watcher would have."""
        from pyspark.sql.types import StructType

        writes = self.writer.writes(vertex, record.number, tag=record.tag)
        own = [w for w in writes if w.mirror_of is None]
        if len(own) != len(record.operations) or any(w.buckets for w in writes):
            log.warning("Job %s: the unit record of %s attempt %d names %d writes, this "
                        "attempt makes %d; running its partitions again", self.job.run_id,
                        vertex.id, record.attempt, len(record.operations), len(own))
            return
        for w, state in zip(own, states, strict=True):
            # ended whole: its end seen now, as a success or as an end the server still
            # knows of with the commit's _SUCCESS marker beside (an old marker alone is no
            # proof that a missing file was an empty partition: files may be lost since)
            store = Storage(w.directory)
            w.done = store.exists(store.root) and (
                state == "succeeded" or
                (state == "ended" and store.exists(join(store.root, SUCCESS_MARKER))))
        for w in writes:
            if w.mirror_of is not None:
                w.done = w.mirror_of.done
        todo = [p for p in record.parts
                if p in wanted and (vertex.id, p) not in self.job.finished]
        hashed = hash_mode(vertex)
        if not todo or (not hashed and (len(todo) < len(record.parts)
                                        or not all(w.done for w in writes))):
            return  # a wave counts whole, when every write ended
        self.frames.schemas.setdefault(vertex.id, record.schema)
        self.writer.prepare(writes, StructType.fromJson(json.loads(record.schema)))
        executions = {p: self.job.registry.create(self.job.attempt, vertex.id, p)
                      for p in todo}
        for execution in executions.values():
            execution.machine.move_to(ExecutionState.DEPLOYING)
            execution.machine.move_to(ExecutionState.RUNNING)
        tracker = FileWatcher(self.job, self.frames.schemas, self.progress, vertex,
                              list(record.parts), writes, executions, self.job.clock.now_ms(),
                              record.positional)
        tracker.per_task = hashed and record.per_task  # as the killed writer committed
        tracker.recorded = set(record.parts) - set(todo)
        if hashed:
            tracker.check_attribution()
            tracker.record_visible()
        else:
            tracker.finish()
        for p, execution in executions.items():
            if p not in tracker.recorded:
                execution.machine.move_to(ExecutionState.FAILED)
