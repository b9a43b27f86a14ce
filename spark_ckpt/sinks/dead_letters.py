"""Dead letters: rows a source could not parse, kept in a Delta table of the pipeline's own
(``<checkpoint dir>/dead_letters`` unless spark.ckpt.deadLetters.path says otherwise), each
batch's rows once per (source, batch) however often the batch runs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.sinks.per_batch import DeltaBatchSink, PipelineScope
from spark_ckpt.storage import delta_table, is_delta_table, join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


__all__ = ["DeadLetters"]

log = logging.getLogger(__name__)


class _DeadLetterSink(DeltaBatchSink):
    """One source's dead letters: each batch's rows in one commit with no app transaction
    (whether a batch's rows are there is asked of the rows themselves, see
    :meth:`DeadLetters.written`), and the batch in the commit's metadata."""

    def commit(self, batch_id: int, staged: Any) -> dict[str, Any]:
        if not staged:
            return {"files": 0}
        return self._sink().commit(staged, None, metadata={_DEAD_LETTER_BATCH: str(batch_id)})


_DEAD_LETTER_BATCH = "spark_ckpt.deadletter_batch"


class DeadLetters:
    """Rows a source could not parse, kept in the Delta table ``<checkpoint>/deadletter``
    (``batch_id, source, file, record, reason``), written once per (source, batch).

    Once per (source, batch) is asked of the table's rows: a batch's rows are written in one
    commit, so they are all there or none is. A version counting batches cannot say it: a
    batch's file source may be parsed first after a later batch's dead letters were committed
    (two windows over one source), and the later version would say this batch's were written
    when they were not. The table lives in the checkpoint directory, so it is always the
    directory's own (a copy restores it with the records it matches)."""

    def __init__(self, ctx: PipelineScope) -> None:
        self.ctx = ctx
        self.path = join(ctx.root, "deadletter")
        self._sinks: dict[str, _DeadLetterSink] = {}

    @property
    def uri(self) -> str:
        return self.ctx.storage.spark_path(self.path)

    def committed_batch(self, sources: Sequence[str]) -> int | None:
        """The last batch of this lineage whose dead letters the table holds, or None."""

        if not is_delta_table(self.uri):
            return None
        table = delta_table(self.uri)
        job = f"{self.ctx.lineage}"
        batches = [int(h[_DEAD_LETTER_BATCH]) for h in table.history()
                   if h.get("spark_ckpt.job_id") == job and _DEAD_LETTER_BATCH in h]
        for source in sources:  # written before batches were named in the commits
            version = table.transaction_version(f"spark_ckpt/{job}/deadletter-{source}")
            if version:
                batches.append(version - 1)
        return max(batches, default=None)

    def written(self, batch_id: int, source: str) -> bool:
        """Whether the table holds ``source``'s dead letters of ``batch_id`` (a filtered
        count: partition pruning by source, file statistics on batch_id)."""
        import pyarrow.dataset as ds

        if not is_delta_table(self.uri):
            return False
        rows = delta_table(self.uri).to_pyarrow_dataset()
        found: int = rows.count_rows(filter=(ds.field("source") == source)
                                     & (ds.field("batch_id") == batch_id))
        return found > 0

    def write(self, batch_id: int, source: str, rows: DataFrame) -> None:
        from pyspark.sql import functions as F

        if self.written(batch_id, source):
            return
        sink = self._sinks.setdefault(source, _DeadLetterSink(
            f"deadletter-{source}", self.uri, ("source",), self.ctx))
        df = rows.select(F.lit(batch_id).cast("long").alias("batch_id"),
                         F.lit(source).alias("source"), "file", "record", "reason")
        sink.prepare(df)
        sink.commit(batch_id, sink.stage(df, batch_id))
        log.warning("Pipeline %s batch %d: source %s had malformed records; kept in %s",
                    self.ctx.name, batch_id, source, self.path)
