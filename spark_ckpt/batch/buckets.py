"""Durable exchanges: a vertex's output written bucketed by its one consumer's key.

A join of two large inputs is one Spark job whose first stage reads both inputs and shuffles
them by the key; none of that stage outlives the driver. A durable exchange is that shuffle
written as files: each wave of input splits is written bucketed by the consumer's key into the
consumer's partitions (Spark's bucketed writer: bucket *j* is the rows with
``pmod(hash(key), n) == j``, the same hash the consumer's partitions use), and the consumer
reads the finished waves as one bucketed table, so Spark joins bucket *j* with bucket *j* with
no exchange, and a re-run of some partitions reads only their buckets.

Layout of one wave's write directory (its name ends ``-b<n>-k<digest>``: the bucket count and
a digest of the bucket columns, so files bucketed for another count or key are never read as
bucketed for this one)::

    <results>/<vertex>/<wave>-b<n>-k<digest>/spark_ckpt_bucket=<j>/part-<task>-<uuid>_<j>.c000.parquet

Spark's bucketed reads and writes need a table in a catalog: each write and each read uses a
temporary external table in the session catalog (``spark_catalog.default.spark_ckpt_<digest of
the job id>_*``),
dropped when the vertex's run ends, after its files were recorded. A classic driver's in-memory
catalog dies with it; a Hive metastore or a Spark Connect server keeps a killed driver's tables,
so each attempt drops the job's leftovers first. A read registers one catalog partition per
(wave, bucket) it needs, pointing at that directory, so it reads exactly the recorded waves.
Whatever does not fit (a catalog that cannot create or partition bucketed tables, a bucket
count or key that changed, a file nobody recorded) is read the plain way: the recorded files,
filtered to the partitions and shuffled by the key. Same rows, slower.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spark_ckpt.storage import Storage

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

__all__ = ["BUCKET_COLUMN", "BucketedTables", "bucket_layout", "job_table_prefix",
           "layout_suffix"]

log = logging.getLogger(__name__)

BUCKET_COLUMN = "spark_ckpt_bucket"
WAVE_COLUMN = "spark_ckpt_wave"
_WAVE_DIR = re.compile(r"-b(\d+)-k([0-9a-f]{8})$")
_BUCKET_DIR = re.compile(rf"^{BUCKET_COLUMN}=(\d+)$")
_BUCKET_FILE = re.compile(r"^.*_(\d+)(?:\..*)?$")  # how Spark reads a bucket id off a file name
# Partitions registered per ALTER TABLE statement (keeps each statement's text moderate).
_ADD_CHUNK = 200


def job_table_prefix(job_id: str) -> str:
    """The start of the names of a job's temporary tables (a digest: job ids are free text,
    and one job's prefix must not be the start of another's)."""
    return f"spark_ckpt_{hashlib.sha256(job_id.encode()).hexdigest()[:12]}_"


def layout_suffix(columns: tuple[str, ...], buckets: int) -> str:
    """What a wave directory's name ends with when its files are bucketed so."""
    digest = hashlib.sha256(json.dumps(list(columns)).encode()).hexdigest()[:8]
    return f"-b{buckets}-k{digest}"


def bucket_layout(paths: list[str], columns: tuple[str, ...],
                  buckets: int) -> dict[str, dict[int, list[str]]] | None:
    """The recorded files of a bucketed vertex by wave directory and bucket, or None when any
    of them is not laid out for ``buckets`` buckets of ``columns`` (written for another count
    or key, or plainly)."""
    suffix = layout_suffix(columns, buckets)
    waves: dict[str, dict[int, list[str]]] = {}
    for path in paths:
        parts = path.rstrip("/").split("/")
        if len(parts) < 3:
            return None
        wave, bucket_dir, name = "/".join(parts[:-2]), parts[-2], parts[-1]
        found = _WAVE_DIR.search(wave)
        in_dir = _BUCKET_DIR.match(bucket_dir)
        in_name = _BUCKET_FILE.match(name)
        if found is None or found.group(0) != suffix or in_dir is None or \
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


# What the probe found, per session: a later job of the same session (a notebook's next run,
# an in-process resubmission) does not ask its catalog again.
_PROBED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_PROBED_LOCK = threading.Lock()


