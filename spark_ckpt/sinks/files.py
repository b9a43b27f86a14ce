"""What both sink kinds do with the files Spark's Parquet writer leaves: list them, read their
partition values, check them before a commit, and the schema and timestamp settings Delta
wants."""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from spark_ckpt.errors import CommitError
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.session import session_conf
from spark_ckpt.storage import Storage, stat_any

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = ["arrow_schema_for", "check_files", "micros_timestamps", "partition_values",
           "written_files"]


def arrow_schema_for(schema: StructType) -> pa.Schema:
    from spark_ckpt.arrowtypes import to_arrow

    fields = []
    for field in to_arrow(schema):
        if pa.types.is_timestamp(field.type) and field.type.tz is not None:
            field = field.with_type(pa.timestamp("us", tz="UTC"))
        fields.append(field)
    return pa.schema(fields)


@contextlib.contextmanager
def micros_timestamps(spark: Any) -> Iterator[None]:
    """Spark writes INT96 timestamps unless told otherwise; Delta wants microseconds."""
    with session_conf(spark, "spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS"):
        yield


def written_files(store: Storage, directory: str) -> list[tuple[Any, str]]:
    """(file info, path relative to ``directory``) of each data file a Spark write left there:
    not ``_SUCCESS``, ``.crc`` checksums or ``_temporary`` leftovers."""
    out = []
    for info in store.list_files(directory, recursive=True):
        relative = info.path[len(directory.rstrip("/")) + 1:]
        if not any(part.startswith((".", "_")) for part in relative.split("/")):
            out.append((info, relative))
    return out


def partition_values(relative: str) -> dict[str, str | None]:
    """Hive partition values from the ``col=value/`` directories of a written file's path."""
    values: dict[str, str | None] = {}
    for segment in relative.split("/")[:-1]:
        key, _, value = segment.partition("=")
        value = urllib.parse.unquote(value)
        values[key] = None if value == "__HIVE_DEFAULT_PARTITION__" else value
    return values


def check_files(sink: str, files: list[OutputFile]) -> None:
    """delta-rs accepts an AddAction for a file that does not exist; never commit one."""
    sizes = stat_any(f.path for f in files)
    for f, size in zip(files, sizes, strict=True):
        if size != f.size:
            found = "missing" if size is None else f"{size} bytes"
            raise CommitError(
                f"sink {sink}: staged file {f.path} should be {f.size} bytes, found {found}; "
                "refusing to commit (the partition will be re-run on the next attempt)"
            )
