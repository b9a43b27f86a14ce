"""Typed keyed state and the vectorized processor on a real SparkSession: state of every type a
user can declare comes back through snapshots, changelogs, restores and rescales exactly as plain
Spark computes it, in both backends; vectorized and per-key processors give plain Spark's
answer."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import functions as F

from spark_ckpt import KeyedProcessor, Settings, StreamingContext, read_state
from spark_ckpt.state import Result, VectorizedProcessor

BASE = dict(progress="never", checkpoint_interval_ms=1, state_max_parallelism=32,
            state_materialize_every=2)
TYPED = ("id BIGINT, dec DECIMAL(20,4), d DATE, ts TIMESTAMP, ntz TIMESTAMP_NTZ, "
         "s STRING, bin BINARY, f DOUBLE, b BOOLEAN, "
         "st STRUCT<ts: TIMESTAMP, dest: STRING, inner: STRUCT<x: DECIMAL(10,2)>>, "
         "arr ARRAY<BIGINT>, arr_st ARRAY<STRUCT<d: DATE, tag: STRING>>, "
         "m MAP<STRING, DOUBLE>, m_arr MAP<INT, ARRAY<STRING>>")
TYPED_COLUMNS = [c.split(" ")[0] for c in
                 ["id", "dec", "d", "ts", "ntz", "s", "bin", "f", "b", "st", "arr", "arr_st", "m",
                  "m_arr"]]


def typed_rows(df):
    """Columns of every kind, nulls included, derived from the generator's rows."""
    i = F.col("id")
    null_every = lambda n, c: F.when(i % n == 0, F.lit(None)).otherwise(c)  # noqa: E731
    return df.select(
        "key", "id",
        null_every(7, (i / 3).cast("decimal(20,4)")).alias("dec"),
        F.date_add(F.lit("2026-01-01").cast("date"), (i % 400).cast("int")).alias("d"),
        F.col("event_time").alias("ts"),
        F.col("event_time").cast("timestamp_ntz").alias("ntz"),
        null_every(5, F.concat(F.lit("välue-"), i.cast("string"))).alias("s"),
        F.encode(F.concat(F.lit("\u0000"), i.cast("string")), "utf-8").alias("bin"),
        F.when(i % 11 == 0, F.lit(float("nan"))).otherwise(F.col("value")).alias("f"),
        (i % 2 == 0).alias("b"),
        F.struct(null_every(3, F.col("event_time")).alias("ts"), F.lit(None).cast("string")
                 .alias("dest"), F.struct((i % 100 / 4).cast("decimal(10,2)").alias("x"))
                 .alias("inner")).alias("st"),
        F.array(i, F.lit(None).cast("bigint"), -i).alias("arr"),
        F.array(F.struct(F.lit("2000-02-29").cast("date").alias("d"),
                         i.cast("string").alias("tag"))).alias("arr_st"),
        F.create_map(F.lit("v"), F.col("value"), F.lit("n"), F.lit(None).cast("double"))
        .alias("m"),
        F.create_map((i % 5).cast("int"), F.array(F.lit("x"), F.lit(None).cast("string")))
        .alias("m_arr"))


class LatestTyped(VectorizedProcessor):
    """Keeps, per key, the row with the largest id seen (every column typed)."""

    state_schema = TYPED

    def process_batch(self, batch):
        rows = batch.arrow_rows
        ids = np.asarray(rows.column("id").to_numpy())
        # the row with the largest id of each key's group
        best = np.array([s + int(np.argmax(ids[s:e])) for s, e in
                         zip(batch.offsets[:-1], batch.offsets[1:], strict=True)], np.int64)
        new = rows.take(pa.array(best)).select(TYPED_COLUMNS)
        old_id = batch.arrow_state.column("id")
        newer = pc.fill_null(pc.greater(new.column("id"), old_id), True)
        return Result(state=new, changed=np.asarray(newer.to_numpy(zero_copy_only=False)),
                      emit=batch.keys.assign(n=batch.sizes))


