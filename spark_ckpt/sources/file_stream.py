"""A directory of files as a replayable source: each batch's piece is the list of files it
reads (new files by modification time, at most the per-batch limits), read with Spark's readers
and the recorded schema; malformed rows go to the dead-letter table."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

from spark_ckpt.errors import JobDefinitionError, RecordError, SourceError
from spark_ckpt.formats import PATH, ListOf, Opt, Row, integer
from spark_ckpt.sources.source import Source, SourceRun
from spark_ckpt.storage import Storage, join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["FileStreamSource"]

log = logging.getLogger(__name__)



CORRUPT_COLUMN = "_corrupt_record"


JSON_MAX_STRING_LEN = 20_000_000  # Spark's default maxStringLen (Jackson's limit)


_KEEP = 1 << 62  # the mtime of a seen file recorded before mtimes were: never forgotten


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
                declared = cast(StructType, StructType.fromDDL(declared))
            if declared is None:  # Parquet: the first file's, recorded by the pipeline
                declared = self.pipeline.recorded_schema(self.name) or self._infer()
            self._schema = declared
        return self._schema

    def _infer(self) -> StructType:
        import pyarrow.parquet as pq

        from spark_ckpt.sources.job_inputs import footer_schema

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

        from spark_ckpt.sources.job_inputs import (
            case_sensitive,
            footer_schema,
            merge_schema,
            parquet_drift,
        )

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
    def read(self, run: SourceRun, piece: dict[str, Any]) -> DataFrame:
        spark = run.spark
        files = self._present([f[0] for f in piece["files"]], run)
        if not files:
            return self.empty(spark)
        schema = self.schema()
        if self.fmt == "parquet":
            return spark.read.options(**self.options).schema(schema).parquet(*files)
        return self._read_text(run, files, schema)

    def _present(self, files: list[str], run: SourceRun) -> list[str]:
        """The batch's files; one deleted since the batch was allocated fails the batch, naming
        it (with ignoreMissingFiles, Structured Streaming's answer: it is skipped)."""
        from spark_ckpt.sources.job_inputs import ignore_missing_files
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

    def _read_text(self, run: SourceRun, files: list[str], schema: StructType) -> DataFrame:
        """The batch's JSON or CSV rows that parse; the others go to the dead-letter table.

        On a classic session, where everything the pipeline computes from the source reads
        each batch whole (spark_ckpt's own operators and sinks: ``BatchRun.reads_whole``), the
        rows and the malformed ones are counted as the batch's own job reads them (Spark's
        ``observe``: no job of their own); once the batch's jobs have run, malformed rows
        found are read again and written to the dead-letter table (a job only when there are
        some), before the batch commits. Where no job reported the counts (nothing read the
        source in this batch), they are counted in a job then. Elsewhere (a ``transform`` or
        ``foreach_batch`` function of the user's, which may read part of a batch; Spark
        Connect, whose client learns metrics only with an action's own result) the rows are
        persisted, counted and routed before the pipeline reads them."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import StringType, StructField, StructType

        from spark_ckpt.sparkapi import spark_api

        with_corrupt = StructType(list(schema.fields) +
                                  [StructField(CORRUPT_COLUMN, StringType(), True)])
        reader = (run.spark.read.options(**self.options).schema(with_corrupt)
                  .option("mode", "PERMISSIVE").option("columnNameOfCorruptRecord",
                                                       CORRUPT_COLUMN))
        raw = reader.json(files) if self.fmt == "json" else reader.csv(files)
        parsed = raw.withColumn("_ckpt_file", F.col("_metadata.file_path"))
        counts = (F.count(F.lit(1)).alias("rows"),
                  F.count(F.when(F.col(CORRUPT_COLUMN).isNotNull(),
                                 _with_data(schema))).alias("bad"))
        observed = None
        if run.reads_whole(self.name):  # else a user's function may read part of it
            observed = spark_api(run.spark).observe(
                parsed, f"spark_ckpt-{self.name}-b{run.batch_id}-{id(parsed):x}", *counts)
        if observed is None:
            return self._read_text_persisted(run, parsed, schema, counts)
        frame, values = observed
        batch_id = run.batch_id

        def route() -> None:
            # Spark hands the counts over as the query that read them ends (before its
            # action returns); a grace for a listener's delay, no more: in a batch whose jobs
            # did not read the source (a window that does not fire), nothing will come
            seen = values(0.2)
            if seen is None or not {"rows", "bad"} <= seen.keys():  # nothing (or an empty
                # row: the query ended without them) from the batch's jobs: count them now
                log.info("File source %s: batch %d's rows were not counted by its jobs; "
                         "counting them", self.name, batch_id)
                # over the observed frame: the query completes the observation, which Spark
                # keeps in the session until one does
                row = frame.agg(*counts).first()
                assert row is not None  # an aggregate without grouping has one row
                seen = {"rows": row[0], "bad": row[1]}
            self._counted(run, parsed, schema, int(seen["rows"]), int(seen["bad"]))

        run.after_jobs(route)
        return frame.where(F.col(CORRUPT_COLUMN).isNull()).drop(CORRUPT_COLUMN, "_ckpt_file")

    def _read_text_persisted(self, run: SourceRun, parsed: DataFrame, schema: StructType,
                             counts: tuple[Any, ...]) -> DataFrame:
        from pyspark import StorageLevel
        from pyspark.sql import functions as F

        parsed = parsed.persist(StorageLevel.MEMORY_AND_DISK)
        run.on_cleanup(parsed.unpersist)
        row = parsed.agg(*counts).first()
        assert row is not None  # an aggregate without grouping has one row
        self._counted(run, parsed, schema, int(row["rows"]), int(row["bad"]))
        return parsed.where(F.col(CORRUPT_COLUMN).isNull()).drop(CORRUPT_COLUMN, "_ckpt_file")

    def _counted(self, run: SourceRun, parsed: DataFrame, schema: StructType, rows: int,
                 bad: int) -> None:
        """The batch's input rows in its progress; its ``bad`` malformed rows (read again
        from ``parsed``) to the dead-letter table."""
        from pyspark.sql import functions as F

        if run.batch_id == run.stats.batch_id:
            run.stats.input_rows[self.name] = rows
        if not bad:
            return
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
            F.col("_ckpt_file").alias("file"), _with_data(schema).alias("record"),
            reason.alias("reason"),
        ), bad)


def _with_data(schema: StructType) -> Any:
    """The corrupt-record column, read with every data column: Spark's JSON and CSV readers
    parse only the columns a query reads, so a row is malformed or not by those columns
    alone (a query of the corrupt-record column alone is refused); referenced here, every
    column of the schema is parsed, and a row is malformed as the whole schema says (as the
    batch read whole says: what the pipeline selects later does not change it). Their values
    are never used: a malformed row's record is never null."""
    from pyspark.sql import functions as F

    every = [F.col("`" + f.name.replace("`", "``") + "`").cast("string") for f in schema.fields]
    return F.coalesce(F.col(CORRUPT_COLUMN), F.concat_ws(",", *every))
