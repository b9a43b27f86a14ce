"""Delta Lake interoperability, both ways, against Delta Lake's own Spark connector.

* Tables spark_ckpt writes through delta-rs (a pipeline's two-phase Delta sinks with their
  column statistics, a batch job's compacted event log) are read by Delta Spark: the same rows
  as spark_ckpt reads, its history, time travel, data skipping on the statistics (files left
  out, never a matching row), every column type a sink writes, delta-rs's log checkpoints.
* Tables Delta Spark writes are read by ``delta_stream``: appends across Delta checkpoints,
  OPTIMIZE, timestamp_ntz, and each feature spark_ckpt does not read (column mapping, deletion
  vectors) or reads only under an option (MERGE, UPDATE), which must stop the pipeline with a
  SourceError naming it, never give wrong rows.

Delta Spark is delta-spark 4.4.0 on pip PySpark 4.2.0 in a virtual environment of its own (no
release is built for Spark 4.3, spark_ckpt's: tests/delta_spark_env.py), one session for the
module in a child process; spark_ckpt runs on the suite's Spark 4.3 session. docs/delta-interop.md
has the support matrix these tests check.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from decimal import Decimal
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pyspark.sql import types as T

from delta_spark_env import DeltaSpark, DeltaSparkError
from helpers import LONG_FAULTS, LONG_ONLY
from spark_ckpt import BatchJob, PipelineFailedError, Settings, SourceError, StreamingContext
from spark_ckpt.eventlog.reader import read_table
from spark_ckpt.state import count, sum_
from spark_ckpt.storage import Storage
from spark_ckpt.storage.delta_reader import read_delta

# a test's time includes its module fixtures: the sink pipeline's two runs and Delta Spark's
# start (a few minutes on a busy 2-core machine)
pytestmark = pytest.mark.timeout(1800)
# CI reads one sink table of every column type in Delta Spark and checks that a feature
# spark_ckpt does not read stops the stream by name; the rest of both directions (history,
# statistics and skipping, checkpoints, compacted event logs, Delta Spark's writes) run with
# SPARK_CKPT_LONG_FAULTS=1: together they are ten minutes of a 2-core machine
LONG = pytest.mark.skipif(not LONG_FAULTS, reason=LONG_ONLY)

# every column type a spark_ckpt sink writes: Spark's atomic types, decimals of both
# physical sizes, timestamps with and without a time zone, nested structs, arrays and maps
SCHEMA = T.StructType([
    T.StructField("id", T.LongType()),
    T.StructField("part", T.IntegerType()),
    T.StructField("i8", T.ByteType()),
    T.StructField("i16", T.ShortType()),
    T.StructField("i32", T.IntegerType()),
    T.StructField("flag", T.BooleanType()),
    T.StructField("f32", T.FloatType()),
    T.StructField("f64", T.DoubleType()),
    T.StructField("dec", T.DecimalType(10, 2)),
    T.StructField("big", T.DecimalType(38, 6)),
    T.StructField("text", T.StringType()),
    T.StructField("raw", T.BinaryType()),
    T.StructField("day", T.DateType()),
    T.StructField("ts", T.TimestampType()),
    T.StructField("ntz", T.TimestampNTZType()),
    T.StructField("st", T.StructType([T.StructField("a", T.IntegerType()),
                                      T.StructField("b", T.StringType()),
                                      T.StructField("t", T.TimestampType())])),
    T.StructField("arr", T.ArrayType(T.IntegerType())),
    T.StructField("m", T.MapType(T.StringType(), T.LongType())),
    T.StructField("arr_st", T.ArrayType(T.StructType([T.StructField("x", T.LongType())]))),
])
ROWS_PER_FILE, FILES = 5, 4
# the columns whose statistics a reader may skip files on, and how a literal of each is spelled
# in Spark SQL (timestamps as instants; timestamp_ntz as wall-clock time)
SKIPPING = ["id", "part", "i8", "i16", "i32", "flag", "dec", "big", "text", "day", "ts", "ntz",
            "st.a", "st.b", "st.t"]


def row(i: int) -> dict:
    base_ts = dt.datetime(2026, 3, 8, 9, 59, 59, 999_999, tzinfo=dt.UTC)
    return {
        "id": i, "part": i % 2, "i8": i - 10, "i16": i * 100 - 1000, "i32": i * 1000 - 5000,
        "flag": i % 3 == 0, "f32": i * 0.5, "f64": float("nan") if i == 7 else i * 1.25,
        "dec": Decimal(i * 13725 - 100_000).scaleb(-2),
        "big": (Decimal("12345678901234567890.123456") * (1 if i % 2 else -1)
                + Decimal(i)),
        "text": None if i == 6 else ("x" * 40 + str(i) if i == 5 else
                                     ("zürich-ü" if i == 8 else f"name-{i:02d}")),
        "raw": bytes([i, 255 - i]),
        "day": dt.date(2026, 1, 1) + dt.timedelta(days=i),
        "ts": None if i == 9 else base_ts + dt.timedelta(hours=i, microseconds=i),
        # wall-clock times across the US DST change of 2026-03-08 02:00
        "ntz": dt.datetime(2026, 3, 8, 1, 30, 0, 123_456) + dt.timedelta(minutes=37 * i),
        "st": None if i == 4 else {"a": i, "b": f"b{i}", "t": base_ts - dt.timedelta(days=i)},
        "arr": None if i == 3 else list(range(i % 4)),
        "m": {"k": i, "j": -i} if i % 2 else {},
        "arr_st": [{"x": i}, {"x": i * 2}],
    }


def sql_literal(column: str, value) -> str:
    if value is None:
        return "NULL"
    kind = {"ts": "ts", "st.t": "ts", "ntz": "ntz", "day": "date", "text": "str",
            "st.b": "str", "dec": "dec", "big": "dec"}.get(column, "plain")
    if kind == "ts":
        return f"TIMESTAMP '{value.astimezone(dt.UTC).isoformat(sep=' ')}'"
    if kind == "ntz":
        return f"TIMESTAMP_NTZ '{value.isoformat(sep=' ')}'"
    if kind == "date":
        return f"DATE '{value.isoformat()}'"
    if kind == "str":
        return "'" + value.replace("'", "''") + "'"
    if kind == "dec":
        return f"{value}BD"
    return str(value).lower() if isinstance(value, bool) else str(value)


def value_of(r: dict, column: str):
    for part in column.split("."):
        r = None if r is None else r.get(part)
    return r


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def delta_spark(tmp_path_factory):
    directory = tmp_path_factory.mktemp("delta-spark")
    session = DeltaSpark(directory / "warehouse", directory / "worker.log")
    yield session
    session.close()


def rows_json(spark, df) -> list[dict]:
    """A DataFrame's rows as Spark writes them as JSON (both Sparks spell values alike)."""
    from pyspark.sql import functions as F

    return sorted((json.loads(r[0]) for r in df.select(F.to_json(F.struct("*"))).collect()),
                  key=lambda r: json.dumps(r, sort_keys=True))


