"""Stream-stream joins bounded in event time (issue 35, item 3), against batch Spark.

Bids join auctions of the same id opened at most 20 s before the bid
(``a_time BETWEEN b_time - 20 s AND b_time``), over four batches of both streams, rows out of
order within the watermark's delay. Every kind of join equals batch Spark's join of all rows
with the same condition, but for the unmatched rows of an outer (or anti) join that the final
watermark has not yet released (they could still match). Also: the watermark is the smaller of
the two inputs', late rows are dropped and counted, a killed driver emits each row once.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from pyspark.sql import functions as F

from spark_ckpt import StreamingContext
from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.options import Settings
from helpers import write_batch_files
from spark_ckpt.streaming.template.joins import HOWS

BASE_MS = 1_767_225_600_000
AUCTIONS = "auction BIGINT, seller BIGINT, a_ms BIGINT"
BIDS = "auction BIGINT, bidder BIGINT, price BIGINT, b_ms BIGINT"
DELAY_MS = 5_000


def _data(batches: int = 4, seed: int = 11) -> tuple[list[pd.DataFrame], list[pd.DataFrame]]:
    """Auctions open every ~0.5 s; bids come 0–30 s after an auction opened (so some fall
    outside the 20-second bound), name an auction that does not exist, or none (a null key,
    which matches nothing, as in Spark); each batch holds
    10 s of event time, shuffled, with rows up to 3 s older than the batch's start."""
    rng = np.random.default_rng(seed)
    auctions, bids = [], []
    for a in range(batches * 20):
        t = BASE_MS + a * 500 + int(rng.integers(0, 400))
        auctions.append({"auction": a, "seller": int(rng.integers(0, 9)), "a_ms": t})
        for _ in range(int(rng.integers(0, 4))):
            draw = rng.random()
            bids.append({"auction": a if draw < 0.87 else None if draw < 0.9 else 100_000 + a,
                         "bidder": int(rng.integers(0, 50)), "price": int(rng.integers(1, 999)),
                         "b_ms": t + int(rng.integers(0, 30_000))})

    def cut(rows: list[dict], column: str) -> list[pd.DataFrame]:
        frame = pd.DataFrame(rows).astype({"auction": "Int64"})
        batch = ((frame[column] - BASE_MS + 3_000 * rng.random(len(frame))) // 10_000) \
            .clip(0, batches - 1).astype(int)
        return [frame[batch == b].sample(frac=1.0, random_state=b).reset_index(drop=True)
                for b in range(batches)]

    return cut(auctions, "a_ms"), cut(bids, "b_ms")


def _write(spark, frames: list[pd.DataFrame], schema: str, source) -> str:
    return write_batch_files(spark, frames, schema, source)


def _streams(ctx, spark, tmp_path, auctions, bids):
    a = ctx.file_stream("auctions", _write(spark, auctions, AUCTIONS, tmp_path / "a"),
                        "parquet", AUCTIONS, max_files_per_batch=1) \
        .with_column("a_time", F.timestamp_millis("a_ms")).with_watermark("a_time", "5 seconds")
    b = ctx.file_stream("bids", _write(spark, bids, BIDS, tmp_path / "b"), "parquet", BIDS,
                        max_files_per_batch=1) \
        .with_column("b_time", F.timestamp_millis("b_ms")).with_watermark("b_time", "5 seconds")
    return a, b


def _expected(spark, auctions: pd.DataFrame, bids: pd.DataFrame, how: str,
              watermark: int) -> pd.DataFrame:
    a = spark.createDataFrame(auctions, AUCTIONS)
    b = spark.createDataFrame(bids, BIDS)
    cond = (b.auction == a.auction) & (a.a_ms >= b.b_ms - 20_000) & (a.a_ms <= b.b_ms)
    spark_how = {"left_outer": "left", "right_outer": "right", "full_outer": "full"}.get(how,
                                                                                        how)
    joined = b.join(a, cond, spark_how)
    if how in ("left_semi", "left_anti"):
        out = joined.select("auction", "bidder", "price", "b_ms")
    else:
        out = joined.select(F.coalesce(b.auction, a.auction).alias("auction"), "bidder",
                            "price", "b_ms", "seller", "a_ms")
    rows = out.toPandas()
    # an unmatched row is emitted once the watermark passes the last time it could match
    unmatched_bid = rows.a_ms.isna() if "a_ms" in rows else pd.Series(how == "left_anti",
                                                                      index=rows.index)
    # a bid without an auction id never matches: released at once
    pending = unmatched_bid & (rows.b_ms + 0 > watermark) & rows.auction.notna()
    if "a_ms" in rows:
        pending |= rows.b_ms.isna() & (rows.a_ms + 20_000 > watermark)
    released = ~pending
    return _sorted(rows[released])


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c in ("auction", "b_ms", "bidder", "price", "a_ms", "seller")
            if c in frame.columns]
    return frame[cols].astype("float64").sort_values(cols).reset_index(drop=True)


