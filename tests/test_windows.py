"""Event-time windowed aggregations (issue 35, item 2): ``key_by(...).window(...).agg(...)``
gives Spark's answer.

- Each kind of window (tumbling, sliding, session, cumulate) with every aggregate function,
  over rows out of order within and across batches, against batch Spark's ``window()`` /
  ``session_window()`` over all rows (cumulate windows: against an independent pandas
  computation), for the windows the final watermark closes.
- Update mode: the last update of each window is its final value.
- Late rows: dropped and counted, the rest equal batch Spark's over the rows kept.
- The same query in Structured Streaming, batch by batch, gives the same windows.
- A driver SIGKILLed mid-run and restarted emits every window exactly once.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from spark_ckpt import StreamingContext
from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.options import Settings
from spark_ckpt.state import (
    approx_count_distinct,
    collect_list,
    collect_set,
    count,
    count_distinct,
    first,
    last,
    max_,
    mean,
    min_,
    percentile,
    sum_,
)
from spark_ckpt.streaming import cumulate, session, sliding, tumbling
from helpers import write_batch_files, LONG_FAULTS, ROOT, child_env

DELAY_MS = 3_000
BASE_MS = 1_767_225_600_000  # 2026-01-01
SCHEMA = "key BIGINT, t_ms BIGINT, value DOUBLE, label STRING"
SCHEMA_COLUMNS = ["key", "t_ms", "value", "label"]

SPECS = {
    "tumbling": (lambda: tumbling("10 seconds"), lambda c: F.window(c, "10 seconds")),
    "sliding": (lambda: sliding("10 seconds", "4 seconds"),
                lambda c: F.window(c, "10 seconds", "4 seconds")),
    "session": (lambda: session("2 seconds"), lambda c: F.session_window(c, "2 seconds")),
    "cumulate": (lambda: cumulate("5 seconds", "20 seconds"), None),
}


def _aggs() -> dict:
    return dict(n=count(), nv=count("value"), total=sum_("value"), low=min_("value"),
                high=max_("value"), avg=mean("value"), lo_label=min_("label"),
                first_v=first("value", "event_time"), last_v=last("value", "event_time"),
                distinct=count_distinct("label"), approx=approx_count_distinct("label"),
                values=collect_list("value"), labels=collect_set("label"),
                p30=percentile("value", 0.3))


def _spark_aggs() -> list:
    return [F.count(F.lit(1)).alias("n"), F.count("value").alias("nv"),
            F.sum("value").alias("total"), F.min("value").alias("low"),
            F.max("value").alias("high"), F.avg("value").alias("avg"),
            F.min("label").alias("lo_label"),
            F.min_by("value", "event_time").alias("first_v"),
            F.max_by("value", "event_time").alias("last_v"),
            F.count_distinct("label").alias("distinct"),
            F.approx_count_distinct("label").alias("approx"),
            F.collect_list("value").alias("values"), F.collect_set("label").alias("labels"),
            F.percentile("value", F.lit(0.3)).alias("p30")]


def _events(batches: int = 4, per_key: int = 40, keys: int = 3, seed: int = 7,
            late: int = 0) -> list[pd.DataFrame]:
    """Per key, times that advance by 0–2.6 s (so sessions of a 2-second gap break, some
    exactly at the gap); batches cut in event-time order, each shuffled, and rows of the last
    1.5 s before a cut moved to the next batch half the time (out of order across batches,
    never later than the delay); with ``late``, that many rows per batch after the first come
    100 s behind (late from the third batch on: two batches' event time)."""
    rng = np.random.default_rng(seed)
    rows = []
    for key in range(keys):
        t = BASE_MS + int(rng.integers(0, 2000))
        for i in range(per_key * batches):
            t += int(rng.choice([0, 1, 150, 400, 900, 2_000, 2_600]))
            value = None if i % 17 == 5 else float(rng.integers(0, 50))
            label = None if i % 13 == 3 else f"l{int(rng.integers(0, 8))}"
            rows.append({"key": key, "t_ms": t + key, "value": value, "label": label})
    frame = pd.DataFrame(rows).drop_duplicates(["key", "t_ms"]).sort_values("t_ms")
    frame["batch"] = np.arange(len(frame)) * batches // len(frame)
    cuts = frame.groupby("batch").t_ms.max()
    for b in range(batches - 1):
        near = (frame.batch == b) & (frame.t_ms > cuts[b] - 1_500) & \
            (rng.random(len(frame)) < 0.5)
        frame.loc[near, "batch"] = b + 1
    frames = []
    for b in range(batches):
        part = frame[frame.batch == b].drop(columns="batch")
        if b and late:
            extra = part.sample(late, random_state=b)
            extra = extra.assign(t_ms=extra.t_ms - 100_000 - b)
            part = pd.concat([part, extra])
        frames.append(part.sample(frac=1.0, random_state=b).reset_index(drop=True))
    return frames


def _write(spark, frames: list[pd.DataFrame], source) -> str:
    return write_batch_files(spark, frames, SCHEMA, source)


def _context(spark, tmp_path, name: str) -> StreamingContext:
    return StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), name, settings=Settings(
        checkpoint_interval_ms=0, state_parallelism=2, progress="never"))