def delta_rows(delta_spark: DeltaSpark, path: str, columns: list[str] | None = None,
               **read_options) -> list[dict]:
    code = ("df = spark.read.format('delta')\n"
            "for k, v in args['options'].items():\n"
            "    df = df.option(k, v)\n"
            "df = df.load(args['path'])\n"
            "if args['columns']:\n"
            "    df = df.select(*args['columns'])\n"
            "import json\n"
            "result = [json.loads(r[0]) for r in"
            " df.select(F.to_json(F.struct('*'))).collect()]")
    got = delta_spark.run(code, path=path, columns=columns, options=read_options)
    return sorted(got, key=lambda r: json.dumps(r, sort_keys=True))


def write_input_file(spark, directory: Path, k: int) -> None:
    """File ``k`` of the source: rows ``k*5 .. k*5+4``, one Parquet file Spark wrote."""
    rows = [row(i) for i in range(k * ROWS_PER_FILE, (k + 1) * ROWS_PER_FILE)]
    scratch = directory.parent / f"scratch-{k}"
    spark.createDataFrame(rows, SCHEMA).coalesce(1).write.parquet(str(scratch))
    (part,) = scratch.glob("part-*.parquet")
    directory.mkdir(exist_ok=True)
    shutil.move(str(part), directory / f"in-{k}.parquet")
    shutil.rmtree(scratch)