def test_every_join_kind_equals_batch_sparks_join(spark, tmp_path):
    auctions, bids = _data()
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "joins", settings=Settings(
        checkpoint_interval_ms=0, state_parallelism=2, progress="never"))
    a, b = _streams(ctx, spark, tmp_path, auctions, bids)
    for how in HOWS:
        b.join_stream(a, "auction", how, between=("-20 seconds", "0 seconds"), name=how) \
            .write_parquet(str(tmp_path / "out" / how), name=how)
    progress = ctx.process_available(timeout=900)
    assert progress[-1]["num_input_rows"] == 0  # the no-data batch that released the last rows
    everything_a, everything_b = pd.concat(auctions), pd.concat(bids)
    watermark = min(int(everything_a.a_ms.max()), int(everything_b.b_ms.max())) - DELAY_MS
    for how in HOWS:
        got = _sorted(spark.read.parquet(str(tmp_path / "out" / how)).toPandas())
        expected = _expected(spark, everything_a, everything_b, how, watermark)
        assert len(expected) >= 10, how
        pd.testing.assert_frame_equal(got, expected, check_dtype=False, obj=how)
    assert not any(p["state"][how].get("late_rows") for p in progress for how in HOWS)


def test_the_join_watermark_is_the_slower_inputs(spark, tmp_path):
    """Auctions stop after the first batch while bids go on: the join's watermark stays at
    the auctions' (no auction row is dropped before a bid could still match it)."""
    auctions, bids = _data()
    auctions = [auctions[0]] + [auctions[0].iloc[:0]] * 3
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "slow", settings=Settings(
        checkpoint_interval_ms=0, state_parallelism=2, progress="never"))
    a, b = _streams(ctx, spark, tmp_path, auctions, bids)
    b.join_stream(a, "auction", "inner", between=("-20 seconds", "0 seconds"), name="j") \
        .write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=600)
    watermarks = [p["state"]["j"]["watermark_ms"] for p in progress]
    assert watermarks[-1] == int(auctions[0].a_ms.max()) - DELAY_MS
    got = _sorted(spark.read.parquet(str(tmp_path / "out")).toPandas())
    expected = _expected(spark, auctions[0], pd.concat(bids), "inner", 0)
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)