def _input(ctx: StreamingContext, source: str):
    return ctx.file_stream("events", source, "parquet", SCHEMA, max_files_per_batch=1) \
        .with_column("event_time", F.timestamp_millis("t_ms")) \
        .with_watermark("event_time", "3 seconds")


def _normal(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows comparable across engines: window as (start, end) ms, lists sorted, sorted rows."""
    out = frame.copy()
    out["start"] = out["window"].map(lambda w: pd.Timestamp(w["start"]).value // 1_000_000)
    out["end"] = out["window"].map(lambda w: pd.Timestamp(w["end"]).value // 1_000_000)
    out = out.drop(columns="window")
    for col in ("values", "labels"):
        if col in out:
            out[col] = out[col].map(lambda v: tuple(sorted(x for x in v)) if v is not None
                                    else ())
    for col in ("total", "avg", "p30"):
        if col in out:
            out[col] = out[col].astype(float).round(9)
    cols = ["key", "start", "end", *[c for c in out.columns if c not in ("key", "start", "end")]]
    return out[cols].sort_values(["key", "start", "end"]).reset_index(drop=True)


def _reference(spark, rows: pd.DataFrame, kind: str, watermark_ms: int) -> pd.DataFrame:
    """Batch Spark over ``rows``: the windows that end at or before ``watermark_ms``."""
    df = spark.createDataFrame(rows, SCHEMA).withColumn("event_time",
                                                        F.timestamp_millis("t_ms"))
    window_of = SPECS[kind][1]
    if window_of is None:  # cumulate: every window of the row's 20-second period ending after
        # it, assigned here in Python row by row (not as the implementation does)
        size, step, assigned = 20_000, 5_000, []
        for row in rows.to_dict("records"):
            base = row["t_ms"] // size * size
            assigned += [{**row, "w_start": base, "w_end": base + k * step}
                         for k in range(1, size // step + 1) if base + k * step > row["t_ms"]]
        df = spark.createDataFrame(pd.DataFrame(assigned),
                                   f"{SCHEMA}, w_start BIGINT, w_end BIGINT") \
            .withColumn("event_time", F.timestamp_millis("t_ms")) \
            .withColumn("window", F.struct(F.timestamp_millis("w_start").alias("start"),
                                           F.timestamp_millis("w_end").alias("end")))
        grouped = df.groupBy("key", "window")
    else:
        grouped = df.groupBy("key", window_of("event_time").alias("window"))
    out = _normal(grouped.agg(*_spark_aggs()).toPandas())
    # filtered here, not in Spark: Spark pushes a filter on session_window's end below the
    # merging of sessions, and then merges only the rows that pass it (found by this test)
    return out[out.end <= watermark_ms].reset_index(drop=True)


def test_every_window_kind_and_function_equals_batch_spark(spark, tmp_path):
    """The four kinds in one pipeline (one run), each with every function."""
    frames = _events()
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "kinds")
    keyed = _input(ctx, source).key_by("key")
    for kind in SPECS:
        keyed.window(SPECS[kind][0]()).agg(name=kind, **_aggs()) \
            .write_parquet(str(tmp_path / "out" / kind), name=kind)
    progress = ctx.process_available(timeout=900)
    assert [p["num_input_rows"] for p in progress] == [len(f) for f in frames] + [0]
    everything = pd.concat(frames)
    for kind in SPECS:
        expected = _reference(spark, everything, kind, int(everything.t_ms.max()) - DELAY_MS)
        got = _normal(spark.read.parquet(str(tmp_path / "out" / kind)).toPandas())
        assert len(expected) >= 6, kind
        assert not any(p["state"][kind].get("late_rows") for p in progress), kind
        pd.testing.assert_frame_equal(got, expected, check_dtype=False, obj=kind)


def test_windows_over_two_inputs_with_watermarks_of_their_own_equal_batch_spark(spark,
                                                                                tmp_path):
    """Two sources into one windowed aggregation (a keyed union), each declaring its own
    watermark with an idle timeout (so each input's partitions are kept apart): a window's
    partials of both inputs merge into one, every function; the windows the smaller input's
    final watermark closes equal batch Spark's over the rows of both."""
    a, b = _events(seed=7), _events(seed=8)
    # no key at the same time in both (first/last of a tie are any of the tied rows, in
    # Spark as here: min_by keeps whichever row its aggregation met first)
    taken = set(map(tuple, pd.concat(a)[["key", "t_ms"]].values.tolist()))
    b = [f[[(k, t) not in taken for k, t in zip(f.key, f.t_ms, strict=True)]].reset_index(
        drop=True) for f in b]
    ctx = _context(spark, tmp_path, "two-inputs")

    def read(name: str, frames) -> object:
        return ctx.file_stream(name, _write(spark, frames, tmp_path / name), "parquet", SCHEMA,
                               max_files_per_batch=1) \
            .with_column("event_time", F.timestamp_millis("t_ms")) \
            .with_watermark("event_time", "3 seconds", idle_timeout="1 hour")

    keyed = read("a", a).key_by("key").union(read("b", b).key_by("key"))
    for kind in ("tumbling", "session"):
        keyed.window(SPECS[kind][0]()).agg(name=kind, **_aggs()) \
            .write_parquet(str(tmp_path / "out" / kind), name=kind)
    progress = ctx.process_available(timeout=900)
    final = min(int(pd.concat(a).t_ms.max()), int(pd.concat(b).t_ms.max())) - DELAY_MS
    assert progress[-1]["state"]["tumbling"]["watermark_ms"] == final
    for kind in ("tumbling", "session"):
        expected = _reference(spark, pd.concat(a + b), kind, final)
        got = _normal(spark.read.parquet(str(tmp_path / "out" / kind)).toPandas())
        assert len(expected) >= 6, kind
        assert not any(p["state"][kind].get("late_rows") for p in progress), kind
        pd.testing.assert_frame_equal(got, expected, check_dtype=False, obj=kind)


@pytest.mark.parametrize("kind", ["tumbling", "session"])
def test_update_mode_ends_each_window_with_its_final_value(spark, tmp_path, kind):
    frames = _events()
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, f"{kind}_update")
    _input(ctx, source).key_by("key").window(SPECS[kind][0](), output_mode="update") \
        .agg(name=kind, n=count(), high=max_("value")) \
        .foreach_batch(lambda df, b: df.withColumn("batch", F.lit(b))
                       .write.mode("append").parquet(str(tmp_path / "out")), name="out")
    ctx.process_available(timeout=600)
    got = spark.read.parquet(str(tmp_path / "out")).toPandas()
    # windows updated in several batches (a session's bounds grow with it)
    assert len(got) > got.groupby(["key", got.window.map(str)]).ngroups if kind != "session" \
        else got.groupby(["key", got.window.map(lambda w: str(w["start"]))]).size().max() > 1
    last_update = got.sort_values("batch").groupby(
        ["key", got.window.map(str)], as_index=False).tail(1).drop(columns="batch")
    everything = pd.concat(frames)
    expected = _reference(spark, everything, kind, 2 ** 62)[["key", "start", "end", "n", "high"]]
    if kind == "session":
        # a session that later merged with another was emitted under its old bounds, as
        # Structured Streaming's update mode emits it (no retraction): every final session is
        # among the updates, with its final values
        found = expected.merge(_normal(got.drop(columns="batch")), how="left", indicator=True)
        assert (found["_merge"] == "both").all(), found[found["_merge"] != "both"]
        return
    pd.testing.assert_frame_equal(_normal(last_update), expected, check_dtype=False)


def test_late_rows_are_dropped_and_counted(spark, tmp_path):
    """Rows 30 s behind: late where their window ended at or before the watermark the
    previous batch ran with (as Structured Streaming drops them); counted in the progress;
    the windows equal batch Spark's over the rows kept; the late rows themselves, with their
    window, through ``late_rows()`` to a Delta table of their own, each once."""
    frames = _events(late=5)
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "late")
    windows = _input(ctx, source).key_by("key").window(tumbling("10 seconds")) \
        .agg(name="tumbling", **_aggs())
    windows.write_parquet(str(tmp_path / "out"), name="out")
    windows.late_rows().write_delta(str(tmp_path / "late"), name="late")
    progress = ctx.process_available(timeout=600)
    kept, late, tops, dropped = [], 0, [], []
    for b, frame in enumerate(frames):
        # late against the watermark batch b-1 ran with: the newest time before batch b-1
        watermark = max(tops[:b - 1]) - DELAY_MS if b >= 2 else None
        end = (frame.t_ms // 10_000 + 1) * 10_000
        is_late = (end <= watermark) if watermark is not None else np.zeros(len(frame), bool)
        late += int(np.sum(is_late))
        kept.append(frame[~np.asarray(is_late)])
        dropped.append(frame[np.asarray(is_late)])
        tops.append(int(frame.t_ms.max()))
    top = max(tops)
    assert late >= 10
    assert sum(p["state"]["tumbling"].get("late_rows", 0) for p in progress) == late
    everything = pd.concat(kept)
    expected = _reference(spark, everything, "tumbling", top - DELAY_MS)
    got = _normal(spark.read.parquet(str(tmp_path / "out")).toPandas())
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)
    # the late rows: the input's columns and their window, each once
    late_rows = DeltaTable(str(tmp_path / "late")).to_pandas()
    assert sorted(late_rows.columns) == sorted([*SCHEMA_COLUMNS, "event_time", "window"])
    gone = pd.concat(dropped)
    order = ["key", "t_ms"]
    pd.testing.assert_frame_equal(
        late_rows[SCHEMA_COLUMNS].sort_values(order).reset_index(drop=True),
        gone[SCHEMA_COLUMNS].sort_values(order).reset_index(drop=True), check_dtype=False)
    starts = late_rows["window"].map(lambda w: w["start"]).astype("datetime64[us, UTC]")
    assert (starts.astype("int64") // 1000 == late_rows.t_ms // 10_000 * 10_000).all()


def test_structured_streaming_gives_the_same_windows(spark, tmp_path):
    """The same query in Structured Streaming, over the same files one per batch, in append
    mode with the same watermark, late rows among them: the same windows, the same values,
    the same rows dropped as late. (Structured Streaming refuses an exact count of distinct
    values in a streaming aggregation.)"""
    frames = _events(late=5)
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "ours")
    _input(ctx, source).key_by("key").window(tumbling("10 seconds")) \
        .agg(name="tumbling", n=count(), total=sum_("value"), high=max_("value"),
             approx=approx_count_distinct("label")) \
        .write_parquet(str(tmp_path / "ours"), name="out")
    progress = ctx.process_available(timeout=600)
    assert sum(p["state"]["tumbling"].get("late_rows", 0) for p in progress) >= 5
    query = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(source)
             .withColumn("event_time", F.timestamp_millis("t_ms"))
             .withWatermark("event_time", "3 seconds")
             .groupBy("key", F.window("event_time", "10 seconds"))
             .agg(F.count(F.lit(1)).alias("n"), F.sum("value").alias("total"),
                  F.max("value").alias("high"),
                  F.approx_count_distinct("label").alias("approx"))
             .writeStream.format("parquet").outputMode("append")
             .option("checkpointLocation", str(tmp_path / "ss_ckpt"))
             .trigger(availableNow=True).start(str(tmp_path / "ss")))
    query.awaitTermination(600)
    ours = _normal(spark.read.parquet(str(tmp_path / "ours")).toPandas())
    theirs = _normal(spark.read.parquet(str(tmp_path / "ss")).toPandas())
    assert len(theirs) >= 6
    # Structured Streaming's available-now run ends without a no-data batch for the final
    # watermark: it emits the windows the watermark of its last batch closed; ours has them all
    closed = ours.merge(theirs[["key", "start"]], on=["key", "start"])
    pd.testing.assert_frame_equal(closed, theirs, check_dtype=False)


