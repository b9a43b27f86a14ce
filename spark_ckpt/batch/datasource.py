"""A Spark data source whose Spark partition *k* is exactly logical partition *k* of a plan.

Spark's own file reader packs and splits files as it likes, so a Spark partition cannot be
tied to a source split or to a consumer's sub-partition of durable results. This Python data
source takes an explicit plan, one entry per logical partition, each a list of *pieces*:

* ``{"kind": "parquet", "path": ..., "row_groups": [..] | null}``: a result file's row groups
  for one sub-partition, or a whole Parquet source file;
* ``{"kind": "csv" | "json", "path": ..., "options": {...}}``: a whole source file.

Rows are read with pyarrow and cast to the plan's Spark schema. A vertex function without a
shuffle keeps Spark partition *k* = logical partition *k* all the way to the writer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

__all__ = ["NAME", "PartitionsDataSource", "register"]

NAME = "spark_ckpt_partitions"


class _Pieces(InputPartition):
    def __init__(self, index: int, pieces: list[dict[str, Any]]) -> None:
        super().__init__(index)
        self.pieces = pieces


class _Reader(DataSourceReader):
    def __init__(self, plan: dict[str, Any], schema: StructType) -> None:
        self.plan = plan
        self.schema = schema

    def partitions(self) -> list[InputPartition]:
        return [_Pieces(i, p) for i, p in enumerate(self.plan["partitions"])]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        from spark_ckpt.arrowtypes import to_arrow

        arrow_schema = to_arrow(self.schema)
        for piece in partition.pieces:  # type: ignore[attr-defined]
            try:
                table = _read_piece(piece, arrow_schema)
            except Exception as exc:
                raise RuntimeError(
                    f"spark_ckpt: cannot read {piece['kind']} file {piece['path']} "
                    f"({self.plan.get('label', '')}): {exc}"
                ) from exc
            yield from table.to_batches(max_chunksize=65536)


def _filesystem(path: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), path


def _read_piece(piece: dict[str, Any], arrow_schema: Any) -> Any:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    fs, path = _filesystem(piece["path"])
    names = arrow_schema.names
    kind = piece["kind"]
    if kind == "parquet":
        pf = pq.ParquetFile(path, filesystem=fs)
        present = [n for n in names if n in pf.schema_arrow.names]
        groups = piece.get("row_groups")
        table = (pf.read_row_groups(groups, columns=present) if groups is not None
                 else pf.read(columns=present))
        missing = [n for n in names if n not in present]
        for name in missing:
            field = arrow_schema.field(name)
            if not field.nullable:
                raise ValueError(f"expected column {name!r}, found columns {pf.schema_arrow.names}")
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
        return table.select(names).cast(arrow_schema)
    options = piece.get("options") or {}
    with fs.open_input_stream(path, compression="detect") as stream:
        if kind == "csv":
            header = str(options.get("header", "false")).lower() == "true"
            read = pacsv.ReadOptions(column_names=None if header else names,
                                     autogenerate_column_names=False)
            parse = pacsv.ParseOptions(delimiter=options.get("sep", options.get("delimiter", ",")))
            convert = pacsv.ConvertOptions(column_types=arrow_schema, include_columns=names)
            table = pacsv.read_csv(stream, read_options=read, parse_options=parse,
                                   convert_options=convert)
        elif kind == "json":
            parse = pajson.ParseOptions(explicit_schema=arrow_schema,
                                        unexpected_field_behavior="ignore")
            table = pajson.read_json(stream, parse_options=parse)
        else:
            raise ValueError(f"expected a piece kind of parquet, csv or json, found {kind!r}")
    return table.select(names).cast(arrow_schema)


class PartitionsDataSource(DataSource):
    """Options: ``plan``: JSON ``{"schema": <StructType JSON>, "partitions": [[piece]...]}``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return StructType.fromJson(json.loads(self.options["plan"])["schema"])

    def reader(self, schema: StructType) -> DataSourceReader:
        return _Reader(json.loads(self.options["plan"]), schema)


_registered: set[int] = set()


def register(spark: Any) -> None:
    """Register the data source with a session (once per session)."""
    key = id(spark)
    if key not in _registered:
        spark.dataSource.register(PartitionsDataSource)
        _registered.add(key)


def read_plan(spark: Any, schema: StructType, partitions: list[list[dict[str, Any]]],
              label: str = "") -> Any:
    """A DataFrame with one Spark partition per entry of ``partitions``."""
    register(spark)
    plan = {"schema": schema.jsonValue(), "partitions": partitions, "label": label}
    return spark.read.format(NAME).schema(schema).option("plan", json.dumps(plan)).load()
