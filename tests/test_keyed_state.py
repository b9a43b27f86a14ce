"""Keyed state with checkpoints on a real SparkSession and real Delta tables: results equal the
same computation in plain Spark, across restores, rescaling and failing checkpoints."""

from __future__ import annotations

from spark_ckpt.storage.delta_reader import read_delta
import json
import os
import shutil

import pandas as pd
import pytest
from pyspark.sql import functions as F

from spark_ckpt import (
    CheckpointError,
    KeyedProcessor,
    PipelineFailedError,
    Settings,
    StateTooLargeError,
    StreamingContext,
    read_state,
)
from spark_ckpt.state import count, first, last, max_, mean, min_, sum_

EPOCH_MS = 1_767_225_600_000
BASE = dict(progress="never", checkpoint_interval_ms=1, state_parallelism=3,
            state_max_parallelism=32)


def settings(**kw) -> Settings:
    return Settings(**{**BASE, **kw})


def generated(spark, start: int, end: int, keys: int, seed: int = 42):
    """The generator source's rows, computed by plain Spark."""
    return spark.range(start, end).select(
        "id", F.pmod("id", F.lit(keys)).alias("key"),
        (F.pmod(F.xxhash64("id", F.lit(seed)), F.lit(1_000_000)) / 100.0).alias("value"),
        F.timestamp_millis(F.lit(EPOCH_MS) + F.col("id")).alias("event_time"))


AGGS = dict(n=count(), total=sum_("value"), lo=min_("value"), hi=max_("value"),
            avg=mean("value"), first_v=first("value", "event_time"),
            last_v=last("value", "event_time"))


def expected_aggs(df) -> pd.DataFrame:
    return df.groupBy("key").agg(
        F.count("*").alias("n"), F.sum("value").alias("total"), F.min("value").alias("lo"),
        F.max("value").alias("hi"), F.avg("value").alias("avg"),
        F.min_by("value", "event_time").alias("first_v"),
        F.max_by("value", "event_time").alias("last_v")).toPandas()


def same(got: pd.DataFrame, want: pd.DataFrame, key: str = "key") -> None:
    got = got[list(want.columns)].sort_values(key).reset_index(drop=True)
    want = want.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-9)


def agg_pipeline(spark, tmp_path, *, total: int, name: str = "agg", ckpt: str = "ckpt",
                 parallelism: int | None = None, full: bool = False, **kw):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / ckpt), name, settings=settings(**kw))
    gen = ctx.generator_stream("gen", rows_per_batch=400, total_rows=total, keys=97)
    agg = gen.key_by("key", parallelism=parallelism).agg(name="totals", **AGGS)
    agg.write_delta(str(tmp_path / "totals"), name="totals", merge_keys=["key"])
    agg.write_parquet(str(tmp_path / "updates"), name="updates")
    if full:
        agg.full_state().foreach_batch(
            lambda df, b: df.write.mode("overwrite").parquet(str(tmp_path / "full" / str(b))),
            name="full")
    return ctx, agg


