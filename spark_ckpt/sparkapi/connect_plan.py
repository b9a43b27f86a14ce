"""A Spark Connect DataFrame's plan as plain data, read from the client's own plan tree.

:mod:`spark_ckpt.batch.aggsplit` reads a classic session's analysed plan. A Connect client has
none: it holds the plan it sends, unresolved, as plan nodes (``pyspark.sql.connect.plan``) over
expressions (``pyspark.sql.connect.expressions``) that name columns and functions. This module
maps that tree to :class:`PlanNode` and :class:`Expr` with the analysed plan's names (an
``Aggregate``, a ``Project``, a ``Window`` for a projection with a window function, a
``LogicalRelation`` for a read...; a rollup, cube, pivot or grouping sets is an ``Aggregate``
whose grouping is no column), and asks the server, once per aggregation, what the client
cannot know: one schema of a probe frame (the aggregation's input grouped as it is, aggregated
by the aggregation's own columns and by each aggregate written as SQL) gives the output
columns' names and every aggregate's result type, and checks that each SQL text analyses to the
type of the expression it was written from.

Each expression an aggregation outputs is written as SQL text the server parses back to the same
expression: column references backquoted, literals typed, operators parenthesised. What cannot
be written so (a Python UDF, a window function, a metadata column, SQL text of ``F.expr`` with
operators between aggregates, which is kept verbatim but not taken apart) becomes an aggregate
whose function names why: the split refuses it, saying so. ``F.expr`` text that is one function
call (``max(DISTINCT s)``, ``try_sum(x)``, ``percentile(x, 0.5)``) is taken apart, its pieces
kept verbatim.

Which functions aggregate is known here by name (:data:`AGGREGATES`, Spark's aggregate
functions); a function that aggregates without being listed (a UDAF registered by name) is left
in the split's final step, whose select then fails analysis (it keeps the grouping columns beside
the outputs): the split is refused, never wrong.

The tree is rebuilt here too: :func:`frame_at` (a node as a DataFrame) and :func:`replaced` (a
node replaced by another DataFrame's plan, under the replaced node's plan id, so columns taken
from the DataFrame the node was, ``agg["k"]``, still resolve above it).
"""
# ruff: noqa: SLF001 - reading the Connect client's plan tree is this module's purpose

from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.sparkapi.types import Expr, PlanNode

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["AGGREGATES", "analyzed_plan", "frame_at", "plan_children", "replaced", "sql_type"]

log = logging.getLogger(__name__)

# Spark's aggregate functions by name (FunctionRegistry's "agg_funcs", Spark 4.x)
AGGREGATES = frozenset({
    "any", "any_value", "approx_count_distinct", "approx_percentile", "approx_top_k",
    "approx_top_k_accumulate", "approx_top_k_combine", "array_agg", "avg", "bit_and", "bit_or",
    "bit_xor", "bitmap_and_agg", "bitmap_construct_agg", "bitmap_or_agg", "bool_and", "bool_or",
    "collect_list", "collect_set", "collect_union", "corr", "count", "count_if",
    "count_min_sketch", "covar_pop", "covar_samp", "every", "first", "first_value", "grouping",
    "grouping_id",
    "histogram_numeric", "hll_sketch_agg", "hll_union_agg", "kll_merge_agg_bigint",
    "kll_merge_agg_double", "kll_merge_agg_float", "kll_sketch_agg_bigint",
    "kll_sketch_agg_double", "kll_sketch_agg_float", "kurtosis", "last", "last_value",
    "listagg", "max", "max_by", "mean", "measure", "median", "min", "min_by", "mode",
    "percentile", "percentile_approx", "percentile_cont", "percentile_disc", "product",
    "regr_avgx", "regr_avgy", "regr_count", "regr_intercept", "regr_r2", "regr_slope",
    "regr_sxx", "regr_sxy", "regr_syy", "skewness", "some", "std", "stddev", "stddev_pop",
    "stddev_samp", "string_agg", "sum", "theta_intersection_agg", "theta_sketch_agg",
    "theta_union_agg", "try_avg", "try_sum", "tuple_intersection_agg_double",
    "tuple_intersection_agg_integer", "tuple_sketch_agg_double", "tuple_sketch_agg_integer",
    "tuple_union_agg_double", "tuple_union_agg_integer", "var_pop", "var_samp", "variance",
})
# the analysed plan's class of the aggregates the split has a partial form of
KINDS = {"count": "Count", "sum": "Sum", "avg": "Average", "mean": "Average", "min": "Min",
         "max": "Max", "collect_set": "CollectSet", "percentile": "Percentile",
         "median": "Median"}
# functions whose value is not the same from one evaluation to the next
NONDETERMINISTIC = frozenset({
    "input_file_block_length", "input_file_block_start", "input_file_name", "java_method",
    "monotonically_increasing_id", "rand", "randn", "random", "randstr", "reflect", "shuffle",
    "spark_partition_id", "try_reflect", "uniform", "uuid", "distributed_sequence_id"})
# functions that make rows of a row (a projection with one is a Generate)
GENERATORS = frozenset({"explode", "explode_outer", "inline", "inline_outer", "json_tuple",
                        "posexplode", "posexplode_outer", "stack", "variant_explode",
                        "variant_explode_outer"})
