"""``read_state`` shows the event-time operators' state as their user sees the operator, from
the checkpoint alone, against plain batch Spark over the same input rows:

- windowed aggregations (tumbling, sliding, session, cumulate; every function): one row per
  window (session) the final watermark left open, the keys, ``window`` and each output over
  the rows merged so far;
- drop_duplicates (the keys it remembers), top_n, last_row and Window Top-N (the kept rows with
  their rank and window), a stream join (the rows each side keeps, whether they matched);
- a checkpoint written before the operators recorded their definition reads as the raw state.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from pyspark.sql import functions as F

from spark_ckpt import read_state
from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
from spark_ckpt.state import max_
from spark_ckpt.streaming import tumbling
from spark_ckpt.streaming.runtime.pipeline_dir import checkpoints_uri
from test_stream_joins import AUCTIONS, BIDS, _data, _streams
from test_windows import SCHEMA, SPECS, _aggs, _context, _events, _normal, _reference, _write

from helpers import LONG_FAULTS, write_batch_files

DELAY_MS = 30_000  # a long delay: several windows of every key are open at the end
BASE_MS = 1_767_225_600_000


def _last_checkpoint(ckpt: str, progress: list[dict]) -> dict:
    """The latest completed checkpoint's metadata; it is the run's last batch's."""
    store = CheckpointStorage(checkpoints_uri(ckpt))
    meta = store.read_metadata(store.completed_ids()[-1])
    assert meta["barrier_batch"] == progress[-1]["batch_id"]
    return meta


# CI reads overlapping windows and merged sessions; tumbling and cumulating windows too with
# SPARK_CKPT_LONG_FAULTS=1
KINDS = list(SPECS) if LONG_FAULTS else ["sliding", "session"]


def test_windowed_aggregations_read_as_their_open_windows(spark, tmp_path):
    """Each kind of window (KINDS) with every function: the windows the final watermark has not
    closed, with the values batch Spark computes over all rows of each window."""
    frames = _events()
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "open_windows")
    keyed = ctx.file_stream("events", source, "parquet", SCHEMA, max_files_per_batch=1) \
        .with_column("event_time", F.timestamp_millis("t_ms")) \
        .with_watermark("event_time", f"{DELAY_MS // 1000} seconds").key_by("key")
    for kind in KINDS:
        keyed.window(SPECS[kind][0]()).agg(name=kind, **_aggs()) \
            .write_parquet(str(tmp_path / "out" / kind), name=kind)
    progress = ctx.process_available(timeout=900)
    everything = pd.concat(frames)
    watermark = int(everything.t_ms.max()) - DELAY_MS
    meta = _last_checkpoint(str(tmp_path / "ckpt"), progress)
    ckpt = str(tmp_path / "ckpt")
    for kind in KINDS:
        assert meta["operators"][kind]["extra"]["applied_watermark_ms"] == watermark, kind
        assert not any(p["state"][kind].get("late_rows") for p in progress), kind
        every = _reference(spark, everything, kind, 2 ** 62)
        expected = every[every.end > watermark].reset_index(drop=True)
        emitted = _normal(spark.read.parquet(str(tmp_path / "out" / kind)).toPandas())
        assert len(expected) >= 3 and len(emitted) >= 3, kind  # some open, some closed
        state = read_state(spark, ckpt, kind)
        assert state.columns == ["key", "window", *_aggs()], kind
        assert state.schema["window"].dataType.simpleString() == \
            "struct<start:timestamp,end:timestamp>", kind
        pd.testing.assert_frame_equal(_normal(state.toPandas()), expected, check_dtype=False,
                                      obj=kind)
        # the emitted windows and the open ones are all of batch Spark's, each once
        assert len(emitted) + len(expected) == len(every), kind


def _bids(batches: int = 4, per_batch: int = 150, seed: int = 5) -> list[pd.DataFrame]:
    """Bids 20 s of event time per batch, shuffled, each time once (but resent bids, which
    repeat a recent bid whole), no row late."""
    rng = np.random.default_rng(seed)
    frames, next_id = [], 0
    for b in range(batches):
        rows: list[dict] = []
        for j in range(per_batch):
            if j % 6 == 5:  # a resend of a recent bid
                rows.append(dict(rows[int(rng.integers(max(0, len(rows) - 20), len(rows)))]))
                continue
            rows.append({"id": next_id, "auction": int(rng.integers(0, 8)),
                         "price": int(rng.integers(0, 1_000)) * 1000 + next_id % 1000,
                         "t_ms": BASE_MS + b * 20_000 + j * 130 + int(rng.integers(0, 100))})
            next_id += 1
        frames.append(pd.DataFrame(rows).sample(frac=1.0, random_state=b)
                      .reset_index(drop=True))
    return frames


