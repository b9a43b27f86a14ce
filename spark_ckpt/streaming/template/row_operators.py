"""Deduplication and Top-N on keyed streams.

``stream.drop_duplicates("id", within="10 minutes")`` (or ``key_by("id").drop_duplicates(...)``)
emits each key's first row and drops the key's later rows:

- with ``within`` (a duration; the input declares a watermark): the key is remembered until the
  watermark passes its first row's event time plus ``within``, as Structured Streaming's
  ``dropDuplicatesWithinWatermark`` (whose ``within`` is the watermark's delay); rows at or
  before the watermark are late, dropped and counted (``late_rows``);
- with ``ttl`` (a duration of processing time): the key is remembered that long after its first
  row, as Flink SQL's deduplication with ``table.exec.state.ttl``;
- with neither: every key is remembered for ever (a warning says the state grows).

``key_by("auction").top_n(10, order_by=[("price", "desc")])`` keeps each key's first ``n`` rows
in that order (Flink's Top-N, ``ROW_NUMBER() OVER (PARTITION BY auction ORDER BY price DESC)
<= 10``). Each batch emits, for every key whose top rows it changed, all of them with their
``rank`` (1 = first): an upsert stream by (key, rank), for ``write_delta(merge_keys=[key,
"rank"])``. ``last_row(order_by="ts")`` is the one newest row per key (Flink's deduplication
keeping the last row), without a rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.state.row_processors import RANK_COLUMN, DedupProcessor, TopNProcessor
from spark_ckpt.streaming.template.derived import Derived, DerivedOperator
from spark_ckpt.streaming.template.event_time import duration_ms
from spark_ckpt.streaming.template.keyed import KeyedStream

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["DeduplicatedStream", "TopNStream", "check_order", "dedup_state", "kept_rows",
           "parse_order", "top_n_state"]

log = logging.getLogger(__name__)


def parse_order(what: str, order_by: Any) -> list[tuple[str, bool]]:
    """``order_by`` ("price", or [("price", "desc"), ("ts", "asc")]) as (column, descending)
    pairs. Nulls sort last either way."""
    order = [(order_by, "asc")] if isinstance(order_by, str) else list(order_by)
    parsed = []
    for item in order:
        column, direction = (item, "asc") if isinstance(item, str) else item
        if str(direction).lower() not in ("asc", "desc"):
            raise JobDefinitionError(
                f"{what}: expected order_by as [(column, 'asc' | 'desc')], found {item!r}")
        parsed.append((column, str(direction).lower() == "desc"))
    if not parsed:
        raise JobDefinitionError(f"{what}: expected at least one order_by column")
    return parsed


def check_order(what: str, order: list[tuple[str, bool]], names: list[str]) -> None:
    """Refuse an order_by column the operator's input does not have."""
    for column, _desc in order:
        if column not in names:
            raise JobDefinitionError(
                f"{what}: order_by column {column!r} is not in its input; columns: "
                f"{sorted(names)}")


class DeduplicatedStream(DerivedOperator):
    """Each key's first row (see the module's docstring)."""

    def __init__(self, keyed: KeyedStream, name: str, *, within: Any = None,
                 ttl: Any = None) -> None:
        if within is not None and ttl is not None:
            raise JobDefinitionError(
                f"drop_duplicates {name}: expected within= (event time) or ttl= (processing "
                "time), found both")
        mark = self.watermark_of_inputs(keyed, f"drop_duplicates {name}",
                                        required=within is not None)
        self.within_ms = None if within is None else duration_ms(within, "within")
        ttl_ms = None if ttl is None else duration_ms(ttl, "ttl")
        if ttl_ms is not None and ttl_ms <= 0:
            raise JobDefinitionError(f"drop_duplicates {name}: expected a ttl above 0")
        if within is None and ttl is None:
            log.warning("drop_duplicates %s: neither within= nor ttl= is given: every key is "
                        "kept in state for ever", name)
        super().__init__(keyed, name, event_time=mark.column if mark else None,
                         delay_ms=mark.delay_ms if mark else 0, ttl_ms=ttl_ms)

    def derive(self, schema: StructType) -> Derived:
        return Derived(DedupProcessor(self.event_time, self.within_ms), schema)

    def definition(self) -> dict[str, Any]:
        return {"operator": "drop_duplicates", "keys": list(self.keys),
                "event_time": self.event_time, "within_ms": self.within_ms}