_JOIN_HINTS = frozenset({"broadcast", "broadcastjoin", "mapjoin", "merge", "shuffle_merge",
                         "mergejoin", "shuffle_hash", "shuffle_replicate_nl"})
# operators written between their operands (the Connect client names them so)
_INFIX = {"+": "+", "-": "-", "*": "*", "/": "/", "%": "%", "&": "&", "|": "|", "^": "^",
          "<": "<", ">": ">", "<=": "<=", ">=": ">=", "=": "=", "==": "=", "!=": "!=",
          "<>": "<>", "<=>": "<=>", "and": "AND", "or": "OR", "||": "||", "div": "DIV"}
# one unquoted word of SQL text that is no column
_NOT_COLUMNS = frozenset({"true", "false", "null", "current_date", "current_timestamp",
                          "current_time", "current_user", "user", "session_user",
                          "current_catalog", "current_database", "current_schema",
                          "localtimestamp", "current_path"})
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PROBE = "__sck_probe_"
_UNWRITABLE = ", which a Spark Connect client cannot write as SQL"
_AROUND = "SQL text with operators around its aggregates (taken apart only when it is one call)"


class _Unwritable(Exception):
    """Why an expression cannot be written as SQL text the server parses back to it."""


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def name_parts(identifier: str) -> list[str]:
    """The parts of a column name as Spark parses one: dots between parts, a backquoted part
    may hold dots (and a doubled backquote for one)."""
    parts: list[str] = []
    current: list[str] = []
    i, n = 0, len(identifier)
    while i < n:
        c = identifier[i]
        if c == "`":
            i += 1
            while True:
                if i >= n:
                    raise _Unwritable(f"the column name {identifier!r} (an open backquote)")
                if identifier[i] == "`":
                    if identifier[i + 1:i + 2] == "`":
                        current.append("`")
                        i += 2
                        continue
                    i += 1
                    break
                current.append(identifier[i])
                i += 1
        elif c == ".":
            parts.append("".join(current))
            current = []
            i += 1
        else:
            current.append(c)
            i += 1
    parts.append("".join(current))
    return parts


def sql_type(data_type: Any) -> str:
    """A type as the analysed plan writes it in SQL (``BIGINT``, ``DECIMAL(22,2)``,
    ``ARRAY<STRING>``, ``STRUCT<`a`: INT>``)."""
    from pyspark.sql import types as T

    if isinstance(data_type, T.ArrayType):
        return f"ARRAY<{sql_type(data_type.elementType)}>"
    if isinstance(data_type, T.MapType):
        return f"MAP<{sql_type(data_type.keyType)}, {sql_type(data_type.valueType)}>"
    if isinstance(data_type, T.StructType):
        fields = ", ".join(f"{quote(f.name)}: {sql_type(f.dataType)}" for f in data_type.fields)
        return f"STRUCT<{fields}>"
    return str(data_type.simpleString()).upper()


def literal_sql(value: Any, data_type: Any) -> str:
    """A Connect literal (the client's value and type) as SQL text of that value and type."""
    from pyspark.sql import types as T

    if value is None:
        return "NULL" if isinstance(data_type, T.NullType) else \
            f"CAST(NULL AS {sql_type(data_type)})"
    if isinstance(data_type, T.BooleanType):
        return "true" if value else "false"
    suffixes = ((T.ByteType, "Y"), (T.ShortType, "S"), (T.IntegerType, ""), (T.LongType, "L"))
    for cls, suffix in suffixes:
        if isinstance(data_type, cls):
            integer = int(value)
            return f"{integer}{suffix}" if integer >= 0 else \
                f"CAST({integer} AS {sql_type(data_type)})"
    if isinstance(data_type, (T.FloatType, T.DoubleType)):
        number = float(value)
        text = "NaN" if math.isnan(number) else "Infinity" if number == math.inf else \
            "-Infinity" if number == -math.inf else repr(number)
        if isinstance(data_type, T.DoubleType) and math.isfinite(number) and number >= 0:
            return f"{text}D"
        return f"CAST('{text}' AS {sql_type(data_type)})"
    if isinstance(data_type, T.DecimalType):
        # the server types a decimal literal by its digits, as a BD literal is typed
        return f"{value}BD" if value >= 0 else f"(- {-value}BD)"
    if isinstance(data_type, T.StringType):
        text = str(value)
        if "\\" in text or "'" in text or "${" in text:  # escapes and variable substitution
            return f"CAST(X'{text.encode().hex()}' AS STRING)"
        return f"'{text}'"
    if isinstance(data_type, T.BinaryType):
        return f"X'{bytes(value).hex()}'"
    if isinstance(data_type, T.DateType):
        return f"DATE '{datetime.date(1970, 1, 1) + datetime.timedelta(days=int(value))}'"
    if isinstance(data_type, T.TimestampNTZType):
        moment = datetime.datetime(1970, 1, 1) + datetime.timedelta(microseconds=int(value))
        return f"TIMESTAMP_NTZ '{moment:%Y-%m-%d %H:%M:%S.%f}'"
    if isinstance(data_type, T.TimestampType):
        return f"timestamp_micros(CAST({int(value)} AS BIGINT))"
    if isinstance(data_type, T.ArrayType):
        if not value:
            return f"CAST(array() AS {sql_type(data_type)})"
        return f"array({', '.join(literal_sql(v, data_type.elementType) for v in value)})"
    raise _Unwritable(f"a {data_type.simpleString()} literal")


