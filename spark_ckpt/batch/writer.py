"""The task side: write one partition's durable outputs, then its manifest.

Runs inside a Spark task (``mapInArrow``), where Spark partition *k* holds exactly the rows of
logical partition ``partitions[k]`` (see datasource.py and runner.py). It writes

* per hash/forward/broadcast consumer: one Parquet file whose row groups are the consumer's
  sub-partitions, in order, with their row-group ranges noted in the manifest;
* per sink: staged Parquet data files (Delta: in the table directory, invisible until the
  commit adds them; Parquet: in the sink's staging directory);

and last, atomically, the manifest. Every name carries the attempt id and Spark's task attempt
id, so retried or speculative attempts never overwrite each other.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

__all__ = ["make_writer", "MANIFEST_SCHEMA_DDL"]

MANIFEST_SCHEMA_DDL = "manifest string"


def make_writer(spec: dict[str, Any]):  # noqa: ANN201 - a mapInArrow function
    """Build the ``mapInArrow`` function for one wave. ``spec`` is plain JSON-able data."""

    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        started = int(time.time() * 1000)
        ctx = TaskContext.get()
        index = ctx.partitionId()
        partitions = spec["partitions"]
        if index >= len(partitions):
            raise RuntimeError(
                f"spark_ckpt: vertex {spec['vertex_id']} produced Spark partition {index}, but "
                f"only {len(partitions)} logical partitions run; its function changed the "
                "partitioning without a shuffle (declare key= so rows are re-attributed)"
            )
        partition = partitions[index]
        collected = list(batches)
        table = (pa.Table.from_batches(collected) if collected
                 else spec_schema(spec).empty_table())
        if spec["key_mode"] and table.num_rows:
            _check_attribution(table, index, partition, spec)
        manifest = write_partition(
            table, spec, partition, spec["attempt_ids"][index], ctx.taskAttemptId(),
            ctx.attemptNumber(), started,
        )
        yield pa.RecordBatch.from_pydict(
            {"manifest": pa.array([manifest.dumps().decode()], pa.string())}
        )

    return write


def spec_schema(spec: dict[str, Any]) -> Any:
    from pyspark.sql.types import StructType

    from spark_ckpt.arrowtypes import to_arrow

    return to_arrow(StructType.fromJson(spec["input_schema"]))


def _check_attribution(table: Any, index: int, partition: int, spec: dict[str, Any]) -> None:
    import pyarrow.compute as pc

    from spark_ckpt.execution.result_partition import PART_COLUMN

    column = table.column(PART_COLUMN)
    if pc.any(pc.not_equal(column, index)).as_py():
        raise RuntimeError(
            f"spark_ckpt: vertex {spec['vertex_id']} partition {partition}: some output rows "
            f"hash (on key columns {spec['key']}) to a partition that is not running. The vertex "
            "function must keep its key columns unchanged, so each output row stays in the "
            "partition of its input."
        )


def write_partition(table: Any, spec: dict[str, Any], partition: int, attempt_id: str,
                    task_attempt: int, attempt_number: int, started: int) -> Any:
    import pyarrow.parquet as pq

    from spark_ckpt.execution.result_partition import OutputFile, PartitionManifest
    from spark_ckpt.storage import Storage, join

    stem = f"p-{partition:05d}-{attempt_id}-t{task_attempt}"
    data = table.select(spec["data_columns"])
    outputs: list[OutputFile] = []

    store = Storage(spec["result_dir"])
    for result in spec["results"]:
        path = join(store.root, f"to-{result['consumer']}", f"{stem}.parquet")
        store.makedirs(path.rsplit("/", 1)[0])
        groups: dict[int, list[int]] = {}
        with pq.ParquetWriter(path, data.schema, filesystem=store.fs,
                              compression="lz4") as writer:
            if result["sub_column"]:
                subs = table.column(result["sub_column"]).to_numpy(zero_copy_only=False)
                order = subs.argsort(kind="stable")
                sorted_subs = subs[order]
                ordered = data.take(order)
                next_group = 0
                start = 0
                while start < len(sorted_subs):
                    sub = int(sorted_subs[start])
                    end = int(sorted_subs.searchsorted(sub, side="right"))
                    writer.write_table(ordered.slice(start, end - start),
                                       row_group_size=end - start)
                    groups[sub] = [next_group, 1, end - start]
                    next_group += 1
                    start = end
            elif data.num_rows:
                writer.write_table(data, row_group_size=data.num_rows)
                groups[-1] = [0, 1, data.num_rows]
        size = store.fs.get_file_info(path).size
        outputs.append(OutputFile("result", result["consumer"], store.spark_path(path), size,
                                  data.num_rows, groups))

    for sink in spec["sinks"]:
        outputs.extend(_write_sink(Storage(sink["staging_dir"]), sink, data, stem, spec))

    manifest = PartitionManifest(
        job_id=spec["job_id"], vertex_id=spec["vertex_id"], partition=partition,
        attempt_id=attempt_id, spark_task_attempt_id=task_attempt,
        spark_attempt_number=attempt_number, started_ms=started,
        finished_ms=int(time.time() * 1000), rows=data.num_rows, outputs=tuple(outputs),
        schema=spec["output_schema"],
    )
    manifests = Storage(spec["manifest_dir"])
    manifests.write_atomic(join(manifests.root, f"{stem}.json"), manifest.dumps())
    return manifest


def _utc_timestamps(table: Any) -> Any:
    """Delta stores timestamps as UTC microseconds; Spark hands Arrow its session zone."""
    import pyarrow as pa

    fields = []
    for field in table.schema:
        if pa.types.is_timestamp(field.type) and field.type.tz is not None:
            field = field.with_type(pa.timestamp("us", tz="UTC"))
        fields.append(field)
    return table.cast(pa.schema(fields))


def _write_sink(store: Any, sink: dict[str, Any], data: Any, stem: str,
                spec: dict[str, Any]) -> list[Any]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from spark_ckpt.execution.result_partition import OutputFile
    from spark_ckpt.storage import join

    data = _utc_timestamps(data)
    partition_by = sink["partition_by"]
    if partition_by:
        keys = data.select(partition_by).group_by(partition_by).aggregate([]).to_pylist()
    else:
        keys = [{}]
    name = f"part-{spec['job_id']}-{spec['vertex_id']}-{stem}"
    files = []
    for values in keys:
        subset = data
        subdir = ""
        for col, value in values.items():
            mask = (pc.is_null(subset.column(col)) if value is None
                    else pc.equal(subset.column(col), value))
            subset = subset.filter(mask)
            subdir += f"{col}={'__HIVE_DEFAULT_PARTITION__' if value is None else value}/"
        if not subset.num_rows and (partition_by or sink["kind"] == "delta"):
            continue  # no empty data files in tables
        subset = subset.drop_columns(partition_by) if partition_by else subset
        relative = f"{subdir}{name}.parquet"
        path = join(store.root, relative)
        store.makedirs(path.rsplit("/", 1)[0])
        pq.write_table(subset, path, filesystem=store.fs, compression="snappy")
        size = store.fs.get_file_info(path).size
        files.append(OutputFile(
            "sink", sink["name"], store.spark_path(path), size, subset.num_rows, {},
            {k: (None if v is None else str(v)) for k, v in values.items()},
        ))
    return files
