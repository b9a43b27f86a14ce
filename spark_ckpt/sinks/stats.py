"""Per-column statistics of a committed Parquet file, for the Delta log's ``add`` action.

A Delta ``add`` action may carry ``stats``: ``numRecords`` and, per column, ``minValues``,
``maxValues`` and ``nullCount``. Readers (Databricks, Delta Spark, delta-rs, DuckDB) skip a file
whose range cannot match a predicate. Spark's Parquet writer already stores each row group's
min, max and null count in the footer; this module reads the footer (a few KB at the end of
the file) and folds the row groups into the file's figures.

Only figures that are exact for the column's comparison in Spark SQL are written, since a
wrong minimum or maximum makes a reader skip a file that holds matching rows (a silently
dropped row):

* integers, booleans, dates, and decimals (as exact JSON numbers);
* strings of at most 32 characters at both ends (Delta truncates longer ones; a truncated
  maximum needs care this module does not take: it leaves them out);
* timestamps stored as INT64 (micros or millis), in UTC, the minimum rounded down and the
  maximum rounded up to the millisecond Delta's format keeps; Spark's default INT96
  timestamps carry no statistics; ``timestamp_ntz`` the same, as wall-clock time without a
  zone, as Delta Spark writes it (not as an instant marked ``Z``: the value has no zone);
* not floats or doubles: Spark orders NaN above every number, the Parquet writers leave NaN
  out of the maximum, and a footer cannot say whether a file holds one;
* not lists, maps or binary.

``nullCount`` is written for every top-level and struct-nested leaf whose row groups all
count their nulls. A file whose footer cannot be read gets ``numRecords`` only.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import logging
import re
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from spark_ckpt.storage import resolve

__all__ = ["file_stats"]

log = logging.getLogger(__name__)

MAX_STRING = 32
_DECIMAL_MARK = "\u2063sck-decimal\u2063"  # around a decimal's text until it is unquoted
_DECIMAL = re.compile('"' + re.escape(json.dumps(_DECIMAL_MARK)[1:-1]) + r'(-?[0-9.]+)'
                      + re.escape(json.dumps(_DECIMAL_MARK)[1:-1]) + '"')


def file_stats(path: str, rows: int, partition_columns: set[str]) -> str:
    """The ``stats`` JSON of the Parquet file at ``path`` (a local path or a URI)."""
    stats: dict[str, Any] = {"numRecords": rows}
    try:
        if "://" in path:
            fs, where = resolve(path)
        else:
            fs, where = pafs.LocalFileSystem(), path
        with fs.open_input_file(where) as handle:
            parquet = pq.ParquetFile(handle)
            meta, arrow = parquet.metadata, parquet.schema_arrow
    except (OSError, pa.ArrowException) as exc:
        log.warning("Could not read the Parquet footer of %s for Delta statistics: %s",
                    path, exc)
        return json.dumps(stats)
    minimum: dict[str, Any] = {}
    maximum: dict[str, Any] = {}
    nulls: dict[str, Any] = {}
    types = _leaf_types(arrow)
    for column in range(meta.num_columns):
        dotted = meta.schema.column(column).path
        if dotted not in types or dotted.split(".", 1)[0] in partition_columns:
            continue  # inside a list or map, or a partition column (not in the file)
        lo, hi, count = _fold(meta, column)
        keys = dotted.split(".")
        if count is not None:
            _put(nulls, keys, count)
        kind = types[dotted]
        if lo is None or hi is None:
            continue
        low, high = _json_value(lo, kind, up=False), _json_value(hi, kind, up=True)
        if low is not None and high is not None:
            _put(minimum, keys, low)
            _put(maximum, keys, high)
    if minimum:
        stats["minValues"] = minimum
        stats["maxValues"] = maximum
    if nulls:
        stats["nullCount"] = nulls
    text = json.dumps(stats, separators=(",", ":"))
    return _DECIMAL.sub(lambda m: m.group(1), text)  # decimals as exact JSON numbers


def _leaf_types(schema: pa.Schema) -> dict[str, pa.DataType]:
    """Parquet column path -> Arrow type, for leaves reached through structs only."""
    out: dict[str, pa.DataType] = {}

    def visit(prefix: str, field: pa.Field) -> None:
        name = f"{prefix}{field.name}"
        if pa.types.is_struct(field.type):
            for child in field.type:
                visit(f"{name}.", child)
        elif not (pa.types.is_list(field.type) or pa.types.is_large_list(field.type)
                  or pa.types.is_map(field.type)):
            out[name] = field.type

    for field in schema:
        visit("", field)
    return out


def _fold(meta: Any, column: int) -> tuple[Any, Any, int | None]:
    """The file's min, max (None when any row group with values lacks them) and null count
    (None when any row group does not count)."""
    lo = hi = None
    nulls: int | None = 0
    exact = True
    for group in range(meta.num_row_groups):
        chunk = meta.row_group(group).column(column)
        st = chunk.statistics
        if st is None:
            return None, None, None
        if nulls is not None:
            nulls = nulls + st.null_count if st.has_null_count else None
        values = chunk.num_values - (st.null_count if st.has_null_count else 0)
        if not st.has_min_max:
            if values > 0 or not st.has_null_count:
                exact = False
            continue
        lo = st.min if lo is None else min(lo, st.min)
        hi = st.max if hi is None else max(hi, st.max)
    if not exact:
        return None, None, nulls
    return lo, hi, nulls


def _json_value(value: Any, kind: pa.DataType, *, up: bool) -> Any:
    """``value`` as Delta's stats JSON writes it, or None where no exact figure exists."""
    if pa.types.is_boolean(kind) or pa.types.is_integer(kind):
        return value if isinstance(value, bool | int) else None
    if pa.types.is_decimal(kind):
        if not isinstance(value, decimal.Decimal) or not value.is_finite():
            return None
        return f"{_DECIMAL_MARK}{format(value, 'f')}{_DECIMAL_MARK}"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return value if isinstance(value, str) and len(value) <= MAX_STRING else None
    if pa.types.is_date(kind):
        return value.isoformat() if isinstance(value, dt.date) else None
    if pa.types.is_timestamp(kind) and isinstance(value, dt.datetime):
        # timestamp_ntz (no zone in the file's type): its wall-clock time as is, without a
        # zone, as Delta Spark writes it; a timestamp: the instant, in UTC, marked "Z"
        local = kind.tz is None
        if value.tzinfo is not None:
            value = value.astimezone(dt.UTC)
            if local:
                value = value.replace(tzinfo=None)
        micros = value.microsecond % 1000
        if micros:  # Delta keeps milliseconds: widen the range, never narrow it
            value -= dt.timedelta(microseconds=micros)
            if up:
                value += dt.timedelta(milliseconds=1)
        return (value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}"
                + ("" if local else "Z"))
    return None  # floats (NaN), binary, time, anything else


def _put(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value
