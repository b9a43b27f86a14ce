"""A Delta table as a replayable source: each batch's piece is a range of table versions read
from the commit log (sources/delta_log.py), the snapshot first for a new pipeline, with Delta
Lake's options for commits that change rows (ignore_deletes, ignore_changes,
skip_change_commits)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError, SourceError
from spark_ckpt.formats import ANY, PATH, STR, ListOf, MapOf, Opt, Row, integer
from spark_ckpt.sources.delta_log import (
    AddedFile,
    CommitKind,
    DeltaCommit,
    commit_path,
    decode_path,
    earliest_commit,
    is_absolute,
    read_commit,
)
from spark_ckpt.sources.source import Source, SourceRun
from spark_ckpt.sparkapi import union_by_name
from spark_ckpt.storage import Storage, delta_table, join

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["DeltaStreamSource"]

log = logging.getLogger(__name__)



# -- a Delta table -----------------------------------------------------------------------------
class DeltaTableAccess(Source):
    """A source over a Delta table at a path: its table at a version, and its schema."""

    what = "Delta source"

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.path = path
        self.store = Storage(path)
        self.uri = self.store.spark_path(self.store.root)
        self._schema: StructType | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path}

    def _table(self, version: int | None = None) -> Any:

        try:
            return delta_table(self.uri, version=version)
        except Exception as exc:
            raise SourceError(
                f"{self.what} {self.name}: expected a Delta table at {self.uri}"
                f"{'' if version is None else f' version {version}'}, cannot load it: {exc}"
            ) from exc

    def schema(self) -> StructType:
        import pyarrow as pa

        from spark_ckpt.arrowtypes import to_spark

        if self._schema is None:
            self._schema = to_spark(pa.schema(self._table().schema()))
        return self._schema


class DeltaStreamSource(DeltaTableAccess):
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
        super().__init__(name, path)
        if starting_version is not None and (isinstance(starting_version, bool) or
                                             not isinstance(starting_version, int) or
                                             starting_version < 0):
            raise JobDefinitionError(f"Delta source {name}: expected starting_version >= 0 "
                                     f"or None, found {starting_version!r}")
        if max_versions_per_batch is not None and max_versions_per_batch < 1:
            raise JobDefinitionError(f"Delta source {name}: expected max_versions_per_batch >= 1 "
                                     f"or None, found {max_versions_per_batch}")
        self.starting_version = starting_version
        self.max_versions = max_versions_per_batch
        self.ignore_deletes = ignore_deletes
        self.ignore_changes = ignore_changes
        self.skip_change_commits = skip_change_commits
        # the last version read; -1 and no starting_version: the snapshot comes first
        self.version = -1 if starting_version is None else starting_version - 1
        self.table_id: str | None = None  # the metaData.id of the table the pieces read
        self._read_through: int | None = None  # the newest version a piece read (None: none)

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
        from spark_ckpt.sources.job_inputs import ignore_missing_files
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
    def read(self, run: SourceRun, piece: dict[str, Any]) -> DataFrame:
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