@pytest.mark.parametrize("small_batch_bytes", [1 << 20, 0], ids=["one-task", "task-per-range"])
def test_keyed_aggregates_equal_plain_spark_in_every_view(spark, tmp_path, small_batch_bytes):
    ctx, agg = agg_pipeline(spark, tmp_path, total=2000, full=True,
                            state_small_batch_bytes=small_batch_bytes)
    progress = ctx.process_available(timeout=300)
    assert [p["num_input_rows"] for p in progress] == [400] * 5
    assert {p["state"]["totals"]["single_task"] for p in progress} == {small_batch_bytes > 0}
    want = expected_aggs(generated(spark, 0, 2000, 97))
    same(read_delta(str(tmp_path / "totals")).to_pandas(), want)
    same(agg.state_view().toPandas(), want)
    same(read_state(spark, str(tmp_path / "ckpt"), "totals").toPandas(), want)
    # the full state after every batch (complete mode)
    for b in range(5):
        same(spark.read.parquet(str(tmp_path / "full" / str(b))).toPandas(),
             expected_aggs(generated(spark, 0, 400 * (b + 1), 97)))
    # the update stream: every batch's changed keys with their values after that batch
    updates = spark.read.parquet(str(tmp_path / "updates")).toPandas()
    assert len(updates) == sum(p["state"]["totals"]["changed_keys"] for p in progress)
    latest = updates.sort_values("n").groupby("key").tail(1)
    same(latest, want)
    stats = ctx.recent_checkpoints[-1]
    assert stats["status"] == "completed" and stats["barrier_batch"] == 4
    assert set(stats["operators"]) == {"totals"}
    assert progress[-1]["checkpoint"]["status"] == "completed"
    # the command line shows the same history and the latest checkpoint
    from click.testing import CliRunner

    from spark_ckpt.ops.cli import main

    listed = CliRunner().invoke(main, ["checkpoints", "list", str(tmp_path / "ckpt"), "--json"])
    assert listed.exit_code == 0, listed.output
    history = [json.loads(line) for line in listed.output.splitlines()]
    assert history[-1]["checkpoint_id"] == stats["checkpoint_id"]
    shown = CliRunner().invoke(main, ["checkpoints", "show", str(tmp_path / "ckpt")],
                               env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert f"Checkpoint {stats['checkpoint_id']}" in shown.output and "totals" in shown.output


class Sessionize(KeyedProcessor):
    """Counts rows per key (value state), keeps the last three ids (list state), counts parity
    (map state); an event-time timer 50 ms after the key's first event closes the key."""

    state_schema = "n BIGINT, recent ARRAY<BIGINT>, parity MAP<STRING, BIGINT>"

    def process(self, key, rows, ctx):
        n = ctx.value("n")
        count_ = (n.get() or 0) + len(rows)
        n.update(count_)
        recent = ctx.list("recent")
        recent.put((recent.get() + sorted(rows["id"].tolist()))[-3:])
        parity = ctx.map("parity")
        for i in rows["id"]:
            p = "even" if i % 2 == 0 else "odd"
            parity.put(p, parity.get(p, 0) + 1)
        if not ctx.timers.list():
            first_ms = int(rows["event_time"].min().astype("datetime64[ms]").astype("int64"))
            ctx.timers.register_event_time(first_ms + 50)
        yield (key[0], "rows", count_, json.dumps(recent.get()), parity.get("even", 0))

    def on_timer(self, key, timer_ms, ctx):
        total = ctx.value("n").get()
        ctx.clear()
        yield (key[0], "closed", total, "[]", timer_ms)


def test_processor_value_list_map_state_and_event_time_timers(spark, tmp_path):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "sess", settings=settings())
    gen = ctx.generator_stream("gen", rows_per_batch=40, total_rows=200, keys=4)
    out = gen.key_by("key").process(Sessionize(), "key BIGINT, kind STRING, n BIGINT, "
                                    "recent STRING, extra BIGINT", name="sess",
                                    event_time="event_time", watermark_delay_ms=0)
    out.write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=300)
    rows = spark.read.parquet(str(tmp_path / "out")).toPandas()
    # simulate: batch b has ids [40b, 40b+40); event time = epoch + id ms; watermark = max
    # event time of the earlier batches
    expect = []
    state: dict[int, dict] = {}
    watermark = None
    for b in range(5):
        ids = list(range(40 * b, 40 * b + 40))
        for k in range(4):
            mine = [i for i in ids if i % 4 == k]
            s = state.setdefault(k, {"n": 0, "recent": [], "even": 0, "timer": None})
            s["n"] += len(mine)
            s["recent"] = (s["recent"] + mine)[-3:]
            s["even"] += sum(1 for i in mine if i % 2 == 0)
            if s["timer"] is None:
                s["timer"] = EPOCH_MS + min(mine) + 50
            expect.append((k, "rows", s["n"], json.dumps(s["recent"]), s["even"]))
        top = max(ids)
        for k in range(4):  # timers fire after data, up to the watermark of earlier batches
            s = state[k]
            if watermark is not None and s["timer"] is not None and s["timer"] <= watermark:
                expect.append((k, "closed", s["n"], "[]", s["timer"]))
                state[k] = {"n": 0, "recent": [], "even": 0, "timer": None}
        watermark = EPOCH_MS + top
    for k in range(4):  # a no-data batch after the last: the timers the final watermark reached
        s = state[k]
        if s["timer"] is not None and s["timer"] <= watermark:
            expect.append((k, "closed", s["n"], "[]", s["timer"]))
            state[k] = {"n": 0, "recent": [], "even": 0, "timer": None}
    assert [p["num_input_rows"] for p in progress] == [40] * 5 + [0]
    got = sorted(map(tuple, rows[["key", "kind", "n", "recent", "extra"]].values.tolist()))
    assert got == sorted(expect)
    assert sum(p["state"]["sess"]["timers_fired"] for p in progress) == \
        sum(1 for e in expect if e[1] == "closed")
    state_rows = read_state(spark, str(tmp_path / "ckpt"), "sess").toPandas()
    assert list(state_rows.columns) == ["key", "n", "recent", "parity"]
    assert sorted(state_rows.key) == sorted(k for k in range(4) if state[k]["n"])
    assert all(n > 0 for n in state_rows.n)


