"""Per-batch sinks, in two phases: *stage* the batch's files invisibly, then *commit* them once.

The commit of batch ``b`` is keyed by ``b``, so a batch run again after a crash never shows
its rows twice:

* :class:`DeltaBatchSink`: Spark writes the batch's Parquet files into a fresh directory of the
  table; one Delta transaction adds them, carrying the app transaction
  ``(spark_ckpt/<lineage>/<output>, b + 1)``. A batch whose version the table already has is
  skipped (delta-rs does not skip a repeat itself, so the version is checked first). The
  lineage is ``<pipeline>-<pipeline id>``, the id made when the checkpoint directory is first
  used (kept in its metadata), so a new checkpoint directory on an existing table never finds
  its batches "already committed".
* :class:`ParquetBatchSink`: Spark writes into a staging directory; the commit creates the
  marker ``_spark_ckpt_commits/<lineage>-<output>-v<b + 1>.json`` if absent, moves the files
  into place and marks it committed; a crash in between is finished from the marker.
* :class:`ForeachBatchSink`: calls the user's function; at-least-once, as Spark's foreachBatch.

Pipelines that checkpoint use the two-phase-commit sinks of two_phase.py instead.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.execution.job_graph import SinkSpec
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.sinks import (
    DeltaSink,
    ParquetSink,
    micros_timestamps,
    partition_values,
    written_files,
)
from spark_ckpt.sparkapi import frame_api
from spark_ckpt.storage import Storage, is_delta_table, join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["BatchSink", "DeltaBatchSink", "ForeachBatchSink", "ParquetBatchSink",
           "PipelineScope", "micros_timestamps"]

log = logging.getLogger(__name__)


class PipelineScope(Protocol):
    """What a pipeline's sinks know of it: its name, its lineage (fixed at start: it keys the
    sinks' exactly-once transactions) and its checkpoint directory."""

    name: str
    lineage: str
    root: str
    storage: Storage


def staged_files(store: Storage, directory: str, target: str) -> list[OutputFile]:
    """The data files Spark wrote under ``directory``, with sizes, rows and partition values."""
    import pyarrow.parquet as pq

    files = []
    for info, relative in written_files(store, directory):
        rows = pq.read_metadata(info.path, filesystem=store.fs).num_rows
        files.append(OutputFile("sink", target, store.spark_path(info.path), info.size, rows,
                                {}, partition_values(relative)))
    return files


class BatchSink:
    kind = "sink"

    def __init__(self, name: str) -> None:
        self.name = name

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def prepare(self, df: DataFrame) -> None:
        """Check or create the target for the batch's schema (each batch, cheap when known)."""

    def is_committed(self, batch_id: int) -> bool:
        return False

    def committed_batch(self) -> int | None:
        """The last batch of this lineage the sink has committed (or begun to commit); None
        if it holds none or cannot tell. Read at start to refuse a checkpoint directory the
        sink is ahead of."""
        return None

    def finish_pending(self, batch_id: int) -> dict[str, Any] | None:
        """Finish a commit of ``batch_id`` an earlier driver began; None if there is none."""
        return None

    def stage(self, df: DataFrame, batch_id: int) -> Any:
        raise NotImplementedError

    def commit(self, batch_id: int, staged: Any) -> dict[str, Any]:
        return {}


class ForeachBatchSink(BatchSink):
    kind = "foreach_batch"

    def __init__(self, name: str, fn: Callable[[DataFrame, int], Any]) -> None:
        super().__init__(name)
        self.fn = fn

    def stage(self, df: DataFrame, batch_id: int) -> Any:
        self.fn(df, batch_id)
        return None


class _FileSink(BatchSink):
    def __init__(self, name: str, path: str, partition_by: Sequence[str],
                 ctx: PipelineScope) -> None:
        super().__init__(name)
        self.path = path
        self.partition_by = tuple(partition_by)
        self.ctx = ctx
        self.store = Storage(path)
        self._prepared: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "partition_by": list(self.partition_by)}

    def check_columns(self, df: DataFrame) -> None:
        """Refuse a stream that lacks a ``partition_by`` column."""
        missing = [c for c in self.partition_by if c not in df.columns]
        if missing:
            raise JobDefinitionError(
                f"output {self.name}: partition_by {list(self.partition_by)} names columns "
                f"{missing} the stream does not have; its columns: {df.columns}"
            )

    @staticmethod
    def provably_empty(df: DataFrame) -> bool:
        """True when Spark's optimizer reduced the batch to no rows (an empty batch): writing
        it would still run a job and leave an empty file."""
        return frame_api(df).provably_empty(df)

    def write_parquet(self, df: DataFrame, directory: str) -> None:
        """Write the batch as Parquet files into ``directory`` (replacing what is there)."""
        writer = df.write.mode("overwrite")
        if self.partition_by:
            writer = writer.partitionBy(*self.partition_by)
        with micros_timestamps(df.sparkSession):
            writer.parquet(self.store.spark_path(directory))


