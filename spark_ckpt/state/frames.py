"""Reading keyed state as a DataFrame (Structured Streaming's state data source).

A state handle is a chain of Parquet files; the state of a key is its row in the newest file
of its range's chain that holds it. ``read_handles`` does that in Spark: every file of every
chain is read once, rows outside the chain's key-group range are dropped (after a rescale a
file can hold other ranges' groups), and the newest row per key wins. Reading a pipeline's
directory by operator name (``spark_ckpt.read_state``) is the state processor's, in
:mod:`spark_ckpt.ops.state_processor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.state.chain import StateHandle
from spark_ckpt.state.keygroups import KG_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = ["read_handles", "read_processor_state"]


def read_handles(spark: SparkSession, handles: Sequence[StateHandle], schema: StructType,
                 keys: list[str]) -> DataFrame:
    from pyspark.sql import functions as F

    order: list[tuple[str, int, int, int]] = []
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
                         describe: dict[str, Any], keys: list[str], *,
                         timer_only: bool = False) -> DataFrame:
    """A processor's state: the key columns and one column per declared variable; keys
    with timers but no variable are left out, unless ``timer_only`` (an operator whose key
    with a timer and no value set is still live, as a window that has seen only null
    values). A key with neither, a deletion a changelog records, is left out either way."""
    import json

    from pyspark.sql import functions as F
    from pyspark.sql.types import (
        ArrayType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    from spark_ckpt.state.schema import TIMERS_COLUMN

    state = StructType.fromJson(json.loads(describe["state_schema"]))
    key_schema = StructType.fromJson(json.loads(describe["key_schema"]))
    timers = [StructField(TIMERS_COLUMN, ArrayType(StructType([
        StructField("ms", LongType()), StructField("kind", StringType())])))] \
        if timer_only else []
    schema = StructType([StructField(KG_COLUMN, IntegerType()), *key_schema.fields,
                         *state.fields, *timers])
    df = read_handles(spark, handles, schema, keys)
    if not state.fields:
        return df.select(*keys).limit(0)
    present: Column | None = None
    for f in state.fields:
        col = F.col(f"`{f.name}`")
        name = type(f.dataType).__name__
        test = col.isNotNull() & (F.size(col) > 0) if name in ("ArrayType", "MapType") \
            else col.isNotNull()
        present = test if present is None else present | test
    assert present is not None  # there is a state field
    if timer_only:
        timer = F.col(f"`{TIMERS_COLUMN}`")
        present = present | (timer.isNotNull() & (F.size(timer) > 0))
    return df.where(present).select(*[F.col(f"`{k}`") for k in keys],
                                    *[F.col(f"`{f.name}`") for f in state.fields])


