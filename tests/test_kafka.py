"""The Kafka source against real brokers (Kafka's own jars, KRaft, on loopback): each batch's
offset ranges recorded before it runs, Spark's Kafka schema, partitions and topics found
between batches, offsets gone (an error naming them, or skipped and counted), clear errors for
a wrong address or topic, secrets kept out of the records, and every record counted once
across SIGKILLed drivers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers import LONG_FAULTS, ROOT, child_env, kill_group
from kafka_cluster import free_port, kafka_cluster

from spark_ckpt import StreamingContext
from spark_ckpt.errors import PipelineFailedError
from spark_ckpt.kafka_client import committed
from spark_ckpt.options import Settings
from spark_ckpt.storage.delta_reader import read_delta

SETTINGS = Settings(checkpoint_interval_ms=0, state_parallelism=2, progress="never")


@pytest.fixture(scope="module")
def kafka(tmp_path_factory):
    with kafka_cluster(tmp_path_factory.mktemp("kafka")) as cluster:
        yield cluster


def produce(cluster, topic: str, records: list[dict]) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all",
                         "enable.idempotence": True, "linger.ms": 5})
    failed: list = []
    for r in records:
        producer.produce(topic, key=r.get("key"), value=r.get("value"),
                         partition=r.get("partition", -1), headers=r.get("headers"),
                         timestamp=r.get("timestamp", 0),
                         on_delivery=lambda err, _m: failed.append(err) if err else None)
    assert producer.flush(60) == 0 and not failed, failed[:3]


def consume_all(cluster, topic: str) -> pd.DataFrame:
    """Every record of ``topic``, read with a plain consumer (the expected rows)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": "expected",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    meta = consumer.list_topics(topic, timeout=10).topics[topic]
    rows = []
    for partition in sorted(meta.partitions):
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        consumer.assign([TopicPartition(topic, partition, low)])
        while True:
            at = consumer.position([TopicPartition(topic, partition)])[0].offset
            if at >= high:
                break
            for m in consumer.consume(500, timeout=1.0):
                assert m.error() is None, m.error()
                kind, stamp = m.timestamp()
                rows.append({"key": m.key(), "value": m.value(), "topic": topic,
                             "partition": partition, "offset": m.offset(),
                             "timestamp": pd.Timestamp(stamp, unit="ms", tz="UTC"),
                             "timestampType": {1: 0, 2: 1}.get(kind, -1),
                             "headers": [(k, v) for k, v in (m.headers() or [])]})
    consumer.close()
    return pd.DataFrame(rows)


def records(n: int, partitions: int, start: int = 0) -> list[dict]:
    # recent create times: records older than the broker's retention (7 days) are deleted
    base = int(time.time() * 1000) - 60_000
    return [{"key": f"k{i % 7}".encode(), "value": json.dumps({"amount": i}).encode(),
             "partition": i % partitions, "headers": [("h", f"x{i}".encode()), ("e", None)],
             "timestamp": base + i} for i in range(start, start + n)]


def as_rows(df: pd.DataFrame) -> list[tuple]:
    def headers(h):
        return tuple((x["key"], x["value"]) if isinstance(x, dict) else tuple(x)
                     for x in (h if h is not None else []))

    out = [(bytes(r.key) if r.key is not None else None,
            bytes(r.value) if r.value is not None else None, r.topic,
            int(r.partition), int(r.offset), pd.Timestamp(r.timestamp).tz_convert("UTC")
            if pd.Timestamp(r.timestamp).tzinfo else pd.Timestamp(r.timestamp, tz="UTC"),
            int(r.timestampType), headers(r.headers)) for r in df.itertuples()]
    return sorted(out, key=lambda t: (t[2], t[3], t[4]))


def source_pieces(ctx, source: str = "records") -> list[dict]:
    return [ctx.allocation(p["batch_id"]).pieces[source] for p in ctx.recent_progress]


def test_max_offsets_are_shared_by_backlog_without_starving_a_small_partition():
    """max_offsets_per_batch as Spark's maxOffsetsPerTrigger: shared in proportion to each
    partition's backlog, every backlogged partition getting an offset first, never more than
    the limit nor than a partition has."""
    from spark_ckpt.sources.kafka import KafkaSource

    source = KafkaSource("s", "127.0.0.1:9", topics=["t"], max_offsets_per_batch=10)
    a, b = ("t", 0), ("t", 1)
    assert source._limit({a: 0, b: 0}, {a: 1000, b: 1}) == {a: 9, b: 1}
    assert source._limit({a: 5, b: 0}, {a: 8, b: 4}) == {a: 8, b: 4}  # under the limit
    parts = {("t", p): 0 for p in range(4)}
    ends = source._limit(parts, {tp: 250 for tp in parts})
    assert sorted(ends.values()) == [2, 2, 3, 3]
    source.max_offsets = 2  # fewer offsets than backlogged partitions: the largest first
    ends = source._limit(parts, {("t", 0): 5, ("t", 1): 50, ("t", 2): 9, ("t", 3): 0})
    assert ends == {("t", 0): 0, ("t", 1): 1, ("t", 2): 1, ("t", 3): 0}


