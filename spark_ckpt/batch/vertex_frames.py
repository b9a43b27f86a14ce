"""The rows of a job's vertices as DataFrames, read where they are.

A source's split is read with ``spark.read`` (a file source) or built and filtered by its
hash (any other); a durable vertex's finished partitions are read from their result files (or
the sink's staged files that double as them), a durable exchange's as a bucketed catalog table
(batch.buckets); a vertex not durable is computed inline from what it reads. While the
planner samples or explains (``planning``), vertices are computed inline or read as empty
frames of their schema instead.

Thread ownership: :class:`VertexFrames` belongs to the job's thread, which sets ``planning``
and ``sample_rows`` before any run. Wave threads read frames and add their vertex's entry to
``schemas`` (one key per vertex, written with the schema every wave computes alike).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spark_ckpt.batch.buckets import BucketedTables, job_table_prefix
from spark_ckpt.batch.planning import hash_mode
from spark_ckpt.errors import JobDefinitionError, TaskExecutionError
from spark_ckpt.sources.job_inputs import FileSource
from spark_ckpt.sparkapi import empty_frame
from spark_ckpt.storage import join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from spark_ckpt.batch.job_attempt import Attempt
    from spark_ckpt.execution.job_graph import Edge, JobVertex
    from spark_ckpt.sinks import Sink

__all__ = ["VertexFrames"]

log = logging.getLogger(__name__)


class VertexFrames:
    """The rows of one attempt's vertices (see the module's docstring)."""

    def __init__(self, job: Attempt, splits: dict[str, list[Any]],
                 source_schemas: dict[str, Any], sinks: dict[str, Sink]) -> None:
        self.job = job
        self.graph = job.graph
        self.spark = job.spark
        self.splits = splits
        self.source_schemas = source_schemas
        self.sinks = sinks
        self.schemas: dict[str, str] = {}
        # Planning (batch.cuts): "inline" computes every vertex from the sources (samples,
        # the consumer's output); "explain" reads a durable vertex as an empty frame of its
        # schema, so a vertex's plan shows its own exchanges only. Nothing is written.
        self.planning: str | None = None
        self.sample_rows: int | None = None  # planning: read at most this many rows a source
        # planning: read this fraction of a source's rows (a seeded random sample) instead
        self.sample_fraction: float | None = None
        # While a vertex of map-side partial aggregates whose splits have several files runs
        # (VertexRunner): a file source's splits are read one Spark partition each, in order.
        self.split_tasks = False
        self._plain = threading.local()  # this thread reads sources as the function sees them
        # durable exchanges' catalog tables
        self.tables = BucketedTables(self.spark, self._table_location,
                                     job_table_prefix(job.run_id))
        self._scratch: str | None = None

    # -- what a vertex's output is -----------------------------------------------------------
    def result_sink(self, vertex: JobVertex) -> str | None:
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
        if consumer is None or not vertex.bucket_by or hash_mode(vertex) or \
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

    def needs_results(self, vertex: JobVertex) -> bool:
        """True when a live vertex consumes ``vertex``'s output (so it writes result files)."""
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
                    self.schemas[vertex_id] = self.compute(vertex, None).schema.json()
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
            return self.compute(vertex, parts)
        if self.planning == "explain":
            return empty_frame(self.spark, self.output_schema(vertex_id))
        return self._read_results(vertex, parts)

    @contextlib.contextmanager
    def plain_reads(self) -> Iterator[None]:
        """Within: this thread's source reads are one ``spark.read`` a frame, as a vertex's
        function sees them, not :attr:`split_tasks`'s union of single-partition reads."""
        self._plain.on = True
        try:
            yield
        finally:
            self._plain.on = False

    def compute_inline(self, vertex_id: str, parts: list[int] | None) -> DataFrame:
        """The vertex's output for ``parts`` (None: all), computed from where it reads."""
        vertex = self.graph.vertices[vertex_id]
        if vertex.is_source:
            return self._source_frame(vertex, parts)
        return self.compute(vertex, parts)

    def _source_frame(self, vertex: JobVertex, parts: list[int] | None) -> DataFrame:
        df = self._source_rows(vertex, parts)
        if self.planning == "inline" and parts is not None:
            if self.sample_fraction is not None:  # before the chain's joins: they run on it
                df = df.sample(False, self.sample_fraction, seed=17)
            elif self.sample_rows is not None:
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
            if self.split_tasks and not getattr(self._plain, "on", False):
                # one task a split: a scan each, which the vertex's file settings make one
                # partition (VertexRunner); a split with no file, one empty partition
                return functools.reduce(lambda a, b: a.union(b), [
                    source.read(self.spark, schema, [path for path, _ in splits[p]])
                    if splits[p] else empty_frame(self.spark, schema).coalesce(1)
                    for p in chosen])
            return source.read(self.spark, schema, files)
        df = source.build(self.spark)
        if parts is not None and vertex.parallelism > 1:
            bucket = F.pmod(F.hash(*source.split_by), F.lit(vertex.parallelism))
            df = df.where(bucket.isin(parts))
        return df

    def _read_results(self, vertex: JobVertex, parts: list[int] | None) -> DataFrame:
        chosen = range(vertex.parallelism) if parts is None else parts
        result_sink = self.result_sink(vertex)
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
        # what the graph's restart and invalidation rules assume (planning.check_reads)
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

    def compute(self, vertex: JobVertex, parts: list[int] | None,
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

    def check_key(self, vertex: JobVertex, df: DataFrame) -> None:
        """Fail when ``df`` (the vertex's output) lost a key column."""
        missing = [c for c in vertex.key if c not in df.columns]
        if missing:
            raise JobDefinitionError(
                f"vertex {vertex.id}: each output row must keep the key columns that place it "
                f"in a partition; expected key columns {list(vertex.key)} in the output, found "
                f"columns {df.columns}. Keep them in the output, or set key= on the vertex and "
                f"hash its inputs by it."
            )
