"""Event time moves without data (issue 35, item 6): a bounded run (``process_available``)
ends with a no-data batch when an event-time operator's watermark moved past the one its
tasks last ran with, so its timers fire and its windows close as far as the final watermark
reaches, as Structured Streaming's no-data batches do. The windows are compared with batch
Spark's over the same rows."""

from __future__ import annotations

import ast
import subprocess
import sys
from datetime import timedelta

import pandas as pd
import pytest
from pyspark.sql import functions as F

from spark_ckpt import KeyedProcessor, StreamingContext
from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.options import Settings
from spark_ckpt.streaming.template.event_time import duration_ms
from helpers import ROOT, child_env

WINDOW_MS = 10_000
DELAY_MS = 3_000
BASE_MS = 1_767_225_600_000  # 2026-01-01


class TumblingMax(KeyedProcessor):
    """A 10-second tumbling window's maximum per key, written by hand with event timers: each
    window's running maximum in map state, emitted once the watermark passes its end."""

    state_schema = "windows MAP<BIGINT, DOUBLE>"

    def process(self, key, rows, ctx):
        windows = ctx.map("windows")
        starts = (rows["t_ms"] // WINDOW_MS) * WINDOW_MS
        for start, value in zip(starts.tolist(), rows["value"].tolist(), strict=True):
            best = windows.get(start)
            if best is None:
                ctx.timers.register_event_time(start + WINDOW_MS)
            windows.put(start, value if best is None else max(best, value))
        return iter(())

    def on_timer(self, key, timer_ms, ctx):
        windows = ctx.map("windows")
        start = timer_ms - WINDOW_MS
        yield (key[0], start, windows.get(start))
        windows.remove(start)


def _events(batches: int = 4, per_batch: int = 60, keys: int = 3) -> list[pd.DataFrame]:
    """Rows out of order within a batch and across batches, never later than the delay."""
    frames, i = [], 0
    for b in range(batches):
        rows = []
        for j in range(per_batch):
            jitter = ((i * 7919) % (DELAY_MS // 2))  # at most 1.5 s behind the trend
            t = BASE_MS + b * 9_000 + j * 150 - jitter
            rows.append({"key": i % keys, "t_ms": t, "value": float((i * 37) % 101)})
            i += 1
        frames.append(pd.DataFrame(rows))
    return frames


@pytest.mark.parametrize("declared", ["process", "with_watermark"])
def test_a_bounded_run_closes_every_window_its_final_watermark_reaches(spark, tmp_path,
                                                                        declared):
    """The event time and delay given to process(), or declared upstream with
    with_watermark (as Structured Streaming's withWatermark)."""
    frames = _events()
    source = _write_inputs(spark, frames, tmp_path / "in")
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "tumbling", settings=Settings(
        checkpoint_interval_ms=0, state_parallelism=2, progress="never"))
    rows = ctx.file_stream("events", source, "parquet",
                           "key BIGINT, t_ms BIGINT, value DOUBLE", max_files_per_batch=1)
    timed = rows.with_column("event_time", F.timestamp_millis("t_ms"))
    if declared == "with_watermark":
        keyed = timed.with_watermark("event_time", "3 seconds").select("*").key_by("key")
        windows = keyed.process(TumblingMax(), "key BIGINT, start_ms BIGINT, max DOUBLE",
                                name="tumbling")
    else:
        windows = timed.key_by("key").process(
            TumblingMax(), "key BIGINT, start_ms BIGINT, max DOUBLE", name="tumbling",
            event_time="event_time", watermark_delay_ms=DELAY_MS)
    windows.write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=300)
    # the data batches, then one no-data batch that moved the watermark to the last data's
    assert [p["num_input_rows"] for p in progress] == [len(f) for f in frames] + [0]
    assert progress[-1]["state"]["tumbling"]["timers_fired"] > 0

    _assert_closed_windows(spark, frames, tmp_path / "out")


def _write_inputs(spark, frames: list[pd.DataFrame], source) -> str:
    source.mkdir()
    for b, frame in enumerate(frames):
        spark.createDataFrame(frame, "key BIGINT, t_ms BIGINT, value DOUBLE") \
            .coalesce(1).write.parquet(str(source / f"b{b:02d}"))
    files = sorted(source.glob("b*/*.parquet"))
    for n, f in enumerate(files):  # one file per batch, in order
        f.rename(source / f"part-{n:02d}.parquet")
    return str(source)


def _assert_closed_windows(spark, frames: list[pd.DataFrame], out) -> None:
    """The output equals batch Spark's windows that the final watermark closes."""
    everything = pd.concat(frames)
    final_watermark = int(everything.t_ms.max()) - DELAY_MS
    expected = (spark.createDataFrame(everything, "key BIGINT, t_ms BIGINT, value DOUBLE")
                .groupBy("key", F.window(F.timestamp_millis("t_ms"), "10 seconds"))
                .agg(F.max("value").alias("max"))
                .select("key", F.unix_millis(F.col("window.start")).alias("start_ms"), "max",
                        F.unix_millis(F.col("window.end")).alias("end_ms"))
                .where(F.col("end_ms") <= final_watermark).drop("end_ms").toPandas())
    got = spark.read.parquet(str(out)).toPandas()
    order = ["key", "start_ms"]
    assert len(expected) >= 6  # windows of every key closed, the test is not vacuous
    pd.testing.assert_frame_equal(got.sort_values(order).reset_index(drop=True),
                                  expected.sort_values(order).reset_index(drop=True),
                                  check_dtype=False)


def test_no_data_batch_is_not_run_without_event_time(spark, tmp_path):
    """A pipeline with no event-time operator ends with its last data batch."""
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "plain", settings=Settings(
        checkpoint_interval_ms=0, state_parallelism=2, progress="never"))
    ctx.generator_stream("gen", rows_per_batch=10, total_rows=30, keys=2) \
        .write_parquet(str(tmp_path / "out"), name="out")
    assert [p["num_input_rows"] for p in ctx.process_available(timeout=300)] == [10, 10, 10]