class Counter(KeyedProcessor):
    state_schema = "n BIGINT"

    def process(self, key, rows, ctx):
        n = ctx.value("n")
        n.update((n.get() or 0) + len(rows))
        yield (key[0], n.get())


def test_ttl_expires_state_between_batches(spark, tmp_path):
    ctx = StreamingContext(spark, 0.3, str(tmp_path / "ckpt"), "ttl", settings=settings())
    gen = ctx.generator_stream("gen", rows_per_batch=8, total_rows=24, keys=2)
    gen.key_by("key").process(Counter(), "key BIGINT, n BIGINT", ttl_ms=1) \
        .write_parquet(str(tmp_path / "out"), name="out")
    ctx.process_available(timeout=300)
    rows = spark.read.parquet(str(tmp_path / "out")).toPandas()
    assert sorted(rows.n) == [4] * 6  # every batch starts afresh: the state expired


def test_rescale_4_to_2_to_8_gives_the_uninterrupted_result(spark, tmp_path):
    for parallelism, total in ((4, 800), (2, 1600), (8, 2400)):
        ctx, agg = agg_pipeline(spark, tmp_path, total=total, parallelism=parallelism)
        ctx.process_available(timeout=300)
        assert agg.parallelism == parallelism
        same(agg.state_view().toPandas(), expected_aggs(generated(spark, 0, total, 97)))
    want = expected_aggs(generated(spark, 0, 2400, 97))
    same(read_delta(str(tmp_path / "totals")).to_pandas(), want)
    updates = spark.read.parquet(str(tmp_path / "updates")).toPandas()
    same(updates.sort_values("n").groupby("key").tail(1), want)


def test_restore_by_id_replays_from_that_checkpoint(spark, tmp_path):
    ctx, _ = agg_pipeline(spark, tmp_path, total=2000, checkpoint_retained=10)
    ctx.process_available(timeout=300)
    done = [c for c in ctx.recent_checkpoints if c["status"] == "completed"]
    early = next(c for c in done if c["barrier_batch"] == 1)
    ctx2, agg2 = agg_pipeline(spark, tmp_path, total=2000, checkpoint_retained=10)
    progress = ctx2.process_available(timeout=300, restore_checkpoint=early["checkpoint_id"])
    assert ctx2.restored.checkpoint_id == early["checkpoint_id"]
    # the batches after the restored barrier ran again over the same input: same state
    assert [(p["batch_id"], p["recovered"]) for p in progress] == [(2, True), (3, True),
                                                                  (4, True)]
    outputs = [p["outputs"] for p in progress]
    assert all(o == {"skipped": "already visible (committed before a restore)"}
               for p in outputs for o in p.values()), outputs
    same(agg2.state_view().toPandas(), expected_aggs(generated(spark, 0, 2000, 97)))
    # newer checkpoints were abandoned: the next start restores the new history
    assert ctx2.checkpoint_storage.completed_ids()[-1] > done[-1]["checkpoint_id"]
    assert all(c["barrier_batch"] <= 4 for c in ctx2.recent_checkpoints)
    with pytest.raises(CheckpointError, match="expected checkpoint 999"):
        agg_pipeline(spark, tmp_path, total=2000)[0].start(restore_checkpoint=999)

    # the command line marks the abandoned checkpoints, shows one, and validates the rest
    from click.testing import CliRunner

    from spark_ckpt.ops.cli import main

    ckpt = str(tmp_path / "ckpt")
    listed = CliRunner().invoke(main, ["checkpoints", "list", ckpt, "--json"])
    status = {r["checkpoint_id"]: r["status"]
              for r in map(json.loads, listed.output.splitlines())}
    abandoned = [c["checkpoint_id"] for c in done if c["checkpoint_id"] > early["checkpoint_id"]]
    assert abandoned and {status[c] for c in abandoned} == {"abandoned"}, status
    assert status[early["checkpoint_id"]] == "completed"
    shown = CliRunner().invoke(main, ["checkpoints", "show", ckpt, str(abandoned[0])])
    assert shown.exit_code == 0 and f"Checkpoint {abandoned[0]} is abandoned" in shown.output
    missing = CliRunner().invoke(main, ["checkpoints", "show", ckpt, "999"])
    assert missing.exit_code == 1 and "checkpoint 999 in" in missing.output \
        and "is not there" in missing.output and f"{abandoned[0]} (abandoned)" in missing.output
    newest = ctx2.checkpoint_storage.completed_ids()[-1]
    checked = CliRunner().invoke(main, ["validate", ckpt, "--json"])
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.output)["restores"] == newest
    meta = ctx2.checkpoint_storage.read_metadata(newest)
    # the newest changelog: only the newest checkpoint holds it (earlier files are shared)
    victim = max((f for e in meta["operators"].values() for h in e["handles"].values()
                  for f in h["files"]), key=lambda f: f["batch"])["path"]
    os.remove(victim.removeprefix("file://"))
    checked = CliRunner().invoke(main, ["validate", ckpt])
    assert checked.exit_code == 1 and "state file missing" in checked.output
    assert "A restart restores checkpoint" in checked.output


