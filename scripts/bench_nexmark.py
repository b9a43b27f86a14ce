"""Nexmark throughput (issue 35): spark_ckpt against Structured Streaming and PyFlink SQL, the
same events, the same query, each system writing its result exactly once, outputs checked
against batch Spark SQL over all events.

    python scripts/bench_nexmark.py --events 10000000 --reps 1 \\
        --pyflink /opt/flinkenv/bin/python --json benchmarks/results/nexmark.json

The generator's events (scripts/nexmark_gen.py, 10,000 a second of event time) in ``--files``
Parquet files; each arm its own driver process, the arms in alternating order between
repetitions and between queries:

``ckpt``   spark_ckpt: ``ctx.file_stream`` of the files, ``--files-per-batch`` a batch,
           ``with_watermark("dateTime", "4 seconds")``, the query of
           scripts/nexmark_queries.py, ``write_parquet`` (two-phase: files visible when a
           checkpoint completes, one every 10 s), ``process_available``; state on the default
           backend, ``state_parallelism`` 2;
``ss``     Structured Streaming as a careful user writes the query: ``readStream`` of the
           files, ``maxFilesPerTrigger`` the same, ``withWatermark``, the query in the
           DataFrame API (``ss_query`` below: the windowed ones written for it, every
           other one its batch reference run on the stream), RocksDB state with changelog
           checkpointing, the file sink (exactly once), ``availableNow``. A query
           Structured Streaming refuses is reported with its error;
``batch``  the floor under both Spark arms: the query's batch Spark SQL (the reference) over
           every event in one job, written to Parquet (rows of windows the final watermark
           does not close left out before the check, as for Flink);
``flink``  PyFlink SQL (``--pyflink PYTHON``): Flink's nexmark SQL over a Parquet copy of the
           events (one file of one row group: read in event order, see ``prepare``), RocksDB,
           incremental checkpoints every 10 s, parallelism 2 (scripts/bench_nexmark_flink.py).

With ``--source kafka --kafka BOOTSTRAP`` the ``ckpt`` arm (the only one then) reads the
events from a Kafka topic instead (``--topic``, ``nexmark-<events>-s42-r10000`` by default, with
``--partitions``; written by ``nexmark_gen.produce`` when it does not hold them yet, kept
between runs), ``nexmark_queries.kafka_input``, at most ``--files-per-batch`` files' worth of
offsets a batch; the reference and the check are the same (q12's reference needs files).

Throughput is the events over the query's time: for the Spark arms from the query's start to
its end (the driver's start is reported beside it); for Flink its job's net runtime (its
local executor starts a mini-cluster for the job; the time from submission is reported
beside it). Checked: each arm's rows equal the
reference's (``nexmark_queries.QUERIES``), over the windows that the final watermark (the
last event's time less 4 s) closes. Flink closes every window at the end of its bounded
input; its rows of the windows past that watermark are left out before comparing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_nexmark_flink  # noqa: E402  (its SQL; pyflink is imported only in its main)
import nexmark_gen  # noqa: E402
import nexmark_queries  # noqa: E402

RATE = 10_000  # events a second of event time (the generator's default)
FLINK_PARQUET = ("https://repo1.maven.org/maven2/org/apache/flink/flink-sql-parquet/"
                 "{v}/flink-sql-parquet-{v}.jar")
CACHE = Path.home() / ".cache" / "spark-ckpt-bench"


# -- Structured Streaming's queries ---------------------------------------------------------
def _ss_kind(ev: Any, kind: int, struct: str, fields: list[str]) -> Any:
    """One kind's fields, with the events' top-level ``dateTime`` (which carries the
    watermark; it equals the kind's own) in the place of the kind's."""
    from pyspark.sql import functions as F

    return ev.where(f"event_type = {kind}").select(
        *[F.col("dateTime") if f == "dateTime" else F.col(f"{struct}.{f}") for f in fields])


def ss_bids(ev: Any) -> Any:
    return _ss_kind(ev, 2, "bid", ["auction", "bidder", "price", "channel", "url", "dateTime",
                                   "extra"])


def ss_q5(ev: Any) -> Any:
    from pyspark.sql import functions as F

    counts = ss_bids(ev).groupBy("auction", F.window("dateTime", "10 seconds", "2 seconds")) \
        .agg(F.count(F.lit(1)).alias("num"))
    # one event-time column a stream: the largest count per sliding window groups by a
    # 2-second window over the counts' window_time (one sliding window ends in each) and
    # carries the sliding window's bounds as plain columns
    maxes = counts.select(F.col("window.start").alias("mstart"),
                          F.col("window.end").alias("mend"), "num",
                          F.window_time("window").alias("wt")) \
        .groupBy(F.window("wt", "2 seconds").alias("w"), "mstart", "mend") \
        .agg(F.max("num").alias("maxn"))
    c = counts.select("auction", "num", F.col("window.start").alias("starttime"),
                      F.col("window.end").alias("endtime"), F.window_time("window").alias("ct"))
    m = maxes.select("mstart", "mend", "maxn", F.window_time("w").alias("mt"))
    return c.join(m, (c.starttime == m.mstart) & (c.endtime == m.mend) & (c.num >= m.maxn)
                  & (c.ct >= m.mt - F.expr("INTERVAL 2 seconds")) & (c.ct <= m.mt)) \
        .select("auction", "num", "starttime")


def ss_q7(ev: Any) -> Any:
    from pyspark.sql import functions as F

    b = ss_bids(ev)
    maxes = b.groupBy(F.window("dateTime", "10 seconds")) \
        .agg(F.max("price").alias("maxprice")) \
        .select("maxprice", F.col("window.end").alias("wend"),
                F.window_time("window").alias("m_time"))
    # the reference's bound is the window's end less 1 ms (Flink's rowtime); window_time, the
    # time column that carries the watermark, is the end less 1 µs: bound on both
    return b.join(maxes, (b.price == maxes.maxprice)
                  & (b.dateTime >= maxes.wend - F.expr("INTERVAL 10001 milliseconds"))
                  & (b.dateTime <= maxes.wend - F.expr("INTERVAL 1 millisecond"))
                  & (b.dateTime >= maxes.m_time - F.expr("INTERVAL 11 seconds"))
                  & (b.dateTime <= maxes.m_time)) \
        .select("auction", "price", "bidder", "dateTime", "extra")


def ss_q8(ev: Any) -> Any:
    from pyspark.sql import functions as F

    p = _ss_kind(ev, 0, "person", ["id", "name", "dateTime"]) \
        .groupBy("id", "name", F.window("dateTime", "10 seconds")).count() \
        .select("id", "name", F.col("window").alias("pw"))
    a = _ss_kind(ev, 1, "auction", ["seller", "dateTime"]) \
        .groupBy("seller", F.window("dateTime", "10 seconds")).count() \
        .select("seller", F.col("window").alias("aw"))
    return p.join(a, (p.id == a.seller) & (p.pw == a.aw)) \
        .select("id", "name", F.col("pw.start").alias("starttime"))


def ss_q11(ev: Any) -> Any:
    from pyspark.sql import functions as F

    return ss_bids(ev).groupBy("bidder", F.session_window("dateTime", "10 seconds").alias("w")) \
        .agg(F.count(F.lit(1)).alias("bid_count")) \
        .select("bidder", "bid_count", F.col("w.start").alias("starttime"),
                F.col("w.end").alias("endtime"))


def ss_q12(ev: Any) -> Any:
    """Processing-time windows as a Structured Streaming user writes them: each micro-batch's
    ``current_timestamp()``, watermarked with no delay."""
    from pyspark.sql import functions as F

    b = ss_bids(ev).withColumn("p_time", F.current_timestamp()) \
        .withWatermark("p_time", "0 seconds")
    return b.groupBy("bidder", F.window("p_time", "10 seconds").alias("w")) \
        .agg(F.count(F.lit(1)).alias("bid_count")) \
        .select("bidder", "bid_count", F.col("w.start").alias("starttime"),
                F.col("w.end").alias("endtime"))


def ss_batch_files(ckpt: Path) -> dict[str, int]:
    """File name -> the ``current_timestamp()`` of the micro-batch that read it, from the
    query's offset log (``batchTimestampMs``) and its file source's log (every entry names its
    batch; the log is compacted every 10 batches into ``N.compact``, which holds them all)."""
    stamps = {}
    for offsets in (ckpt / "offsets").iterdir():
        if offsets.name.isdigit():
            meta = json.loads(offsets.read_text().splitlines()[1])
            stamps[int(offsets.name)] = int(meta["batchTimestampMs"])
    times = {}
    for log in (ckpt / "sources" / "0").iterdir():
        if not log.name.removesuffix(".compact").isdigit():
            continue
        for line in log.read_text().splitlines()[1:]:
            entry = json.loads(line)
            times[entry["path"].rsplit("/", 1)[-1]] = stamps[int(entry["batchId"])]
    return times


# The queries whose windows need the watermarked column and window_time; every other query is
# its batch reference run on the stream: the same DataFrame or SQL, as a user ports it
SS_WINDOWED = {"q5": ss_q5, "q7": ss_q7, "q8": ss_q8, "q11": ss_q11, "q12": ss_q12}


def ss_query(name: str, events: Any) -> Any:
    if name in SS_WINDOWED:
        return SS_WINDOWED[name](events)
    return nexmark_queries.QUERIES[name][1](events.sparkSession, events)


# The columns a ROW_NUMBER query determines where rows tie on its order (the same dateTime of
# one bidder's bids on one auction in q18, the same price in q19's top 10, the same price and
# time in q9): SQL leaves the row among the tied ones to the engine, so Spark's, Flink's and
# spark_ckpt's choices are compared on the columns every tied row shares (so, for these three,
# the other columns are not checked: a row mixing two bids' columns would pass)
TIES = {
    "q9": ["id", "itemName", "description", "initialBid", "reserve", "dateTime", "expires",
           "seller", "category", "extra", "auction", "price", "bid_dateTime"],
    "q18": ["auction", "bidder", "dateTime"],
    "q19": ["auction", "rank", "price"],
}


def upsert_keys(query: str) -> list[str]:
    """The keys of a query whose result is an update stream (none for an append result)."""
    mode = nexmark_queries.QUERIES[query][2]
    return mode.split(":")[1].split(",") if mode.startswith("upsert:") else []


def _batch_writer(out: str) -> Any:
    """An update stream's sink, the same in both Spark arms: each batch's rows appended to
    Parquet with the batch's id; the last row of a key is its result."""
    from pyspark.sql import functions as F

    def write(df: Any, batch: int) -> None:
        df.withColumn("__batch", F.lit(batch)).write.mode("append").parquet(out)
    return write


# -- the children ---------------------------------------------------------------------------
def session(name: str) -> Any:
    import logging

    from spark_ckpt import get_or_create_session

    logging.basicConfig(level=logging.WARNING)
    spark = get_or_create_session(name, conf={
        "spark.master": "local[2]", "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2", "spark.sql.session.timeZone": "UTC"})
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def child_ckpt(args: argparse.Namespace, spark: Any) -> dict:
    from spark_ckpt import Settings, StreamingContext

    work = Path(args.work)
    ctx = StreamingContext(spark, 0.1, str(work / "ckpt"), f"nexmark-{args.query}",
                           settings=Settings(progress="never", checkpoint_interval_ms=10_000,
                                             state_parallelism=2))
    if args.kafka:
        events = nexmark_queries.kafka_input(ctx, args.kafka, args.topic,
                                             max_offsets_per_batch=args.offsets_per_batch)
    else:
        events = nexmark_queries.file_input(ctx, args.events, args.files_per_batch)
    query = nexmark_queries.QUERIES[args.query][0](events)
    if upsert_keys(args.query):
        query.foreach_batch(_batch_writer(str(work / "out")), name=args.query)
    else:
        query.write_parquet(str(work / "out"), name=args.query)
    t0 = time.perf_counter()
    progress = ctx.process_available(timeout=7200)
    seconds = time.perf_counter() - t0
    proctime = {"file_times": nexmark_queries.batch_files(ctx, progress),
                "close_ms": max(p["batch_time_ms"] for p in progress)} \
        if args.query == "q12" else {}
    return {**proctime, "seconds": seconds,
            "rows": sum(p["num_input_rows"] or 0 for p in progress),
            "batches": sum(1 for p in progress if p["num_input_rows"]),
            "batch_ms": [p["durations_ms"]["total"] for p in progress],
            "durations_ms": [p["durations_ms"] for p in progress],
            "checkpoints": [{k: c.get(k) for k in ("checkpoint_id", "status", "duration_ms")}
                            for c in ctx.recent_checkpoints]}


def child_ss(args: argparse.Namespace, spark: Any) -> dict:
    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                   "true")
    work = Path(args.work)
    events = (spark.readStream.schema(nexmark_gen.SPARK_SCHEMA)
              .option("maxFilesPerTrigger", args.files_per_batch).parquet(args.events))
    if args.query != "q12":  # (q12 watermarks its processing time: SS takes one watermark)
        events = events.withWatermark("dateTime", nexmark_queries.WATERMARK_DELAY)
    try:
        result = ss_query(args.query, events)
        writer = result.writeStream.option("checkpointLocation", str(work / "ckpt")) \
            .trigger(availableNow=True)
        if upsert_keys(args.query):
            writer = writer.outputMode("update").foreachBatch(_batch_writer(str(work / "out")))
        else:
            writer = writer.format("parquet").option("path", str(work / "out")) \
                .outputMode("append")
        t0 = time.perf_counter()
        query = writer.start()
    except Exception as exc:  # noqa: BLE001 - a query SS refuses is reported, not a failure
        return {"refused": f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"}
    query.awaitTermination()
    seconds = time.perf_counter() - t0
    progress = query.recentProgress
    proctime = {}
    if args.query == "q12":
        file_times = ss_batch_files(work / "ckpt")
        proctime = {"file_times": file_times, "close_ms": max(file_times.values())}
    return {**proctime, "seconds": seconds, "rows": sum(p["numInputRows"] for p in progress),
            "batches": sum(1 for p in progress if p["numInputRows"]),
            "batch_ms": [p["durationMs"].get("triggerExecution") for p in progress]}


def child_batch(args: argparse.Namespace, spark: Any) -> dict:
    """The floor under both Spark arms: the query's batch Spark SQL over every event at once
    (one job, no state kept, no batches), its rows written to Parquet."""
    t0 = time.perf_counter()
    events = spark.read.schema(nexmark_gen.SPARK_SCHEMA).parquet(args.events)
    reference = nexmark_queries.QUERIES[args.query][1]
    reference(spark, events).write.parquet(str(Path(args.work) / "out"))
    return {"seconds": time.perf_counter() - t0, "rows": None}


def child(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    spark = session(f"nexmark-{args.child}-{args.query}")
    started = time.perf_counter() - t0
    result = child_ss(args, spark) if args.child == "ss" else child_batch(args, spark) \
        if args.child == "batch" else child_ckpt(args, spark)
    result["session_start_s"] = started
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent -----------------------------------------------------------------------------
def prepare(work: Path, events: int, files: int) -> tuple[Path, Path]:
    """The events (kept between runs of the same size) and their copy for Flink: INT96
    timestamps, which Flink's Parquet format reads as TIMESTAMP(3), in one file of one row
    group. Flink's file source hands its splits to the readers in no order (a hash set), so
    over the 100 files a 4-second watermark passed files not yet read and Flink dropped their
    rows as late (q11: 64,460 of 73,626 sessions missing); one row group is one split that
    carries rows, read in event order (the other splits of the file hold no row group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = work / f"events-{events}-{files}"
    flink = work / f"events-flink-{events}"
    if not (out / "_DONE").exists():
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        nexmark_gen.write(out, events, files, events_per_second=RATE)
        (out / "_DONE").write_text("")
        print(f"generated {events} events in {time.perf_counter() - t0:.1f} s", flush=True)
    if not (flink / "_DONE").exists():
        shutil.rmtree(flink, ignore_errors=True)
        flink.mkdir(parents=True)
        table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("*.parquet")))
        pq.write_table(table, flink / "events.parquet", row_group_size=table.num_rows,
                       use_deprecated_int96_timestamps=True)
        del table
        (flink / "_DONE").write_text("")
    return out, flink


def reference_session(name: str) -> Any:
    """The parent's session: batch Spark SQL over every event, and the arms' outputs read."""
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName(name)
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
             .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "4g")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def flink_jar(version: str) -> str:
    path = CACHE / f"flink-sql-parquet-{version}.jar"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(FLINK_PARQUET.format(v=version), path)
    return f"file://{path}"


def run(args: argparse.Namespace, system: str, query: str, work: Path, events: Path,
        flink_events: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if system == "flink":
        version = subprocess.run(
            [args.pyflink, "-c", "import importlib.metadata as m; "
             "print(m.version('apache-flink'))"], capture_output=True, text=True,
            check=True).stdout.strip()
        # Flink's Parquet format reads through Hadoop's classes: the Hadoop client jars that
        # pip's PySpark ships
        import pyspark

        hadoop = sorted(f"file://{p}" for p in (Path(pyspark.__file__).parent / "jars")
                        .glob("hadoop-client-*.jar"))
        cmd = [args.pyflink, str(ROOT / "scripts" / "bench_nexmark_flink.py"), "--query",
               query, "--events", str(flink_events), "--jars",
               ";".join([flink_jar(version), *hadoop]), "--work", str(work)]
        env = dict(os.environ, TZ="UTC")
    else:
        cmd = [sys.executable, __file__, "--child", system, "--query", query, "--work",
               str(work), "--events", str(events), "--files-per-batch",
               str(args.files_per_batch)]
        if args.source == "kafka":
            cmd += ["--kafka", args.kafka, "--topic", args.topic, "--offsets-per-batch",
                    str(args.events // args.files * args.files_per_batch)]
        env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
                   PYSPARK_DRIVER_PYTHON=sys.executable,
                   PYSPARK_SUBMIT_ARGS=f"--driver-memory {args.driver_memory} pyspark-shell",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.arm_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its JVM and its workers
        proc.communicate()
        return {"failed": f"not done in {args.arm_timeout:.0f} s",
                "process_seconds": args.arm_timeout}
    wall = time.perf_counter() - t0
    (work.parent / f"{work.name}.log").write_text(stdout[-50_000:] + stderr[-200_000:])
    line = next((li for li in stdout.splitlines() if li.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"failed": f"exit {proc.returncode}: {stderr[-1500:]}",
                "process_seconds": wall}
    result = {**json.loads(line[7:]), "process_seconds": wall}
    if "seconds" in result:
        result["throughput"] = args.events / result["seconds"]
        if result.get("rows") not in ((args.events,) if system == "ckpt" else (
                args.events, 2 * args.events)) and system not in ("flink", "batch"):
            # (2 ×: Structured Streaming counts a source read by two branches twice)
            result["check_rows"] = f"read {result.get('rows')} of {args.events} events"
    return result


def flink_changelog(files: list[Path], expected: Any) -> Any:
    """Flink's update stream (debezium-json: a new row as ``after``, a retracted one as
    ``before``) applied: the rows left, typed as the reference's."""
    from collections import Counter

    import pandas as pd

    columns = list(expected.columns)
    final: Counter = Counter()
    for path in files:
        for line in path.read_text().splitlines():
            change = json.loads(line)
            if change.get("before") is not None:
                final[tuple(change["before"][c] for c in columns)] -= 1
            if change.get("after") is not None:
                final[tuple(change["after"][c] for c in columns)] += 1
    if any(n < 0 for n in final.values()):
        raise ValueError("Flink's changelog retracts a row it never inserted")
    frame = pd.DataFrame([k for k, n in final.items() for _ in range(n)], columns=columns)
    for column in frame.columns:
        if pd.api.types.is_datetime64_any_dtype(expected[column]):
            frame[column] = pd.to_datetime(frame[column], utc=True, format="mixed")
        elif pd.api.types.is_numeric_dtype(expected[column]):
            frame[column] = pd.to_numeric(frame[column])
    return frame


def read_output(spark: Any, system: str, query: str, work: Path, expected: Any) -> Any:
    import pandas as pd

    out = work / "out"
    # Flink's part files have no suffix; hidden ones (in progress) are not its output
    files = sorted(p for p in out.rglob("*") if p.is_file() and not any(
        part.startswith((".", "_")) for part in p.relative_to(out).parts)) \
        if out.exists() else []
    if not files:
        return pd.DataFrame(columns=list(expected.columns))
    if system == "flink" and not bench_nexmark_flink.QUERIES[query][2]:
        return flink_changelog(files, expected)
    frame = spark.read.parquet(str(out)).toPandas()
    if "__batch" in frame.columns:  # the Spark arms' update stream: a key's last row
        keys = upsert_keys(query)
        if frame.duplicated(["__batch", *keys]).any():
            raise ValueError("two rows of one key in one batch of an update stream")
        frame = frame.sort_values("__batch", kind="stable") \
            .groupby(keys, as_index=False).tail(1).drop(columns="__batch")
    return frame


def check(spark: Any, system: str, query: str, work: Path, expected: Any, mode: str,
          final_watermark_ms: int) -> dict:
    """The arm's rows against the reference's. Only Flink's are cut to the windows the
    final watermark closes (it closes every window at the end of its input); spark_ckpt's and
    Structured Streaming's must not hold a window the watermark did not close."""
    import pandas as pd

    if len(expected) == 0:
        raise SystemExit("the reference has no rows: too few events for this query's windows")
    try:
        got = read_output(spark, system, query, work, expected)
        if system in ("flink", "batch"):  # every window, closed by the end of the input
            got = nexmark_queries.closed(got, mode, final_watermark_ms, nexmark_gen.BASE_MS)
        got = got[[c for c in expected.columns]]
    except Exception as exc:  # noqa: BLE001 - an unreadable output is a failed check
        return {"equal": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if query in TIES:  # rows that tie on the order: which one a system keeps is its own
        got, expected = got[TIES[query]], expected[TIES[query]]
    # (3 decimals: Flink's q1 multiplies a DECIMAL, Spark a DOUBLE)
    a, b = nexmark_queries.normal(got, 3), nexmark_queries.normal(expected, 3)
    try:
        pd.testing.assert_frame_equal(a, b, check_dtype=False)
        return {"equal": True, "rows": len(a)}
    except AssertionError:
        merged = a.merge(b, how="outer", indicator=True)
        return {"equal": False, "rows": len(a), "expected_rows": len(b),
                "missing": int((merged["_merge"] == "right_only").sum()),
                "extra": int((merged["_merge"] == "left_only").sum())}


def check_proctime(spark: Any, system: str, work: Path, everything: Any, result: dict) -> dict:
    """q12: spark_ckpt's and Structured Streaming's rows against batch Spark over the times
    their batches recorded (each file's bids at its batch's time). Flink stamps each record
    with the wall clock as it arrives, which no run records: its rows are checked only for
    what any processing-time windowing holds (each bidder's windows once, no more bids than
    the bidder made, some windows closed)."""
    if system != "flink":
        expected = nexmark_queries.q12_reference(
            spark, everything, result.pop("file_times"), result["close_ms"]).toPandas()
        return check(spark, system, "q12", work, expected, "append", 0)
    from pyspark.sql import functions as F

    bids = everything.where("event_type = 2").groupBy(F.col("bid.bidder").alias("bidder")) \
        .count().toPandas().set_index("bidder")["count"]
    got = read_output(spark, system, "q12", work,
                      nexmark_queries.q12_reference(spark, everything, {}, 0).toPandas())
    totals = got.groupby("bidder")["bid_count"].sum()
    weak = {"windows": len(got), "bids_in_windows": int(got["bid_count"].sum()),
            "duplicates": int(got.duplicated(["bidder", "starttime"]).sum()),
            "over": int((totals > bids.reindex(totals.index).fillna(0)).sum())}
    weak["equal"] = weak["windows"] > 0 and not weak["duplicates"] and not weak["over"]
    weak["weak"] = "processing times not recorded: consistency only"
    return weak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default="10000000",
                        help="how many events (a child: the directory of the events)")
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--files-per-batch", type=int, default=10)
    parser.add_argument("--queries", default=",".join(nexmark_queries.QUERIES))
    parser.add_argument("--arms", default="ckpt,ss,flink")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--pyflink", default="/opt/flinkenv/bin/python")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--arm-timeout", type=float, default=1500,
                        help="seconds an arm may take before it is killed and reported")
    parser.add_argument("--work", type=Path, default=Path("/tmp/spark-ckpt-bench-nexmark"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--source", choices=["files", "kafka"], default="files",
                        help="what the ckpt arm reads (kafka: the ckpt arm alone)")
    parser.add_argument("--kafka", metavar="BOOTSTRAP", help="with --source kafka")
    parser.add_argument("--topic",
                        help="with --source kafka (default nexmark-<events>-s42-r<rate>)")
    parser.add_argument("--partitions", type=int, default=8, help="a new topic's")
    parser.add_argument("--child", choices=["ckpt", "ss", "batch"])
    parser.add_argument("--query")
    parser.add_argument("--offsets-per-batch", type=int)
    args, _ = parser.parse_known_args()
    if args.child:
        args.work = str(args.work)
        child(args)
        return
    args.events = int(args.events)
    if args.source == "kafka":
        if args.kafka is None or args.arms != "ckpt" or "q12" in args.queries.split(","):
            parser.error("--source kafka: expected --kafka BOOTSTRAP and --arms ckpt, and "
                         "not q12 (its reference needs the files each batch read)")
        # the generator's seed and rate in the name: a topic of other events is never reused
        args.topic = args.topic or f"nexmark-{args.events}-s42-r{RATE}"
        if nexmark_gen.held(args.kafka, args.topic) != (args.partitions, args.events):
            t0 = time.perf_counter()
            nexmark_gen.produce(args.kafka, args.topic, args.events, args.partitions,
                                events_per_second=RATE, progress=print)
            print(f"produced {args.events} events in {time.perf_counter() - t0:.1f} s",
                  flush=True)

    events, flink_events = prepare(args.work, args.events, args.files)

    spark = reference_session("nexmark-reference")
    everything = spark.read.schema(nexmark_gen.SPARK_SCHEMA).parquet(str(events))
    final_watermark = nexmark_gen.BASE_MS + (args.events - 1) * 1000 // RATE - 4_000
    arms = args.arms.split(",")
    results: dict[str, Any] = {
        "command": " ".join(sys.argv), "machine": f"{platform.node()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "events": args.events,
        "files": args.files, "files_per_batch": args.files_per_batch, "reps": args.reps,
        "source": args.source, "queries": {}}
    for number, query in enumerate(args.queries.split(",")):
        _stream, reference, mode = nexmark_queries.QUERIES[query]
        spark.catalog.clearCache()
        expected = None if mode == "proctime" else nexmark_queries.closed(
            reference(spark, everything).toPandas(), mode, final_watermark, nexmark_gen.BASE_MS)
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for rep in range(args.reps):
            # the arms' order alternates between repetitions and between queries
            for arm in (arms if (rep + number) % 2 == 0 else arms[::-1]):
                work = args.work / "runs" / f"{query}-{arm}-{rep}"
                result = run(args, arm, query, work, events, flink_events)
                if "seconds" in result and mode == "proctime":
                    result["check"] = check_proctime(spark, arm, work, everything, result)
                elif "seconds" in result:
                    result["check"] = check(spark, arm, query, work, expected, mode,
                                            final_watermark)
                runs[arm].append(result)
                shutil.rmtree(work, ignore_errors=True)
                print(f"\n{query} {arm} {rep}", json.dumps(
                    {k: v for k, v in result.items()
                     if k not in ("batch_ms", "durations_ms", "checkpoints")}), flush=True)
        summary: dict[str, Any] = {"runs": runs}
        for arm in arms:
            done = [r["throughput"] for r in runs[arm]
                    if "throughput" in r and r.get("check", {}).get("equal")]
            if done:
                summary[f"{arm}_events_per_s"] = statistics.median(done)
        for other in ("ss", "flink", "batch"):
            if "ckpt_events_per_s" in summary and f"{other}_events_per_s" in summary:
                summary[f"ckpt_over_{other}"] = (summary["ckpt_events_per_s"]
                                                 / summary[f"{other}_events_per_s"])
        results["queries"][query] = summary
        print(f"\n{query}", json.dumps({k: v for k, v in summary.items() if k != "runs"}),
              flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1))
    spark.stop()


if __name__ == "__main__":
    main()
