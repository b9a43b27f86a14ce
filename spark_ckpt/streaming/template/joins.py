"""Stream-stream joins bounded in event time:
``bids.join_stream(auctions, on="auction", how="inner", between=("-10 seconds", "0 seconds"))``.

Rows of the two streams match when their ``on`` columns are equal and the right row's event
time is within ``[left.t + lower, left.t + upper]`` (``between``), each side's event time
being the column its own ``with_watermark`` declares, as Structured Streaming's
``a.t BETWEEN b.t - INTERVAL ... AND b.t + INTERVAL ...`` and Flink SQL's interval join.

- ``how``: ``inner``, ``left_outer``, ``right_outer``, ``full_outer``, ``left_semi``,
  ``left_anti``. The watermark is the smaller of the two inputs' (each its newest event time
  minus its delay; none until both have seen rows). A kept row is dropped once no future row
  of the other side can match it; an outer (or anti) row is emitted then, once, with nulls for
  the other side (a semi join emits a left row at its first match).
- Rows at or before the watermark are late: dropped and counted (``late_rows``).
- Without ``between`` (inner and semi joins only, as Structured Streaming) the join keeps
  every row of a key; give ``ttl`` (processing time) to bound it; a warning says the state
  grows otherwise. Event time plays no part then, and no watermark flows downstream.
- A row whose ``on`` columns hold a null matches nothing (as Spark's equi-join): an outer or
  anti join emits it at once with nulls for the other side. A row with a null event time is
  dropped and counted (``null_time_rows``).
- Times are compared in microseconds, as Spark's.
- Output: the ``on`` columns, the left's other columns, the right's other columns (a name on
  both sides is refused: rename it on one side).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.state.join_processor import SIDE_COLUMN, TIME_COLUMN, JoinProcessor
from spark_ckpt.streaming.template.derived import Derived, DerivedOperator
from spark_ckpt.streaming.template.event_time import declared_watermark, duration_ms
from spark_ckpt.streaming.template.keyed import KeyedStream, _SchemaRun

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from spark_ckpt.streaming.template.stream import Stream

__all__ = ["HOWS", "StreamJoin", "join_state"]

log = logging.getLogger(__name__)

HOWS = ("inner", "left_outer", "right_outer", "full_outer", "left_semi", "left_anti")


def _signed_ms(value: Any, what: str) -> int:
    if isinstance(value, str) and value.strip().startswith("-"):
        return -duration_ms(value.strip()[1:], what)
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return value
    return duration_ms(value, what)


class StreamJoin(DerivedOperator):
    """A stream-stream join (see the module's docstring)."""

    inputs_differ = True

    def __init__(self, left: Stream, right: Stream, on: str | Sequence[str], how: str,
                 between: Any, ttl: Any, name: str) -> None:
        from pyspark.sql import functions as F

        keys = [on] if isinstance(on, str) else list(on)
        if not keys:
            raise JobDefinitionError(f"join_stream {name}: expected on= columns, found none")
        if how not in HOWS:
            raise JobDefinitionError(f"join_stream {name}: expected how in {HOWS}, found "
                                     f"{how!r}")
        # without a time bound, event time plays no part (rows are kept, or dropped by ttl)
        marks = [declared_watermark([s], f"join_stream {name}") if between is not None
                 else None for s in (left, right)]
        if between is not None and None in marks:
            raise JobDefinitionError(
                f"join_stream {name}: expected a watermark on both inputs (between= bounds the "
                "join in event time), found "
                f"{'none on the left' if marks[0] is None else 'none on the right'}")
        if between is None and how not in ("inner", "left_semi"):
            raise JobDefinitionError(
                f"join_stream {name}: a {how} join needs between= (an event-time bound): its "
                "unmatched rows are emitted when the watermark says nothing can match them "
                "any more, which needs a bound (as Structured Streaming requires one)")
        self.how = how
        self.lower: int | None = None
        self.upper: int | None = None
        if between is not None:
            if isinstance(between, tuple | list):
                low, high = between
                self.lower = _signed_ms(low, "between (lower)")
            else:
                high = between
                self.lower = -duration_ms(between, "between")
            self.upper = _signed_ms(high, "between (upper)")
            if self.lower > self.upper:
                raise JobDefinitionError(
                    f"join_stream {name}: expected between=(lower, upper) with lower <= upper, "
                    f"found {between!r}")
        ttl_ms = None if ttl is None else duration_ms(ttl, "ttl")
        if between is None and ttl is None:
            log.warning("join_stream %s: no between= bound and no ttl=: every row of both "
                        "inputs is kept in state for ever", name)
        sides = []
        for s, (stream, mark) in enumerate(zip((left, right), marks, strict=True)):
            time = F.col(mark.column) if mark is not None else F.lit(None).cast("timestamp")
            sides.append(stream.with_column(SIDE_COLUMN, F.lit(s))
                         .with_column(TIME_COLUMN, time))
        self.key_columns = tuple(keys)
        self.side_streams = tuple(sides)
        keyed = KeyedStream(left.pipeline, sides, keys)  # type: ignore[arg-type]
        # without a bound, event time plays no part: no watermark to pass downstream either
        super().__init__(keyed, name, event_time=TIME_COLUMN if between is not None else None,
                         ttl_ms=ttl_ms)
        if None not in marks:
            self.channel_delays = tuple(m.delay_ms for m in marks)  # type: ignore[union-attr]

    def derive(self, schema: StructType) -> Derived:
        from pyspark.sql.types import ArrayType, StructType

        run = _SchemaRun(self.pipeline.spark)
        internal = {SIDE_COLUMN, TIME_COLUMN}
        fields = {}
        for side, stream in zip(("l", "r"), self.side_streams, strict=True):
            side_schema = run.get_or_compute(stream).schema
            missing = [k for k in self.key_columns if k not in side_schema.fieldNames()]
            if missing:
                raise JobDefinitionError(
                    f"join_stream {self.operator}: on= columns {missing} are not in the "
                    f"{'left' if side == 'l' else 'right'} input; its columns: "
                    f"{sorted(side_schema.fieldNames())}")
            fields[side] = [f for f in side_schema.fields
                            if f.name not in internal and f.name not in self.key_columns]
        clash = {f.name for f in fields["l"]} & {f.name for f in fields["r"]}
        if clash and self.how not in ("left_semi", "left_anti"):
            raise JobDefinitionError(
                f"join_stream {self.operator}: columns {sorted(clash)} are on both sides; "
                "expected distinct names (rename them on one side, e.g. with select())")
        union = {f.name: f for f in schema.fields}
        key_fields = [union[k] for k in self.key_columns]
        out = [*key_fields, *fields["l"],
               *([] if self.how in ("left_semi", "left_anti") else fields["r"])]
        ddl = []
        for side in ("l", "r"):
            ddl += [f"{side}_{i} {ArrayType(f.dataType, True).simpleString()}"
                    for i, f in enumerate(fields[side])]
            ddl += [f"{side}_time ARRAY<BIGINT>", f"{side}_matched ARRAY<BOOLEAN>"]
        processor = JoinProcessor(self.how, self.lower, self.upper,
                                  {s: [f.name for f in fields[s]] for s in ("l", "r")},
                                  ", ".join(ddl))
        return Derived(processor, StructType(out))

    def definition(self) -> dict[str, Any]:
        return {"operator": "stream_join", "keys": list(self.key_columns), "how": self.how,
                "lower_ms": self.lower, "upper_ms": self.upper,
                "columns": {s: list(c) for s, c in self.derived().processor.columns.items()}}


def join_state(state: DataFrame, definition: dict[str, Any]) -> DataFrame:
    """A stream-stream join's state as ``read_state`` shows it: one row per kept row of either
    side, the ``on`` columns, ``side`` ('left' or 'right'), the left's columns, the right's
    (null for the other side's rows), and ``matched`` (whether it has met a row of the other
    side). A name taken by a column before it (a semi or anti join's two sides may share a
    name; a column called side or matched) is prefixed with underscores."""
    from functools import reduce

    from pyspark.sql import functions as F

    keys = list(definition["keys"])
    taken = set(keys)

    def free(name: str) -> str:
        while name in taken:
            name = f"_{name}"
        taken.add(name)
        return name

    named = {side: [(f"{side}_{i}", free(c)) for i, c in enumerate(definition["columns"][side])]
             for side in ("l", "r")}
    side_name, matched_name = free("side"), free("matched")
    parts = []
    for side, label in (("l", "left"), ("r", "right")):
        at = F.col("__ckpt_i") + 1
        rows = state.select(
            *[F.col(f"`{k}`") for k in keys], *[F.col(n) for n, _c in named[side]],
            F.col(f"{side}_matched"),
            F.posexplode(F.col(f"{side}_time")).alias("__ckpt_i", "__ckpt_t"))
        parts.append(rows.select(
            *[F.col(f"`{k}`") for k in keys], F.lit(label).alias(side_name),
            *[F.element_at(F.col(n), at).alias(c) for n, c in named[side]],
            F.element_at(F.col(f"{side}_matched"), at).alias(matched_name)))
    both = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    out: DataFrame = both.select(
        *[F.col(f"`{c}`") for c in [*keys, side_name, *[c for _n, c in named["l"]],
                                    *[c for _n, c in named["r"]], matched_name]])
    return out
