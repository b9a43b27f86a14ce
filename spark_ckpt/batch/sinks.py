"""Sinks commit a job's output once, idempotently, after every partition has staged its files.

Spark's Parquet writer stages the files (batch.vertex_runner), each write in a directory of its
own under ``<sink>/_spark_ckpt_staging/<job>/<vertex>/``; the driver commits them:

* Delta (delta-rs): the staged files stay where they are, inside the table directory and
  invisible until the commit adds them (Delta paths may name any file under the table). The
  commit is one Delta transaction carrying the app transaction
  ``(spark_ckpt/<job>/<sink>, version)``; delta-rs does not skip a repeated version by itself,
  so :meth:`DeltaSink.is_committed` checks ``transaction_version`` first.
* Parquet directory: the commit checks every staged file, creates the marker
  ``_spark_ckpt_commits/<job>-v<version>.json`` create-if-absent (only one driver can), moves
  the files into place, and marks the marker committed. A crash in between is finished by the
  next attempt from the marker's file list, as MapReduce's committer recovers; a new version is
  never begun while an earlier one of the same job is half done.

The version used is logged in ``SinkCommitStarted`` before the commit, so a recovered driver
asks the sink whether *that* version landed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.parse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from spark_ckpt.errors import CommitError, FormatVersionError, JobDefinitionError, RecordError
from spark_ckpt.execution.graph import SinkSpec
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.faults import fault_point
from spark_ckpt.formats import dump_record, load_record
from spark_ckpt.storage import Storage, join, stat_any

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = ["DeltaSink", "ParquetSink", "Sink", "make_sink", "micros_timestamps",
           "partition_values", "written_files"]

log = logging.getLogger(__name__)


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
    key = "spark.sql.parquet.outputTimestampType"
    before = spark.conf.get(key, None)
    if before == "TIMESTAMP_MICROS":
        yield
        return
    spark.conf.set(key, "TIMESTAMP_MICROS")
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)


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


def _check_files(sink: str, files: list[OutputFile]) -> None:
    """delta-rs accepts an AddAction for a file that does not exist; never commit one."""
    sizes = stat_any(f.path for f in files)
    for f, size in zip(files, sizes, strict=True):
        if size != f.size:
            found = "missing" if size is None else f"{size} bytes"
            raise CommitError(
                f"sink {sink}: staged file {f.path} should be {f.size} bytes, found {found}; "
                "refusing to commit (the partition will be re-run on the next attempt)"
            )


class Sink:
    def __init__(self, spec: SinkSpec, job_id: str) -> None:
        self.spec = spec
        self.job_id = job_id
        self.app_id = f"spark_ckpt/{job_id}/{spec.name}"

    def prepare(self, schema: StructType) -> None:
        """Check or create the target before files are staged for it."""
        raise NotImplementedError

    def staging_dir(self, vertex_id: str, tag: str) -> str:
        """A directory (Spark URI) only one write uses, under this sink's staging area."""
        return self.store.spark_path(join(self.staging, vertex_id, tag))

    def locate(self, paths: list[str]) -> list[str]:
        """Where staged files are now (a Parquet commit moves them)."""
        return paths

    def next_version(self) -> int:
        raise NotImplementedError

    def is_committed(self, version: int) -> bool:
        raise NotImplementedError

    def commit(self, files: list[OutputFile], version: int) -> dict[str, Any]:
        raise NotImplementedError