def test_an_idle_input_stops_holding_the_join_watermark_back(spark, tmp_path):
    """As above, but both inputs declare ``idle_timeout="10 seconds"`` (Flink's
    ``withIdleness``): once the auctions had no rows for 10 s on the pipeline's clock, the
    join's watermark follows the bids alone, and the join still equals batch Spark's."""
    from helpers import wait_for

    from spark_ckpt.clock import ManualClock

    auctions, bids = _data()
    auctions = [auctions[0]] + [auctions[0].iloc[:0]] * 3
    clock = ManualClock(start_ms=50_000_000)
    ctx = StreamingContext(spark, 5.0, str(tmp_path / "ckpt"), "idle", clock=clock,
                           settings=Settings(checkpoint_interval_ms=0, state_parallelism=2,
                                             progress="never"))
    a = ctx.file_stream("auctions", _write(spark, auctions, AUCTIONS, tmp_path / "a"),
                        "parquet", AUCTIONS, max_files_per_batch=1) \
        .with_column("a_time", F.timestamp_millis("a_ms")) \
        .with_watermark("a_time", "5 seconds", idle_timeout="10 seconds")
    b = ctx.file_stream("bids", _write(spark, bids, BIDS, tmp_path / "b"), "parquet", BIDS,
                        max_files_per_batch=1) \
        .with_column("b_time", F.timestamp_millis("b_ms")) \
        .with_watermark("b_time", "5 seconds", idle_timeout="10 seconds")
    b.join_stream(a, "auction", "inner", between=("-20 seconds", "0 seconds"), name="j") \
        .write_parquet(str(tmp_path / "out"), name="out")
    ctx.start()
    try:
        assert wait_for(lambda: len(ctx.recent_progress) == 1, 120)
        for n in (2, 3, 4):
            clock.advance(5_000)
            assert wait_for(lambda n=n: len(ctx.recent_progress) == n, 120), \
                ctx.recent_progress
        states = [p["state"]["j"] for p in ctx.recent_progress]
    finally:
        ctx.stop()
    slow = int(auctions[0].a_ms.max())

    def bids_up_to(b: int) -> int:
        return int(pd.concat(bids[:b + 1]).b_ms.max())

    # batch 1 waits for the auctions; batch 2 runs 10 s after their last row: idle from there
    assert [s["watermark_ms"] for s in states] == [
        None, min(slow, bids_up_to(0)) - DELAY_MS, bids_up_to(1) - DELAY_MS,
        bids_up_to(2) - DELAY_MS], states
    assert states[3]["watermark_ms"] > slow
    assert [s["idle_partitions"] for s in states] == [0, 0, 1, 1], states
    got = _sorted(spark.read.parquet(str(tmp_path / "out")).toPandas())
    expected = _expected(spark, auctions[0], pd.concat(bids), "inner", 0)
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)
    assert not any(s.get("late_rows") for s in states)


def test_an_idle_timeout_shorter_than_a_batch_idles_only_inputs_without_rows(spark, tmp_path):
    """An idle timeout of 1 ms, far below the time between batches: an input with rows in the
    last batch is never idle (the bids here, every batch), an input without is (the auctions
    after their one batch), and a bounded run still ends, equal to batch Spark's join."""
    auctions, bids = _data()
    auctions = [auctions[0]] + [auctions[0].iloc[:0]] * 3
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "short-idle", settings=Settings(
        checkpoint_interval_ms=0, state_parallelism=2, progress="never"))
    a = ctx.file_stream("auctions", _write(spark, auctions, AUCTIONS, tmp_path / "a"),
                        "parquet", AUCTIONS, max_files_per_batch=1) \
        .with_column("a_time", F.timestamp_millis("a_ms")) \
        .with_watermark("a_time", "5 seconds", idle_timeout=1)
    b = ctx.file_stream("bids", _write(spark, bids, BIDS, tmp_path / "b"), "parquet", BIDS,
                        max_files_per_batch=1) \
        .with_column("b_time", F.timestamp_millis("b_ms")) \
        .with_watermark("b_time", "5 seconds", idle_timeout=1)
    b.join_stream(a, "auction", "inner", between=("-20 seconds", "0 seconds"), name="j") \
        .write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=600)
    marks = [p["state"]["j"]["watermark_ms"] for p in progress]

    def bids_up_to(i: int) -> int:
        return int(pd.concat(bids[:i + 1]).b_ms.max())

    assert marks[:4] == [None, min(int(auctions[0].a_ms.max()), bids_up_to(0)) - DELAY_MS,
                         bids_up_to(1) - DELAY_MS, bids_up_to(2) - DELAY_MS], marks
    got = _sorted(spark.read.parquet(str(tmp_path / "out")).toPandas())
    expected = _expected(spark, auctions[0], pd.concat(bids), "inner", 0)
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)


def test_join_definitions_are_checked(spark, tmp_path):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "refused", settings=Settings(
        checkpoint_interval_ms=0, progress="never"))
    gen = ctx.generator_stream("gen", rows_per_batch=10, total_rows=30, keys=2)
    marked = gen.with_watermark("event_time", "1 second")
    with pytest.raises(JobDefinitionError, match="expected how"):
        marked.join_stream(marked, "key", "sideways", between="1 second")
    with pytest.raises(JobDefinitionError, match="none on the right"):
        marked.join_stream(gen, "key", "inner", between="1 second")
    with pytest.raises(JobDefinitionError, match="needs between="):
        marked.join_stream(marked, "key", "left_outer")
    with pytest.raises(JobDefinitionError, match="lower <= upper"):
        marked.join_stream(marked, "key", "inner", between=("5 seconds", "1 second"))
