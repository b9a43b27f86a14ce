"""The one seam between spark_ckpt and Spark's internals.

Everything spark_ckpt needs from Spark beyond the public DataFrame API goes through
:func:`spark_api`: job groups (tags on Spark Connect), cancelling them, plan facts (the
exchanges a job keeps, how its output is partitioned, whether it is deterministic or provably
empty, its size estimate, an aggregation's analysed plan) and facts about the application.
Two implementations answer: :mod:`spark_ckpt.sparkapi.classic` through the driver's JVM
(py4j), and :mod:`spark_ckpt.sparkapi.connect` through a Spark Connect client (with
:mod:`spark_ckpt.sparkapi.connect_plan`, which reads an aggregation's plan from the client's
own plan tree). No other module touches py4j, ``_jdf``, ``_jsc``, ``_jvm`` or Connect
internals (a test checks).
What both share: :mod:`spark_ckpt.sparkapi.types` (the interface and its plain data),
:mod:`spark_ckpt.sparkapi.plans` (pure functions over the physical plan's text) and
:mod:`spark_ckpt.sparkapi.committers` (the JVM's committer classes, the write options and file
names per-task commits rely on). No other module reads plan text or names a JVM class (a test
checks that too).

Where Connect has no equivalent, the Connect implementation answers ``None`` ("cannot
tell") and every caller takes the answer that keeps its guarantee: a job whose partitioning
cannot be read is repartitioned, one whose determinism cannot be read is recomputed never,
an aggregation whose plan cannot be read is kept whole. docs/connect.md lists each difference.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from spark_ckpt.session import is_connect
from spark_ckpt.sparkapi.types import Expr, PlanNode, SparkApi, walk

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = ["Expr", "PlanNode", "SparkApi", "empty_frame", "frame_api", "is_connect", "spark_api",
           "union_by_name", "walk"]


def spark_api(spark: SparkSession) -> SparkApi:
    """The seam for ``spark``: classic through py4j, or Spark Connect."""
    if is_connect(spark):
        from spark_ckpt.sparkapi.connect import ConnectSpark

        return ConnectSpark(spark)
    from spark_ckpt.sparkapi.classic import ClassicSpark

    return ClassicSpark(spark)


def frame_api(df: DataFrame) -> SparkApi:
    """The seam for the session ``df`` belongs to."""
    return spark_api(df.sparkSession)


def empty_frame(spark: SparkSession, schema: StructType) -> DataFrame:
    """No rows, with ``schema``'s column names and types (all nullable, as a file read gives),
    built without Python in Spark tasks: a classic ``createDataFrame([], schema)`` would start a
    Python worker when it runs, which a cluster without Python for its executors cannot."""
    from pyspark.sql import functions as F

    return spark.range(0).select(
        *[F.lit(None).cast(field.dataType).alias(field.name) for field in schema.fields])


def union_by_name(frames: Sequence[DataFrame], *, allow_missing: bool = False) -> DataFrame:
    """The rows of every frame, columns matched by name (``allow_missing``: a column some
    frames lack is null in their rows)."""
    return functools.reduce(lambda a, b: a.unionByName(b, allowMissingColumns=allow_missing),
                            frames)