# -- SQL text (F.expr, where(str), selectExpr) --------------------------------------------------
_TOKEN = re.compile(r"""\s+|(?P<token>
    `(?:[^`]|``)*`                              # a backquoted name
  | [rRxX]?'(?:[^'\\]|\\.)*' | [rRxX]?"(?:[^"\\]|\\.)*"   # a string (raw, hex)
  | (?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[A-Za-z]*  # a number
  | [A-Za-z_][A-Za-z0-9_]*                      # a word
  | [(),.\[\]]
  | [^\sA-Za-z0-9_`'"(),.\[\]]+                 # an operator
)""", re.VERBOSE)

_Token = tuple[str, int, int]  # text, start, end


def sql_tokens(text: str) -> list[_Token] | None:
    """The tokens of SQL text; None when it has a comment or a token this reader does not
    know (an unclosed string)."""
    tokens: list[_Token] = []
    at = 0
    while at < len(text):
        found = _TOKEN.match(text, at)
        if not found:
            return None
        if found.group("token"):
            token = found.group("token")
            if "--" in token or "/*" in token:
                return None
            tokens.append((token, found.start(), found.end()))
        at = found.end()
    return tokens


def _is_word(token: str) -> bool:
    return bool(_WORD.match(token))


def _is_name(token: str) -> bool:
    return _is_word(token) or token.startswith("`")


def _called(tokens: Sequence[_Token]) -> set[str]:
    """The names of the functions SQL text calls (lower case)."""
    names = set()
    for (token, _, _), following in zip(tokens, tokens[1:], strict=False):
        if following[0] == "(" and _is_name(token):
            names.add(name_parts(token)[0].lower() if token.startswith("`") else token.lower())
    return names


@dataclasses.dataclass
class _Facts:
    """What a node's expressions do: a window function, an aggregate outside one, a generator,
    a function with a different value each time."""

    window: bool = False
    aggregate: bool = False
    generator: bool = False
    nondeterministic: bool = False

    def add_text(self, text: str) -> None:
        tokens = sql_tokens(text)
        if tokens is None:
            self.nondeterministic = True  # unread: assume the worst
            return
        called = _called(tokens)
        if any(t[0].lower() == "over" for t in tokens):
            self.window = True
        elif called & AGGREGATES:
            self.aggregate = True
        self.generator |= bool(called & GENERATORS)
        self.nondeterministic |= bool(called & NONDETERMINISTIC)


def _expressions_facts(expressions: Sequence[Any]) -> _Facts:
    from pyspark.sql.connect import expressions as E

    facts = _Facts()

    def visit(e: Any, in_window: bool) -> None:
        if isinstance(e, E.WindowExpression):
            facts.window = in_window = True
        elif isinstance(e, (E.UnresolvedFunction, E.CallFunction)):
            name = e._name.lower()
            facts.aggregate |= name in AGGREGATES and not in_window
            facts.generator |= name in GENERATORS
            facts.nondeterministic |= name in NONDETERMINISTIC
        elif isinstance(e, E.CommonInlineUserDefinedFunction):
            facts.nondeterministic |= not e._deterministic
            facts.aggregate |= _udf_aggregates(e) and not in_window
        elif isinstance(e, E.SQLExpression):
            facts.add_text(e._expr)
        elif isinstance(e, E.DistributedSequenceID):
            facts.nondeterministic = True
        for child in e.children:
            visit(child, in_window)

    for expression in expressions:
        visit(expression, False)
    return facts


def _udf_aggregates(e: Any) -> bool:
    """A UDF that aggregates (a grouped-aggregate pandas or Arrow UDF, a Java UDAF)."""
    from pyspark.util import PythonEvalType

    function = e._function
    if getattr(function, "_aggregate", False):
        return True
    grouped = {v for k, v in vars(PythonEvalType).items() if "GROUPED_AGG" in k}
    return getattr(function, "_eval_type", None) in grouped


# -- the plan tree -------------------------------------------------------------------------------
def plan_children(node: Any) -> list[Any]:
    """A plan node's children, in the order of the analysed plan's (a join's left, then its
    right; a set operation's two sides)."""
    from pyspark.sql.connect.plan import LogicalPlan

    right = getattr(node, "right", None)
    if isinstance(right, LogicalPlan):
        return [node._child, right]
    other = getattr(node, "other", None)
    if isinstance(other, LogicalPlan):
        return [node._child, other]
    return [node._child] if node._child is not None else []


def _node_expressions(node: Any) -> list[Any]:
    """The Connect expressions a plan node holds (its columns, condition, keys, ...)."""
    from pyspark.sql.connect.expressions import Expression

    found: list[Any] = []

    def add(value: Any, depth: int) -> None:
        if isinstance(value, Expression):
            found.append(value)
        elif isinstance(getattr(value, "_expr", None), Expression):
            found.append(value._expr)
        elif isinstance(value, (list, tuple)) and depth < 2:
            for item in value:
                add(item, depth + 1)

    for key, value in vars(node).items():
        if key not in ("_child", "left", "right", "other", "_references"):
            add(value, 0)
    return found