def test_corrupt_latest_checkpoint_falls_back_and_shows_nothing_twice(spark, tmp_path, caplog):
    ctx, _ = agg_pipeline(spark, tmp_path, total=1200)
    ctx.process_available(timeout=300)
    latest = max((tmp_path / "ckpt" / "checkpoints").glob("chk-*/_metadata.json"))
    latest.write_text('{"kind": "checkpoint-metadata", "format_version": 1, "checkpo')
    ctx2, agg2 = agg_pipeline(spark, tmp_path, total=2000)
    ctx2.process_available(timeout=300)
    assert "cannot be restored" in caplog.text and "falling back" in caplog.text
    want = expected_aggs(generated(spark, 0, 2000, 97))
    same(read_delta(str(tmp_path / "totals")).to_pandas(), want)
    updates = spark.read.parquet(str(tmp_path / "updates")).toPandas()
    # each batch's updates are in the append-only output once: 5 batches x 97 keys
    assert len(updates) == 5 * 97
    assert not updates.duplicated(["key", "n"]).any()


@pytest.mark.parametrize("kind", ["delta", "parquet"])
@pytest.mark.parametrize("checkpointing", ["true", "false"])
def test_new_checkpoint_directory_on_an_existing_table_keeps_new_rows(spark, tmp_path, kind,
                                                                      checkpointing):
    def run(ckpt: str, start: int) -> None:
        ctx = StreamingContext(spark, 0.05, str(tmp_path / ckpt), "lineage",
                               settings=settings(checkpoint_enabled=checkpointing))
        gen = ctx.generator_stream("gen", rows_per_batch=10, total_rows=30, keys=3)
        shifted = gen.with_column("id", F.col("id") + start)
        if kind == "delta":
            shifted.write_delta(str(tmp_path / "table"), name="out")
        else:
            shifted.write_parquet(str(tmp_path / "table"), name="out")
        ctx.process_available(timeout=300)

    run("ckpt-a", 0)
    run("ckpt-b", 1000)  # a new checkpoint directory, the same table and output name
    if kind == "delta":
        ids = read_delta(str(tmp_path / "table")).to_pandas().id
    else:
        ids = spark.read.parquet(str(tmp_path / "table")).toPandas().id
    assert sorted(ids) == list(range(30)) + list(range(1000, 1030))


def test_memory_backend_fails_clearly_past_its_limit_and_rocksdb_takes_it(spark, tmp_path):
    ctx, _ = agg_pipeline(spark, tmp_path, total=800, state_memory_max_rows=20)
    with pytest.raises(PipelineFailedError) as info:
        ctx.process_available(timeout=300)
    assert "memoryMaxRows=20" in str(info.value) and "rocksdb" in str(info.value)
    assert StateTooLargeError.__name__ in str(info.value)
    shutil.rmtree(tmp_path)
    ctx, agg = agg_pipeline(spark, tmp_path, total=1600, state_memory_max_rows=20,
                            state_backend="rocksdb", state_local_dir=str(tmp_path / "local"))
    ctx.process_available(timeout=300)
    want = expected_aggs(generated(spark, 0, 1600, 97))
    same(read_delta(str(tmp_path / "totals")).to_pandas(), want)
    same(agg.state_view().toPandas(), want)


