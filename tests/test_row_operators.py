"""Deduplication and Top-N (issue 35, items 4 and 5), against batch Spark.

- ``drop_duplicates(cols, within=...)``: each key's first row by arrival, the key forgotten once
  the watermark passes its first row's event time plus ``within`` (a key seen again after that
  is emitted again), rows at or before the watermark dropped and counted.
- ``top_n``: the upserts by (key, rank) of every batch, applied in order, end as batch Spark's
  ``row_number() OVER (PARTITION BY key ORDER BY ...) <= n``; ``last_row`` as the newest row.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F

from spark_ckpt import StreamingContext
from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.options import Settings
from helpers import write_batch_files

BASE_MS = 1_767_225_600_000
SCHEMA = "id BIGINT, auction BIGINT, price BIGINT, t_ms BIGINT"


def _write(spark, frames: list[pd.DataFrame], source) -> str:
    return write_batch_files(spark, frames, SCHEMA, source)


def _context(spark, tmp_path, name: str) -> StreamingContext:
    return StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), name, settings=Settings(
        checkpoint_interval_ms=0, state_parallelism=2, progress="never"))


def _input(ctx, source: str):
    return ctx.file_stream("bids", source, "parquet", SCHEMA, max_files_per_batch=1) \
        .with_column("event_time", F.timestamp_millis("t_ms")) \
        .with_watermark("event_time", "5 seconds")


def _bids(batches: int = 4, per_batch: int = 200, seed: int = 3) -> list[pd.DataFrame]:
    """Bids 20 s of event time per batch; ids repeat within a few seconds (duplicates), a few
    ids repeat a minute later (past ``within``), a few rows come 30 s late."""
    rng = np.random.default_rng(seed)
    frames, next_id = [], 0
    for b in range(batches):
        rows = []
        for j in range(per_batch):
            t = BASE_MS + b * 20_000 + int(rng.integers(0, 20_000))
            if j % 5 == 0 and rows:  # a duplicate of a recent id, up to 3 s apart
                prev = rows[int(rng.integers(0, len(rows)))]
                rows.append({**prev, "t_ms": prev["t_ms"] + int(rng.integers(0, 3000))})
                continue
            rows.append({"id": next_id, "auction": int(rng.integers(0, 15)),
                         "price": int(rng.integers(0, 1_000_000)) * 1000 + next_id % 1000,
                         "t_ms": t})
            next_id += 1
        if b >= 3:  # ids of batch 0 again, 60 s after them: past within, not late
            old = frames[0].drop_duplicates("id").head(5)
            old = old.assign(t_ms=old.t_ms + 60_000)
            rows += old.to_dict("records")
        if b >= 2:  # 30 s behind: late
            rows += [{**rows[i], "id": 10_000_000 + b * 10 + i, "price": -1 - i,
                      "t_ms": BASE_MS + (b - 2) * 20_000} for i in range(4)]
        frames.append(pd.DataFrame(rows).sample(frac=1.0, random_state=b)
                      .reset_index(drop=True))
    return frames


def test_drop_duplicates_within_keeps_each_ids_first_row_until_the_watermark_passes(spark,
                                                                                     tmp_path):
    frames = _bids()
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "dedup")
    _input(ctx, source).drop_duplicates("id", within="10 seconds", name="dedup") \
        .write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=600)
    # the model: arrival order (batch, row); a batch's watermark = newest earlier - 5 s; late:
    # at or before the previous batch's watermark (as Structured Streaming drops them)
    emitted, remembered, late, tops = [], {}, 0, []
    for b, frame in enumerate(frames):
        watermark = max(tops) - 5_000 if tops else None
        late_mark = max(tops[:b - 1]) - 5_000 if b >= 2 else None  # batch b-1's watermark
        for row in frame.itertuples(index=False):
            if late_mark is not None and row.t_ms <= late_mark:
                late += 1
                continue
            if row.id in remembered:
                continue
            remembered[row.id] = row.t_ms + 10_000
            emitted.append(row._asdict())
        if watermark is not None:
            remembered = {k: v for k, v in remembered.items() if v > watermark}
        tops.append(int(frame.t_ms.max()))
    expected = pd.DataFrame(emitted).sort_values(["id", "t_ms"]).reset_index(drop=True)
    got = spark.read.parquet(str(tmp_path / "out")).drop("event_time").toPandas() \
        .sort_values(["id", "t_ms"]).reset_index(drop=True)
    assert late >= 8 and expected.id.duplicated().sum() == 5  # re-emitted after `within`
    assert sum(p["state"]["dedup"].get("late_rows", 0) for p in progress) == late
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)
    # every id of the input but the late ones, as batch Spark's dropDuplicates has them
    everything = pd.concat(frames)
    batch = spark.createDataFrame(everything, SCHEMA).dropDuplicates(["id"]).count()
    assert got.id.nunique() == batch - len(set(everything.id[everything.id >= 10_000_000]))


def _apply_upserts(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The upsert stream applied in batch order: the last row per key wins."""
    return frame.sort_values("batch", kind="stable").groupby(keys, as_index=False).tail(1) \
        .drop(columns="batch")