def test_each_batch_reads_its_recorded_offsets_in_sparks_kafka_schema(spark, kafka, tmp_path):
    """Four partitions, 1,000 records with keys, headers and timestamps, at most 300 offsets a
    batch: the batches' recorded ranges cover every offset once, each partition's in order,
    and the rows read are the records a plain consumer reads, in Spark's Kafka schema."""
    kafka.create_topic("orders", 4)
    produce(kafka, "orders", records(1000, 4))
    out = tmp_path / "out"
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "kafka-read", settings=SETTINGS)
    stream = ctx.kafka_stream("records", kafka.bootstrap, topics=["orders"],
                              starting_offsets="earliest", max_offsets_per_batch=300,
                              reader="python")
    assert [f.name for f in stream.source.schema().fields] == [
        "key", "value", "topic", "partition", "offset", "timestamp", "timestampType",
        "headers"]
    stream.write_parquet(str(out), name="rows")
    progress = ctx.process_available()
    pieces = source_pieces(ctx)
    assert len(progress) >= 4 and all(p["offsets"] <= 300 for p in pieces), pieces
    covered: dict[int, list[tuple[int, int]]] = {}
    for piece in pieces:
        for topic, partition, start, end in piece["ranges"]:
            assert topic == "orders"
            if end > start:
                covered.setdefault(partition, []).append((start, end))
    for partition, spans in covered.items():
        flat = [o for s, e in spans for o in range(s, e)]
        assert flat == list(range(250)), (partition, spans)  # once each, in order
    got = spark.read.parquet(str(out)).toPandas()
    assert as_rows(got) == as_rows(consume_all(kafka, "orders"))
    assert sum(p["num_input_rows"] for p in progress) == 1000



_SPARK_READER = """
import sys
from pyspark.sql import SparkSession
from spark_ckpt import StreamingContext
from spark_ckpt.options import Settings
bootstrap, ckpt, out, jars = sys.argv[1:5]
spark = (SparkSession.builder.master("local[2]").config("spark.jars", jars)
         .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
         .getOrCreate())
ctx = StreamingContext(spark, 0.1, ckpt, "both-spark", settings=Settings(
    checkpoint_interval_ms=0, state_parallelism=2, progress="never"))
stream = ctx.kafka_stream("records", bootstrap, pattern="both-.*", starting_offsets="earliest",
                          max_offsets_per_batch=250, reader="spark")
stream.write_parquet(out, name="rows")
ctx.kafka_stream("parsed", bootstrap, pattern="both-.*", starting_offsets="earliest",
                 max_offsets_per_batch=250, reader="spark", value_format="json",
                 value_schema="amount BIGINT, note STRING",
                 metadata_columns=PARSED_METADATA).write_parquet(out + "-json", name="parsed")
print("ROWS", sum(p["num_input_rows"] for p in ctx.process_available()), flush=True)
"""
# the Kafka columns a parsed stream keeps in the test below, renamed
_PARSED_METADATA = {"at": "offset", "topic": "topic", "partition": "partition", "ts": "timestamp"}


@pytest.mark.skipif(not LONG_FAULTS, reason="a second driver with Spark's connector on its class "
                    "path (75 s); the schema and offsets are checked above; "
                    "SPARK_CKPT_LONG_FAULTS=1")
def test_sparks_connector_and_the_python_reader_give_the_same_rows(spark, kafka, tmp_path):
    """The same offset ranges read through Spark's own Kafka connector (on the driver's
    classpath at its start, as Databricks has it: spark-sql-kafka from Maven Central,
    jvm/spark-kafka/pom.xml) and by the Python tasks give equal rows: keys null and not,
    headers with a null value, create times and a topic stamped at log append (timestampType
    1), batches of 250 offsets over five partitions of two topics. The same records read with
    ``value_format="json"`` (values malformed or of the wrong types among them) give the
    rows of Spark's ``from_json`` over the records, from both readers."""
    from kafka_cluster import connector_jars
    from pyspark.sql import functions as F

    kafka.create_topic("both-create", 3)
    kafka.create_topic("both-append", 2, config={"message.timestamp.type": "LogAppendTime"})
    rows = records(600, 3)
    for i, r in enumerate(rows):
        if i % 5 == 0:
            r["key"] = None
        if i % 11 == 0:
            r["value"] = b'{"amount": "x", "note": 3}'
        elif i % 13 == 0:
            r["value"] = b"not json" if i % 2 else None
        elif i % 3 == 0:
            r["value"] = json.dumps({"amount": i, "note": f"n\u00e9{i}", "x": [1]}).encode()
    produce(kafka, "both-create", rows)
    produce(kafka, "both-append", records(300, 2))
    child = subprocess.run(
        [sys.executable, "-c", _SPARK_READER.replace("PARSED_METADATA", repr(_PARSED_METADATA)),
         kafka.bootstrap, str(tmp_path / "ckpt-spark"),
         str(tmp_path / "out-spark"), ",".join(connector_jars())],
        env=child_env(), capture_output=True, text=True, timeout=600)
    assert child.returncode == 0 and "ROWS 1800" in child.stdout, child.stderr[-3000:]
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt-python"), "both-python",
                           settings=SETTINGS)
    ctx.kafka_stream("records", kafka.bootstrap, pattern="both-.*", starting_offsets="earliest",
                     max_offsets_per_batch=250, reader="python") \
        .write_parquet(str(tmp_path / "out-python"), name="rows")
    ctx.kafka_stream("parsed", kafka.bootstrap, pattern="both-.*", starting_offsets="earliest",
                     max_offsets_per_batch=250, reader="python", value_format="json",
                     value_schema="amount BIGINT, note STRING",
                     metadata_columns=_PARSED_METADATA) \
        .write_parquet(str(tmp_path / "out-python-json"), name="parsed")
    assert sum(p["num_input_rows"] for p in ctx.process_available()) == 1800
    got = {r: spark.read.parquet(str(tmp_path / f"out-{r}")).toPandas()
           for r in ("spark", "python")}
    expected = pd.concat([consume_all(kafka, "both-create"), consume_all(kafka, "both-append")])
    assert as_rows(got["spark"]) == as_rows(got["python"]) == as_rows(expected)
    # the parsed streams: Spark's from_json over the records' values
    raw = spark.read.parquet(str(tmp_path / "out-spark"))
    want = raw.select(F.from_json(F.col("value").cast("string"), "amount BIGINT, note STRING")
                      .alias("v"), F.col("offset").alias("at"), "topic", "partition",
                      F.col("timestamp").alias("ts")).select("v.*", "at", "topic", "partition",
                                                             "ts")
    order = ["topic", "partition", "at"]
    expected_parsed = want.toPandas().sort_values(order).reset_index(drop=True)
    for side in ("spark", "python"):
        parsed = spark.read.parquet(str(tmp_path / f"out-{side}-json"))
        assert parsed.columns == ["amount", "note", "at", "topic", "partition", "ts"]
        pd.testing.assert_frame_equal(
            parsed.toPandas().sort_values(order).reset_index(drop=True), expected_parsed)
    assert expected_parsed.amount.isna().sum() >= 60  # malformed and mistyped values among them
    assert {int(t) for t in got["spark"].timestampType} == {0, 1}
    assert int(got["spark"].key.isna().sum()) == 120


