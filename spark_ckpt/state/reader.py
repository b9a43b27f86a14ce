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

__all__ = ["read_handles"]


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