def run_sink_pipeline(spark, tmp_path: Path) -> dict:
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "interop",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             state_parallelism=2))
    stream = ctx.file_stream("in", str(tmp_path / "input"), "parquet", SCHEMA,
                             max_files_per_batch=1)
    stream.write_delta(str(tmp_path / "all_types"), name="all_types", partition_by=["part"])
    stream.key_by("part").agg(name="totals", n=count(), total=sum_("i32")) \
        .write_delta(str(tmp_path / "totals"), name="totals", merge_keys=["part"])
    return {"batches": len(ctx.process_available(timeout=900))}


@pytest.fixture(scope="module")
def sink_tables(spark, tmp_path_factory):
    """A pipeline's two-phase Delta sinks: every column type, partitioned, appended per
    checkpoint; and a keyed aggregation merged by key. Two runs (the second a restart from the
    first's checkpoint), four input files a batch each."""
    tmp_path = tmp_path_factory.mktemp("sinks")
    for k in range(2):
        write_input_file(spark, tmp_path / "input", k)
    first = run_sink_pipeline(spark, tmp_path)
    for k in range(2, FILES):
        write_input_file(spark, tmp_path / "input", k)
    second = run_sink_pipeline(spark, tmp_path)
    assert first["batches"] >= 2 and second["batches"] >= 2
    return tmp_path


# -- written by spark_ckpt, read by Delta Spark -----------------------------------------------
def test_a_sink_table_of_every_column_type_reads_the_same_in_delta_spark(spark, delta_spark,
                                                                           sink_tables):
    path = str(sink_tables / "all_types")
    want = rows_json(spark, spark.read.schema(SCHEMA).parquet(str(sink_tables / "input")))
    assert len(want) == ROWS_PER_FILE * FILES
    # spark_ckpt's own reading (delta-rs decides the files) gives the input's rows
    own = read_delta(path)
    assert rows_json(spark, spark.createDataFrame(own.select(SCHEMA.names), SCHEMA)) == want
    # and Delta Spark's, with the table's schema as Delta Spark reads it
    assert delta_rows(delta_spark, path, SCHEMA.names) == want
    schema = delta_spark.run("result = spark.read.format('delta').load(args['p']).schema.json()",
                             p=path)
    assert T.StructType.fromJson(json.loads(schema)) == SCHEMA
    detail = delta_spark.sql(f"DESCRIBE DETAIL delta.`{path}`")[0]
    assert detail["partitionColumns"] == ["part"]
    assert detail["numFiles"] == len(DeltaTable(path).file_uris()) == 2 * FILES
    # timestamp_ntz needs its table feature (reader 3, writer 7): Delta Spark reads it as such
    assert "timestampNtz" in detail.get("tableFeatures", []), detail


@LONG
def test_delta_spark_reads_the_sinks_history_and_each_version(delta_spark, sink_tables):
    for name in ("all_types", "totals"):
        path = str(sink_tables / name)
        own = DeltaTable(path)
        history = delta_spark.sql(f"DESCRIBE HISTORY delta.`{path}`")
        assert sorted(h["version"] for h in history) == list(range(own.version() + 1))
        operations = {h["operation"] for h in history}
        assert "CREATE TABLE" in operations
        assert operations & {"WRITE", "MERGE"}, operations
        for version in range(1, own.version() + 1):
            got = delta_rows(delta_spark, path, None, versionAsOf=str(version))
            assert len(got) == read_delta(path, version=version).num_rows, (name, version)
    # the merged totals: one row per key, as spark_ckpt reads them
    totals = delta_rows(delta_spark, str(sink_tables / "totals"), ["part", "n", "total"])
    rows = [row(i) for i in range(ROWS_PER_FILE * FILES)]
    assert totals == [{"part": p, "n": sum(1 for r in rows if r["part"] == p),
                       "total": sum(r["i32"] for r in rows if r["part"] == p)} for p in (0, 1)]


