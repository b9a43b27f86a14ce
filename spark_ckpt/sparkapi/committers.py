"""How Spark's file writers commit, as spark_ckpt relies on it: the commit protocol and
Parquet committer classes under which a task's file is in place, whole, exactly when the
task commits; the write options that make it so; the names tasks give their files; the
marker a committed job leaves. The same on classic and Spark Connect (session configuration
and writer options only), and the only place spark_ckpt names the JVM's classes
(tests/test_seam.py checks).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["DEFAULT_COMMITTERS", "PER_TASK_WRITE_OPTIONS", "SUCCESS_MARKER",
           "commits_per_task", "task_partition"]

# The v2 file committer moves a task's file into place when the task commits; one file per
# task (no maxRecordsPerFile split) keeps that move a single rename.
PER_TASK_WRITE_OPTIONS = {"mapreduce.fileoutputcommitter.algorithm.version": "2",
                          "maxRecordsPerFile": "0"}
DEFAULT_COMMITTERS = {
    "spark.sql.sources.commitProtocolClass":
        "org.apache.spark.sql.execution.datasources.SQLHadoopMapReduceCommitProtocol",
    "spark.sql.parquet.output.committer.class":
        "org.apache.parquet.hadoop.ParquetOutputCommitter",
}
# what a job's commit leaves beside its files
SUCCESS_MARKER = "_SUCCESS"
_PART_FILE = re.compile(r"^part-(\d{5,})-.*\.parquet$")


def commits_per_task(spark: SparkSession) -> bool:
    """True when a task's file is in place, whole, exactly when the task commits: Spark's
    default commit protocol and Parquet committer (with :data:`PER_TASK_WRITE_OPTIONS`). Any
    other committer (a cloud vendor's direct or magic committer) counts at job end only."""
    conf = spark.conf
    return all((conf.get(key, None) or default) == default
               for key, default in DEFAULT_COMMITTERS.items())


def task_partition(file_name: str) -> int | None:
    """The Spark partition whose task wrote the Parquet file ``file_name`` (its base name:
    ``part-00003-...parquet``); None for any other file."""
    found = _PART_FILE.match(file_name)
    return int(found.group(1)) if found else None