def run_typed(spark, tmp_path, total: int, parallelism: int, backend: str):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "typed",
                           settings=Settings(**BASE, state_parallelism=parallelism,
                                             state_backend=backend))
    gen = ctx.generator_stream("gen", rows_per_batch=150, total_rows=total, keys=23)
    typed = gen.transform(typed_rows, name="typed")
    typed.key_by("key").process(LatestTyped(), "key BIGINT, n BIGINT", name="latest") \
        .write_parquet(str(tmp_path / "out"), name="out")
    ctx.process_available(timeout=300)
    return ctx


def expected_latest(spark, total: int) -> list:
    from test_keyed_state import generated

    df = typed_rows(generated(spark, 0, total, 23))
    return sorted(df.groupBy("key").agg(F.max_by(F.struct(*TYPED_COLUMNS), "id").alias("r"))
                  .select("key", "r.*").collect(), key=lambda r: r.key)


def rows_equal(got: list, want: list) -> None:
    def norm(row):
        return tuple("NaN" if isinstance(v, float) and v != v else v for v in row)
    assert [norm(r) for r in got] == [norm(r) for r in want]


def test_every_declared_type_round_trips_through_snapshots_restores_and_rescales(spark,
                                                                               tmp_path):
    for total, parallelism, backend in ((600, 2, "memory"), (1200, 3, "rocksdb"),
                                        (1800, 1, "memory")):
        run_typed(spark, tmp_path, total, parallelism, backend)
        got = read_state(spark, str(tmp_path / "ckpt"), "latest")
        assert got.schema.simpleString() == \
            spark.createDataFrame([], f"key BIGINT, {TYPED}").schema.simpleString()
        rows_equal(sorted(got.collect(), key=lambda r: r.key), expected_latest(spark, total))
    out = spark.read.parquet(str(tmp_path / "out"))
    assert out.agg(F.sum("n")).first()[0] == 1800  # every row seen once


# -- vectorized and per-key processors, same answers ------------------------------------------
class RunningVectorized(VectorizedProcessor):
    state_schema = "n BIGINT, total DOUBLE"

    def process_batch(self, batch):
        st = batch.state
        sums = np.add.reduceat(batch.rows["value"].to_numpy(), batch.offsets[:-1])
        n = st["n"].fillna(0).to_numpy("int64") + batch.sizes
        total = st["total"].fillna(0.0).to_numpy() + sums
        return Result(state=pd.DataFrame({"n": n, "total": total}),
                      emit=batch.keys.assign(n=n, total=total))


class RunningPerKey(KeyedProcessor):
    state_schema = "n BIGINT, total DOUBLE"

    def process(self, key, rows, ctx):
        n, total = ctx.value("n"), ctx.value("total")
        n.update((n.get() or 0) + len(rows))
        total.update((total.get() or 0.0) + float(rows["value"].sum()))
        yield (key[0], n.get(), total.get())


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_vectorized_and_per_key_running_totals_equal_plain_spark(spark, tmp_path, backend):
    from test_keyed_state import generated

    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "run",
                           settings=Settings(**BASE, state_parallelism=3, state_backend=backend))
    keyed = ctx.generator_stream("gen", rows_per_batch=300, total_rows=1500, keys=40) \
        .key_by("key")
    for name, proc in (("vec", RunningVectorized()), ("per_key", RunningPerKey())):
        keyed.process(proc, "key BIGINT, n BIGINT, total DOUBLE", name=name) \
            .write_parquet(str(tmp_path / f"out-{name}"), name=f"out-{name}")
    ctx.process_available(timeout=300)
    want = generated(spark, 0, 1500, 40).groupBy("key").agg(
        F.count("*").alias("n"), F.sum("value").alias("total")).toPandas() \
        .sort_values("key").reset_index(drop=True)
    for name in ("vec", "per_key"):
        got = spark.read.parquet(str(tmp_path / f"out-{name}")).toPandas()
        last = got.sort_values("n").groupby("key").tail(1).sort_values("key") \
            .reset_index(drop=True)
        pd.testing.assert_frame_equal(last[["key", "n", "total"]], want, check_dtype=False,
                                      rtol=1e-9)
        assert len(got) == 5 * 40  # one row per key and batch
        state = read_state(spark, str(tmp_path / "ckpt"), name).toPandas()
        pd.testing.assert_frame_equal(state.sort_values("key").reset_index(drop=True),
                                      want, check_dtype=False, rtol=1e-9)


