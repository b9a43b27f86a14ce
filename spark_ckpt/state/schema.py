"""Typed keyed state: the declared state variables of a processor and how they are stored.

A processor declares its state variables with Spark types, as a DDL string, a ``StructType`` or
a dict of name to type::

    state_schema = "n BIGINT, last STRUCT<ts: TIMESTAMP, dest: STRING>, recent ARRAY<BIGINT>,
                    by_dest MAP<STRING, BIGINT>, doc json"

Each variable is one column of the state, stored with its type in both backends and in the
snapshot and changelog Parquet files: a *value* state is a column of any type, a *list* state an
``ARRAY<element>`` column, a *map* state a ``MAP<key, value>`` column. ``json`` (only as a
variable's own type) is a string column holding a JSON document: the one place state is JSON.

A key's state is its row: a variable that is null does not exist (``ValueState.exists()`` is
false), an empty list or map is the same as none, and a key whose variables are all null and
which has no timers is gone. Besides the variables a state row has ``_kg`` (its key group), the
key columns, ``_timers`` (``ARRAY<STRUCT<ms: BIGINT, kind: STRING>>``) and ``_expires`` (the
time-to-live deadline of each variable, ``MAP<STRING, BIGINT>``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, cast

import pyarrow as pa

from spark_ckpt.errors import JobDefinitionError

__all__ = ["EXPIRES_COLUMN", "JSON_META", "STATE_FORMAT_TYPED", "TIMERS_COLUMN", "TIMER_TYPE",
           "StateSchema", "StateVar", "json_safe", "json_unsafe", "parse_state_schema"]

TIMERS_COLUMN = "_timers"
EXPIRES_COLUMN = "_expires"
TIMER_TYPE = pa.list_(pa.struct([("ms", pa.int64()), ("kind", pa.string())]))
EXPIRES_TYPE = pa.map_(pa.string(), pa.int64())
JSON_META = b"spark_ckpt.json"
STATE_FORMAT_TYPED = b"2"  # spark_ckpt.state of typed processor state files

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class StateVar:
    """One declared state variable: its name, Arrow type, and whether it holds JSON."""

    name: str
    type: pa.DataType
    is_json: bool = False

    @property
    def kind(self) -> str:
        """What the type allows: ``list`` (ARRAY), ``map`` (MAP) or ``value`` (any)."""
        if pa.types.is_list(self.type) or pa.types.is_large_list(self.type):
            return "list"
        if pa.types.is_map(self.type):
            return "map"
        return "value"

    def field(self) -> pa.Field:
        meta = {JSON_META: b"1"} if self.is_json else None
        return pa.field(self.name, self.type, metadata=meta)


class StateSchema:
    """The state variables of one processor, in declaration order."""

    def __init__(self, variables: list[StateVar]) -> None:
        self.vars = list(variables)
        self.by_name = {v.name: v for v in self.vars}
        self.json_flags = {v.name: v.is_json for v in self.vars}
        self.kinds = {v.name: v.kind for v in self.vars}

    @property
    def names(self) -> list[str]:
        return [v.name for v in self.vars]

    def arrow(self) -> pa.Schema:
        """The variables' columns (no key, key-group or timer columns)."""
        return pa.schema([v.field() for v in self.vars])

    def file_schema(self, key_fields: list[pa.Field], *, ttl: bool) -> pa.Schema:
        fields = [pa.field("_kg", pa.int32()), *key_fields, *[v.field() for v in self.vars],
                  pa.field(TIMERS_COLUMN, TIMER_TYPE)]
        if ttl:
            fields.append(pa.field(EXPIRES_COLUMN, EXPIRES_TYPE))
        return pa.schema(fields)

    def to_json(self) -> str:
        """The variables as a Spark StructType's JSON (json variables marked in metadata)."""
        from spark_ckpt.arrowtypes import to_spark

        spark = to_spark(pa.schema([pa.field(v.name, v.type) for v in self.vars]))
        raw = json.loads(spark.json())
        for field, var in zip(raw["fields"], self.vars, strict=True):
            if var.is_json:
                field["metadata"] = {"spark_ckpt.type": "json"}
        return json.dumps(raw)

    @classmethod
    def from_spark_json(cls, raw: str) -> StateSchema:
        """The variables :meth:`to_json` wrote (a checkpoint's description of its state)."""
        from pyspark.sql.types import StructType

        from spark_ckpt.arrowtypes import to_arrow

        spark = StructType.fromJson(json.loads(raw))
        arrow = to_arrow(spark)
        return cls([StateVar(f.name, a.type,
                             (f.metadata or {}).get("spark_ckpt.type") == "json")
                    for f, a in zip(spark.fields, arrow, strict=True)])

    def serialize(self) -> str:
        hexed: str = self.arrow().serialize().to_pybytes().hex()
        return hexed

    @classmethod
    def deserialize(cls, hexed: str) -> StateSchema:
        schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(hexed)))
        return cls([StateVar(f.name, f.type, bool(f.metadata and f.metadata.get(JSON_META)))
                    for f in schema])


