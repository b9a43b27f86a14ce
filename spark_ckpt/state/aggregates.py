"""Built-in keyed aggregations: what Spark pre-aggregates per batch, and how state merges it.

``keyed.agg(n=count(), total=sum_("amount"), last_price=last("price", "ts"))``: each batch,
Spark groups the batch by (key group, key) and computes a *partial* per output; the stateful
task merges each partial into the key's state. State columns per output ``o``:

========  ==========================  =============================================
function  state columns               merge of state s with a batch partial p
========  ==========================  =============================================
count     ``o`` (long)                s + p
sum       ``o``                       s + p; null only while every value was null
min, max  ``o``                       the smaller / larger; nulls ignored
mean      ``o__sum``, ``o__count``    both added; the view shows sum / count
first     ``o``, ``o__ts``            the value with the smaller event time
last      ``o``, ``o__ts``            the value with the larger event time (ties: later batch)
========  ==========================  =============================================

Inside the state, timestamps are int64 microseconds and dates int32 days (cast back when a
view is produced), so merges are plain numpy operations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa

from spark_ckpt.errors import JobDefinitionError

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType, StructType

__all__ = ["Agg", "AggSpec", "count", "first", "last", "max_", "mean", "min_", "sum_"]

Func = Literal["count", "sum", "min", "max", "mean", "first", "last", "count_distinct",
               "approx_count_distinct", "collect_list", "collect_set", "percentile"]
#: what key_by().agg() merges into running state (the others keep lists: windows only)
RUNNING = ("count", "sum", "min", "max", "mean", "first", "last")


@dataclasses.dataclass(frozen=True)
class Agg:
    """One aggregation, before it is given its output name."""

    func: Func
    column: str | None = None
    time_column: str | None = None
    param: float | None = None  # approx_count_distinct's rsd, percentile's percentage


def count(column: str | None = None) -> Agg:
    """Rows per key (``column``: only rows where it is not null)."""
    return Agg("count", column)


def sum_(column: str) -> Agg:
    return Agg("sum", column)


def min_(column: str) -> Agg:
    return Agg("min", column)


def max_(column: str) -> Agg:
    return Agg("max", column)


def mean(column: str) -> Agg:
    return Agg("mean", column)


def first(column: str, time_column: str) -> Agg:
    """The value with the smallest ``time_column`` seen for the key."""
    return Agg("first", column, time_column)


def last(column: str, time_column: str) -> Agg:
    """The value with the largest ``time_column`` seen for the key."""
    return Agg("last", column, time_column)


_NUMERIC = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType")
_ORDERED = (*_NUMERIC, "StringType", "TimestampType", "TimestampNTZType", "DateType",
            "BooleanType")


@dataclasses.dataclass(frozen=True)
class _Out:
    name: str
    agg: Agg
    value_type: DataType  # type of the output column (Spark)


class AggSpec:
    """Named aggregations over a keyed stream, checked against the stream's schema."""

    def __init__(self, keys: Sequence[str], aggs: dict[str, Agg], schema: StructType) -> None:
        from pyspark.sql.types import DoubleType, LongType

        if not aggs:
            raise JobDefinitionError("agg(): expected at least one aggregation, found none")
        self.keys = tuple(keys)
        self.outputs: list[_Out] = []
        fields = {f.name: f.dataType for f in schema.fields}
        for name, agg in aggs.items():
            if not isinstance(agg, Agg) or agg.func not in RUNNING:
                raise JobDefinitionError(
                    f"agg(): {name}= expected count(), sum_(col), min_(col), max_(col), "
                    f"mean(col), first(col, ts) or last(col, ts); found {agg!r} (lists of "
                    "values, distinct counts and percentiles are kept per window: "
                    "key_by(...).window(...).agg(...))"
                )
            if name in self.keys or name.startswith("_") or "__" in name:
                raise JobDefinitionError(
                    f"agg(): output name {name!r} clashes with a key or a reserved name "
                    "(names starting with '_' or containing '__')"
                )
            for col in (agg.column, agg.time_column):
                if col is not None and col not in fields:
                    raise JobDefinitionError(
                        f"agg(): {name}={agg.func}({col!r}) names a column the stream does not "
                        f"have; its columns: {sorted(fields)}"
                    )
            dtype = fields.get(agg.column) if agg.column else None
            kind = type(dtype).__name__ if dtype is not None else None
            if agg.func in ("sum", "mean") and kind not in _NUMERIC:
                raise JobDefinitionError(
                    f"agg(): {name}={agg.func}({agg.column!r}) expected a numeric column, "
                    f"found {dtype}"
                )
            if agg.func in ("min", "max", "first", "last") and kind not in _ORDERED:
                raise JobDefinitionError(
                    f"agg(): {name}={agg.func}({agg.column!r}) expected a numeric, string, "
                    f"boolean, date or timestamp column, found {dtype}"
                )
            if agg.time_column is not None:
                tkind = type(fields[agg.time_column]).__name__
                if tkind not in ("TimestampType", "TimestampNTZType", "LongType",
                                 "IntegerType", "DateType"):
                    raise JobDefinitionError(
                        f"agg(): {name}={agg.func}(..., {agg.time_column!r}) expected an event "
                        f"time column (timestamp, date or integer), found "
                        f"{fields[agg.time_column]}"
                    )
            if agg.func == "count":
                value_type: DataType = LongType()
            elif agg.func == "sum":
                value_type = LongType() if kind in _NUMERIC[:4] else DoubleType()
            elif agg.func == "mean":
                value_type = DoubleType()
            else:
                value_type = dtype  # type: ignore[assignment]
            self.outputs.append(_Out(name, agg, value_type))
        for key in self.keys:
            if key not in fields:
                raise JobDefinitionError(
                    f"key_by(): key column {key!r} is not in the stream; its columns: "
                    f"{sorted(fields)}"
                )
        self.key_types = {k: fields[k] for k in self.keys}
        self.time_types = {o.agg.time_column: fields[o.agg.time_column] for o in self.outputs
                           if o.agg.time_column}

    # -- Spark side -------------------------------------------------------------------------
    def partial_columns(self) -> list[Column]:
        """Per-batch partial aggregates, one or two columns per output."""
        from pyspark.sql import functions as F

        cols: list[Column] = []
        for o in self.outputs:
            a = o.agg
            c = F.col(a.column) if a.column else F.lit(1)  # only count() has no column
            if a.func == "count":
                cols.append(F.count(c).alias(o.name))
            elif a.func == "sum":
                cols.append(F.sum(c).cast(o.value_type).alias(o.name))
            elif a.func in ("min", "max"):
                cols.append(getattr(F, a.func)(c).alias(o.name))
            elif a.func == "mean":
                cols.append(F.sum(c.cast("double")).alias(f"{o.name}__sum"))  # as avg
                cols.append(F.count(c).alias(f"{o.name}__count"))
            else:
                by, pick = (F.min_by, F.min) if a.func == "first" else (F.max_by, F.max)
                ts = F.col(str(a.time_column))  # first() and last() have one
                cols.append(by(c, ts).alias(o.name))
                cols.append(pick(ts).alias(f"{o.name}__ts"))
        return cols

    def state_columns(self) -> list[tuple[str, str, DataType]]:
        """(state column, merge kind, Spark type) in file order."""
        from pyspark.sql.types import DoubleType, LongType

        out: list[tuple[str, str, DataType]] = []
        for o in self.outputs:
            f = o.agg.func
            if f == "count":
                out.append((o.name, "add", LongType()))
            elif f == "sum":
                out.append((o.name, "add", o.value_type))
            elif f in ("min", "max"):
                out.append((o.name, f, o.value_type))
            elif f == "mean":
                out.append((f"{o.name}__sum", "add", DoubleType()))
                out.append((f"{o.name}__count", "add", LongType()))
            else:
                ttype = self.time_types[str(o.agg.time_column)]
                out.append((o.name, f"{f}_value", o.value_type))
                out.append((f"{o.name}__ts", f"{f}_ts", ttype))
        return out

    def view(self, df: DataFrame) -> DataFrame:
        """Keys and output columns of state rows (a changelog or a snapshot)."""
        from pyspark.sql import functions as F

        cols: list[Any] = [F.col(k) for k in self.keys]
        for o in self.outputs:
            if o.agg.func == "mean":
                cols.append(F.when(F.col(f"{o.name}__count") > 0,
                                   F.col(f"{o.name}__sum") / F.col(f"{o.name}__count"))
                            .alias(o.name))
            else:
                cols.append(F.col(o.name).cast(o.value_type).alias(o.name))
        return df.select(*cols)

    def describe(self) -> dict[str, Any]:
        return {"keys": list(self.keys),
                "aggs": {o.name: [o.agg.func, o.agg.column, o.agg.time_column]
                         for o in self.outputs}}