class Sessions(VectorizedProcessor):
    """Vectorized sessionizer: a session per key closes 30 ms of event time after its last
    event (an event-time timer per key, replaced every batch), emitting its row count."""

    state_schema = "n BIGINT, last_ms BIGINT"

    def process_batch(self, batch):
        ms = batch.arrow_rows.column("event_time").cast(pa.int64()).to_numpy() // 1000
        last = np.maximum.reduceat(ms, batch.offsets[:-1])
        n = batch.state["n"].fillna(0).to_numpy("int64") + batch.sizes
        return Result(state=pd.DataFrame({"n": n, "last_ms": last}), event_timers=last + 30)

    def on_timers(self, batch):
        out = batch.keys.assign(n=batch.state["n"].to_numpy("int64"),
                                end_ms=batch.state["last_ms"].to_numpy("int64"))
        cleared = pd.DataFrame({"n": [None] * len(batch), "last_ms": [None] * len(batch)})
        return Result(state=cleared, emit=out)


def test_vectorized_timers_close_sessions_as_the_watermark_passes(spark, tmp_path):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "sess",
                           settings=Settings(**BASE, state_parallelism=2))
    gen = ctx.generator_stream("gen", rows_per_batch=40, total_rows=200, keys=4)
    # key 1 goes quiet after id 80, key 2 after id 120: their sessions close
    quiet = F.col("id") >= F.when(F.col("key") == 1, 80).when(F.col("key") == 2, 120) \
        .otherwise(10**9)
    gen.filter(~quiet).key_by("key").process(
        Sessions(), "key BIGINT, n BIGINT, end_ms BIGINT", name="s", event_time="event_time") \
        .write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=300)
    rows = spark.read.parquet(str(tmp_path / "out")).toPandas()
    # ids arrive in batches of 40, 1 ms apart: each key's session stays open while its events
    # keep coming; timers fire once the watermark (max event time of earlier batches) passes
    # last + 30, which happens after the next batch for every key but the last batch's
    expect, state, watermark = [], {}, None
    for b in range(5):
        for k in range(4):
            mine = [i for i in range(40 * b, 40 * b + 40) if i % 4 == k and
                    i < {1: 80, 2: 120}.get(k, 10**9)]
            if not mine:
                continue
            s = state.setdefault(k, {"n": 0})
            s["n"] += len(mine)
            s["last"] = max(mine)
        for k in list(state):
            if watermark is not None and state[k]["last"] + 30 <= watermark:
                expect.append((k, state[k]["n"], 1_767_225_600_000 + state[k]["last"]))
                del state[k]
        watermark = 40 * b + 39
    got = sorted(zip(rows.key, rows.n, rows.end_ms, strict=True))
    assert got == sorted((k, n, e) for k, n, e in expect)
    assert {k for k, _n, _e in expect} == {1, 2}
    assert sum(p["state"]["s"]["timers_fired"] for p in progress) == len(expect)
    left = read_state(spark, str(tmp_path / "ckpt"), "s").toPandas()
    assert sorted(left.key) == sorted(state)


