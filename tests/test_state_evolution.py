"""State schema evolution across restarts, on a real SparkSession: a pipeline restarted with
added, removed, reordered, renamed and widened state (processors of both APIs, both backends,
aggregations) continues from its checkpoint with exactly plain Spark's answer; a change the
stored state cannot become is refused at start, naming the operator, both schemas and what to
do, and nothing runs."""

from __future__ import annotations

import decimal
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import functions as F

from spark_ckpt import KeyedProcessor, Settings, StateSchemaError, StreamingContext, read_state
from spark_ckpt.state import Result, VectorizedProcessor
from spark_ckpt.state.aggregates import count, max_, mean, min_, sum_
from spark_ckpt.state.evolution import evolve_table, plan_evolution, type_problem

KEYS = 23
N = 900  # rows per phase

V1 = ("n INT, id_sum BIGINT, small FLOAT, tag STRING, old_only BIGINT, price DECIMAL(10,2), "
      "info STRUCT<a: INT, b: STRING>, hist ARRAY<INT>")
# reordered; n, small, price, info.a, hist widened; tag renamed to label; old_only removed;
# info.c and seen_since added
V2 = ("label STRING, seen_since BIGINT, n BIGINT, id_sum BIGINT, small DOUBLE, "
      "price DECIMAL(12,2), info STRUCT<b: STRING, a: BIGINT, c: DOUBLE>, hist ARRAY<BIGINT>")
V3 = V2 + ", old_only BIGINT"  # a removed variable declared again: it starts empty


def _latest(batch):
    """Per key of the call: the index (into batch.arrow_rows) of its row with the largest id."""
    ids = np.asarray(batch.arrow_rows.column("id").to_numpy())
    return pa.array([s + int(np.argmax(ids[s:e])) for s, e in
                     zip(batch.offsets[:-1], batch.offsets[1:], strict=True)], pa.int64())


def _derived(rows: pa.Table, int_type: pa.DataType) -> dict:
    ids = rows.column("id").combine_chunks()
    small = pc.divide(pc.cast(pc.remainder(ids, 1000), pa.float64()), 4.0)
    a = pc.cast(pc.remainder(ids, 1000), int_type)
    return {
        "small": small,
        "tag": pc.binary_join_element_wise("t", pc.cast(ids, pa.string()), ""),
        "price": pa.array([decimal.Decimal(i) / 100 for i in ids.to_pylist()],
                          pa.decimal128(10, 2)),
        "a": a, "b": pc.binary_join_element_wise("b", pc.cast(ids, pa.string()), ""),
        "max_id": ids,
    }


class EvolvingV1(VectorizedProcessor):
    state_schema = V1

    def process_batch(self, batch):
        st = batch.arrow_state
        latest = batch.arrow_rows.take(_latest(batch))
        d = _derived(latest, pa.int32())
        sums = np.add.reduceat(batch.arrow_rows.column("id").to_numpy(), batch.offsets[:-1])
        state = pa.table({
            "n": pc.add(pc.fill_null(st.column("n"), 0), pa.array(batch.sizes, pa.int32())),
            "id_sum": pc.add(pc.fill_null(st.column("id_sum"), 0), pa.array(sums, pa.int64())),
            "small": pc.cast(d["small"], pa.float32()), "tag": d["tag"],
            "old_only": d["max_id"], "price": d["price"],
            "info": pa.StructArray.from_arrays([d["a"], d["b"]], ["a", "b"]),
            "hist": pa.array([[v] for v in d["a"].to_pylist()], pa.list_(pa.int32())),
        })
        return Result(state=state, emit=batch.keys.assign(n=batch.sizes))


class EvolvingV2(VectorizedProcessor):
    """Continues V1's state under V2's schema; does not touch old_only (V3 declares it)."""

    state_schema = V2

    def process_batch(self, batch):
        st = batch.arrow_state
        latest = batch.arrow_rows.take(_latest(batch))
        d = _derived(latest, pa.int64())
        sizes = pa.array(batch.sizes, pa.int64())
        sums = np.add.reduceat(batch.arrow_rows.column("id").to_numpy(), batch.offsets[:-1])
        state = pa.table({
            "n": pc.add(pc.fill_null(st.column("n"), 0), sizes),
            "id_sum": pc.add(pc.fill_null(st.column("id_sum"), 0), pa.array(sums, pa.int64())),
            "seen_since": pc.add(pc.fill_null(st.column("seen_since"), 0), sizes),
            "small": d["small"], "label": d["tag"], "price": pc.cast(d["price"],
                                                                     pa.decimal128(12, 2)),
            "info": pa.StructArray.from_arrays(
                [d["b"], d["a"], pc.multiply(pc.cast(d["a"], pa.float64()), 2.0)],
                ["b", "a", "c"]),
            "hist": pa.array([[v] for v in d["a"].to_pylist()], pa.list_(pa.int64())),
        })
        return Result(state=state, emit=batch.keys.assign(n=batch.sizes))