_ROW_BY_ROW_CLASSES = {"Project", "WithColumns", "ToDF", "WithColumnsRenamed", "Drop", "ToSchema"}
_NAMES = {"Filter": "Filter", "Sort": "Sort", "Join": "Join", "SubqueryAlias": "SubqueryAlias",
          "Range": "Range", "LocalRelation": "LocalRelation",
          "ChunkedCachedLocalRelation": "LocalRelation", "Read": "LogicalRelation",
          "DataSource": "LogicalRelation", "CachedRemoteRelation": "LogicalRDD",
          "Limit": "GlobalLimit"}


def _kind(node: Any, facts: _Facts) -> str:
    """The analysed plan's class name for a Connect plan node."""
    cls = type(node).__name__
    if cls == "Aggregate":
        return "Aggregate"  # a rollup, cube, pivot too: its grouping is then no column
    if cls in _ROW_BY_ROW_CLASSES:
        if facts.window:
            return "Window"
        if facts.generator:
            return "Generate"
        if facts.aggregate and cls in ("Project", "WithColumns"):
            return "Aggregate"  # select(sum(x)): an aggregation without grouping
        return "Project"
    if cls == "Hint":
        return "ResolvedHint" if str(node._name).lower() in _JOIN_HINTS else "UnresolvedHint"
    if cls == "SetOperation":
        return {"union": "Union", "intersect": "Intersect", "except": "Except"}.get(
            node.set_op, "SetOperation")
    if cls == "Deduplicate" and node.within_watermark:
        return "DeduplicateWithinWatermark"
    return _NAMES.get(cls, cls)


def analyzed_plan(df: DataFrame, mark: DataFrame | None = None) -> PlanNode:
    """``df``'s plan as the analysed plan's plain data (see the module's docstring); nodes that
    are ``mark``'s own plan (the same object) are ``marked``."""
    session = df.sparkSession
    mark_plan = getattr(mark, "_plan", None)

    def build(node: Any) -> PlanNode:
        children = tuple(build(child) for child in plan_children(node))
        facts = _expressions_facts(_node_expressions(node))
        if type(node).__name__ == "SQL":
            facts.add_text(str(node._query))
        kind = _kind(node, facts)
        grouping: tuple[Expr, ...] = ()
        aggregates: tuple[Expr, ...] = ()
        if kind == "Aggregate" and type(node).__name__ == "Aggregate":
            grouping, aggregates = _aggregation(node, session)
        return PlanNode(kind=kind, name=kind,
                        deterministic=not facts.nondeterministic
                        and all(c.deterministic for c in children),
                        children=children, grouping=grouping, aggregates=aggregates,
                        marked=mark_plan is not None and node is mark_plan,
                        # a subquery's plan is held as a reference of the node that uses it
                        subquery=bool(getattr(node, "_references", None)))

    return build(df._plan)  # type: ignore[attr-defined]


def node_at(plan: Any, path: Sequence[int]) -> Any:
    for index in path:
        plan = plan_children(plan)[index]
    return plan


def _frame(plan: Any, session: Any) -> DataFrame:
    from pyspark.sql.connect.dataframe import DataFrame as ConnectDataFrame

    return ConnectDataFrame(plan, session)  # type: ignore[return-value]


def frame_at(df: DataFrame, path: Sequence[int]) -> DataFrame:
    """The node of ``df``'s plan at ``path`` as a DataFrame of ``df``'s session."""
    return _frame(node_at(df._plan, path), df.sparkSession)  # type: ignore[attr-defined]


def replaced(df: DataFrame, path: Sequence[int], replacement: DataFrame) -> DataFrame:
    """``df`` with the node at ``path`` replaced by ``replacement``'s plan. The nodes on the way
    are shallow copies (``df`` itself is untouched); the replacement is read through a
    projection of all its columns that has the replaced node's plan id, so a column taken from
    the DataFrame the node was (``agg["k"]``, resolved by plan id) resolves to it."""
    from pyspark.sql.connect.column import Column
    from pyspark.sql.connect.expressions import UnresolvedStar
    from pyspark.sql.connect.plan import Project

    root = df._plan  # type: ignore[attr-defined]
    old = node_at(root, path)
    plan: Any = replacement._plan  # type: ignore[attr-defined]
    new = Project(plan, [Column(UnresolvedStar(None))])
    new._root_plan_id = old._plan_id
    new._plan_id_with_rel = None

    def rebuild(node: Any, rest: Sequence[int]) -> Any:
        if not rest:
            return new
        children = plan_children(node)
        child = rebuild(children[rest[0]], rest[1:])
        copied = copy.copy(node)
        if rest[0] == 0:
            copied._child = child
            if hasattr(copied, "left"):
                copied.left = child
        elif hasattr(copied, "right") and copied.right is children[1]:
            copied.right = child
        else:
            copied.other = child
        return copied

    return _frame(rebuild(root, tuple(path)), df.sparkSession)


