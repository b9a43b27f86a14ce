"""Declare a batch job as a DAG of vertices, then run it with recovery.

    job = BatchJob("orders-daily", work_dir="/data/ckpt")
    orders = job.read_files("orders", "/data/orders", parallelism=16)
    customers = job.read_files("customers", "/data/customers", parallelism=1)
    enriched = job.vertex("enriched", lambda o, c: o.join(c, "customer_id"),
                          orders, customers.broadcast())
    daily = job.vertex("daily", lambda e: e.groupBy("region", "day").agg(F.sum("amount")),
                       enriched.by("region", "day"), parallelism=8)
    job.write_delta(daily, "/data/out/daily")
    result = job.run()

A vertex function takes one DataFrame per input and returns a DataFrame. Partition *i* of a
vertex sees only the rows of its inputs that belong to partition *i*; when the function shuffles
(a ``groupBy`` or a join on the key), each output row must keep the key columns, so the row can
be attributed to its partition. Submitting the same job id again after a crash runs only what
is missing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from spark_ckpt.batch.runner import JobResult, JobRunner
from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.execution.job_graph import Edge, JobGraph, JobVertex, SinkSpec
from spark_ckpt.names import check_name
from spark_ckpt.options import Settings
from spark_ckpt.sources.job_inputs import DataFrameSource, FileFormat, FileSource
from spark_ckpt.storage import s3

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from spark_ckpt.batch.cuts import CutPlan
    from spark_ckpt.clock import Clock

__all__ = ["BatchJob", "Input", "VertexRef"]


@dataclasses.dataclass(frozen=True)
class Input:
    """A vertex input: an upstream vertex and how its output reaches the consumer."""

    vertex: VertexRef
    kind: Literal["hash", "forward", "broadcast", "default"]
    columns: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class VertexRef:
    """Handle to a declared vertex, used as an input of later vertices and sinks."""

    job: BatchJob
    id: str

    @property
    def parallelism(self) -> int:
        """How many partitions the vertex runs."""
        return self.job.graph.vertices[self.id].parallelism

    def by(self, *columns: str) -> Input:
        """Hash-partition this vertex's output by ``columns`` for the consumer."""
        if not columns:
            raise JobDefinitionError(f"{self.id}.by() needs at least one column")
        return Input(self, "hash", tuple(columns))

    def forward(self) -> Input:
        """Consumer partition *i* reads this vertex's partition *i* (equal parallelism)."""
        return Input(self, "forward")

    def broadcast(self) -> Input:
        """Every consumer partition reads all of this vertex's output (a small table)."""
        return Input(self, "broadcast")