class TopNStream(DerivedOperator):
    """Each key's first ``n`` rows in an order (see the module's docstring)."""

    def __init__(self, keyed: KeyedStream, name: str, n: int,
                 order_by: Sequence[tuple[str, str]] | str, *, with_rank: bool = True) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise JobDefinitionError(f"top_n {name}: expected n >= 1, found {n!r}")
        self.n = n
        self.order = parse_order(f"top_n {name}", order_by)
        self.with_rank = with_rank
        super().__init__(keyed, name)  # unbounded: no event time (Top-N per window: later)

    def derive(self, schema: StructType) -> Derived:
        from pyspark.sql.types import ArrayType, IntegerType, StructField, StructType

        names = schema.fieldNames()
        check_order(f"top_n {self.operator}", self.order, names)
        if self.with_rank and RANK_COLUMN in names:
            raise JobDefinitionError(
                f"top_n {self.operator}: its input has a column {RANK_COLUMN!r}, the name of "
                "the rank it adds; rename it")
        ddl = ", ".join(f"row_{i} {ArrayType(f.dataType, True).simpleString()}"
                        for i, f in enumerate(schema.fields))
        raw = StructType([*schema.fields, *([StructField(RANK_COLUMN, IntegerType())]
                                            if self.with_rank else [])])
        return Derived(TopNProcessor(self.n, self.order, names, ddl, self.with_rank), raw)

    def definition(self) -> dict[str, Any]:
        return {"operator": "top_n", "columns": list(self.derived().processor.columns),
                "n": self.n, "order": [[c, desc] for c, desc in self.order],
                "with_rank": self.with_rank}


def kept_rows(state: DataFrame, columns: Sequence[str], *, carry: Sequence[str],
              with_rank: bool) -> DataFrame:
    """A Top-N's state (per key, the kept rows as one list per input column, ``row_<i>``, in
    rank order) as rows: the input's columns, the key columns ``carry``, and the ``rank``."""
    from pyspark.sql import functions as F

    at = F.col("__ckpt_i") + 1
    lists = [f"row_{i}" for i in range(len(columns))]
    exploded = state.select(*[F.col(f"`{c}`") for c in [*carry, *lists[1:]]],
                            F.posexplode(F.col(lists[0])).alias("__ckpt_i", "__ckpt_v0"))
    values = [F.col("__ckpt_v0").alias(columns[0]),
              *[F.element_at(F.col(n), at).alias(c)
                for n, c in zip(lists[1:], columns[1:], strict=True)]]
    rank = [at.cast("int").alias(RANK_COLUMN)] if with_rank else []
    out: DataFrame = exploded.select(*values, *[F.col(f"`{c}`") for c in carry], *rank)
    return out


def dedup_state(state: DataFrame, definition: dict[str, Any]) -> DataFrame:
    """A deduplication's state as ``read_state`` shows it: the keys it remembers and, when it
    has an event time, the first row's event time under the event-time column's name."""
    from pyspark.sql import functions as F

    from spark_ckpt.state.row_processors import FIRST_SEEN

    keys = list(definition["keys"])
    time = definition.get("event_time")
    seen = [F.timestamp_millis(F.col(FIRST_SEEN)).alias(time)] \
        if time is not None and time not in keys else []
    out: DataFrame = state.select(*[F.col(f"`{k}`") for k in keys], *seen)
    return out


def top_n_state(state: DataFrame, definition: dict[str, Any]) -> DataFrame:
    """A Top-N's (or last row's) state as ``read_state`` shows it: each key's kept rows, the
    input's columns and their ``rank`` (none for the last row), as the operator emits them."""
    return kept_rows(state, definition["columns"], carry=[],
                     with_rank=bool(definition["with_rank"]))