# -- the documented examples: vectorized and per-key, same answers as plain Spark -------------
def run_example(spark, tmp_path, name, processors, schema, keyed_input, **kw):
    """One pipeline with the example's vectorized and per-key processors side by side."""
    ctx = StreamingContext(spark, 0.05, str(tmp_path / name), name,
                           settings=Settings(**BASE, state_parallelism=2))
    gen = ctx.generator_stream("gen", rows_per_batch=100, total_rows=500, keys=50)
    keyed = keyed_input(gen).key_by("key")
    for api, processor in processors.items():
        keyed.process(processor, schema, name=api, **kw) \
            .write_parquet(str(tmp_path / f"out-{api}"), name=f"out-{api}")
    ctx.process_available(timeout=300)
    return {api: spark.read.parquet(str(tmp_path / f"out-{api}")) for api in processors}


def late_keys(gen):
    """Keys 25..49 first appear in batch 2 (ids from 200)."""
    return gen.filter((F.col("key") < 25) | (F.col("id") >= 200))


def test_dedup_example_emits_each_key_once_from_its_first_batch(spark, tmp_path):
    import keyed_examples as ex

    outs = run_example(spark, tmp_path, "dedup",
                       {"vectorized": ex.Dedup(), "per_key": ex.DedupPerKey()},
                       "id BIGINT, key BIGINT, value DOUBLE, event_time TIMESTAMP", late_keys)
    first_batch = {k: 0 if k < 25 else 2 for k in range(50)}
    for out in outs.values():
        rows = out.toPandas()
        assert sorted(rows.key) == list(range(50))  # once each
        assert all(i // 100 == first_batch[k] and i % 50 == k
                   for k, i in zip(rows.key, rows.id, strict=True))


def test_top_n_example_keeps_the_n_largest_values_per_key(spark, tmp_path):
    import keyed_examples as ex
    from test_keyed_state import generated

    run_example(spark, tmp_path, "top", {"vectorized": ex.TopN(), "per_key": ex.TopNPerKey()},
                "key BIGINT, top ARRAY<DOUBLE>", late_keys)
    want = late_keys(generated(spark, 0, 500, 50)).groupBy("key").agg(
        F.slice(F.sort_array(F.collect_list("value"), False), 1, ex.TOP_N).alias("top"))
    for api in ("vectorized", "per_key"):
        got = read_state(spark, str(tmp_path / "top"), api)
        assert sorted(map(tuple, got.collect())) == sorted(map(tuple, want.collect()))


def test_sessions_examples_give_the_same_sessions_in_both_apis(spark, tmp_path):
    import keyed_examples as ex

    quiet = lambda gen: gen.filter(  # noqa: E731 - keys 1 and 2 go quiet: their sessions close
        F.col("id") < F.when(F.col("key") == 1, 150).when(F.col("key") == 2, 250)
        .otherwise(10**9))
    outs = run_example(spark, tmp_path, "sess",
                       {"vectorized": ex.Sessions(), "per_key": ex.SessionsPerKey()},
                       "key BIGINT, n BIGINT, start_ms BIGINT, end_ms BIGINT", quiet,
                       event_time="event_time")
    epoch = 1_767_225_600_000
    rows = {api: sorted(map(tuple, out.collect())) for api, out in outs.items()}
    assert rows["vectorized"] == rows["per_key"]
    got = rows["vectorized"]
    # keys 1 and 2 closed mid-run; the run's final no-data batch closes the sessions the
    # final watermark reaches (every other key's)
    assert (1, 3, epoch + 1, epoch + 101) in got and (2, 5, epoch + 2, epoch + 202) in got
    assert len(got) == 20 and all(end <= epoch + 499 for *_, end in got)


# -- what a user gets wrong is named -----------------------------------------------------------
class Undeclared(KeyedProcessor):
    state_schema = "n BIGINT"

    def process(self, key, rows, ctx):
        ctx.value("total").update(1.0)


class WrongType(KeyedProcessor):
    state_schema = "n BIGINT"

    def process(self, key, rows, ctx):
        ctx.value("n").update("many")


class WrongCall(VectorizedProcessor):
    state_schema = "n BIGINT"

    def process_batch(self, batch):
        return Result(state=pd.DataFrame({"n": [1]}))  # one row, whatever the number of keys