def test_delta_merge_by_a_string_and_an_integer_key_with_nulls(spark, tmp_path):
    """Merge keys of two columns, one a string with nulls: one row per key, Spark's totals
    (delta-rs once parsed the joined predicate as one comparison against a boolean)."""
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "two-keys", settings=settings())
    gen = ctx.generator_stream("gen", rows_per_batch=300, total_rows=1500, keys=40)
    carrier = F.when(F.col("key") % 7 == 0, F.lit(None)).otherwise(
        F.format_string("C%d", F.col("key") % 3))
    agg = gen.with_column("carrier", carrier).key_by("carrier", "key").agg(
        name="totals", n=count(), total=sum_("value"))
    agg.write_delta(str(tmp_path / "out"), name="out", merge_keys=["carrier", "key"])
    ctx.process_available(timeout=300)
    want = generated(spark, 0, 1500, 40).withColumn("carrier", carrier) \
        .groupBy("carrier", "key").agg(F.count("*").alias("n"),
                                       F.sum("value").alias("total")).toPandas()
    got = read_delta(str(tmp_path / "out")).to_pandas()
    assert len(got) == len(want) == 40
    assert got["carrier"].isna().sum() == 6  # keys 0, 7, ..., 35: one row each, not one per batch
    same(got, want)


def test_checkpoints_align_two_inputs_of_very_different_speeds(spark, tmp_path):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "align",
                           settings=settings(checkpoint_retained=20))
    fast = ctx.generator_stream("fast", rows_per_batch=1000, total_rows=6000, keys=50, seed=1)
    slow = ctx.generator_stream("slow", rows_per_batch=7, total_rows=42, keys=50, seed=2)
    both = fast.key_by("key").union(slow.key_by("key")).agg(name="both", n=count(),
                                                            total=sum_("value"))
    both.write_delta(str(tmp_path / "out"), name="out", merge_keys=["key"])
    ctx.process_available(timeout=300)
    completed = [c for c in ctx.recent_checkpoints if c["status"] == "completed"]
    assert len(completed) >= 3
    for stats in completed:
        meta = ctx.checkpoint_storage.read_metadata(stats["checkpoint_id"])
        ends = {name: src["piece"]["end"] for name, src in meta["sources"].items()}
        want = generated(spark, 0, ends["fast"], 50, 1).unionByName(
            generated(spark, 0, ends["slow"], 50, 2)).groupBy("key").agg(
            F.count("*").alias("n"), F.sum("value").alias("total")).toPandas()
        got = read_state(spark, str(tmp_path / "ckpt"), "both",
                         stats["checkpoint_id"]).toPandas()
        same(got, want)
    # tasks that got both inputs measured how long the first input's barrier waited
    aligned = [m for c in completed for t, m in c["tasks"].items()
               if t.startswith("op:") and m.get("channels") == 2]
    assert aligned and all(m["alignment_ms"] >= 0 for m in aligned)


def test_failing_checkpoint_storage_is_tolerated_then_fails_clearly(spark, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("SPARK_CKPT_FAULT", "checkpoint.metadata:1-2:fail")
    ctx, _ = agg_pipeline(spark, tmp_path, total=1600, checkpoint_tolerable_failures=2)
    ctx.process_available(timeout=300)
    statuses = [c["status"] for c in ctx.recent_checkpoints]
    assert statuses[:2] == ["aborted", "aborted"] and statuses[-1] == "completed"
    same(read_delta(str(tmp_path / "totals")).to_pandas(),
         expected_aggs(generated(spark, 0, 1600, 97)))

    monkeypatch.setenv("SPARK_CKPT_FAULT", "checkpoint.metadata:1-:fail")
    ctx, _ = agg_pipeline(spark, tmp_path, total=3200, checkpoint_tolerable_failures=1)
    with pytest.raises(CheckpointError, match="2 checkpoint.*tolerableFailures=1"):
        ctx.process_available(timeout=300)
    monkeypatch.delenv("SPARK_CKPT_FAULT")
    ctx, _ = agg_pipeline(spark, tmp_path, total=3200)
    ctx.process_available(timeout=300)
    same(read_delta(str(tmp_path / "totals")).to_pandas(),
         expected_aggs(generated(spark, 0, 3200, 97)))
    updates = spark.read.parquet(str(tmp_path / "updates")).toPandas()
    assert len(updates) == 8 * 97 and not updates.duplicated(["key", "n"]).any()


def test_a_checkpoint_that_times_out_is_aborted_and_output_stays_exactly_once(
        spark, tmp_path, monkeypatch):
    # the sinks' pre-commit of the first two checkpoints stalls (as slow storage would) past
    # the 300 ms timeout: both expire; the third completes and commits what they staged
    monkeypatch.setenv("SPARK_CKPT_FAULT", "checkpoint.barrier:1-2:pause")
    monkeypatch.setenv("SPARK_CKPT_FAULT_PAUSE_S", "0.6")
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "slow",
                           settings=settings(checkpoint_timeout_ms=300,
                                             checkpoint_tolerable_failures=100,
                                             checkpoint_interval_ms=50))
    gen = ctx.generator_stream("gen", rows_per_batch=100, total_rows=400, keys=5)
    gen.key_by("key").agg(name="n", n=count()).write_delta(
        str(tmp_path / "out"), name="out", merge_keys=["key"])
    ctx.process_available(timeout=300)
    statuses = [(c["checkpoint_id"], c["status"], c["reason"]) for c in ctx.recent_checkpoints]
    assert [s[:2] for s in statuses[:2]] == [(1, "aborted"), (2, "aborted")], statuses
    assert all("expired" in s[2] for s in statuses[:2]), statuses
    assert ctx.recent_checkpoints[-1]["status"] == "completed"
    got = read_delta(str(tmp_path / "out")).to_pandas().sort_values("key")
    assert got.n.tolist() == [80] * 5