class BucketedTables:
    """The temporary catalog tables of one runner's bucketed writes and reads.

    ``prefix`` starts every table's name (:func:`job_table_prefix`); ``location`` gives an
    empty directory every table points at (Spark lists a table's location when it is
    created; its partitions point where the files are)."""

    def __init__(self, spark: SparkSession, location: Callable[[], str], prefix: str) -> None:
        self.spark = spark
        self._location = location
        self.prefix = re.sub(r"[^a-z0-9_]", "_", prefix.lower())
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()  # one probe, whichever wave thread asks first
        self._open: list[str] = []
        self._supported: bool | None = None

    def _new_name(self) -> str:
        name = f"spark_catalog.default.{self.prefix}{uuid.uuid4().hex}"
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
        """Drop every table this object made (after the files they wrote were recorded)."""
        with self._lock:
            names = list(self._open)
        for name in names:
            self._drop(name)

    def drop_leftovers(self) -> int:
        """Drop tables an earlier driver of the job left (a Hive metastore or a Spark
        Connect server outlives a killed driver); only the job's owner calls this."""
        try:
            rows = self.spark.sql(
                f"SHOW TABLES IN spark_catalog.default LIKE '{self.prefix}*'").collect()
        except Exception as exc:  # noqa: BLE001 - a catalog without tables has no leftovers
            log.debug("Cannot list leftover tables: %s", exc)
            return 0
        names = [f"spark_catalog.default.{r['tableName']}" for r in rows
                 if not r["isTemporary"] and r["tableName"].startswith(self.prefix)]
        for name in names:
            self._drop(name)
        return len(names)

    def supported(self) -> bool:
        """True when this session's catalog does what durable exchanges need: a bucketed,
        partitioned write through ``saveAsTable`` and a partitioned bucketed table whose
        partitions point at given directories. Asked once per session (the catalog's answer
        does not change while it lives), with an empty write into a new directory under
        ``location``."""
        with self._probe_lock:
            if self._supported is None:
                with _PROBED_LOCK:
                    known = _PROBED.get(self.spark)
                self._supported = self._probe() if known is None else known
                with _PROBED_LOCK:
                    _PROBED[self.spark] = self._supported
            return self._supported

    def _probe(self) -> bool:
        probe = f"{self._location().rstrip('/')}/probe-{uuid.uuid4().hex[:8]}"
        names = [self._new_name(), self._new_name()]
        try:
            # no rows from Python: a classic createDataFrame would start a Python worker
            (self.spark.range(0).selectExpr("CAST(id AS INT) AS k",
                                            f"CAST(id AS INT) AS {BUCKET_COLUMN}").write
             .mode("append").format("parquet").option("path", probe)
             .partitionBy(BUCKET_COLUMN).bucketBy(2, "k").saveAsTable(names[0]))
            name = names[1]
            self.spark.sql(
                f"CREATE TABLE {name} (k INT, {WAVE_COLUMN} STRING, {BUCKET_COLUMN} INT) "
                f"USING parquet PARTITIONED BY ({WAVE_COLUMN}, {BUCKET_COLUMN}) "
                f"CLUSTERED BY (k) INTO 2 BUCKETS LOCATION {_literal(self._location())}")
            self.spark.sql(f"ALTER TABLE {name} ADD PARTITION ({WAVE_COLUMN}='w', "
                           f"{BUCKET_COLUMN}=0) LOCATION {_literal(probe)}")
            self.spark.table(name).count()
            return True
        except Exception as exc:  # noqa: BLE001 - any refusal means: not here
            log.info("The session catalog cannot hold bucketed Parquet tables as durable "
                     "exchanges need (%s): none are made", str(exc).splitlines()[0][:300])
            return False
        finally:
            for name in names:  # only its own: wave threads may have tables open
                self._drop(name)

    def write_bucketed(self, df: DataFrame, directory: str, columns: tuple[str, ...],
                       buckets: int, options: dict[str, str]) -> None:
        """Write ``df`` into ``directory`` (new, named with :func:`layout_suffix`), bucketed
        by ``columns`` into ``buckets``. Its table stays until :meth:`drop_all`: dropped only
        once the files are recorded (a catalog set to purge external tables would take the
        files with it)."""
        from pyspark.sql import functions as F

        taken = [c for c in (BUCKET_COLUMN, WAVE_COLUMN) if c in df.columns]
        if taken:
            from spark_ckpt.errors import JobDefinitionError

            raise JobDefinitionError(
                f"expected no output column named {' or '.join(taken)} (spark_ckpt's bucketed "
                f"files use these names), found columns {df.columns}; rename it, or set "
                "spark.ckpt.batch.exchangeCuts=false")
        name = self._new_name()
        bucketed = df.withColumn(BUCKET_COLUMN,
                                 F.pmod(F.hash(*columns), F.lit(buckets)).cast("int"))
        (bucketed.write.mode("append").format("parquet").options(**options)
         .option("path", directory).partitionBy(BUCKET_COLUMN)
         .bucketBy(buckets, *columns).saveAsTable(name))

    def read(self, schema: StructType, files: list[str], columns: tuple[str, ...],
             buckets: int, parts: list[int] | None) -> DataFrame | None:
        """The rows of buckets ``parts`` (None: all) of a bucketed vertex's recorded
        ``files``, as a bucketed table Spark reads without an exchange; None when the files
        cannot be read that way (the caller reads them plainly)."""
        layout = bucket_layout(files, columns, buckets)
        if layout is None or not self.supported() or WAVE_COLUMN in schema.fieldNames() or \
                BUCKET_COLUMN in schema.fieldNames() or not self._only_recorded(layout):
            return None
        wanted = set(range(buckets) if parts is None else parts)
        try:
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
        except Exception as exc:  # noqa: BLE001 - e.g. a type the catalog does not take
            log.warning("Cannot read %d bucketed files as a table (%s): read plainly",
                        len(files), str(exc).splitlines()[0][:300])
            return None

    @staticmethod
    def _only_recorded(layout: dict[str, dict[int, list[str]]]) -> bool:
        """True when each wave directory holds exactly its recorded data files: a catalog
        partition reads every file of its directory."""
        for wave, by_bucket in layout.items():
            recorded = {p for paths in by_bucket.values() for p in paths}
            store = Storage(wave)
            listed = {store.spark_path(info.path)
                      for info in store.list_files(store.root, recursive=True)
                      if not _hidden(info.path[len(store.root.rstrip("/")) + 1:])}
            if listed != recorded:
                extra = sorted(listed - recorded)[:3]
                log.warning("Bucketed files of %s differ from the recorded ones (e.g. %s): "
                            "read plainly", wave, extra or sorted(recorded - listed)[:3])
                return False
        return True


def _hidden(relative: str) -> bool:
    """What Spark's file listing skips: names starting with ``.`` or ``_`` (but a ``_x=1``
    partition directory is read)."""
    return any(part.startswith(".") or (part.startswith("_") and "=" not in part)
               for part in relative.split("/"))