@pytest.mark.parametrize("processor, message", [
    (Undeclared(), r"state variable 'total' is not declared.*declared: \['n'\]"),
    (WrongType(), r"state variable 'n' of key \(\d+,\): expected a value of type int64, found "
                  r"str 'many'"),
    (WrongCall(), r"expected Result.state to have one row per key of the call \(\d+\), found 1"),
])
def test_a_state_mistake_fails_the_batch_naming_the_variable_and_key(spark, tmp_path, processor,
                                                                    message):
    from spark_ckpt import PipelineFailedError, UserFunctionError

    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "bad",
                           settings=Settings(**BASE, state_parallelism=2))
    ctx.generator_stream("gen", rows_per_batch=20, total_rows=20, keys=4).key_by("key") \
        .process(processor, "key BIGINT", name="bad").write_parquet(str(tmp_path / "out"),
                                                                    name="out")
    with pytest.raises((PipelineFailedError, UserFunctionError)) as info:
        ctx.process_available(timeout=300)
    text = str(info.value) + str(info.value.__cause__ or "")
    import re

    assert re.search(message, text), text
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.parquet"))


def test_a_vectorized_processor_without_a_state_schema_is_refused_when_defined(spark,
                                                                               tmp_path):
    from spark_ckpt import JobDefinitionError

    class NoSchema(VectorizedProcessor):
        def process_batch(self, batch):
            return None

    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "none", settings=Settings(**BASE))
    gen = ctx.generator_stream("gen", rows_per_batch=20, total_rows=20, keys=4)
    with pytest.raises(JobDefinitionError, match="declares no state_schema"):
        gen.key_by("key").process(NoSchema(), "key BIGINT")


def test_a_checkpoint_of_json_processor_state_is_refused_at_start(spark, tmp_path):
    """A checkpoint written before typed state (its operator metadata has no state_schema)
    stops the start with what to do; nothing runs."""
    import json

    from spark_ckpt import CheckpointError, PipelineFailedError

    def pipeline(total: int):
        ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "old",
                               settings=Settings(**BASE, state_parallelism=2))
        gen = ctx.generator_stream("gen", rows_per_batch=50, total_rows=total, keys=4)
        gen.key_by("key").process(RunningPerKey(), "key BIGINT, n BIGINT, total DOUBLE",
                                  name="run").write_parquet(str(tmp_path / "out"), name="out")
        return ctx

    pipeline(100).process_available(timeout=300)
    for meta_file in (tmp_path / "ckpt" / "checkpoints").glob("chk-*/_metadata.json"):
        meta = json.loads(meta_file.read_text())
        for op in meta.get("operators", {}).values():
            for key in ("state_schema", "key_schema", "state_format"):
                op.pop(key, None)
        meta_file.write_text(json.dumps(meta))
    with pytest.raises((CheckpointError, PipelineFailedError), match="JSON documents"):
        pipeline(200).process_available(timeout=300)


def test_a_changed_key_is_refused_at_start(spark, tmp_path):
    """Keyed by ``key``, then by the same values under another name: refused before anything
    runs (restored rows would otherwise all land on the null key)."""
    from spark_ckpt import CheckpointError, PipelineFailedError

    def pipeline(total: int, key: str):
        ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "rekey",
                               settings=Settings(**BASE, state_parallelism=2))
        gen = ctx.generator_stream("gen", rows_per_batch=50, total_rows=total, keys=4)
        gen.transform(lambda df: df.withColumnRenamed("key", key), name="renamed") \
            .key_by(key).process(RunningVectorized(), f"{key} BIGINT, n BIGINT, total DOUBLE",
                                 name="run") \
            .write_parquet(str(tmp_path / "out"), name="out")
        return ctx

    pipeline(100, "key").process_available(timeout=300)
    with pytest.raises((CheckpointError, PipelineFailedError),
                       match=r"keyed by \['key'\], the pipeline keys it by \['user'\]"):
        pipeline(200, "user").process_available(timeout=300)
