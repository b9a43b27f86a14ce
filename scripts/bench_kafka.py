"""Kafka in, keyed count/sum, Delta merge out; and Kafka to Kafka exactly once (issue 34).

    python scripts/bench_kafka.py --records 10000000 --reps 2 \\
        --pyflink /opt/flinkenv/bin/python --json benchmarks/results/F.json

One KRaft broker on loopback (Kafka's own jars, tests/kafka_cluster.py), a topic of 8
partitions, ``--records`` JSON records of about 200 bytes over ``--keys`` keys (every key the
same number of records; a key's records in one partition, as a keyed producer puts them).
Then, each arm its own driver process reading the whole topic from its start in batches of
``--per-batch`` offsets, alternating the order between repetitions:

``ss``        Structured Streaming as a careful user writes it: Spark's Kafka source
              (spark-sql-kafka 4.2.0 from Maven Central: none is published for 4.3.0),
              ``from_json``, ``groupBy(key).agg(count, sum)``, RocksDB state with changelog
              checkpoints, update mode, ``foreachBatch`` merging the batch into Delta with
              delta-rs (the batch id as the table's app transaction), ``availableNow``;
``ckpt``      spark_ckpt: ``ctx.kafka_stream`` read through the same connector (on the
              classpath, as on Databricks), ``from_json``, ``key_by(key).agg(count, sum)``,
              ``write_delta(merge_keys=[key])`` (two-phase, a checkpoint every 10 s),
              ``process_available``;
``ckpt_py``   the same, the connector absent: the Python reader (confluent-kafka in tasks);
``ckpt_json`` the Python reader with the value's format declared (``value_format="json"``,
              ``value_schema``, as Flink SQL's Kafka table declares ``'value.format' =
              'json'``): the tasks parse the values with Arrow where that is Spark's answer
              (sources/kafka_values.py), no ``from_json`` in the pipeline;
``flink``     PyFlink SQL (``--pyflink PYTHON``, a virtualenv with apache-flink): Flink's Kafka
              connector (flink-sql-connector-kafka 5.0.0-2.2), its JSON format, ``GROUP BY``,
              RocksDB, incremental checkpoints every 10 s, parallelism 2, bounded at the latest
              offsets (scripts/bench_pyflink.py);
``floor``     what any Spark engine does for this pipeline and nothing more: each batch's
              offsets read through Spark's connector, ``from_json``, the count and sum, to
              Spark's ``noop`` sink (no state, no output, no checkpoint): the least time on
              Spark, against which the others' ratios are bounded;
``eo``/``alo`` spark_ckpt Kafka to Kafka: the records' key and value sent on to a topic of 8
              partitions, ``delivery="exactly_once"`` against ``"at_least_once"``.

Throughput is the topic's records over the query's time (from the query's start to its end;
the driver's start is reported beside it). Outputs are checked: the Delta tables and Flink's
printed rows against the expected count and sum of every key; the Kafka outputs by counting
what a ``read_committed`` consumer reads (exactly the records for ``eo``, at least them for
``alo``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # kafka_cluster: the brokers and the connectors' jars
sys.path.insert(0, str(ROOT))

TOPIC = "events"
PAD = [chr(ord("a") + i) * 118 for i in range(26)]
FLINK_KAFKA_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0
</modelVersion><groupId>io.spark-ckpt.bench</groupId><artifactId>flink-kafka</artifactId>
<version>1</version><packaging>pom</packaging><dependencies><dependency>
<groupId>org.apache.flink</groupId><artifactId>flink-sql-connector-kafka</artifactId>
<version>5.0.0-2.2</version></dependency></dependencies></project>"""


def value_of(i: int) -> float:
    return ((i * 37) % 10_000) / 100.0