@LONG
def test_delta_spark_sees_the_sinks_app_transactions(delta_spark, sink_tables):
    """A Delta Spark writer given the same txnAppId would skip the versions the sink wrote."""
    path = str(sink_tables / "all_types")
    own = DeltaTable(path)
    got = delta_spark.run(
        "dl = spark._jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession,"
        " args['p'])\n"
        "spark.read.format('delta').load(args['p']).limit(1).collect()\n"
        "txns = dl.unsafeVolatileSnapshot().transactions()\n"
        "it = txns.iterator()\n"
        "result = {}\n"
        "while it.hasNext():\n"
        "    kv = it.next()\n"
        "    result[kv._1()] = kv._2()", p=path)
    assert len(got) == 1
    (app_id, version), = got.items()
    assert own.transaction_version(app_id) == version >= 2


STATS_CHECK = """
from pyspark.sql.classic.dataframe import DataFrame
spark.conf.set('spark.sql.session.timeZone', args['zone'])
log = spark._jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, args['p'])
spark.read.format('delta').load(args['p']).limit(1).collect()  # the log's latest version
snapshot = log.unsafeVolatileSnapshot()
import json
raw = DataFrame(snapshot.allFiles().toDF(), spark).select('path', F.col('stats').alias('raw'))
stats = DataFrame(snapshot.withStats(), spark).select('path', 'stats').join(raw, 'path')
data = spark.read.format('delta').load(args['p']).withColumn('f', F.col('_metadata.file_path'))
aggs = [F.count(F.lit(1)).alias('rows')]
for c in args['columns']:
    aggs += [F.min(c).alias('min ' + c), F.max(c).alias('max ' + c),
             F.count_if(F.col(c).isNull()).alias('nulls ' + c)]
actual = data.groupBy('f').agg(*aggs)
# by the whole path: files of two partition directories may share a name
joined = stats.join(actual, F.col('f').endswith(F.concat(F.lit('/'), F.col('path'))), 'full')
problems, unparsed = [], set()
for r in joined.collect():
    where = r['path'] or r['f']
    if r['stats'] is None or r['rows'] is None:
        problems.append((where, 'file without stats or rows'))
        continue
    if r['stats']['numRecords'] != r['rows']:
        problems.append((where, 'numRecords', r['stats']['numRecords'], r['rows']))
    for c in args['columns']:
        def stat(kind):
            value = r['stats'][kind]
            for part in c.split('.'):
                value = None if value is None or part not in value.__fields__ else value[part]
            return value
        lo, hi, nulls = stat('minValues'), stat('maxValues'), stat('nullCount')
        written = json.loads(r['raw']).get('minValues', {})
        for part in c.split('.'):
            written = written.get(part) if isinstance(written, dict) else None
        if written is not None and (lo is None or hi is None):
            unparsed.add(c)  # the log has it, Delta Spark could not read it
            continue
        if lo is not None and not (lo <= r['min ' + c] and r['max ' + c] <= hi):
            problems.append((where, c, str(lo), str(hi), str(r['min ' + c]), str(r['max ' + c])))
        if nulls is not None and nulls != r['nulls ' + c]:
            problems.append((where, c, 'nullCount', nulls, r['nulls ' + c]))
spark.conf.set('spark.sql.session.timeZone', 'UTC')
result = {'problems': problems, 'unparsed': sorted(unparsed), 'files': joined.count()}
"""


@LONG
@pytest.mark.parametrize("zone", ["UTC", "America/Los_Angeles"])
def test_delta_spark_parses_the_sinks_statistics_and_each_one_holds(delta_spark, sink_tables,
                                                                   zone):
    """Delta Spark's own parsing of each file's statistics (``withStats``: the typed values
    its data skipping compares predicates with), against each file's true minimum, maximum
    and null count, in a session time zone that is UTC and one that is not: a range that did
    not hold would skip a file holding matching rows."""
    path = str(sink_tables / "all_types")
    got = delta_spark.run(STATS_CHECK, p=path, zone=zone, columns=SKIPPING)
    assert got["files"] == 2 * FILES
    assert not got["problems"], got["problems"][:10]
    # every column with statistics is one Delta Spark parses (none dropped as unreadable),
    # but a boolean's: Delta Spark keeps no minimum or maximum of booleans (delta-rs writes
    # them), so it never skips a file on one
    assert got["unparsed"] in ([], ["flag"]), got["unparsed"]