# -- expressions as SQL --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Piece:
    """A piece of SQL text: a function call taken apart, or a leaf (kept verbatim)."""

    kind: str  # "call", "column", "qualified", "literal", "star", "opaque"
    text: str
    name: str = ""  # a call's function (lower case), a column's name
    distinct: bool = False
    filtered: bool = False
    args: tuple[_Piece, ...] = ()
    aggregates: bool = False  # opaque text that calls an aggregate function


def _matching(tokens: Sequence[_Token], open_at: int, hi: int) -> int | None:
    """Where the bracket opened at ``open_at`` closes (before ``hi``)."""
    depth = 0
    for i in range(open_at, hi):
        token = tokens[i][0]
        if token in ("(", "["):
            depth += 1
        elif token in (")", "]"):
            depth -= 1
            if depth == 0:
                return i
    return None


def _split_args(tokens: Sequence[_Token], lo: int, hi: int) -> list[tuple[int, int]]:
    if lo == hi:
        return []
    out, depth, start = [], 0, lo
    for i in range(lo, hi):
        token = tokens[i][0]
        if token in ("(", "["):
            depth += 1
        elif token in (")", "]"):
            depth -= 1
        elif token == "," and depth == 0:
            out.append((start, i))
            start = i + 1
    out.append((start, hi))
    return out


def _unquoted(token: str) -> str:
    return name_parts(token)[0] if token.startswith("`") else token


def parse_sql(text: str) -> _Piece | None:
    """SQL text as a piece: a function call is taken apart, anything else is one opaque piece;
    None when the text is not read here (a comment, an unclosed string)."""
    tokens = sql_tokens(text)
    if not tokens:
        return None
    return _piece(text, tokens, 0, len(tokens))


def _piece(text: str, tokens: Sequence[_Token], lo: int, hi: int) -> _Piece:
    source = text[tokens[lo][1]:tokens[hi - 1][2]]
    first = tokens[lo][0]
    if hi - lo == 1:
        if first == "*":
            return _Piece("star", source)
        if first.startswith("`"):
            return _Piece("column", source, name=_unquoted(first))
        if _is_word(first):
            if first.lower() in ("true", "false", "null"):
                return _Piece("literal", source)
            if first.lower() not in _NOT_COLUMNS:
                return _Piece("column", source, name=first)
        elif first[0] in "'\"0123456789." or first[:2].lower() in ("x'", 'x"', "r'", 'r"'):
            return _Piece("literal", source)
    # a dotted name: a qualified column or a struct's field
    if hi - lo > 1 and (hi - lo) % 2 == 1 and all(
            _is_name(tokens[i][0]) if (i - lo) % 2 == 0 else tokens[i][0] == "."
            for i in range(lo, hi)):
        return _Piece("qualified", source)
    # a function call: name(...), name(DISTINCT ...), name(...) FILTER (WHERE ...)
    at = lo
    while at + 2 < hi and _is_name(tokens[at][0]) and tokens[at + 1][0] == ".":
        at += 2
    if at + 1 < hi and _is_name(tokens[at][0]) and tokens[at + 1][0] == "(":
        close = _matching(tokens, at + 1, hi)
        filtered = False
        if close is not None and close + 1 < hi and tokens[close + 1][0].lower() == "filter" \
                and close + 2 < hi and tokens[close + 2][0] == "(" \
                and _matching(tokens, close + 2, hi) == hi - 1:
            filtered = True
        if close is not None and (close == hi - 1 or filtered):
            name = _unquoted(tokens[at][0]).lower() if at == lo else \
                text[tokens[lo][1]:tokens[at][2]]
            spans = _split_args(tokens, at + 2, close)
            distinct = False
            if spans and spans[0][1] - spans[0][0] > 1 and \
                    tokens[spans[0][0]][0].lower() in ("distinct", "all"):
                distinct = tokens[spans[0][0]][0].lower() == "distinct"
                spans[0] = (spans[0][0] + 1, spans[0][1])
            if all(b > a for a, b in spans):
                return _Piece("call", source, name=name, distinct=distinct, filtered=filtered,
                              args=tuple(_piece(text, tokens, a, b) for a, b in spans))
    return _Piece("opaque", source, aggregates=bool(_called(tokens[lo:hi]) & AGGREGATES))