class TwoTimers(KeyedProcessor):
    state_schema = {"n": "BIGINT"}

    def process(self, key, rows, ctx):
        ctx.value("n").update(len(rows))
        ctx.timers.register_processing_time(ctx.processing_time_ms - 1)
        ctx.timers.register_processing_time(ctx.processing_time_ms)

    def on_timer(self, key, timer_ms, ctx):
        yield (key[0], ctx.value("n").get(), ctx.timer_kind)
        ctx.clear()  # the second timer goes with the rest of the key


def test_a_timer_cleared_by_an_earlier_callback_does_not_fire(spark, tmp_path):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "timers", settings=settings())
    gen = ctx.generator_stream("gen", rows_per_batch=6, total_rows=6, keys=3)
    gen.key_by("key").process(TwoTimers(), "key BIGINT, n BIGINT, kind STRING") \
        .write_parquet(str(tmp_path / "out"), name="out")
    ctx.process_available(timeout=300)
    rows = spark.read.parquet(str(tmp_path / "out")).toPandas().sort_values("key")
    assert rows.values.tolist() == [[0, 2, "processing"], [1, 2, "processing"],
                                    [2, 2, "processing"]]


class Reminder(KeyedProcessor):
    """Each key's rows counted; 12 s of processing time after its first row, a reminder."""
    state_schema = {"n": "BIGINT"}

    def process(self, key, rows, ctx):
        if ctx.value("n").get() is None:
            ctx.timers.register_processing_time(ctx.processing_time_ms + 12_000)
        ctx.value("n").update((ctx.value("n").get() or 0) + len(rows))

    def on_timer(self, key, timer_ms, ctx):
        yield (key[0], ctx.value("n").get(), timer_ms)


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_a_processing_timer_fires_on_the_clock_when_empty_batches_are_skipped(
        spark, tmp_path, backend):
    """With empty batches skipped, a batch without data runs at the first tick at or after a
    processing-time timer (the tasks report their earliest one), and only then: ticks before
    it and after it run nothing."""
    from helpers import wait_for

    from spark_ckpt.clock import ManualClock

    source, staging = tmp_path / "in", tmp_path / "staging"
    source.mkdir()
    staging.mkdir()
    spark.createDataFrame([(1,), (1,), (2,)], "key BIGINT").coalesce(1).write \
        .parquet(str(staging / "f0"))
    clock = ManualClock(start_ms=20_000_000)
    ctx = StreamingContext(spark, 5.0, str(tmp_path / "ckpt"), "reminders", clock=clock,
                           settings=settings(stream_skip_empty_batches=True,
                                             state_backend=backend))
    ctx.file_stream("rows", str(source), "parquet", "key BIGINT") \
        .key_by("key").process(Reminder(), "key BIGINT, n BIGINT, due_ms BIGINT",
                               name="reminders") \
        .write_parquet(str(tmp_path / "out"), name="out")
    for f in (staging / "f0").glob("*.parquet"):
        f.rename(source / f.name)
    ctx.start()
    try:
        assert wait_for(lambda: len(ctx.recent_progress) == 1, 120), ctx.recent_progress
        clock.advance(5_000)  # +5 s, +10 s: nothing due, no data: no batch
        clock.advance(5_000)
        assert not wait_for(lambda: len(ctx.recent_progress) > 1, 3), ctx.recent_progress
        clock.advance(5_000)  # +15 s: the first tick after the timers (+12 s)
        assert wait_for(lambda: len(ctx.recent_progress) == 2, 120), ctx.recent_progress
        last = ctx.recent_progress[-1]
        assert last["num_input_rows"] == 0 and last["batch_time_ms"] == 20_015_000, last
        assert last["state"]["reminders"]["timers_fired"] == 2, last
        clock.advance(5_000)  # nothing left: no batch
        assert not wait_for(lambda: len(ctx.recent_progress) > 2, 3), ctx.recent_progress
    finally:
        ctx.stop()
    # every batch the run ran (a stop finishes the batches allocated): the first and the
    # timers' (one at a tick with nothing due would be here even if the waits above missed it)
    assert [p["batch_time_ms"] for p in ctx.recent_progress] == [20_000_000, 20_015_000]
    rows = spark.read.parquet(str(tmp_path / "out")).toPandas().sort_values("key")
    assert rows.values.tolist() == [[1, 2, 20_012_000], [2, 1, 20_012_000]]


