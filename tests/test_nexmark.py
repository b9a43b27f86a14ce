"""Nexmark (issue 35): the generator is deterministic and in the benchmark's proportions, and
every query written so far equals its batch Spark SQL reference over the same events, all of
them in one pipeline over 200,000 events (200 s of event time) in 2 files (the generator's
100,000-event chunks), one a batch, and the batch without data that closes the last windows."""

from __future__ import annotations

import sys

import pandas as pd
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import functions as F

from spark_ckpt import StreamingContext
from spark_ckpt.clock import ManualClock
from spark_ckpt.options import Settings
from helpers import LONG_FAULTS, ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import nexmark_gen
import nexmark_queries

EVENTS = 200_000
RATE = 1_000  # events a second: 200 s of event time, windows and sessions to close
# CI runs a query of most kinds of stateful output (a join's appends, hopping windows closed by
# the watermark, sessions, a top-n's upserts; test_windows.py has processing-time windows);
# every query with SPARK_CKPT_LONG_FAULTS=1 (three minutes of a 2-core machine)
CI_QUERIES = ("q3", "q5", "q11", "q19")
QUERIES = {name: q for name, q in nexmark_queries.QUERIES.items()
           if LONG_FAULTS or name in CI_QUERIES}


def test_the_generator_is_deterministic_and_in_proportion(tmp_path):
    one = nexmark_gen.write(tmp_path / "a", EVENTS, 2)
    two = nexmark_gen.write(tmp_path / "b", EVENTS, 4)
    a = pq.read_table(one).sort_by("dateTime")
    b = pq.read_table(two).sort_by("dateTime")
    assert a.equals(b)  # the same events whatever the files
    kinds = dict(zip(*[c.to_pylist() for c in
                       pc.value_counts(a.column("event_type")).flatten()], strict=True))
    assert kinds == {0: EVENTS // 50, 1: EVENTS * 3 // 50, 2: EVENTS * 46 // 50}
    bids = pc.struct_field(a.filter(pc.equal(a.column("event_type"), 2)).column("bid"), 0)
    hot = pc.value_counts(bids).flatten()[1].to_numpy()
    assert hot.max() > 100 * float(pd.Series(hot).median())  # hot auctions take most bids


def test_every_query_equals_batch_spark_sql(spark, tmp_path):
    assert len(nexmark_gen.write(tmp_path / "events", EVENTS, 2,
                                 events_per_second=RATE)) == 2
    # batches 10 s apart on the injected clock (q12's processing-time windows then close)
    ctx = StreamingContext(spark, 10.0, str(tmp_path / "ckpt"), "nexmark", settings=Settings(
        checkpoint_interval_ms=0, state_parallelism=2, progress="never"),
        clock=ManualClock(start_ms=nexmark_gen.BASE_MS))
    events = nexmark_queries.file_input(ctx, str(tmp_path / "events"), max_files_per_batch=1)
    for name, (query, _reference, _mode) in QUERIES.items():
        query(events).foreach_batch(
            lambda df, b, name=name: df.withColumn("__batch", F.lit(b)).write.mode("append")
            .parquet(str(tmp_path / "out" / name)), name=name)
    progress = ctx.process_available(timeout=1800)
    batch_times = [p["batch_time_ms"] for p in progress]
    assert batch_times == [nexmark_gen.BASE_MS + 10_000 * b for b in range(len(progress))]
    everything = spark.read.schema(nexmark_gen.SPARK_SCHEMA).parquet(str(tmp_path / "events"))
    # the last event's time minus the delay
    final_watermark = nexmark_gen.BASE_MS + (EVENTS - 1) * 1000 // RATE - 4_000
    for name, (_query, reference, mode) in QUERIES.items():
        got = spark.read.parquet(str(tmp_path / "out" / name)).toPandas()
        expected = (nexmark_queries.q12_reference(
            spark, everything, nexmark_queries.batch_files(ctx, progress), max(batch_times))
            if mode == "proctime" else reference(spark, everything)).toPandas()
        got, expected = nexmark_queries.comparable(got, expected, mode, final_watermark,
                                                   nexmark_gen.BASE_MS)
        assert len(expected) > 0, name
        pd.testing.assert_frame_equal(got, expected, check_dtype=False, obj=name)
