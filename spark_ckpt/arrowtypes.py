"""Spark schema <-> Arrow schema, the one way spark_ckpt converts (timestamps in UTC)."""

from __future__ import annotations

from typing import Any

__all__ = ["to_arrow", "to_spark"]


def to_arrow(schema: Any) -> Any:
    """The Arrow schema Spark exchanges for ``schema`` (a StructType), timestamps in UTC."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


def to_spark(schema: Any) -> Any:
    """The Spark StructType for an Arrow schema (timestamps of any unit become TIMESTAMP)."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import from_arrow_schema

    fields = []
    for field in schema:
        if pa.types.is_timestamp(field.type):
            field = field.with_type(pa.timestamp("us", tz=field.type.tz))
        elif pa.types.is_large_string(field.type) or pa.types.is_string_view(field.type):
            field = field.with_type(pa.string())
        fields.append(field)
    return from_arrow_schema(pa.schema(fields))
