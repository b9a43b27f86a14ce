"""Writing state offline (the State Processor API's write side), on a real SparkSession:
a pipeline bootstrapped from a batch table continues from it (rescaled, in both operator
kinds), and a checkpoint's state rewritten offline (keys dropped, values fixed) is what the
next run restores, with exactly the answer plain Spark gives for the same history."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from pyspark.sql import functions as F

from spark_ckpt import CheckpointError, JobDefinitionError, Settings, StreamingContext
from spark_ckpt import Result, VectorizedProcessor, raw_state, read_state, rewrite_state
from spark_ckpt.state.aggregates import count, sum_

KEYS = 13


class Running(VectorizedProcessor):
    state_schema = "n BIGINT, total DOUBLE"

    def process_batch(self, batch):
        st = batch.state
        sums = np.add.reduceat(batch.rows["value"].to_numpy(), batch.offsets[:-1])
        n = st["n"].fillna(0).to_numpy("int64") + batch.sizes
        total = st["total"].fillna(0.0).to_numpy() + sums
        return Result(state=pd.DataFrame({"n": n, "total": total}),
                      emit=batch.keys.assign(n=n))


def _ctx(spark, ckpt, rows, parallelism, kind="agg"):
    ctx = StreamingContext(spark, 0.05, str(ckpt), "boot",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             state_max_parallelism=16))
    gen = ctx.generator_stream("gen", rows_per_batch=200, total_rows=rows, keys=KEYS)
    keyed = gen.key_by("key", parallelism=parallelism)
    if kind == "agg":
        keyed.agg("totals", n=count(), total=sum_("id")).write_parquet(str(ckpt) + "-out",
                                                                       name="out")
    else:
        keyed.process(Running(), "key BIGINT, n BIGINT", name="totals") \
            .write_parquet(str(ckpt) + "-out", name="out")
    return ctx


def _seed(spark):
    """A batch table of earlier totals for keys 0..KEYS+4 (some keys the stream never has)."""
    return spark.range(KEYS + 5).select(F.col("id").alias("key"),
                                        (F.col("id") * 10).alias("n"),
                                        (F.col("id") * 100).alias("total"))


@pytest.mark.parametrize("kind", ["agg", "process"])
def test_a_pipeline_bootstrapped_from_a_table_continues_from_it(spark, tmp_path, kind):
    from test_keyed_state import generated

    ckpt = tmp_path / "ckpt"
    seed = _seed(spark)
    if kind == "process":
        seed = seed.withColumn("total", F.col("total").cast("double"))
    assert _ctx(spark, ckpt, 600, 3, kind).bootstrap_state({"totals": seed}) == 1
    ctx = _ctx(spark, ckpt, 600, 2, kind)  # rescaled from the bootstrap's 3 tasks
    ctx.process_available(timeout=300)
    assert ctx.restored.checkpoint_id == 1
    rows = generated(spark, 0, 600, KEYS)
    col = "id" if kind == "agg" else "value"
    stream = {r.key: (r.n, r.total) for r in rows.groupBy("key").agg(
        F.count("*").alias("n"), F.sum(col).alias("total")).collect()}
    got = {r.key: (r.n, r.total) for r in read_state(spark, str(ckpt), "totals").collect()}
    assert set(got) == set(range(KEYS + 5))
    for key, (n, total) in got.items():
        sn, st = stream.get(key, (0, 0))
        assert n == key * 10 + sn, key
        assert total == pytest.approx(key * 100 + st), key


def test_bootstrap_refuses_bad_tables_and_a_pipeline_that_ran(spark, tmp_path):
    ckpt = tmp_path / "ckpt"
    doubled = _seed(spark).unionByName(_seed(spark).where("key = 3"))
    with pytest.raises(JobDefinitionError, match=r"expected one row per key, found key "
                                                 r"\{'key': 3\} 2 times"):
        _ctx(spark, ckpt, 200, 2).bootstrap_state({"totals": doubled})
    with pytest.raises(JobDefinitionError, match="unknown: \\['bogus'\\]"):
        _ctx(spark, ckpt, 200, 2).bootstrap_state(
            {"totals": _seed(spark).withColumn("bogus", F.lit(1))})
    with pytest.raises(JobDefinitionError, match="no stateful operator \\['nope'\\]"):
        _ctx(spark, ckpt, 200, 2).bootstrap_state({"nope": _seed(spark)})
    _ctx(spark, ckpt, 200, 2).process_available(timeout=300)
    with pytest.raises(CheckpointError, match="writes a pipeline's first checkpoint"):
        _ctx(spark, ckpt, 200, 2).bootstrap_state({"totals": _seed(spark)})


def test_a_rewritten_checkpoint_is_what_the_next_run_restores(spark, tmp_path):
    from test_keyed_state import generated

    ckpt = tmp_path / "ckpt"
    _ctx(spark, ckpt, 1000, 2).process_available(timeout=300)
    before = raw_state(spark, str(ckpt), "totals")
    assert sorted(before.columns) == ["key", "n", "total"] and before.count() == KEYS

    def fix(df):  # drop keys below 5, double key 7's count, into 3 tasks
        return df.where("key >= 5").withColumn(
            "n", F.when(F.col("key") == 7, F.col("n") * 2).otherwise(F.col("n")))

    with pytest.raises(JobDefinitionError, match=r"key bigint \(the state's: int\)|"
                                                 r"key int \(the state's: bigint\)"):
        rewrite_state(spark, str(ckpt), "totals",
                      lambda df: df.withColumn("key", F.col("key").cast("int")))
    new_id = rewrite_state(spark, str(ckpt), "totals", fix, parallelism=3)
    got = {r.key: r.n for r in read_state(spark, str(ckpt), "totals").collect()}
    counted = {r.key: r.n for r in generated(spark, 0, 1000, KEYS).groupBy("key")
               .agg(F.count("*").alias("n")).collect()}
    assert got == {k: (2 * n if k == 7 else n) for k, n in counted.items() if k >= 5}
    ctx = _ctx(spark, ckpt, 1600, 2)
    ctx.process_available(timeout=300)
    assert ctx.restored.checkpoint_id == new_id
    later = {r.key: r.n for r in generated(spark, 1000, 1600, KEYS).groupBy("key")
             .agg(F.count("*").alias("n")).collect()}
    final = {r.key: r.n for r in read_state(spark, str(ckpt), "totals").collect()}
    want = {k: (0 if k < 5 else (2 * counted[k] if k == 7 else counted[k])) + later.get(k, 0)
            for k in counted}
    assert final == want