def test_a_window_needs_a_watermark_and_a_timestamp(spark, tmp_path):
    ctx = _context(spark, tmp_path, "refused")
    gen = ctx.generator_stream("gen", rows_per_batch=10, total_rows=30, keys=2)
    with pytest.raises(JobDefinitionError, match="expected a watermark"):
        gen.key_by("key").window(tumbling("10 seconds")).agg(n=count())
    with pytest.raises(JobDefinitionError, match="expected tumbling"):
        gen.with_watermark("event_time", "1 second").key_by("key").window("10 seconds")
    with pytest.raises(JobDefinitionError, match="expected a slide no longer"):
        sliding("1 second", "2 seconds")
    with pytest.raises(JobDefinitionError, match="whole number of steps"):
        cumulate("3 seconds", "10 seconds")


_KILLED = """
import sys
from pyspark.sql import functions as F
from spark_ckpt import StreamingContext, get_or_create_session
from spark_ckpt.options import Settings
from spark_ckpt.state import count, max_, sum_
from spark_ckpt.streaming import session, tumbling
source, ckpt, out = sys.argv[1:4]
spark = get_or_create_session("windows_killed")
ctx = StreamingContext(spark, 0.05, ckpt, "windows_killed", settings=Settings(
    checkpoint_interval_ms=200, state_parallelism=2, progress="never"))
rows = ctx.file_stream("events", source, "parquet", "{schema}", max_files_per_batch=1) \\
    .with_column("event_time", F.timestamp_millis("t_ms")) \\
    .with_watermark("event_time", "3 seconds").key_by("key")
rows.window(tumbling("10 seconds")).agg(name="tumbling", n=count(), high=max_("value")) \\
    .write_delta(out + "/tumbling", name="tumbling")
rows.window(session("2 seconds")).agg(name="session", n=count(), total=sum_("value")) \\
    .write_delta(out + "/session", name="session")
ctx.process_available(timeout=600)
print("DONE", flush=True)
""".replace("{schema}", SCHEMA)