def _split_top(ddl: str) -> list[str]:
    """Split ``a INT, b STRUCT<x: INT, y: INT>`` at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(ddl):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(ddl[start:i])
            start = i + 1
    parts.append(ddl[start:])
    return [p.strip() for p in parts if p.strip()]


def _spark_type(ddl: str, spark: Any, where: str) -> Any:
    """A Spark DataType from a DDL type string (Spark's own parser)."""
    from pyspark.sql.types import StructType

    try:
        if spark is not None:
            return cast(StructType, StructType.fromDDL(f"`v` {ddl}")).fields[0].dataType
        from pyspark.sql.types import _parse_datatype_string

        return _parse_datatype_string(ddl)
    except Exception as exc:  # noqa: BLE001 - Spark's parse error says where
        raise JobDefinitionError(
            f"{where}: expected a Spark SQL type (for example BIGINT, STRING, "
            f"ARRAY<BIGINT>, MAP<STRING, DOUBLE>, STRUCT<ts: TIMESTAMP, dest: STRING>, or json), "
            f"found {ddl!r}: {str(exc).splitlines()[0]}"
        ) from None


def parse_state_schema(declared: Any, *, spark: Any = None,
                       where: str = "state_schema") -> StateSchema:
    """A :class:`StateSchema` from a DDL string, a StructType or a dict of name -> type (a DDL
    type string or a Spark DataType). ``json`` is allowed as a variable's type."""
    from pyspark.sql.types import DataType, StructType

    from spark_ckpt.arrowtypes import to_arrow

    if declared is None:
        return StateSchema([])
    items: list[tuple[str, Any]] = []
    if isinstance(declared, StructType):
        items = [(f.name, f.dataType) for f in declared.fields]
    elif isinstance(declared, Mapping):
        items = list(declared.items())
    elif isinstance(declared, str):
        for part in _split_top(declared):
            name, _, ddl = part.partition(" ")
            if not ddl.strip():
                name, _, ddl = part.partition(":")
            items.append((name.strip().strip("`").rstrip(":"), ddl.strip().lstrip(":").strip()))
    else:
        raise JobDefinitionError(
            f"{where}: expected a DDL string, a StructType or a dict of name to type, found "
            f"{type(declared).__name__}"
        )
    variables: list[StateVar] = []
    for name, t in items:
        if not isinstance(name, str) or not _NAME.match(name):
            raise JobDefinitionError(
                f"{where}: expected state variable names of letters, digits and '_' starting "
                f"with a letter, found {name!r}"
            )
        if name in {v.name for v in variables}:
            raise JobDefinitionError(f"{where}: state variable {name!r} is declared twice")
        if isinstance(t, str) and t.strip().lower() == "json":
            variables.append(StateVar(name, pa.string(), True))
            continue
        dtype = t if isinstance(t, DataType) else _spark_type(str(t), spark,
                                                               f"{where}: variable {name!r}")
        arrow = to_arrow(StructType().add(name, dtype)).field(0).type
        variables.append(StateVar(name, arrow))
    return StateSchema(variables)


# -- a JSON form of typed values (the rocksdb backend's per-key rows) -----------------------
def _safe_type(t: pa.DataType, binary: pa.DataType | None = None,
               keep_decimal: bool = False) -> pa.DataType:
    """The type values of ``t`` take in JSON: times as integers, decimals as strings, maps as
    lists of {key, value}, binary as base64 strings (or ``binary``)."""
    if pa.types.is_timestamp(t) or pa.types.is_time64(t) or pa.types.is_duration(t):
        return pa.int64()
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return pa.int32()
    if pa.types.is_decimal(t):
        return t if keep_decimal else pa.string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.string() if binary is None else binary
    if pa.types.is_map(t):
        return pa.list_(pa.struct([("key", _safe_type(t.key_type, binary, keep_decimal)),
                                   ("value", _safe_type(t.item_type, binary, keep_decimal))]))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_safe_type(t.value_type, binary, keep_decimal))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _safe_type(f.type, binary, keep_decimal))
                          for f in t])
    return t