class DeltaSink(Sink):
    def __init__(self, spec: SinkSpec, job_id: str) -> None:
        super().__init__(spec, job_id)
        self.store = Storage(spec.path)
        self.uri = self.store.spark_path(self.store.root)
        self.staging = join(self.store.root, "_spark_ckpt_staging", job_id)
        self._schema: pa.Schema | None = None

    def prepare(self, schema: StructType) -> None:
        from deltalake import DeltaTable

        arrow = arrow_schema_for(schema)
        self._schema = arrow
        if DeltaTable.is_deltatable(self.uri):
            table = DeltaTable(self.uri)
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
                              partition_by=list(self.spec.partition_by) or None)

    def _txn_version(self) -> int:
        from deltalake import DeltaTable

        return DeltaTable(self.uri).transaction_version(self.app_id) or 0

    def next_version(self) -> int:
        return self._txn_version() + 1

    def is_committed(self, version: int) -> bool:
        return self._txn_version() >= version

    def commit(self, files: list[OutputFile], version: int, *,
               metadata: dict[str, str] | None = None) -> dict[str, Any]:
        from deltalake import CommitProperties, DeltaTable, Transaction
        from deltalake.transaction import AddAction

        if self.is_committed(version):
            return {"skipped": True}
        _check_files(self.spec.name, files)
        root = self.uri.rstrip("/") + "/"
        now = int(time.time() * 1000)
        actions = [
            AddAction(
                # the plain relative path: delta-rs encodes it for the log itself (quoting
                # here made '@' or Spark's escaped partition values unreadable)
                path=f.path[len(root):] if f.path.startswith(root) else f.path,
                size=f.size,
                partition_values=f.partition_values,
                modification_time=now,
                data_change=True,
                stats=json.dumps({"numRecords": f.rows}),
            )
            for f in files
        ]
        table = DeltaTable(self.uri)
        schema = self._schema or pa.schema(table.schema())
        properties = CommitProperties(
            app_transactions=[Transaction(app_id=self.app_id, version=version)],
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

        def batches():  # noqa: ANN202
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


class ParquetSink(Sink):
    def __init__(self, spec: SinkSpec, job_id: str) -> None:
        super().__init__(spec, job_id)
        if spec.mode != "append":
            raise JobDefinitionError(
                f"Parquet sink {spec.name}: expected mode 'append', found {spec.mode!r}; a "
                "Parquet directory cannot be replaced atomically (use a Delta sink)"
            )
        self.store = Storage(spec.path)
        self.staging = join(self.store.root, "_spark_ckpt_staging", job_id)
        self.commits = join(self.store.root, "_spark_ckpt_commits")

    def prepare(self, schema: StructType) -> None:
        self.store.makedirs(self.staging)
        self._finish_half_done()

    def _finish_half_done(self) -> None:
        """Complete any commit of this job that a crash left half done, before a new one."""
        for version in self._versions():
            marker = self._read_marker(version)
            if marker is not None and marker["status"] == "committing":
                log.warning("Parquet sink %s: finishing commit v%d of job %s, begun before",
                            self.spec.name, version, self.job_id)
                self._move(version, marker)

    def locate(self, paths: list[str]) -> list[str]:
        moved: dict[str, str] | None = None
        out = []
        for path in paths:
            if self.store.exists(self.store.fs_path(path)):
                out.append(path)
                continue
            if moved is None:
                moved = {}
                for version in self._versions():
                    marker = self._read_marker(version)
                    if marker is not None:
                        moved.update({src: dst for src, dst, _ in marker["moves"]})
            dst = moved.get(self.store.fs_path(path))
            out.append(self.store.spark_path(dst) if dst else path)
        return out

    def _marker(self, version: int) -> str:
        return join(self.commits, f"{self.job_id}-v{version:05d}.json")

    def _versions(self) -> list[int]:
        prefix = f"{self.job_id}-v"
        return sorted(int(i.base_name[len(prefix):-5]) for i in
                      self.store.list_files(self.commits, recursive=False)
                      if i.base_name.startswith(prefix) and i.base_name.endswith(".json")
                      and i.base_name[len(prefix):-5].isdigit())

    def next_version(self) -> int:
        return max(self._versions(), default=0) + 1

    def purge_markers(self, below: int) -> int:
        """Delete the commit markers of versions ``< below`` (a streaming sink's batches
        whose records are purged: they never run again); return how many went."""
        gone = 0
        for version in self._versions():
            if version >= below:
                break
            self.store.fs.delete_file(self._marker(version))
            gone += 1
        return gone

    def _read_marker(self, version: int) -> dict[str, Any] | None:
        path = self._marker(version)
        if not self.store.exists(path):
            return None
        try:
            return load_record(self.store.read_bytes(path), "parquet-sink-commit", (1,),
                               where=self.store.spark_path(path))
        except RecordError:
            raise
        except FormatVersionError as exc:
            # A torn marker (a crash mid-write on a store without atomic publish) could be a
            # "committing" one (nothing moved) or a "committed" one (every file moved): no
            # guess is safe, so the commit stops here and names the file.
            raise RecordError(
                f"Parquet sink {self.spec.name}: commit marker {self.store.spark_path(path)}: "
                f"{exc}; its files may or may not have been moved, so it is neither redone "
                "nor skipped: compare its staged and committed files and restore the marker"
            ) from exc

    def is_committed(self, version: int) -> bool:
        marker = self._read_marker(version)
        return marker is not None and marker["status"] == "committed"

    def commit(self, files: list[OutputFile], version: int) -> dict[str, Any]:
        existing = self._read_marker(version)
        if existing is None:
            _check_files(self.spec.name, files)  # before the marker: a refused commit leaves none
            moves = []
            depth = len(self.spec.partition_by) + 1  # <p1=..>/.../<file> under its write dir
            for f in files:
                relative = "/".join(self.store.fs_path(f.path).split("/")[-depth:])
                moves.append([self.store.fs_path(f.path), join(self.store.root, relative),
                              f.size])
            body = {"job_id": self.job_id, "version": version, "status": "committing",
                    "moves": moves}
            if self.store.create_exclusive(self._marker(version),
                                           dump_record("parquet-sink-commit", 1, body)):
                return self._move(version, body)
            existing = self._read_marker(version)
            if existing is None:
                raise CommitError(
                    f"Parquet sink {self.spec.name}: commit marker v{version} existed when "
                    f"this driver tried to create it, then was gone ({self._marker(version)})"
                )
        if existing["status"] == "committed":
            return {"skipped": True}
        log.warning("Parquet sink %s: finishing commit v%d begun by an earlier attempt of "
                    "job %s", self.spec.name, version, self.job_id)
        return self._move(version, existing)

    def _move(self, version: int, body: dict[str, Any]) -> dict[str, Any]:
        moves = body["moves"]
        for i, (src, dst, _size) in enumerate(moves):
            src_exists, dst_exists = self.store.exists(src), self.store.exists(dst)
            if src_exists:
                self.store.move(src, dst)
            elif not dst_exists:
                raise CommitError(
                    f"Parquet sink {self.spec.name}: commit v{version} lost {src}; it is "
                    f"neither staged nor at {dst}"
                )
            if i == 0:
                fault_point("sink.commit.files")
        self.store.write_atomic(
            self._marker(version),
            dump_record("parquet-sink-commit", 1, body | {"status": "committed"}))
        self.store.delete_dir(self.staging)  # what is left: files of no committed partition
        return {"files": len(moves)}


def make_sink(spec: SinkSpec, job_id: str) -> Sink:
    if spec.kind == "delta":
        return DeltaSink(spec, job_id)
    return ParquetSink(spec, job_id)


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
        return value.isoformat(sep=" ") if hasattr(value, "hour") else value.isoformat()
    return str(value)


def _fmt(columns: dict[str, Any]) -> str:
    return "(" + ", ".join(f"{k} {v}" for k, v in columns.items()) + ")"