# the default run kills mid-commit of a checkpoint's sinks; SPARK_CKPT_LONG_FAULTS=1 also after
# a batch committed
@pytest.mark.parametrize("fault", ["checkpoint.sink.committed:2",
                                   *(["stream.batch.committed:2"] if LONG_FAULTS else [])])
def test_a_killed_driver_emits_every_window_exactly_once(spark, tmp_path, fault):
    frames = _events()
    source = _write(spark, frames, tmp_path / "in")
    command = [sys.executable, "-c", _KILLED, source, str(tmp_path / "ckpt"),
               str(tmp_path / "out")]
    killed = subprocess.run(command, env=child_env(fault), cwd=ROOT, capture_output=True,
                            text=True, timeout=600, start_new_session=True)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]
    done = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-3000:]
    everything = pd.concat(frames)
    watermark = int(everything.t_ms.max()) - DELAY_MS
    for kind, cols in (("tumbling", ["n", "high"]), ("session", ["n", "total"])):
        got = _normal(DeltaTable(str(tmp_path / "out" / kind)).to_pandas())
        expected = _reference(spark, everything, kind, watermark)[["key", "start", "end",
                                                                   *cols]]
        pd.testing.assert_frame_equal(got, expected, check_dtype=False)


def test_windows_rescale_and_restore_by_id_as_if_uninterrupted(spark, tmp_path):
    """Two batches on 2 tasks, two more after a restart on 4, then a restore of the first
    checkpoint on 3 that replays the rest: the Delta outputs hold every window once, as batch
    Spark's (session state moves between ranges with its key; a tumbling window's with its
    (key, window))."""
    import shutil

    frames = _events()
    staged = _write(spark, frames, tmp_path / "staged")
    source = tmp_path / "in"
    source.mkdir()

    def run(parallelism: int, restore: int | None = None) -> StreamingContext:
        ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "rescaled",
                               settings=Settings(checkpoint_interval_ms=200,
                                                 state_parallelism=parallelism,
                                                 checkpoint_retained=10, progress="never"))
        keyed = _input(ctx, str(source)).key_by("key")
        keyed.window(tumbling("10 seconds")).agg(name="tumbling", n=count(), high=max_("value")) \
            .write_delta(str(tmp_path / "out" / "tumbling"), name="tumbling")
        keyed.window(session("2 seconds")).agg(name="session", n=count(), total=sum_("value")) \
            .write_delta(str(tmp_path / "out" / "session"), name="session")
        ctx.process_available(timeout=600, restore_checkpoint=restore)
        return ctx

    for n in (0, 1):
        shutil.copy(f"{staged}/part-{n:02d}.parquet", source)
    first = run(2)
    early = [c["checkpoint_id"] for c in first.recent_checkpoints
             if c["status"] == "completed"][0]
    for n in (2, 3):
        shutil.copy(f"{staged}/part-{n:02d}.parquet", source)
    run(4)
    run(3, restore=early)
    everything = pd.concat(frames)
    watermark = int(everything.t_ms.max()) - DELAY_MS
    for kind, cols in (("tumbling", ["n", "high"]), ("session", ["n", "total"])):
        got = _normal(DeltaTable(str(tmp_path / "out" / kind)).to_pandas())
        expected = _reference(spark, everything, kind, watermark)[["key", "start", "end",
                                                                   *cols]]
        pd.testing.assert_frame_equal(got, expected, check_dtype=False, obj=kind)