class EvolvingV3(EvolvingV2):
    state_schema = V3


class PerKeyV1(KeyedProcessor):
    state_schema = "n INT, tag STRING, gone DOUBLE, pair STRUCT<x: INT, y: STRING>"

    def process(self, key, rows, ctx):
        n = ctx.value("n")
        n.update((n.get() or 0) + len(rows))
        top = int(rows["id"].max())
        ctx.value("tag").update(f"t{top}")
        ctx.value("gone").update(1.5)
        ctx.value("pair").update({"x": top % 1000, "y": f"y{top}"})
        yield (key[0], n.get())


class PerKeyV2(KeyedProcessor):
    state_schema = "pair STRUCT<y: STRING, x: BIGINT>, label STRING, n BIGINT, extra ARRAY<BIGINT>"

    def process(self, key, rows, ctx):
        n = ctx.value("n")
        n.update((n.get() or 0) + len(rows))
        top = int(rows["id"].max())
        ctx.value("label").update(f"t{top}")
        ctx.value("pair").update({"x": top % 1000, "y": f"y{top}"})
        extra = ctx.value("extra")
        extra.update([*(extra.get() or []), len(rows)])
        yield (key[0], n.get())


def _run(spark, tmp_path, processor, *, total, backend="memory", only_keys=None,
         renames=None, materialize_every=50, parallelism=2):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "evolve",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             state_max_parallelism=16,
                                             state_materialize_every=materialize_every,
                                             state_parallelism=parallelism,
                                             state_backend=backend))
    gen = ctx.generator_stream("gen", rows_per_batch=300, total_rows=total, keys=KEYS)
    src = gen if only_keys is None else gen.transform(
        lambda df: df.where(F.col("key") < only_keys), name="some_keys")
    src.key_by("key").process(processor, "key BIGINT, n BIGINT", name="state",
                              state_renames=renames) \
        .write_parquet(str(tmp_path / "out"), name="out")
    ctx.process_available(timeout=300)
    return ctx


def _expected(spark, phases):
    """Plain Spark's answer: every phase's rows (start, end, keys below), per key."""
    from test_keyed_state import generated

    frames = [generated(spark, s, e, KEYS).where(F.col("key") < k).withColumn("late", F.lit(p > 0))
              for p, (s, e, k) in enumerate(phases)]
    df = frames[0]
    for f in frames[1:]:
        df = df.unionByName(f)
    top = F.max("id")
    rows = df.groupBy("key").agg(
        F.count("*").alias("n"), F.sum("id").alias("id_sum"), top.alias("top"),
        F.sum(F.when(F.col("late"), 1)).alias("seen_since"),
        F.max(F.when(F.col("late"), F.col("id"))).alias("late_top")).collect()
    out = {}
    for r in rows:
        a = r.top % 1000
        out[r.key] = dict(
            label=f"t{r.top}", seen_since=r.seen_since, n=r.n, id_sum=r.id_sum,
            small=a / 4.0, price=decimal.Decimal(r.top) / 100,
            info={"b": f"b{r.top}", "a": a, "c": a * 2.0 if r.late_top is not None else None},
            hist=[a])
    return out


def _state(spark, tmp_path, operator="state"):
    got = read_state(spark, str(tmp_path / "ckpt"), operator)
    return {r.key: r.asDict(recursive=True) for r in got.collect()}


