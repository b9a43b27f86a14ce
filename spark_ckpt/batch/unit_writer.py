"""Writing one durable run unit's output with Spark's Parquet writer: the unit's writes (its
result files, and each sink's staged files, a sink beside another on the same file system
mirroring its files instead of writing them again), each sink prepared once, and the write
itself, with a :class:`~spark_ckpt.batch.file_watcher.FileWatcher` recording partitions as
their files appear.

Thread ownership: :class:`UnitWriter` is shared by the wave threads of a vertex; the set of
prepared sinks is its only state, guarded by a lock. Each :meth:`UnitWriter.write` runs on
the thread of its unit (and starts that unit's poller thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

from spark_ckpt.batch.buckets import layout_suffix
from spark_ckpt.batch.file_watcher import FileWatcher, UnitWrite
from spark_ckpt.errors import TaskExecutionError
from spark_ckpt.execution.attempt_states import ExecutionState
from spark_ckpt.execution.result_partition import result_dir
from spark_ckpt.sparkapi import spark_api
from spark_ckpt.sparkapi.committers import PER_TASK_WRITE_OPTIONS
from spark_ckpt.storage import join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from spark_ckpt.batch.job_attempt import Attempt
    from spark_ckpt.batch.job_progress import JobProgress
    from spark_ckpt.batch.lineage import Lineages
    from spark_ckpt.batch.vertex_frames import VertexFrames
    from spark_ckpt.execution.job_graph import JobVertex
    from spark_ckpt.sinks import Sink

__all__ = ["UnitWriter"]

log = logging.getLogger(__name__)


def _store_of(path: str) -> str:
    """The file system a path is on (scheme and authority): a mirror's files are linked or
    copied within one."""
    if "://" not in path:
        return "file://"
    scheme, rest = path.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0] if scheme != 'file' else ''}"


class UnitWriter:
    """Writes one attempt's run units (see the module's docstring)."""

    def __init__(self, job: Attempt, frames: VertexFrames, lineages: Lineages,
                 sinks: dict[str, Sink], progress: JobProgress) -> None:
        self.job = job
        self.frames = frames
        self.lineages = lineages
        self.sinks = sinks
        self.progress = progress
        self._prepared: set[str] = set()
        self._prepare_lock = threading.Lock()

    def writes(self, vertex: JobVertex, number: int, tag: str,
               bucketed: bool = True) -> list[UnitWrite]:
        """The writes of run unit ``number``, in directories named by ``tag`` (this unit's, or
        an earlier attempt's unit's, derived as its driver did); ``bucketed``: False for a
        wave of map-side partials (one file a task, not bucketed)."""
        job = self.job
        writes = []
        result_sink = self.frames.result_sink(vertex)
        if self.frames.needs_results(vertex) and result_sink is None:
            bucket_by, buckets = self.frames.bucketing(vertex) if bucketed else ((), 0)
            if buckets:
                tag += layout_suffix(bucket_by, buckets)
            directory = join(result_dir(job.paths["job"], vertex.id), tag)
            writes.append(UnitWrite("result", vertex.id, job.storage.spark_path(directory),
                                    bucket_by=bucket_by, buckets=buckets))
        for spec in vertex.sinks:
            staging = self.sinks[spec.name].staging_dir(vertex.id, tag)
            write = UnitWrite("sink", spec.name, staging, tuple(spec.partition_by))
            write.mirror_of = next((w for w in writes if w.kind == "sink" and w.mirror_of is None
                                    and w.partition_by == write.partition_by
                                    and _store_of(w.directory) == _store_of(staging)), None)
            writes.append(write)
        return writes

    def prepare(self, writes: list[UnitWrite], schema: StructType) -> None:
        """Prepare each sink ``writes`` stage files for, once per attempt."""
        with self._prepare_lock:  # waves run in threads; a sink is prepared once
            for w in writes:
                if w.kind == "sink" and w.target not in self._prepared:
                    self.sinks[w.target].prepare(schema)
                    self._prepared.add(w.target)

    def write(self, vertex: JobVertex, parts: list[int], df: DataFrame,
              writes: list[UnitWrite], executions: dict[int, Any], started_ms: int,
              keep: DataFrame | None = None,
              operations: list[str] | None = None, positional: bool = False,
              task_parts: list[int] | None = None) -> None:
        """Run ``writes`` of ``df`` (``parts`` of ``vertex``) and record the partitions as
        their files appear; ``keep``: the frame persisted on the server meanwhile;
        ``operations``: the ids the writes' operations take (the unit's record);
        ``task_parts``: the partition each Spark task computes (map-side partials: several
        tasks may compute one, from its files), recorded when all of their files are in
        place."""
        from pyspark.storagelevel import StorageLevel

        for execution in executions.values():
            execution.machine.move_to(ExecutionState.RUNNING)
        tracker = FileWatcher(self.job, self.frames.schemas, self.progress, vertex, parts,
                              writes, executions, started_ms, positional, task_parts)
        cached = sum(w.mirror_of is None for w in writes) > 1 and keep is None
        if cached:
            df = df.persist()
        if keep is not None:
            # on disk, not the server's memory: other sessions share it; a killed client's
            # next one finds it (and the shuffles under it) by the same plan
            keep.persist(StorageLevel.DISK_ONLY)
            log.info("Job %s attempt %d: %s persisted on the server while it runs (inputs "
                     "%s)", self.job.run_id, self.job.attempt, vertex.id,
                     self.lineages.inputs_tag())
        stop = threading.Event()
        poller = None
        if tracker.per_task:
            poller = threading.Thread(target=tracker.poll, args=(stop,),
                                      name=f"spark-ckpt-poll-{vertex.id}", daemon=True)
            poller.start()
        ids = iter(operations or ())
        api = spark_api(self.job.spark)
        try:
            for w in writes:
                if w.mirror_of is not None:
                    continue
                if w.buckets:
                    self.frames.tables.write_bucketed(df, w.directory, w.bucket_by, w.buckets,
                                                      PER_TASK_WRITE_OPTIONS)
                else:
                    writer = df.write.mode("append").options(**PER_TASK_WRITE_OPTIONS)
                    if w.partition_by:
                        writer = writer.partitionBy(*w.partition_by)
                    operation = next(ids, None)
                    with api.operation_id(operation) if operation else contextlib.nullcontext():
                        writer.parquet(w.directory)
                w.done = True
                for mirror in writes:
                    if mirror.mirror_of is w:
                        mirror.done = True
        except Exception as exc:
            for execution in executions.values():
                execution.machine.move_to(ExecutionState.FAILED)
            raise TaskExecutionError(
                f"vertex {vertex.id} partitions {parts[0]}..{parts[-1]} failed: {exc}"
            ) from exc
        finally:
            stop.set()
            if poller is not None:
                poller.join()
            if cached:
                df.unpersist()
            if keep is not None and not all(w.done for w in writes):
                keep.unpersist()  # failed: nothing of it is read again in this process
        # A kept frame stays until every partition is recorded: a client killed while
        # recording leaves it for the next one, which runs what was not recorded
        try:
            tracker.finish()
        finally:
            if keep is not None:
                keep.unpersist()
