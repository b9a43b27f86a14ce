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
  a run of a few is laid out by position when that is cheaper (:meth:`VertexRunner.positional`:
  partition ``parts[i]`` in Spark partition *i*, file ``part-0000i-...``).
* **split mode** (no key; forward inputs from sources or hash-mode vertices). Partition *j* is
  the function over input partition *j* (a source's split *j*). Partitions run in *waves*, one
  Spark job per group of partitions over exactly their input files; a wave's files are shared
  by its partitions, which become durable together when the job ends. The function must not
  shuffle (it would see a wave, not a partition).

A vertex marked ``durable=False`` has no files: consumers compute it inline, in their own job.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import threading
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from spark_ckpt.batch.adoption import UnitRecord, write_unit
from spark_ckpt.batch.buckets import BucketedTables, job_table_prefix, layout_suffix
from spark_ckpt.batch.cuts import wave_size, waves_of
from spark_ckpt.errors import JobDefinitionError, JobFencedError, TaskExecutionError
from spark_ckpt.execution.attempt_states import ExecutionState
from spark_ckpt.execution.job_graph import Edge, JobVertex
from spark_ckpt.execution.result_partition import OutputFile, PartitionResult, result_dir
from spark_ckpt.faults import fault_point
from spark_ckpt.sinks import Sink, partition_values, written_files
from spark_ckpt.sources.job_inputs import FileSource
from spark_ckpt.sparkapi import empty_frame, frame_api, is_connect, spark_api
from spark_ckpt.storage import Storage, join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from spark_ckpt.batch.job_progress import JobProgress
    from spark_ckpt.clock import Clock
    from spark_ckpt.eventlog.replay import FinishedPartition
    from spark_ckpt.execution.attempts import ExecutionRegistry
    from spark_ckpt.execution.job_graph import JobGraph
    from spark_ckpt.options import Settings
    from spark_ckpt.sources.file_identity import FileIdentity

__all__ = ["VertexRunner", "exchanges", "plan_shuffles"]


class Attempt(Protocol):
    """What running vertices needs of the job attempt that runs them (the job runner)."""

    run_id: str
    attempt: int
    owner_tag: str  # tags every Spark operation of the attempt (Spark Connect)
    graph: JobGraph
    spark: SparkSession
    settings: Settings
    storage: Storage
    paths: dict[str, str]
    registry: ExecutionRegistry
    finished: dict[tuple[str, int], FinishedPartition]
    clock: Clock  # the partitions' start and finish times
    explaining: bool  # BatchJob.explain: nothing may be written in the job's directory
    # what identified each file of each file source (size, time, object version), by path
    input_files: dict[str, dict[str, FileIdentity]]

    def partition_finished(self, result: PartitionResult) -> bool:
        """Record a finished partition once; False for duplicates and stale attempts."""

    # Spark Connect: the run units earlier attempts left running (batch.adoption), and the
    # last attempt that logged each partition finished: never taken from a unit of that
    # attempt or an earlier one (its file was logged once, and may be gone since)
    left_running: list[UnitRecord]
    once_finished: dict[tuple[str, int], int]

    def release_earlier(self, attempts: set[int]) -> None:
        """Interrupt what earlier ``attempts`` still run on the server."""

log = logging.getLogger(__name__)

_SHUFFLE = re.compile(r"(?<!Broadcast)Exchange |\bUnion\b|\bCoalesce\b")
_EXCHANGE = re.compile(r"(?<!Broadcast)Exchange ")
_PART_FILE = re.compile(r"^part-(\d{5,})-.*\.parquet$")
# The v2 file committer moves a task's file into place when the task commits; one file per
# task (no maxRecordsPerFile split) keeps that move a single rename.
_V2 = {"mapreduce.fileoutputcommitter.algorithm.version": "2", "maxRecordsPerFile": "0"}
# A keyed vertex run for some of its partitions (a re-run, a recovery) can write through
# len(parts) Spark partitions, Spark partition i holding partition parts[i], instead of through
# its parallelism, where every partition not running is an empty task: when shuffling the
# output once more costs less than the empty tasks it saves. On the orders report (2 cores)
# 45 empty tasks took 0.4 s of wall time (9 ms each) and shuffling 8 MB of Parquet output
# (5 partitions) once more 0.2 s (6 ms per 256 KiB): this many output bytes per empty task
# saved leans, conservatively, towards the wide stage (sizes are compressed Parquet bytes; the
# shuffle moves more).
_EMPTY_TASK_BYTES = 256 * 1024
_DEFAULT_COMMITTERS = {
    "spark.sql.sources.commitProtocolClass":
        "org.apache.spark.sql.execution.datasources.SQLHadoopMapReduceCommitProtocol",
    "spark.sql.parquet.output.committer.class":
        "org.apache.parquet.hadoop.ParquetOutputCommitter",
}


def plan_shuffles(df: DataFrame) -> bool:
    """True when the physical plan moves rows between partitions (broadcasts do not)."""
    return bool(_SHUFFLE.search(frame_api(df).executed_plan(df)))


def _store_of(path: str) -> str:
    """The file system a path is on (scheme and authority): a mirror's files are linked or
    copied within one."""
    if "://" not in path:
        return "file://"
    scheme, rest = path.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0] if scheme != 'file' else ''}"


def exchanges(df: DataFrame) -> list[str]:
    """The exchanges in the physical plan, without expression ids: what Spark moves."""
    plan = frame_api(df).executed_plan(df)
    out = []
    for line in plan.splitlines():
        if "Exchange " not in line:
            continue
        text = line[line.index("Exchange ") - (9 if "BroadcastExchange " in line else 0):]
        text = re.sub(r"#\d+L?", "", text)
        text = re.sub(r",? ?\[plan_id=\d+\]", "", text).strip()
        out.append(text)
    return out