def _reader_spec(kafka, tasks: list[list[tuple[str, int, int, int]]]) -> dict:
    config = {"bootstrap.servers": kafka.bootstrap, "group.id": "spark-ckpt-pool-reader",
              "enable.auto.commit": False, "enable.partition.eof": False,
              "auto.offset.reset": "error"}
    return {"config": config, "fail_on_data_loss": True, "source": "pool",
            "bootstrap": kafka.bootstrap, "tasks": tasks, "format": None}


def _records_read(reader, task: int) -> list[tuple[int, int, int]]:
    """(partition, offset, the record's number in its value) of what a task reads."""
    import pyarrow as pa

    ids = pa.record_batch([pa.array([task], pa.int64())], names=["id"])
    return [(p, o, json.loads(v)["amount"]) for b in reader(iter([ids]))
            for p, o, v in zip(b.column("partition").to_pylist(), b.column("offset").to_pylist(),
                               b.column("value").to_pylist(), strict=True)]


def test_a_workers_kept_consumers_read_each_range_exactly_and_a_stuck_one_is_replaced(
        kafka, monkeypatch):
    """In a Python worker (here in-process, as a task runs it): a consumer kept from one
    range reads the next range of another partition, then of the first partition again from
    an earlier offset, each exactly (CI found a kept consumer paused, then assigned and
    resumed, reading nothing for 120 s: librdkafka's pause/resume race an assign; kept
    consumers are now unassigned), one consumer made for all four. A consumer that reads
    nothing although the records exist (here one whose partition is paused) is replaced by a
    new one at the same offset, long before the read times out."""
    from confluent_kafka import Consumer, TopicPartition

    from spark_ckpt.sources import kafka_reader

    kafka.create_topic("pool-t", 2)
    produce(kafka, "pool-t", records(120, 2))  # record i at partition i % 2, offset i // 2
    pool = kafka_reader._Consumers()
    monkeypatch.setattr(kafka_reader, "_CONSUMERS", pool)
    made = []
    monkeypatch.setattr(pool, "new", lambda *a: made.append(a) or kafka_reader._Consumers.new(*a))
    reader = kafka_reader.ReadRanges(_reader_spec(
        kafka, [[("pool-t", 0, 0, 40)], [("pool-t", 1, 5, 60)], [("pool-t", 0, 10, 60)],
                [("pool-t", 1, 0, 30)]]))
    for task, (partition, start, end) in enumerate([(0, 0, 40), (1, 5, 60), (0, 10, 60),
                                                    (1, 0, 30)]):
        # the values say which record each is: its partition's, at its offset
        assert _records_read(reader, task) == [
            (partition, o, 2 * o + partition) for o in range(start, end)]
    assert len(made) == 1  # one consumer, kept and assigned again for each range, none renewed
    monkeypatch.setattr(kafka_reader, "_RENEW_S", 2.0)
    monkeypatch.setattr(kafka_reader, "_READ_TIMEOUT_S", 30.0)

    def stuck(config, topic, partition, start):
        consumer = Consumer(config)
        consumer.assign([TopicPartition(topic, partition, start)])
        consumer.pause([TopicPartition(topic, partition)])
        return "stuck", consumer

    monkeypatch.setattr(pool, "take", stuck)
    started = time.monotonic()
    assert _records_read(reader, 2) == [(0, o, 2 * o) for o in range(10, 60)]
    assert time.monotonic() - started < 20 and len(made) == 2  # replaced once