class _Writer:
    """Writes Connect expressions as :class:`Expr` with SQL text; collects the aggregates it
    wrote (their SQL, and the Connect expression each came from) for the probe."""

    def __init__(self) -> None:
        self.aggregates: dict[str, Any] = {}  # SQL -> the Connect expression (None: SQL text)
        self.averaged: list[str] = []  # the SQL of what avg aggregates (its type is probed)

    # - Connect expressions
    def expr(self, e: Any, in_struct: bool = False) -> Expr:
        from pyspark.sql.connect import expressions as E

        if isinstance(e, E.ColumnAlias):
            if len(e._alias) != 1:
                raise _Unwritable("an alias of several names")
            child = self.expr(e._child)
            if not in_struct:  # an alias inside an expression names nothing (but a field)
                return child
            return Expr(kind="Alias", sql=f"{child.sql} AS {quote(e._alias[0])}",
                        name=e._alias[0], children=(child,))
        if isinstance(e, E.ColumnReference):
            if e._is_metadata_column:
                raise _Unwritable(f"the metadata column {e._unparsed_identifier}")
            parts = name_parts(e._unparsed_identifier)
            sql = ".".join(quote(p) for p in parts)
            if len(parts) == 1:
                return Expr(kind="AttributeReference", sql=sql, name=parts[0])
            return Expr(kind="UnresolvedAttribute", sql=sql)
        if isinstance(e, E.LiteralExpression):
            return Expr(kind="Literal", sql=literal_sql(e._value, e._dataType),
                        data_type=sql_type(e._dataType))
        if isinstance(e, E.CastExpression):
            if e._eval_mode in ("ansi", "legacy"):
                raise _Unwritable(f"a cast in {e._eval_mode} mode")
            target = e._data_type if isinstance(e._data_type, str) else sql_type(e._data_type)
            child = self.expr(e._expr)
            cast = "TRY_CAST" if e._eval_mode == "try" else "CAST"
            return Expr(kind="Cast", sql=f"{cast}({child.sql} AS {target})", children=(child,))
        if isinstance(e, E.CaseWhen):
            parts_sql, children = [], []
            for condition, value in e._branches:
                c, v = self.expr(condition), self.expr(value)
                parts_sql.append(f"WHEN {c.sql} THEN {v.sql}")
                children += [c, v]
            if e._else_value is not None:
                other = self.expr(e._else_value)
                parts_sql.append(f"ELSE {other.sql}")
                children.append(other)
            return Expr(kind="CaseWhen", sql=f"CASE {' '.join(parts_sql)} END",
                        children=tuple(children))
        if isinstance(e, E.UnresolvedFunction):
            return self.call(e._name, list(e._args), e._is_distinct, e)
        if isinstance(e, E.CallFunction):
            return self.call(e._name, list(e._args), False, e)
        if isinstance(e, E.UnresolvedExtractValue):
            child, extraction = self.expr(e._child), self.expr(e._extraction)
            return Expr(kind="UnresolvedExtractValue", sql=f"{child.sql}[{extraction.sql}]",
                        children=(child, extraction))
        if isinstance(e, E.SQLExpression):
            return self.text(e._expr)
        if isinstance(e, E.UnresolvedNamedLambdaVariable):
            return Expr(kind="NamedLambdaVariable",
                        sql=".".join(quote(p) for p in e._name_parts))
        if isinstance(e, E.LambdaFunction):
            body = self.expr(e._function)
            names = [".".join(quote(p) for p in a._name_parts) for a in e._arguments]
            params = names[0] if len(names) == 1 else f"({', '.join(names)})"
            return Expr(kind="LambdaFunction", sql=f"{params} -> {body.sql}", children=(body,))
        if isinstance(e, E.NamedArgumentExpression):
            value = self.expr(e._value)
            return Expr(kind="NamedArgumentExpression", sql=f"{e._key} => {value.sql}",
                        children=(value,))
        if isinstance(e, E.WindowExpression):
            raise _Unwritable("a window function")
        if isinstance(e, E.CommonInlineUserDefinedFunction):
            raise _Unwritable(f"the UDF {e._function_name}")
        raise _Unwritable(f"a {type(e).__name__}")

    def call(self, name: str, args: list[Any], distinct: bool, original: Any) -> Expr:
        lower = name.lower()
        if lower in AGGREGATES:
            return self._aggregate(name, args, distinct, original)
        children = [self.expr(a, in_struct=lower == "struct") for a in args]
        sqls = [c.sql for c in children]
        kind = "CreateArray" if lower == "array" else name
        if distinct:
            raise _Unwritable(f"a DISTINCT {name}, which is no aggregate")
        if lower in _INFIX and len(children) == 2:
            sql = f"({sqls[0]} {_INFIX[lower]} {sqls[1]})"
        elif lower == "not" and len(children) == 1:
            sql = f"(NOT {sqls[0]})"
        elif lower == "~" and len(children) == 1:
            sql = f"(~ {sqls[0]})"
        elif lower == "in" and len(children) >= 2:
            sql = f"({sqls[0]} IN ({', '.join(sqls[1:])}))"
        else:
            sql = f"{_function_name(name)}({', '.join(sqls)})"
        return Expr(kind=kind, sql=sql, children=tuple(children))

    def _aggregate(self, name: str, args: list[Any], distinct: bool, original: Any) -> Expr:
        from pyspark.sql.connect import expressions as E

        lower = name.lower()
        try:
            if lower == "count" and len(args) == 1 and isinstance(args[0], E.UnresolvedStar) \
                    and args[0]._unparsed_target is None and not distinct:
                children: tuple[Expr, ...] = (Expr(kind="Literal", sql="1", data_type="INT"),)
            else:
                children = tuple(self.expr(a) for a in args)
        except _Unwritable as exc:
            return refused(repr(original), f"{lower} of {exc}{_UNWRITABLE}")
        sql = f"{lower}({'DISTINCT ' if distinct else ''}{', '.join(c.sql for c in children)})"
        return self._aggregate_expr(lower, sql, children, distinct, False, original)

    def _aggregate_expr(self, lower: str, sql: str, children: tuple[Expr, ...], distinct: bool,
                        filtered: bool, original: Any) -> Expr:
        kind = KINDS.get(lower, lower)
        if kind == "Percentile" and len(children) == 2:  # the analysed plan's default frequency
            children += (Expr(kind="Literal", sql="1L", data_type="BIGINT"),)
        if kind == "Average" and children:
            self.averaged.append(children[0].sql)
        function = Expr(kind=kind, sql=sql, children=children, pretty_name=lower)
        self.aggregates.setdefault(sql, original)
        return Expr(kind="AggregateExpression", sql=sql, children=(function,), distinct=distinct,
                    filtered=filtered, function=function)

    # - SQL text
    def text(self, source: str) -> Expr:
        piece = parse_sql(source)
        if piece is None:
            raise _Unwritable(f"the SQL text {source!r} (a comment, an unclosed string)")
        if piece.kind == "opaque":
            if piece.aggregates:
                raise _Unwritable(_AROUND)
            return Expr(kind="SQLExpression", sql=f"({piece.text})")
        return self.piece(piece)

    def piece(self, piece: _Piece) -> Expr:
        if piece.kind == "column":
            return Expr(kind="AttributeReference", sql=piece.text, name=piece.name)
        if piece.kind == "literal":
            return Expr(kind="Literal", sql=piece.text)
        if piece.kind == "qualified":
            return Expr(kind="UnresolvedAttribute", sql=piece.text)
        if piece.kind == "star":
            return Expr(kind="Star", sql="*")
        if piece.kind == "opaque":
            if piece.aggregates:
                raise _Unwritable(_AROUND)
            return Expr(kind="SQLExpression", sql=piece.text)  # a whole argument: verbatim
        children = tuple(self.piece(a) for a in piece.args)
        if piece.name in AGGREGATES:
            return self._aggregate_expr(piece.name, piece.text, children, piece.distinct,
                                        piece.filtered, None)
        if piece.filtered or piece.distinct:
            raise _Unwritable(f"DISTINCT or FILTER in {piece.text}, a call of a function not "
                              "known here as an aggregate")
        kind = "CreateArray" if piece.name == "array" else piece.name
        return Expr(kind=kind, sql=piece.text, children=children)