def _produce(bootstrap: str, start: int, end: int, step: int, keys: int,
             partitions: int) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50,
                         "batch.size": 1_000_000, "queue.buffering.max.messages": 1_000_000,
                         "compression.type": "lz4", "acks": "all"})
    stamp = int(time.time() * 1000)
    for i in range(start, end, step):
        key = i % keys
        value = (f'{{"key":{key},"carrier":"C{key % 17:02d}","value":{value_of(i)},'
                 f'"event_time":{stamp + i // 1000},"note":"{PAD[i % 26]}"}}')
        while True:
            try:
                producer.produce(TOPIC, value.encode(), str(key).encode(),
                                 partition=key % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(300) == 0


def produce(bootstrap: str, records: int, keys: int, partitions: int) -> float:
    t0 = time.perf_counter()
    procs = [multiprocessing.Process(target=_produce, args=(bootstrap, w, records, 2, keys,
                                                             partitions)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return time.perf_counter() - t0


def expected(records: int, keys: int) -> tuple[Any, Any]:
    import numpy as np

    i = np.arange(records, dtype=np.int64)
    values = ((i * 37) % 10_000) / 100.0
    return np.bincount(i % keys, minlength=keys), np.bincount(i % keys, weights=values,
                                                              minlength=keys)


# -- children -----------------------------------------------------------------------------
def session(name: str, jars: str):
    import logging

    from spark_ckpt import get_or_create_session

    logging.basicConfig(level=logging.WARNING)
    conf = {"spark.master": "local[2]", "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "2", "spark.sql.session.timeZone": "UTC"}
    if jars:
        conf["spark.jars"] = jars
    spark = get_or_create_session(name, conf=conf)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


VALUE_SCHEMA = "key BIGINT, carrier STRING, value DOUBLE, event_time BIGINT, note STRING"


def child_ss(args: argparse.Namespace, spark) -> dict:
    from pyspark.sql import functions as F

    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                   "true")
    out = str(Path(args.work) / "out")
    rows = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", args.bootstrap)
            .option("subscribe", TOPIC).option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", args.per_batch).load()
            .select(F.from_json(F.col("value").cast("string"), VALUE_SCHEMA).alias("v"))
            .select("v.key", "v.value"))
    result = rows.groupBy("key").agg(F.count(F.lit(1)).alias("n"), F.sum("value").alias("total"))

    def merge(df, batch_id: int) -> None:
        """The batch's rows to Arrow, a delta-rs merge by key, the batch id as the table's
        app transaction (a replayed batch is not merged twice)."""
        from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

        table_rows = df.toArrow()
        props = CommitProperties(app_transactions=[Transaction(app_id="bench", version=batch_id)])
        if not DeltaTable.is_deltatable(out):
            write_deltalake(out, table_rows, commit_properties=props)
            return
        table = DeltaTable(out)
        done = table.transaction_version("bench")
        if done is not None and done >= batch_id:
            return
        table.merge(table_rows, "t.key = s.key", source_alias="s", target_alias="t",
                    commit_properties=props) \
            .when_matched_update_all().when_not_matched_insert_all().execute()

    writer = (result.writeStream.outputMode("update").foreachBatch(merge)
              .option("checkpointLocation", str(Path(args.work) / "ckpt"))
              .trigger(availableNow=True))
    t0 = time.perf_counter()
    query = writer.start()
    query.awaitTermination()
    seconds = time.perf_counter() - t0
    progress = query.recentProgress
    return {"seconds": seconds, "rows": sum(p["numInputRows"] for p in progress),
            "batches": sum(1 for p in progress if p["numInputRows"])}


def child_ckpt(args: argparse.Namespace, spark) -> dict:
    from pyspark.sql import functions as F

    from spark_ckpt import Settings, StreamingContext
    from spark_ckpt.state import count, sum_

    work = Path(args.work)
    settings = Settings(progress="never", checkpoint_interval_ms=10_000, state_parallelism=2)
    ctx = StreamingContext(spark, 0.1, str(work / "ckpt"), "bench-kafka", settings=settings)
    declared = {"value_format": "json", "value_schema": VALUE_SCHEMA} \
        if args.system == "ckpt_json" else {}
    records = ctx.kafka_stream("events", args.bootstrap, topics=[TOPIC],
                               starting_offsets="earliest", max_offsets_per_batch=args.per_batch,
                               reader="python" if args.system in ("ckpt_py", "ckpt_json")
                               else "spark", **declared)
    if args.system == "ckpt_json":
        records.select("key", "value").key_by("key").agg(
            name="totals", n=count(), total=sum_("value")) \
            .write_delta(str(work / "out"), name="totals", merge_keys=["key"])
    elif args.system in ("eo", "alo"):
        records.select("key", "value").write_kafka(
            args.bootstrap, topic=args.out_topic, name="out",
            delivery="exactly_once" if args.system == "eo" else "at_least_once")
    else:
        parsed = records.select(F.from_json(F.col("value").cast("string"), VALUE_SCHEMA)
                                .alias("v")).select("v.key", "v.value")
        parsed.key_by("key").agg(name="totals", n=count(), total=sum_("value")) \
            .write_delta(str(work / "out"), name="totals", merge_keys=["key"])
    t0 = time.perf_counter()
    progress = ctx.process_available(timeout=7200)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": sum(p["num_input_rows"] or 0 for p in progress),
            "batches": sum(1 for p in progress if p["num_input_rows"]),
            "batch_ms": [p["durations_ms"]["total"] for p in progress],
            "durations_ms": [p["durations_ms"] for p in progress],
            "checkpoints": [{k: c.get(k) for k in ("checkpoint_id", "status", "duration_ms")}
                            for c in ctx.recent_checkpoints]}


def child_steady(args: argparse.Namespace, spark) -> dict:
    """The keyed count/sum (and each key's newest produce time, for the latency) over a topic
    being produced at a steady rate, merged into Delta, running until the parent stops it
    (SIGTERM): Structured Streaming's default trigger (a batch as soon as the last ends),
    spark_ckpt with a batch every 0.1 s and a checkpoint every ``--checkpoint-ms`` (its
    Delta output is visible when a checkpoint completes)."""
    import signal
    import threading

    from pyspark.sql import functions as F

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    out = str(Path(args.work) / "out")
    if args.system == "ss_steady":
        spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                       "org.apache.spark.sql.execution.streaming.state."
                       "RocksDBStateStoreProvider")
        spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                       "true")
        rows = (spark.readStream.format("kafka")
                .option("kafka.bootstrap.servers", args.bootstrap)
                .option("subscribe", args.out_topic).option("startingOffsets", "earliest")
                .load()
                .select(F.from_json(F.col("value").cast("string"), VALUE_SCHEMA).alias("v"))
                .select("v.key", "v.value", "v.event_time"))
        result = rows.groupBy("key").agg(F.count(F.lit(1)).alias("n"),
                                         F.sum("value").alias("total"),
                                         F.max("event_time").alias("last_ms"))

        def merge(df, batch_id: int) -> None:
            from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

            table_rows = df.toArrow()
            props = CommitProperties(app_transactions=[Transaction(app_id="bench",
                                                                   version=batch_id)])
            if not DeltaTable.is_deltatable(out):
                write_deltalake(out, table_rows, commit_properties=props)
                return
            DeltaTable(out).merge(table_rows, "t.key = s.key", source_alias="s",
                                  target_alias="t", commit_properties=props) \
                .when_matched_update_all().when_not_matched_insert_all().execute()

        query = (result.writeStream.outputMode("update").foreachBatch(merge)
                 .option("checkpointLocation", str(Path(args.work) / "ckpt")).start())
        print("RUNNING", flush=True)
        while not stop.is_set() and query.isActive:
            stop.wait(0.5)
        query.stop()
        return {"seconds": 0.0, "rows": 0, "batches": len(query.recentProgress)}
    from spark_ckpt import Settings, StreamingContext
    from spark_ckpt.state import count, max_, sum_

    work = Path(args.work)
    ctx = StreamingContext(spark, 0.1, str(work / "ckpt"), "bench-steady", settings=Settings(
        progress="never", checkpoint_interval_ms=args.checkpoint_ms, state_parallelism=2))
    parsed = ctx.kafka_stream("events", args.bootstrap, topics=[args.out_topic],
                              starting_offsets="earliest", reader="spark") \
        .select(F.from_json(F.col("value").cast("string"), VALUE_SCHEMA).alias("v")) \
        .select("v.key", "v.value", "v.event_time")
    parsed.key_by("key").agg(name="totals", n=count(), total=sum_("value"),
                             last_ms=max_("event_time")) \
        .write_delta(out, name="totals", merge_keys=["key"])
    ctx.start()
    print("RUNNING", flush=True)
    stop.wait()
    ctx.stop()
    return {"seconds": 0.0, "rows": 0, "batches": len(ctx.recent_progress),
            "where_the_time_goes": _steady_phases(ctx)}


