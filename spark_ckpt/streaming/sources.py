"""Replayable streaming sources: the position of each batch is an offset the allocation records.

Every source answers four questions for the ReceiverTracker:

* ``plan()``: what the next batch would read (a JSON-able *piece*: files, versions, a row
  range or received blocks), never more than the source's per-batch limits;
* ``advance(piece)``: the piece was recorded durably; move past it;
* ``restore(pieces)``: rebuild the position from the recorded pieces after a restart;
* ``read(run, piece)``: the piece as a DataFrame, identical every time it is read.

Sources here: a directory of files (:class:`FileStreamSource`), a Delta table
(:class:`DeltaStreamSource`) and a deterministic generator (:class:`GeneratorSource`).
Receiver-based sources, for data that cannot be replayed, are in receiver.py.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Protocol

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import JobDefinitionError, RecordError, SourceError
from spark_ckpt.formats import ANY, PATH, STR, ListOf, MapOf, Opt, Row, integer, validate
from spark_ckpt.storage import Storage, join
from spark_ckpt.streaming.batch import union_by_name
from spark_ckpt.streaming.delta_log import (
    AddedFile,
    CommitKind,
    DeltaCommit,
    commit_path,
    decode_path,
    earliest_commit,
    is_absolute,
    read_commit,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from spark_ckpt.options import Settings
    from spark_ckpt.streaming.batch import BatchRun

__all__ = ["DeltaStreamSource", "FileStreamSource", "GeneratorSource", "Source"]

log = logging.getLogger(__name__)

CORRUPT_COLUMN = "_corrupt_record"
JSON_MAX_STRING_LEN = 20_000_000  # Spark's default maxStringLen (Jackson's limit)
_SYSTEM_CLOCK = SystemClock()  # a source's clock until it is bound to a pipeline that has one
_KEEP = 1 << 62  # the mtime of a seen file recorded before mtimes were: never forgotten


class SourceScope(Protocol):
    """What a source reads of the pipeline it is bound to: its options, the checkpoint
    directory it keeps its records under, and the schema recorded for it (and, when it has one,
    its ``clock``: see :attr:`Source.clock`)."""

    settings: Settings
    storage: Storage
    root: str

    def recorded_schema(self, source: str) -> StructType | None: ...


class Source:
    """Base class of streaming sources. ``name`` is unique within a pipeline."""

    kind = "source"
    PIECE: Any = None  # the spec of this source's recorded pieces (see spark_ckpt.formats)

    def __init__(self, name: str) -> None:
        self.name = name
        self.pipeline: Any = None  # the pipeline it is bound to (a SourceScope)

    def bind(self, pipeline: SourceScope) -> None:
        self.pipeline = pipeline

    @property
    def clock(self) -> Clock:
        """The clock of the pipeline this source is bound to: its ``clock`` when it has one,
        else (and before it is bound) the system clock."""
        clock = getattr(self.pipeline, "clock", None)
        return clock if isinstance(clock, Clock) else _SYSTEM_CLOCK

    def schema(self) -> StructType:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def check_piece(self, piece: Any, where: str) -> None:
        """Refuse a recorded piece that is not this source's (a hand edit, a bug): RecordError
        naming ``where`` (the record's file), the field, what was expected and what was found."""
        field = f"pieces.{self.name}"
        try:
            if self.PIECE is not None:
                validate(piece, self.PIECE, field)
            self._check_places(piece, field)
        except RecordError as exc:
            raise RecordError(f"{where}: allocation record {exc}; correct the field or restore "
                              "the file (nothing was run from it)") from None

    def _check_places(self, piece: dict[str, Any], field: str) -> None:
        """Where the piece's files must be (beyond the spec); RecordError(field...) if not."""

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        """Rebuild the position from ``(batch id, piece)`` records, oldest first."""

    def plan(self) -> dict[str, Any]:
        raise NotImplementedError

    def advance(self, piece: dict[str, Any]) -> None:
        raise NotImplementedError

    def rows(self, piece: dict[str, Any]) -> int | None:
        return piece.get("rows")

    def position(self) -> dict[str, Any]:
        """Where the source stands, for the driver-state record."""
        return {}

    def is_empty(self, piece: dict[str, Any]) -> bool:
        return self.rows(piece) == 0

    def read(self, run: BatchRun, piece: dict[str, Any]) -> DataFrame:
        raise NotImplementedError

    def empty(self, spark: Any) -> DataFrame:
        """No rows, in a form Spark's optimizer recognizes, so an empty batch runs no job."""
        from pyspark.sql import functions as F

        return spark.range(1).select(
            *[F.lit(None).cast(f.dataType).alias(f.name) for f in self.schema().fields]
        ).where(F.lit(False))

    def start(self) -> None:
        """Start receiving (receiver sources)."""

    def stop(self) -> None:
        """Stop receiving (receiver sources)."""

    def purge(self, pieces_below: list[tuple[int, dict[str, Any]]], below: int) -> None:
        """Allocation records of batches ``< below`` are about to be deleted."""


# -- a directory of files ----------------------------------------------------------------------
class FileStreamSource(Source):
    """New files of a directory, oldest first, in the stable order (modification time, path).

    Files must appear atomically (written elsewhere, then moved in); names starting with ``.``
    or ``_`` are ignored. Parquet files are checked (footer, columns) before they are
    allocated, so a malformed file stops the pipeline with its name before any batch reads it.
    JSON and CSV rows that do not parse go to the pipeline's dead-letter table with their file
    and the reason, are counted, and the batch goes on.
    """

    kind = "files"
    FORMATS = ("parquet", "json", "csv")
    PIECE = {"files": ListOf(Row(PATH, integer(0), integer(0))), "bytes": integer(0),
             "rows": Opt(integer(0))}

    def __init__(self, name: str, path: str, fmt: str, schema: StructType | str | None = None,
                 *, max_files_per_batch: int | None = None,
                 max_bytes_per_batch: int | None = None,
                 options: dict[str, str] | None = None) -> None:
        super().__init__(name)
        if fmt not in self.FORMATS:
            raise JobDefinitionError(
                f"file source {name}: expected a format of {', '.join(self.FORMATS)}, found "
                f"{fmt!r}"
            )
        if fmt != "parquet" and schema is None:
            raise JobDefinitionError(
                f"file source {name}: a {fmt} source needs a schema (a StructType or a DDL "
                "string such as 'id BIGINT, name STRING'); found none"
            )
        for label, limit in (("max_files_per_batch", max_files_per_batch),
                             ("max_bytes_per_batch", max_bytes_per_batch)):
            if limit is not None and limit < 1:
                raise JobDefinitionError(
                    f"file source {name}: expected {label} >= 1 or None, found {limit}"
                )
        self.path = path
        self.fmt = fmt
        self._declared = schema
        self._schema: StructType | None = None
        self.max_files = max_files_per_batch
        self.max_bytes = max_bytes_per_batch
        self.options = dict(options or {})
        self.store = Storage(path)
        # path -> mtime (ns) of every file taken within the age window; older entries are
        # forgotten, and files older than the window are never taken (Spark's maxFileAge)
        self.seen: dict[str, int] = {}
        self.latest_ns = 0
        self.late_files = 0
        self._warned_late: set[str] = set()

    def _max_age_ns(self) -> int:
        return int(self.pipeline.settings.stream_file_source_max_file_age_ms) * 1_000_000

    def _threshold_ns(self) -> int:
        return self.latest_ns - self._max_age_ns() if self.latest_ns else 0

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "format": self.fmt}

    # -- schema --------------------------------------------------------------------------
    def schema(self) -> StructType:
        from pyspark.sql.types import StructType

        if self._schema is None:
            declared = self._declared
            if isinstance(declared, str):
                declared = StructType.fromDDL(declared)
            if declared is None:  # Parquet: the first file's, recorded by the pipeline
                declared = self.pipeline.recorded_schema(self.name) or self._infer()
            self._schema = declared
        return self._schema

    def _infer(self) -> StructType:
        import pyarrow.parquet as pq

        from spark_ckpt.batch.sources import footer_schema

        files = [f for f in self._listing() if f[1] > 0]  # empty files have no schema
        if not files:
            raise SourceError(
                f"file source {self.name}: cannot infer the schema of {self.path}: no Parquet "
                "file there yet; pass schema= (a StructType or DDL string)"
            )
        path = files[0][0]
        try:
            schema, unknown = footer_schema(pq.read_metadata(self.store.fs_path(path),
                                                             filesystem=self.store.fs))
        except Exception as exc:
            raise SourceError(
                f"file source {self.name}: expected a Parquet file, cannot read {path}: {exc}"
            ) from exc
        spark = getattr(self.pipeline, "spark", None)
        if unknown and spark is not None:  # types only Spark maps (unsigned integers, ...)
            return spark.read.options(**self.options).parquet(path).schema
        return schema

    # -- positions -----------------------------------------------------------------------
    def _listing(self) -> list[tuple[str, int, int]]:
        infos = self.store.list_files(self.store.root, recursive=False)
        if not infos and not self.store.exists(self.store.root):
            # not the same as an empty directory: a wrong path would otherwise wait forever
            raise SourceError(
                f"file source {self.name}: expected a directory of {self.fmt} files at "
                f"{self.path}, found that the path does not exist; create it (it may stay "
                "empty) or fix the path"
            )
        files = [
            (self.store.spark_path(i.path), i.size, i.mtime_ns or 0) for i in infos
            if not i.base_name.startswith((".", "_")) and ".tmp" not in i.base_name
        ]
        files.sort(key=lambda f: (f[2], f[0]))
        return files

    def _check_places(self, piece: dict[str, Any], field: str) -> None:
        directory = self.store.spark_path(self.store.root).rstrip("/")
        for i, (path, _size, _mtime) in enumerate(piece["files"]):
            if path.rsplit("/", 1)[0] != directory:
                raise RecordError(f"field {field}.files[{i}][0]: expected a file directly in "
                                  f"{directory}, found {path!r}")

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        self.seen = dict(self._snapshot())
        for _batch, piece in pieces:
            self._take(piece.get("files", []))
        real = [m for m in self.seen.values() if m != _KEEP]
        if real:
            self.latest_ns = max(self.latest_ns, *real)

    def _take(self, files: list[list[Any]]) -> None:
        for path, _size, mtime in files:
            self.seen[path] = int(mtime)
            self.latest_ns = max(self.latest_ns, int(mtime))

    def _snapshot_dir(self) -> str:
        return join(self.pipeline.root, "sources", self.name)

    def _snapshot(self) -> list[tuple[str, int]]:
        """``(path, mtime ns)`` of the newest seen-files snapshot. Snapshots written before
        mtimes were kept have none: their files are kept for good (``_KEEP``)."""
        import pyarrow.parquet as pq

        store = self.pipeline.storage
        snaps = sorted(i.path for i in store.list_files(self._snapshot_dir(), recursive=False)
                       if i.base_name.startswith("seen-") and i.base_name.endswith(".parquet"))
        if not snaps:
            return []
        table = pq.read_table(snaps[-1], filesystem=store.fs)
        self._check_snapshot(store.spark_path(snaps[-1]), table)
        paths = table.column("path").to_pylist()
        if "mtime_ns" in table.column_names:
            return list(zip(paths, table.column("mtime_ns").to_pylist(), strict=True))
        return [(p, _KEEP) for p in paths]

    def _check_snapshot(self, where: str, table: Any) -> None:
        """A seen-files snapshot is ``path`` (string) and ``mtime_ns`` (int64), no nulls, every
        path a file of this source's directory; anything else is refused (a hand edit)."""
        import pyarrow as pa

        def refuse(field: str, expected: str, found: Any) -> None:
            raise RecordError(f"{where}: seen-files snapshot column {field}: expected {expected}, "
                              f"found {found}; correct or restore the file (nothing was run "
                              "from it)")

        for column, kind in (("path", pa.string()), ("mtime_ns", pa.int64())):
            if column not in table.column_names:
                if column == "path":
                    refuse(column, "a column", "none")
                continue
            if table.schema.field(column).type != kind:
                refuse(column, f"type {kind}", f"type {table.schema.field(column).type}")
            if table.column(column).null_count:
                refuse(column, "no nulls", f"{table.column(column).null_count} null(s)")
        directory = self.store.spark_path(self.store.root).rstrip("/")
        for path in table.column("path").to_pylist():
            if ".." in path.split("/") or path.rsplit("/", 1)[0] != directory:
                refuse("path", f"files directly in {directory}", repr(path))

    def purge(self, pieces_below: list[tuple[int, dict[str, Any]]], below: int) -> None:
        """Fold the files of the records about to go into a seen-files snapshot, keeping only
        the files within the age window (older ones are never taken again anyway)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        store = self.pipeline.storage
        seen = dict(self._snapshot())
        for _batch, piece in pieces_below:
            seen.update((f[0], int(f[2])) for f in piece.get("files", []))
        threshold = self._threshold_ns()
        seen = {p: m for p, m in seen.items() if m >= threshold}
        for path in [p for p, m in self.seen.items() if m < threshold]:
            del self.seen[path]
        directory = self._snapshot_dir()
        store.makedirs(directory)
        buffer = pa.BufferOutputStream()
        paths = sorted(seen)
        pq.write_table(pa.table({"path": pa.array(paths, pa.string()),
                                 "mtime_ns": pa.array([seen[p] for p in paths], pa.int64())}),
                       buffer)
        store.write_atomic(join(directory, f"seen-{below:012d}.parquet"),
                           buffer.getvalue().to_pybytes())
        for info in store.list_files(directory, recursive=False):
            if info.base_name.startswith("seen-") and info.base_name < f"seen-{below:012d}":
                store.fs.delete_file(info.path)

    def plan(self) -> dict[str, Any]:
        chosen: list[list[Any]] = []
        total = 0
        threshold = self._threshold_ns()
        for path, size, mtime in self._listing():
            if path in self.seen:
                continue
            if mtime < threshold:  # older than the window: never taken (maxFileAge)
                if path not in self._warned_late:
                    self._warned_late.add(path)
                    self.late_files += 1
                    log.warning("File source %s: ignoring %s, older than the newest file "
                                "taken minus spark.ckpt.stream.fileSource.maxFileAgeMs", self.name,
                                path)
                continue
            if self.max_files is not None and len(chosen) >= self.max_files:
                break
            if self.max_bytes is not None and chosen and total + size > self.max_bytes:
                break
            chosen.append([path, size, mtime])
            total += size
        rows = self._check_parquet(chosen) if self.fmt == "parquet" else None
        return {"files": chosen, "bytes": total, "rows": rows if chosen else 0}

    def _check_parquet(self, files: list[list[Any]]) -> int:
        """Read the footers: a file that is not Parquet, or whose schema drifted, stops here,
        before anything is allocated from it. With a declared schema or ``mergeSchema``,
        Spark's answer: columns added are ignored, nullable columns missing read as null;
        otherwise (the schema recorded from the first file) any added, missing or retyped
        column is drift. Empty (0-byte) files hold no rows, as Spark reads them."""
        import pyarrow.parquet as pq

        from spark_ckpt.batch.sources import case_sensitive, footer_schema, merge_schema, \
            parquet_drift

        expected = self.schema()
        spark = getattr(self.pipeline, "spark", None)
        lenient = self._declared is not None or merge_schema(spark, self.options)
        sensitive = case_sensitive(spark)
        rows = 0
        for path, size, _mtime in files:
            if size == 0:
                continue
            try:
                meta = pq.read_metadata(self.store.fs_path(path), filesystem=self.store.fs)
                found, unknown = footer_schema(meta)
            except Exception as exc:
                raise SourceError(
                    f"file source {self.name}: expected a Parquet file, found unreadable {path} "
                    f"({exc}); move it out of {self.path} (nothing was allocated from it)"
                ) from exc
            drift = parquet_drift(found, expected, lenient=lenient, case_sensitive=sensitive,
                                  unknown=unknown)
            if drift:
                origin = "declared" if self._declared is not None else \
                    "recorded from the source's first file"
                raise SourceError(
                    f"file source {self.name}: {path} does not match the schema ({drift}): "
                    f"expected {expected.simpleString()} ({origin}), found "
                    f"{found.simpleString()}. Nothing was allocated from it: move it out of "
                    f"{self.path} (or fix it) and restart; to read such files, declare the "
                    "schema (missing columns read as null, extra ones are ignored) or set the "
                    "option mergeSchema=true"
                )
            rows += meta.num_rows
        return rows

    def advance(self, piece: dict[str, Any]) -> None:
        self._take(piece["files"])

    def position(self) -> dict[str, Any]:
        return {"files_seen": len(self.seen), "late_files_ignored": self.late_files}

    def is_empty(self, piece: dict[str, Any]) -> bool:
        return not piece["files"]

    # -- reading -------------------------------------------------------------------------
    def read(self, run: BatchRun, piece: dict[str, Any]) -> DataFrame:
        spark = run.spark
        files = self._present([f[0] for f in piece["files"]], run)
        if not files:
            return self.empty(spark)
        schema = self.schema()
        if self.fmt == "parquet":
            return spark.read.options(**self.options).schema(schema).parquet(*files)
        return self._read_text(run, files, schema)

    def _present(self, files: list[str], run: BatchRun) -> list[str]:
        """The batch's files; one deleted since the batch was allocated fails the batch, naming
        it (with ignoreMissingFiles, Structured Streaming's answer: it is skipped)."""
        from spark_ckpt.batch.sources import ignore_missing_files
        from spark_ckpt.storage import stat_any

        missing = [f for f, size in zip(files, stat_any(files), strict=True) if size is None]
        if not missing:
            return files
        if not ignore_missing_files(run.spark, self.options):
            raise SourceError(
                f"file source {self.name}: batch {run.batch_id} was allocated file "
                f"{missing[0]}, found it missing ({len(missing)} missing file(s)); the batch "
                "did not run. Put the file back and restart, or set "
                "spark.sql.files.ignoreMissingFiles=true to run the batch without it, as "
                "Spark's file source does"
            )
        log.warning("File source %s: batch %d skips %d missing file(s) (e.g. %s): "
                    "spark.sql.files.ignoreMissingFiles=true", self.name, run.batch_id,
                    len(missing), missing[0])
        return [f for f in files if f not in set(missing)]

    def _read_text(self, run: BatchRun, files: list[str], schema: StructType) -> DataFrame:
        from pyspark import StorageLevel
        from pyspark.sql import functions as F
        from pyspark.sql.types import StringType, StructField, StructType

        with_corrupt = StructType(list(schema.fields) +
                                  [StructField(CORRUPT_COLUMN, StringType(), True)])
        reader = (run.spark.read.options(**self.options).schema(with_corrupt)
                  .option("mode", "PERMISSIVE").option("columnNameOfCorruptRecord",
                                                       CORRUPT_COLUMN))
        raw = reader.json(files) if self.fmt == "json" else reader.csv(files)
        parsed = raw.withColumn("_ckpt_file", F.col("_metadata.file_path"))
        parsed = parsed.persist(StorageLevel.MEMORY_AND_DISK)
        run.on_cleanup(parsed.unpersist)
        counts = parsed.agg(F.count(F.lit(1)).alias("rows"),
                            F.count(CORRUPT_COLUMN).alias("bad")).first()
        rows, bad = int(counts["rows"]), int(counts["bad"])
        if run.batch_id == run.stats.batch_id:
            run.stats.input_rows[self.name] = rows
        if bad:
            reason = F.lit(f"malformed {self.fmt} record (does not match the schema "
                           f"{schema.simpleString()})")
            if self.fmt == "json":  # Spark's JSON reader refuses longer strings as malformed
                limit = int(next((v for k, v in self.options.items()
                                  if k.lower() == "maxstringlen"), JSON_MAX_STRING_LEN))
                reason = F.when(F.length(CORRUPT_COLUMN) > limit, F.lit(
                    f"json record longer than the JSON reader's maxStringLen={limit} "
                    "characters: a string in it may exceed that limit (Spark reads such a "
                    "record as malformed); set the source option maxStringLen to read it, "
                    f"or it does not match the schema {schema.simpleString()}")).otherwise(reason)
            run.dead_letter(self.name, parsed.where(F.col(CORRUPT_COLUMN).isNotNull()).select(
                F.col("_ckpt_file").alias("file"), F.col(CORRUPT_COLUMN).alias("record"),
                reason.alias("reason"),
            ), bad)
        return parsed.where(F.col(CORRUPT_COLUMN).isNull()).drop(CORRUPT_COLUMN, "_ckpt_file")


# -- a Delta table -----------------------------------------------------------------------------
class DeltaStreamSource(Source):
    """Rows of a Delta table: its rows as they are when the pipeline starts, then the new rows
    of each later version, followed through the table's commit log.

    Where a new pipeline starts (as Delta Lake's own streaming source does):

    * by default (``starting_version=None``) the first batch reads the table's *snapshot*: the
      files of the latest version when the batch is planned (one batch, whatever
      ``max_versions_per_batch`` says: a snapshot is one version, however many commits made
      it). What commits before it did (appends, deletes, updates, compactions) is in the
      snapshot already and is never read as a change, and commits cleaned up from the log do
      not matter. Later batches read the commits after that version;
    * ``starting_version=k`` (Delta's ``startingVersion``): no snapshot; the first batch reads
      the changes of versions ``k, k+1, ...``, commit by commit as below (a DELETE among them
      stops the pipeline by default); the rows the table held before ``k`` are not read.

    A restarted pipeline goes on from its recorded position, whatever these say.

    A batch reads the files that the commits since the previous batch added as new data (at
    most ``max_versions_per_batch`` versions; a skipped version counts as read); Spark reads the
    data files, partition values, sizes and row counts come from the add actions. Commits that
    change no data (``dataChange=false``: OPTIMIZE, Z-order, compaction; VACUUM, table
    properties) are skipped. A commit that removes data files stops the pipeline with a
    :class:`SourceError` naming the version and the operation, unless one of Delta Lake's
    streaming options says otherwise:

    * ``ignore_deletes`` (Delta's ``ignoreDeletes``): a commit that only removes files (DELETE
      of whole files or partitions) is skipped; one that also adds files still stops;
    * ``ignore_changes`` (Delta's deprecated ``ignoreChanges``): a commit that rewrites files
      (UPDATE, MERGE, DELETE inside files, overwrite) is read as if it appended the files it
      added, so the rows it did not change come again (logged as a warning);
    * ``skip_change_commits`` (Delta's ``skipChangeCommits``): every commit that removes files
      is skipped, the files it added too.

    A schema the pipeline's source schema cannot read, deletion vectors (in a commit read or in
    the snapshot) and column mapping stop the pipeline by name: Spark's Parquet reader would
    not apply them and would give wrong rows. Each piece records the table's id
    (``metaData.id``): a table deleted and created again at the same path has another id, and
    the pipeline stops naming both (Delta Lake's source refuses it too), instead of taking the
    new table's versions for the old one's.
    """

    kind = "delta"
    PIECE = {"from_version": integer(-1), "to_version": integer(-1),
             "files": ListOf(Row(PATH, integer(0), Opt(integer(0)), MapOf(ANY))),
             "rows": Opt(integer(0)), "table_id?": STR}

    def __init__(self, name: str, path: str, *, starting_version: int | None = None,
                 max_versions_per_batch: int | None = None, ignore_deletes: bool = False,
                 ignore_changes: bool = False, skip_change_commits: bool = False) -> None:
        super().__init__(name)
        if starting_version is not None and (isinstance(starting_version, bool) or
                                             not isinstance(starting_version, int) or
                                             starting_version < 0):
            raise JobDefinitionError(f"Delta source {name}: expected starting_version >= 0 "
                                     f"or None, found {starting_version!r}")
        if max_versions_per_batch is not None and max_versions_per_batch < 1:
            raise JobDefinitionError(f"Delta source {name}: expected max_versions_per_batch >= 1 "
                                     f"or None, found {max_versions_per_batch}")
        self.path = path
        self.store = Storage(path)
        self.uri = self.store.spark_path(self.store.root)
        self.starting_version = starting_version
        self.max_versions = max_versions_per_batch
        self.ignore_deletes = ignore_deletes
        self.ignore_changes = ignore_changes
        self.skip_change_commits = skip_change_commits
        # the last version read; -1 and no starting_version: the snapshot comes first
        self.version = -1 if starting_version is None else starting_version - 1
        self.table_id: str | None = None  # the metaData.id of the table the pieces read
        self._read_through: int | None = None  # the newest version a piece read (None: none)
        self._schema: StructType | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path}

    def _table(self, version: int | None = None) -> Any:
        from deltalake import DeltaTable

        try:
            return DeltaTable(self.uri, version=version)
        except Exception as exc:
            raise SourceError(
                f"Delta source {self.name}: expected a Delta table at {self.uri}"
                f"{'' if version is None else f' version {version}'}, cannot load it: {exc}"
            ) from exc

    def schema(self) -> StructType:
        import pyarrow as pa

        from spark_ckpt.arrowtypes import to_spark

        if self._schema is None:
            self._schema = to_spark(pa.schema(self._table().schema()))
        return self._schema

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        for _batch, piece in pieces:
            self.version = max(self.version, piece["to_version"])
            self._note(piece)

    def _note(self, piece: dict[str, Any]) -> None:
        """Remember what a recorded piece says of the table: the newest version it read and
        the table's id (pieces recorded before ids were have none)."""
        if piece["to_version"] > piece["from_version"]:
            self._read_through = max(self._read_through or -1, piece["to_version"])
        if piece.get("table_id"):
            self.table_id = piece["table_id"]

    # -- planning ------------------------------------------------------------------------
    def plan(self) -> dict[str, Any]:
        table = self._table()
        latest = table.version()
        table_id = table.metadata().id
        self._check_same_table(table_id, latest)
        if latest <= self.version:
            return self._piece(self.version, self.version, [], table_id)
        mode = table.metadata().configuration.get("delta.columnMapping.mode", "none")
        if mode not in (None, "none"):
            self._refuse_column_mapping(f"its latest version {latest}", mode)
        if self.version < 0 and self.starting_version is None:
            return self._plan_snapshot(table, latest, table_id)
        target = latest if self.max_versions is None else min(latest,
                                                              self.version + self.max_versions)
        chosen: list[tuple[int, AddedFile]] = []
        for version in range(self.version + 1, target + 1):
            chosen += [(version, f) for f in self._admit(self._commit(version, target))]
        return self._piece(self.version, target, self._files(self._present(chosen)), table_id)

    def _piece(self, from_version: int, to_version: int, files: list[list[Any]],
               table_id: str) -> dict[str, Any]:
        rows = sum(f[2] for f in files) if all(f[2] is not None for f in files) else None
        return {"from_version": from_version, "to_version": to_version, "files": files,
                "rows": rows, "table_id": table_id}

    def _files(self, chosen: list[tuple[int, AddedFile]]) -> list[list[Any]]:
        return sorted([f.path, f.size, f.rows, self._partition_values(f.partition_values)]
                      for _version, f in chosen)

    def _check_same_table(self, table_id: str, latest: int) -> None:
        """The table at the path must be the one the recorded pieces read: same id, and a
        version at least the newest one read (a Delta table's versions never go back)."""
        again = ("Nothing was allocated from it. To read the table now at that path, start a "
                 "new pipeline (a new checkpoint directory): it reads the table's current rows "
                 "first, then its changes; to go on with the table this pipeline read, put it "
                 "back at that path and restart")
        if self.table_id is not None and table_id != self.table_id:
            raise SourceError(
                f"Delta source {self.name}: expected the table this pipeline read through "
                f"version {self.version} at {self.uri} (table id {self.table_id}), found "
                f"another table there (table id {table_id}, latest version {latest}): the "
                "table was deleted and created again at that path, or another table was put "
                "there, so the versions this pipeline recorded are not this table's, and "
                f"reading on from version {self.version + 1} would skip or mix up rows. {again}"
            )
        if self._read_through is not None and latest < self._read_through:
            raise SourceError(
                f"Delta source {self.name}: expected version {self._read_through} or later of "
                f"{self.uri} (this pipeline read through it), found the table's latest version "
                f"{latest} (table id {table_id}): a Delta table's versions never go back, so "
                "the table was created again at that path, or its log was replaced by an older "
                f"copy (this pipeline's records hold no table id to tell which). {again}"
            )

    def _plan_snapshot(self, table: Any, version: int, table_id: str) -> dict[str, Any]:
        """The first batch of a pipeline without ``starting_version``: every file of the table
        at ``version`` (its latest), as Delta Lake's streaming source reads first."""
        import pyarrow as pa

        from spark_ckpt.arrowtypes import to_spark

        self._check_schema(to_spark(pa.schema(table.schema())),
                           f"the table {self.uri} at version {version}, which a new pipeline "
                           "reads first (its current rows), has the schema", version)
        self._refuse_snapshot_deletion_vectors(table, version)
        chosen = [(version, AddedFile(
            decode_path(add["path"]), int(add["size_bytes"] or 0), add.get("num_records"),
            {k: _log_value(v) for k, v in (add.get("partition") or {}).items()}))
            for add in pa.table(table.get_add_actions(flatten=False)).to_pylist()]
        log.info("Delta source %s: a new pipeline reads the table's %d file(s) at version %d "
                 "first, then the versions after it", self.name, len(chosen), version)
        return self._piece(-1, version, self._files(self._present(chosen, snapshot=True)),
                           table_id)

    def _refuse_snapshot_deletion_vectors(self, table: Any, version: int) -> None:
        import pyarrow as pa

        head = (f"Delta source {self.name}: the table {self.uri} at version {version}, which a "
                "new pipeline reads first (its current rows),")
        try:
            files = pa.table(table.deletion_vectors()).column("filepath").to_pylist()
        except Exception as exc:
            raise SourceError(
                f"{head} may hold deletion vectors: reading them failed ({exc}). This source "
                "reads data files with Spark's Parquet reader, which does not apply deletion "
                "vectors. Nothing was allocated"
            ) from exc
        if files:
            raise SourceError(
                f"{head} holds {len(files)} file(s) with deletion vectors (rows of the file "
                f"marked deleted, e.g. {files[0]}); this source reads data files with Spark's "
                "Parquet reader, which does not apply deletion vectors and would read the "
                "deleted rows. Nothing was allocated. Rewrite those files without deletion "
                "vectors (delta-spark: REORG TABLE ... APPLY (PURGE)) and restart, or start "
                f"with starting_version={version + 1} to read only the changes after it (not "
                "the rows the table holds now)"
            )

    def _commit(self, version: int, target: int) -> DeltaCommit:
        commit = read_commit(self.store, version)
        if commit is not None:
            return commit
        earliest = earliest_commit(self.store)
        there = (f"the oldest commit still in the log is version {earliest}"
                 if earliest is not None else "no commit file is left in the log")
        start = earliest if earliest is not None and earliest > version else "<a version>"
        raise SourceError(
            f"Delta source {self.name}: expected the commit of version {version} at "
            f"{join(self.uri, commit_path(version))}, found it gone ({there}): the table's log "
            "was cleaned up (commits older than delta.logRetentionDuration are deleted once a "
            f"checkpoint covers them) before this pipeline read version {version}, so what "
            f"versions {version}..{target} changed cannot be read. Nothing was allocated from "
            f"them. Put the commit files back and restart, or start a new pipeline (a new "
            "checkpoint directory): without starting_version it reads the table's current rows "
            f"first, then its changes; with starting_version={start} the changes from that "
            "version (the rows of the versions before it are not read). Keep "
            "delta.logRetentionDuration longer than the pipeline may fall behind"
        )

    def _admit(self, commit: DeltaCommit) -> tuple[AddedFile, ...]:
        """The files of ``commit`` a batch reads (none when it is skipped), or SourceError when
        the options do not allow it."""
        self._check_metadata(commit)
        v, op = commit.version, commit.operation
        if commit.kind is CommitKind.APPEND:
            added = commit.added
        elif commit.kind is CommitKind.NO_DATA_CHANGE:
            log.debug("Delta source %s: version %d (%s) changes no data: skipped", self.name, v,
                      op)
            return ()
        elif self.skip_change_commits or (commit.kind is CommitKind.DELETE and
                                          (self.ignore_deletes or self.ignore_changes)):
            option = "skip_change_commits" if self.skip_change_commits else (
                "ignore_deletes" if self.ignore_deletes else "ignore_changes")
            log.info("Delta source %s: version %d (%s) removed %d file(s) and added %d: "
                     "skipped (%s)", self.name, v, op, len(commit.removed), len(commit.added),
                     option)
            return ()
        elif commit.kind is CommitKind.CHANGE and self.ignore_changes:
            log.warning("Delta source %s: version %d (%s) rewrote %d file(s): reading the %d "
                        "file(s) it added again (ignore_changes: rows it did not change come "
                        "again)", self.name, v, op, len(commit.removed), len(commit.added))
            added = commit.added
        else:
            raise SourceError(self._refusal(commit))
        with_dv = next((f for f in added if f.deletion_vector), None)
        if with_dv is not None:
            raise SourceError(
                f"Delta source {self.name}: version {v} of {self.uri} ({op}) added "
                f"{with_dv.path} with a deletion vector (rows of the file marked deleted); "
                "this source reads data files with Spark's Parquet reader, which does not "
                "apply deletion vectors and would read the deleted rows. Nothing was "
                f"allocated from version {v}. Set skip_change_commits=True and restart to skip "
                "the commits that write deletion vectors (DELETE, UPDATE, MERGE on a table "
                "with delta.enableDeletionVectors=true), or turn deletion vectors off on the "
                "table before such commits"
            )
        return added

    def _refusal(self, commit: DeltaCommit) -> str:
        v, op = commit.version, commit.operation
        head = (f"Delta source {self.name}: expected an append-only table, but version {v} of "
                f"{self.uri} ({op}) removed {len(commit.removed)} file(s) (e.g. "
                f"{commit.removed[0]})")
        if commit.kind is CommitKind.DELETE:
            return (f"{head} and added none. Nothing was allocated from version {v}. Set "
                    "ignore_deletes=True and restart to skip commits that only remove files "
                    "(the deleted rows stay in the output), or skip_change_commits=True to skip "
                    "every commit that removes files")
        covered = " (ignore_deletes=True covers only commits that add no file)" \
            if self.ignore_deletes else ""
        return (f"{head} and added {len(commit.added)}: it rewrote rows (UPDATE, MERGE, a "
                f"DELETE inside files, an overwrite){covered}. Nothing was allocated from "
                f"version {v}. Set skip_change_commits=True and restart to skip such commits "
                "(neither their removed nor their rewritten rows are read), or "
                "ignore_changes=True to read the files they added (rows they did not change "
                "come again)")

    def _check_metadata(self, commit: DeltaCommit) -> None:
        """A commit's new metadata must be readable with the source's schema (its columns, of
        the same types: older files may lack columns the schema has, read as null)."""
        import pyarrow as pa
        from deltalake import Schema

        from spark_ckpt.arrowtypes import to_spark

        if commit.column_mapping is not None:
            self._refuse_column_mapping(f"version {commit.version} ({commit.operation})",
                                        commit.column_mapping)
        if commit.schema_string is None:
            return
        try:
            found = to_spark(pa.schema(Schema.from_json(commit.schema_string)))
        except Exception as exc:
            raise SourceError(
                f"Delta source {self.name}: version {commit.version} of {self.uri} "
                f"({commit.operation}) set a schema this source cannot map: {exc}"
            ) from exc
        self._check_schema(found, f"version {commit.version} of {self.uri} "
                           f"({commit.operation}) changed the table's schema to", commit.version)

    def _check_schema(self, found: StructType, head: str, version: int) -> None:
        """SourceError (``head`` says where ``found`` is) unless the source's schema reads
        ``found``: each of its columns there, of the same type."""
        reading = self.schema()
        known = {f.name: f.dataType.simpleString() for f in reading.fields}
        for f in found.fields:
            if known.get(f.name) != f.dataType.simpleString():
                what = (f"column {f.name} is {known[f.name]} in the source's schema" if
                        f.name in known else f"column {f.name} is not in the source's schema")
                raise SourceError(
                    f"Delta source {self.name}: {head} {found.simpleString()}, which the "
                    f"source's schema {reading.simpleString()} does not read ({what}, "
                    f"{f.dataType.simpleString()} there). Nothing was allocated from version "
                    f"{version}. A source's schema cannot change under a checkpoint: to read on "
                    "with the new schema, start a new pipeline (a new checkpoint directory), "
                    "which reads the table's current rows first, or with "
                    f"starting_version={version} to read the changes from that version"
                )

    def _refuse_column_mapping(self, where: str, mode: str) -> None:
        raise SourceError(
            f"Delta source {self.name}: {self.uri} uses column mapping at {where} "
            f"(delta.columnMapping.mode={mode}): its data files name columns by physical names "
            "or field ids, which Spark's Parquet reader would not match (reading nulls). This "
            "source does not read column-mapped tables: stream from a copy written without "
            "column mapping, or read the table with delta-spark's streaming source"
        )

    def _full(self, path: str) -> str:
        """A piece's file as Spark reads it: an absolute path or URI as it is (any scheme:
        ``s3://``, ``file:/``, ...), a relative one under the table's root."""
        return path if is_absolute(path) else self.uri.rstrip("/") + "/" + path

    def _present(self, chosen: list[tuple[int, AddedFile]], *,
                 snapshot: bool = False) -> list[tuple[int, AddedFile]]:
        """The chosen files, each still there: VACUUM deletes a file some time after a later
        commit removed it (a compaction, a DELETE), and a pipeline behind that has not read its
        rows yet stops here, naming the version that added it (with ignoreMissingFiles,
        Spark's answer: the file is left out). ``snapshot``: the files are a snapshot's."""
        from spark_ckpt.batch.sources import ignore_missing_files
        from spark_ckpt.storage import stat_any

        sizes = stat_any(self._full(f.path) for _version, f in chosen)
        missing = [c for c, size in zip(chosen, sizes, strict=True) if size is None]
        if not missing:
            return chosen
        version, gone = missing[0]
        if not ignore_missing_files(getattr(self.pipeline, "spark", None), {}):
            if snapshot:
                raise SourceError(
                    f"Delta source {self.name}: the table {self.uri} at version {version}, "
                    "which a new pipeline reads first (its current rows), holds "
                    f"{self._full(gone.path)}, found the file missing ({len(missing)} missing "
                    "file(s)): the table is damaged (a data file deleted while a version "
                    "still holds it: VACUUM with too short a retention, or by hand). Nothing "
                    "was allocated. Put the file back and restart, or set "
                    "spark.sql.files.ignoreMissingFiles=true to go on without its rows"
                )
            raise SourceError(
                f"Delta source {self.name}: version {version} of {self.uri} added "
                f"{gone.path}, found the file missing ({len(missing)} missing file(s)): a later "
                "commit removed it (OPTIMIZE, DELETE, ...) and VACUUM deleted it before this "
                "pipeline read its rows. Nothing was allocated from it. Put the file back and "
                "restart, or set spark.sql.files.ignoreMissingFiles=true to go on without its "
                "rows; keep delta.deletedFileRetentionDuration longer than the pipeline may "
                "fall behind"
            )
        log.warning("Delta source %s: leaving out %d missing file(s) (e.g. %s, added by version "
                    "%d): spark.sql.files.ignoreMissingFiles=true", self.name, len(missing),
                    gone.path, version)
        return [c for c in chosen if c not in missing]

    def _partition_values(self, values: dict[str, str | None]) -> dict[str, Any]:
        """The log's partition values (strings) as JSON values the reader casts exactly: whole
        numbers and booleans as such, a timestamp marked UTC (Delta writes them in UTC without
        a zone; Spark would read them in the session's time zone)."""
        from pyspark.sql import types as T

        schema = self.schema()
        out: dict[str, Any] = {}
        for column, raw in values.items():
            kind = schema[column].dataType if column in schema.names else None
            value: Any = raw
            if raw is None or kind is None:
                pass
            elif isinstance(kind, T.ByteType | T.ShortType | T.IntegerType | T.LongType):
                value = int(raw) if raw.lstrip("-").isdigit() else raw
            elif isinstance(kind, T.BooleanType):
                value = raw.lower() == "true"
            elif isinstance(kind, T.TimestampType) and "T" not in raw:
                value = raw.replace(" ", "T", 1) + "Z"
            out[column] = value
        return out

    def advance(self, piece: dict[str, Any]) -> None:
        self.version = piece["to_version"]
        self._note(piece)

    def position(self) -> dict[str, Any]:
        return {"version": self.version}

    def is_empty(self, piece: dict[str, Any]) -> bool:
        # versions skipped (compactions, ignored deletes) still move the position: a batch
        # records that, or an available-now run would stop before the versions after them
        return not piece["files"] and piece["to_version"] == piece["from_version"]

    # -- reading -------------------------------------------------------------------------
    def read(self, run: BatchRun, piece: dict[str, Any]) -> DataFrame:
        from pyspark.sql import functions as F

        spark = run.spark
        if not piece["files"]:
            return self.empty(spark)
        schema = self.schema()
        groups: dict[str, list[str]] = {}
        for path, _size, _rows, values in piece["files"]:
            groups.setdefault(json.dumps(values, sort_keys=True), []).append(self._full(path))
        frames = []
        for key, files in sorted(groups.items()):
            values = json.loads(key)
            data_schema = type(schema)([f for f in schema.fields if f.name not in values])
            df = spark.read.schema(data_schema).parquet(*files)
            for column, value in values.items():
                df = df.withColumn(column, F.lit(value).cast(schema[column].dataType))
            frames.append(df.select(*schema.names))

        return union_by_name(frames)