@LONG
def test_delta_spark_reads_only_the_files_the_statistics_admit(delta_spark, sink_tables):
    path = str(sink_tables / "all_types")
    files = len(DeltaTable(path).file_uris())
    scans = delta_spark.run(
        "df = spark.read.format('delta').load(args['p'])\n"
        "result = {p: scan_metrics(df.where(p)).get('numFiles') for p in args['predicates']}",
        p=path, predicates=["id = 0", "id = 4", "id = 3", "id >= 100",
                            "ntz = TIMESTAMP_NTZ '2026-03-08 01:30:00.123456'",
                            "day = DATE '2026-01-01'", "dec = -1000.00BD", "text = 'name-00'",
                            "st.a = 0", "ts < TIMESTAMP '2026-03-08'", "id >= 0"])
    assert scans["id >= 0"] == files == 2 * FILES
    # A batch's two files (part = id % 2) hold alternating ids: the first batch's ids 0, 2, 4
    # and 1, 3; their ranges interleave, so id 3 (part 1's) is inside part 0's [0, 4] too and
    # both files are read; ids 0 and 4, the ends of part 0's range, are in one file's range only
    assert scans["id = 3"] == 2
    assert scans["id = 0"] == scans["id = 4"] == 1
    assert scans["id >= 100"] == 0
    # ... and so is row 0's value of each other column, through its column's statistics
    # (decimals, dates, strings, timestamp_ntz, a nested struct's field)
    for predicate in ("ntz = TIMESTAMP_NTZ '2026-03-08 01:30:00.123456'",
                      "day = DATE '2026-01-01'", "dec = -1000.00BD", "st.a = 0"):
        assert scans[predicate] == 1, (predicate, scans)
    # the file of i = 5 has no string statistics (a value longer than 32 characters): read
    assert scans["text = 'name-00'"] == 2
    assert scans["ts < TIMESTAMP '2026-03-08'"] == 0


@LONG
def test_delta_spark_reads_a_sink_table_through_a_delta_rs_checkpoint(delta_spark, tmp_path,
                                                                    sink_tables):
    """delta-rs's log checkpoint (Parquet, with the add actions' statistics) as Delta Spark's
    starting point: same rows, and still skipping files on the statistics."""
    path = tmp_path / "all_types"
    shutil.copytree(sink_tables / "all_types", path)
    table = DeltaTable(str(path))
    table.create_checkpoint()
    for v in range(table.version()):  # only the checkpoint holds the older versions now
        (path / "_delta_log" / f"{v:020d}.json").unlink()
    want = delta_rows(delta_spark, str(sink_tables / "all_types"), SCHEMA.names)
    assert delta_rows(delta_spark, str(path), SCHEMA.names) == want
    scans = delta_spark.run(
        "df = spark.read.format('delta').load(args['p'])\n"
        "result = scan_metrics(df.where('id = 0')).get('numFiles')", p=str(path))
    assert scans == 1  # (the one file whose range holds id 0: see the test above)