def test_a_restart_that_changes_an_outputs_function_is_refused(spark, tmp_path):
    """``n=count()`` restarted as ``n=sum_("t_ms")`` (a BIGINT state either way, so the
    state's types cannot tell): the state holds counts, which a sum would merge into (and
    read_state would show as sums); refused by name before anything runs. An output added
    beside the kept ones is state evolution: allowed."""
    from spark_ckpt.errors import StateSchemaError

    frames = _events(batches=2)
    source = _write(spark, frames, tmp_path / "in")

    def run(**aggs) -> None:
        ctx = _context(spark, tmp_path, "changed")
        _input(ctx, source).key_by("key").window(tumbling("10 seconds")) \
            .agg(name="w", **aggs).write_parquet(str(tmp_path / "out"), name="out")
        ctx.process_available(timeout=600)

    run(n=count())
    with pytest.raises(StateSchemaError, match=r"outputs \['n'\].*cannot change"):
        run(n=sum_("t_ms"))
    run(n=count(), high=max_("value"))


def test_windows_chain_and_the_watermark_flows_through(spark, tmp_path):
    """A windowed aggregation into another (Structured Streaming's chained aggregation over
    window_time()): counts per key and 10-second window, then the largest count of each
    window. The second declares no watermark: it runs with the first's, so in the batch the
    first closes a window the second closes it too. Equals batch Spark's two nested
    aggregations over the windows the final watermark closes."""
    frames = _events()
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, "chained")
    counts = _input(ctx, source).key_by("key").window(tumbling("10 seconds")) \
        .agg(name="counts", n=count())
    counts.with_column("window_time", F.window_time("window")).with_column("all", F.lit(1)) \
        .key_by("all").window(tumbling("10 seconds", on="window_time")) \
        .agg(name="busiest", most=max_("n")) \
        .write_parquet(str(tmp_path / "out"), name="out")
    ctx.process_available(timeout=600)
    everything = spark.createDataFrame(pd.concat(frames), SCHEMA) \
        .withColumn("event_time", F.timestamp_millis("t_ms"))
    watermark = int(pd.concat(frames).t_ms.max()) - DELAY_MS
    expected = (everything.groupBy("key", F.window("event_time", "10 seconds"))
                .agg(F.count(F.lit(1)).alias("n"))
                .where(F.unix_millis(F.col("window.end")) <= watermark)
                .groupBy("window").agg(F.max("n").alias("most")).toPandas())
    got = spark.read.parquet(str(tmp_path / "out")).toPandas()
    assert len(expected) >= 10
    key = lambda f: f.assign(start=f.window.map(lambda w: w["start"]))[["start", "most"]] \
        .sort_values("start").reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(key(got), key(expected), check_dtype=False)


