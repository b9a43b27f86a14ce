"""Split a vertex's aggregation into a partial step and a final step, as Spark's planner does.

Spark runs ``groupBy(keys).agg(...)`` as a partial aggregation before the shuffle and a final
one after it, and shuffles only the partial aggregates. spark_ckpt makes the same partial
aggregates durable, per wave of input splits, instead of the wide rows they came from: a job
killed mid-way keeps the partials of the waves that finished, and they are small.

A vertex function is split when its result is one ``Aggregate`` (``groupBy(columns).agg``)
over plain grouping columns whose aggregate functions all have a partial form here:

=========================  ==================================  ===========================
function                   partial (per wave)                  final (over the partials)
=========================  ==================================  ===========================
``count(...)``             ``count(...)``                      ``sum``
``sum(x)``                 ``sum(x)``, ``count(x)``            ``sum``, cast to sum's type;
                                                               null if a wave overflowed
``min(x)``, ``max(x)``     the same                            ``min``, ``max``
``avg(x)`` (not decimal)   ``sum(double(x))``, ``count(x)``    ``sum / count`` (null at 0)
=========================  ==================================  ===========================

Expressions over them (``round(sum(x), 2)``, ``sum(a) / count(b)``) are evaluated after the
final step. Anything else (a ``DISTINCT``, ``FILTER`` or ``try_`` aggregate, ``collect_list``,
percentiles, a grouping expression that is not a column, a ``HAVING``, a ``select`` after the
aggregation, anything but projections and filters before it, a non-deterministic
expression) is not split: the planner then keeps the vertex whole and says why. The split is
checked before use: the final step must give the function's output columns with its types.

The plan comes from :mod:`spark_ckpt.sparkapi` as plain data. A Spark Connect session does not
show it: there aggregations are kept whole (docs/connect.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from spark_ckpt.errors import NotSplittable
from spark_ckpt.sparkapi import Expr, PlanNode, frame_api, walk

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["AggSplit", "NotSplittable", "split_aggregate"]

_PREFIX = "__sck_"


@dataclasses.dataclass(frozen=True)
class AggSplit:
    """The partial and final steps of one aggregation, as SQL over column names."""

    grouping: tuple[str, ...]
    partial: tuple[tuple[str, str], ...]  # (column, SQL over the aggregation's input)
    merge: tuple[tuple[str, str], ...]  # (column, SQL over the partial columns)
    outputs: tuple[tuple[str, str], ...]  # (output column, SQL over grouping + merged)

    def describe(self) -> dict[str, object]:
        return {"grouping": list(self.grouping), "partial": [list(p) for p in self.partial],
                "merge": [list(m) for m in self.merge],
                "outputs": [list(o) for o in self.outputs]}

    def partial_frame(self, aggregated: DataFrame) -> DataFrame:
        """The partial aggregates of ``aggregated`` (the function's result over some input):
        its aggregation's input, grouped by the same columns."""
        from pyspark.sql import functions as F

        source = _aggregate_input(aggregated)
        return source.groupBy(*[F.col(_quote(g)) for g in self.grouping]).agg(
            *[F.expr(sql).alias(name) for name, sql in self.partial])

    def final_frame(self, partials: DataFrame) -> DataFrame:
        """The function's output from partial aggregates (of any number of waves)."""
        from pyspark.sql import functions as F

        merged = partials.groupBy(*[F.col(_quote(g)) for g in self.grouping]).agg(
            *[F.expr(sql).alias(name) for name, sql in self.merge])
        return merged.select(*[F.expr(sql).alias(name) for name, sql in self.outputs])

    def partial_fn(self, fn: Callable[..., DataFrame]) -> Callable[..., DataFrame]:
        def partial(*inputs: DataFrame) -> DataFrame:
            return self.partial_frame(fn(*inputs))
        return partial


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _aggregate_plan(df: DataFrame) -> PlanNode:
    plan = frame_api(df).analyzed_plan(df)
    if plan is None:
        raise NotSplittable("this session cannot show Spark's analysed plan (Spark Connect)")
    if plan.kind != "Aggregate":
        raise NotSplittable(
            f"its result is a {plan.name}, not a groupBy(...).agg(...) (a select, "
            "filter or join after the aggregation keeps the aggregation whole)")
    return plan


def _aggregate_input(df: DataFrame) -> DataFrame:
    _aggregate_plan(df)
    child = frame_api(df).plan_child_frame(df)
    if child is None:
        raise NotSplittable("this session cannot show what the aggregation reads")
    return child


# What may run before the aggregation: row by row, so running it per wave of splits gives the
# rows running it per partition does (a distinct, a window, a limit or a join would not).
_ROW_BY_ROW = {"Project", "Filter", "SubqueryAlias", "ResolvedHint", "LocalRelation",
               "LogicalRelation", "LogicalRDD", "Range", "OneRowRelation"}


def _check_row_by_row(plan: PlanNode) -> None:
    for node in walk(plan):
        if node.kind not in _ROW_BY_ROW:
            raise NotSplittable(
                f"it runs a {node.name} before aggregating, which a wave of input splits "
                "would see differently from a partition (only projections and filters may)")
    if not plan.deterministic:
        raise NotSplittable("it is not deterministic before aggregating")


def split_aggregate(df: DataFrame) -> AggSplit:
    """The partial and final steps of the aggregation ``df`` is, or NotSplittable (why).
    ``df`` is best the function over a leaf (an empty frame of its input's schema), so what
    runs before the aggregation is the function's own."""
    plan = _aggregate_plan(df)
    _check_row_by_row(plan.children[0])
    if not plan.deterministic:
        raise NotSplittable("its aggregation is not deterministic")
    grouping = []
    for expr in plan.grouping:
        if expr.kind != "AttributeReference":
            raise NotSplittable(f"it groups by the expression {expr.sql}, not a column")
        grouping.append(expr.name)
    if not grouping:
        raise NotSplittable("it aggregates without grouping columns")
    if len(set(grouping)) != len(grouping):
        raise NotSplittable(f"its grouping columns {grouping} repeat a name")
    partial: list[tuple[str, str]] = []
    merge: list[tuple[str, str]] = []
    merged_of: dict[str, str] = {}  # an aggregate's SQL -> its merged column

    found: list[str] = []  # the aggregates of the output expression being visited

    def visit(expr: Expr) -> None:
        if expr.kind == "AggregateExpression":
            sql = expr.sql
            found.append(sql)
            if sql not in merged_of:
                merged_of[sql] = _split_one(expr, len(merged_of), partial, merge)
            return
        for child in expr.children:
            visit(child)

    outputs_raw: list[tuple[str, str, bool]] = []
    for named in plan.aggregates:
        if named.kind == "AttributeReference":
            if named.name not in grouping:
                raise NotSplittable(f"its output column {named.name} is not a grouping column")
            outputs_raw.append((named.name, _quote(named.name), False))
            continue
        if named.kind != "Alias":
            raise NotSplittable(f"its output {named.sql} is not a named expression")
        found.clear()
        visit(named.children[0])
        text = named.children[0].sql
        for sql in set(found):
            # each aggregate's text is replaced by its merged column: it must appear exactly
            # where the aggregates are (not in a literal, not inside another name)
            if text.count(sql) != found.count(sql) or any(
                    other != sql and sql in other for other in found):
                raise NotSplittable(f"its output {named.name} = {text} cannot be rewritten "
                                    f"over merged partials ({sql} appears elsewhere in it)")
        outputs_raw.append((named.name, text, True))
    outputs = []
    replacements = sorted(merged_of.items(), key=lambda kv: -len(kv[0]))
    for name, sql, has_aggregates in outputs_raw:
        if has_aggregates:
            for text, column in replacements:
                sql = sql.replace(text, _quote(column))
        outputs.append((name, sql))
    if any(name.startswith(_PREFIX) for name in grouping) or \
            any(name.startswith(_PREFIX) for name, _ in outputs):
        raise NotSplittable(f"a column name starts with {_PREFIX}, which the split uses")
    return AggSplit(tuple(grouping), tuple(partial), tuple(merge), tuple(outputs))


def _split_one(agg: Expr, number: int, partial: list[tuple[str, str]],
               merge: list[tuple[str, str]]) -> str:
    """Add the partial and merge columns of one aggregate expression; return the merged one."""
    if agg.distinct:
        raise NotSplittable(f"{agg.sql} is a DISTINCT aggregate")
    if agg.filtered:
        raise NotSplittable(f"{agg.sql} has a FILTER clause")
    fn = agg.function
    assert fn is not None
    kind = fn.kind
    if fn.pretty_name.startswith("try_"):
        raise NotSplittable(f"{agg.sql} is a try_ aggregate (its null on overflow would be "
                            "lost in a merge)")
    result_type = agg.data_type
    p = f"{_PREFIX}p{number}"
    m = f"{_PREFIX}m{number}"
    if kind == "Sum":
        # A wave's sum is null with rows only when it overflowed (ANSI off): the total is
        # null then, as Spark's; otherwise the sum of the waves' sums.
        c = f"{_PREFIX}c{number}"
        child = fn.children[0]
        partial.append((p, agg.sql))
        partial.append((c, f"count({child.sql})"))
        merge.append((m, f"CAST(CASE WHEN max(CASE WHEN {_quote(p)} IS NULL AND {_quote(c)} > 0 "
                         f"THEN 1 ELSE 0 END) = 1 THEN NULL ELSE sum({_quote(p)}) END "
                         f"AS {result_type})"))
        return m
    if kind in ("Count", "Min", "Max"):
        partial.append((p, agg.sql))
        combine = {"Count": "sum", "Min": "min", "Max": "max"}[kind]
        merge.append((m, f"CAST({combine}({_quote(p)}) AS {result_type})"))
        return m
    if kind == "Average":
        child = fn.children[0]
        if child.data_type.startswith("DECIMAL") or result_type != "DOUBLE":
            raise NotSplittable(f"{agg.sql} averages a {child.data_type}; only "
                                "non-decimal averages are split")
        c = f"{_PREFIX}c{number}"
        partial.append((p, f"sum(CAST({child.sql} AS DOUBLE))"))
        partial.append((c, f"count({child.sql})"))
        merge.append((m, f"CASE WHEN sum({_quote(c)}) = 0 THEN CAST(NULL AS DOUBLE) "
                         f"ELSE sum({_quote(p)}) / sum({_quote(c)}) END"))
        return m
    raise NotSplittable(f"{agg.sql} ({kind}) has no partial form here (count, sum, min, max "
                        "and avg do)")


def check_split(split: AggSplit, aggregated: DataFrame) -> DataFrame:
    """Refuse a split whose final step would not give ``aggregated``'s columns and types;
    return the partial step over ``aggregated``'s input (planned, not run)."""
    partials = split.partial_frame(aggregated)
    final = split.final_frame(partials)
    want = [(f.name, f.dataType.simpleString()) for f in aggregated.schema.fields]
    got = [(f.name, f.dataType.simpleString()) for f in final.schema.fields]
    if want != got:
        raise NotSplittable(f"its split would give columns {got}, not {want}")
    return partials