def test_partitions_added_and_topics_matching_the_pattern_are_read_from_their_start(
        spark, kafka, tmp_path):
    """A pattern source over evt-a (2 partitions): after a run, evt-a gets two more partitions
    and evt-b appears; the next run of the same checkpoint reads the new records and the new
    partitions' and topic's records from their earliest offset, every record once."""
    from confluent_kafka.admin import AdminClient, NewPartitions

    kafka.create_topic("evt-a", 2)
    produce(kafka, "evt-a", records(100, 2))

    def run() -> pd.DataFrame:
        ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "kafka-pattern",
                               settings=SETTINGS)
        ctx.kafka_stream("records", kafka.bootstrap, pattern="evt-.*",
                         starting_offsets="latest", reader="python") \
            .select("topic", "partition", "offset").write_delta(str(tmp_path / "out"),
                                                                name="rows")
        ctx.process_available()
        return read_delta(str(tmp_path / "out")).to_pandas()

    assert run().empty  # "latest": a new pipeline starts after what is there
    produce(kafka, "evt-a", records(40, 2, start=100))
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    admin.create_partitions([NewPartitions("evt-a", 4)])["evt-a"].result(timeout=30)
    kafka.create_topic("evt-b", 1)
    kafka.wait_for_partitions("evt-a", 4)
    produce(kafka, "evt-a", records(40, 4, start=140))
    produce(kafka, "evt-b", records(30, 1, start=0))
    got = run()
    assert not got.duplicated().any()
    expected = pd.concat([consume_all(kafka, "evt-a"), consume_all(kafka, "evt-b")])
    expected = expected[(expected.topic == "evt-b") | (expected.offset >= 50) |
                        (expected.partition >= 2)]
    assert sorted(map(tuple, got[["topic", "partition", "offset"]].values.tolist())) == \
        sorted(map(tuple, expected[["topic", "partition", "offset"]].values.tolist()))