@LONG
def test_delta_spark_reads_a_compacted_event_log_as_spark_ckpt_does(spark, delta_spark,
                                                                  tmp_path):
    from pyspark.sql import functions as F

    job = BatchJob("interop", spark=spark, work_dir=str(tmp_path / "work"),
                   settings=Settings(progress="never", event_log_flush_interval_ms=50,
                                     event_log_flush_max_events=1,
                                     event_log_compact_at_files=3,
                                     batch_exchange_min_bytes=0))
    numbers = job.source("numbers", lambda s: s.range(0, 400).withColumn(
        "bucket", (F.col("id") % 5).cast("int")), parallelism=4, split_by=["id"])
    sums = job.vertex("sums", lambda df: df.groupBy("bucket").agg(F.sum("id").alias("total")),
                      numbers.by("bucket"), parallelism=3)
    job.write_parquet(sums, str(tmp_path / "out"))
    assert job.run().status == "succeeded"
    events = str(tmp_path / "work" / "interop" / "events")
    own, _version, problems = read_table(Storage(events), events)
    assert not problems
    history = delta_spark.sql(f"DESCRIBE HISTORY delta.`{events}`")
    assert "OPTIMIZE" in {h["operation"] for h in history}  # the log was compacted
    got = delta_rows(delta_spark, events, ["job_attempt", "seq", "event_type", "vertex_id",
                                           "payload"])
    want = sorted(({k: v for k, v in r.items() if v is not None} for r in
                   own.select(["job_attempt", "seq", "event_type", "vertex_id", "payload"])
                   .to_pylist()), key=lambda r: json.dumps(r, sort_keys=True))
    assert got == want
    assert len({(r["job_attempt"], r["seq"]) for r in got}) == len(got)  # each event once
    assert sum(1 for r in got if r["event_type"] == "ExecutionVertexFinished") >= 7


# -- written by Delta Spark, read by delta_stream ---------------------------------------------
def stream_once(spark, tmp_path: Path, table: str, ckpt: str = "ckpt", **options) -> list:
    """One available-now run of ``delta_stream(table) -> write_parquet``; the output rows
    (all runs of this checkpoint) as JSON."""
    ctx = StreamingContext(spark, 0.1, str(tmp_path / ckpt), "from-delta-spark",
                           settings=Settings(progress="never"))
    ctx.delta_stream("src", table, **options).write_parquet(str(tmp_path / f"{ckpt}-out"),
                                                            name="out")
    try:
        ctx.process_available(timeout=600)
    except PipelineFailedError as exc:  # the source's own error, as the tests match it
        if isinstance(exc.__cause__, SourceError):
            raise exc.__cause__ from exc
        raise
    out = tmp_path / f"{ckpt}-out"
    if not out.exists() or not any(out.rglob("*.parquet")):
        return []
    return rows_json(spark, spark.read.parquet(str(out)))


@LONG
def test_appends_across_delta_spark_checkpoints_and_optimize_read_each_row_once(
        spark, delta_spark, tmp_path):
    table = str(tmp_path / "t")
    delta_spark.run(f"spark.sql(\"CREATE TABLE delta.`{table}` (id BIGINT, k INT, s STRING) "
                    "USING delta TBLPROPERTIES ('delta.checkpointInterval' = '2')\")")
    write = ("spark.range(args['lo'], args['hi'], numPartitions=2)"
             ".selectExpr('id', 'CAST(id % 3 AS INT) AS k', 'CAST(id AS STRING) AS s')"
             ".write.format('delta').mode('append').save(args['p'])")
    for lo in range(0, 30, 10):
        delta_spark.run(write, p=table, lo=lo, hi=lo + 10)
    assert any(Path(table, "_delta_log").glob("*.checkpoint*.parquet"))
    assert [r["id"] for r in sorted(stream_once(spark, tmp_path, table),
                                    key=lambda r: r["id"])] == list(range(30))
    delta_spark.run(f"spark.sql('OPTIMIZE delta.`{table}`')")
    delta_spark.run(write, p=table, lo=30, hi=40)
    delta_spark.run(write, p=table, lo=40, hi=50)  # a second checkpoint after the OPTIMIZE
    got = stream_once(spark, tmp_path, table)
    assert [r["id"] for r in sorted(got, key=lambda r: r["id"])] == list(range(50))
    assert got == delta_rows(delta_spark, table)
    # a new pipeline starts from the snapshot, which delta-rs loads from Delta Spark's checkpoint
    assert stream_once(spark, tmp_path, table, ckpt="fresh") == got


