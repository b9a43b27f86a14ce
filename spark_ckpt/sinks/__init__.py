"""Sinks both capabilities use: they commit output once, idempotently, after every partition
has staged its files.

Spark's Parquet writer stages the files (batch.unit_writer; sinks.per_batch per batch), each
write in a directory of its own under ``<sink>/_spark_ckpt_staging/<job>/<vertex>/``; the
driver commits them:

* Delta (delta-rs): the staged files stay where they are, inside the table directory and
  invisible until the commit adds them (Delta paths may name any file under the table). The
  commit is one Delta transaction carrying the app transaction
  ``(spark_ckpt/<job>/<sink>, version)``; delta-rs does not skip a repeated version by itself,
  so :meth:`DeltaSink.is_committed` checks ``transaction_version`` first.
* Parquet directory: the commit checks every staged file, creates the marker
  ``_spark_ckpt_commits/<job>-v<version>.json`` create-if-absent (only one driver can), moves
  the files into place, and marks the marker committed. A crash in between is finished by the
  next attempt from the marker's file list, as MapReduce's committer recovers; a new version is
  never begun while an earlier one of the same job is half done.

The version used is logged in ``SinkCommitStarted`` before the commit, so a recovered driver
asks the sink whether *that* version landed.
"""

from __future__ import annotations

from spark_ckpt.clock import Clock
from spark_ckpt.execution.job_graph import SinkSpec
from spark_ckpt.sinks.delta import DeltaSink
from spark_ckpt.sinks.files import (
    arrow_schema_for,
    check_files,
    micros_timestamps,
    partition_values,
    written_files,
)
from spark_ckpt.sinks.parquet import ParquetSink
from spark_ckpt.sinks.sink import Sink

__all__ = ["DeltaSink", "ParquetSink", "Sink", "arrow_schema_for", "check_files", "make_sink",
           "micros_timestamps", "partition_values", "written_files"]


def make_sink(spec: SinkSpec, job_id: str, *, clock: Clock | None = None) -> Sink:
    """The sink ``spec`` names: a Delta table or a Parquet directory (``clock``: the Delta
    commit's timestamps)."""
    if spec.kind == "delta":
        return DeltaSink(spec, job_id, clock=clock)
    return ParquetSink(spec, job_id)