def test_processor_state_evolves_across_restarts_and_a_removed_variable_stays_gone(spark,
                                                                                  tmp_path):
    _run(spark, tmp_path, EvolvingV1(), total=N)
    # only keys below 10 have rows from here on: the others' state comes from V1's files alone
    ctx = _run(spark, tmp_path, EvolvingV2(), total=2 * N, only_keys=10,
               renames={"tag": "label"})
    op = ctx.graph.stateful[0].snapshot()  # the operator's runtime state, as published
    assert op.evolution is not None and op.evolution.removed == ("old_only",)
    assert set(op.evolution.added) == {"seen_since"}
    assert op.evolution.sources == {"label": "tag"}
    got = _state(spark, tmp_path)
    want = _expected(spark, [(0, N, KEYS), (N, 2 * N, 10)])
    assert set(got) == set(want) == set(range(KEYS))
    for key, row in want.items():
        assert {k: got[key][k] for k in row} == row, key
    assert "old_only" not in got[0] and "tag" not in got[0]
    # old_only declared again, the rename still passed (already made: ignored): the V1 values
    # of keys that had no rows since must not come back
    _run(spark, tmp_path, EvolvingV3(), total=3 * N, only_keys=5, renames={"tag": "label"})
    got = _state(spark, tmp_path)
    want = _expected(spark, [(0, N, KEYS), (N, 2 * N, 10), (2 * N, 3 * N, 5)])
    for key, row in want.items():
        assert {k: got[key][k] for k in row} == row, key
        assert got[key]["old_only"] is None, key
    # every row was processed once, across the three versions
    assert spark.read.parquet(str(tmp_path / "out")).agg(F.sum("n")).first()[0] == \
        N + sum(1 for i in range(N, 3 * N) if i % KEYS < (10 if i < 2 * N else 5))


def test_per_key_processor_state_evolves_with_rocksdb(spark, tmp_path):
    from test_keyed_state import generated

    _run(spark, tmp_path, PerKeyV1(), total=N, backend="rocksdb")
    _run(spark, tmp_path, PerKeyV2(), total=2 * N, backend="rocksdb", parallelism=3,
         renames={"tag": "label"})  # rescaled too
    got = _state(spark, tmp_path)
    df = generated(spark, 0, 2 * N, KEYS)
    want = {r.key: (r.n, r.top, r.late) for r in df.groupBy("key").agg(
        F.count("*").alias("n"), F.max("id").alias("top"),
        F.sum(F.when(F.col("id") >= N, 1)).alias("late")).collect()}
    assert set(got) == set(want)
    for key, (n, top, late) in want.items():
        row = got[key]
        assert (row["n"], row["label"], row["pair"], sum(row["extra"])) == \
            (n, f"t{top}", {"y": f"y{top}", "x": top % 1000}, late), key
        assert "gone" not in row


def _listing(root):
    out = set()
    for base, _dirs, files in os.walk(root):
        for f in files:
            out.add(os.path.relpath(os.path.join(base, f), root))
    return out