@LONG
def test_timestamp_ntz_and_every_type_delta_spark_writes_read_exactly(spark, delta_spark,
                                                                     sink_tables, tmp_path):
    table = str(tmp_path / "typed")
    delta_spark.run("spark.read.format('delta').load(args['src']).write.format('delta')"
                    ".partitionBy('part').save(args['p'])",
                    src=str(sink_tables / "all_types"), p=table)
    detail = delta_spark.sql(f"DESCRIBE DETAIL delta.`{table}`")[0]
    assert "timestampNtz" in detail.get("tableFeatures", []), detail
    first = stream_once(spark, tmp_path, table)
    want = delta_rows(delta_spark, table)
    assert first == want and len(first) == ROWS_PER_FILE * FILES
    # then an append of Delta Spark's read as a change (not the snapshot)
    delta_spark.run("spark.read.format('delta').load(args['p']).where('id < 3')"
                    ".write.format('delta').mode('append').save(args['p'])", p=table)
    assert stream_once(spark, tmp_path, table) == delta_rows(delta_spark, table)


def test_column_mapping_stops_the_stream_by_name(spark, delta_spark, tmp_path):
    table = str(tmp_path / "mapped")
    delta_spark.run(
        f"spark.sql(\"CREATE TABLE delta.`{table}` (id BIGINT, name STRING) USING delta "
        "TBLPROPERTIES ('delta.columnMapping.mode' = 'name')\")\n"
        f"spark.sql(\"INSERT INTO delta.`{table}` VALUES (1, 'a'), (2, 'b')\")\n"
        f"spark.sql(\"ALTER TABLE delta.`{table}` RENAME COLUMN name TO label\")")
    with pytest.raises(SourceError, match="column mapping"):
        stream_once(spark, tmp_path, table)
    with pytest.raises(SourceError, match="column mapping"):
        stream_once(spark, tmp_path, table, ckpt="from-0", starting_version=0)


@LONG
def test_deletion_vectors_stop_the_stream_by_name_unless_their_commits_are_skipped(
        spark, delta_spark, tmp_path):
    table = str(tmp_path / "dv")
    delta_spark.run(
        f"spark.sql(\"CREATE TABLE delta.`{table}` (id BIGINT) USING delta "
        "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')\")\n"
        "spark.range(0, 20, numPartitions=1).write.format('delta').mode('append')"
        ".save(args['p'])", p=table)
    before = stream_once(spark, tmp_path, table)  # a pipeline reading before the DELETE
    assert sorted(r["id"] for r in before) == list(range(20))
    delta_spark.run(f"spark.sql('DELETE FROM delta.`{table}` WHERE id % 4 = 0')")
    assert any(a.get("add", {}).get("deletionVector")
               for f in Path(table, "_delta_log").glob("*.json")
               for a in map(json.loads, f.read_text().splitlines()))
    # the snapshot of a new pipeline holds a file with a deletion vector
    with pytest.raises(SourceError, match="deletion vector"):
        stream_once(spark, tmp_path, table, ckpt="fresh")
    # the running pipeline meets the DELETE's commit: it rewrote rows, refused by default...
    with pytest.raises(SourceError, match="removed 1 file"):
        stream_once(spark, tmp_path, table)
    # ... and read as a change (ignore_changes) it would need the vector: refused by name
    with pytest.raises(SourceError, match="deletion vector"):
        stream_once(spark, tmp_path, table, ignore_changes=True)
    # skipped (skip_change_commits), the appends after it read right
    delta_spark.run("spark.range(100, 105, numPartitions=1).write.format('delta')"
                    ".mode('append').save(args['p'])", p=table)
    got = stream_once(spark, tmp_path, table, skip_change_commits=True)
    assert sorted(r["id"] for r in got) == [*range(20), *range(100, 105)]


