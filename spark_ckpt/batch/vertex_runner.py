"""Run chosen partitions of one vertex on Spark, each partition written by exactly one task.

How Spark partition *k* comes to hold exactly logical partition ``parts[k]``:

* inputs are read through the partitions data source (datasource.py): Spark partition *k* of
  each input is logical partition ``parts[k]``; a function without a shuffle (narrow
  transformations, joins with broadcast inputs) keeps that, and the writer needs nothing more;
* a function that shuffles (``groupBy``, a join of two hashed inputs) loses it, so each output
  row is re-attributed by ``pmod(hash(key), parallelism)`` and moved with ``repartitionById``;
  such a vertex runs in *waves* (one Spark job per group of partitions), because only the last
  stage of a Spark job can make a partition durable;
* a DataFrame source is split the same way, keeping only the rows of the running partitions.

While a wave runs, a poller turns the manifests tasks write into ``ExecutionVertexFinished``
events, so finished partitions are durable long before the wave ends.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from spark_ckpt.batch.datasource import read_plan
from spark_ckpt.batch.sinks import Sink
from spark_ckpt.batch.sources import DataFrameSource, FileSource
from spark_ckpt.batch.writer import MANIFEST_SCHEMA_DDL, make_writer
from spark_ckpt.errors import JobDefinitionError, TaskExecutionError
from spark_ckpt.execution.graph import Edge, JobVertex
from spark_ckpt.execution.result_partition import (
    PART_COLUMN,
    PartitionManifest,
    manifest_dir,
    result_dir,
)
from spark_ckpt.execution.state import ExecutionState
from spark_ckpt.faults import fault_point

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from spark_ckpt.batch.progress import JobProgress
    from spark_ckpt.batch.runner import JobRunner

__all__ = ["VertexRunner", "plan_shuffles"]

log = logging.getLogger(__name__)

_SHUFFLE = re.compile(r"(?<!Broadcast)Exchange |\bUnion\b|\bCoalesce\b")


def plan_shuffles(df: DataFrame) -> bool:
    """True when the physical plan moves rows between partitions (broadcasts do not)."""
    plan = df._jdf.queryExecution().executedPlan().toString()  # noqa: SLF001
    return bool(_SHUFFLE.search(plan))


class VertexRunner:
    def __init__(self, job: JobRunner, splits: dict[str, list[Any]], sinks: dict[str, Sink],
                 progress: JobProgress) -> None:
        self.job = job
        self.graph = job.graph
        self.spark = job.spark
        self.splits = splits
        self.sinks = sinks
        self.progress = progress
        self.schemas: dict[str, str] = {}
        self._source_schemas: dict[str, Any] = {}

    # -- schemas ---------------------------------------------------------------------------
    def _output_schema(self, vertex_id: str) -> Any:
        from pyspark.sql.types import StructType

        if vertex_id not in self.schemas:
            vertex = self.graph.vertices[vertex_id]
            recorded = next((f.schema for (v, _), f in self.job.finished.items()
                             if v == vertex_id and f.schema), None)
            if recorded:
                self.schemas[vertex_id] = recorded
            else:  # plan (not run) the vertex over one partition to learn its schema
                self.schemas[vertex_id] = self._dataframe(vertex, [0]).schema.json()
        return StructType.fromJson(json.loads(self.schemas[vertex_id]))

    # -- building a wave's DataFrame -------------------------------------------------------
    def _input(self, edge: Edge, consumer: JobVertex, parts: list[int]) -> DataFrame:
        from pyspark.sql import functions as F

        upstream = self.graph.vertices[edge.upstream]
        label = f"{upstream.id}->{consumer.id}"
        if self.graph.is_virtual(upstream.id):  # read the source's splits in place
            schema = self._source_schema(upstream)
            splits = self.splits[upstream.id]
            if edge.kind == "broadcast":
                everything = [piece for split in splits for piece in upstream.source.pieces(split)]
                return F.broadcast(read_plan(self.spark, schema, [everything], label))
            return read_plan(self.spark, schema,
                             [upstream.source.pieces(splits[i]) for i in parts], label)
        schema = self._output_schema(upstream.id)

        def pieces_of(producer: int, sub: int | None) -> list[dict[str, Any]]:
            finished = self.job.finished.get((upstream.id, producer))
            if finished is None:
                raise TaskExecutionError(
                    f"vertex {consumer.id} needs partition {producer} of {upstream.id}, which "
                    "is not finished (scheduling bug)"
                )
            out = []
            for o in finished.outputs:
                if o.kind != "result" or o.target != consumer.id:
                    continue
                if sub is None:
                    if o.rows:
                        out.append({"kind": "parquet", "path": o.path, "row_groups": None})
                elif sub in o.groups:
                    first, count, _rows = o.groups[sub]
                    out.append({"kind": "parquet", "path": o.path,
                                "row_groups": list(range(first, first + count))})
            return out

        if edge.kind == "broadcast":
            everything = [piece for j in range(upstream.parallelism)
                          for piece in pieces_of(j, None)]
            return F.broadcast(read_plan(self.spark, schema, [everything], label))
        plan = []
        for i in parts:
            if edge.kind == "forward":
                plan.append(pieces_of(i, None))
            else:
                plan.append([piece for j in range(upstream.parallelism)
                             for piece in pieces_of(j, i)])
        return read_plan(self.spark, schema, plan, label)

    def _source_schema(self, vertex: JobVertex) -> Any:
        if vertex.id not in self._source_schemas:
            files = [path for split in self.splits[vertex.id] for path, _ in split]
            self._source_schemas[vertex.id] = vertex.source.spark_schema(self.spark, files)
        return self._source_schemas[vertex.id]

    def _dataframe(self, vertex: JobVertex, parts: list[int]) -> DataFrame:
        source = vertex.source
        if isinstance(source, FileSource):
            plan = [source.pieces(self.splits[vertex.id][p]) for p in parts]
            return read_plan(self.spark, self._source_schema(vertex), plan, vertex.id)
        if isinstance(source, DataFrameSource):
            return source.build(self.spark)
        assert vertex.fn is not None
        inputs = [self._input(edge, vertex, parts) for edge in vertex.inputs]
        out = vertex.fn(*inputs)
        if out is None or not hasattr(out, "schema"):
            raise JobDefinitionError(
                f"vertex {vertex.id}: expected its function to return a DataFrame, found "
                f"{type(out).__name__}"
            )
        return out

    def _attributed(self, vertex: JobVertex, df: DataFrame, parts: list[int],
                    key_mode: bool) -> DataFrame:
        """Add consumer sub-partition columns and, for shuffling vertices, the partition."""
        from pyspark.sql import functions as F

        for index, (consumer_id, edge) in enumerate(self._consumer_edges(vertex)):
            if edge.kind != "hash":
                continue
            missing = [c for c in edge.columns if c not in df.columns]
            if missing:
                raise JobDefinitionError(
                    f"vertex {vertex.id}: its consumer {consumer_id} is hash-partitioned by "
                    f"{list(edge.columns)}, but the output has no {missing}; output columns: "
                    f"{df.columns}"
                )
            consumer = self.graph.vertices[consumer_id]
            df = df.withColumn(
                f"__ckpt_sub{index}",
                F.pmod(F.hash(*edge.columns), F.lit(consumer.parallelism)).cast("int"),
            )
        if key_mode:
            positions = F.array(*[F.lit(p) for p in parts])
            if vertex.key:
                bucket = F.pmod(F.hash(*vertex.key), F.lit(vertex.parallelism))
            else:
                bucket = F.lit(0)
            df = df.withColumn(PART_COLUMN, (F.array_position(positions, bucket) - 1).cast("int"))
            if isinstance(vertex.source, DataFrameSource):
                df = df.where(F.col(PART_COLUMN) >= 0)  # rows of partitions not running now
            df = df.repartitionById(len(parts), PART_COLUMN)
        return df

    def _consumer_edges(self, vertex: JobVertex) -> list[tuple[str, Edge]]:
        live = {v.id for v in self.graph.live_vertices()}
        return [(c, e) for c, e in self.graph.consumers(vertex.id) if c in live]

    # -- running ---------------------------------------------------------------------------
    def run(self, vertex: JobVertex, parts: list[int]) -> None:
        started = time.perf_counter()
        probe = self._dataframe(vertex, parts)
        data_columns = probe.columns
        self.schemas[vertex.id] = probe.schema.json()
        key_mode = isinstance(vertex.source, DataFrameSource) or (
            not vertex.is_source and plan_shuffles(probe)
        )
        if key_mode and not vertex.is_source:
            missing = [c for c in vertex.key if c not in data_columns]
            if not vertex.key or missing:
                raise JobDefinitionError(
                    f"vertex {vertex.id}: its function shuffles rows (a groupBy or a join of "
                    f"hashed inputs), so each output row must keep the key columns that place "
                    f"it in a partition; expected key columns {list(vertex.key) or '(none set)'} "
                    f"in the output, found columns {data_columns}. Keep them in the output, "
                    f"or set key= on the vertex and hash its inputs by it."
                )
        staging = {name: sink.prepare(probe.schema) for name, sink in self.sinks.items()
                   if any(s.name == name for s in vertex.sinks)}
        waves = self._waves(vertex, parts, key_mode)
        log.info("Job %s attempt %d: vertex %s runs %d of %d partitions in %d wave(s)%s",
                 self.job.job.job_id, self.job.attempt, vertex.id, len(parts),
                 vertex.parallelism, len(waves), " (re-attributed by key)" if key_mode else "")

        planned = time.perf_counter()
        stop = threading.Event()
        poller = threading.Thread(target=self._poll, args=(vertex, stop),
                                  name=f"spark-ckpt-poll-{vertex.id}", daemon=True)
        poller.start()
        groups: list[str] = []
        try:
            workers = min(self.job.settings.batch_concurrent_waves, len(waves))
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                futures = []
                for number, wave in enumerate(waves):
                    group = (f"spark_ckpt-{self.job.job.job_id}-a{self.job.attempt}-"
                             f"{vertex.id}-w{number}")
                    groups.append(group)
                    df = probe if len(waves) == 1 else self._dataframe(vertex, wave)
                    futures.append(pool.submit(self._run_wave, vertex, wave, df, data_columns,
                                               key_mode, staging, group, number))
                try:
                    for future in concurrent.futures.as_completed(futures):
                        future.result()
                except BaseException:
                    for group in groups:
                        self.spark.sparkContext.cancelJobGroup(group)
                    raise
        finally:
            stop.set()
            poller.join()
        missing = [p for p in parts if (vertex.id, p) not in self.job.finished]
        if missing:
            raise TaskExecutionError(
                f"vertex {vertex.id}: Spark jobs ended but partitions {missing} wrote no manifest"
            )
        done = time.perf_counter()
        log.info("Job %s attempt %d: vertex %s finished %d partitions (planned in %.1f s, ran "
                 "in %.1f s)", self.job.job.job_id, self.job.attempt, vertex.id, len(parts),
                 planned - started, done - planned)

    def _waves(self, vertex: JobVertex, parts: list[int], key_mode: bool) -> list[list[int]]:
        if not key_mode or isinstance(vertex.source, DataFrameSource):
            return [parts]
        size = self.job.settings.batch_partitions_per_wave
        if size <= 0:
            cores = self.spark.sparkContext.defaultParallelism
            size = max(cores, math.ceil(len(parts) / 10))
        return [parts[i:i + size] for i in range(0, len(parts), size)]

    def _run_wave(self, vertex: JobVertex, parts: list[int], df: DataFrame,
                  data_columns: list[str], key_mode: bool, staging: dict[str, str],
                  group: str, number: int) -> None:
        job = self.job
        executions = [job.registry.create(job.attempt, vertex.id, p) for p in parts]
        out = self._attributed(vertex, df, parts, key_mode)
        consumer_edges = self._consumer_edges(vertex)
        spec = {
            "job_id": job.job.job_id,
            "vertex_id": vertex.id,
            "partitions": parts,
            "attempt_ids": [e.attempt_id for e in executions],
            "key_mode": key_mode and not isinstance(vertex.source, DataFrameSource),
            "key": list(vertex.key),
            "data_columns": data_columns,
            "input_schema": out.schema.jsonValue(),
            "output_schema": self.schemas[vertex.id],
            "results": [{"consumer": c, "sub_column": f"__ckpt_sub{i}" if e.kind == "hash"
                         else None} for i, (c, e) in enumerate(consumer_edges)],
            "sinks": [{"name": s.name, "kind": s.kind, "staging_dir": staging[s.name],
                       "partition_by": list(s.partition_by)} for s in vertex.sinks],
            "result_dir": job.storage.spark_path(result_dir(job.paths["job"], vertex.id)),
            "manifest_dir": job.storage.spark_path(manifest_dir(job.paths["job"], vertex.id)),
        }
        for execution in executions:
            execution.machine.move_to(ExecutionState.DEPLOYING)
        sc = self.spark.sparkContext
        sc.setJobGroup(group, f"spark_ckpt job {job.job.job_id} attempt {job.attempt}: "
                       f"vertex {vertex.id} wave {number} partitions {parts[0]}..{parts[-1]}",
                       interruptOnCancel=True)
        for execution in executions:
            execution.machine.move_to(ExecutionState.RUNNING)
        try:
            rows = out.mapInArrow(make_writer(spec), MANIFEST_SCHEMA_DDL).collect()
        except Exception as exc:
            for execution in executions:
                execution.machine.move_to(ExecutionState.FAILED)
            raise TaskExecutionError(
                f"job {job.job.job_id} attempt {job.attempt}: vertex {vertex.id} wave {number} "
                f"(partitions {parts}) failed: {exc}"
            ) from exc
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
        for row in rows:
            self._finished(PartitionManifest.loads(row["manifest"]))

    def _finished(self, manifest: PartitionManifest) -> None:
        if self.job.partition_finished(manifest):
            self.progress.advance(manifest.vertex_id)

    def _poll(self, vertex: JobVertex, stop: threading.Event) -> None:
        job = self.job
        directory = manifest_dir(job.paths["job"], vertex.id)
        seen: set[str] = set()
        interval = job.settings.batch_poll_interval_ms / 1000.0
        while True:
            last = stop.is_set()
            try:
                infos = job.storage.list_files(directory, recursive=False)
            except OSError as exc:
                log.warning("Job %s: cannot list %s: %s", job.job.job_id, directory, exc)
                infos = []
            for info in infos:
                if not info.base_name.endswith(".json") or info.path in seen:
                    continue
                seen.add(info.path)
                try:
                    manifest = PartitionManifest.loads(job.storage.read_bytes(info.path))
                except Exception as exc:  # a manifest of a dying task; the wave result decides
                    log.warning("Job %s: unreadable manifest %s: %s", job.job.job_id,
                                info.path, exc)
                    continue
                if job.registry.get(manifest.attempt_id) is None:
                    continue
                fault_point("partition.written")
                try:
                    self._finished(manifest)
                except Exception as exc:  # e.g. fenced: the wave thread reports it too
                    log.error("Job %s: recording %s failed: %s", job.job.job_id, info.path, exc)
                    return
            if last:
                return
            stop.wait(interval)