def _function_name(name: str) -> str:
    if _is_word(name):
        return name
    if "." in name and not name.startswith("`"):  # a qualified (persistent) function
        return ".".join(quote(p) for p in name_parts(name))
    return quote(name)


def refused(text: str, why: str) -> Expr:
    """An aggregate the split refuses, naming why (as its function's kind)."""
    function = Expr(kind=why, sql=text)
    return Expr(kind="AggregateExpression", sql=text, children=(function,), function=function)


def _named(writer: _Writer, e: Any) -> Expr:
    """One output of an aggregation (named later, from the probe's schema): a column, or an
    alias of an expression."""
    from pyspark.sql.connect import expressions as E

    inner = e
    if isinstance(e, E.ColumnAlias):
        if len(e._alias) != 1:
            return Expr(kind="MultiAlias", sql=repr(e))
        inner = e._child
    if isinstance(inner, E.ColumnReference) and inner is e:
        try:
            column = writer.expr(inner)
        except _Unwritable as exc:
            return Expr(kind="Alias", sql=repr(e),
                        children=(refused(repr(e), f"{exc}{_UNWRITABLE}"),))
        if column.kind == "AttributeReference":
            return column
    try:
        child = writer.expr(inner)
    except _Unwritable as exc:
        child = refused(repr(inner), f"{exc}{_UNWRITABLE}")
    return Expr(kind="Alias", sql=child.sql, children=(child,))


def _grouping(e: Any) -> Expr:
    """A grouping expression: a column (under an alias too: the analysed plan drops a grouping
    expression's alias), or what it is."""
    from pyspark.sql.connect import expressions as E

    inner = e._child if isinstance(e, E.ColumnAlias) and len(e._alias) == 1 else e
    try:
        return _Writer().expr(inner)
    except _Unwritable as exc:
        return Expr(kind=str(exc), sql=repr(e))


def _grouping_sets(node: Any, grouping: list[Expr]) -> Expr:
    """A rollup's, cube's, pivot's or grouping sets' grouping, as one expression that is no
    column (SQL-like text, for the refusal's message)."""
    columns = ", ".join(g.sql for g in grouping)
    kind = str(node._group_type)
    if kind == "pivot":
        pivot = _grouping(node._pivot_col._expr)
        return Expr(kind="Pivot", sql=f"{columns} PIVOT {pivot.sql}")
    if kind == "grouping_sets":
        sets = ", ".join("(" + ", ".join(_grouping(c._expr).sql for c in one) + ")"
                         for one in node._grouping_sets or [])
        return Expr(kind="GroupingSets", sql=f"GROUPING SETS ({sets})")
    return Expr(kind=kind.capitalize(), sql=f"{kind.upper()}({columns})")