@LONG
def test_a_delta_table_source_refuses_deletion_vectors_and_column_mapping_by_name(
        spark, delta_spark, tmp_path):
    """``ctx.delta_table`` (a temporal join's side) reads versions through delta-rs's Arrow
    reader, which applies neither deletion vectors nor column mapping: refused by name
    (column mapping at reader version 2 has no reader feature for delta-rs to refuse: renamed
    columns would read as nulls)."""
    from spark_ckpt.sources.delta_table import DeltaTableSource

    dv, mapped = str(tmp_path / "dv"), str(tmp_path / "mapped")
    delta_spark.run(
        f"spark.sql(\"CREATE TABLE delta.`{dv}` (id BIGINT) USING delta "
        "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')\")\n"
        f"spark.range(0, 10, numPartitions=1).write.format('delta').mode('append').save('{dv}')\n"
        f"spark.sql('DELETE FROM delta.`{dv}` WHERE id < 4')\n"
        f"spark.sql(\"CREATE TABLE delta.`{mapped}` (id BIGINT, name STRING) USING delta "
        "TBLPROPERTIES ('delta.columnMapping.mode' = 'name')\")\n"
        f"spark.sql(\"INSERT INTO delta.`{mapped}` VALUES (1, 'a'), (2, 'b')\")\n"
        f"spark.sql(\"ALTER TABLE delta.`{mapped}` RENAME COLUMN name TO label\")")
    for path, named in ((dv, "deletionVectors"), (mapped, "column mapping")):
        source = DeltaTableSource("side", path)
        with pytest.raises(SourceError, match=named):
            source.snapshot(source.plan()["version"])


@LONG
def test_merge_and_update_follow_the_streaming_options(spark, delta_spark, tmp_path):
    table = str(tmp_path / "merged")
    delta_spark.run("spark.range(0, 10, numPartitions=2).selectExpr('id', 'id * 10 AS v')"
                    ".write.format('delta').save(args['p'])", p=table)
    assert len(stream_once(spark, tmp_path, table)) == 10
    delta_spark.run(
        f"spark.sql('UPDATE delta.`{table}` SET v = -1 WHERE id = 3')\n"
        "spark.range(8, 12).selectExpr('id', 'id * 100 AS v').createOrReplaceTempView('src')\n"
        f"spark.sql('MERGE INTO delta.`{table}` t USING src s ON t.id = s.id "
        "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *')")
    with pytest.raises(SourceError, match=r"\(UPDATE\) removed"):
        stream_once(spark, tmp_path, table)
    # skip_change_commits: neither commit is read (their new rows neither)
    skipped = stream_once(spark, tmp_path, table, skip_change_commits=True)
    assert sorted((r["id"], r["v"]) for r in skipped) == [(i, i * 10) for i in range(10)]
    # ignore_changes: each commit's rewritten files again, the unchanged rows with them
    changed = stream_once(spark, tmp_path, table, ckpt="ckpt-changes", starting_version=1,
                          ignore_changes=True)
    now = {(r["id"], r["v"]) for r in delta_rows(delta_spark, table)}
    assert now <= {(r["id"], r["v"]) for r in changed}
    assert {(3, -1), (8, 800), (10, 1000), (11, 1100)} <= now


@LONG
def test_delta_spark_refuses_nothing_spark_ckpt_wrote_and_errors_are_not_silent(delta_spark,
                                                                               tmp_path):
    """The worker reports Delta Spark's own errors (a path that is no table), not empty rows."""
    with pytest.raises(DeltaSparkError, match="not a Delta table|DELTA_|PATH_NOT_FOUND"):
        delta_rows(delta_spark, str(tmp_path / "nothing"))


def test_timestamp_ntz_statistics_are_wall_clock_times_without_a_zone(tmp_path):
    """A timestamp_ntz column's figures carry no zone (as Delta Spark writes them); a
    timestamp's are instants in UTC marked Z. Both widened to the millisecond."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_ckpt.sinks.stats import file_stats

    path = str(tmp_path / "t.parquet")
    at = [dt.datetime(2026, 3, 8, 1, 30, 0, 123_456), dt.datetime(2026, 3, 8, 2, 30)]
    pq.write_table(pa.table({"ntz": pa.array(at, pa.timestamp("us")),
                             "ts": pa.array(at, pa.timestamp("us", tz="UTC"))}), path)
    stats = json.loads(file_stats(path, 2, set()))
    assert stats["minValues"] == {"ntz": "2026-03-08T01:30:00.123",
                                  "ts": "2026-03-08T01:30:00.123Z"}
    assert stats["maxValues"] == {"ntz": "2026-03-08T02:30:00.000",
                                  "ts": "2026-03-08T02:30:00.000Z"}
