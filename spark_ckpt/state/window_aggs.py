"""Aggregate functions of windowed aggregations: what Spark pre-aggregates per batch, what a
window's state holds, how a batch's partial merges into it, and the final value.

Each batch, Spark groups the batch's rows by (key, window) and computes one *partial* per
output with its own functions; the stateful task merges the partial into the window's state
and, when the watermark passes the window's end, emits the final value. So every value is
computed by Spark's own expressions over the rows, and the merges are exact:

======================  =========================  ==================  =====================
function                partial (Spark)            merge               final
======================  =========================  ==================  =====================
count                   ``count``                  add                 the count
sum                     ``sum``                    add                 the sum
min, max                ``min`` / ``max``          smaller / larger    the value
mean (avg)              ``sum``, ``count``         add both            sum / count
first, last (by time)   ``min_by`` / ``max_by``    earlier / later     the value
count_distinct          ``collect_set``            union               the set's size
approx_count_distinct   ``collect_set``            union               Spark's
                                                                       ``approx_count_distinct``
                                                                       over the set
collect_list            ``collect_list``           concatenate         the list
collect_set             ``collect_set``            union               the set
percentile              ``collect_list``           concatenate         Spark's ``percentile``
                                                                       over the values
======================  =========================  ==================  =====================

``approx_count_distinct`` over the distinct values is its answer over all rows (a HyperLogLog
sketch does not change when a value it holds is added again), and ``percentile`` keeps every
value as Spark's exact one does; both finals are computed by Spark on the rows a batch emits.
Sums of floating-point values are added in a different order than a batch query's, as any two
Spark plans may add them; the last bits can differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.state.aggregates import Agg, from_internal, merge, to_internal, to_numpy

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType, StructType

__all__ = ["WindowAggSpec", "approx_count_distinct", "collect_list", "collect_set",
           "count_distinct", "percentile"]

#: functions whose state is a list of values (merged by union or concatenation)
_LISTS = {"count_distinct": "union", "approx_count_distinct": "union", "collect_set": "union",
          "collect_list": "concat", "percentile": "concat"}
#: functions whose final value Spark computes over the emitted list
SPARK_FINALS = ("approx_count_distinct", "percentile")


def count_distinct(column: str) -> Agg:
    """Distinct non-null values of ``column`` (Spark's ``count(DISTINCT column)``)."""
    return Agg("count_distinct", column)


def approx_count_distinct(column: str, rsd: float = 0.05) -> Agg:
    """Spark's ``approx_count_distinct(column, rsd)``: its HyperLogLog++ estimate."""
    return Agg("approx_count_distinct", column, None, float(rsd))


def collect_list(column: str) -> Agg:
    """The non-null values of ``column`` in arrival order (Spark's ``collect_list``)."""
    return Agg("collect_list", column)


def collect_set(column: str) -> Agg:
    """The distinct non-null values of ``column`` (Spark's ``collect_set``; no order)."""
    return Agg("collect_set", column)


def percentile(column: str, percentage: float) -> Agg:
    """Spark's exact ``percentile(column, percentage)`` (interpolated, every value kept)."""
    if not 0.0 <= float(percentage) <= 1.0:
        raise JobDefinitionError(
            f"percentile({column!r}, {percentage!r}): expected a percentage in [0, 1]")
    return Agg("percentile", column, None, float(percentage))


_NUMERIC = ("ByteType", "ShortType", "IntegerType", "LongType", "FloatType", "DoubleType")
_ORDERED = (*_NUMERIC, "StringType", "TimestampType", "TimestampNTZType", "DateType",
            "BooleanType")
_TIMES = ("TimestampType", "TimestampNTZType", "LongType", "IntegerType", "DateType")
_FUNCS = ("count", "sum", "min", "max", "mean", "first", "last", *_LISTS)


@dataclasses.dataclass(frozen=True)
class Output:
    """One named output: its function, its final Spark type, and its state columns
    ``(name, merge kind, Spark type)``."""

    name: str
    agg: Agg
    value_type: DataType
    state: tuple[tuple[str, str, DataType], ...]


class WindowAggSpec:
    """Named aggregations of a windowed aggregation, checked against its input's schema."""

    def __init__(self, aggs: dict[str, Agg], schema: StructType, *, order_by: str,
                 reserved: Sequence[str]) -> None:
        from pyspark.sql.types import ArrayType, DoubleType, LongType

        if not aggs:
            raise JobDefinitionError("window(...).agg(): expected at least one aggregation, "
                                     "found none")
        fields = {f.name: f.dataType for f in schema.fields}
        self.order_by = order_by  # the event time: orders lists, so a replay is the same
        self.reserved = list(reserved)
        used = {c for a in aggs.values() if isinstance(a, Agg)
                for c in (a.column, a.time_column) if c is not None}
        # the input columns the aggregations read (their types decide the state's): recorded
        self.inputs = [f for f in schema.fields if f.name in used or f.name == order_by]
        self.outputs: list[Output] = []
        for name, agg in aggs.items():
            if not isinstance(agg, Agg) or agg.func not in _FUNCS:
                raise JobDefinitionError(
                    f"window(...).agg(): {name}= expected one of count(), sum_(col), "
                    "min_(col), max_(col), mean(col), first(col, ts), last(col, ts), "
                    "count_distinct(col), approx_count_distinct(col), collect_list(col), "
                    f"collect_set(col), percentile(col, p); found {agg!r}")
            if name in reserved or name.startswith("_") or "__" in name:
                raise JobDefinitionError(
                    f"window(...).agg(): output name {name!r} clashes with a key, 'window' or a "
                    "reserved name (names starting with '_' or containing '__')")
            for col in (agg.column, agg.time_column):
                if col is not None and col not in fields:
                    raise JobDefinitionError(
                        f"window(...).agg(): {name}={agg.func}({col!r}) names a column the "
                        f"stream does not have; its columns: {sorted(fields)}")
            dtype = fields.get(agg.column) if agg.column else None
            kind = type(dtype).__name__ if dtype is not None else None
            func: str = agg.func
            if func in ("sum", "mean", "percentile") and kind not in _NUMERIC:
                raise JobDefinitionError(
                    f"window(...).agg(): {name}={func}({agg.column!r}) expected a numeric "
                    f"column, found {dtype}")
            if func in ("min", "max", "first", "last") and kind not in _ORDERED:
                raise JobDefinitionError(
                    f"window(...).agg(): {name}={func}({agg.column!r}) expected a numeric, "
                    f"string, boolean, date or timestamp column, found {dtype}")
            if func in _LISTS and kind in ("ArrayType", "MapType", "StructType"):
                raise JobDefinitionError(
                    f"window(...).agg(): {name}={func}({agg.column!r}) expected a column of a "
                    f"simple type (number, string, boolean, date, timestamp), found {dtype}")
            if agg.time_column is not None and \
                    type(fields[agg.time_column]).__name__ not in _TIMES:
                raise JobDefinitionError(
                    f"window(...).agg(): {name}={func}(..., {agg.time_column!r}) expected an "
                    f"event time column (timestamp, date or integer), found "
                    f"{fields[agg.time_column]}")
            state: tuple[tuple[str, str, DataType], ...]
            if func == "count":
                value_type: DataType = LongType()
                state = ((name, "add", LongType()),)
            elif func == "sum":
                value_type = LongType() if kind in _NUMERIC[:4] else DoubleType()
                state = ((name, "add", value_type),)
            elif func == "mean":
                value_type = DoubleType()
                state = ((f"{name}__sum", "add", DoubleType()),
                         (f"{name}__count", "add", LongType()))
            elif func in ("min", "max"):
                value_type = dtype  # type: ignore[assignment]
                state = ((name, func, value_type),)
            elif func in ("first", "last"):
                value_type = dtype  # type: ignore[assignment]
                state = ((name, f"{func}_value", value_type),
                         (f"{name}__ts", f"{func}_ts", fields[str(agg.time_column)]))
            else:
                element: DataType = DoubleType() if func == "percentile" or dtype is None \
                    else dtype
                state = ((name, _LISTS[func], ArrayType(element, False)),)
                value_type = {"count_distinct": LongType(), "approx_count_distinct": LongType(),
                              "percentile": DoubleType()}.get(
                    func, ArrayType(element, False))
            self.outputs.append(Output(name, agg, value_type, state))

    # -- recorded with the state (a reader rebuilds the spec from the checkpoint alone) -------
    def describe(self) -> dict[str, Any]:
        """The spec as JSON values: :meth:`from_description` rebuilds it."""
        from pyspark.sql.types import StructField, StructType

        # the input fields' names and types only: their metadata (column comments, Delta's
        # generation expressions) is no part of the spec and would change the record
        inputs = StructType([StructField(f.name, f.dataType, f.nullable) for f in self.inputs])
        return {"aggs": [[o.name, o.agg.func, o.agg.column, o.agg.time_column, o.agg.param]
                         for o in self.outputs],  # a list: records are written key-sorted
                "inputs": inputs.jsonValue(), "order_by": self.order_by,
                "reserved": self.reserved}

    @classmethod
    def from_description(cls, described: dict[str, Any]) -> WindowAggSpec:
        from pyspark.sql.types import StructType

        aggs = {name: Agg(func, column, time_column, param)
                for name, func, column, time_column, param in described["aggs"]}
        return cls(aggs, StructType.fromJson(described["inputs"]),
                   order_by=described["order_by"], reserved=described["reserved"])

    # -- Spark side -----------------------------------------------------------------------
    def partial_columns(self) -> list[Column]:
        """The batch's partial aggregates per (key, window), one column per state column."""
        from pyspark.sql import functions as F

        cols: list[Column] = []
        for o in self.outputs:
            a = o.agg
            func: str = a.func
            c = F.col(a.column) if a.column else F.lit(1)
            if func == "count":
                cols.append(F.count(c).alias(o.name))
            elif func == "sum":
                cols.append(F.sum(c).cast(o.value_type).alias(o.name))
            elif func == "mean":  # as Spark's avg: the values as doubles, then summed
                cols.append(F.sum(c.cast("double")).alias(f"{o.name}__sum"))
                cols.append(F.count(c).alias(f"{o.name}__count"))
            elif func in ("min", "max"):
                cols.append(getattr(F, func)(c).alias(o.name))
            elif func in ("first", "last"):  # a tie in time: the smaller / larger value
                by, pick = (F.min_by, F.min) if func == "first" else (F.max_by, F.max)
                ts = F.col(str(a.time_column))
                cols.append(by(c, F.struct(ts, c)).alias(o.name))
                cols.append(pick(ts).alias(f"{o.name}__ts"))
            elif func == "percentile":
                cols.append(F.array_sort(F.collect_list(c.cast("double"))).alias(o.name))
            elif _LISTS[func] == "union":
                cols.append(F.array_sort(F.collect_set(c)).alias(o.name))
            else:  # in event-time order (then value): the same list when a batch is replayed
                pairs = F.collect_list(F.when(c.isNotNull(), F.struct(
                    F.col(self.order_by).alias("t"), c.alias("v"))))
                cols.append(F.transform(F.array_sort(pairs), lambda x: x["v"]).alias(o.name))
        return cols

    def state_ddl(self) -> str:
        """The window state's columns as Spark DDL (the processor's state schema)."""
        return ", ".join(f"`{n}` {t.simpleString()}" for o in self.outputs
                         for n, _k, t in o.state)

    def state_names(self) -> list[str]:
        return [n for o in self.outputs for n, _k, _t in o.state]

    def merges(self) -> list[tuple[str, str, str | None]]:
        """(state column, merge kind, its time column for first/last) in state order."""
        out: list[tuple[str, str, str | None]] = []
        for o in self.outputs:
            for n, kind, _t in o.state:
                # first/last: the value and its time both merge by the time column
                out.append((n, kind, f"{o.name}__ts" if kind.startswith(("first", "last"))
                            else None))
        return out

    def final_columns(self) -> list[Column]:
        """The outputs from state columns: what the task emits, before Spark's own finals."""
        from pyspark.sql import functions as F

        cols: list[Column] = []
        for o in self.outputs:
            f = o.agg.func
            if f == "mean":
                cols.append(F.when(F.col(f"{o.name}__count") > 0,
                                   F.col(f"{o.name}__sum") / F.col(f"{o.name}__count"))
                            .alias(o.name))
            elif f == "count_distinct":
                cols.append(F.size(F.col(o.name)).cast("bigint").alias(o.name))
            else:
                cols.append(F.col(o.name))
        return cols

    def spark_finals(self, df: DataFrame, group: list[str]) -> DataFrame:
        """Spark's own ``approx_count_distinct`` and ``percentile`` over the emitted lists;
        ``group`` identifies an emitted row (its keys and window)."""
        from pyspark.sql import functions as F

        for o in self.outputs:
            if o.agg.func not in SPARK_FINALS:
                continue
            value = F.col("__value")
            final = F.approx_count_distinct(value, o.agg.param) \
                if o.agg.func == "approx_count_distinct" \
                else F.percentile(value, F.lit(o.agg.param))
            renamed = [f"__ckpt_g{i}" for i in range(len(group))]
            finals = df.select(*[F.col(g).alias(r) for g, r in zip(group, renamed, strict=True)],
                               F.explode_outer(o.name).alias("__value")) \
                .groupBy(*renamed).agg(final.alias("__ckpt_final"))
            cond = [F.col(g).eqNullSafe(F.col(r)) for g, r in zip(group, renamed, strict=True)]
            df = df.join(finals, cond, "left").select(
                *[F.col(c) if c != o.name else F.col("__ckpt_final").alias(o.name)
                  for c in df.columns])
        return df


# -- worker side ------------------------------------------------------------------------------
def merge_columns(merges: list[tuple[str, str, str | None]], old: pa.Table,
                  new: pa.Table) -> dict[str, pa.Array]:
    """Merge partials ``new`` into states ``old`` (aligned rows; a missing state is null)."""
    out: dict[str, pa.Array] = {}
    for name, kind, ts in merges:
        a, b = _flat(old.column(name)), _flat(new.column(name))
        if kind in ("union", "concat"):
            out[name] = _merge_lists(kind, a, b)
            continue
        target = b.type
        oa, na = to_internal(a.cast(target) if a.type != target else a), to_internal(b)
        pair = None
        if ts is not None:
            ta, tb = to_internal(_flat(old.column(ts))), to_internal(_flat(new.column(ts)))
            pair = (to_numpy(ta), to_numpy(tb))
        values, valid = merge(kind, to_numpy(oa), to_numpy(na), pair)
        out[name] = from_internal(_array(values, valid, oa.type), target)
    return out


def _flat(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _array(values: np.ndarray, valid: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    if values.dtype == object:
        return pa.array([v if ok else None for v, ok in zip(values, valid, strict=True)],
                        arrow_type)
    return pa.array(values, arrow_type, mask=~np.asarray(valid, dtype=bool))


def _merge_lists(kind: str, a: pa.Array, b: pa.Array) -> pa.Array:
    """Concatenate two list columns row by row (a union keeps each distinct value once, in
    order of first appearance; NaN is one value, as Spark's collect_set has it)."""
    rows = []
    for x, y in zip(a.to_pylist(), b.to_pylist(), strict=True):
        items = [*(x or []), *(y or [])]
        if kind == "union" and items:
            items = pc.unique(pa.array(items, b.type.value_type)).to_pylist()
        rows.append(items)
    return pa.array(rows, b.type)


def merge_scalars(merges: list[tuple[str, str, str | None]], rows: list[dict[str, Any]],
                  types: dict[str, pa.DataType]) -> dict[str, Any]:
    """Merge several states of one session (Python values) into one (in the same way)."""
    table = pa.Table.from_pylist([rows[0]], schema=pa.schema(
        [pa.field(n, types[n]) for n in rows[0]]))
    for row in rows[1:]:
        other = pa.Table.from_pylist([row], schema=table.schema)
        merged = merge_columns(merges, table, other)
        table = pa.table({n: merged.get(n, table.column(n)) for n in table.column_names})
    return table.to_pylist()[0]  # type: ignore[no-any-return]
