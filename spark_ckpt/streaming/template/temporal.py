"""Temporal joins with a Delta table: ``orders.join_as_of(rates, "currency", "order_time")``
joins each row with the table's version as of the row's time, Flink SQL's event-time temporal
join (``JOIN rates FOR SYSTEM_TIME AS OF o.order_time ON ...``) with Delta's time travel
(``TIMESTAMP AS OF``) as the versions' times.

- The table is ``ctx.delta_table(name, path)`` (sources/delta_table.py): each batch records the
  table's latest version when it is planned, and a replay reads the same versions.
- A row at time ``t`` joins the newest version committed at or before ``t`` among those the
  batch recorded; a row older than the table's first version has no version (an inner join
  drops it, a left join keeps it with nulls), as a row older than a Flink versioned table's
  first row; so does a row with a null time. A row ahead of the table's newest commit joins the
  newest version its batch saw: Flink would hold it until the versioned side's watermark passes
  its time; a Delta table has no watermark, so here it is not held (a commit later with a time
  at or before the row's does not change the row's answer).
- ``on``: the equality columns, named alike on both sides (a null never matches); the output is
  the stream's columns and the table's other columns (a name on both sides is refused).
- ``how``: ``inner`` or ``left`` (Flink's temporal joins are inner and left outer).
- Stateless: nothing is kept across batches but the versions read (cached in the driver).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.streaming.template.stream import InputStream, Stream

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from spark_ckpt.streaming.template.batch_run import BatchRun

__all__ = ["TemporalJoin"]

_VERSION = "__ckpt_version"
_HOWS = {"inner": "inner", "left": "left", "left_outer": "left"}


class TemporalJoin(Stream):
    """A stream joined with a Delta table as of each row's time (see the module's
    docstring)."""

    def __init__(self, left: Stream, table: Stream, on: str | Sequence[str], time_column: str,
                 how: str, name: str) -> None:
        from spark_ckpt.sources.delta_table import DeltaTableSource

        if not isinstance(table, InputStream) or not isinstance(table.source, DeltaTableSource):
            raise JobDefinitionError(
                f"join_as_of {name}: expected a table from ctx.delta_table(name, path), found "
                f"{table!r}")
        if how not in _HOWS:
            raise JobDefinitionError(
                f"join_as_of {name}: expected how in {sorted(_HOWS)}, found {how!r}")
        self.on = [on] if isinstance(on, str) else list(on)
        if not self.on:
            raise JobDefinitionError(f"join_as_of {name}: expected at least one column in on")
        super().__init__(left.pipeline, (left, table), name)
        self.left, self.table, self.source = left, table, table.source
        self.time_column = time_column
        self.how = _HOWS[how]

    def _check(self, left: DataFrame, table_columns: list[str]) -> None:
        """Refuse what cannot be joined, before any job runs."""
        for side, columns in (("stream", left.columns), ("table", table_columns)):
            missing = [c for c in self.on if c not in columns]
            if missing:
                raise JobDefinitionError(
                    f"join_as_of {self.name}: expected the join columns {missing} in the "
                    f"{side}; its columns: {columns}")
        field = next((f for f in left.schema.fields if f.name == self.time_column), None)
        if field is None or field.dataType.typeName() not in ("timestamp", "timestamp_ntz"):
            raise JobDefinitionError(
                f"join_as_of {self.name}: expected {self.time_column!r} to be a TIMESTAMP "
                f"column of the stream, found "
                f"{field.dataType.simpleString() if field else 'no such column'}")
        both = (set(left.columns) & set(table_columns)) - set(self.on)
        if both:
            raise JobDefinitionError(
                f"join_as_of {self.name}: columns {sorted(both)} are on both sides; rename "
                "them on one side")

    def _joined(self, left: DataFrame, right: DataFrame, version: Column) -> DataFrame:
        from pyspark.sql import functions as F

        columns = [c for c in left.columns if c != _VERSION]
        out: DataFrame = left.withColumn(_VERSION, version) \
            .join(F.broadcast(right), [*self.on, _VERSION], self.how) \
            .select(*columns, *[c for c in right.columns
                                if c not in self.on and c != _VERSION])
        return out

    def compute(self, run: BatchRun) -> DataFrame | None:
        from pyspark.sql import functions as F

        left = run.get_or_compute(self.left)
        if left is None:
            return None
        piece = run.allocation.pieces.get(self.source.name)
        if piece is None:
            raise JobDefinitionError(
                f"join_as_of {self.name}: batch {run.batch_id}'s allocation has nothing for "
                f"table {self.source.name}; recorded sources: {sorted(run.allocation.pieces)}")
        self._check(left, self.source.schema().fieldNames())
        t = F.unix_millis(F.col(self.time_column).cast("timestamp"))
        lo, hi = left.select(F.min(t), F.max(t)).first() or (None, None)
        times, complete = self.source.commit_times(int(piece["version"]))
        if lo is not None and not complete and lo < times[0][1]:
            from spark_ckpt.errors import SourceError

            raise SourceError(
                f"join_as_of {self.name}: batch {run.batch_id} has a row at {lo} ms, before "
                f"version {times[0][0]} of table {self.source.name} ({times[0][1]} ms), the "
                "oldest whose commit its log still holds: the version that row is as of is no "
                "longer known (Delta cleaned up the log before it)")
        # the versions some row of the batch is as of: from the newest at or before the
        # earliest row to the newest at or before the latest one
        needed = [] if lo is None or hi is None else [
            (i, v, at) for i, (v, at) in enumerate(times)
            if at <= hi and (i + 1 == len(times) or times[i + 1][1] > lo)]
        # each version's time range, joined to the rows in range (broadcast, a few rows)
        ranges = run.spark.createDataFrame(
            [(v, at, times[i + 1][1] if i + 1 < len(times) else None) for i, v, at in needed],
            "v BIGINT, from_ms BIGINT, to_ms BIGINT")
        timed = left.withColumn("__ckpt_t", t)
        versioned = timed.join(F.broadcast(ranges), (F.col("__ckpt_t") >= F.col("from_ms")) & (
            F.col("to_ms").isNull() | (F.col("__ckpt_t") < F.col("to_ms"))), "left")
        right = self.source.frame(run.spark, [v for _i, v, _at in needed], _VERSION)
        return self._joined(versioned.select(*left.columns, F.col("v").alias(_VERSION)),
                            right, F.col(_VERSION))

    def schema_frame(self, schema_run: Any) -> DataFrame:
        """The output's schema (the template's dry run at start)."""
        from pyspark.sql import functions as F

        left = schema_run.get_or_compute(self.left)
        table = schema_run.get_or_compute(self.table)
        self._check(left, table.columns)
        right = table.withColumn(_VERSION, F.lit(None).cast("bigint"))
        return self._joined(left, right, F.lit(None).cast("bigint"))