def test_a_checkpoint_goes_at_the_last_finished_batch_without_waiting_for_the_running_one(
        spark, tmp_path):
    """Triggered while batch 1 is held in its task, checkpoint 1 completes at once with its
    barrier after batch 0: state, offsets and committed output are batch 0's, and the sink made
    visible only batch 0's rows. Released, the run ends equal to plain Spark."""
    import threading

    from spark_ckpt.streaming.runtime.progress import StreamingListener

    gate = tmp_path / "gate"

    def hold(frames):  # in a Python worker: batch 1 (ids 100..199) waits for the test's gate
        import os
        import time

        for pdf in frames:
            if ((pdf.id >= 100) & (pdf.id < 200)).any():
                deadline = time.time() + 120
                # Polls for an event (the gate file the test creates), not for time to pass:
                # a worker process cannot wait on the test's threading.Event. A slower machine
                # only makes the wait longer; the batch is held until the gate opens, whenever.
                while not os.path.exists(str(gate)) and time.time() < deadline:
                    time.sleep(0.05)
            yield pdf

    batch1_started = threading.Event()
    batch1_done = threading.Event()

    class Events(StreamingListener):
        def on_batch_started(self, info):
            if info["batch_id"] == 1:
                batch1_started.set()

        def on_batch_completed(self, progress):
            if progress["batch_id"] == 1:
                batch1_done.set()

    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "nowait",
                           settings=settings(checkpoint_interval_ms=3_600_000))
    ctx.add_listener(Events())
    gen = ctx.generator_stream("gen", rows_per_batch=100, total_rows=300, keys=5)
    held = gen.transform(lambda df: df.repartition(1).mapInPandas(hold, df.schema), name="held")
    held.key_by("key").agg(name="n", n=count()).write_delta(
        str(tmp_path / "out"), name="out", merge_keys=["key"])
    ctx.start(available_now=True)
    try:
        assert batch1_started.wait(120)
        cid = ctx.coordinator.trigger_now().result(timeout=60)
        assert ctx.coordinator.completion(cid).result(timeout=60) == "completed"
        assert not batch1_done.is_set()  # batch 1 is still held: nothing waited for it
        stats = next(c for c in ctx.recent_checkpoints if c["checkpoint_id"] == cid)
        assert stats["barrier_batch"] == 0
        meta = ctx.checkpoint_storage.read_metadata(cid)
        assert meta["sources"]["gen"]["piece"]["end"] == 100
        same(read_state(spark, str(tmp_path / "ckpt"), "n", cid).toPandas(),
             generated(spark, 0, 100, 5).groupBy("key").agg(F.count("*").alias("n")).toPandas())
        assert read_delta(str(tmp_path / "out")).to_pandas().n.sum() == 100
    finally:
        gate.touch()
    assert ctx.await_termination(300)
    same(read_delta(str(tmp_path / "out")).to_pandas(),
         generated(spark, 0, 300, 5).groupBy("key").agg(F.count("*").alias("n")).toPandas())