class BatchJob:
    """A batch job with a stable id; see the module docstring.

    Args:
        job_id: names the job's logic, stable across resubmissions.
        run_key: names one run of it (a date, a batch of input): resubmitting the same
            ``(job_id, run_key)`` resumes that run, or answers "already complete"; a new run
            key runs afresh. Without one, the job id alone is the run.
        spark: the session to run on (default: the active one, else one from defaults).
        work_dir: overrides ``spark.ckpt.workDir``.
        settings: overrides every ``spark.ckpt.*`` value read from the Spark conf.
        clock: the time stamped on attempt markers and events (tests pass a manual clock).
    """

    def __init__(self, job_id: str, *, run_key: str | None = None,
                 spark: SparkSession | None = None, work_dir: str | None = None,
                 settings: Settings | None = None, clock: Clock | None = None) -> None:
        for what, value in (("job id", job_id), ("run key", run_key)):
            if value is None and what == "run key":
                continue
            check_name(what, value)
        self.job_id = job_id
        self.run_key = run_key
        # One run of the job's logic: its event log, results and sink commits. The same run
        # id resumes; a new run key runs afresh (the next day of a daily job).
        self.run_id = job_id if run_key is None else f"{job_id}@{run_key}"
        self.graph = JobGraph(job_id)
        self._spark = spark
        self._work_dir = work_dir
        self._settings = settings
        self._clock = clock

    # -- sources ---------------------------------------------------------------------------
    def read_files(self, name: str, path: str, *, format: FileFormat = "parquet",
                   parallelism: int | None = None, schema: Any = None,
                   options: dict[str, str] | None = None) -> VertexRef:
        """A source vertex over a file or the files under a directory, read exactly as
        ``spark.read.format(format).options(**options).load(path)`` reads them.

        ``parallelism`` (the number of splits) defaults to one split per file and is capped at
        the number of files.
        """
        if format not in ("parquet", "csv", "json", "orc", "text"):
            raise JobDefinitionError(
                f"source {name}: expected format parquet, csv, json, orc or text, found "
                f"{format!r}"
            )
        source = FileSource(path, format, dict(options or {}), schema)
        # The split count is decided now so later vertices can default to it; the splits
        # themselves are recorded at run time (or taken from an earlier attempt's record).
        splits = source.discover(parallelism)
        self.graph.add(JobVertex(name, len(splits), source=source, auto_parallelism=True,
                                 declared_parallelism=parallelism or "auto"))
        return VertexRef(self, name)

    def source(self, name: str, build: Callable[[SparkSession], DataFrame] | DataFrame, *,
               parallelism: int = 1, split_by: tuple[str, ...] | list[str] = ()) -> VertexRef:
        """A source vertex over any DataFrame (or a function building it from the session)."""
        builder = build if callable(build) else (lambda _spark, df=build: df)
        if parallelism > 1 and not split_by:
            raise JobDefinitionError(
                f"source {name}: parallelism {parallelism} needs split_by=columns to split rows"
            )
        source = DataFrameSource(builder, tuple(split_by), label=name)
        self.graph.add(JobVertex(name, parallelism, source=source, key=tuple(split_by)))
        return VertexRef(self, name)

    # -- transformations -------------------------------------------------------------------
    def vertex(self, name: str, fn: Callable[..., DataFrame], *inputs: VertexRef | Input,
               parallelism: int | None = None, key: tuple[str, ...] | list[str] = (),
               version: str = "", durable: bool | None = None) -> VertexRef:
        """A vertex computing ``fn(*input_dataframes)`` per partition.

        Args:
            inputs: upstream vertices (``ref``, ``ref.by(cols)``, ``ref.forward()``,
                ``ref.broadcast()``). A bare ``ref`` is hashed by ``key`` when given, else
                forwarded.
            parallelism: defaults to the first non-broadcast input's parallelism.
            key: output columns that identify a row's partition; defaults to the columns of
                the first hash input. Needed when ``fn`` shuffles.
            version: change it when ``fn`` changes, so earlier finished work is not reused.
            durable: None (the default) lets the planner choose where the job becomes
                durable (batch.cuts; see ``explain()``): a vertex with sinks always is; a wide
                intermediate is chained into its consumer as Spark pipelines it; an
                aggregating consumer's map-side partial aggregates are the cut. True makes the
                vertex's output durable; False runs it inside each consumer, with no result
                partitions and no events (it re-runs with them), like a chained operator in
                Flink.
        """
        if not inputs:
            raise JobDefinitionError(f"vertex {name} has no inputs; use read_files or source")
        specs = [i if isinstance(i, Input) else Input(i, "default") for i in inputs]
        main = [s for s in specs if s.kind != "broadcast"]
        if not main:
            raise JobDefinitionError(f"vertex {name}: every input is broadcast; one must not be")
        inherits = None
        if parallelism is None:
            parallelism = main[0].vertex.parallelism
            upstream = self.graph.vertices[main[0].vertex.id]
            if upstream.auto_parallelism:
                inherits = upstream.id
        key = tuple(key)
        if not key:
            hashed = [s for s in specs if s.kind == "hash"]
            key = hashed[0].columns if hashed else ()
        edges = []
        for spec in specs:
            kind = spec.kind
            columns = spec.columns
            if kind == "default":
                if key:
                    kind, columns = "hash", key
                elif spec.vertex.parallelism == parallelism:
                    kind = "forward"
                else:
                    raise JobDefinitionError(
                        f"vertex {name} (parallelism {parallelism}) reads {spec.vertex.id} "
                        f"(parallelism {spec.vertex.parallelism}) without a key: use "
                        f"{spec.vertex.id}.by(columns) or give key="
                    )
            edges.append(Edge(spec.vertex.id, kind, tuple(columns)))
        self.graph.add(JobVertex(name, parallelism, inputs=tuple(edges), fn=fn, key=key,
                                 version=version, durable=durable is not False,
                                 declared_durable=durable,
                                 auto_parallelism=inherits is not None, inherits=inherits))
        return VertexRef(self, name)

    # -- sinks -----------------------------------------------------------------------------
    def write_delta(self, vertex: VertexRef, path: str, *, mode: str = "error",
                    partition_by: tuple[str, ...] | list[str] = (),
                    merge_keys: tuple[str, ...] | list[str] = (),
                    name: str | None = None) -> None:
        """Commit the vertex's output to a Delta table once per run, when the run completes.

        Args:
            mode: what the commit does to rows already in the table, as in Spark:
                ``error`` (the default, as ``DataFrameWriter``'s): refuse to run when the
                table already holds rows; ``append``; ``overwrite`` (replace every row);
                ``overwrite_partitions`` (replace the partitions the run wrote, keep the
                others; needs ``partition_by``); ``merge`` (upsert on ``merge_keys``: rows
                with the keys of an output row are replaced by it, the rest are kept; the
                staged rows pass through the driver, read by delta-rs).
            merge_keys: the columns that identify a row; giving them implies ``merge``.
        """
        keys = tuple(merge_keys)
        if keys and mode == "error":
            mode = "merge"
        modes = ("error", "append", "overwrite", "overwrite_partitions", "merge")
        if mode not in modes:
            raise JobDefinitionError(f"Delta sink: expected mode {', '.join(modes)}, "
                                     f"found {mode!r}")
        if mode == "overwrite_partitions" and not partition_by:
            raise JobDefinitionError("Delta sink: mode overwrite_partitions needs partition_by "
                                     "columns, found none")
        if (mode == "merge") != bool(keys):
            raise JobDefinitionError(
                "Delta sink: mode merge needs merge_keys=columns, and merge_keys= is only for "
                f"merge; found mode {mode!r} with merge_keys {list(keys)}"
            )
        self._add_sink(vertex, SinkSpec(name or f"{vertex.id}-delta", "delta", path, mode,
                                        tuple(partition_by), tuple(keys)))

    def write_parquet(self, vertex: VertexRef, path: str, *,
                      partition_by: tuple[str, ...] | list[str] = (),
                      name: str | None = None) -> None:
        """Move the vertex's output into a Parquet directory once, when the job completes."""
        self._add_sink(vertex, SinkSpec(name or f"{vertex.id}-parquet", "parquet", path,
                                        "append", tuple(partition_by)))

    def _add_sink(self, vertex: VertexRef, spec: SinkSpec) -> None:
        if vertex.job is not self:
            raise JobDefinitionError(f"vertex {vertex.id} belongs to another job")
        names = {s.name for v in self.graph.vertices.values() for s in v.sinks}
        if spec.name in names:
            raise JobDefinitionError(f"job {self.job_id}: sink name {spec.name!r} is used twice")
        self.graph.vertices[vertex.id].sinks.append(spec)

    # -- running ---------------------------------------------------------------------------
    def _runner(self):
        from spark_ckpt.session import get_or_create_session

        spark = self._spark or get_or_create_session(f"spark_ckpt:{self.run_id}")
        s3.configure(spark.conf)  # before the first Storage: S3 from spark.hadoop.fs.s3a.*
        settings = self._settings or Settings.from_conf(spark.conf)
        if self._work_dir:
            settings = dataclasses.replace(settings, work_dir=self._work_dir)
        return JobRunner(self.graph, self.run_id, spark, settings, self._clock)

    def explain(self, *, show: bool = True) -> CutPlan:
        """Where the job becomes durable and why, as ``run()`` would decide now: each vertex
        durable, chained or a source, the sampled size ratio and estimated bytes of each cut,
        and the Spark exchanges each vertex's job keeps. Runs a sample of one input split
        (Spark jobs) when no earlier attempt recorded the decisions; writes nothing.
        Prints the plan unless ``show=False``; returns it (``str(plan)`` is the text)."""
        plan = self._runner().explain()
        if show:
            print(plan)
        return plan

    def run(self, *, fresh: bool = False) -> JobResult:
        """Run the job; resume from the event log when this job id ran before.

        Args:
            fresh: archive any earlier event log and results of this job id and start over.
        """
        return self._runner().run(fresh=fresh)
