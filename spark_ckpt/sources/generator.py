"""A deterministic generator as a replayable source: each batch's piece is a range of row
numbers at a rate on the pipeline's clock, the rows a function of the number."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from spark_ckpt.errors import JobDefinitionError, RecordError
from spark_ckpt.formats import integer
from spark_ckpt.sources.source import Source, SourceRun, SourceScope

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["GeneratorSource"]



# -- a deterministic generator -----------------------------------------------------------------
class GeneratorSource(Source):
    """Rows ``id, key, value, event_time``, a pure function of ``id``: replayable from any offset.

    ``rows_per_batch`` fixes each batch's size (exact offsets for tests); otherwise
    ``rows_per_second`` decides it from the time since the previous batch, capped by
    ``max_rows_per_batch``. ``total_rows`` ends the stream (``available_now`` stops there).
    """

    kind = "generator"
    SCHEMA = "id BIGINT, key BIGINT, value DOUBLE, event_time TIMESTAMP"
    PIECE = {"start": integer(0), "end": integer(0), "rows": integer(0)}

    def __init__(self, name: str, *, rows_per_batch: int | None = None,
                 rows_per_second: float | None = None, max_rows_per_batch: int | None = None,
                 total_rows: int | None = None, keys: int = 1000, partitions: int = 2,
                 seed: int = 42) -> None:
        super().__init__(name)
        if (rows_per_batch is None) == (rows_per_second is None):
            raise JobDefinitionError(
                f"generator source {name}: expected exactly one of rows_per_batch and "
                f"rows_per_second, found {rows_per_batch!r} and {rows_per_second!r}"
            )
        self.rows_per_batch = rows_per_batch
        self.rate = rows_per_second
        self.max_rows = max_rows_per_batch
        self.total = total_rows
        self.keys = keys
        self.partitions = partitions
        self.seed = seed
        self.offset = 0
        self._last = self.clock.monotonic_s()

    def bind(self, pipeline: SourceScope) -> None:
        super().bind(pipeline)
        self._last = self.clock.monotonic_s()  # the rate runs on the pipeline's clock

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "keys": self.keys, "seed": self.seed}

    def schema(self) -> StructType:
        from pyspark.sql.types import StructType

        return cast(StructType, StructType.fromDDL(self.SCHEMA))

    def _check_places(self, piece: dict[str, Any], field: str) -> None:
        if piece["end"] < piece["start"]:
            raise RecordError(f"field {field}.end: expected at least start={piece['start']}, "
                              f"found {piece['end']}")

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        for _batch, piece in pieces:
            self.offset = max(self.offset, piece["end"])

    def plan(self) -> dict[str, Any]:
        now = self.clock.monotonic_s()
        if self.rows_per_batch is not None:
            count = self.rows_per_batch
        else:
            count = int((now - self._last) * float(self.rate))  # type: ignore[arg-type]
        if self.max_rows is not None:
            count = min(count, self.max_rows)
        end = self.offset + max(count, 0)
        if self.total is not None:
            end = min(end, self.total)
        return {"start": self.offset, "end": end, "rows": end - self.offset}

    def advance(self, piece: dict[str, Any]) -> None:
        self.offset = piece["end"]
        self._last = self.clock.monotonic_s()

    def position(self) -> dict[str, Any]:
        return {"offset": self.offset}

    def read(self, run: SourceRun, piece: dict[str, Any]) -> DataFrame:
        from pyspark.sql import functions as F

        df = run.spark.range(piece["start"], piece["end"], numPartitions=self.partitions)
        return df.select(
            "id",
            F.pmod(F.col("id"), F.lit(self.keys)).alias("key"),
            (F.pmod(F.xxhash64("id", F.lit(self.seed)), F.lit(1_000_000)) / 100.0).alias("value"),
            F.timestamp_millis(F.lit(1_767_225_600_000) + F.col("id")).alias("event_time"),
        )