def _has_binary(t: pa.DataType) -> bool:
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return True
    return any(_has_binary(t.field(i).type) for i in range(t.num_fields)) \
        if t.num_fields else False


def _encode_binary(array: pa.Array) -> pa.Array:
    """Binary values (at any depth) as base64 strings."""
    import base64

    t = array.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.array([None if b is None else base64.b64encode(b).decode()
                         for b in array.to_pylist()], pa.string())
    if pa.types.is_struct(t):
        return pa.StructArray.from_arrays(
            [_encode_binary(array.field(i)) for i in range(t.num_fields)],
            fields=[pa.field(t.field(i).name, _safe_binary(t.field(i).type))
                    for i in range(t.num_fields)], mask=array.is_null())
    if pa.types.is_map(t):
        array = array.cast(pa.list_(pa.struct([("key", t.key_type), ("value", t.item_type)])))
        t = array.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.ListArray.from_arrays(array.offsets, _encode_binary(array.flatten()),
                                        mask=array.is_null())
    return array


def _safe_binary(t: pa.DataType) -> pa.DataType:
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.string()
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _safe_binary(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.list_(pa.struct([("key", _safe_binary(t.key_type)),
                                   ("value", _safe_binary(t.item_type))]))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_safe_binary(t.value_type))
    return t


def json_safe(array: pa.Array | pa.ChunkedArray) -> list[Any]:
    """Python values of ``array`` that ``json.dumps`` writes and :func:`json_unsafe` reads
    back to the same typed values (NaN and infinities included, as the json module writes)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if _has_binary(array.type):
        array = _encode_binary(array)
    values: list[Any] = array.cast(_safe_type(array.type)).to_pylist()
    return values


def _needs_python(t: pa.DataType) -> bool:
    """Types JSON values are converted back from in Python: binary, decimals and maps."""
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_decimal(t) or \
            pa.types.is_map(t):
        return True
    return any(_needs_python(t.field(i).type) for i in range(t.num_fields)) \
        if t.num_fields else False


def _decode_binary(values: Any, t: pa.DataType) -> Any:
    import base64
    import decimal

    if values is None:
        return None
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return base64.b64decode(values)
    if pa.types.is_decimal(t):
        return decimal.Decimal(values)
    if pa.types.is_struct(t):
        return {f.name: _decode_binary(values.get(f.name), f.type) for f in t}
    if pa.types.is_map(t):
        return [(_decode_binary(e["key"], t.key_type), _decode_binary(e["value"], t.item_type))
                for e in values]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return [_decode_binary(v, t.value_type) for v in values]
    return values


def json_unsafe(values: list[Any], t: pa.DataType) -> pa.Array:
    """The typed array of values written by :func:`json_safe`."""
    if _needs_python(t):  # times are integers, which pa.array takes for them
        return pa.array([_decode_binary(v, t) for v in values], t)
    safe = pa.array(values, _safe_type(t))
    return safe if safe.type == t else safe.cast(t)
