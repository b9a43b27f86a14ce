"""Spark schema -> Arrow schema, the one way spark_ckpt converts (timestamps in UTC)."""

from __future__ import annotations

from typing import Any

__all__ = ["to_arrow"]


def to_arrow(schema: Any) -> Any:
    """The Arrow schema Spark exchanges for ``schema`` (a StructType), timestamps in UTC."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")
