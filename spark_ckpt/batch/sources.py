"""Sources of a batch job: where partition *i* of a source vertex gets its rows.

* :class:`FileSource` splits a list of files (Parquet, CSV, newline-delimited JSON) into
  ``parallelism`` splits in a stable order; the split assignment is the vertex coordinator's
  state, recorded in ``JobVertexInitialized`` so a recovered attempt reads exactly the files the
  first one did, even when new files arrived since. Re-running split *i* reads only its files.
* :class:`DataFrameSource` wraps any DataFrame a user can build (JDBC, tables, ``range``). Its
  rows are split by ``pmod(hash(split_by), parallelism)``; re-running any of its partitions reads
  the whole DataFrame once (Spark cannot read a hash bucket of an arbitrary plan alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from spark_ckpt.errors import InputChangedError, JobDefinitionError
from spark_ckpt.storage import Storage, stat_any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = ["DataFrameSource", "FileSource", "Split"]

FileFormat = Literal["parquet", "csv", "json"]
_SUFFIXES = {"parquet": (".parquet",), "csv": (".csv", ".csv.gz"), "json": (".json", ".jsonl")}

Split = list[tuple[str, int]]  # (path, size) of each file


@dataclasses.dataclass(eq=False)
class FileSource:
    path: str
    format: FileFormat = "parquet"
    options: dict[str, str] = dataclasses.field(default_factory=dict)
    schema: StructType | str | None = None
    replayable = True

    def describe(self) -> dict[str, Any]:
        return {"kind": "files", "path": self.path, "format": self.format,
                "options": self.options}

    def discover(self, parallelism: int | None) -> list[Split]:
        """List the input files in a stable order and cut them into contiguous splits."""
        store = Storage(self.path)
        infos = store.list_files(store.root) if store.exists(store.root) else []
        if not infos and store.exists(store.root):  # a single file
            infos = [store.fs.get_file_info(store.root)]
        files = sorted(
            (store.spark_path(i.path), i.size) for i in infos
            if i.base_name.endswith(_SUFFIXES[self.format])
            and not any(part.startswith(("_", ".")) for part in
                        i.path[len(store.root):].split("/") if part)
        )
        if not files:
            raise JobDefinitionError(
                f"file source {self.path}: expected {self.format} files "
                f"({', '.join(_SUFFIXES[self.format])}), found none"
            )
        count = min(parallelism or len(files), len(files))
        return [files[i * len(files) // count:(i + 1) * len(files) // count]
                for i in range(count)]

    def spark_schema(self, spark: SparkSession, sample_files: list[str]) -> StructType:
        from pyspark.sql.types import StructType

        if isinstance(self.schema, StructType):
            return self.schema
        reader = spark.read.format(self.format).options(**self.options)
        if isinstance(self.schema, str):
            return reader.schema(self.schema).load(sample_files[:1]).schema
        # Inferred from the first file: listing and reading every footer of a large input
        # costs seconds (a Spark job above 32 paths). Files of one source share a schema;
        # a file that does not fails the read naming it.
        return reader.load(sample_files[:1]).schema

    def pieces(self, split: Split) -> list[dict[str, Any]]:
        return [{"kind": self.format, "path": path, "size": size, "options": self.options}
                for path, size in split]

    def validate_splits(self, vertex_id: str, splits: list[Split]) -> None:
        """Before re-reading recorded splits, check their files are the ones recorded."""
        files = [f for split in splits for f in split]
        for (path, size), found in zip(files, stat_any(p for p, _ in files), strict=True):
            if found != size:
                what = "missing" if found is None else f"{found} bytes"
                raise InputChangedError(
                    f"source vertex {vertex_id}: input file {path} was {size} bytes when the "
                    f"job first read it, found {what}. The job's input changed; run it again "
                    f"with fresh=True (or a new job id) to start over."
                )


@dataclasses.dataclass(eq=False)
class DataFrameSource:
    build: Callable[[SparkSession], DataFrame]
    split_by: tuple[str, ...] = ()
    label: str = ""
    replayable = False

    def describe(self) -> dict[str, Any]:
        return {"kind": "dataframe", "label": self.label, "split_by": list(self.split_by)}


def decode_splits(data: Any) -> list[Split]:
    return [[(str(p), int(n)) for p, n in s] for s in data]