def _log_value(value: Any) -> str | None:
    """A typed partition value of delta-rs's add actions as the commit log serializes it (the
    form :meth:`DeltaStreamSource._partition_values` reads): timestamps in UTC without a zone,
    dates ``YYYY-MM-DD``, booleans ``true``/``false``, numbers as written."""
    import datetime as dt

    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.UTC).replace(tzinfo=None)
        return value.isoformat(sep=" ", timespec="microseconds")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


# -- a deterministic generator -----------------------------------------------------------------
class GeneratorSource(Source):
    """Rows ``id, key, value, event_time``, a pure function of ``id``: replayable from any offset.

    ``rows_per_batch`` fixes each batch's size (exact offsets for tests); otherwise
    ``rows_per_second`` decides it from the time since the previous batch, capped by
    ``max_rows_per_batch``. ``total_rows`` ends the stream (``available_now`` stops there).
    """

    kind = "generator"
    SCHEMA = "id BIGINT, key BIGINT, value DOUBLE, event_time TIMESTAMP"
    PIECE = {"start": integer(0), "end": integer(0), "rows": integer(0)}

    def __init__(self, name: str, *, rows_per_batch: int | None = None,
                 rows_per_second: float | None = None, max_rows_per_batch: int | None = None,
                 total_rows: int | None = None, keys: int = 1000, partitions: int = 2,
                 seed: int = 42) -> None:
        super().__init__(name)
        if (rows_per_batch is None) == (rows_per_second is None):
            raise JobDefinitionError(
                f"generator source {name}: expected exactly one of rows_per_batch and "
                f"rows_per_second, found {rows_per_batch!r} and {rows_per_second!r}"
            )
        self.rows_per_batch = rows_per_batch
        self.rate = rows_per_second
        self.max_rows = max_rows_per_batch
        self.total = total_rows
        self.keys = keys
        self.partitions = partitions
        self.seed = seed
        self.offset = 0
        self._last = self.clock.monotonic_s()

    def bind(self, pipeline: SourceScope) -> None:
        super().bind(pipeline)
        self._last = self.clock.monotonic_s()  # the rate runs on the pipeline's clock

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "keys": self.keys, "seed": self.seed}

    def schema(self) -> StructType:
        from pyspark.sql.types import StructType

        return StructType.fromDDL(self.SCHEMA)

    def _check_places(self, piece: dict[str, Any], field: str) -> None:
        if piece["end"] < piece["start"]:
            raise RecordError(f"field {field}.end: expected at least start={piece['start']}, "
                              f"found {piece['end']}")

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        for _batch, piece in pieces:
            self.offset = max(self.offset, piece["end"])

    def plan(self) -> dict[str, Any]:
        now = self.clock.monotonic_s()
        if self.rows_per_batch is not None:
            count = self.rows_per_batch
        else:
            count = int((now - self._last) * float(self.rate))  # type: ignore[arg-type]
        if self.max_rows is not None:
            count = min(count, self.max_rows)
        end = self.offset + max(count, 0)
        if self.total is not None:
            end = min(end, self.total)
        return {"start": self.offset, "end": end, "rows": end - self.offset}

    def advance(self, piece: dict[str, Any]) -> None:
        self.offset = piece["end"]
        self._last = self.clock.monotonic_s()

    def position(self) -> dict[str, Any]:
        return {"offset": self.offset}

    def read(self, run: BatchRun, piece: dict[str, Any]) -> DataFrame:
        from pyspark.sql import functions as F

        df = run.spark.range(piece["start"], piece["end"], numPartitions=self.partitions)
        return df.select(
            "id",
            F.pmod(F.col("id"), F.lit(self.keys)).alias("key"),
            (F.pmod(F.xxhash64("id", F.lit(self.seed)), F.lit(1_000_000)) / 100.0).alias("value"),
            F.timestamp_millis(F.lit(1_767_225_600_000) + F.col("id")).alias("event_time"),
        )