def _aggregation(node: Any, session: Any) -> tuple[tuple[Expr, ...], tuple[Expr, ...]]:
    """An Aggregate node's grouping and output expressions, named and typed by one probe."""
    from pyspark.sql.connect import expressions as E

    grouping = [_grouping(c._expr) for c in node._grouping_cols]
    if node._group_type != "groupby":  # grouped several ways at once: refused by its grouping
        return (_grouping_sets(node, grouping),), ()
    if not grouping or any(g.kind != "AttributeReference" for g in grouping):
        return tuple(grouping), ()  # the split refuses these before it reads the outputs
    writer = _Writer()
    outputs = [_named(writer, c._expr) for c in node._aggregate_cols]
    found = _probe(node, session, writer)
    fields, types, why = found
    n_group = len(fields) - len(outputs)
    named_grouping = []
    for i, g in enumerate(grouping):
        plain = not isinstance(node._grouping_cols[i]._expr, E.ColumnAlias)
        if plain and n_group == len(grouping):  # the name the column resolves to
            g = dataclasses.replace(g, name=fields[i].name, sql=quote(fields[i].name))
        named_grouping.append(g)
    kept: list[Expr] = []
    if n_group == len(grouping):  # the grouping columns come first (retainGroupColumns)
        for i, g in enumerate(named_grouping):
            if isinstance(node._grouping_cols[i]._expr, E.ColumnAlias):
                kept.append(Expr(kind="Alias", sql=f"{g.sql} AS {quote(fields[i].name)}",
                                 name=fields[i].name, children=(g,)))
            else:
                kept.append(Expr(kind="AttributeReference", sql=g.sql, name=g.name))
    for i, output in enumerate(outputs):
        name = fields[n_group + i].name
        if output.kind == "Alias":
            child = _typed(output.children[0], types, why)
            output = dataclasses.replace(output, name=name, sql=f"{child.sql} AS {quote(name)}",
                                         children=(child,))
        elif output.kind == "AttributeReference":
            output = dataclasses.replace(output, name=name)
        kept.append(output)
    return tuple(named_grouping), tuple(kept)


def _probe(node: Any, session: Any, writer: _Writer) -> tuple[list[Any], dict[str, str],
                                                                dict[str, str]]:
    """One schema of the aggregation's input grouped as the node groups it, aggregated by the
    node's own columns, each aggregate written as SQL and the expression it was written from,
    and ``first`` of what each avg reads: the node's output fields, the SQL type of each SQL
    text, and why an aggregate's SQL is refused (it does not analyse, or to another type)."""
    from pyspark.sql.connect import functions as CF
    from pyspark.sql.connect.column import Column

    child = _frame(node._child, session)
    texts = list(writer.aggregates.items())
    originals = [(sql, e) for sql, e in texts if e is not None]
    extra = [CF.expr(sql).alias(f"{_PROBE}t{i}") for i, (sql, _) in enumerate(texts)]
    extra += [Column(e).alias(f"{_PROBE}o{i}") for i, (_, e) in enumerate(originals)]
    extra += [CF.first(CF.expr(sql)).alias(f"{_PROBE}c{i}")
              for i, sql in enumerate(writer.averaged)]

    def schema(columns: list[Any]) -> list[Any]:
        grouped = child.groupBy(*node._grouping_cols)
        return list(grouped.agg(*columns).schema.fields)  # type: ignore[attr-defined]

    why: dict[str, str] = {}
    try:
        fields = schema([*node._aggregate_cols, *extra])
    except Exception as exc:  # noqa: BLE001 - which part does not analyse: asked apart below
        log.debug("Spark Connect: the probe of an aggregation failed (%s); probing its parts",
                  str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        fields = schema(list(node._aggregate_cols))  # the aggregation's own error, if its own
        found: list[Any] = []
        for i, column in enumerate(extra):
            try:
                found += schema([column])[-1:]
            except Exception as part_exc:  # noqa: BLE001 - that part is refused, saying why
                found.append(None)
                if i < len(texts):
                    first = str(part_exc).splitlines()[0] if str(part_exc) else "an error"
                    why[texts[i][0]] = f"its SQL text does not analyse on the server ({first})"
        fields += found
    n_out = len(fields) - len(extra)
    probed = fields[n_out:]
    types: dict[str, str] = {}
    for (sql, _), field in zip(texts, probed, strict=False):
        if field is not None:
            types[sql] = sql_type(field.dataType)
    for (sql, _), field in zip(originals, probed[len(texts):], strict=False):
        if field is not None and sql in types and types[sql] != sql_type(field.dataType):
            why[sql] = (f"its SQL text {sql} analyses to a {types[sql]}, the aggregate it was "
                        f"written from to a {sql_type(field.dataType)}")
    for sql, field in zip(writer.averaged, probed[len(texts) + len(originals):], strict=False):
        if field is not None:
            types.setdefault(f"child:{sql}", sql_type(field.dataType))
    return fields[:n_out], types, why


def _typed(e: Expr, types: dict[str, str], why: dict[str, str]) -> Expr:
    """``e`` with its aggregates' result types (and avg's input type), or refused."""
    if e.kind == "AggregateExpression" and e.function is not None:
        if e.sql in why:
            return refused(e.sql, why[e.sql])
        data_type = types.get(e.sql, "")
        children = tuple(dataclasses.replace(c, data_type=types.get(f"child:{c.sql}",
                                                                    c.data_type))
                         if e.function.kind == "Average" else c
                         for c in e.function.children)
        function = dataclasses.replace(e.function, data_type=data_type, children=children)
        return dataclasses.replace(e, data_type=data_type, function=function,
                                   children=(function,))
    if not e.children:
        return e
    return dataclasses.replace(e, children=tuple(_typed(c, types, why) for c in e.children))
