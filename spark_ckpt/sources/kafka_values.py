"""A Kafka source's value format (``value_format="json"``, as Flink SQL's Kafka table
declares ``'value.format' = 'json'``): each record's value parsed into the columns of a
schema, exactly as Spark's ``from_json(CAST(value AS STRING), schema)`` parses it
(PERMISSIVE: a value that does not fit gives nulls), plus the Kafka metadata columns asked for.

Where the records are read by Spark's Kafka connector, Spark's ``from_json`` parses them.
Where they are read in Python tasks, the tasks parse them with Arrow's JSON reader, a block of
records at a time, and hand Spark typed columns; a block is parsed there only when Arrow's
answer is certainly Spark's:

- the schema's fields are all of types whose JSON parse the two agree on (STRING, BIGINT, INT,
  DOUBLE, BOOLEAN; any other type: every value goes to Spark's parser);
- every value is one line that starts with ``{`` (no null value, no newline in a value, no
  top-level scalar or array);
- every value is at most 1,000 bytes of valid UTF-8 (longer ones may pass Spark's parser
  limits), with no ``Inf``/``NaN`` token and no integer ``-0``, which the two read otherwise;
- Arrow parses the whole block with the schema (it refuses what Spark turns into nulls or
  reads differently: a number into a STRING field, a fraction into an integer, an integer
  out of range, a duplicate field, single quotes, trailing text);
- the block gives exactly one row per value.

Any block that fails one of these is passed to Spark as raw values, and Spark's ``from_json``
parses it in the same task's plan: the rows are Spark's either way
(tests/test_kafka_values.py compares both on a corpus of awkward values).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import StructType

__all__ = ["METADATA", "RAW", "TASK_PREFIX", "ValueFormat", "parse_block"]

# Spark's Kafka schema (includeHeaders=true): the metadata columns a parsed stream may keep
METADATA = {"key": "BINARY", "topic": "STRING", "partition": "INT", "offset": "BIGINT",
            "timestamp": "TIMESTAMP", "timestampType": "INT",
            "headers": "ARRAY<STRUCT<key: STRING, value: BINARY>>", "value": "BINARY"}
# the Kafka columns' names in what Python tasks give Spark (value fields keep their own)
TASK_PREFIX = "__spark_ckpt_kafka_"
# the raw values of a block Python tasks left to Spark's parser (null where they parsed it)
RAW = "__spark_ckpt_raw_value"
# a value longer than this may pass Spark's parser limits (nesting depth 1,000, numbers of
# 1,000 digits, Jackson's name and string lengths), which Arrow does not have: Spark's parse
_MAX_VALUE_BYTES = 1_000
# tokens the two read otherwise wherever they stand in a value: Arrow takes Inf, -Inf, -NaN
# (Jackson, as Spark sets it, NaN and Infinity only, else the record is malformed), and reads
# an integer -0 into a DOUBLE as -0.0 (Spark as 0.0); a block with any goes to Spark
_READ_OTHERWISE = re.compile(rb"[:\[,]\s*(?:[-+]?(?:NaN|Inf)|-0(?![.eE0-9]))")
# Spark type names whose JSON parse Arrow's reader gives identically (see the docstring)
_FAST = {"string": "string", "bigint": "int64", "int": "int32", "double": "float64",
         "boolean": "bool"}


class ValueFormat:
    """What a parsed Kafka stream's rows are: the value's schema (a DDL string or a
    StructType) and the metadata columns kept, ``{output name: Kafka column}``."""

    def __init__(self, source: str, value_format: str, value_schema: Any,
                 metadata: Sequence[str] | Mapping[str, str] | None) -> None:
        from pyspark.sql.types import BinaryType, StructField, StructType

        if value_format != "json":
            raise JobDefinitionError(
                f"kafka source {source}: expected value_format 'json' or None, found "
                f"{value_format!r}")
        if isinstance(value_schema, str):
            try:
                value_schema = StructType.fromDDL(value_schema)
            except Exception as exc:  # noqa: BLE001 - Spark's parser: any refusal
                raise JobDefinitionError(
                    f"kafka source {source}: expected value_schema as a DDL string such as "
                    f"'id BIGINT, name STRING' or a StructType, found {value_schema!r} "
                    f"({str(exc).splitlines()[0][:200]})") from None
        if not isinstance(value_schema, StructType) or not value_schema.fields:
            raise JobDefinitionError(
                f"kafka source {source}: value_format='json' expects value_schema, a DDL "
                f"string or a non-empty StructType, found {value_schema!r}")
        kept = (dict(metadata) if isinstance(metadata, Mapping)
                else {name: name for name in (metadata or ())})
        unknown = sorted(set(kept.values()) - set(METADATA))
        if unknown:
            raise JobDefinitionError(
                f"kafka source {source}: expected metadata columns among {sorted(METADATA)}, "
                f"found {unknown}")
        clash = sorted(set(kept) & set(value_schema.fieldNames()))
        if clash:
            raise JobDefinitionError(
                f"kafka source {source}: metadata column name(s) {clash} are also fields of "
                "value_schema; name them otherwise, e.g. metadata_columns={"
                + ", ".join(f"'kafka_{c}': '{kept[c]}'" for c in clash) + "}")
        self.value_schema: StructType = value_schema
        self.metadata = kept
        self.fast = all(f.dataType.simpleString() in _FAST for f in value_schema.fields)
        # built once: each batch's plan uses them (a DDL parse is a JVM call)
        meta = _metadata_schema()
        self._schema = StructType(list(value_schema.fields)
                                  + [StructField(out, meta[col].dataType, True)
                                     for out, col in kept.items()])
        # the Kafka columns under names of their own (a value field may be called timestamp)
        self._task_schema = StructType(list(value_schema.fields)
                                       + [StructField(TASK_PREFIX + c, meta[c].dataType, True)
                                          for c in sorted(set(kept.values()))]
                                       + [StructField(RAW, BinaryType(), True)])
        self._spec: dict[str, Any] | None = None

    def schema(self) -> StructType:
        """The stream's rows: the value's fields, then the metadata columns."""
        return self._schema

    def reader_spec(self) -> dict[str, Any]:
        """What Python tasks need (pickled into the task): each field's Arrow type name
        for the parse, its Arrow type (for a null column), the metadata columns."""
        from pyspark.sql.pandas.types import to_arrow_type

        if self._spec is None:
            self._spec = {"fields": [(f.name, _FAST.get(f.dataType.simpleString()))
                                     for f in self.value_schema.fields],
                          "types": [to_arrow_type(f.dataType, timezone="UTC")
                                    for f in self.value_schema.fields],
                          "fast": self.fast, "metadata": sorted(set(self.metadata.values()))}
        return self._spec

    def task_schema(self) -> StructType:
        """What Python tasks give Spark: the value's fields (null where a block was left to
        Spark), the metadata columns (by their Kafka names), the raw values left to Spark."""
        return self._task_schema

    def from_tasks(self, frame: DataFrame) -> DataFrame:
        """The Python tasks' rows as the stream's: blocks left to Spark parsed by its
        ``from_json``, in the same plan."""
        from pyspark.sql import functions as F

        # a block the tasks parsed: its columns; one they left: Spark's parse of its values
        # (the struct built once a row, in one projection, whichever way it went)
        fields = [F.col(f"`{f.name}`") for f in self.value_schema.fields]
        value = F.when(F.col(RAW).isNull(), F.struct(*fields)) \
            .otherwise(self._parse(F.col(RAW))).alias("__spark_ckpt_value")
        meta = [F.col(f"`{TASK_PREFIX}{col}`").alias(out) for out, col in self.metadata.items()]
        return frame.select(value, *meta).select(
            "__spark_ckpt_value.*", *[F.col(f"`{out}`") for out in self.metadata])

    def from_connector(self, frame: DataFrame) -> DataFrame:
        """Spark's Kafka connector's rows as the stream's (Spark's ``from_json``)."""
        from pyspark.sql import functions as F

        parsed = "__spark_ckpt_parsed_value"
        frame = frame.withColumn(parsed, self._parse(F.col("value")))
        columns: list[Column] = [F.col(parsed).getField(f.name).alias(f.name)
                                 for f in self.value_schema.fields]
        columns += [F.col(f"`{col}`").alias(out) for out, col in self.metadata.items()]
        return frame.select(*columns)

    def _parse(self, value: Column) -> Column:
        from pyspark.sql import functions as F

        return F.from_json(value.cast("string"), self.value_schema)


def _metadata_schema() -> StructType:
    from typing import cast

    from pyspark.sql.types import StructType

    return cast(StructType, StructType.fromDDL(
        ", ".join(f"`{k}` {v}" for k, v in METADATA.items())))


def parse_block(pa: Any, values: list[Any], spec: dict[str, Any]) -> tuple[Any, bool]:
    """The value columns of one block of records: ``(columns, True)`` parsed by Arrow where
    that is certainly Spark's answer (the module's docstring), else ``(raw values, False)``
    for Spark's parser."""
    n = len(values)
    if spec["fast"] and n and None not in values and max(map(len, values)) <= _MAX_VALUE_BYTES:
        block = b"\n".join(values)
        if block.count(b"\n") == n - 1 and _lines_open_objects(block, n) and \
                _utf8(block) and not _READ_OTHERWISE.search(block):
            import pyarrow.json as pj

            schema = pa.schema([(name, kind) for name, kind in spec["fields"]])
            try:
                table = pj.read_json(
                    pa.py_buffer(block),
                    read_options=pj.ReadOptions(use_threads=False,
                                                block_size=max(len(block) + 1, 1 << 20)),
                    parse_options=pj.ParseOptions(explicit_schema=schema,
                                                  unexpected_field_behavior="ignore"))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError):
                table = None
            if table is not None and table.num_rows == n:
                return [table.column(name).combine_chunks()
                        for name, _kind in spec["fields"]], True
    return values, False


def _utf8(block: bytes) -> bool:
    """Valid UTF-8 (Spark decodes invalid bytes to U+FFFD; Arrow keeps them unchecked)."""
    try:
        block.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _lines_open_objects(block: bytes, n: int) -> bool:
    """Every one of the block's ``n`` lines starts with ``{`` (Arrow's reader is not handed
    a top-level scalar: with a schema it crashes the process on a bare ``null`` line,
    pyarrow 26)."""
    import numpy as np

    data = np.frombuffer(block, dtype=np.uint8)
    starts = np.flatnonzero(data == 0x0A) + 1
    if not len(data) or data[0] != 0x7B or len(starts) != n - 1:
        return False
    # a last value that is empty leaves the block ending in a newline
    return not len(starts) or (starts[-1] < len(data) and bool((data[starts] == 0x7B).all()))