def _steady_phases(ctx) -> dict:
    """Where a steady spark_ckpt run's time went: its batches' phases (median and p90 over
    the batches that read records) and its checkpoints' durations, in ms."""
    def summary(values: list[float]) -> dict:
        values = sorted(values)
        return {"median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))],
                "n": len(values)} if values else {}

    batches = [p for p in ctx.recent_progress if p["num_input_rows"]]
    phases = {k for p in batches for k in p["durations_ms"]}
    out = {f"batch_{k}": summary([p["durations_ms"].get(k, 0) for p in batches])
           for k in sorted(phases)}
    out["batch_rows"] = summary([p["num_input_rows"] for p in batches])
    out["checkpoint"] = summary([c["duration_ms"] for c in ctx.recent_checkpoints
                                 if c.get("duration_ms") is not None])
    return out


def child_floor(args: argparse.Namespace, spark) -> dict:
    """What every Spark engine does for this pipeline, and nothing else: each batch's
    offsets read through Spark's Kafka connector, ``from_json``, the keyed count and sum,
    written nowhere (Spark's ``noop`` sink); no state, no sink, no checkpoint."""
    from pyspark.sql import functions as F

    ends = {p: args.records // args.partitions for p in range(args.partitions)}
    step = args.per_batch // args.partitions
    t0 = time.perf_counter()
    batches = 0
    for start in range(0, max(ends.values()), step):
        starting = {TOPIC: {str(p): start for p in ends}}
        ending = {TOPIC: {str(p): min(start + step, e) for p, e in ends.items()}}
        (spark.read.format("kafka").option("kafka.bootstrap.servers", args.bootstrap)
         .option("subscribe", TOPIC).option("startingOffsets", json.dumps(starting))
         .option("endingOffsets", json.dumps(ending)).load()
         .select(F.from_json(F.col("value").cast("string"), VALUE_SCHEMA).alias("v"))
         .groupBy("v.key").agg(F.count(F.lit(1)).alias("n"), F.sum("v.value").alias("total"))
         .write.format("noop").mode("overwrite").save())
        batches += 1
    return {"seconds": time.perf_counter() - t0, "rows": args.records, "batches": batches}


def child(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    jars = "" if args.system in ("ckpt_py", "ckpt_json") else args.jars
    spark = session(f"bench-kafka-{args.system}", jars)
    started = time.perf_counter() - t0
    if args.system.endswith("_steady"):
        result = child_steady(args, spark)
    elif args.system == "floor":
        result = child_floor(args, spark)
    elif args.system == "ss":
        result = child_ss(args, spark)
    else:
        result = child_ckpt(args, spark)
    result["session_start_s"] = started
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent ---------------------------------------------------------------------------
def check_delta(path: str, n_expected: Any, total_expected: Any) -> dict:
    import numpy as np

    from spark_ckpt.storage.delta_reader import read_delta

    table = read_delta(path).to_pandas().sort_values("key")
    ok = (len(table) == len(n_expected)
          and np.array_equal(table.key.to_numpy(), np.arange(len(n_expected)))
          and np.array_equal(table.n.to_numpy(), n_expected)
          and np.allclose(table.total.to_numpy(), total_expected, rtol=1e-9, atol=1e-6))
    return {"rows": len(table), "equal": bool(ok)}


def check_flink(stdout: str, n_expected: Any, total_expected: Any) -> dict:
    import numpy as np

    got: dict[int, tuple[int, float]] = {}
    for line in stdout.splitlines():
        if line.startswith("OUT") and "[" in line:  # "OUT:<subtask>> +U[k, n, total]"
            key, n, total = line.split("[", 1)[1].rstrip("]").split(",")
            got[int(key)] = (int(n), float(total))
    keys = sorted(got)
    ok = (keys == list(range(len(n_expected)))
          and np.array_equal([got[k][0] for k in keys], n_expected)
          and np.allclose([got[k][1] for k in keys], total_expected, rtol=1e-9, atol=1e-6))
    return {"rows": len(got), "equal": bool(ok)}


def count_committed(bootstrap: str, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-check",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    total = 0
    meta = consumer.list_topics(topic, timeout=10).topics[topic]
    for partition in meta.partitions:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        consumer.assign([TopicPartition(topic, partition, low)])
        while consumer.position([TopicPartition(topic, partition)])[0].offset < high:
            msgs = consumer.consume(10_000, timeout=1.0)
            total += sum(1 for m in msgs if m.error() is None)
            if not msgs:  # the rest of the log is transaction markers
                break
    consumer.close()
    return total


def run(args: argparse.Namespace, system: str, work: Path, cluster, jars: str,
        flink_jar: str) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYSPARK_SUBMIT_ARGS="--driver-memory 4g pyspark-shell",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out_topic = ""
    if system == "flink":
        cmd = [args.pyflink, str(ROOT / "scripts" / "bench_pyflink.py"), "--kafka",
               cluster.bootstrap, "--topic", TOPIC, "--jars", f"file://{flink_jar}",
               "--work", str(work), "--rows-per-key", str(args.records // args.keys),
               "--rows", str(args.records), "--agg"]
        env = dict(os.environ)
    else:
        if system in ("eo", "alo"):
            out_topic = f"out-{system}-{int(time.time() * 1000)}"
            cluster.create_topic(out_topic, args.partitions)
        cmd = [sys.executable, __file__, "--child", system, "--work", str(work), "--bootstrap",
               cluster.bootstrap, "--per-batch", str(args.per_batch), "--jars", jars,
               "--out-topic", out_topic, "--records", str(args.records), "--partitions",
               str(args.partitions)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    (work.parent / f"{work.name}.log").write_text(proc.stderr[-200_000:])
    line = next((li for li in proc.stdout.splitlines() if li.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{system} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-6000:]}")
    result = {**json.loads(line[7:]), "process_seconds": wall}
    n_exp, total_exp = args.expected
    if system == "floor":
        result["check"] = {"equal": True, "note": "writes nothing (noop)"}
    elif system == "flink":
        result["check"] = check_flink(proc.stdout, n_exp, total_exp)
    elif system in ("eo", "alo"):
        got = count_committed(cluster.bootstrap, out_topic)
        result["check"] = {"records": got, "equal": got == args.records if system == "eo"
                           else got >= args.records}
    else:
        result["check"] = check_delta(str(work / "out"), n_exp, total_exp)
    result["throughput"] = args.records / result["seconds"]
    if not result["check"]["equal"]:
        raise SystemExit(f"{system}: wrong output {result['check']}")
    return result


def _produce_steady(bootstrap: str, topic: str, rate: int, seconds: float, keys: int,
                    partitions: int) -> None:
    """``rate`` records a second for ``seconds``, in slices of 10 ms; each record's
    event_time is when it was produced (ms)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all"})
    per_tick = rate // 100
    start = time.time()
    i = 0
    for tick in range(int(seconds * 100)):
        due = start + tick / 100
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)  # pacing the producer to its rate, not a wait for a result
        now = int(time.time() * 1000)
        for _ in range(per_tick):
            key = i % keys
            value = (f'{{"key":{key},"carrier":"C{key % 17:02d}","value":{value_of(i)},'
                     f'"event_time":{now},"note":"{PAD[i % 26]}"}}')
            producer.produce(topic, value.encode(), str(key).encode(),
                             partition=key % partitions)
            i += 1
        producer.poll(0)
    assert producer.flush(120) == 0


def _watch(table: str, until: Any, seen: list[tuple[float, int]]) -> None:
    """Each new Delta version of ``table``: when it became visible here and the newest
    produce time it includes (the largest ``last_ms``)."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    version = -1
    while not until():
        try:
            dt = DeltaTable(table)
        except Exception:  # noqa: BLE001 - not created yet
            time.sleep(0.02)  # polling for the table's first version
            continue
        if dt.version() != version:
            visible = time.time()
            version = dt.version()
            newest = pc.max(dt.to_pyarrow_table(columns=["last_ms"])["last_ms"]).as_py()
            if newest is not None:
                seen.append((visible, int(newest)))
        time.sleep(0.02)  # polling for the next version


def latencies(seen: list[tuple[float, int]], warmup_ms: int) -> dict:
    """Each record produced in (newest of version v-1, newest of version v] became visible
    with version v: at a steady rate its produce times are uniform in that span, so its
    latency is visible(v) - produce time, counted per millisecond of the span."""
    import numpy as np

    out: list[Any] = []
    first = seen[0][1] + warmup_ms if seen else 0
    for (_vis0, newest0), (vis, newest) in zip(seen, seen[1:], strict=False):
        if newest <= newest0 or newest0 < first:
            continue
        produced = np.arange(newest0 + 1, newest + 1, dtype=np.int64)
        out.append(vis * 1000 - produced)
    if not out:
        return {}
    ms = np.concatenate(out)
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max()), "versions": len(seen), "measured_ms": int(len(ms))}


def run_steady(args: argparse.Namespace, system: str, work: Path, cluster, jars: str) -> dict:
    import threading

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    topic = f"steady-{system}-{int(time.time() * 1000)}"
    cluster.create_topic(topic, args.partitions)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYSPARK_SUBMIT_ARGS="--driver-memory 4g pyspark-shell",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--child", system, "--work", str(work), "--bootstrap",
           cluster.bootstrap, "--jars", jars, "--out-topic", topic, "--checkpoint-ms",
           str(args.checkpoint_ms)]
    log = open(work.parent / f"{work.name}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                            cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:  # the query is running (its session started)
        if line.startswith("RUNNING"):
            break
    else:
        raise SystemExit(f"{system} did not start (see {log.name})")
    done = threading.Event()
    seen: list[tuple[float, int]] = []
    watcher = threading.Thread(target=_watch, args=(str(work / "out"), done.is_set, seen))
    watcher.start()
    producer = multiprocessing.Process(target=_produce_steady, args=(
        cluster.bootstrap, topic, args.steady, args.steady_seconds, args.keys, args.partitions))
    started = time.time()
    producer.start()
    producer.join()
    last_produced = int(time.time() * 1000) - 50
    deadline = time.time() + 120
    while time.time() < deadline and not (seen and seen[-1][1] >= last_produced):
        time.sleep(0.2)  # until the last records are visible (at most 2 minutes)
    done.set()
    watcher.join()
    proc.terminate()
    try:
        tail, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        tail = ""
    log.close()
    result = latencies(seen, args.steady_warmup * 1000)
    for line in tail.splitlines():
        if line.startswith("RESULT "):
            result["child"] = json.loads(line[len("RESULT "):])
    result.update({"rate": args.steady, "seconds": args.steady_seconds,
                   "drained": bool(seen and seen[-1][1] >= last_produced),
                   "first_visible_s": (seen[0][0] - started) if seen else None})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child")
    parser.add_argument("--work")
    parser.add_argument("--bootstrap")
    parser.add_argument("--jars", default="")
    parser.add_argument("--out-topic", default="")
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--per-batch", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--systems", default="ss,ckpt,ckpt_py,flink,eo,alo")
    parser.add_argument("--pyflink", help="a Python with apache-flink (its own virtualenv)")
    parser.add_argument("--base", default="/tmp/spark-ckpt-bench-kafka")
    parser.add_argument("--broker-heap", default="2g")
    parser.add_argument("--json")
    parser.add_argument("--steady", type=int, default=0,
                        help="instead: records/s produced while the pipelines run "
                        "(ss_steady, ckpt_steady); end-to-end latency to Delta")
    parser.add_argument("--steady-seconds", type=float, default=120.0)
    parser.add_argument("--checkpoint-ms", type=int, default=1000,
                        help="spark_ckpt's checkpoint interval in the steady run (its Delta "
                        "output is visible when a checkpoint completes)")
    parser.add_argument("--steady-warmup", type=float, default=30.0,
                        help="seconds of the start left out of the latencies")
    args = parser.parse_args()
    if args.child:
        args.system = args.child
        child(args)
        return

    os.environ["SPARK_CKPT_KAFKA_HEAP"] = args.broker_heap  # read as kafka_cluster loads
    from kafka_cluster import _fetched, connector_jars, start_cluster

    systems = [s for s in args.systems.split(",") if s and (s != "flink" or args.pyflink)]
    base = Path(args.base)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    jars = ",".join(connector_jars())
    flink_jar = ""
    if "flink" in systems:
        pom = base / "flink-kafka-pom.xml"
        pom.write_text(FLINK_KAFKA_POM)
        flink_jar = str(next((_fetched(pom, "flink-sql-connector-kafka-5.0.0-2.2", "jars")
                              / "jars").glob("flink-sql-connector-kafka-*.jar")))
    cluster = start_cluster(base / "kafka")
    figures: dict[str, Any] = {"records": args.records, "keys": args.keys,
                               "partitions": args.partitions, "per_batch": args.per_batch,
                               "reps": args.reps, "systems": systems,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "command": " ".join(sys.argv)}
    try:
        if args.steady:
            figures["steady"] = {s: [] for s in systems}
            for rep in range(args.reps):
                for system in (systems if rep % 2 == 0 else systems[::-1]):
                    r = run_steady(args, system, base / f"{system}-{rep}", cluster, jars)
                    figures["steady"][system].append(r)
                    print(f"rep {rep + 1} {system}: {r}", flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(figures, indent=1))
            return
        cluster.create_topic(TOPIC, args.partitions)
        figures["produce_seconds"] = produce(cluster.bootstrap, args.records, args.keys,
                                             args.partitions)
        print(f"produced {args.records:,} records in {figures['produce_seconds']:.1f} s",
              flush=True)
        args.expected = expected(args.records, args.keys)
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for rep in range(args.reps):
            order = systems if rep % 2 == 0 else systems[::-1]
            for system in order:
                r = run(args, system, base / f"{system}-{rep}", cluster, jars, flink_jar)
                runs[system].append(r)
                print(f"rep {rep + 1} {system}: {r['seconds']:.1f} s "
                      f"({r['throughput']:,.0f} records/s; process {r['process_seconds']:.1f} s)"
                      f" {r['check']}", flush=True)
                figures["runs"] = runs
                if args.json:
                    Path(args.json).write_text(json.dumps(figures, indent=1))
        med = {s: statistics.median(r["throughput"] for r in rs) for s, rs in runs.items()}
        figures["median_throughput"] = med
        ratios = {}
        for a, b in (("ckpt", "ss"), ("ckpt_py", "ss"), ("ckpt_json", "ss"), ("ckpt", "flink"),
                     ("ckpt_py", "flink"), ("ckpt_json", "flink"),
                     ("eo", "alo"), ("floor", "ss"), ("floor", "ckpt")):
            if a in med and b in med:
                ratios[f"{a}/{b}"] = med[a] / med[b]
        figures["ratios"] = ratios
        print(json.dumps({"median_throughput": med, "ratios": ratios}, indent=1), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
