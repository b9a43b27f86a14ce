"""A Delta table (delta-rs): staged files stay inside the table directory, invisible until one
Delta transaction adds them with the app transaction ``(spark_ckpt/<job>/<sink>, version)``;
delta-rs does not skip a repeated version by itself, so :meth:`DeltaSink.is_committed` checks
``transaction_version`` first. The commit's timestamps come from an injected
:class:`~spark_ckpt.clock.Clock` (the pipeline's, in a streaming pipeline)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.execution.job_graph import SinkSpec
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.sinks.files import arrow_schema_for, check_files
from spark_ckpt.sinks.sink import Sink
from spark_ckpt.sinks.stats import file_stats
from spark_ckpt.storage import Storage, delta_options, delta_table, is_delta_table, join

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pyspark.sql.types import StructType

__all__ = ["DeltaSink"]

log = logging.getLogger(__name__)


class DeltaSink(Sink):
    def __init__(self, spec: SinkSpec, job_id: str, *, clock: Clock | None = None) -> None:
        super().__init__(spec, job_id)
        self.clock = clock or SystemClock()
        self.store = Storage(spec.path)
        self.uri = self.store.spark_path(self.store.root)
        self.staging = join(self.store.root, "_spark_ckpt_staging", job_id)
        self._schema: pa.Schema | None = None

    def prepare(self, schema: StructType) -> None:
        from deltalake import DeltaTable

        arrow = arrow_schema_for(schema)
        self._schema = arrow
        if is_delta_table(self.uri):
            table = delta_table(self.uri)
            existing = pa.schema(table.schema())
            found = {f.name: f.type for f in existing}
            expected = {f.name: f.type for f in arrow}
            if found != expected:
                raise JobDefinitionError(
                    f"Delta sink {self.spec.name} at {self.uri}: the job writes columns "
                    f"{_fmt(expected)}, the table has {_fmt(found)}"
                )
            parts = list(table.metadata().partition_columns)
            if parts != list(self.spec.partition_by):
                raise JobDefinitionError(
                    f"Delta sink {self.spec.name}: the job partitions by "
                    f"{list(self.spec.partition_by)}, the table by {parts}"
                )
            if self.spec.mode == "error" and not self._txn_version() and table.file_uris():
                raise JobDefinitionError(
                    f"Delta sink {self.spec.name}: the table at {self.uri} already holds rows "
                    f"and the sink's mode is 'error' (the default, as in Spark); choose what "
                    f"the run does to them: mode='append', 'overwrite', "
                    f"'overwrite_partitions' or 'merge'"
                )
        else:
            DeltaTable.create(self.uri, arrow, mode="ignore",
                              partition_by=list(self.spec.partition_by) or None,
                              storage_options=delta_options(self.uri))

    def _txn_version(self) -> int:

        return delta_table(self.uri).transaction_version(self.app_id) or 0

    def next_version(self) -> int:
        return self._txn_version() + 1

    def is_committed(self, version: int) -> bool:
        return self._txn_version() >= version

    def committed_version(self) -> int | None:
        """The version of this sink's app transaction in the table, None if it has none."""
        version = self._txn_version()
        return version or None

    def commit(self, files: list[OutputFile], version: int | None, *,
               metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """Add ``files`` in one Delta transaction carrying the app transaction ``version``
        (skipped if the table already has it); ``version=None``: no app transaction (the
        caller knows by other means whether the files were committed)."""
        from deltalake import CommitProperties, Transaction
        from deltalake.transaction import AddAction

        if version is not None and self.is_committed(version):
            return {"skipped": True}
        check_files(self.spec.name, files)
        root = self.uri.rstrip("/") + "/"
        now = self.clock.now_ms()
        stats = self._stats(files)
        actions = [
            AddAction(
                # the plain relative path: delta-rs encodes it for the log itself (quoting
                # here made '@' or Spark's escaped partition values unreadable)
                path=f.path[len(root):] if f.path.startswith(root) else f.path,
                size=f.size,
                partition_values=f.partition_values,
                modification_time=now,
                data_change=True,
                stats=stat,
            )
            for f, stat in zip(files, stats, strict=True)
        ]
        table = delta_table(self.uri)
        schema = self._schema or pa.schema(table.schema())
        properties = CommitProperties(
            app_transactions=None if version is None else [
                Transaction(app_id=self.app_id, version=version)],
            custom_metadata={"spark_ckpt.job_id": self.job_id, **(metadata or {})},
        )
        mode = self.spec.mode
        if mode == "merge":
            return self._merge(table, files, schema, properties)
        removes: list[Any] = []
        if mode == "overwrite_partitions":
            removes = self._removes_of_partitions(table, files, now)
        table.create_write_transaction(
            actions + removes,
            mode="overwrite" if mode == "overwrite" else "append",
            schema=schema,
            partition_by=list(self.spec.partition_by) or None,
            commit_properties=properties,
        )
        table.update_incremental()
        return {"table_version": table.version(), "files": len(files),
                "removed": len(removes)}

    def _stats(self, files: list[OutputFile]) -> list[str]:
        """Each file's column statistics from its Parquet footer (readers skip files with
        them); footers are read a few at a time (one small read each, at the file's end)."""
        from concurrent.futures import ThreadPoolExecutor

        parts = set(self.spec.partition_by)
        if len(files) <= 1:
            return [file_stats(f.path, f.rows, parts) for f in files]
        with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
            return list(pool.map(lambda f: file_stats(f.path, f.rows, parts), files))

    def _removes_of_partitions(self, table: Any, files: list[OutputFile],
                               now: int) -> list[Any]:
        """Remove actions for every file in a partition the run wrote (dynamic partition
        overwrite: the other partitions keep their rows)."""
        from deltalake.transaction import RemoveAction

        columns = list(self.spec.partition_by)
        schema = self._schema or pa.schema(table.schema())
        types = [schema.field(c).type for c in columns]
        # Compared as typed values: Spark spells a partition directory "true" or
        # "2026-11-22 00:00:00", the table's log "True"-less typed values.
        written = {tuple(_typed(f.partition_values.get(c), t) for c, t in zip(columns, types,
                                                                               strict=True))
                   for f in files}
        existing = pa.table(table.get_add_actions(flatten=True)).to_pylist()
        removes = []
        for add in existing:
            values = tuple(_typed(add.get(f"partition.{c}"), t)
                           for c, t in zip(columns, types, strict=True))
            if values in written:
                texts = {c: _partition_text(add.get(f"partition.{c}")) for c in columns}
                removes.append(RemoveAction(path=add["path"], data_change=True,
                                            deletion_timestamp=now, size=add["size_bytes"],
                                            partition_values=texts))
        return removes

    def _merge(self, table: Any, files: list[OutputFile], schema: pa.Schema,
               properties: Any) -> dict[str, Any]:
        """Upsert the staged rows on the sink's keys in one Delta commit (delta-rs MERGE)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        def batches() -> Iterator[pa.RecordBatch]:
            for f in files:
                store = Storage(f.path)
                data = pq.read_table(store.root, filesystem=store.fs)
                for column, value in f.partition_values.items():
                    field = schema.field(column)
                    array = pa.array([value] * data.num_rows, pa.string())
                    data = data.append_column(column, pc.cast(array, field.type))
                yield from data.select(schema.names).cast(schema).to_batches()

        source = pa.RecordBatchReader.from_batches(schema, batches())
        predicate = " AND ".join(f"t.`{k}` = s.`{k}`" for k in self.spec.keys)
        metrics = (table.merge(source, predicate, source_alias="s", target_alias="t",
                               commit_properties=properties)
                   .when_matched_update_all().when_not_matched_insert_all().execute())
        table.update_incremental()
        return {"table_version": table.version(), "files": len(files),
                "merged": {k: v for k, v in metrics.items() if k.startswith("num_target")}}


def _typed(value: Any, type_: pa.DataType) -> Any:
    """A partition value (Spark's directory text, or a typed value from the Delta log) as
    a Python value of the column's type, so both spellings compare equal."""
    if value is None:
        return None
    if not isinstance(value, str):
        if pa.types.is_timestamp(type_) and getattr(value, "tzinfo", None) is not None:
            return value.replace(tzinfo=None) if type_.tz is None else value
        return value
    if pa.types.is_timestamp(type_) and type_.tz is not None:
        naive = pa.array([value]).cast(pa.timestamp(type_.unit))
        return pa.compute.assume_timezone(naive, type_.tz)[0].as_py()
    return pa.array([value]).cast(type_)[0].as_py()


def _partition_text(value: Any) -> str | None:
    """A partition value as Delta's log spells it."""
    if value is None:
        return None
    if hasattr(value, "isoformat"):
        text: str = value.isoformat(sep=" ") if hasattr(value, "hour") else value.isoformat()
        return text
    return str(value)


def _fmt(columns: dict[str, Any]) -> str:
    return "(" + ", ".join(f"{k} {v}" for k, v in columns.items()) + ")"
