"""Nexmark through Kafka (issue 35: the generator "writes to files and to Kafka"): the
generator's events produced to a real broker's topic of 3 partitions (KRaft, Kafka's jars, on
loopback), read back by ``nexmark_queries.kafka_input`` in batches of at most 2,000 offsets
as exactly the rows and types of its files, each record keyed, placed and timestamped as the
generator says, and q1 (stateless) and q5, q7, q11 (windowed) on that stream equal to
their batch Spark SQL references over the generator's files of the same events."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
from helpers import LONG_FAULTS, LONG_ONLY, ROOT
from kafka_cluster import kafka_cluster
from pyspark.sql import functions as F

from spark_ckpt import StreamingContext
from spark_ckpt.options import Settings

sys.path.insert(0, str(ROOT / "scripts"))
import nexmark_gen
import nexmark_queries

EVENTS = 5_000
RATE = 100  # events a second: 50 s of event time, windows and sessions to close
PARTITIONS = 3
QUERIES = ["q1", "q5", "q7", "q11"]


@pytest.fixture(scope="module")
def kafka(tmp_path_factory):
    with kafka_cluster(tmp_path_factory.mktemp("kafka")) as cluster:
        yield cluster


@pytest.mark.skipif(not LONG_FAULTS, reason=LONG_ONLY)  # test_nexmark.py's queries, from files
def test_queries_read_from_kafka_equal_batch_spark_sql(spark, kafka, tmp_path):
    assert nexmark_gen.produce(kafka.bootstrap, "nexmark", EVENTS, PARTITIONS,
                               events_per_second=RATE) == EVENTS
    with pytest.raises(ValueError, match=f"already holds {EVENTS} records"):
        nexmark_gen.produce(kafka.bootstrap, "nexmark", 10, PARTITIONS)
    nexmark_gen.write(tmp_path / "files", EVENTS, 1, events_per_second=RATE)

    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "nexmark-kafka",
                           settings=Settings(checkpoint_interval_ms=0, state_parallelism=2,
                                             progress="never"))
    events = nexmark_queries.kafka_input(ctx, kafka.bootstrap, "nexmark",
                                         max_offsets_per_batch=2_000)

    def to(out: str):
        return lambda df, b: df.withColumn("__batch", F.lit(b)).write.mode("append") \
            .parquet(str(tmp_path / "out" / out))

    events.foreach_batch(to("events"), name="events")
    ctx.kafka_stream("records", kafka.bootstrap, topics=["nexmark"],
                     starting_offsets="earliest", value_format="json",
                     value_schema="dateTime TIMESTAMP",
                     metadata_columns=["key", "partition", "timestamp"]) \
        .foreach_batch(to("records"), name="records")
    for name in QUERIES:
        nexmark_queries.QUERIES[name][0](events).foreach_batch(to(name), name=name)
    progress = ctx.process_available(timeout=900)
    read = [ctx.allocation(p["batch_id"]).pieces["events"]["offsets"] for p in progress]
    assert sum(read) == EVENTS and max(read) <= 2_000 and read[-1] == 0, read

    # the stream's rows and types are the files'
    files = spark.read.schema(nexmark_gen.SPARK_SCHEMA).parquet(str(tmp_path / "files"))
    got = spark.read.parquet(str(tmp_path / "out" / "events")).drop("__batch")
    assert got.schema == files.schema
    assert got.count() == EVENTS
    assert got.exceptAll(files).count() == 0 and files.exceptAll(got).count() == 0

    # event n: key n, partition n % 3, the Kafka timestamp its time
    records = spark.read.parquet(str(tmp_path / "out" / "records")).toPandas()
    n = records["key"].map(lambda k: int(bytes(k)))
    assert sorted(n) == list(range(EVENTS))
    assert (records["partition"] == n % PARTITIONS).all()
    assert (records["timestamp"] == records["dateTime"]).all()
    ms = pd.to_datetime(records["dateTime"], utc=True).dt.as_unit("ms").astype("int64")
    assert (ms == nexmark_gen.BASE_MS + n * 1000 // RATE).all()

    final_watermark = nexmark_gen.BASE_MS + (EVENTS - 1) * 1000 // RATE - 4_000
    for name in QUERIES:
        _query, reference, mode = nexmark_queries.QUERIES[name]
        rows = spark.read.parquet(str(tmp_path / "out" / name)).toPandas()
        rows, expected = nexmark_queries.comparable(
            rows, reference(spark, files).toPandas(), mode, final_watermark,
            nexmark_gen.BASE_MS)
        assert len(expected) > 0, name
        pd.testing.assert_frame_equal(rows, expected, check_dtype=False, obj=name)


def test_the_generator_refuses_a_topic_that_would_lose_events_and_fails_on_delivery_errors(
        kafka):
    """A topic that would delete the events (any finite retention: they are dated 2026-01-01
    on), replace their times (LogAppendTime) or holds other partitions is refused before
    anything is sent; a record the broker refuses
    (larger than the topic's max.message.bytes) fails the run, naming what was delivered."""
    kafka.create_topic("nexmark-kept", 2, config={"retention.ms": str(7 * 86_400_000)})
    with pytest.raises(ValueError, match="a finite retention deletes them"):
        nexmark_gen.produce(kafka.bootstrap, "nexmark-kept", 10, 2)
    # ten years' retention deletes them too, later (a topic the benchmark keeps between runs)
    kafka.create_topic("nexmark-years", 2, config={"retention.ms": str(3650 * 86_400_000)})
    with pytest.raises(ValueError, match="'retention.ms': '315360000000'"):
        nexmark_gen.produce(kafka.bootstrap, "nexmark-years", 10, 2)
    kafka.create_topic("nexmark-appended", 2, config={
        "retention.ms": "-1", "message.timestamp.type": "LogAppendTime"})
    with pytest.raises(ValueError, match="LogAppendTime replaces their times"):
        nexmark_gen.produce(kafka.bootstrap, "nexmark-appended", 10, 2)
    with pytest.raises(ValueError, match="has 2 partitions, not 3"):
        nexmark_gen.produce(kafka.bootstrap, "nexmark-kept", 10, 3)
    kafka.create_topic("nexmark-small", 2, config={"retention.ms": "-1",
                                                   "max.message.bytes": "200"})
    with pytest.raises(RuntimeError, match=r"nexmark-small: 0 of 10 events delivered.*failed"):
        nexmark_gen.produce(kafka.bootstrap, "nexmark-small", 10, 2)