def _add_file(spark, source, staging, n: int, bidders: list[int]) -> None:
    """One more input file (``part-NN``), moved into the watched directory whole."""
    frame = pd.DataFrame({"key": bidders, "t_ms": [0] * len(bidders),
                          "value": [1.0] * len(bidders), "label": ["x"] * len(bidders)})
    spark.createDataFrame(frame, SCHEMA).coalesce(1).write.parquet(str(staging / f"f{n}"))
    (part,) = (staging / f"f{n}").glob("*.parquet")
    part.rename(source / f"part-{n:02d}.parquet")


def test_processing_time_windows_fire_on_the_clock_without_data_and_never_reopen(spark,
                                                                               tmp_path):
    """Flink's TUMBLE(PROCTIME(), ...) (Nexmark q12) on the pipeline's injected clock: a row's
    time is its batch's time; a window is emitted once, in the first batch at or after its
    end, also a batch without data the clock alone makes due. A restart whose clock reads
    earlier keeps the time it had (a window it closed stays closed, the rows go on counting
    in the open one), and the windows' state comes back from the checkpoint."""
    from spark_ckpt.clock import ManualClock
    from helpers import wait_for

    t0 = BASE_MS  # on a 10-second boundary
    source, staging = tmp_path / "in", tmp_path / "staging"
    source.mkdir()
    staging.mkdir()

    def run(clock: ManualClock) -> StreamingContext:
        ctx = StreamingContext(spark, 5.0, str(tmp_path / "ckpt"), "proctime", clock=clock,
                               settings=Settings(checkpoint_interval_ms=0, state_parallelism=2,
                                                 progress="never",
                                                 stream_skip_empty_batches=True))
        ctx.file_stream("events", str(source), "parquet", SCHEMA) \
            .key_by("key").window(tumbling("10 seconds", processing_time=True)) \
            .agg(name="q12", n=count()) \
            .select("key", "n", F.unix_millis("window.start").alias("start_ms"),
                    F.unix_millis("window.end").alias("end_ms")) \
            .write_parquet(str(tmp_path / "out"), name="out")
        ctx.start()
        return ctx

    def batches(ctx) -> list[tuple[int, int]]:  # (batch time, input rows) of each batch run
        return [(p["batch_time_ms"], p["num_input_rows"]) for p in ctx.recent_progress]

    def emitted() -> list[tuple]:
        if not (tmp_path / "out").exists():
            return []
        frame = spark.read.schema("key BIGINT, n BIGINT, start_ms BIGINT, end_ms BIGINT") \
            .parquet(str(tmp_path / "out")).toPandas()
        return sorted(map(tuple, frame[["key", "n", "start_ms", "end_ms"]].values.tolist()))

    def tick(ctx, clock: ManualClock, ms: int, expected: list[tuple[int, int]]) -> None:
        clock.advance(ms)
        assert wait_for(lambda: batches(ctx) == expected, 120), batches(ctx)

    _add_file(spark, source, staging, 0, [1, 1, 1, 2, 2])
    clock = ManualClock(start_ms=t0)
    ctx = run(clock)
    assert wait_for(lambda: batches(ctx) == [(t0, 5)], 120), batches(ctx)
    _add_file(spark, source, staging, 1, [1, 3])
    tick(ctx, clock, 5_000, [(t0, 5), (t0 + 5_000, 2)])
    # no data (empty batches skipped): the clock passing the window's end runs a batch
    tick(ctx, clock, 5_000, [(t0, 5), (t0 + 5_000, 2), (t0 + 10_000, 0)])
    closed = ctx.last_progress["state"]["q12"]  # (visible at the checkpoint on stop)
    assert closed["timers_fired"] == 3 and closed["state_rows"] == 0, closed
    window0 = [(1, 4, t0, t0 + 10_000), (2, 2, t0, t0 + 10_000), (3, 1, t0, t0 + 10_000)]
    clock.advance(10_000)  # nothing open, nothing new: no batch
    assert not wait_for(lambda: len(batches(ctx)) > 3, 3), batches(ctx)
    _add_file(spark, source, staging, 2, [2, 2, 3])
    clock.advance(5_000)
    assert wait_for(lambda: len(batches(ctx)) == 4, 120), batches(ctx)
    assert batches(ctx)[3] == (t0 + 25_000, 3)
    ctx.stop()
    assert emitted() == window0

    # a restart on a clock that reads earlier than the last batch's time: rows keep the
    # operator's time (t0+25s, window [t0+20s, t0+30s) still open) until the clock passes it
    _add_file(spark, source, staging, 3, [3, 4])
    clock = ManualClock(start_ms=t0 + 1_000)
    ctx = run(clock)
    assert wait_for(lambda: [n for _t, n in batches(ctx)] == [2], 120), batches(ctx)
    assert ctx.last_progress["state"]["q12"]["watermark_ms"] == t0 + 25_000
    clock.advance(25_000)  # t0+26s: before the window's end, nothing due
    assert not wait_for(lambda: len(batches(ctx)) > 1, 3), batches(ctx)
    clock.advance(5_000)  # t0+31s: the next tick after the window's end
    assert wait_for(lambda: len(batches(ctx)) == 2, 120), batches(ctx)
    ctx.stop()
    window2 = [(2, 2, t0 + 20_000, t0 + 30_000), (3, 2, t0 + 20_000, t0 + 30_000),
               (4, 1, t0 + 20_000, t0 + 30_000)]
    assert emitted() == sorted(window0 + window2)