def _ends_hash_partitioned(df: DataFrame, key: tuple[str, ...], parallelism: int) -> bool:
    """True when Spark's plan ends hash-partitioned by ``key`` into ``parallelism`` partitions
    and every exchange in it is a user repartition by number: adaptive execution may coalesce
    or split the exchanges Spark adds itself (ENSURE_REQUIREMENTS), never those."""
    api = frame_api(df)
    plan = api.executed_plan(df)
    for line in plan.splitlines():
        if _EXCHANGE.search(line) and "REPARTITION_BY_NUM" not in line:
            return False
    return api.ends_hash_partitioned(df, tuple(key), parallelism, plan=plan)


@dataclasses.dataclass
class _Write:
    """One Spark write of a run unit: the result files, or one sink's staged files."""

    kind: str  # "result" or "sink"
    target: str  # vertex id or sink name
    directory: str  # Spark URI of a directory only this write uses
    partition_by: tuple[str, ...] = ()
    done: bool = False
    # Written bucketed by these columns into ``buckets`` buckets (batch.cuts' exchange cuts):
    # file .../<wave>-b<buckets>/spark_ckpt_bucket=<j>/part-..._<j>.c000.parquet holds the
    # wave's rows of bucket j, which a bucketed table over the waves reads as bucket j.
    bucket_by: tuple[str, ...] = ()
    buckets: int = 0
    # Another write of the same rows with the same layout: this one's files are that one's,
    # linked (or copied) into this directory, so Spark writes the rows once.
    mirror_of: _Write | None = None