def test_top_n_and_last_row_end_as_batch_sparks_row_number(spark, tmp_path):
    frames = _bids()
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "topn")
    keyed = _input(ctx, source).select("id", "auction", "price", "t_ms").key_by("auction")
    keyed.top_n(3, [("price", "desc")], name="top3").foreach_batch(
        lambda df, b: df.withColumn("batch", F.lit(b)).write.mode("append")
        .parquet(str(tmp_path / "top")), name="top")
    keyed.last_row("t_ms", name="last").foreach_batch(
        lambda df, b: df.withColumn("batch", F.lit(b)).write.mode("append")
        .parquet(str(tmp_path / "last")), name="last")
    ctx.process_available(timeout=600)
    everything = spark.createDataFrame(pd.concat(frames), SCHEMA)
    ranked = everything.withColumn("rank", F.row_number().over(
        Window.partitionBy("auction").orderBy(F.col("price").desc())))
    expected = ranked.where("rank <= 3").toPandas().sort_values(["auction", "rank"]) \
        .reset_index(drop=True)
    top = spark.read.parquet(str(tmp_path / "top")).toPandas()
    assert top.batch.nunique() > 1  # updated batch after batch
    got = _apply_upserts(top, ["auction", "rank"]).sort_values(["auction", "rank"]) \
        .reset_index(drop=True)
    cols = ["auction", "rank", "id", "price"]  # a duplicated bid differs only in its time
    pd.testing.assert_frame_equal(got[cols], expected[cols], check_dtype=False)
    newest = everything.withColumn("r", F.row_number().over(
        Window.partitionBy("auction").orderBy(F.col("t_ms").desc(), F.col("id").desc()))) \
        .where("r = 1").drop("r").toPandas()
    last = _apply_upserts(spark.read.parquet(str(tmp_path / "last")).toPandas(), ["auction"])
    cols = ["auction", "t_ms"]  # rows of one auction at the same t_ms: either is the newest
    pd.testing.assert_frame_equal(
        last[cols].sort_values(cols).reset_index(drop=True),
        newest[cols].sort_values(cols).reset_index(drop=True), check_dtype=False)


def test_options_are_checked_when_the_pipeline_is_defined(spark, tmp_path):
    ctx = _context(spark, tmp_path, "refused")
    gen = ctx.generator_stream("gen", rows_per_batch=10, total_rows=30, keys=2)
    with pytest.raises(JobDefinitionError, match="expected a watermark"):
        gen.drop_duplicates("key", within="1 minute")
    with pytest.raises(JobDefinitionError, match="found both"):
        gen.drop_duplicates("key", within="1 minute", ttl="1 hour")
    with pytest.raises(JobDefinitionError, match="expected n >= 1"):
        gen.key_by("key").top_n(0, "value")
    with pytest.raises(JobDefinitionError, match="'asc' | 'desc'"):
        gen.key_by("key").top_n(3, [("value", "down")])