def test_the_update_stream_read_by_a_transform_and_foreach_batch_has_every_change(spark,
                                                                                  tmp_path):
    """Sinks the state tasks write themselves (chained) and readers of the update stream that
    Spark computes (a transform, foreach_batch) see the same rows."""
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "readers", settings=settings())
    gen = ctx.generator_stream("gen", rows_per_batch=400, total_rows=1200, keys=97)
    agg = gen.key_by("key").agg(name="totals", n=count(), total=sum_("value"))
    agg.write_parquet(str(tmp_path / "chained"), name="chained")
    agg.transform(lambda df: df.where("n >= 1"), name="kept").write_parquet(
        str(tmp_path / "kept"), name="kept")
    agg.foreach_batch(lambda df, b: df.write.mode("overwrite").parquet(
        str(tmp_path / "each" / str(b))), name="each")
    progress = ctx.process_available(timeout=300)
    assert [p["outputs"]["chained"].get("chained") for p in progress] == [True] * 3
    changed = sum(p["state"]["totals"]["changed_keys"] for p in progress)
    assert changed == 3 * 97
    chained = spark.read.parquet(str(tmp_path / "chained")).toPandas()
    kept = spark.read.parquet(str(tmp_path / "kept")).toPandas()
    each = spark.read.parquet(*[str(tmp_path / "each" / str(b)) for b in range(3)]).toPandas()
    order = ["key", "n"]
    for got in (kept, each):
        assert len(got) == changed
        pd.testing.assert_frame_equal(
            got[chained.columns].sort_values(order).reset_index(drop=True),
            chained.sort_values(order).reset_index(drop=True), check_dtype=False)


def test_a_completed_checkpoint_left_behind_by_a_crash_is_discarded_on_restart(spark, tmp_path):
    """A driver killed after completing a checkpoint but before subsuming the oldest leaves one
    checkpoint too many; its state files go with the restart's clean-up, so the restart
    discards its directory too (a soak found checkpoints/ growing across kills)."""
    ctx, _ = agg_pipeline(spark, tmp_path, total=1200, checkpoint_retained=2)
    ctx.process_available(timeout=300)
    chk = tmp_path / "ckpt" / "checkpoints"
    kept = sorted(p.name for p in chk.glob("chk-*"))
    assert len(kept) == 2
    leftover = chk / "chk-00000000"  # as old as can be: not among the two retained
    shutil.copytree(chk / kept[0], leftover)
    ctx2, agg2 = agg_pipeline(spark, tmp_path, total=2000, checkpoint_retained=2)
    ctx2.process_available(timeout=300)
    assert not leftover.exists()
    assert len(list(chk.glob("chk-*"))) == 2
    same(agg2.state_view().toPandas(), expected_aggs(generated(spark, 0, 2000, 97)))


def test_a_pipeline_checkpointed_before_its_first_batch_restarts(spark, tmp_path):
    """An available-now run over an empty directory checkpoints the cut before batch 0
    (barrier -1); the next start must restore it, not refuse it."""
    landing = tmp_path / "landing"
    landing.mkdir()

    def build():
        ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "empty",
                               settings=settings())
        rows = ctx.file_stream("rows", str(landing), "json", schema="key BIGINT, value DOUBLE")
        agg = rows.key_by("key").agg(name="totals", n=count(), total=sum_("value"))
        agg.write_delta(str(tmp_path / "totals"), name="totals", merge_keys=["key"])
        return ctx

    assert build().process_available(timeout=300) == []
    meta = json.loads(next((tmp_path / "ckpt" / "checkpoints").glob("chk-*/_metadata.json"))
                      .read_text())
    assert meta["barrier_batch"] == -1
    (landing / "a.json").write_text('{"key": 1, "value": 2.5}\n{"key": 1, "value": 1.5}\n')
    ctx = build()
    assert [p["num_input_rows"] for p in ctx.process_available(timeout=300)] == [2]
    assert ctx.restored is not None and ctx.restored.barrier_batch == -1
    got = read_delta(str(tmp_path / "totals")).to_pandas()
    assert got[["key", "n", "total"]].values.tolist() == [[1, 2, 4.0]]


def test_start_up_clean_up_deletes_only_what_was_written_before_this_driver_claimed(
        spark, tmp_path):
    """A restart deletes state files no retained checkpoint references (a crashed run's
    leftovers), but never one written after it claimed the directory: that is a newer
    driver's (racing two real drivers, the loser's start-up deleted the owner's fresh state
    file between its fence check and the deletion)."""
    import os
    import time

    ctx, _ = agg_pipeline(spark, tmp_path, total=800)
    ctx.process_available(timeout=300)
    state = tmp_path / "ckpt" / "state"
    orphan, newer = state / "orphan.parquet", state / "newer.parquet"
    orphan.write_bytes(b"left by a crashed run")
    newer.write_bytes(b"a newer driver's fresh state")
    later = time.time() + 3600  # as if written after the next driver's claim
    os.utime(newer, (later, later))
    ctx2, agg2 = agg_pipeline(spark, tmp_path, total=1200)
    ctx2.process_available(timeout=300)
    assert not orphan.exists() and newer.exists()
    same(agg2.state_view().toPandas(), expected_aggs(generated(spark, 0, 1200, 97)))