class VertexRunner:
    def __init__(self, job: Attempt, splits: dict[str, list[Any]],
                 source_schemas: dict[str, Any], sinks: dict[str, Sink],
                 progress: JobProgress) -> None:
        self.job = job
        self.graph = job.graph
        self.spark = job.spark
        self.splits = splits
        self.source_schemas = source_schemas
        self.sinks = sinks
        self.progress = progress
        self.schemas: dict[str, str] = {}
        self._prepared: set[str] = set()
        self._prepare_lock = threading.Lock()
        # Planning (batch.cuts): "inline" computes every vertex from the sources (samples,
        # the consumer's output); "explain" reads a durable vertex as an empty frame of its
        # schema, so a vertex's plan shows its own exchanges only. Nothing is written.
        self.planning: str | None = None
        self.sample_rows: int | None = None  # planning: read at most this many rows a source
        # durable exchanges' catalog tables
        self.tables = BucketedTables(self.spark, self._table_location,
                                     job_table_prefix(job.run_id))
        self._scratch: str | None = None
        self._tag: str | None = None  # _inputs_tag, once known ("" for none)
        self._lineages: dict[str, str | None] = {}  # lineage() per vertex, once known

    # -- modes -----------------------------------------------------------------------------
    def hash_mode(self, vertex: JobVertex) -> bool:
        return bool(vertex.key)

    def per_task_commits(self) -> bool:
        """True when a task's file is in place, whole, exactly when the task commits: Spark's
        default commit protocol and Parquet committer (with the v2 algorithm). Any other
        committer (a cloud vendor's direct or magic committer) counts at job end only."""
        conf = self.spark.conf
        return all((conf.get(key, None) or default) == default
                   for key, default in _DEFAULT_COMMITTERS.items())

    def _result_sink(self, vertex: JobVertex) -> str | None:
        """A sink whose staged files hold exactly the vertex output, read by consumers."""
        for spec in vertex.sinks:
            if not spec.partition_by:
                return spec.name
        return None

    def bucketing(self, vertex: JobVertex) -> tuple[tuple[str, ...], int]:
        """(columns, bucket count) the vertex's result files are written bucketed by, or
        ((), 0): a durable exchange (batch.buckets) where the planner chose one and this
        session's catalog can write it."""
        consumer = self.graph.vertices.get(vertex.bucket_for or "")
        if consumer is None or not vertex.bucket_by or self.hash_mode(vertex) or \
                not self.exchanges_supported():
            return (), 0
        return tuple(vertex.bucket_by), consumer.parallelism

    def exchanges_supported(self) -> bool:
        """True when this session's catalog creates the bucketed tables durable exchanges
        need (asked once)."""
        return self.tables.supported()

    def _table_location(self) -> str:
        """The empty directory temporary tables point at: ``results/_tables`` in the job's
        directory once it exists, else (``explain``, which writes nothing there, or a plan
        before the job's first run) a new temporary directory of the driver's, removed when
        the process ends."""
        if self._scratch is None:
            job_dir = self.job.paths["job"]
            if self.job.storage.exists(job_dir) and not self.job.explaining:
                self._scratch = join(job_dir, "results", "_tables")
                self.job.storage.makedirs(self._scratch)
                self._scratch = self.job.storage.spark_path(self._scratch)
            else:
                import atexit
                import pathlib
                import shutil
                import tempfile

                scratch = tempfile.mkdtemp(prefix="spark-ckpt-tables-")
                atexit.register(shutil.rmtree, scratch, ignore_errors=True)
                self._scratch = pathlib.Path(scratch).as_uri()
        return self._scratch

    def _needs_results(self, vertex: JobVertex) -> bool:
        live = {v.id for v in self.graph.live_vertices()}
        return any(c in live for c, _ in self.graph.consumers(vertex.id))

    # -- schemas ---------------------------------------------------------------------------
    def output_schema(self, vertex_id: str) -> StructType:
        import json

        from pyspark.sql.types import StructType

        if vertex_id not in self.schemas:
            recorded = next((f.schema for (v, _), f in self.job.finished.items()
                             if v == vertex_id and f.schema), None)
            if recorded:
                self.schemas[vertex_id] = recorded
            else:  # plan (not run) the vertex to learn its schema
                vertex = self.graph.vertices[vertex_id]
                mode, self.planning = self.planning, self.planning and "inline"
                try:
                    self.schemas[vertex_id] = self._compute(vertex, None).schema.json()
                finally:
                    self.planning = mode
        return StructType.fromJson(json.loads(self.schemas[vertex_id]))

    # -- the rows of a vertex's partitions, as a DataFrame ---------------------------------
    def frame(self, vertex_id: str, parts: list[int] | None) -> DataFrame:
        """Output rows of ``parts`` of a vertex (None: all), read where they are."""
        vertex = self.graph.vertices[vertex_id]
        if vertex.is_source and not vertex.sinks:
            return self._source_frame(vertex, parts)
        if not vertex.durable or self.planning == "inline":
            return self._compute(vertex, parts)
        if self.planning == "explain":
            return empty_frame(self.spark, self.output_schema(vertex_id))
        return self._read_results(vertex, parts)

    def compute_inline(self, vertex_id: str, parts: list[int] | None) -> DataFrame:
        """The vertex's output for ``parts`` (None: all), computed from where it reads."""
        vertex = self.graph.vertices[vertex_id]
        if vertex.is_source:
            return self._source_frame(vertex, parts)
        return self._compute(vertex, parts)

    def _source_frame(self, vertex: JobVertex, parts: list[int] | None) -> DataFrame:
        df = self._source_rows(vertex, parts)
        if self.planning == "inline" and self.sample_rows is not None and parts is not None:
            df = df.limit(self.sample_rows)
        return df

    def _source_rows(self, vertex: JobVertex, parts: list[int] | None) -> DataFrame:
        from pyspark.sql import functions as F

        source = vertex.source
        if isinstance(source, FileSource):
            splits = self.splits[vertex.id]
            chosen = range(len(splits)) if parts is None else parts
            files = [path for p in chosen for path, _ in splits[p]]
            schema = self.source_schemas[vertex.id]
            if not files:
                return empty_frame(self.spark, schema)
            return source.read(self.spark, schema, files)
        df = source.build(self.spark)
        if parts is not None and vertex.parallelism > 1:
            bucket = F.pmod(F.hash(*source.split_by), F.lit(vertex.parallelism))
            df = df.where(bucket.isin(parts))
        return df

    def _read_results(self, vertex: JobVertex, parts: list[int] | None) -> DataFrame:
        chosen = range(vertex.parallelism) if parts is None else parts
        result_sink = self._result_sink(vertex)
        files: dict[str, None] = {}  # ordered, without the repeats of shared wave files
        for p in chosen:
            finished = self.job.finished.get((vertex.id, p))
            if finished is None:
                raise TaskExecutionError(
                    f"partition {p} of {vertex.id} is needed but not finished (scheduling bug)"
                )
            for o in finished.outputs:
                if (o.kind == "result" or (o.kind == "sink" and o.target == result_sink)) \
                        and o.rows:
                    files[o.path] = None
        schema = self.output_schema(vertex.id)
        if result_sink is not None:
            files = dict.fromkeys(self.sinks[result_sink].locate(list(files)))
        if not files:
            return empty_frame(self.spark, schema)
        return self.spark.read.schema(schema).parquet(*files)

    def _input(self, edge: Edge, consumer: JobVertex, parts: list[int] | None,
               co_partition: bool = True) -> DataFrame:
        """One input of ``consumer``: the rows its ``parts`` read (None: all); a join's hash
        inputs co-partitioned into the consumer's partitions unless not ``co_partition``
        (Spark then shuffles them for the join as it does any join's)."""
        from pyspark.sql import functions as F

        upstream = self.graph.vertices[edge.upstream]
        if edge.kind == "broadcast":
            return F.broadcast(self.frame(upstream.id, None))
        if edge.kind == "hash":
            df = self.frame(upstream.id, None)
            if parts is not None:
                bucket = F.pmod(F.hash(*edge.columns), F.lit(consumer.parallelism))
                df = df.where(bucket.isin(parts))
            if co_partition and consumer.key and tuple(edge.columns) == tuple(consumer.key) \
                    and sum(e.kind == "hash" for e in consumer.inputs) > 1:
                df = df.repartition(consumer.parallelism, *edge.columns)  # co-partition a join
            return df
        # forward: partition j of the consumer reads partition j of the upstream, which is
        # what the graph's restart and invalidation rules assume (checked in run())
        return self.frame(upstream.id, parts)

    def _bucketed_inputs(self, vertex: JobVertex, parts: list[int] | None
                         ) -> dict[int, DataFrame]:
        """Every hash input of ``vertex`` read bucketed (by input index), or none of them:
        a join of a bucketed and a plain input lets Spark broadcast one side and stream the
        other as plain splits (adaptive execution may switch to that while running), so
        partition j would no longer be bucket j."""
        hashed = [i for i, e in enumerate(vertex.inputs) if e.kind == "hash"]
        if not hashed or any(self.graph.vertices[vertex.inputs[i].upstream].bucket_for
                             != vertex.id for i in hashed):
            return {}
        out = {}
        for i in hashed:
            edge = vertex.inputs[i]
            df = self._bucketed_input(self.graph.vertices[edge.upstream], edge, vertex, parts)
            if df is None:
                log.info("Job %s attempt %d: %s reads its inputs plainly (%s is not bucketed "
                         "for its %d partitions)", self.job.run_id, self.job.attempt,
                         vertex.id, edge.upstream, vertex.parallelism)
                return {}
            out[i] = df
        return out

    def _bucketed_input(self, upstream: JobVertex, edge: Edge, consumer: JobVertex,
                        parts: list[int] | None) -> DataFrame | None:
        """A durable exchange's rows for ``parts`` of its consumer, read bucketed (Spark
        needs no exchange to join or group them by the key); None: read them plainly."""
        if self.planning == "inline" or upstream.bucket_for != consumer.id or \
                tuple(upstream.bucket_by) != tuple(edge.columns) or not upstream.durable or \
                upstream.sinks:
            return None
        files: dict[str, None] = {}
        for p in range(0 if self.planning == "explain" else upstream.parallelism):
            finished = self.job.finished.get((upstream.id, p))
            if finished is None:
                return None  # the plain read names what is missing
            for o in finished.outputs:
                if o.kind == "result":
                    files[o.path] = None
        return self.tables.read(self.output_schema(upstream.id), list(files),
                                tuple(edge.columns), consumer.parallelism, parts)

    def _compute(self, vertex: JobVertex, parts: list[int] | None,
                 co_partition: bool = True) -> DataFrame:
        """The vertex output for ``parts`` (None: all), before it is arranged for writing."""
        if vertex.is_source:
            return self._source_frame(vertex, parts)
        assert vertex.fn is not None
        fn = vertex.fn_final or vertex.fn  # a consumer of partial aggregates merges them
        bucketed = self._bucketed_inputs(vertex, parts) if self.planning != "inline" else {}
        out = fn(*[bucketed[i] if i in bucketed else
                   self._input(edge, vertex, parts, co_partition)
                   for i, edge in enumerate(vertex.inputs)])
        from pyspark.sql import DataFrame as Frame  # (Spark Connect's is one; asking for
        # a schema there is a round trip to the server)

        if not isinstance(out, Frame):
            raise JobDefinitionError(
                f"vertex {vertex.id}: expected its function to return a DataFrame, found "
                f"{type(out).__name__}"
            )
        return out

    def _check_key(self, vertex: JobVertex, df: DataFrame) -> None:
        missing = [c for c in vertex.key if c not in df.columns]
        if missing:
            raise JobDefinitionError(
                f"vertex {vertex.id}: each output row must keep the key columns that place it "
                f"in a partition; expected key columns {list(vertex.key)} in the output, found "
                f"columns {df.columns}. Keep them in the output, or set key= on the vertex and "
                f"hash its inputs by it."
            )

    # -- running ---------------------------------------------------------------------------
    def run(self, vertex: JobVertex, parts: list[int]) -> int:
        """Run ``parts`` of ``vertex``; how many of them a killed client's write operations
        finished instead (:meth:`adopt`)."""
        started = self.job.clock.monotonic_s()
        if not self.hash_mode(vertex):
            for edge in vertex.inputs:
                upstream = self.graph.vertices[edge.upstream]
                if edge.kind == "forward" and upstream.durable and not upstream.is_source \
                        and not self.hash_mode(upstream):
                    raise JobDefinitionError(
                        f"vertex {vertex.id} reads {upstream.id} forward, but {upstream.id} has "
                        f"no key, so its partitions share files; read it with "
                        f"{upstream.id}.by(columns), or mark {upstream.id} durable=False"
                    )
        for edge in vertex.inputs:
            upstream = self.graph.vertices[edge.upstream]
            if edge.kind == "forward" and self.hash_mode(vertex) and \
                    tuple(upstream.key) != tuple(vertex.key):
                raise JobDefinitionError(
                    f"vertex {vertex.id} (key {list(vertex.key)}) reads {upstream.id} forward, "
                    f"but {upstream.id}'s partitions are not split by that key (its key: "
                    f"{list(upstream.key) or 'none'}); read it with "
                    f"{upstream.id}.by({', '.join(map(repr, vertex.key))})"
                )
        adopted = self.adopt(vertex, parts)
        rest = [p for p in parts if (vertex.id, p) not in self.job.finished]
        units = ([rest] if self.hash_mode(vertex) else self._waves(vertex, rest)) if rest else []
        log.info("Job %s attempt %d: vertex %s runs %d of %d partitions in %d Spark job(s) "
                 "(%s mode)", self.job.run_id, self.job.attempt, vertex.id, len(rest),
                 vertex.parallelism, len(units), "hash" if self.hash_mode(vertex) else "split")
        try:
            if units:
                self._run_units(vertex, units)
        finally:  # after every wave thread ended
            self.tables.drop_all()
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

    def _waves(self, vertex: JobVertex, parts: list[int]) -> list[list[int]]:
        # A durable exchange's first waves are small: the join after it starts only when
        # every wave is done, so what a job killed early keeps is its finished waves
        per_wave = self.job.settings.batch_partitions_per_wave
        return waves_of(parts, wave_size(vertex.parallelism, per_wave,
                                         fine=bool(vertex.partial_of or vertex.exchange_of)),
                        ramp=per_wave == 0 and vertex.exchange_of is not None)

    # -- what a killed Spark Connect client left running (batch.adoption) ------------------
    def lineage(self, vertex: JobVertex) -> str | None:
        """What ``vertex`` reads, as recovery tells inputs apart: its definition, and for each
        input the finished partitions it reads (by attempt id: a partition run again is
        another input), a source's files and their identities (size, modification time,
        object version), or an inline vertex's own lineage. Equal lineages read the same rows.
        None when a source is not files. Computed once per vertex (what it reads is finished
        before it runs, and stays so while it runs)."""
        if vertex.id not in self._lineages:
            digest = hashlib.sha256()
            self._lineages[vertex.id] = digest.hexdigest()[:32] \
                if self._lineage_into(digest, vertex) else None
        return self._lineages[vertex.id]

    def _lineage_into(self, digest: Any, vertex: JobVertex) -> bool:
        digest.update(f"{vertex.id}\0{vertex.fingerprint()}\0{vertex.parallelism}\0"
                      f"{list(vertex.key)}\n".encode())
        if vertex.is_source:
            if not isinstance(vertex.source, FileSource):
                return False
            files = self.job.input_files.get(vertex.id, {})
            for j, split in enumerate(self.splits.get(vertex.id, [])):
                for path, size in split:
                    known = files.get(path)
                    digest.update(f"{j}\0{path}\0{size}\0{known and known.token()}\n".encode())
            return True
        for edge in vertex.inputs:
            upstream = self.graph.vertices[edge.upstream]
            digest.update(f"{edge.upstream}\0{edge.kind}\0{list(edge.columns)}\n".encode())
            done = [self.job.finished.get((upstream.id, p)) for p in range(upstream.parallelism)]
            if upstream.durable and not upstream.is_source and all(done):
                for f in done:
                    assert f is not None
                    digest.update(f"{f.partition}\0{f.attempt_id}\n".encode())
            elif not self._lineage_into(digest, upstream):
                return False
        return True

    def _record_unit(self, vertex: JobVertex, parts: list[int], number: int, tag: str,
                     writes: list[_Write], positional: bool = False) -> list[str] | None:
        """On Spark Connect, record the unit before its writes start, with the ids its
        operations will have (:mod:`spark_ckpt.batch.adoption`); None when not recorded."""
        api = spark_api(self.spark)
        session = api.session_id()
        if not (session and self.job.settings.batch_adopt_operations) or \
                self.planning is not None or self.job.explaining or \
                any(w.buckets for w in writes) or self._reads_exchanges(vertex):
            # a durable exchange's writes, and a vertex reading its tables (which the next
            # attempt drops at its start), are run again
            return None
        lineage = self.lineage(vertex)
        if lineage is None:
            return None
        operations = [str(uuid.uuid4()) for w in writes if w.mirror_of is None]
        try:
            write_unit(self.job.storage, self.job.paths["job"], UnitRecord(
                attempt=self.job.attempt, vertex=vertex.id, number=number, tag=tag,
                parts=tuple(parts), operations=tuple(operations), lineage=lineage,
                schema=self.schemas[vertex.id], session=session,
                user=api.session_user() or "",
                per_task=self.hash_mode(vertex) and self.per_task_commits(),
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
        lineage = self.lineage(vertex)
        other = {r.attempt for r in records if r.lineage != lineage}
        if other:
            log.info("Job %s attempt %d: the writes of %s attempt(s) %s left running read other "
                     "inputs; interrupting them", self.job.run_id, self.job.attempt,
                     vertex.id, sorted(other))
            self.job.release_earlier(other)
        api = spark_api(self.spark)
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
                    if not self.hash_mode(vertex) and any(
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
        """Record what one earlier unit's files complete, as its own tracker would have."""
        from pyspark.sql.types import StructType

        writes = self._writes(vertex, record.number, tag=record.tag)
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
                (state == "ended" and store.exists(join(store.root, "_SUCCESS"))))
        for w in writes:
            if w.mirror_of is not None:
                w.done = w.mirror_of.done
        todo = [p for p in record.parts
                if p in wanted and (vertex.id, p) not in self.job.finished]
        hash_mode = self.hash_mode(vertex)
        if not todo or (not hash_mode and (len(todo) < len(record.parts)
                                           or not all(w.done for w in writes))):
            return  # a wave counts whole, when every write ended
        self.schemas.setdefault(vertex.id, record.schema)
        self._prepare(writes, StructType.fromJson(json.loads(record.schema)))
        executions = {p: self.job.registry.create(self.job.attempt, vertex.id, p)
                      for p in todo}
        for execution in executions.values():
            execution.machine.move_to(ExecutionState.DEPLOYING)
            execution.machine.move_to(ExecutionState.RUNNING)
        tracker = _UnitTracker(self, vertex, list(record.parts), writes, executions,
                               self.job.clock.now_ms(), record.positional)
        tracker.per_task = hash_mode and record.per_task  # as the killed writer committed
        tracker.recorded = set(record.parts) - set(todo)
        if hash_mode:
            tracker._check_attribution()
            tracker._record_visible()
        else:
            tracker.finish()
        for p, execution in executions.items():
            if p not in tracker.recorded:
                execution.machine.move_to(ExecutionState.FAILED)

    # -- a keyed vertex's output kept on a Spark Connect server -----------------------------
    def keeps_on_server(self, vertex: JobVertex) -> bool:
        """True when a whole run of ``vertex`` persists its output on the server while it
        runs (``spark.ckpt.batch.serverCache``): a Spark Connect session (a classic driver's
        cache dies with it), a keyed vertex (one Spark job whose partitions are its
        partitions), a real run, inputs that can be told apart (files)."""
        return (self.job.settings.batch_server_cache and is_connect(self.spark)
                and self.hash_mode(vertex) and self.planning is None
                and not self.job.explaining and not self._reads_exchanges(vertex)
                and self._inputs_tag() is not None)

    def _reads_exchanges(self, vertex: JobVertex) -> bool:
        """True when ``vertex`` reads durable exchanges: through catalog tables made per
        attempt (and dropped, uncaching what reads them, at the next attempt's start), so
        its plan never matches a killed client's; and it shuffles nothing to keep."""
        return any(self.graph.vertices[e.upstream].bucket_for == vertex.id
                   for e in vertex.inputs if e.kind == "hash")

    def _inputs_tag(self) -> str | None:
        """What this job reads, as it reads it: every file source's files and their
        identities (size, modification time, object version, as recovery compares them),
        with the job's id. Spark finds a persisted frame by its plan, and a plan names files
        by path only: the tag, put in the plan, keeps a frame computed from files since
        rewritten from matching. None when a source is not files."""
        if self._tag is None:
            digest = hashlib.sha256(self.job.run_id.encode())
            for vertex in sorted(self.graph.vertices.values(), key=lambda v: v.id):
                if not vertex.is_source:
                    continue
                if not isinstance(vertex.source, FileSource):
                    self._tag = ""
                    break
                files = self.job.input_files.get(vertex.id, {})
                for j, split in enumerate(self.splits.get(vertex.id, [])):
                    for path, size in split:
                        known = files.get(path)
                        digest.update(f"{vertex.id}\0{j}\0{path}\0{size}\0"
                                      f"{known and known.token()}\n".encode())
            else:
                self._tag = digest.hexdigest()[:32]
        return self._tag or None

    def _left_on_server(self, vertex: JobVertex, whole: DataFrame) -> bool:
        """True when a killed client of this server left ``whole`` (the vertex's whole output
        over the same inputs) persisted there."""
        from pyspark.storagelevel import StorageLevel

        if whole.storageLevel == StorageLevel.NONE:
            log.debug("Job %s attempt %d: nothing of %s persisted on the server (inputs %s)",
                      self.job.run_id, self.job.attempt, vertex.id, self._inputs_tag())
            return False
        log.info("Job %s attempt %d: %s reads the output a killed client of this server left "
                 "persisted (the partitions and shuffles it had computed)", self.job.run_id,
                 self.job.attempt, vertex.id)
        return True

    def arranged(self, vertex: JobVertex, parts: list[int]) -> DataFrame:
        """The output of ``parts``, laid out so Spark partition *j* is partition *j* (hash
        mode) or in any layout (split mode, whose wave is one unit)."""
        return self._arranged(vertex, parts)[0]

    def _arranged(self, vertex: JobVertex, parts: list[int]
                  ) -> tuple[DataFrame, DataFrame | None, bool]:
        """:meth:`arranged`, the frame to keep persisted on the server while it is written
        (:meth:`keeps_on_server`) or None, and whether Spark partition *i* is partition
        ``parts[i]`` instead (:meth:`positional`)."""
        from pyspark.sql import functions as F

        if not self.keeps_on_server(vertex):
            positional = self.positional(vertex, parts)
            return self._arrange(vertex, parts, positional), None, positional
        tag = F.lit(self._inputs_tag())  # an always-true filter: in the plan, not the job
        whole = self._arrange(vertex, list(range(vertex.parallelism))).where(tag == tag)
        left = self._left_on_server(vertex, whole)
        if len(parts) == vertex.parallelism:
            return whole, whole, False
        if not left:  # read and shuffle only the rows of these partitions
            return self._arrange(vertex, parts), None, False
        # partition j of the kept output holds exactly bucket j's rows: filtering keeps that
        bucket = F.pmod(F.hash(*vertex.key), F.lit(vertex.parallelism))
        return whole.where(bucket.isin(parts)), whole, False

    def positional(self, vertex: JobVertex, parts: list[int]) -> bool:
        """True when a run of ``parts`` (fewer than all) of keyed ``vertex`` writes through
        ``len(parts)`` Spark partitions: partition ``parts[i]`` in Spark partition *i* (a row
        whose key is in no running partition fails the run before it is moved). A join of its
        hash inputs shuffles them as Spark plans any join (its shuffle partitions, coalesced by
        adaptive execution: Spark would widen a co-partitioning ``repartition(len(parts))`` to
        its shuffle partitions anyway), and the output is shuffled once more by position,
        instead of every partition not running being an empty task of stages as wide as the
        vertex. Chosen when that extra shuffle, estimated from the sizes of the vertex's
        finished partitions, costs less than the empty tasks (:data:`_EMPTY_TASK_BYTES` each).
        Never for a vertex reading durable exchanges (its bucketed scans are as wide as the
        vertex anyway)."""
        n = vertex.parallelism
        if not self.hash_mode(vertex) or not parts or len(parts) >= n or \
                self.planning is not None or self._reads_exchanges(vertex):
            return False
        sizes = [self._partition_bytes(f) for (v, _), f in list(self.job.finished.items())
                 if v == vertex.id]
        if not sizes:
            return False
        estimate = len(parts) * sum(sizes) / len(sizes)
        return estimate <= (n - len(parts)) * _EMPTY_TASK_BYTES

    @staticmethod
    def _partition_bytes(finished: FinishedPartition) -> int:
        """The bytes of a finished partition's output: its largest write's files (every write
        holds the same rows)."""
        by_write: dict[tuple[str, str], int] = {}
        for o in finished.outputs:
            by_write[(o.kind, o.target)] = by_write.get((o.kind, o.target), 0) + o.size
        return max(by_write.values(), default=0)

    def _arrange(self, vertex: JobVertex, parts: list[int], positional: bool = False
                 ) -> DataFrame:
        from pyspark.sql import functions as F

        whole = len(parts) == vertex.parallelism
        df = self._compute(vertex, None if whole else parts, co_partition=not positional)
        if vertex.partial_of is not None:  # a wave may aggregate, what it reads may not
            for edge in vertex.inputs:
                if edge.kind == "forward" and plan_shuffles(self.frame(edge.upstream, parts)):
                    raise JobDefinitionError(
                        f"vertex {edge.upstream}: its function shuffles rows (a groupBy, a join "
                        "of non-broadcast inputs, a distinct, a window), so it cannot run split "
                        "by split; set key= on it (and hash its inputs by it)")
        if not self.hash_mode(vertex):
            if vertex.partial_of is None and plan_shuffles(df):
                raise JobDefinitionError(
                    f"vertex {vertex.id}: its function shuffles rows (a groupBy, a join of "
                    f"non-broadcast inputs, a distinct, a window), so each output row must "
                    f"keep the key columns that place it in a partition; set key= on the vertex "
                    f"(and hash its inputs by it), found no key. Output columns: {df.columns}"
                )
            return df
        self._check_key(vertex, df)
        bucket = F.pmod(F.hash(*vertex.key), F.lit(vertex.parallelism))
        if positional:  # Spark partition i: partition parts[i]
            position = {p: i for i, p in enumerate(parts)}
            lookup = F.array(*[F.lit(position.get(b, -1)) for b in range(vertex.parallelism)])
            return self._only_running(df, vertex, parts, bucket).repartitionById(
                len(parts), F.element_at(lookup, bucket + 1))
        if not _ends_hash_partitioned(df, vertex.key, vertex.parallelism):
            # By id, not repartition(n, key): Spark drops that one as redundant after an
            # aggregation by the key, leaving an exchange adaptive execution may coalesce.
            if not whole:
                df = self._only_running(df, vertex, parts, bucket)
            df = df.repartitionById(vertex.parallelism, bucket)
        return df

    @staticmethod
    def _only_running(df: DataFrame, vertex: JobVertex, parts: list[int],
                      bucket: Any) -> DataFrame:
        """``df``, failing on a row of a partition not running, before the output is moved
        (a filter under the exchange: not the partition id, which Spark does not evaluate for
        one partition), so before any task writes: a partition's file, once in place, is
        whole and only its own rows (the poller may log it at once). When Spark's plan
        already ends partitioned by the key, every row is in its own partition, and only
        running ones have rows: nothing to check."""
        from pyspark.sql import functions as F

        stray = F.raise_error(F.concat(
            F.lit(f"vertex {vertex.id}: a row of partition "), bucket.cast("string"),
            F.lit(f", which is not running, came out of partitions {parts[0]}..{parts[-1]}; the "
                  f"function must keep its key columns {list(vertex.key)} unchanged, so each "
                  "output row stays in the partition of its input")))
        return df.where(F.when(bucket.isin(parts), F.lit(True)).otherwise(stray))

    def _run_unit(self, vertex: JobVertex, parts: list[int], group: str, number: int) -> None:
        job = self.job
        started_ms = job.clock.now_ms()
        executions = {p: job.registry.create(job.attempt, vertex.id, p) for p in parts}
        for execution in executions.values():
            execution.machine.move_to(ExecutionState.DEPLOYING)
        df, keep, positional = self._arranged(vertex, parts)
        self.schemas[vertex.id] = df.schema.json()
        tag = f"a{job.attempt}-u{number}-{uuid.uuid4().hex[:8]}"
        writes = self._writes(vertex, number, tag)
        self._prepare(writes, df.schema)
        operations = self._record_unit(vertex, parts, number, tag, writes, positional)
        with spark_api(self.spark).job_group(
                group, f"spark_ckpt job {job.run_id} attempt {job.attempt}: vertex "
                f"{vertex.id} partitions {parts[0]}..{parts[-1]}", owner=job.owner_tag):
            self._write_unit(vertex, parts, df, writes, executions, started_ms, keep,
                             operations, positional)

    def _prepare(self, writes: list[_Write], schema: StructType) -> None:
        with self._prepare_lock:  # waves run in threads; a sink is prepared once
            for w in writes:
                if w.kind == "sink" and w.target not in self._prepared:
                    self.sinks[w.target].prepare(schema)
                    self._prepared.add(w.target)

    def _write_unit(self, vertex: JobVertex, parts: list[int], df: DataFrame,
                    writes: list[_Write], executions: dict[int, Any], started_ms: int,
                    keep: DataFrame | None = None,
                    operations: list[str] | None = None, positional: bool = False) -> None:
        from pyspark.storagelevel import StorageLevel

        for execution in executions.values():
            execution.machine.move_to(ExecutionState.RUNNING)
        tracker = _UnitTracker(self, vertex, parts, writes, executions, started_ms,
                               positional)
        cached = sum(w.mirror_of is None for w in writes) > 1 and keep is None
        if cached:
            df = df.persist()
        if keep is not None:
            # on disk, not the server's memory: other sessions share it; a killed client's
            # next one finds it (and the shuffles under it) by the same plan
            keep.persist(StorageLevel.DISK_ONLY)
            log.info("Job %s attempt %d: %s persisted on the server while it runs (inputs "
                     "%s)", self.job.run_id, self.job.attempt, vertex.id, self._inputs_tag())
        stop = threading.Event()
        poller = None
        if tracker.per_task:
            poller = threading.Thread(target=tracker.poll, args=(stop,),
                                      name=f"spark-ckpt-poll-{vertex.id}", daemon=True)
            poller.start()
        ids = iter(operations or ())
        api = spark_api(self.spark)
        try:
            for w in writes:
                if w.mirror_of is not None:
                    continue
                if w.buckets:
                    self.tables.write_bucketed(df, w.directory, w.bucket_by, w.buckets, _V2)
                else:
                    writer = df.write.mode("append").options(**_V2)
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

    def _writes(self, vertex: JobVertex, number: int, tag: str) -> list[_Write]:
        """The writes of run unit ``number``, in directories named by ``tag`` (this unit's, or
        an earlier attempt's unit's, derived as its driver did)."""
        job = self.job
        writes = []
        result_sink = self._result_sink(vertex)
        if self._needs_results(vertex) and result_sink is None:
            bucket_by, buckets = self.bucketing(vertex)
            if buckets:
                tag += layout_suffix(bucket_by, buckets)
            directory = join(result_dir(job.paths["job"], vertex.id), tag)
            writes.append(_Write("result", vertex.id, job.storage.spark_path(directory),
                                 bucket_by=bucket_by, buckets=buckets))
        for spec in vertex.sinks:
            staging = self.sinks[spec.name].staging_dir(vertex.id, tag)
            write = _Write("sink", spec.name, staging, tuple(spec.partition_by))
            write.mirror_of = next((w for w in writes if w.kind == "sink" and w.mirror_of is None
                                    and w.partition_by == write.partition_by
                                    and _store_of(w.directory) == _store_of(staging)), None)
            writes.append(write)
        return writes


class _UnitTracker:
    """Turns the files of one run unit's writes into finished partitions.

    Hash mode: partition *j* is finished once each write has its file ``part-0000j-*`` (the v2
    committer moves a task's file into place when the task commits), or once the write ended
    without one (an empty partition); ``positional``: partition ``parts[i]``'s file is
    ``part-0000i-*`` (``VertexRunner.positional``). Partitioned sink writes, whose tasks move
    several files, count only when their Spark job ended. Split mode: every partition of the
    wave, when the last write ended.
    """

    def __init__(self, runner: VertexRunner, vertex: JobVertex, parts: list[int],
                 writes: list[_Write], executions: dict[int, Any], started_ms: int,
                 positional: bool = False) -> None:
        self.runner = runner
        self.positional = positional
        self.vertex = vertex
        self.parts = parts
        self.writes = writes
        self.executions = executions
        self.started_ms = started_ms
        self.recorded: set[int] = set()
        self.hash = runner.hash_mode(vertex)
        self.per_task = self.hash and runner.per_task_commits()
        self._footers: dict[str, tuple[int, int]] = {}
        self._linked: set[str] = set()  # mirror files in place (a wave's, once for the wave)

    def _partition_of(self, index: int | None) -> int | None:
        """The partition Spark partition ``index`` of a write holds (None: not a task's file;
        -1: none, a Spark partition past the positional layout's, which never has rows)."""
        if index is None or not self.positional:
            return index
        return self.parts[index] if index < len(self.parts) else -1

    def _listing(self) -> list[list[tuple[str, int | None]]]:
        """Every write's files from one listing of each directory Spark writes; a mirror's
        are where its source's files go (linked when their partition is recorded)."""
        out: dict[int, list[tuple[str, int | None]]] = {}
        for i, w in enumerate(self.writes):
            if w.mirror_of is None:
                out[i] = self._files(w)
        for i, w in enumerate(self.writes):
            if w.mirror_of is not None:
                source = out[self.writes.index(w.mirror_of)]
                out[i] = [(self._mirror_path(w, path), index) for path, index in source]
        return [out[i] for i in range(len(self.writes))]

    def _files(self, write: _Write) -> list[tuple[str, int | None]]:
        """(path, Spark partition) of each data file the write has made visible."""
        assert write.mirror_of is None
        store = Storage(write.directory)
        out = []
        for info, _relative in written_files(store, store.root):
            m = _PART_FILE.match(info.base_name)
            out.append((store.spark_path(info.path), int(m.group(1)) if m else None))
        return out

    @staticmethod
    def _mirror_path(write: _Write, source_path: str) -> str:
        assert write.mirror_of is not None
        relative = source_path[len(write.mirror_of.directory.rstrip("/")) + 1:]
        return f"{write.directory.rstrip('/')}/{relative}"

    def _link(self, write: _Write, path: str) -> None:
        """Put a mirror's file in place (idempotent): the source's bytes under its name."""
        assert write.mirror_of is not None
        if path in self._linked:
            return
        source = f"{write.mirror_of.directory.rstrip('/')}/" \
                 f"{path[len(write.directory.rstrip('/')) + 1:]}"
        store = Storage(write.directory)
        store.link_or_copy(store.fs_path(source), store.fs_path(path))
        self._linked.add(path)
        if source in self._footers:
            self._footers[path] = self._footers[source]

    def _footer(self, path: str) -> tuple[int, int]:
        import pyarrow.parquet as pq

        if path not in self._footers:
            store = Storage(path)
            size = store.fs.get_file_info(store.root).size
            rows = pq.read_metadata(store.root, filesystem=store.fs).num_rows
            self._footers[path] = (size, rows)
        return self._footers[path]

    def _output(self, write: _Write, path: str) -> OutputFile:
        size, rows = self._footer(path)
        relative = path[len(write.directory.rstrip("/")) + 1:]
        values = partition_values(relative) if write.partition_by else {}
        return OutputFile(write.kind, write.target, path, size, rows, {}, values)

    def poll(self, stop: threading.Event) -> None:
        interval = self.runner.job.settings.batch_poll_interval_ms / 1000.0
        while not stop.wait(interval):
            try:
                self._record_visible()
            except Exception as exc:  # noqa: BLE001 - e.g. fenced: the write thread reports it too
                log.error("Job %s: recording finished partitions of %s failed: %s",
                          self.runner.job.run_id, self.vertex.id, exc)
                return

    def _record_visible(self) -> None:
        # One snapshot of which writes ended, taken before listing: a write that ends while
        # this poll lists must not make a partition whose file the listing missed look empty.
        done = [w.done for w in self.writes]
        listing = self._listing()
        by_write: list[dict[int, list[str]]] = []
        for w, ended, listed in zip(self.writes, done, listing, strict=True):
            files: dict[int, list[str]] = {}
            if ended or (self.per_task and not w.partition_by):
                for path, index in listed:
                    p = self._partition_of(index)
                    if p is not None:
                        files.setdefault(p, []).append(path)
            by_write.append(files)
        for p in self.parts:
            if p in self.recorded:
                continue
            ready = all(ended or p in files for ended, files in zip(done, by_write,
                                                                    strict=True))
            if ready:
                self._record(p, [(w, path) for w, files in zip(self.writes, by_write,
                                                                 strict=True)
                                 for path in files.get(p, [])])

    def finish(self) -> None:
        if self.hash:
            self._check_attribution()
            self._record_visible()  # every write has ended: the rest, empty ones included
            return
        files = [(w, path) for w, listed in zip(self.writes, self._listing(), strict=True)
                 for path, _ in listed]
        for p in self.parts:
            self._record(p, files)

    def _check_attribution(self) -> None:
        running = set(self.parts)
        for w in self.writes:
            if w.mirror_of is not None:
                continue
            for path, index in self._files(w):
                p = self._partition_of(index)
                if p is not None and p not in running and self._footer(path)[1]:
                    which = f"partition {p}" if p >= 0 else "a partition"
                    raise TaskExecutionError(
                        f"vertex {self.vertex.id}: rows of {which}, which is not "
                        f"running, came out of partitions {self.parts[0]}..{self.parts[-1]}; the "
                        f"function must keep its key columns {list(self.vertex.key)} unchanged, "
                        "so each output row stays in the partition of its input"
                    )

    def _record(self, partition: int, files: list[tuple[_Write, str]]) -> None:
        for w, path in files:
            if w.mirror_of is not None:
                self._link(w, path)  # in place before the event that names it is logged
        outputs = tuple(self._output(w, path) for w, path in files)
        fault_point("partition.written")
        first = self.writes[0] if self.writes else None
        rows = sum(o.rows for o in outputs if first is not None and o.target == first.target)
        result = PartitionResult(
            vertex_id=self.vertex.id, partition=partition,
            attempt_id=self.executions[partition].attempt_id,
            started_ms=self.started_ms, finished_ms=self.runner.job.clock.now_ms(), rows=rows,
            outputs=outputs, schema=self.runner.schemas[self.vertex.id],
            shared=() if self.hash else tuple(self.parts),
        )
        if self.runner.job.partition_finished(result):
            self.recorded.add(partition)
            self.runner.progress.advance(self.vertex.id)
        elif (self.vertex.id, partition) in self.runner.job.finished:
            self.recorded.add(partition)