def test_processing_time_windows_take_no_time_column():
    with pytest.raises(JobDefinitionError, match="processing-time windows take no time column"):
        tumbling("10 seconds", on="event_time", processing_time=True)


@pytest.mark.parametrize("kind", ["tumbling", "sliding"])
def test_window_top_n_equals_row_number_over_windows_in_batch_spark(spark, tmp_path, kind):
    """Flink's Window Top-N (``ROW_NUMBER() OVER (PARTITION BY window_start, window_end, key
    ORDER BY value DESC, t_ms) <= 3``): each window's top rows once, when the watermark passes
    its end; rows 100 s behind merge while their windows are open and are dropped and counted
    once the watermark passed them; the windows the final watermark closes equal batch
    Spark's over the rows that were on time."""
    frames = _events(late=2)
    source = _write(spark, frames, tmp_path / "in")
    ctx = _context(spark, tmp_path, f"top-{kind}")
    _input(ctx, source).key_by("key").window(SPECS[kind][0]()) \
        .top_n(3, [("value", "desc"), ("t_ms", "asc")], name="top") \
        .select("key", "t_ms", "value", "label", "rank",
                F.unix_millis("window.start").alias("w_start"),
                F.unix_millis("window.end").alias("w_end")) \
        .write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=900)
    late = sum(p["state"]["top"].get("late_rows", 0) for p in progress)
    # the reference drops what Structured Streaming drops: a (row, window) of batch b is late
    # when the window ended at or before the watermark batch b - 1 ran with (the largest time
    # of the batches before it, less the delay)
    marks = [None, None] + [int(pd.concat(frames[:b - 1]).t_ms.max()) - DELAY_MS
                            for b in range(2, len(frames))]
    batched = pd.concat([f.assign(mark=m if m is not None else -1)
                         for f, m in zip(frames, marks, strict=True)])
    watermark = int(batched.t_ms.max()) - DELAY_MS
    w = spark.createDataFrame(batched, f"{SCHEMA}, mark BIGINT") \
        .withColumn("w", SPECS[kind][1](F.timestamp_millis("t_ms")))
    dropped = w.where(F.unix_millis("w.end") <= F.col("mark")).count()
    assert late == dropped and dropped >= len(frames) - 2, (late, dropped)
    rank = F.row_number().over(
        __import__("pyspark.sql.window", fromlist=["Window"]).Window
        .partitionBy("key", "w").orderBy(F.col("value").desc_nulls_last(), "t_ms"))
    expected = w.where(F.unix_millis("w.end") > F.col("mark")) \
        .withColumn("rank", rank).where("rank <= 3") \
        .select("key", "t_ms", "value", "label", "rank",
                F.unix_millis("w.start").alias("w_start"), F.unix_millis("w.end").alias("w_end")) \
        .where(F.col("w_end") <= watermark).toPandas()
    got = spark.read.parquet(str(tmp_path / "out")).toPandas()
    order = ["key", "w_start", "rank"]
    assert len(expected) >= 20 and got.duplicated(order).sum() == 0
    pd.testing.assert_frame_equal(
        got.sort_values(order).reset_index(drop=True)[expected.columns],
        expected.sort_values(order).reset_index(drop=True), check_dtype=False)
