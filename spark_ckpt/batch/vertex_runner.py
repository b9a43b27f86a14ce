"""Run chosen partitions of one vertex on Spark, natively: Spark's readers, Spark's writers.

No Python runs in a task. Sources are read with ``spark.read``; a vertex's durable output (its
result partitions and its sinks' staged files) is written by Spark's Parquet writer; the driver
only plans, watches files appear and logs events. How a written file is tied to a partition:

* **hash mode** (the vertex has a key: ``key=`` or the columns of a hash input). Partition *j*
  is the output rows with ``pmod(hash(key), parallelism) == j``. The output is written
  hash-partitioned by the key into ``parallelism`` Spark partitions, so Spark partition *j* is
  partition *j* and its file is named ``part-0000j-...``. A join of hashed inputs has its inputs
  repartitioned by the key first, so the join needs no other exchange; any other function is
  left to Spark's planner (partial aggregation included) and its output is repartitioned by the
  key unless Spark's plan already ends that way. The write uses the v2 file committer: each
  task's file appears when the task commits, and the driver logs the partition then, long
  before the Spark job ends. Running some partitions reads the hashed inputs filtered to them;
  a run of a few is laid out by position when that is cheaper
  (:func:`~spark_ckpt.batch.planning.writes_positionally`: partition ``parts[i]`` in Spark
  partition *i*, file ``part-0000i-...``).
* **split mode** (no key; forward inputs from sources or hash-mode vertices). Partition *j* is
  the function over input partition *j* (a source's split *j*). Partitions run in *waves*, one
  Spark job per group of partitions over exactly their input files; a wave's files are shared
  by its partitions, which become durable together when the job ends. The function must not
  shuffle (it would see a wave, not a partition).

A vertex marked ``durable=False`` has no files: consumers compute it inline, in their own job.

This module orchestrates one vertex: check what it reads, adopt what a killed Spark Connect
client's writes finish, run the rest in run units (a thread each, up to
``batch_concurrent_waves`` at once), cancel them all on the first failure, check every
partition was recorded. Its parts: :mod:`~spark_ckpt.batch.planning` (which units),
:mod:`~spark_ckpt.batch.vertex_frames` (the rows), :mod:`~spark_ckpt.batch.arrangement`
(their layout), :mod:`~spark_ckpt.batch.lineage`, :mod:`~spark_ckpt.batch.unit_writer`,
:mod:`~spark_ckpt.batch.file_watcher` and :mod:`~spark_ckpt.batch.adoption`.

Thread ownership: a :class:`VertexRunner` belongs to the job's thread, which runs one vertex
at a time; each run unit runs on a thread of that vertex's pool.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, Any

from spark_ckpt.batch.adoption import Adoption
from spark_ckpt.batch.arrangement import Arrangement
from spark_ckpt.batch.cuts import split_source
from spark_ckpt.batch.lineage import Lineages
from spark_ckpt.batch.planning import check_reads, hash_mode, run_units
from spark_ckpt.batch.unit_writer import UnitWriter
from spark_ckpt.batch.vertex_frames import VertexFrames
from spark_ckpt.errors import TaskExecutionError
from spark_ckpt.execution.attempt_states import ExecutionState
from spark_ckpt.session import session_conf
from spark_ckpt.sources.job_inputs import normalize_path
from spark_ckpt.sparkapi import is_connect, spark_api

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from spark_ckpt.batch.buckets import BucketedTables
    from spark_ckpt.batch.job_attempt import Attempt
    from spark_ckpt.batch.job_progress import JobProgress
    from spark_ckpt.execution.job_graph import JobVertex
    from spark_ckpt.sinks import Sink

__all__ = ["VertexRunner"]

log = logging.getLogger(__name__)


class VertexRunner:
    """Runs the vertices of one job attempt, one at a time (see the module's docstring)."""

    def __init__(self, job: Attempt, splits: dict[str, list[Any]],
                 source_schemas: dict[str, Any], sinks: dict[str, Sink],
                 progress: JobProgress) -> None:
        self.job = job
        self.graph = job.graph
        self.spark = job.spark
        self.frames = VertexFrames(job, splits, source_schemas, sinks)
        self.lineages = Lineages(job, splits)
        self.arrangement = Arrangement(job, self.frames, self.lineages)
        self.writer = UnitWriter(job, self.frames, self.lineages, sinks, progress)
        self.adoption = Adoption(job, self.frames, self.lineages, self.writer, progress)
        self._map_side: str | None = None  # the vertex running as map-side partials, if any

    # -- planning (batch.cuts, BatchJob.explain): see VertexFrames ---------------------------
    @property
    def planning(self) -> str | None:
        return self.frames.planning

    @planning.setter
    def planning(self, mode: str | None) -> None:
        self.frames.planning = mode

    @property
    def sample_rows(self) -> int | None:
        return self.frames.sample_rows

    @sample_rows.setter
    def sample_rows(self, rows: int | None) -> None:
        self.frames.sample_rows = rows

    @property
    def sample_fraction(self) -> float | None:
        return self.frames.sample_fraction

    @sample_fraction.setter
    def sample_fraction(self, fraction: float | None) -> None:
        self.frames.sample_fraction = fraction

    @property
    def tables(self) -> BucketedTables:
        """The catalog tables of durable exchanges."""
        return self.frames.tables

    def compute_inline(self, vertex_id: str, parts: list[int] | None) -> DataFrame:
        """The vertex's output for ``parts`` (None: all), computed from where it reads."""
        return self.frames.compute_inline(vertex_id, parts)

    def exchanges_supported(self) -> bool:
        """True when this session's catalog creates the bucketed tables durable exchanges
        need (asked once)."""
        return self.frames.exchanges_supported()

    def arranged(self, vertex: JobVertex, parts: list[int]) -> DataFrame:
        """The output of ``parts``, laid out as its write lays it out."""
        return self.arrangement.arranged(vertex, parts)

    # -- running ---------------------------------------------------------------------------
    def run(self, vertex: JobVertex, parts: list[int]) -> int:
        """Run ``parts`` of ``vertex``; how many of them a killed client's write operations
        finished instead (:meth:`Adoption.adopt <spark_ckpt.batch.adoption.Adoption.adopt>`)."""
        started = self.job.clock.monotonic_s()
        check_reads(self.graph, vertex)
        adopted = self.adoption.adopt(vertex, parts)
        rest = [p for p in parts if (vertex.id, p) not in self.job.finished]
        units = run_units(vertex, rest, self.job.settings)
        log.info("Job %s attempt %d: vertex %s runs %d of %d partitions in %d Spark job(s) "
                 "(%s mode)", self.job.run_id, self.job.attempt, vertex.id, len(rest),
                 vertex.parallelism, len(units), "hash" if hash_mode(vertex) else "split")
        try:
            if units:
                with self._one_job_waves(vertex):
                    self._run_units(vertex, units)
        finally:  # after every wave thread ended
            self.frames.tables.drop_all()
        missing = [p for p in parts if (vertex.id, p) not in self.job.finished]
        if missing:
            raise TaskExecutionError(
                f"vertex {vertex.id}: expected every one of partitions {parts} recorded when "
                f"their Spark jobs ended, found {missing} not recorded (their files: see the "
                "write directories under results/ and the sinks' _spark_ckpt_staging/)"
            )
        log.info("Job %s attempt %d: vertex %s finished %d partitions in %.1f s",
                 self.job.run_id, self.job.attempt, vertex.id, len(parts),
                 self.job.clock.monotonic_s() - started)
        return adopted

    def _one_job_waves(self, vertex: JobVertex) -> contextlib.AbstractContextManager[Any]:
        """While a partial vertex's waves run: adaptive execution off, and as many shuffle
        partitions as its consumer has partitions (so a wave's merge stage writes bucket *j*
        from task *j* where the buckets are its grouping columns).

        Under adaptive execution a wave is two Spark jobs, its map stage and then its merge
        and write; side by side, Spark's FIFO order runs the second behind the next wave's
        map job, so waves became durable in pairs, one map stage late (shape (f): a kill at
        30% found nothing durable; docs/benchmarks.md). As one job of two stages, a wave's
        merge stage outranks every later wave's map stage and runs as soon as its own map
        stage ends. One at a time instead cost the map stages' idle tails (1.14x plain Spark
        against 1.06x). The settings are the session's, for the vertex's run only: nothing
        but its waves is planned meanwhile (one vertex at a time), and a session that
        refuses them keeps its own (the waves then run as before).

        And, planned so (no bucketed layout: batch.cuts chose map-side partials), the wave
        runs as Spark's map stage alone (:meth:`SparkApi.map_side
        <spark_ckpt.sparkapi.SparkApi.map_side>`), each task's partials durable when every
        task reading the files of its split committed (:meth:`_task_parts`). Where every split
        is one file, the source is one scan of them with a file a task (its open cost as
        large as a partition: Spark packs no two files into one task, and cuts none), so the
        stage is the one plain Spark runs; where a split has several files, each split is a
        scan of its own, one partition (a union of them costs a row boundary between the
        scans' codegen stage and the aggregation's: +8% task time on shape (f))."""
        if vertex.partial_of is None:
            return contextlib.nullcontext()
        consumer = self.graph.vertices[vertex.partial_of]
        stack = contextlib.ExitStack()
        if vertex.map_side and self.job.settings.batch_map_side_partials and \
                not is_connect(self.spark):  # planned so (batch.cuts)
            self._map_side = vertex.id
            stack.callback(setattr, self, "_map_side", None)
            splits = self.frames.splits.get(split_source(self.graph, vertex), [])
            whole = str(1 << 40)  # no file cut (splits over MAP_SIDE_MAX_SPLIT_BYTES are not
            # planned map-side)
            settings = [("spark.sql.files.maxPartitionBytes", whole),
                        ("spark.sql.files.minPartitionNum", "1")]
            if splits and all(len(split) <= 1 for split in splits):
                settings.append(("spark.sql.files.openCostInBytes", whole))
            else:
                self.frames.split_tasks = True
                stack.callback(setattr, self.frames, "split_tasks", False)
                # a union of single-partition reads keeps one partition a read (Spark 4.1+
                # would report the union single-partition, and run it as one task)
                settings.append(("spark.sql.unionOutputPartitioning", "false"))
            for key, value in settings:
                stack.enter_context(session_conf(self.spark, key, value, required=False))
        stack.enter_context(session_conf(self.spark, "spark.sql.adaptive.enabled", "false",
                                         required=False))
        stack.enter_context(session_conf(self.spark, "spark.sql.shuffle.partitions",
                                         str(consumer.parallelism), required=False))
        return stack

    def _run_units(self, vertex: JobVertex, units: list[list[int]]) -> None:
        groups: list[str] = []
        workers = min(self.job.settings.batch_concurrent_waves, len(units))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = []
            for number, unit in enumerate(units):
                group = (f"spark_ckpt-{self.job.run_id}-a{self.job.attempt}-{vertex.id}"
                         f"-u{number}")
                groups.append(group)
                futures.append(pool.submit(self._run_unit, vertex, unit, group, number))
            try:
                for future in concurrent.futures.as_completed(futures):
                    future.result()
            except BaseException:
                for future in futures:  # waves not started yet never start
                    future.cancel()
                for group in groups:
                    spark_api(self.spark).cancel_group(group)
                raise

    def _run_unit(self, vertex: JobVertex, parts: list[int], group: str, number: int) -> None:
        """One run unit, on a thread of the vertex's pool: lay out, record, write."""
        job = self.job
        started_ms = job.clock.now_ms()
        executions = {p: job.registry.create(job.attempt, vertex.id, p) for p in parts}
        for execution in executions.values():
            execution.machine.move_to(ExecutionState.DEPLOYING)
        api = spark_api(self.spark)
        with api.job_group(group, f"spark_ckpt job {job.run_id} attempt {job.attempt}: vertex "
                           f"{vertex.id} partitions {parts[0]}..{parts[-1]}",
                           owner=job.owner_tag):
            df, keep, positional = self.arrangement.for_unit(vertex, parts)
            self.frames.schemas[vertex.id] = df.schema.json()
            # map-side partials: each task writes the partials of the files it reads, its
            # split's, durable when every task of the split committed
            mapped, task_parts = None, None
            if self._map_side == vertex.id:
                try:
                    mapped = api.map_side(df)
                    if mapped is not None:
                        task_parts = self._task_parts(vertex, parts, mapped[1])
                except Exception as exc:  # noqa: BLE001 - Spark's internals refused: merge
                    log.warning("Job %s attempt %d: vertex %s: no map stage cut from the plan "
                                "(%s): the wave merges its partials", job.run_id, job.attempt,
                                vertex.id, str(exc).splitlines()[0][:300] if str(exc) else
                                type(exc).__name__)
                if task_parts is None:
                    mapped = None
                log.info("Job %s attempt %d: vertex %s partitions %d..%d: %s", job.run_id,
                         job.attempt, vertex.id, parts[0], parts[-1],
                         f"map-side partials, {len(task_parts)} tasks for {len(parts)} splits"
                         if task_parts is not None else
                         "partials merged per wave (no map stage to cut from the plan)")
            tag = f"a{job.attempt}-u{number}-{uuid.uuid4().hex[:8]}"
            writes = self.writer.writes(vertex, number, tag, bucketed=mapped is None)
            self.writer.prepare(writes, df.schema)
            operations = self.adoption.record_unit(vertex, parts, number, tag, writes,
                                                   positional)
            self.writer.write(vertex, parts, df if mapped is None else mapped[0], writes,
                              executions, started_ms, keep, operations, positional,
                              task_parts=task_parts)

    def _task_parts(self, vertex: JobVertex, parts: list[int],
                    reads: list[tuple[str, ...]]) -> list[int] | None:
        """For each task of a map-side wave, the split of ``parts`` whose partials it writes
        (-1: it reads no file, so writes no rows), from the files it reads; None (the wave
        merges its partials instead) when a task reads files of two splits, or a file of no
        split of the wave."""
        splits = self.frames.splits.get(split_source(self.graph, vertex), [])
        named = [(normalize_path(path), p) for p in parts if p < len(splits)
                 for path, _ in splits[p]]
        owner = dict(named)
        if len(owner) < len(named):  # two files, one spelling: which split is whose?
            log.warning("Job %s attempt %d: vertex %s: two input files of partitions %d..%d "
                        "read as one path", self.job.run_id, self.job.attempt, vertex.id,
                        parts[0], parts[-1])
            return None
        out = []
        for task, files in enumerate(reads):
            found = {owner.get(normalize_path(f), -2) for f in files}
            if len(found) > 1 or -2 in found:
                log.warning("Job %s attempt %d: vertex %s: map task %d reads %s, not one "
                            "split's files of partitions %d..%d", self.job.run_id,
                            self.job.attempt, vertex.id, task, list(files)[:3], parts[0],
                            parts[-1])
                return None
            out.append(found.pop() if found else -1)
        return out