BID_SCHEMA = "id BIGINT, auction BIGINT, price BIGINT, t_ms BIGINT"


def test_row_operators_read_as_the_rows_they_keep(spark, tmp_path):
    frames = _bids()
    source = write_batch_files(spark, frames, BID_SCHEMA, tmp_path / "in")
    ctx = _context(spark, tmp_path, "kept_rows")
    bids = ctx.file_stream("bids", source, "parquet", BID_SCHEMA, max_files_per_batch=1) \
        .with_column("event_time", F.timestamp_millis("t_ms")) \
        .with_watermark("event_time", "5 seconds")
    sink = str(tmp_path / "out")
    bids.drop_duplicates("id", within="10 seconds", name="dedup").write_parquet(
        f"{sink}/dedup", name="dedup_out")
    keyed = bids.key_by("auction")
    keyed.top_n(3, [("price", "desc")], name="top3").write_parquet(f"{sink}/top3",
                                                                    name="top3_out")
    keyed.last_row("t_ms", name="last").write_parquet(f"{sink}/last", name="last_out")
    keyed.window(tumbling("10 seconds")).top_n(2, [("price", "desc")], name="wtop") \
        .write_parquet(f"{sink}/wtop", name="wtop_out")
    progress = ctx.process_available(timeout=900)
    ckpt = str(tmp_path / "ckpt")
    everything = pd.concat(frames)
    watermark = int(everything.t_ms.max()) - 5_000
    meta = _last_checkpoint(ckpt, progress)
    assert meta["operators"]["dedup"]["extra"]["applied_watermark_ms"] == watermark
    assert not any(p["state"][op].get("late_rows") for p in progress for op in ("dedup", "wtop"))
    spark.createDataFrame(everything, BID_SCHEMA) \
        .withColumn("event_time", F.timestamp_millis("t_ms")).createOrReplaceTempView("bids")
    columns = ["id", "auction", "price", "t_ms", "event_time"]

    def same(got, sql: str, order: list[str]) -> None:
        want = spark.sql(sql).toPandas()
        assert len(want) >= 3, sql
        got = got.toPandas()
        assert list(got.columns) == list(want.columns)
        pd.testing.assert_frame_equal(got.sort_values(order).reset_index(drop=True),
                                      want.sort_values(order).reset_index(drop=True),
                                      check_dtype=False, obj=sql)

    # the ids still remembered: their first row's time plus `within` is past the watermark
    same(read_state(spark, ckpt, "dedup"),
         f"SELECT id, min(event_time) AS event_time FROM bids GROUP BY id "
         f"HAVING min(t_ms) + 10000 > {watermark}", ["id"])
    ranked = "SELECT {cols}, row_number() OVER (PARTITION BY auction{window} ORDER BY price " \
             "DESC) AS rank FROM bids"
    same(read_state(spark, ckpt, "top3"),
         f"SELECT * FROM ({ranked.format(cols=', '.join(columns), window='')}) WHERE rank <= 3",
         ["auction", "rank"])
    same(read_state(spark, ckpt, "last"),  # times are distinct but for resent bids
         f"SELECT {', '.join(columns)} FROM (SELECT *, row_number() OVER (PARTITION BY "
         "auction ORDER BY t_ms DESC) AS r FROM bids) WHERE r = 1", ["auction"])
    windowed = ranked.format(cols=f"{', '.join(columns)}, window",
                             window=", window") \
        .replace("FROM bids", "FROM (SELECT *, window(event_time, '10 seconds') AS window "
                              "FROM bids)")
    wtop = read_state(spark, ckpt, "wtop")
    assert wtop.schema["window"].dataType.simpleString() == \
        "struct<start:timestamp,end:timestamp>"
    open_windows = f"SELECT * FROM ({windowed}) WHERE rank <= 2 AND " \
                   f"window.end > timestamp_millis({watermark})"
    same(wtop.withColumn("window", F.col("window.start")),
         f"SELECT {', '.join(columns)}, window.start AS window, rank FROM ({open_windows})",
         ["auction", "window", "rank"])
    emitted = spark.read.parquet(f"{sink}/wtop").count()
    assert emitted > 0 and emitted + wtop.count() == spark.sql(
        f"SELECT * FROM ({windowed}) WHERE rank <= 2").count()


