"""Split a vertex's aggregation into a partial step and a final step, as Spark's planner does.

Spark runs ``groupBy(keys).agg(...)`` as a partial aggregation before the shuffle and a final
one after it, and shuffles only the partial aggregates. spark_ckpt makes the same partial
aggregates durable, per wave of input splits, instead of the wide rows they came from: a job
killed mid-way keeps the partials of the waves that finished, and they are small.

A vertex function is split when it aggregates its input once (``groupBy(columns).agg``), over
plain grouping columns, with only projections and filters before the aggregation, and every
aggregate function has a partial form here. Whatever the function does with the aggregation's
result (an ``orderBy``, a ``select``, a ``where``, a window function, a second aggregation, a
join with a small table) runs after the final step as it is: the aggregation's node in the
function's plan is replaced by the merged partials (:meth:`AggSplit.result_frame`).

=========================  ==================================  ===========================
function                   partial (per wave)                  final (over the partials)
=========================  ==================================  ===========================
``count(...)``             ``count(...)``                      ``sum``
``sum(x)``                 ``sum(x)``, ``count(x)``            ``sum``, cast to sum's type;
                                                               null if a wave overflowed
``min(x)``, ``max(x)``     the same                            ``min``, ``max``
``avg(x)`` (not decimal)   ``sum(double(x))``, ``count(x)``    ``sum / count`` (null at 0)
``f(DISTINCT x)``          grouped by ``x`` too (Spark's       ``f(x)`` over one row per
(count, sum, avg, min,     first exchange of a distinct        group and ``x``
max)                       aggregate)
``collect_set(x)``         grouped by ``x`` too                ``collect_set(x)``
``percentile(x, p)``,      grouped by ``x`` too, with          ``percentile(x, p, n)``:
``median(x)``              ``count(x)`` as ``n``               exact, as Spark's
=========================  ==================================  ===========================

Distinct and holistic aggregates are split as Spark's plan splits a distinct aggregation: the
partials are grouped by the grouping columns and the aggregated column, one row per value a
wave saw, and the final step merges them per value, then per group. All of them in one
function must read the same columns (Spark's single distinct group).

Expressions over aggregates (``round(sum(x), 2)``, ``sum(a) / count(b)``) are evaluated after
the final step. Anything else (a ``FILTER`` or ``try_`` aggregate, ``collect_list``,
``approx_count_distinct`` and ``percentile_approx`` (their answer depends on how the rows were
split, Spark's own too), a grouping expression that is not a column, anything but
projections and filters before the aggregation, an input read again after it, a
non-deterministic expression) is not split: the planner then keeps the vertex whole and says
why. The split is checked before use: the final step must give the aggregation's columns with
its types.

Sums of doubles (``sum``, ``avg``) merge the waves' partial sums: the answer is Spark's up to
the order in which floating-point sums are added, which Spark's own answer also depends on
(how the input is split into tasks, the order shuffle blocks arrive). Every other result is
exactly Spark's.

The plan comes from :mod:`spark_ckpt.sparkapi` as plain data: a classic session's analysed
plan, or on Spark Connect the client's own plan tree, each aggregate written as SQL and typed by
the server (docs/connect.md). What a Connect client cannot write as SQL (a Python UDF or a window
function among the outputs, ``F.expr`` text with operators between aggregates) is refused,
naming it. The final step's select keeps the grouping columns beside the outputs: an output that
still aggregates (a function the seam did not know as an aggregate) fails analysis there, and
the split is refused, instead of aggregating the merged rows into one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from spark_ckpt.errors import NotSplittable
from spark_ckpt.sparkapi import Expr, PlanNode, empty_frame, frame_api

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = ["AggSplit", "NotSplittable", "SplitSet", "input_leaf", "split_aggregate"]

_PREFIX = "__sck_"


@dataclasses.dataclass(frozen=True)
class AggSplit:
    """The partial and final steps of one aggregation, as SQL over column names."""

    grouping: tuple[str, ...]
    partial: tuple[tuple[str, str], ...]  # (column, SQL over the aggregation's input)
    merge: tuple[tuple[str, str], ...]  # (column, SQL over the partial columns)
    outputs: tuple[tuple[str, str], ...]  # (output column, SQL over grouping + merged)
    # distinct and holistic aggregates: the partials are grouped by these columns too, and
    # merged per value with ``rollup`` (SQL over the partial columns) before ``merge``
    distinct: tuple[str, ...] = ()
    rollup: tuple[tuple[str, str], ...] = ()
    path: tuple[int, ...] = ()  # where the aggregation is in the function's analysed plan
    after: tuple[str, ...] = ()  # what the function runs after it (plan node names)

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "grouping": list(self.grouping), "partial": [list(p) for p in self.partial],
            "merge": [list(m) for m in self.merge], "outputs": [list(o) for o in self.outputs]}
        # (keys added only where used: a split recorded before them keeps its fingerprint)
        if self.distinct:
            out["distinct"] = list(self.distinct)
            out["rollup"] = [list(r) for r in self.rollup]
        if self.path:
            out["path"] = list(self.path)
        return out

    def partial_frame(self, aggregated: DataFrame) -> DataFrame:
        """The partial aggregates of ``aggregated`` (the function's result over some input):
        its aggregation's input, grouped by the same columns (and the distinct ones)."""

        source = _aggregate_input(aggregated, self.path)
        return _grouped(source, self.grouping + self.distinct, self.partial)

    def group_counts(self, aggregated: DataFrame) -> list[DataFrame]:
        """Rows per group of the partials (``__sck_rows`` beside the grouping and distinct
        columns): what :mod:`~spark_ckpt.batch.wave_groups` estimates a wave's groups from."""
        from pyspark.sql import functions as F

        source = _aggregate_input(aggregated, self.path)
        keys = [F.col(_quote(c)) for c in self.grouping + self.distinct]
        return [source.groupBy(*keys).agg(F.count(F.lit(1)).alias(f"{_PREFIX}rows"))]

    def final_frame(self, partials: DataFrame) -> DataFrame:
        """The aggregation's output from partial aggregates (of any number of waves)."""
        from pyspark.sql import functions as F

        if self.distinct:  # one row per group and value, as Spark's second step makes
            partials = _grouped(partials, self.grouping + self.distinct, self.rollup)
        merged = partials.groupBy(*[F.col(_quote(g)) for g in self.grouping]).agg(
            *[F.expr(sql).alias(name) for name, sql in self.merge])
        # the grouping columns beside the outputs, dropped after: an output that aggregates
        # fails analysis here rather than aggregate the merged rows
        keys = [f"{_PREFIX}key{i}" for i in range(len(self.grouping))]
        return merged.select(*[F.expr(sql).alias(name) for name, sql in self.outputs],
                             *[F.col(_quote(g)).alias(k) for g, k in zip(self.grouping, keys,
                                                                          strict=True)]) \
            .drop(*keys)

    def result_frame(self, whole: DataFrame, partials: DataFrame) -> DataFrame:
        """The function's output from partial aggregates: ``whole`` (the function over an
        input of the same schema) with its aggregation replaced by :meth:`final_frame`."""
        final = self.final_frame(partials)
        if not self.path:
            return final
        _check_aggregate_at(whole, self.path)
        replaced = frame_api(whole).replace_plan(whole, self.path, final)
        if replaced is None:
            raise NotSplittable("this session cannot replace the aggregation in its plan")
        return replaced

    def partial_fn(self, fn: Callable[..., DataFrame]) -> Callable[..., DataFrame]:
        def partial(*inputs: DataFrame) -> DataFrame:
            return self.partial_frame(fn(*inputs))
        return partial

    def final_fn(self, fn: Callable[..., DataFrame], schema: StructType,
                 main: int = 0) -> Callable[..., DataFrame]:
        """The consumer's function over partial aggregates: called with its inputs, the
        ``main`` one (which it aggregates) replaced by the partials; ``schema`` is the
        aggregated input's (the function is planned over no rows of it, then its aggregation
        replaced)."""
        def final(*inputs: DataFrame) -> DataFrame:
            partials = inputs[main]
            if not self.path:
                return self.final_frame(partials)
            leaf = input_leaf(partials.sparkSession, schema)
            whole = fn(*[leaf if i == main else df for i, df in enumerate(inputs)])
            return self.result_frame(whole, partials)
        return final


_PART = f"{_PREFIX}aggregation"  # which aggregation of a SplitSet a partial row belongs to


@dataclasses.dataclass(frozen=True)
class SplitSet:
    """The splits of a function that aggregates its input in several places (two
    aggregations of one input, joined): a wave's partials are every aggregation's, each row
    tagged with its aggregation's number, and the final step replaces each aggregation in the
    function's plan with its merged partials."""

    parts: tuple[AggSplit, ...]

    @property
    def grouping(self) -> tuple[str, ...]:
        """The grouping columns every aggregation has."""
        return tuple(c for c in self.parts[0].grouping
                     if all(c in p.grouping for p in self.parts[1:]))

    @property
    def distinct(self) -> tuple[str, ...]:
        return ()

    @property
    def after(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for p in self.parts for name in p.after))

    def describe(self) -> dict[str, object]:
        return {"aggregations": [p.describe() for p in self.parts]}

    def partial_frame(self, aggregated: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        frames = [p.partial_frame(aggregated).withColumn(_PART, F.lit(i))
                  for i, p in enumerate(self.parts)]
        out = frames[0]
        for frame in frames[1:]:
            out = out.unionByName(frame, allowMissingColumns=True)
        return out

    def partial_fn(self, fn: Callable[..., DataFrame]) -> Callable[..., DataFrame]:
        def partial(*inputs: DataFrame) -> DataFrame:
            return self.partial_frame(fn(*inputs))
        return partial

    def group_counts(self, aggregated: DataFrame) -> list[DataFrame]:
        return [frame for p in self.parts for frame in p.group_counts(aggregated)]

    def result_frame(self, whole: DataFrame, partials: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        for i, part in enumerate(self.parts):
            columns = [*part.grouping, *part.distinct, *(name for name, _ in part.partial)]
            mine = partials.where(F.col(_PART) == i).select(*[F.col(_quote(c)) for c in columns])
            whole = part.result_frame(whole, mine)
        return whole

    def final_fn(self, fn: Callable[..., DataFrame], schema: StructType,
                 main: int = 0) -> Callable[..., DataFrame]:
        def final(*inputs: DataFrame) -> DataFrame:
            leaf = input_leaf(inputs[main].sparkSession, schema)
            whole = fn(*[leaf if i == main else df for i, df in enumerate(inputs)])
            return self.result_frame(whole, inputs[main])
        return final


def _grouped(df: DataFrame, columns: tuple[str, ...],
             aggregates: tuple[tuple[str, str], ...]) -> DataFrame:
    from pyspark.sql import functions as F

    keys = [F.col(_quote(c)) for c in columns]
    if not aggregates:  # distinct aggregates alone: one row per group and value
        return df.select(*keys).distinct()
    return df.groupBy(*keys).agg(*[F.expr(sql).alias(name) for name, sql in aggregates])


def input_leaf(spark: SparkSession, schema: StructType) -> DataFrame:
    """The frame a consumer's function is planned over to find its aggregations: no rows, the
    input's columns, and a plan no other input of the function has (an empty broadcast input
    of the same column types must not be taken for it)."""
    from pyspark.sql import functions as F

    return empty_frame(spark, schema).where(F.lit(False))


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _check_aggregate_at(df: DataFrame, path: tuple[int, ...]) -> None:
    """The function over this input must have its aggregation where it had it over the leaf
    it was planned on: a function that builds another plan for other rows would otherwise
    have some other node's rows taken for the aggregation's input, or replaced."""
    root = frame_api(df).analyzed_plan(df)
    node = None if root is None else _node_at(root, path)
    if node is None or node.kind != "Aggregate":
        raise NotSplittable(
            f"its plan over this input has no aggregation where it had one over the input "
            f"it was planned on (at {list(path)}: found "
            f"{'nothing' if node is None else node.name})")


def _aggregate_input(df: DataFrame, path: tuple[int, ...]) -> DataFrame:
    if path:
        _check_aggregate_at(df, path)
    child = frame_api(df).plan_frame(df, (*path, 0))
    if child is None:
        raise NotSplittable("this session cannot show what the aggregation reads")
    return child


# What may run before the aggregation: row by row, so running it per wave of splits gives the
# rows running it per partition does (a distinct, a window, a limit or a join would not).
_ROW_BY_ROW = {"Project", "Filter", "SubqueryAlias", "ResolvedHint", "LocalRelation",
               "LogicalRelation", "LogicalRDD", "Range", "OneRowRelation"}


def _check_row_by_row(plan: PlanNode) -> None:
    stack = [plan]
    while stack:
        node = stack.pop()
        if node.marked:
            continue  # the input itself
        if node.kind not in _ROW_BY_ROW:
            raise NotSplittable(
                f"it runs a {node.name} before aggregating, which a wave of input splits "
                "would see differently from a partition (only projections and filters may)")
        stack.extend(node.children)
    if not plan.deterministic:
        raise NotSplittable("it is not deterministic before aggregating")


def _nodes(plan: PlanNode, path: tuple[int, ...] = ()) -> list[tuple[tuple[int, ...], PlanNode]]:
    out = [(path, plan)]
    for i, child in enumerate(plan.children):
        out.extend(_nodes(child, (*path, i)))
    return out


def _node_at(plan: PlanNode, path: tuple[int, ...]) -> PlanNode | None:
    for i in path:
        if i >= len(plan.children):
            return None
        plan = plan.children[i]
    return plan


def _at(plan: PlanNode, path: tuple[int, ...]) -> PlanNode:
    for i in path:
        plan = plan.children[i]
    return plan


def _locate(plan: PlanNode, marked: bool) -> list[tuple[int, ...]]:
    """Where the aggregations to split are: the innermost ``Aggregate`` above each read of
    the input (the ``marked`` nodes, when the function was planned over a leaf of its own;
    every read must be aggregated, each by an aggregation of its own)."""
    nodes = _nodes(plan)
    if marked:
        leaves = [path for path, node in nodes if node.marked]
        if not leaves:
            raise NotSplittable("its result does not read its input")
        found = []
        for leaf in leaves:
            on_path = [leaf[:i] for i in range(len(leaf))]
            inner = [p for p in on_path if _at(plan, p).kind == "Aggregate"]
            if not inner:
                if len(leaves) == 1:
                    break
                raise NotSplittable(
                    f"it reads its input {len(leaves)} times, once without aggregating it "
                    "(an aggregation split in waves must be the only reader of its input)")
            found.append(inner[-1])  # the innermost: Spark's first exchange
        if len(set(found)) != len(found):
            raise NotSplittable(f"it reads its input {len(leaves)} times in one aggregation")
        if found:
            return found
        aggregates: list[tuple[int, ...]] = []
    else:
        aggregates = [path for path, node in nodes if node.kind == "Aggregate"]
        inner = [p for p in aggregates
                 if not any(q != p and q[:len(p)] == p for q in aggregates)]
        if len(inner) > 1:
            raise NotSplittable(f"it aggregates in {len(inner)} places")
        aggregates = inner
    if not aggregates:
        raise NotSplittable(f"its result is a {plan.name} that does not aggregate its input "
                            "(no groupBy(...).agg(...))")
    return aggregates


def split_aggregate(df: DataFrame, leaf: DataFrame | None = None) -> AggSplit | SplitSet:
    """The partial and final steps of the aggregation in ``df``, or NotSplittable (why).
    ``df`` is best the function over ``leaf`` (an empty frame of its input's schema), so what
    runs before the aggregation is the function's own and the input is found as ``leaf``;
    without it, ``df`` must aggregate in one place. A function that aggregates its input in
    several places (two aggregations joined) gets a :class:`SplitSet`: every aggregation's
    partials, in one durable unit."""
    root = frame_api(df).analyzed_plan(df, mark=leaf)
    if root is None:
        raise NotSplittable("this session cannot show Spark's analysed plan (Spark Connect)")
    if any(node.subquery for _path, node in _nodes(root)):
        raise NotSplittable("it runs a subquery (a wave or the merged partials would give it "
                            "other rows than the whole input)")
    paths = _locate(root, leaf is not None)
    if len(paths) == 1:
        return _split_at(root, paths[0], "")
    return SplitSet(tuple(_split_at(root, path, f"a{i}_") for i, path in enumerate(paths)))


def _split_at(root: PlanNode, path: tuple[int, ...], prefix: str) -> AggSplit:
    """The split of the aggregation at ``path``; its partial and merged columns are named
    with ``prefix`` (one per aggregation of a SplitSet)."""
    plan = _at(root, path)
    _check_row_by_row(plan.children[0])
    if not plan.deterministic:
        raise NotSplittable("its aggregation is not deterministic")
    if not root.deterministic:
        raise NotSplittable("what it runs after aggregating is not deterministic")
    after = tuple(_at(root, path[:i]).name for i in range(len(path)))
    grouping = []
    for expr in plan.grouping:
        if expr.kind != "AttributeReference":
            raise NotSplittable(f"it groups by the expression {expr.sql}, not a column")
        grouping.append(expr.name)
    if not grouping:
        raise NotSplittable("it aggregates without grouping columns")
    if len(set(grouping)) != len(grouping):
        raise NotSplittable(f"its grouping columns {grouping} repeat a name")
    parts = _Parts(tuple(grouping), prefix)
    merged_of: dict[str, str] = {}  # an aggregate's SQL -> its merged column

    found: list[str] = []  # the aggregates of the output expression being visited

    def visit(expr: Expr) -> None:
        if expr.kind == "AggregateExpression":
            sql = expr.sql
            found.append(sql)
            if sql not in merged_of:
                merged_of[sql] = parts.split_one(expr, len(merged_of))
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
    names = [*grouping, *parts.distinct, *(name for name, _ in outputs)]
    if any(name.startswith(_PREFIX) for name in names):
        raise NotSplittable(f"a column name starts with {_PREFIX}, which the split uses")
    return AggSplit(tuple(grouping), tuple(parts.partial), tuple(parts.merge), tuple(outputs),
                    distinct=parts.distinct, rollup=tuple(parts.rollup), path=path,
                    after=after)


class _Parts:
    """The partial, rollup and merge columns of one aggregation, added aggregate by
    aggregate."""

    def __init__(self, grouping: tuple[str, ...], prefix: str) -> None:
        self.grouping = grouping
        self.prefix = _PREFIX + prefix
        self.partial: list[tuple[str, str]] = []
        self.rollup: list[tuple[str, str]] = []  # re-merges a partial per distinct value
        self.merge: list[tuple[str, str]] = []
        self.distinct: tuple[str, ...] = ()
        self.by_value = False  # some aggregate needs one row per group and value

    def _distinct_columns(self, agg: Expr, columns: list[Expr]) -> tuple[str, ...]:
        names = []
        for child in columns:
            if child.kind != "AttributeReference":
                raise NotSplittable(f"{agg.sql} aggregates the expression {child.sql}, not a "
                                    "column (a distinct or holistic aggregate must read "
                                    "columns)")
            names.append(child.name)
        wanted = tuple(dict.fromkeys(names))
        if self.by_value and set(wanted) != set(self.distinct):
            raise NotSplittable(f"{agg.sql} reads {list(wanted)}, another distinct or "
                                f"holistic aggregate reads {list(self.distinct)} (Spark "
                                "expands such an aggregation; only one set of columns is "
                                "split here)")
        if any(name in self.grouping for name in wanted):
            raise NotSplittable(f"{agg.sql} reads a grouping column")
        if not self.by_value:
            self.by_value, self.distinct = True, wanted
        return wanted

    def split_one(self, agg: Expr, number: int) -> str:
        """Add the partial and merge columns of one aggregate expression; return the merged
        one."""
        if agg.filtered:
            raise NotSplittable(f"{agg.sql} has a FILTER clause")
        fn = agg.function
        assert fn is not None
        kind = fn.kind
        if fn.pretty_name.startswith("try_"):
            raise NotSplittable(f"{agg.sql} is a try_ aggregate (its null on overflow would "
                                "be lost in a merge)")
        result_type = agg.data_type
        p = f"{self.prefix}p{number}"
        m = f"{self.prefix}m{number}"
        if agg.distinct and kind not in ("Min", "Max"):  # (a distinct min is the min)
            if kind not in ("Count", "Sum", "Average"):
                raise NotSplittable(f"{agg.sql} is a DISTINCT {fn.pretty_name}, which has no "
                                    "partial form here (count, sum, avg, min and max do)")
            columns = self._distinct_columns(agg, list(fn.children))
            function = {"Count": "count", "Sum": "sum", "Average": "avg"}[kind]
            args = ", ".join(_quote(c) for c in columns)
            # one row per group and value once rolled up: the function over those rows is the
            # function over the distinct values
            self.merge.append((m, f"CAST({function}({args}) AS {result_type})"))
            return m
        if kind == "CollectSet":
            (column,) = self._distinct_columns(agg, [fn.children[0]])
            self.merge.append((m, f"collect_set({_quote(column)})"))
            return m
        if kind == "Median":
            (column,) = self._distinct_columns(agg, [fn.children[0]])
            return self._percentile(column, "0.5", result_type, number)
        if kind == "Percentile":
            child, percentage, frequency = fn.children[:3]
            if frequency.sql != "1L" and frequency.sql != "1":
                raise NotSplittable(f"{agg.sql} has a frequency of its own")
            if percentage.kind != "Literal" and percentage.kind != "CreateArray":
                raise NotSplittable(f"{agg.sql}'s percentage is not a literal")
            if fn.pretty_name != "percentile":
                raise NotSplittable(f"{agg.sql} ({fn.pretty_name}) has no partial form here "
                                    "(percentile and median do)")
            (column,) = self._distinct_columns(agg, [child])
            return self._percentile(column, percentage.sql, result_type, number)
        if kind == "Sum":
            # A wave's sum is null with rows only when it overflowed (ANSI off): the total is
            # null then, as Spark's; otherwise the sum of the waves' sums.
            c = f"{self.prefix}c{number}"
            child = fn.children[0]
            self.partial.append((p, agg.sql))
            self.partial.append((c, f"count({child.sql})"))
            overflowed = f"max(CASE WHEN {_quote(p)} IS NULL AND {_quote(c)} > 0 THEN 1 " \
                         "ELSE 0 END) = 1"
            self.rollup.append((p, f"CASE WHEN {overflowed} THEN NULL ELSE sum({_quote(p)}) "
                                   "END"))
            self.rollup.append((c, f"sum({_quote(c)})"))
            self.merge.append((m, f"CAST(CASE WHEN {overflowed} THEN NULL ELSE "
                                  f"sum({_quote(p)}) END AS {result_type})"))
            return m
        if kind in ("Count", "Min", "Max"):
            self.partial.append((p, agg.sql))
            combine = {"Count": "sum", "Min": "min", "Max": "max"}[kind]
            self.rollup.append((p, f"{combine}({_quote(p)})"))
            self.merge.append((m, f"CAST({combine}({_quote(p)}) AS {result_type})"))
            return m
        if kind == "Average":
            child = fn.children[0]
            if child.data_type.startswith("DECIMAL") or result_type != "DOUBLE":
                raise NotSplittable(f"{agg.sql} averages a {child.data_type}; only "
                                    "non-decimal averages are split")
            c = f"{self.prefix}c{number}"
            self.partial.append((p, f"sum(CAST({child.sql} AS DOUBLE))"))
            self.partial.append((c, f"count({child.sql})"))
            self.rollup.append((p, f"sum({_quote(p)})"))
            self.rollup.append((c, f"sum({_quote(c)})"))
            self.merge.append((m, f"CASE WHEN sum({_quote(c)}) = 0 THEN CAST(NULL AS DOUBLE) "
                                  f"ELSE sum({_quote(p)}) / sum({_quote(c)}) END"))
            return m
        raise NotSplittable(f"{agg.sql} ({kind}) has no partial form here (count, sum, min, "
                            "max, avg, their DISTINCT forms, collect_set, percentile and "
                            "median do)")


    def _percentile(self, column: str, percentage: str, result_type: str, number: int) -> str:
        """An exact percentile over one row per value, weighted by how often it was seen."""
        c, m = f"{self.prefix}c{number}", f"{self.prefix}m{number}"
        self.partial.append((c, f"count({_quote(column)})"))
        self.rollup.append((c, f"sum({_quote(c)})"))
        self.merge.append((m, f"CAST(percentile({_quote(column)}, {percentage}, {_quote(c)}) "
                              f"AS {result_type})"))
        return m


def check_split(split: AggSplit | SplitSet, aggregated: DataFrame) -> DataFrame:
    """Refuse a split whose final step would not give the aggregation's columns and types
    (nor, with the function's steps after it, ``aggregated``'s), or whose steps do not
    analyse; return the partial step over ``aggregated``'s input (planned, not run)."""
    try:
        return _check_split(split, aggregated)
    except NotSplittable:
        raise
    except Exception as exc:  # a step Spark cannot analyse: refused, saying why
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise NotSplittable(f"its partial or final step does not analyse "
                            f"({type(exc).__name__}: {first})") from exc


def _check_split(split: AggSplit | SplitSet, aggregated: DataFrame) -> DataFrame:
    if isinstance(split, SplitSet):
        for part in split.parts:
            _check_split(part, aggregated)
        partials = split.partial_frame(aggregated)
        _same_columns(split.result_frame(aggregated, partials), aggregated)
        return partials
    partials = split.partial_frame(aggregated)
    final = split.final_frame(partials)
    node = frame_api(aggregated).plan_frame(aggregated, split.path) if split.path \
        else aggregated
    if node is None:
        raise NotSplittable("this session cannot show the aggregation")
    _same_columns(final, node)
    if split.path:
        _same_columns(split.result_frame(aggregated, partials), aggregated)
    return partials


def _same_columns(got_df: DataFrame, want_df: DataFrame) -> None:
    want = [(f.name, f.dataType.simpleString()) for f in want_df.schema.fields]
    got = [(f.name, f.dataType.simpleString()) for f in got_df.schema.fields]
    if want != got:
        raise NotSplittable(f"its split would give columns {got}, not {want}")
