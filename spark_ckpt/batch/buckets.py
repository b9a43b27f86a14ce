"""Durable exchanges: a vertex's output written bucketed by its one consumer's key.

A join of two large inputs is one Spark job whose first stage reads both inputs and shuffles
them by the key; none of that stage outlives the driver. A durable exchange is that shuffle
written as files: each wave of input splits is written bucketed by the consumer's key into the
consumer's partitions (Spark's bucketed writer: bucket *j* is the rows with
``pmod(hash(key), n) == j``, the same hash the consumer's partitions use), and the consumer
reads the finished waves as one bucketed table, so Spark joins bucket *j* with bucket *j* with
no exchange, and a re-run of some partitions reads only their buckets.

Layout of one wave's write directory (its name ends ``-b<n>``, the bucket count)::

    <results>/<vertex>/<wave>-b<n>/spark_ckpt_bucket=<j>/part-<task>-<uuid>_<j>.c000.parquet

Spark's bucketed reads and writes need a table in a catalog: each write and each read uses a
temporary external table in the session catalog (``spark_catalog.default``), dropped when the
run unit ends (the files stay; a crashed driver's in-memory catalog dies with it). A read
registers one catalog partition per (wave, bucket) it needs, pointing at that directory, so it
reads exactly the recorded waves. Whatever does not fit (a session whose catalog cannot create
bucketed tables, a bucket count that changed, a file nobody recorded) is read the plain way:
the recorded files, filtered to the partitions and shuffled by the key. Same rows, slower.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from spark_ckpt.sinks import written_files
from spark_ckpt.storage import Storage

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

__all__ = ["BUCKET_COLUMN", "BucketedTables", "bucket_layout"]

log = logging.getLogger(__name__)

BUCKET_COLUMN = "spark_ckpt_bucket"
WAVE_COLUMN = "spark_ckpt_wave"
_WAVE_DIR = re.compile(r"-b(\d+)$")
_BUCKET_DIR = re.compile(rf"^{BUCKET_COLUMN}=(\d+)$")
_BUCKET_FILE = re.compile(r"^.*_(\d+)(?:\..*)?$")  # how Spark reads a bucket id off a file name
# Partitions registered per ALTER TABLE statement (keeps each statement's text moderate).
_ADD_CHUNK = 200


def bucket_layout(paths: list[str], buckets: int) -> dict[str, dict[int, list[str]]] | None:
    """The recorded files of a bucketed vertex by wave directory and bucket, or None when any
    of them is not laid out for ``buckets`` buckets (written for another count, or plainly)."""
    waves: dict[str, dict[int, list[str]]] = {}
    for path in paths:
        parts = path.rstrip("/").split("/")
        if len(parts) < 3:
            return None
        wave, bucket_dir, name = "/".join(parts[:-2]), parts[-2], parts[-1]
        found = _WAVE_DIR.search(wave)
        in_dir = _BUCKET_DIR.match(bucket_dir)
        in_name = _BUCKET_FILE.match(name)
        if found is None or int(found.group(1)) != buckets or in_dir is None or \
                in_name is None or int(in_dir.group(1)) != int(in_name.group(1)) or \
                int(in_dir.group(1)) >= buckets:
            return None
        waves.setdefault(wave, {}).setdefault(int(in_dir.group(1)), []).append(path)
    return waves


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _ddl(t: DataType) -> str:
    """A column type as Spark SQL DDL, nested field names quoted."""
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(t, StructType):
        return "struct<" + ",".join(f"{_quote(f.name)}:{_ddl(f.dataType)}" for f in t.fields) \
            + ">"
    if isinstance(t, ArrayType):
        return f"array<{_ddl(t.elementType)}>"
    if isinstance(t, MapType):
        return f"map<{_ddl(t.keyType)},{_ddl(t.valueType)}>"
    return t.simpleString()


def _literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


class BucketedTables:
    """The temporary catalog tables of one runner's bucketed writes and reads."""

    def __init__(self, spark: SparkSession, location: Callable[[], str]) -> None:
        """``location``: an empty directory every table points at (Spark lists a table's
        location when it is created; its partitions point where the files are)."""
        self.spark = spark
        self._location = location
        self._lock = threading.Lock()
        self._open: list[str] = []
        self._supported: bool | None = None

    def _new_name(self) -> str:
        name = f"spark_catalog.default.spark_ckpt_{uuid.uuid4().hex}"
        with self._lock:
            self._open.append(name)
        return name

    def _drop(self, name: str) -> None:
        try:
            self.spark.sql(f"DROP TABLE IF EXISTS {name}")
        except Exception as exc:  # noqa: BLE001 - a leftover entry of an external table
            log.warning("Could not drop temporary table %s: %s", name, exc)
        with self._lock:
            if name in self._open:
                self._open.remove(name)

    def drop_all(self) -> None:
        with self._lock:
            names = list(self._open)
        for name in names:
            self._drop(name)

    def supported(self) -> bool:
        """True when this session's catalog creates bucketed Parquet tables (asked once; the
        probe table is external and writes nothing)."""
        if self._supported is None:
            location = self._location()
            name = self._new_name()
            try:
                self.spark.sql(f"CREATE TABLE {name} (k INT) USING parquet CLUSTERED BY (k) "
                               f"INTO 2 BUCKETS LOCATION {_literal(location)}")
                self._supported = True
            except Exception as exc:  # noqa: BLE001 - any refusal means: not here
                log.info("The session catalog cannot create bucketed Parquet tables (%s): "
                         "no durable exchanges", str(exc).splitlines()[0][:200])
                self._supported = False
            finally:
                self._drop(name)
        return self._supported

    def write_bucketed(self, df: DataFrame, directory: str, columns: tuple[str, ...],
                       buckets: int, options: dict[str, str]) -> None:
        """Write ``df`` into ``directory`` (new), bucketed by ``columns`` into ``buckets``."""
        from pyspark.sql import functions as F

        if BUCKET_COLUMN in df.columns:
            from spark_ckpt.errors import JobDefinitionError

            raise JobDefinitionError(
                f"expected no output column named {BUCKET_COLUMN} (spark_ckpt's bucket "
                f"directories use that name), found columns {df.columns}; rename it, or set "
                "spark.ckpt.batch.exchangeCuts=false")
        name = self._new_name()
        bucketed = df.withColumn(BUCKET_COLUMN,
                                 F.pmod(F.hash(*columns), F.lit(buckets)).cast("int"))
        try:
            (bucketed.write.mode("append").format("parquet").options(**options)
             .option("path", directory).partitionBy(BUCKET_COLUMN)
             .bucketBy(buckets, *columns).saveAsTable(name))
        finally:
            self._drop(name)

    def read(self, schema: StructType, files: list[str],
             columns: tuple[str, ...], buckets: int, parts: list[int] | None
             ) -> DataFrame | None:
        """The rows of buckets ``parts`` (None: all) of a bucketed vertex's recorded
        ``files``, as a bucketed table Spark reads without an exchange; None when the files
        cannot be read that way (the caller reads them plainly)."""
        layout = bucket_layout(files, buckets)
        if layout is None or not self.supported():
            return None
        if not self._only_recorded(layout):
            return None
        wanted = set(range(buckets) if parts is None else parts)
        name = self._new_name()
        cols = ", ".join(f"{_quote(f.name)} {_ddl(f.dataType)}" for f in schema.fields)
        self.spark.sql(
            f"CREATE TABLE {name} ({cols}, {WAVE_COLUMN} STRING, {BUCKET_COLUMN} INT) "
            f"USING parquet PARTITIONED BY ({WAVE_COLUMN}, {BUCKET_COLUMN}) "
            f"CLUSTERED BY ({', '.join(map(_quote, columns))}) INTO {buckets} BUCKETS "
            f"LOCATION {_literal(self._location())}")
        specs = [f"PARTITION ({WAVE_COLUMN}={_literal(wave.rsplit('/', 1)[-1])}, "
                 f"{BUCKET_COLUMN}={j}) LOCATION {_literal(f'{wave}/{BUCKET_COLUMN}={j}')}"
                 for wave, by_bucket in sorted(layout.items())
                 for j in sorted(by_bucket) if j in wanted]
        for i in range(0, len(specs), _ADD_CHUNK):
            self.spark.sql(f"ALTER TABLE {name} ADD " + " ".join(specs[i:i + _ADD_CHUNK]))
        return self.spark.table(name).drop(WAVE_COLUMN, BUCKET_COLUMN)

    @staticmethod
    def _only_recorded(layout: dict[str, dict[int, list[str]]]) -> bool:
        """True when each wave directory holds exactly its recorded data files: a catalog
        partition reads every file of its directory."""
        for wave, by_bucket in layout.items():
            recorded = {p for paths in by_bucket.values() for p in paths}
            store = Storage(wave)
            listed = {store.spark_path(info.path) for info, _ in written_files(store, store.root)}
            if listed != recorded:
                extra = sorted(listed - recorded)[:3]
                log.warning("Bucketed files of %s differ from the recorded ones (e.g. %s): "
                            "read plainly", wave, extra or sorted(recorded - listed)[:3])
                return False
        return True