class DeltaBatchSink(_FileSink):
    kind = "delta"

    def __init__(self, name: str, path: str, partition_by: Sequence[str],
                 ctx: PipelineScope) -> None:
        super().__init__(name, path, partition_by, ctx)
        self._delta: DeltaSink | None = None

    def _sink(self) -> DeltaSink:
        if self._delta is None:
            spec = SinkSpec(self.name, "delta", self.path, "append", self.partition_by)
            self._delta = DeltaSink(spec, self.ctx.lineage, clock=getattr(self.ctx, "clock", None))
        return self._delta

    def prepare(self, df: DataFrame) -> None:
        self.check_columns(df)
        schema = df.schema.json()
        if self._prepared != schema:
            self._sink().prepare(df.schema)
            self._prepared = schema

    def is_committed(self, batch_id: int) -> bool:

        sink = self._sink()
        return is_delta_table(sink.uri) and sink.is_committed(batch_id + 1)

    def committed_batch(self) -> int | None:

        sink = self._sink()
        if not is_delta_table(sink.uri):
            return None
        version = sink.committed_version()
        return None if version is None else version - 1

    def stage(self, df: DataFrame, batch_id: int) -> Any:
        # A fresh, visible directory per try: files of a try that never commits are plain
        # unreferenced files that VACUUM removes; committed files stay where they are.
        directory = join(self.store.root, "spark_ckpt_staged",
                         f"{self.ctx.name}-{self.name}-b{batch_id}-{uuid.uuid4().hex[:12]}")
        if self.provably_empty(df):
            return []
        self.write_parquet(df, directory)
        return staged_files(self.store, directory, self.name)

    def commit(self, batch_id: int, staged: Any) -> dict[str, Any]:
        if not staged:  # nothing to show; an empty commit per empty batch only bloats the log
            return {"files": 0}
        return self._sink().commit(staged, batch_id + 1)


class ParquetBatchSink(_FileSink):
    kind = "parquet"

    def __init__(self, name: str, path: str, partition_by: Sequence[str],
                 ctx: PipelineScope) -> None:
        super().__init__(name, path, partition_by, ctx)
        self._sink: ParquetSink | None = None

    @property
    def _parquet(self) -> ParquetSink:
        if self._sink is None:  # the lineage is known once the pipeline started
            spec = SinkSpec(self.name, "parquet", self.path, "append", self.partition_by)
            self._sink = ParquetSink(spec, f"{self.ctx.lineage}-{self.name}")
        return self._sink

    def prepare(self, df: DataFrame) -> None:
        self.check_columns(df)

    def is_committed(self, batch_id: int) -> bool:
        return self._parquet.is_committed(batch_id + 1)

    def committed_batch(self) -> int | None:
        # any marker counts: a half-done commit of batch b is finished when b runs again
        version = max(self._parquet.versions(), default=None)
        return None if version is None else version - 1

    def purge(self, below: int) -> None:
        """Batches ``< below`` never run again (their records are purged): drop their
        commit markers, which would otherwise grow by one a batch forever."""
        self._parquet.purge_markers(below + 1)

    def finish_pending(self, batch_id: int) -> dict[str, Any] | None:
        if self._parquet.read_marker(batch_id + 1) is None:
            return None
        return self._parquet.commit([], batch_id + 1)

    def stage(self, df: DataFrame, batch_id: int) -> Any:
        # A directory of this try's own: a crashed try's Spark job may still be writing into
        # its directory (on Spark Connect a killed client's operation runs on), never into
        # this one. The commit clears the whole staging area.
        staging = join(self._parquet.staging, f"b{batch_id}-{uuid.uuid4().hex[:12]}")
        if self.provably_empty(df):
            return []
        self.write_parquet(df, staging)
        return staged_files(self.store, staging, self.name)

    def commit(self, batch_id: int, staged: Any) -> dict[str, Any]:
        return self._parquet.commit(staged, batch_id + 1)


