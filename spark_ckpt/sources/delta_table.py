"""A Delta table beside the streams, read whole at a version each batch records: the versioned
side of a temporal join (``stream.join_as_of(table, ...)``, template/temporal.py), or, read as
a stream, each batch's table as of its allocation (a processing-time lookup join).

Each batch's allocation records the table's latest version when the batch is planned, so a
replayed batch reads the same versions whatever was committed since. The table never makes a
batch by itself (its piece holds no rows). Versions are read into the driver through delta-rs
(``storage.delta_reader``), so the table is a dimension table that fits there; each version
read is kept (versions never change) up to ``_KEPT`` of them.

Commit times are the ``timestamp`` of each version's ``commitInfo`` (the writer's clock; Delta
Lake's own ``TIMESTAMP AS OF`` reads the log file's modification time unless in-commit
timestamps are on), made monotonic as Delta Lake makes them for time travel (a version's time is
at least its predecessor's plus 1 ms), so "as of t" is the newest version committed at or before
``t``. Only the versions whose commits the log still holds are known: once Delta cleaned up the
log before a version (``delta.logRetentionDuration``, 30 days by default), a row older than the
oldest version it holds stops the pipeline with a :class:`SourceError` rather than join a
version that may not be the one it is as of.

The rows of every version are read with the schema the table has when the pipeline starts: a
column an older version lacks is null there; a column whose values do not cast to it stops the
pipeline with a :class:`SourceError` naming the version.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import SourceError
from spark_ckpt.formats import Opt, integer
from spark_ckpt.sources.delta_stream import DeltaTableAccess
from spark_ckpt.sources.source import SourceRun

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

__all__ = ["DeltaTableSource"]

log = logging.getLogger(__name__)

_KEPT = 8  # versions kept in the driver between batches
# reader features of protocol 3 that delta-rs's Arrow reader applies (deltalake.table's
# SUPPORTED_READER_FEATURES): anything else is refused by name (_check_readable)
_READABLE_FEATURES = frozenset({"timestampNtz", "variantType", "variantType-preview"})


class DeltaTableSource(DeltaTableAccess):
    """A Delta table at the version each batch records (see the module's docstring)."""

    kind = "delta_table"
    what = "Delta table"
    PIECE = {"version": integer(0), "rows": Opt(integer(0))}

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, path)
        self.version = -1  # the version the last batch recorded
        self._times: dict[int, int] = {}  # version -> monotonic commit time (ms)
        self._oldest = 0  # the oldest version whose commit the log held when last read
        self._kept: OrderedDict[int, pa.Table] = OrderedDict()
        self._latest: Any = None  # the table at its latest version, updated each plan

    # -- allocation: the latest version, never rows -------------------------------------------
    def plan(self) -> dict[str, Any]:
        if self._latest is None:
            self._latest = self._table()
        else:
            self._latest.update_incremental()
        return {"version": int(self._latest.version()), "rows": 0}

    def advance(self, piece: dict[str, Any]) -> None:
        self.version = int(piece["version"])

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        if pieces:
            self.version = int(pieces[-1][1]["version"])

    def position(self) -> dict[str, Any]:
        return {"version": self.version}

    def rows(self, piece: dict[str, Any]) -> int | None:
        return 0

    def is_empty(self, piece: dict[str, Any]) -> bool:
        return True  # a change of the table alone runs no batch

    # -- reading ---------------------------------------------------------------------------
    def read(self, run: SourceRun, piece: dict[str, Any]) -> DataFrame:
        """The table as of the batch's recorded version."""
        return self.frame(run.spark, [int(piece["version"])], None)

    def commit_times(self, latest: int) -> tuple[list[tuple[int, int]], bool]:
        """``(version, commit time in ms)`` of the versions up to ``latest`` whose commits the
        log holds, times monotonic; and whether the log still starts at version 0 (when not,
        a time before the first one listed has no known version)."""
        if latest not in self._times:
            history: dict[int, int] = {}
            for commit in self._table().history():
                if "version" not in commit:
                    continue
                if "timestamp" not in commit:
                    raise SourceError(
                        f"Delta table {self.name}: expected a commit time (commitInfo "
                        f"timestamp) for version {commit['version']} of {self.uri}, found none")
                history[int(commit["version"])] = int(commit["timestamp"])
            if latest not in history:
                raise SourceError(f"Delta table {self.name}: expected version {latest} in "
                                  f"{self.uri}'s log, found versions {sorted(history)[-3:]}")
            oldest = latest
            while oldest - 1 in history:
                oldest -= 1
            times: dict[int, int] = {}
            previous: int | None = None
            for v in range(oldest, latest + 1):
                at = history[v] if previous is None else max(history[v], previous + 1)
                times[v] = previous = at
            self._times, self._oldest = times, oldest
        listed = [(v, at) for v, at in sorted(self._times.items()) if v <= latest]
        return listed, self._oldest == 0

    def snapshot(self, version: int) -> pa.Table:
        """The table's rows at ``version`` (kept: versions never change)."""
        from spark_ckpt.storage.delta_reader import read_delta

        if version not in self._kept:
            self._check_readable(version)
            try:
                self._kept[version] = read_delta(self.uri, version=version)
            except Exception as exc:
                raise SourceError(
                    f"Delta table {self.name}: expected to read version {version} of "
                    f"{self.uri}, cannot: {type(exc).__name__}: {exc} (a VACUUM may have removed "
                    "its files)") from exc
            log.info("Delta table %s: read version %d (%d rows)", self.name, version,
                     self._kept[version].num_rows)
            while len(self._kept) > _KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(version)
        return self._kept[version]

    def _check_readable(self, version: int) -> None:
        """SourceError, by name, for a version whose rows delta-rs's Arrow reader would get
        wrong or refuses: column mapping (its files name columns by physical names, which
        the reader does not map back: renamed columns would read as nulls, whatever the
        protocol version says) and reader features it does not support (deletion vectors:
        the rows they mark deleted would be read)."""
        table = self._table(version)
        mode = table.metadata().configuration.get("delta.columnMapping.mode", "none")
        head = f"Delta table {self.name}: version {version} of {self.uri}"
        if mode not in (None, "none"):
            raise SourceError(
                f"{head} uses column mapping (delta.columnMapping.mode={mode}): its data files "
                "name columns by physical names, which this source's reader (delta-rs into "
                "Arrow) does not map back to the table's columns (renamed columns would read "
                "as nulls). This source does not read column-mapped tables: join with a copy "
                "written without column mapping"
            )
        protocol = table.protocol()
        features = set(protocol.reader_features or ()) - _READABLE_FEATURES
        if protocol.min_reader_version >= 3 and features:
            named = ", ".join(sorted(features))
            raise SourceError(
                f"{head} needs reader features this source's reader (delta-rs into Arrow) does "
                f"not support: {named}"
                + (" (deletion vectors: rows marked deleted in a file would be read as if "
                   "they were not; rewrite the files without them, delta-spark: REORG TABLE "
                   "... APPLY (PURGE), or turn them off before such commits)"
                   if "deletionVectors" in features else "")
            )

    def frame(self, spark: Any, versions: list[int], version_column: str | None) -> DataFrame:
        """The rows of ``versions`` as one Spark DataFrame (with each row's version in
        ``version_column`` when given)."""
        import pyarrow as pa

        from spark_ckpt.arrowtypes import to_arrow, to_spark

        schema = to_arrow(self.schema())
        parts = []
        for v in versions:
            snapshot = self.snapshot(v)
            try:
                table = pa.table({f.name: snapshot.column(f.name).cast(f.type)
                                  if f.name in snapshot.column_names
                                  else pa.nulls(snapshot.num_rows, f.type) for f in schema},
                                 schema=schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SourceError(
                    f"Delta table {self.name}: expected version {v} of {self.uri} to read as "
                    f"the table's schema when the pipeline started ({self.schema().simpleString()}"
                    f"), found {snapshot.schema}: {exc}") from exc
            if version_column is not None:
                table = table.append_column(version_column, pa.array([v] * table.num_rows,
                                                                      pa.int64()))
            parts.append(table)
        if version_column is not None:
            schema = schema.append(pa.field(version_column, pa.int64()))
        whole = pa.concat_tables(parts) if parts else schema.empty_table()
        frame: DataFrame = spark.createDataFrame(whole, schema=to_spark(schema))
        return frame