def test_a_stream_join_reads_as_the_rows_each_side_keeps(spark, tmp_path):
    """A bid waits for auctions opened up to 20 s before it (between=(-20 s, 0)): at the end
    the join keeps the bids after the watermark and the auctions less than 20 s before it,
    each marked matched when batch Spark's join matches it."""
    auctions, bids = _data()
    ctx = _context(spark, tmp_path, "join_state")
    a, b = _streams(ctx, spark, tmp_path, auctions, bids)
    b.join_stream(a, "auction", "left_outer", between=("-20 seconds", "0 seconds"),
                  name="join").write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=900)
    everything_a, everything_b = pd.concat(auctions), pd.concat(bids)
    watermark = min(int(everything_a.a_ms.max()), int(everything_b.b_ms.max())) - 5_000
    _last_checkpoint(str(tmp_path / "ckpt"), progress)
    assert not any(p["state"]["join"].get("late_rows") for p in progress)
    spark.createDataFrame(everything_a, AUCTIONS).createOrReplaceTempView("auctions")
    spark.createDataFrame(everything_b, BIDS).createOrReplaceTempView("bids")
    match = "a.auction = b.auction AND a.a_ms BETWEEN b.b_ms - 20000 AND b.b_ms"
    want = spark.sql(f"""
        SELECT b.auction, 'left' AS side, bidder, price, b_ms, timestamp_millis(b_ms) AS b_time,
               CAST(NULL AS BIGINT) AS seller, CAST(NULL AS BIGINT) AS a_ms,
               CAST(NULL AS TIMESTAMP) AS a_time,
               EXISTS (SELECT 1 FROM auctions a WHERE {match}) AS matched
          FROM bids b WHERE b.auction IS NOT NULL AND b.b_ms > {watermark}
        UNION ALL
        SELECT a.auction, 'right', NULL, NULL, NULL, NULL, seller, a_ms, timestamp_millis(a_ms),
               EXISTS (SELECT 1 FROM bids b WHERE {match})
          FROM auctions a WHERE a.a_ms + 20000 > {watermark}""").toPandas()
    got = read_state(spark, str(tmp_path / "ckpt"), "join").toPandas()
    assert list(got.columns) == list(want.columns)
    assert (want.side == "left").sum() >= 3 and (want.side == "right").sum() >= 3
    assert want.matched.any() and not want.matched.all()
    order = ["side", "auction", "b_ms", "bidder", "price", "a_ms"]
    pd.testing.assert_frame_equal(
        got.sort_values(order).reset_index(drop=True).astype(object).where(got.notna(), None),
        want.sort_values(order).reset_index(drop=True).astype(object).where(want.notna(), None),
        check_dtype=False)


def test_a_checkpoint_without_the_definition_reads_as_the_raw_state(spark, tmp_path):
    """Checkpoints written before the operators recorded their definition (no ``derived`` in
    the operator's entry) read as today's raw layout: the keys with the window's bounds, the
    state variables."""
    frames = _events(batches=2, per_key=20)
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "legacy")
    ctx.file_stream("events", source, "parquet", SCHEMA, max_files_per_batch=1) \
        .with_column("event_time", F.timestamp_millis("t_ms")) \
        .with_watermark("event_time", "30 seconds").key_by("key") \
        .window(tumbling("10 seconds")).agg(name="windows", **{
            k: v for k, v in _aggs().items() if k in ("n", "avg")}) \
        .write_parquet(str(tmp_path / "out"), name="out")
    ctx.process_available(timeout=600)
    ckpt = str(tmp_path / "ckpt")
    decoded = read_state(spark, ckpt, "windows")
    assert decoded.columns == ["key", "window", "n", "avg"]
    store = CheckpointStorage(checkpoints_uri(ckpt))
    path = tmp_path / "ckpt" / "checkpoints" / \
        f"chk-{store.completed_ids()[-1]:08d}" / "_metadata.json"
    record = json.loads(path.read_text())
    assert record["operators"]["windows"]["derived"]["version"] == 1
    del record["operators"]["windows"]["derived"]
    path.write_text(json.dumps(record))
    raw = read_state(spark, ckpt, "windows")
    assert raw.columns == ["key", "__ckpt_window_start", "__ckpt_window_end", "n",
                           "avg__sum", "avg__count"]
    assert raw.count() == decoded.count() > 0
    # a definition of a newer version than this reader knows: the raw state too
    record["operators"]["windows"]["derived"] = {"version": 99, "operator": "window_agg"}
    path.write_text(json.dumps(record))
    assert read_state(spark, ckpt, "windows").columns == raw.columns