def test_offsets_deleted_before_they_are_read_stop_or_are_skipped_and_counted(
        spark, kafka, tmp_path):
    """Offsets 100..149 of a partition are deleted (as retention deletes them) before the
    source reads past 100: the pipeline stops naming the topic, the partition, the recorded
    offset and the available ones, with nothing allocated; with fail_on_data_loss=False the
    next run skips them, counts them in the allocation and reads the rest."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    kafka.create_topic("lossy", 1)
    produce(kafka, "lossy", records(100, 1))

    def context(fail: bool) -> StreamingContext:
        ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "kafka-loss",
                               settings=SETTINGS)
        ctx.kafka_stream("records", kafka.bootstrap, topics=["lossy"],
                         starting_offsets="earliest", fail_on_data_loss=fail,
                         reader="python") \
            .select("offset").write_delta(str(tmp_path / "out"), name="rows")
        return ctx

    context(True).process_available()
    produce(kafka, "lossy", records(100, 1, start=100))
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    admin.delete_records([TopicPartition("lossy", 0, 150)])[
        TopicPartition("lossy", 0, 150)].result(timeout=30)
    allocations = sorted(os.listdir(tmp_path / "ckpt" / "allocations"))
    with pytest.raises(PipelineFailedError) as failed:
        context(True).process_available()
    text = str(failed.value)
    assert "lossy-0" in text and "offset 100" in text and "150..199" in text and \
        "fail_on_data_loss=False" in text, text
    assert sorted(os.listdir(tmp_path / "ckpt" / "allocations")) == allocations
    ctx = context(False)
    ctx.process_available()
    assert sum(p.get("skipped", 0) for p in source_pieces(ctx)) == 50
    offsets = sorted(read_delta(str(tmp_path / "out")).to_pandas().offset)
    assert offsets == list(range(100)) + list(range(150, 200))


def test_a_wrong_address_or_topic_is_a_clear_error_and_nothing_is_allocated(
        spark, kafka, tmp_path):
    cases = [
        (f"127.0.0.1:{free_port()}", ["orders"], "expected the brokers at"),
        (kafka.bootstrap, ["no-such-topic"], "expected topic 'no-such-topic'"),
    ]
    for i, (bootstrap, topics, expected) in enumerate(cases):
        ckpt = tmp_path / f"ckpt{i}"
        ctx = StreamingContext(spark, 0.1, str(ckpt), "kafka-wrong", settings=SETTINGS)
        ctx.kafka_stream("records", bootstrap, topics=topics, reader="python",
                         options={"kafka.default.api.timeout.ms": "3000"}) \
            .write_parquet(str(tmp_path / f"out{i}"), name="rows")
        started = time.monotonic()
        with pytest.raises(PipelineFailedError, match=expected) as failed:
            ctx.process_available()
        assert "nothing was allocated" in str(failed.value)
        assert time.monotonic() - started < 60
        allocations = ckpt / "allocations"
        assert not allocations.exists() or not [f for f in os.listdir(allocations)
                                                if f.endswith(".json")]


def test_secret_options_never_reach_the_checkpoint_or_the_logs(spark, kafka, tmp_path,
                                                               caplog):
    secret = "hunter2-do-not-record"
    kafka.create_topic("secretive", 1)
    produce(kafka, "secretive", records(10, 1))
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "kafka-secret",
                           settings=SETTINGS)
    ctx.kafka_stream("records", kafka.bootstrap, topics=["secretive"],
                     starting_offsets="earliest", reader="python",
                     options={"kafka.ssl.key.password": secret,
                              "kafka.sasl.jaas.config":
                                  f'PlainLoginModule required username="u" password="{secret}";',
                              "kafka.security.protocol": "PLAINTEXT"}) \
        .select("offset").write_delta(str(tmp_path / "out"), name="rows")
    with caplog.at_level("DEBUG"):
        ctx.process_available()
    assert len(read_delta(str(tmp_path / "out")).to_pandas()) == 10
    for path in Path(tmp_path / "ckpt").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in caplog.text


def test_completed_checkpoints_commit_consumed_offsets_to_the_consumer_group(
        spark, kafka, tmp_path):
    """With kafka.group.id, where the source stands after a completed checkpoint is committed
    to that group (what lag monitors read); a restart still reads its checkpoint, not them."""
    from confluent_kafka import Consumer, TopicPartition

    kafka.create_topic("lagged", 2)
    produce(kafka, "lagged", records(60, 2))

    def run() -> None:
        ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "kafka-group",
                               settings=SETTINGS)
        ctx.kafka_stream("records", kafka.bootstrap, topics=["lagged"],
                         starting_offsets="earliest", reader="python",
                         options={"kafka.group.id": "lag-monitor"}) \
            .select("offset").write_delta(str(tmp_path / "out"), name="rows")
        ctx.process_available()

    run()
    reader = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "lag-monitor"})

    def group_offsets() -> list[int]:
        return [tp.offset for tp in committed(
            reader, [TopicPartition("lagged", 0), TopicPartition("lagged", 1)])]

    deadline = time.monotonic() + 20
    while group_offsets() != [30, 30] and time.monotonic() < deadline:
        time.sleep(0.2)  # the commit is a background thread's: polled until a deadline
    assert group_offsets() == [30, 30]
    # the group's offsets are not where a restart starts: moved back, nothing is read again
    reader.commit(offsets=[TopicPartition("lagged", 0, 0), TopicPartition("lagged", 1, 0)],
                  asynchronous=False)
    produce(kafka, "lagged", records(10, 2, start=60))
    run()
    reader.close()
    assert sorted(read_delta(str(tmp_path / "out")).to_pandas().offset) == \
        sorted(list(range(35)) * 2)


# -- every record once across killed drivers ---------------------------------------------------
def _command(kafka, tmp_path, topic: str) -> list[str]:
    return [sys.executable, str(ROOT / "jobs" / "kafka_counts.py"), "--bootstrap",
            kafka.bootstrap, "--topic", topic, "--checkpoint", str(tmp_path / "ckpt"),
            "--output", str(tmp_path / "out"), "--max-offsets", "400", "--available-now"]


@pytest.mark.slow
@pytest.mark.skipif(not LONG_FAULTS, reason="the sink's kill test below replays the source "
                    "across driver kills too; SPARK_CKPT_LONG_FAULTS=1")
def test_every_record_counted_once_across_driver_sigkills(spark, kafka, tmp_path):
    """Eight partitions, 4,000 records, a keyed count and sum into Delta and every record's
    offset appended: ten drivers SIGKILLed at random moments, then one run to the end. Each
    offset is in the records table once, and the totals are the topic's."""
    topic = "counted"
    kafka.create_topic(topic, 8)
    produce(kafka, topic, records(4000, 8))
    rng = random.Random(34)
    kills = 10
    env = child_env()
    landed = 0
    for _ in range(kills):
        proc = subprocess.Popen(_command(kafka, tmp_path, topic), env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        # a seeded moment after the JVM is up: wherever it lands (or if the driver finished
        # first) every record must be counted once; that the kills landed is asserted below
        time.sleep(rng.uniform(12.0, 20.0))
        if proc.poll() is None:
            kill_group(proc)
            landed += 1
        proc.wait(timeout=60)
        proc.stdout.close()
    assert landed >= 1
    final = subprocess.run(_command(kafka, tmp_path, topic), env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stdout[-5000:] + final.stderr[-5000:]
    seen = read_delta(str(tmp_path / "out" / "records")).to_pandas()
    assert not seen.duplicated(["partition", "offset"]).any(), "a record was written twice"
    assert len(seen) == 4000
    totals = read_delta(str(tmp_path / "out" / "totals")).to_pandas().set_index("k")
    expected = pd.DataFrame([(f"k{i % 7}", i) for i in range(4000)], columns=["k", "amount"]) \
        .groupby("k").agg(n=("amount", "size"), total=("amount", "sum"))
    assert totals.loc[expected.index, "n"].tolist() == expected.n.tolist()
    assert totals.loc[expected.index, "total"].tolist() == expected.total.tolist()


# -- the sink -----------------------------------------------------------------------------------
def read_committed(cluster, topic: str) -> pd.DataFrame:
    """What a read_committed consumer of ``topic`` sees: key, the value's JSON, partition and
    offset, in offset order per partition."""
    got = consume_all(cluster, topic)
    if got.empty:
        return pd.DataFrame(columns=["key", "k", "id", "seq", "partition", "offset"])
    values = pd.DataFrame([json.loads(v) for v in got.value])
    values["key"] = [k.decode() if k is not None else None for k in got.key]
    values["partition"] = got.partition.values
    values["offset"] = got.offset.values
    return values


def keyed_inputs(n: int, keys: int = 5) -> list[dict]:
    return [{"key": f"key{i % keys}".encode(), "value": json.dumps({"id": i}).encode()}
            for i in range(n)]


def assert_numbered_once(out: pd.DataFrame, n: int, keys: int = 5) -> None:
    assert sorted(out.id) == list(range(n)), "an id is missing or shows twice"
    for key, rows in out.groupby("k"):
        rows = rows.sort_values(["partition", "offset"])
        assert rows.seq.tolist() == list(range(1, len(rows) + 1)), f"{key}: not 1, 2, 3..."
        assert rows.id.tolist() == sorted(rows.id), f"{key}: not in its input's order"


def test_a_checkpoints_records_reach_read_committed_consumers_once(spark, kafka, tmp_path):
    """Kafka in, a keyed processor numbering each key's records, Kafka out (exactly once)
    and Delta: a read_committed consumer of the output topic sees every record once, each
    key's numbers in order, the same rows as the Delta table; a second run with nothing new
    sends nothing again."""
    import kafka_pipe

    kafka.create_topic("pipe-in", 4)
    kafka.create_topic("pipe-out", 3)
    produce(kafka, "pipe-in", keyed_inputs(600))
    settings = Settings(checkpoint_interval_ms=300, state_parallelism=2, progress="never")

    def run():
        ctx = kafka_pipe.build_pipeline(spark, kafka.bootstrap, "pipe-in", "pipe-out",
                                        str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                        max_offsets=150, settings=settings, interval=0.1)
        return ctx.process_available()

    assert len(run()) >= 4
    out = read_committed(kafka, "pipe-out")
    assert_numbered_once(out, 600)
    delta = read_delta(str(tmp_path / "out" / "seq")).to_pandas()
    assert sorted(map(tuple, delta[["k", "id", "seq"]].values.tolist())) == \
        sorted(map(tuple, out[["k", "id", "seq"]].values.tolist()))
    run()
    assert len(read_committed(kafka, "pipe-out")) == 600


def _zombie(bootstrap: str, transactional_id: str, topic: str, ready: Path) -> None:
    """A producer of the sink's slice that sends in a transaction and dies (SIGKILL) before
    committing it, as a killed attempt's Python worker does."""
    code = (
        "import sys, os, signal, time\n"
        "from confluent_kafka import Producer\n"
        "p = Producer({'bootstrap.servers': sys.argv[1], 'transactional.id': sys.argv[2],\n"
        "              'transaction.timeout.ms': 600000})\n"
        "p.init_transactions(60); p.begin_transaction()\n"
        "for i in range(50): p.produce(sys.argv[3], key=b'zombie', value=b'{\"id\": -1}')\n"
        # (then it only waits to be SIGKILLed: the ready file says when)
        "p.flush(60); open(sys.argv[4], 'w').close(); time.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, bootstrap, transactional_id, topic,
                             str(ready)], start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        assert proc.poll() is None, "the zombie producer exited early"
        time.sleep(0.1)  # polling for its ready file until a deadline
    kill_group(proc)
    proc.wait(timeout=30)


def test_an_open_transaction_of_a_dead_attempt_is_aborted_not_read(spark, kafka, tmp_path):
    """A killed attempt's producer left a transaction open with records in it (a lineage's
    slice id): the next commit of that slice fences it, its records are never read by a
    read_committed consumer, and the checkpoint's own records are there once."""
    import kafka_pipe

    kafka.create_topic("zin", 2)
    kafka.create_topic("zout", 2)
    produce(kafka, "zin", keyed_inputs(100))
    settings = Settings(checkpoint_interval_ms=0, state_parallelism=2, progress="never")
    ctx = kafka_pipe.build_pipeline(spark, kafka.bootstrap, "zin", "zout",
                                    str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                    settings=settings, interval=0.1)
    ctx.process_available()
    sink = next(o.two_phase for o in ctx._definition.graph.outputs if o.output_name == "out")
    for slice_ in range(sink.slices):
        _zombie(kafka.bootstrap, sink.transactional_id(slice_), "zout",
                tmp_path / f"ready{slice_}")
    produce(kafka, "zin", [{"key": f"key{i % 5}".encode(),
                            "value": json.dumps({"id": i}).encode()} for i in range(100, 140)])
    ctx = kafka_pipe.build_pipeline(spark, kafka.bootstrap, "zin", "zout",
                                    str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                    settings=settings, interval=0.1)
    ctx.process_available()
    out = read_committed(kafka, "zout")
    assert (out.id >= 0).all(), "a dead attempt's records were read"
    assert_numbered_once(out, 140)


# in this order: each killed driver gets through a batch or two; the worker's fault last (its
# driver goes on to the end of the input, its commits failing)
SINK_KILLS = ("checkpoint.barrier", "checkpoint.completed", "checkpoint.sink.committed",
              "stream.batch.committed")


@pytest.mark.slow
def test_kafka_to_kafka_exactly_once_across_sigkills(spark, kafka, tmp_path):
    """Drivers of jobs/kafka_pipe.py killed at the sink's commit points (a checkpoint complete
    and nothing sent; a slice sent, its transaction open, its Python worker killed; a slice
    committed, the rest not) and at random moments; then one run to the end. A read_committed
    consumer sees every id once with each key numbered 1, 2, 3... in order, and the Delta table
    has the same rows."""
    kafka.create_topic("fin", 4)
    kafka.create_topic("fout", 3)
    n = 3000
    produce(kafka, "fin", keyed_inputs(n))
    rng = random.Random(35)
    # CI: a half-committed checkpoint (a dead attempt's open transaction: the executor's kill
    # below); SPARK_CKPT_LONG_FAULTS=1: every point, random moments and the worker
    points = SINK_KILLS if LONG_FAULTS else ("checkpoint.sink.committed",)
    kills = [f"{p}:1" for p in points] + \
        [f"after:{rng.uniform(12, 20):.1f}" for _ in range(5 if LONG_FAULTS else 0)] + \
        (["sink.kafka.sent:1"] if LONG_FAULTS else [])
    command = [sys.executable, str(ROOT / "jobs" / "kafka_pipe.py"), "--bootstrap",
               kafka.bootstrap, "--source-topic", "fin", "--sink-topic", "fout",
               "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
               "--max-offsets", "300", "--checkpoint-ms", "500", "--available-now"]
    for kill in kills:
        if kill.startswith("after:"):
            proc = subprocess.Popen(command, env=child_env(), cwd=ROOT, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # a seeded moment: wherever it lands the result must be exactly once
            time.sleep(float(kill.split(":")[1]))
            if proc.poll() is None:
                kill_group(proc)
            proc.wait(timeout=60)
            continue
        done = subprocess.run(command, env=child_env(kill), cwd=ROOT, capture_output=True,
                              text=True, timeout=600, start_new_session=True)
        assert "RESULT" not in done.stdout, f"{kill}: the driver finished before the fault"
        if kill.startswith("sink.kafka.sent"):
            # a Python worker dies with its slice's transaction open, again in every retry of
            # this driver (at its start's commit of what is pending, or later): it stops
            assert done.returncode == 1 and "sending checkpoint" in done.stderr and \
                "Python worker exited unexpectedly" in done.stderr, \
                (kill, done.returncode, done.stderr[-3000:])
        else:  # the driver's whole process group was killed at the point
            assert done.returncode == -9, (kill, done.returncode, done.stdout[-3000:])
    final = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert final.returncode == 0, final.stdout[-5000:] + final.stderr[-5000:]
    out = read_committed(kafka, "fout")
    assert_numbered_once(out, n)
    delta = read_delta(str(tmp_path / "out" / "seq")).to_pandas()
    assert sorted(map(tuple, delta[["k", "id", "seq"]].values.tolist())) == \
        sorted(map(tuple, out[["k", "id", "seq"]].values.tolist()))


@pytest.mark.slow
@pytest.mark.parametrize("target", [
    "executor",
    pytest.param("kill", marks=pytest.mark.skipif(
        not LONG_FAULTS, reason="a worker's death mid-send is in the SIGKILL test above; its "
        "retried recovery runs with SPARK_CKPT_LONG_FAULTS=1")),
])
def test_an_executor_or_worker_killed_mid_send_is_retried_exactly_once(spark, kafka, tmp_path,
                                                                         target):
    """jobs/kafka_pipe.py on local-cluster[2,1,1024]: just after a sending task's Python
    worker has sent its slice in a transaction not yet committed, its executor (with every
    Python worker of it) or the worker alone is SIGKILLed, once. Spark runs the task again,
    on the other executor or a new worker; the new attempt's producer fences the dead one's
    transaction. The driver finishes; a read_committed consumer sees every id once, each key
    numbered 1, 2, 3... in order, and the Delta table has the same rows."""
    source, sink = f"x{target}-in", f"x{target}-out"
    kafka.create_topic(source, 4)
    kafka.create_topic(sink, 3)
    n = 1500
    produce(kafka, source, keyed_inputs(n))
    once = tmp_path / "fault-taken"
    command = [sys.executable, str(ROOT / "jobs" / "kafka_pipe.py"), "--bootstrap",
               kafka.bootstrap, "--source-topic", source, "--sink-topic", sink,
               "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
               "--max-offsets", "500", "--checkpoint-ms", "500", "--available-now",
               "--master", "local-cluster[2,1,1024]"]
    done = subprocess.run(command, env=child_env(f"sink.kafka.sent:1:{target}",
                                                 SPARK_CKPT_FAULT_ONCE=str(once)),
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    assert done.returncode == 0 and "RESULT" in done.stdout, \
        done.stdout[-3000:] + done.stderr[-5000:]
    assert once.exists(), "the fault was never reached: nothing was killed"
    lost = "ExecutorLostFailure" if target == "executor" else "Python worker exited"
    assert lost in done.stderr, done.stderr[-5000:]
    out = read_committed(kafka, sink)
    assert_numbered_once(out, n)
    delta = read_delta(str(tmp_path / "out" / "seq")).to_pandas()
    assert sorted(map(tuple, delta[["k", "id", "seq"]].values.tolist())) == \
        sorted(map(tuple, out[["k", "id", "seq"]].values.tolist()))


@pytest.mark.slow
@pytest.mark.skipif(not LONG_FAULTS, reason="a second, three-broker cluster; the sink's kills "
                    "above run on one broker in CI; SPARK_CKPT_LONG_FAULTS=1")
def test_a_broker_killed_in_a_three_broker_cluster_loses_and_repeats_nothing(
        spark, tmp_path_factory, tmp_path):
    """Three brokers (replication 3, min.insync.replicas 2, acks=all): one is SIGKILLed while
    the Kafka-to-Kafka pipeline runs and stays down; the pipeline goes on through the new
    leaders (a commit refused meanwhile is retried by the next checkpoint's), and a
    read_committed consumer sees every id once, each key numbered in order."""
    with kafka_cluster(tmp_path_factory.mktemp("kafka3"), brokers=3) as cluster:
        cluster.create_topic("bin", 4)
        cluster.create_topic("bout", 3)
        n = 1500
        produce(cluster, "bin", keyed_inputs(n))
        command = [sys.executable, str(ROOT / "jobs" / "kafka_pipe.py"), "--bootstrap",
                   cluster.bootstrap, "--source-topic", "bin", "--sink-topic", "bout",
                   "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
                   "--max-offsets", "200", "--checkpoint-ms", "500", "--available-now"]
        proc = subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        killed = False
        for line in proc.stdout:  # a broker dies once the pipeline has sent something
            if not killed and "Kafka sink out: checkpoint" in line and "committed" in line:
                cluster.kill(cluster.brokers[1])
                killed = True
        proc.wait(timeout=600)
        assert killed, "the pipeline committed nothing before it ended"
        if proc.returncode != 0:  # a commit refused while leaders moved: the next start sends
            final = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True,
                                   text=True, timeout=600)
            assert final.returncode == 0, final.stdout[-5000:] + final.stderr[-5000:]
        out = read_committed(cluster, "bout")
        assert_numbered_once(out, n)


def test_whether_sparks_connector_is_there_is_sparks_own_lookup(spark):
    """On a classic session the Kafka source asks Spark's own data-source lookup (no read
    built to probe it) and checks the Kafka client the connector needs beside its jar: a
    connector without kafka-clients is not taken for one that reads."""
    from spark_ckpt.sparkapi import spark_api

    api = spark_api(spark)
    if api.kind != "classic":
        assert api.data_source_available("kafka") is None  # Connect: a read tells
        return
    assert api.data_source_available("parquet") is True
    assert api.data_source_available("kafka") is False  # not on the tests' session
    from spark_ckpt.sparkapi import classic

    needs = dict(classic._SOURCE_NEEDS)
    try:  # a source whose jar resolves but whose client library does not load
        classic._SOURCE_NEEDS["parquet"] = ("no.such.ClientClass",)
        assert api.data_source_available("parquet") is False
    finally:
        classic._SOURCE_NEEDS.clear()
        classic._SOURCE_NEEDS.update(needs)


def test_watermarks_are_kept_per_partition_and_an_idle_partition_stops_holding_them(
        spark, kafka, tmp_path):
    """Flink's per-partition watermarks with idleness, on a real topic of two partitions and a
    10-second tumbling count: partition 0 runs 20 s of event time ahead of partition 1, whose
    rows are still on time for their window (the smallest partition's time counts; one
    watermark over the whole input, as Structured Streaming keeps it, would have dropped
    them as late); while partition 1 holds the watermark back nothing closes, and once it had
    no rows for the idle timeout on the pipeline's clock the watermark moves on partition 0's
    time alone, closing the window in a batch without data. A row of the idle partition that
    comes back behind the watermark is late: dropped and counted."""
    from helpers import wait_for
    from pyspark.sql import functions as F

    from spark_ckpt.state import count
    from spark_ckpt.streaming.template.windows import tumbling
    from spark_ckpt.clock import ManualClock

    kafka.create_topic("wm", 2)
    e0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z, on a 10-second boundary

    def send(rows: list[tuple[int, str, int]]) -> None:  # (partition, key, event time s)
        produce(kafka, "wm", [{"partition": p, "value": json.dumps({
            "k": k, "ts": pd.Timestamp(e0 + s * 1000, unit="ms", tz="UTC").isoformat()}).encode()}
            for p, k, s in rows])

    out = tmp_path / "out"
    clock = ManualClock(start_ms=10_000_000)
    ctx = StreamingContext(spark, 5.0, str(tmp_path / "ckpt"), "kafka-wm", clock=clock,
                           settings=SETTINGS)
    ctx.kafka_stream("ev", kafka.bootstrap, topics=["wm"], starting_offsets="earliest",
                     reader="python", value_format="json", value_schema="k STRING, ts TIMESTAMP",
                     metadata_columns=["partition"]) \
        .with_watermark("ts", "2 seconds", idle_timeout="20 seconds") \
        .key_by("k").window(tumbling("10 seconds")).agg(name="counts", n=count()) \
        .select("k", "n", F.unix_millis("window.start").alias("start_ms")) \
        .write_parquet(str(out), name="out")

    def step(rows: list[tuple[int, str, int]]) -> dict:
        if rows:
            send(rows)
        done = len(ctx.recent_progress)
        clock.advance(5_000)
        assert wait_for(lambda: len(ctx.recent_progress) > done, 120), ctx.recent_progress
        return ctx.recent_progress[-1]["state"]["counts"]

    def emitted() -> list[tuple]:
        if not out.exists():
            return []
        frame = spark.read.schema("k STRING, n BIGINT, start_ms BIGINT").parquet(str(out))
        return sorted((r.k, r.n, r.start_ms - e0) for r in frame.collect())

    # key a in both partitions in one batch: the window's partials of each merge into one
    send([(0, "a", 1), (0, "a", 2), (0, "a", 3), (1, "a", 2), (1, "b", 1)])
    ctx.start()
    try:
        assert wait_for(lambda: len(ctx.recent_progress) >= 1, 120), ctx.recent_progress
        step([(0, "a", 25), (1, "b", 4)])
        # partition 0 is at 25 s, partition 1 at 4 s: the watermark is 2 s, not 23 s
        state = step([(1, "b", 8)])
        assert state["watermark_ms"] == e0 + 2_000, state
        assert state.get("late_rows", 0) == 0, state
        state = step([])  # partition 1 last had rows 5 s ago: not idle yet
        assert state["watermark_ms"] == e0 + 6_000 and state["idle_partitions"] == 0, state

        def fired() -> int:
            return sum(p["state"]["counts"].get("timers_fired", 0) for p in ctx.recent_progress)

        assert fired() == 0
        for s in (26, 27, 28, 29):  # partition 1 has no rows for 20 s: idle, 28 s - 2 s
            state = step([(0, "a", s)])
        assert state["idle_partitions"] == 1 and state["watermark_ms"] == e0 + 26_000, state
        assert fired() == 2  # the window [0 s, 10 s) of a and of b
        state = step([])  # no rows at all: partition 0's time still counts
        assert state["watermark_ms"] == e0 + 27_000, state
        # partition 1 again, behind the watermark: late, dropped and counted
        state = step([(1, "b", 5)])
        assert state.get("late_rows") == 1 and state["idle_partitions"] == 0, state
    finally:
        ctx.stop()
    assert emitted() == [("a", 4, 0), ("b", 3, 0)]
