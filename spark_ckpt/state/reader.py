"""Reading keyed state as a DataFrame (Structured Streaming's state data source).

A state handle is a chain of Parquet files; the state of a key is its row in the newest file
of its range's chain that holds it. ``read_handles`` does that in Spark: every file of every
chain is read once, rows outside the chain's key-group range are dropped (after a rescale a
file can hold other ranges' groups), and the newest row per key wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from spark_ckpt.state.chain import StateHandle
from spark_ckpt.state.keygroups import KG_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = ["read_handles", "read_processor_state", "read_state"]


def read_handles(spark: SparkSession, handles: Sequence[StateHandle], schema: StructType,
                 keys: list[str]) -> DataFrame:
    from pyspark.sql import functions as F

    order = []
    for handle in handles:
        rng = handle.key_group_range
        for f in handle.files:
            order.append((f.path.rsplit("/", 1)[-1], len(order), rng.start, rng.end))
    if not order:
        return spark.createDataFrame([], schema)
    files = sorted({f.path for h in handles for f in h.files})
    index = spark.createDataFrame(order, "_name STRING, _seq INT, _lo INT, _hi INT")
    rows = spark.read.schema(schema).parquet(*files).withColumn(
        "_name", F.element_at(F.split(F.col("_metadata.file_path"), "/"), -1))
    rows = rows.join(F.broadcast(index), "_name").where(
        (F.col(KG_COLUMN) >= F.col("_lo")) & (F.col(KG_COLUMN) < F.col("_hi")))
    newest = rows.groupBy(*keys).agg(F.max_by(F.struct(*schema.names), F.col("_seq"))
                                     .alias("_row"))
    return newest.select("_row.*")


def read_processor_state(spark: SparkSession, handles: Sequence[StateHandle],
                         describe: dict, keys: list[str]) -> DataFrame:
    """A processor's state: the key columns and one column per declared variable; keys
    with timers but no variable are left out."""
    import json

    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, StructField, StructType

    state = StructType.fromJson(json.loads(describe["state_schema"]))
    key_schema = StructType.fromJson(json.loads(describe["key_schema"]))
    schema = StructType([StructField(KG_COLUMN, IntegerType()), *key_schema.fields,
                         *state.fields])
    df = read_handles(spark, handles, schema, keys)
    if not state.fields:
        return df.select(*keys).limit(0)
    present = None
    for f in state.fields:
        col = F.col(f"`{f.name}`")
        name = type(f.dataType).__name__
        test = col.isNotNull() & (F.size(col) > 0) if name in ("ArrayType", "MapType") \
            else col.isNotNull()
        present = test if present is None else present | test
    return df.where(present).select(*[F.col(f"`{k}`") for k in keys],
                                    *[F.col(f"`{f.name}`") for f in state.fields])


def read_state(spark: SparkSession, checkpoint_dir: str, operator: str,
               checkpoint_id: int | None = None) -> DataFrame:
    """The state of ``operator`` in a completed checkpoint (the latest by default), one row per
    key: aggregations as their key and output columns, processors as their key columns and one
    column per declared state variable, with its declared type (``json`` variables as JSON
    strings).

    ``checkpoint_dir`` is the pipeline's checkpoint directory (or, when the pipeline sets
    ``spark.ckpt.checkpoint.dir``, pass that directory's parent with ``checkpoints`` in it).
    A path where nothing is, a directory that is neither, and a pipeline's directory whose
    metadata.json does not read as a start reads it raise
    :class:`~spark_ckpt.errors.DirectoryError`.
    """
    import json

    from pyspark.sql.types import StructField, StructType

    from spark_ckpt.checkpoint.storage import CheckpointStorage
    from spark_ckpt.errors import CheckpointError
    from spark_ckpt.state.aggregates import Agg, AggSpec
    from spark_ckpt.streaming.pipeline_dir import open_pipeline_dir

    storage = CheckpointStorage(open_pipeline_dir(checkpoint_dir,
                                                  bare_checkpoints=True).checkpoints_uri)
    ids = storage.completed_ids()
    if not ids:
        raise CheckpointError(f"expected completed checkpoints in {storage.uri}, found none")
    cid = ids[-1] if checkpoint_id is None else checkpoint_id
    meta = storage.read_metadata(cid)
    ops = meta.get("operators", {})
    if operator not in ops:
        raise CheckpointError(
            f"checkpoint {cid} has no operator {operator!r}; it has {sorted(ops)}"
        )
    op = ops[operator]
    handles = [StateHandle.from_json(h) for _p, h in
               sorted(op["handles"].items(), key=lambda kv: int(kv[0]))]
    keys = list(op["keys"])
    if op.get("kind") == "agg":
        if "file_schema" not in op:
            return spark.createDataFrame([], ", ".join(f"`{k}` STRING" for k in keys))
        schema = StructType.fromJson(json.loads(op["file_schema"]))
        types = {f.name: f.dataType for f in schema.fields}
        inputs = [StructField(k, types[k]) for k in keys]
        aggs: dict[str, Agg] = {}
        for name, (func, column, time_column) in op["aggs"].items():
            value = types.get(name) or types[f"{name}__sum"]
            if column is not None and column not in {f.name for f in inputs}:
                inputs.append(StructField(column, value))
            if time_column is not None and time_column not in {f.name for f in inputs}:
                inputs.append(StructField(time_column, types[f"{name}__ts"]))
            aggs[name] = Agg(func, column, time_column)
        spec = AggSpec(keys, aggs, StructType(inputs))
        return spec.view(read_handles(spark, handles, schema, keys))
    if "state_schema" not in op:
        raise CheckpointError(
            f"checkpoint {cid}: operator {operator!r} holds its state as JSON documents (written "
            "before typed state) or has run no batch; expected a state_schema in its metadata"
        )
    return read_processor_state(spark, handles, op, keys)