def test_durations_are_read_as_spark_writes_intervals():
    assert duration_ms("10 seconds", "t") == 10_000
    assert duration_ms("1 minute 30 seconds", "t") == 90_000
    assert duration_ms("INTERVAL 2 hours", "t") == 7_200_000
    assert duration_ms("500 milliseconds", "t") == 500
    assert duration_ms("1.5 seconds", "t") == 1_500
    assert duration_ms(timedelta(minutes=1), "t") == 60_000
    assert duration_ms(250, "t") == 250
    for bad in ("10", "ten seconds", "10 fortnights", "-1 second", True, 1.5):
        with pytest.raises(JobDefinitionError):
            duration_ms(bad, "t")


def test_inputs_declaring_different_watermarks_are_refused(spark, tmp_path):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "mixed", settings=Settings(
        checkpoint_interval_ms=0, progress="never"))
    gen = ctx.generator_stream("gen", rows_per_batch=10, total_rows=30, keys=2)
    a = gen.with_watermark("event_time", "1 second")
    b = gen.with_watermark("event_time", "2 seconds")
    with pytest.raises(JobDefinitionError, match="one event-time declaration"):
        a.union(b).key_by("key").process(TumblingMax(), "key BIGINT, s BIGINT, m DOUBLE",
                                         name="p")
    with pytest.raises(JobDefinitionError, match="declare no watermark"):
        a.union(gen).key_by("key").process(TumblingMax(), "key BIGINT, s BIGINT, m DOUBLE",
                                           name="q")


_RESTARTED = """
import sys
from pyspark.sql import functions as F
from spark_ckpt import StreamingContext, get_or_create_session
from spark_ckpt.options import Settings
from test_event_time import TumblingMax
source, ckpt, out = sys.argv[1:4]
spark = get_or_create_session("restarted")
ctx = StreamingContext(spark, 0.05, ckpt, "restarted", settings=Settings(
    checkpoint_interval_ms=0, state_parallelism=2, progress="never"))
ctx.file_stream("events", source, "parquet", "key BIGINT, t_ms BIGINT, value DOUBLE",
                max_files_per_batch=1) \
    .with_column("event_time", F.timestamp_millis("t_ms")) \
    .with_watermark("event_time", "3 seconds").key_by("key") \
    .process(TumblingMax(), "key BIGINT, start_ms BIGINT, max DOUBLE", name="tumbling") \
    .write_parquet(out, name="out")
print("RESULT", [p["num_input_rows"] for p in ctx.process_available(timeout=300)], flush=True)
"""


def test_a_restart_that_recovers_the_last_batch_still_closes_the_last_windows(spark, tmp_path):
    """The driver dies with the last data batch allocated and not run; the next run recovers
    that batch, waits for it, and only then sees event time moved: its no-data batch closes
    the windows the final watermark reaches (found by review: the recovered batch held no
    slot, and the run could end before it moved event time)."""
    frames = _events()
    source = _write_inputs(spark, frames, tmp_path / "in")
    command = [sys.executable, "-c", _RESTARTED, source, str(tmp_path / "ckpt"),
               str(tmp_path / "out")]
    killed = subprocess.run(command, env=child_env(f"stream.batch.allocated:{len(frames)}"),
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            start_new_session=True)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]
    done = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # the recovered batches (the run's last ones: how many were still uncommitted depends on
    # where the kill fell), then one no-data batch
    rows = ast.literal_eval(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    data = [len(f) for f in frames]
    assert rows[-1] == 0 and 0 not in rows[:-1] and rows[:-1] == data[len(data) - len(rows) + 1:], \
        rows
    _assert_closed_windows(spark, frames, tmp_path / "out")