@pytest.fixture(scope="module")
def v1_checkpoint(spark, tmp_path_factory):
    """A checkpoint of EvolvingV1's state, made once and copied by each refusal test."""
    base = tmp_path_factory.mktemp("v1")
    _run(spark, base, EvolvingV1(), total=N // 3)
    return base


@pytest.mark.parametrize("declared, expect", [
    (V1.replace("n INT", "n SMALLINT"), "variable 'n': stored as INT, declared SMALLINT"),
    (V1.replace("small FLOAT", "small STRING"), "variable 'small': stored as FLOAT, declared"),
    (V1.replace("price DECIMAL(10,2)", "price DECIMAL(10,3)"), "integer and 2 fraction digits"),
    (V1.replace("a: INT", "a: STRING"), "variable 'info'.a"),
    (V1.replace("hist ARRAY<INT>", "hist INT"), "variable 'hist'"),
])
def test_a_change_the_state_cannot_become_is_refused_at_start(spark, tmp_path, v1_checkpoint,
                                                             declared, expect):
    import shutil

    for name in ("ckpt", "out"):
        shutil.copytree(v1_checkpoint / name, tmp_path / name)
    before = _listing(tmp_path / "ckpt")

    class Changed(EvolvingV1):
        state_schema = declared

    with pytest.raises(StateSchemaError) as err:
        _run(spark, tmp_path, Changed(), total=N)
    text = str(err.value)
    assert "operator state" in text and expect in text, text
    assert "stored:   n INT, id_sum BIGINT" in text and "What to do" in text
    # nothing ran: no batch allocated or committed, no state or output written
    # (the run's claim is made: runs/ and the fence table)
    after = _listing(tmp_path / "ckpt")
    assert {p for p in after - before if not p.startswith(("runs/", "fence/"))} == set(), \
        sorted(after - before)


def test_after_a_refusal_the_old_pipeline_restores_and_continues(spark, tmp_path):
    _run(spark, tmp_path, EvolvingV1(), total=N // 3)

    class Narrowed(EvolvingV1):
        state_schema = V1.replace("n INT", "n SMALLINT")

    with pytest.raises(StateSchemaError):
        _run(spark, tmp_path, Narrowed(), total=N)
    _run(spark, tmp_path, EvolvingV1(), total=N)
    assert sum(r["n"] for r in _state(spark, tmp_path).values()) == N


def test_renames_that_cannot_apply_are_refused(spark, tmp_path):
    _run(spark, tmp_path, PerKeyV1(), total=N // 3)
    for renames, expect in (({"nope": "label"}, "stores neither"),
                            ({"tag": "missing"}, "'missing' is not declared"),
                            ({"tag": "label", "gone": "label"}, "renames both")):
        with pytest.raises(StateSchemaError, match=expect):
            _run(spark, tmp_path, PerKeyV2(), total=N, renames=renames)


# -- aggregations ---------------------------------------------------------------------------
def _agg_run(spark, tmp_path, rows, *, small_type="int", renames=None, key_type=None,
             keys=("key",), **aggs):
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "evolve_agg",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             state_max_parallelism=16, state_parallelism=2,
                                             state_materialize_every=50))
    gen = ctx.generator_stream("gen", rows_per_batch=300, total_rows=rows, keys=KEYS)

    def shaped(df):
        small = F.pmod("id", F.lit(1000)).cast(small_type)
        df = df.withColumn("small", small).withColumn("k2", F.pmod("id", F.lit(3)))
        return df.withColumn("key", F.col("key").cast(key_type)) if key_type else df

    gen.transform(shaped, name="shaped").key_by(*keys) \
        .agg("totals", state_renames=renames, **aggs).write_parquet(str(tmp_path / "out"),
                                                                    name="out")
    ctx.process_available(timeout=300)
    return ctx


def test_an_aggregation_gains_an_output_renames_one_and_widens_another(spark, tmp_path):
    from test_keyed_state import generated

    _agg_run(spark, tmp_path, N, n=count(), total=sum_("small"), hi=max_("small"))
    _agg_run(spark, tmp_path, 2 * N, small_type="bigint", renames={"n": "orders"},
             orders=count(), total=sum_("small"), hi=max_("small"), avg=mean("value"))
    got = {r.key: r for r in read_state(spark, str(tmp_path / "ckpt"), "totals").collect()}
    df = generated(spark, 0, 2 * N, KEYS).withColumn("small", F.pmod("id", F.lit(1000)))
    want = {r.key: r for r in df.groupBy("key").agg(
        F.count("*").alias("orders"), F.sum("small").alias("total"), F.max("small").alias("hi"),
        F.avg(F.when(F.col("id") >= N, F.col("value"))).alias("avg")).collect()}
    assert set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        assert (g.orders, g.total, g.hi) == (w.orders, w.total, w.hi), key
        assert g.avg == pytest.approx(w.avg), key
    assert read_state(spark, str(tmp_path / "ckpt"), "totals").schema["hi"].dataType \
        .simpleString() == "bigint"


def test_an_aggregation_whose_function_or_key_changed_is_refused(spark, tmp_path):
    _agg_run(spark, tmp_path, N // 3, n=count(), hi=max_("small"))
    with pytest.raises(StateSchemaError, match=r"output 'hi': max\(small\) in the checkpoint, "
                                               r"min\(small\) declared"):
        _agg_run(spark, tmp_path, N, n=count(), hi=min_("small"))
    before = _listing(tmp_path / "ckpt")
    with pytest.raises(StateSchemaError, match="stored as INT, declared STRING: the one does not "
                                               "widen to the other"):
        _agg_run(spark, tmp_path, N, small_type="string", n=count(), hi=max_("small"))
    # refused at start (the template followed over no rows): no batch was allocated or run
    assert {p for p in _listing(tmp_path / "ckpt") - before
            if not p.startswith(("runs/", "fence/"))} == set()
    with pytest.raises(StateSchemaError, match="the key of a stateful operator cannot change"):
        _agg_run(spark, tmp_path, N, key_type="int", n=count(), hi=max_("small"))
    with pytest.raises(StateSchemaError, match=r"keyed by \['key'\], the pipeline keys it by "
                                               r"\['key', 'k2'\]"):
        _agg_run(spark, tmp_path, N, keys=("key", "k2"), n=count(), hi=max_("small"))
    _agg_run(spark, tmp_path, N, n=count(), hi=max_("small"))  # unchanged: continues
    got = read_state(spark, str(tmp_path / "ckpt"), "totals")
    assert got.agg(F.sum("n")).first()[0] == N


# -- the rules, without Spark --------------------------------------------------------------
I8, I16, I32, I64 = pa.int8(), pa.int16(), pa.int32(), pa.int64()
F32, F64, S = pa.float32(), pa.float64(), pa.string()


def D(p, s):  # DECIMAL(p, s)
    return pa.decimal128(p, s)


def ST(**fields):  # STRUCT<...>
    return pa.struct(list(fields.items()))


@pytest.mark.parametrize("old, new, ok", [
    (I8, I16, True), (I16, I32, True), (I32, I64, True), (I64, I32, False), (F32, F64, True),
    (F64, F32, False), (D(10, 2), D(12, 2), True), (D(10, 2), D(11, 3), True),
    (D(10, 2), D(10, 3), False), (D(10, 2), D(12, 1), False), (I32, F64, False),
    (S, I64, False), (I64, S, False), (pa.list_(I32), pa.list_(I64), True),
    (pa.list_(I64), pa.list_(I32), False), (pa.map_(S, I32), pa.map_(S, I64), True),
    (pa.map_(I32, I32), pa.map_(I64, I32), False),
    (ST(a=I32, b=S), ST(b=S, c=pa.date32(), a=I64), True), (ST(a=I32), ST(a=I16), False),
    (pa.list_(I32), I32, False), (pa.timestamp("us", "UTC"), pa.timestamp("us"), False),
    (pa.date32(), pa.timestamp("us", "UTC"), False),
])
def test_widening_rules(old, new, ok):
    assert (type_problem(old, new, "v") is None) == ok


def test_evolved_files_read_nested_values_exactly():
    stored = pa.schema([("a", I32), ("s", ST(x=I32, y=S)), ("l", pa.list_(ST(x=I32))),
                        ("m", pa.map_(S, pa.list_(I32))), ("d", D(5, 2)), ("gone", S)])
    declared = pa.schema([("m", pa.map_(S, pa.list_(I64))), ("renamed", I64),
                          ("l", pa.list_(ST(z=S, x=I64))), ("s", ST(y=S, x=I64)),
                          ("d", D(8, 3)), ("new", F64)])
    ev = plan_evolution("operator t", stored, declared, {"a": "renamed"})
    assert ev.changed and ev.removed == ("gone",) and ev.added == ("new",)
    rows = [dict(a=1, s={"x": 2, "y": "q"}, l=[{"x": 3}, None], m=[("k", [4, None])],
                 d=decimal.Decimal("1.25"), gone="g"),
            dict(a=None, s=None, l=None, m=None, d=None, gone=None)]
    table = pa.Table.from_pylist(rows * 3, stored).slice(1)
    out = evolve_table(table, declared, ev.sources, "file")
    assert out.schema == declared
    assert out.to_pylist()[:2] == [
        dict(m=None, renamed=None, l=None, s=None, d=None, new=None),
        dict(m=[("k", [4, None])], renamed=1, l=[{"z": None, "x": 3}, None],
             s={"y": "q", "x": 2}, d=decimal.Decimal("1.250"), new=None)]


def test_json_and_typed_variables_do_not_convert():
    from spark_ckpt.state.schema import StateSchema, StateVar

    stored = StateSchema([StateVar("doc", S, True)])
    declared = StateSchema([StateVar("doc", S, False)])
    with pytest.raises(StateSchemaError, match="json and typed state do not convert"):
        plan_evolution("operator t", stored.arrow(), declared.arrow(),
                       stored_json=stored.json_flags, declared_json=declared.json_flags)


def test_key_order_is_part_of_the_key(spark, tmp_path):
    _agg_run(spark, tmp_path, N // 3, keys=("key", "k2"), n=count())
    with pytest.raises(StateSchemaError, match="their order"):
        _agg_run(spark, tmp_path, N, keys=("k2", "key"), n=count())


def test_ttl_deadlines_follow_a_rename_and_leave_with_a_removed_variable():
    stored = pa.schema([("_kg", pa.int32()), ("key", I64), ("a", I64), ("gone", S),
                        ("_expires", pa.map_(S, I64))])
    declared = pa.schema([("_kg", pa.int32()), ("key", I64), ("b", I64),
                          ("_expires", pa.map_(S, I64))])
    table = pa.Table.from_pylist([
        {"_kg": 1, "key": 7, "a": 1, "gone": "x", "_expires": [("a", 100), ("gone", 200)]},
        {"_kg": 1, "key": 8, "a": None, "gone": "y", "_expires": [("gone", 300)]},
        {"_kg": 1, "key": 9, "a": 2, "gone": None, "_expires": None}], stored)
    ev = plan_evolution("operator t", pa.schema([stored.field("a"), stored.field("gone")]),
                        pa.schema([declared.field("b")]), {"a": "b"})
    out = evolve_table(table, declared, ev.sources, "file", ["_kg", "key"], expires_of=["b"])
    assert out.column("_expires").to_pylist() == [[("b", 100)], None, None]
    assert out.column("b").to_pylist() == [1, None, 2]