# -- worker side (numpy) ------------------------------------------------------------------
def to_internal(array: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Timestamps as int64 micros and dates as int32 days, so numpy can merge them."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    t = array.type
    if pa.types.is_timestamp(t):
        return array.cast(pa.timestamp("us", tz=t.tz)).cast(pa.int64())
    if pa.types.is_date32(t):
        return array.cast(pa.int32())
    return array


#: an event time that is null, among int64 microseconds
NULL_TIME = np.iinfo(np.int64).min


def event_micros(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A timestamp column as int64 microseconds (Spark's precision); nulls as NULL_TIME."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    micros = column.cast(pa.timestamp("us", tz=getattr(column.type, "tz", None))) \
        .cast(pa.int64()).fill_null(NULL_TIME)
    return np.asarray(micros.to_numpy(zero_copy_only=False), dtype=np.int64)


def from_internal(array: pa.Array, target: pa.DataType) -> pa.Array:
    if pa.types.is_timestamp(target):
        return array.cast(pa.timestamp("us", tz=target.tz))
    if pa.types.is_date32(target):
        return array.cast(pa.date32())
    return array.cast(target) if array.type != target else array


def to_numpy(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, valid): nulls filled with a neutral value of the type."""
    valid = np.asarray(array.is_valid())
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        return np.array(array.to_pylist(), dtype=object), valid
    if pa.types.is_boolean(array.type):
        return np.asarray(array.fill_null(False)), valid
    return np.asarray(array.fill_null(0)), valid


def merge(kind: str, old: tuple[np.ndarray, np.ndarray], new: tuple[np.ndarray, np.ndarray],
          ts: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
          ) -> tuple[np.ndarray, np.ndarray]:
    """Merge a batch partial ``new`` into state ``old`` (aligned arrays) for one column."""
    ov, ok = old
    nv, nk = new
    both = ok & nk
    if kind == "add":
        out = np.where(both, ov + nv, np.where(ok, ov, nv))
    elif kind in ("min", "max"):
        if ov.dtype == object or nv.dtype == object:  # strings: Python's ordering, as Spark's
            py = min if kind == "min" else max
            combined = np.array([py(a, b) if x else None for a, b, x in zip(ov, nv, both,
                                                                            strict=True)],
                                dtype=object)
        else:
            # Spark orders NaN above every number: max keeps it, min ignores it
            combined = (np.fmin if kind == "min" else np.maximum)(ov, nv)
        out = np.where(both, combined, np.where(ok, ov, nv))
    else:  # first/last value or time: take the partial where its event time wins
        assert ts is not None
        (ot, otk), (nt, ntk) = ts
        if kind.startswith("first"):
            wins = ntk & (~otk | (nt < ot))
        else:
            wins = ntk & (~otk | (nt >= ot))
        out = np.where(wins, nv, ov)
        return out, np.where(wins, nk, ok)
    return out, ok | nk
