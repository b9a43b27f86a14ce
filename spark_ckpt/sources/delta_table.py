"""A Delta table beside the streams, read whole at a version each batch records: the versioned
side of a temporal join (``stream.join_as_of(table, ...)``, template/temporal.py), or, read as
a stream, each batch's table as of its allocation (a processing-time lookup join).

Each batch's allocation records the table's latest version when the batch is planned, so a
replayed batch reads the same versions whatever was committed since. The table never makes a
batch by itself (its piece holds no rows). Versions are read into the driver through delta-rs
(``storage.delta_reader``), so the table is a dimension table that fits there; each version
read is kept (versions never change) up to ``_KEPT`` of them.

Commit times are Delta's: the ``timestamp`` of each version's commit, made monotonic as Delta
Lake makes them for time travel (a version's time is at least its predecessor's plus 1 ms), so
"as of t" is the newest version committed at or before ``t``, Delta's ``TIMESTAMP AS OF``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import SourceError
from spark_ckpt.formats import Opt, integer
from spark_ckpt.sources.source import Source, SourceRun
from spark_ckpt.storage import Storage

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["DeltaTableSource"]

log = logging.getLogger(__name__)

_KEPT = 8  # versions kept in the driver between batches


class DeltaTableSource(Source):
    """A Delta table at the version each batch records (see the module's docstring)."""

    kind = "delta_table"
    PIECE = {"version": integer(0), "rows": Opt(integer(0))}

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.path = path
        self.store = Storage(path)
        self.uri = self.store.spark_path(self.store.root)
        self.version = -1  # the version the last batch recorded
        self._schema: StructType | None = None
        self._times: dict[int, int] = {}  # version -> monotonic commit time (ms)
        self._kept: OrderedDict[int, pa.Table] = OrderedDict()

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path}

    def _table(self, version: int | None = None) -> Any:
        from deltalake import DeltaTable

        try:
            return DeltaTable(self.uri, version=version)
        except Exception as exc:
            raise SourceError(
                f"Delta table {self.name}: expected a Delta table at {self.uri}"
                f"{'' if version is None else f' version {version}'}, cannot load it: {exc}"
            ) from exc

    def schema(self) -> StructType:
        import pyarrow as pa

        from spark_ckpt.arrowtypes import to_spark

        if self._schema is None:
            self._schema = to_spark(pa.schema(self._table().schema()))
        return self._schema

    # -- allocation: the latest version, never rows -------------------------------------------
    def plan(self) -> dict[str, Any]:
        return {"version": int(self._table().version()), "rows": 0}

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

    def commit_times(self, latest: int) -> list[tuple[int, int]]:
        """``(version, commit time in ms)`` of versions 0..``latest``, times monotonic."""
        if any(v not in self._times for v in range(latest + 1)):
            history = {int(c["version"]): int(c["timestamp"])
                       for c in self._table().history() if "version" in c}
            missing = [v for v in range(latest + 1) if v not in history]
            if missing:
                raise SourceError(
                    f"Delta table {self.name}: expected the commit times of versions 0 to "
                    f"{latest} in {self.uri}'s log, found none for {missing[:5]}"
                    f"{' ...' if len(missing) > 5 else ''} (the log was cleaned up past them: "
                    "rows older than the oldest version kept cannot be joined as of their time)")
            previous = None
            for v in range(latest + 1):
                at = history[v] if previous is None else max(history[v], previous + 1)
                self._times[v] = previous = at
        return [(v, self._times[v]) for v in range(latest + 1)]

    def snapshot(self, version: int) -> pa.Table:
        """The table's rows at ``version`` (kept: versions never change)."""
        from spark_ckpt.storage.delta_reader import read_delta

        if version not in self._kept:
            try:
                self._kept[version] = read_delta(self.uri, version=version)
            except SourceError:
                raise
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

    def frame(self, spark: Any, versions: list[int], version_column: str | None) -> DataFrame:
        """The rows of ``versions`` as one Spark DataFrame (with each row's version in
        ``version_column`` when given)."""
        import pyarrow as pa

        from spark_ckpt.arrowtypes import to_arrow

        schema = to_arrow(self.schema())
        parts = []
        for v in versions:
            table = self.snapshot(v).select(schema.names).cast(schema)
            if version_column is not None:
                table = table.append_column(version_column, pa.array([v] * table.num_rows,
                                                                      pa.int64()))
            parts.append(table)
        if version_column is not None:
            schema = schema.append(pa.field(version_column, pa.int64()))
        whole = pa.concat_tables(parts) if parts else schema.empty_table()
        from spark_ckpt.arrowtypes import to_spark

        frame: DataFrame = spark.createDataFrame(whole, schema=to_spark(schema))
        return frame