def test_an_open_window_whose_values_are_all_null_is_read(spark, tmp_path):
    """A window whose aggregates are all null so far (only null values seen) is still open: the
    operator emits it, with nulls, when it closes, so read_state shows it, as batch Spark
    computes it. Its state row has only the window's timer and no non-null variable."""
    rows = [{"key": k, "t_ms": BASE_MS + t, "value": None if k == 0 else float(t),
             "label": None} for k in (0, 1) for t in (1_000, 2_000, 12_000, 13_000)]
    frames = [pd.DataFrame(rows[:2] + rows[4:6]), pd.DataFrame(rows[2:4] + rows[6:8])]
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "null_windows")
    ctx.file_stream("events", source, "parquet", SCHEMA, max_files_per_batch=1) \
        .with_column("event_time", F.timestamp_millis("t_ms")) \
        .with_watermark("event_time", f"{DELAY_MS // 1000} seconds").key_by("key") \
        .window(tumbling("10 seconds")).agg(name="windows", high=max_("value")) \
        .write_parquet(str(tmp_path / "out"), name="out")
    ctx.process_available(timeout=600)
    state = read_state(spark, str(tmp_path / "ckpt"), "windows")
    df = spark.createDataFrame(pd.concat(frames), SCHEMA) \
        .withColumn("event_time", F.timestamp_millis("t_ms"))
    expected = _normal(df.groupBy("key", F.window("event_time", "10 seconds").alias("window"))
                       .agg(F.max("value").alias("high")).toPandas())
    assert len(expected) == 4 and expected.high.isna().sum() == 2  # key 0's windows
    got = _normal(state.toPandas())
    pd.testing.assert_frame_equal(got.astype(object).where(got.notna(), None),
                                  expected.astype(object).where(expected.notna(), None),
                                  check_dtype=False)
    # and with no delay, the second batch's watermark closes the first windows: the operator
    # emits key 0's with a null maximum, as batch Spark has it
    closing = _context(spark, tmp_path / "closing", "null_windows_closing")
    closing.file_stream("events", source, "parquet", SCHEMA, max_files_per_batch=1) \
        .with_column("event_time", F.timestamp_millis("t_ms")) \
        .with_watermark("event_time", "0 seconds").key_by("key") \
        .window(tumbling("10 seconds")).agg(name="windows", high=max_("value")) \
        .write_parquet(str(tmp_path / "closed"), name="out")
    closing.process_available(timeout=600)
    emitted = _normal(spark.read.parquet(str(tmp_path / "closed")).toPandas())
    first = expected[expected.end <= BASE_MS + 13_000].reset_index(drop=True)
    assert len(first) == 2
    pd.testing.assert_frame_equal(emitted.astype(object).where(emitted.notna(), None),
                                  first.astype(object).where(first.notna(), None),
                                  check_dtype=False)
    # the closed windows' deletions are in the changelog, not yet in a snapshot: read_state
    # shows only the two still open, key 0's with its null maximum
    still_open = _normal(read_state(spark, str(tmp_path / "closing" / "ckpt"), "windows")
                         .toPandas())
    rest = expected[expected.end > BASE_MS + 13_000].reset_index(drop=True)
    assert len(rest) == 2 and rest.high.isna().sum() == 1
    pd.testing.assert_frame_equal(still_open.astype(object).where(still_open.notna(), None),
                                  rest.astype(object).where(rest.notna(), None),
                                  check_dtype=False)
