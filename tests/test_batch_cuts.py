"""Cost-aware durable cuts: where a batch job becomes durable, decided as Spark places its
shuffles, and never worse than starting over. Real Spark jobs, real files, real SIGKILLs."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner
from pyspark.sql import functions as F

import batch_shapes as shapes
from helpers import LONG_FAULTS, ROOT, child_env, defaults_text
from spark_ckpt import BatchJob, Settings
from spark_ckpt.batch.aggsplit import NotSplittable, SplitSet, check_split, split_aggregate
from spark_ckpt.batch.cuts import waves_of
from spark_ckpt.batch.runner import job_paths
from spark_ckpt.eventlog.reader import read_table
from spark_ckpt.eventlog.replay import replay_table
from spark_ckpt.ops.cli import main as cli
from spark_ckpt.storage import Storage
from spark_ckpt.storage.delta_reader import read_delta

# exchanges however small the tests' inputs (spark.ckpt.batch.exchangeMinBytes=0): the
# orders report's join runs through its durable exchanges, as a large job's does
SETTINGS = Settings(progress="never", event_log_flush_interval_ms=200, batch_exchange_min_bytes=0)
KILLED = -signal.SIGKILL


@pytest.fixture(scope="module")
def shape_input(tmp_path_factory):
    """Small inputs of the report and join shapes (8 files each)."""
    directory = tmp_path_factory.mktemp("shapes")
    for shape in ("report", "join"):
        shapes.generate(shape, str(directory / shape), rows=40_000, files=8, seed=5)
    return directory


def _load(path: str) -> pd.DataFrame:
    if os.path.isdir(f"{path}/_delta_log"):
        return read_delta(path).to_pandas()
    return ds.dataset(path, format="parquet", partitioning="hive",
                      exclude_invalid_files=True).to_table().to_pandas()


def assert_same_rows(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Equal rows; floating-point columns to 1e-9 relative (Spark's own double sums depend
    on how the rows are partitioned)."""
    got = got[list(want.columns)]
    exact = [c for c in want.columns if want[c].dtype.kind != "f"]
    got = got.sort_values(exact).reset_index(drop=True)
    want = want.sort_values(exact).reset_index(drop=True)
    assert len(got) == len(want)
    pd.testing.assert_frame_equal(got[exact].astype(str), want[exact].astype(str))
    for c in want.columns:
        if want[c].dtype.kind == "f":
            assert np.allclose(got[c].to_numpy(), want[c].to_numpy(), rtol=1e-9,
                               equal_nan=True), c


def plain_output(spark, shape: str, shape_input, tmp_path) -> str:
    out = str(tmp_path / "plain")
    shapes.plain(shape, spark, str(shape_input / shapes.INPUT_OF.get(shape, shape)), out)
    return out


# -- the split of an aggregation ---------------------------------------------------------------
def test_waves_start_small_and_cover_every_partition_once():
    """The first two waves are a quarter and a half of the wave size (a job killed early keeps
    them); every partition is in exactly one wave, in order; a set size has no ramp."""
    from spark_ckpt.batch.cuts import waves_of

    assert [len(w) for w in waves_of(list(range(64)), 8, ramp=True)] == [2, 4] + [8] * 7 + [2]
    assert [len(w) for w in waves_of(list(range(64)), 8, ramp=False)] == [8] * 8
    assert waves_of([5, 9, 11], 8, ramp=True) == [[5, 9], [11]]
    assert waves_of(list(range(3)), 1, ramp=True) == [[0], [1], [2]]
    assert waves_of([], 8, ramp=True) == []
    for n, size in ((64, 16), (13, 4), (7, 2), (1, 8)):
        waves = waves_of(list(range(n)), size, ramp=True)
        assert [p for w in waves for p in w] == list(range(n))
        assert all(0 < len(w) <= size for w in waves)
    # map-side partials: durable task by task, so one Spark job (up to 256 splits) unless
    # partitionsPerWave says otherwise
    from spark_ckpt.batch.planning import MAP_SIDE_UNIT, run_units
    from spark_ckpt.execution.job_graph import Edge, JobVertex

    vertex = JobVertex("agg-partial", 600, inputs=(Edge("src", "forward"),), fn=lambda d: d)
    vertex.partial_of = "agg"
    ramped = run_units(vertex, list(range(600)), SETTINGS)
    assert [len(u) for u in ramped][:3] == [18, 37, 75]  # (waves of 75, ramped)
    vertex.map_side = True
    assert [len(u) for u in run_units(vertex, list(range(600)), SETTINGS)] == \
        [MAP_SIDE_UNIT, MAP_SIDE_UNIT, 600 - 2 * MAP_SIDE_UNIT]
    three = dataclasses.replace(SETTINGS, batch_partitions_per_wave=3)
    assert [len(u) for u in run_units(vertex, list(range(7)), three)] == [3, 3, 1]


def test_split_aggregate_gives_plain_sparks_answer(spark):
    """Partials of any number of waves (an empty one included) merge to the aggregation's own
    answer: null keys, null values, decimals, averages, expressions over aggregates."""
    df = spark.range(3000).select(
        F.when(F.col("id") % 11 == 0, None).otherwise((F.col("id") % 4).cast("int")).alias("k"),
        F.when(F.col("id") % 5 == 0, None).otherwise(F.col("id") * 1.5).alias("d"),
        (F.col("id") % 97).cast("decimal(12,2)").alias("dec"),
        F.concat(F.lit("s"), (F.col("id") % 13).cast("string")).alias("s"),
        F.col("id"))

    def fn(x):
        return x.where("id > 3").groupBy("k").agg(
            F.count("*").alias("n"), F.count("d").alias("nd"),
            F.round(F.sum("d"), 2).alias("sum_d"), F.avg("d").alias("avg_d"),
            F.max("dec").alias("max_dec"), F.sum("dec").alias("sum_dec"),
            F.min("s").alias("min_s"), (F.sum("id") / F.count("d")).alias("ratio"),
            F.min("k").alias("k_again"))

    whole = fn(df)
    split = split_aggregate(whole)
    check_split(split, whole)
    waves = [split.partial_frame(fn(df.where(f"id % 3 = {i}"))) for i in range(3)]
    waves.append(split.partial_frame(fn(df.where("id < 0"))))  # an empty wave
    union = waves[0]
    for w in waves[1:]:
        union = union.unionByName(w)
    final = split.final_frame(union)
    assert final.schema.simpleString() == whole.schema.simpleString()
    assert_same_rows(final.toPandas(), whole.toPandas())
    # no rows at all: no groups, as Spark gives
    assert split.final_frame(waves[-1]).count() == 0 == fn(df.where("id < 0")).count()


def test_map_side_is_sparks_map_stage_only_where_a_merge_of_buffers_is_the_answer(
        spark, tmp_path):
    """The seam's cut below the exchange: each task's partial aggregates of the files it
    reads (named for each task, so its split is known), which merged with the same functions
    give plain Spark's rows; refused (None) where the buffer is not the result, the plan does
    more than aggregate, or the map side reads anything but files."""
    from spark_ckpt.sources.job_inputs import normalize_path
    from spark_ckpt.sparkapi import empty_frame, frame_api
    from spark_ckpt.session import session_conf

    files, sizes = [], {}
    for i, (lo, hi) in enumerate([(0, 1000), (1000, 3000), (3000, 6000)]):  # 1000, 2000, 3000
        spark.range(lo, hi, 1, 1).write.parquet(str(tmp_path / f"f{i}"))
        files.append(next(str(f) for f in (tmp_path / f"f{i}").glob("*.parquet")))
        sizes[normalize_path(files[-1])] = hi - lo

    def rows_read(reads):  # the rows of the files each task names
        return [sum(sizes[normalize_path(f)] for f in r) for r in reads]

    def rows_of(df):
        return df.selectExpr("id % 7 AS k", "id % 5 AS x", "CAST(id AS DOUBLE) / 3 AS v")

    def aggregated(df):  # (an aggregate written twice is computed once: both its buffer)
        return rows_of(df).groupBy("k", "x").agg(
            F.count("*").alias("n"), F.sum("v").alias("s"), F.min("v").alias("lo"),
            F.max("x").alias("hi"), F.count("*").alias("n2"))

    def merged(df):
        return df.groupBy("k", "x").agg(F.sum("n").alias("n"), F.sum("s").alias("s"),
                                        F.min("lo").alias("lo"), F.max("hi").alias("hi"),
                                        F.sum("n2").alias("n2"))

    whole = str(1 << 40)
    with session_conf(spark, "spark.sql.adaptive.enabled", "false"), \
            session_conf(spark, "spark.sql.unionOutputPartitioning", "false"), \
            session_conf(spark, "spark.sql.files.maxPartitionBytes", whole):
        # (a) a union of one-file reads (a split's scan each) and an empty split's frame
        union = spark.read.parquet(files[0]).union(spark.read.parquet(files[2])).union(
            empty_frame(spark, spark.read.parquet(files[0]).schema).coalesce(1)).union(
            spark.read.parquet(files[1]))
        good = aggregated(union)
        api = frame_api(good)
        assert api.map_side_plan(good)
        found = api.map_side(good)
        assert found is not None
        mapped, reads = found
        assert [[normalize_path(f) for f in r] for r in reads] == \
            [[normalize_path(files[0])], [normalize_path(files[2])], [], [normalize_path(files[1])]]
        assert mapped.columns == good.columns and mapped.rdd.getNumPartitions() == 4
        # each task's own groups: task t's partials are exactly those of its files' rows
        per_task = mapped.rdd.mapPartitions(lambda it: [sum(r.n for r in it)]).collect()
        assert per_task == rows_read(reads) == [1000, 3000, 0, 2000]
        assert mapped.count() > merged(mapped).count() == good.count()
        assert_same_rows(merged(mapped).toPandas(), good.toPandas())
        # (b) one scan of the three files, a file a task (its open cost a whole partition):
        # the stage plain Spark runs, the files of each task named
        with session_conf(spark, "spark.sql.files.openCostInBytes", whole):
            one = aggregated(spark.read.parquet(*files))
            found = frame_api(one).map_side(one)
            assert found is not None and len(found[1]) == 3
            assert sorted(normalize_path(f) for r in found[1] for f in r) == \
                sorted(normalize_path(f) for f in files)
            assert all(len(r) == 1 for r in found[1])
            sums = found[0].rdd.mapPartitions(lambda it: [sum(r.n for r in it)]).collect()
            assert sums == rows_read(found[1]) and sorted(sums) == [1000, 2000, 3000]
            assert_same_rows(merged(found[0]).toPandas(), one.toPandas())
        # (c) a scan Spark packs into one task (no open cost): one task, both files named
        with session_conf(spark, "spark.sql.files.openCostInBytes", "0"), \
                session_conf(spark, "spark.sql.files.minPartitionNum", "1"):
            packed = aggregated(spark.read.parquet(files[0], files[1]))
            found = frame_api(packed).map_side(packed)
        assert found is not None and len(found[1]) == 1 and len(found[1][0]) == 2
        # refused: not a merge of buffers, more than an aggregation, not files
        rows = rows_of(union)
        refused = [rows.groupBy("k").agg(F.avg("v")),  # (sum, count): not its result
                   rows.groupBy("k").agg(F.expr("try_sum(CAST(v AS BIGINT))")),  # (sum, isEmpty)
                   rows.groupBy("k").agg(F.sum("v").alias("s")).orderBy("k"),
                   rows.groupBy("k").agg((F.sum("v") * 2).alias("s")),
                   rows.groupBy("k").agg(F.collect_list("v")),
                   rows.groupBy("k").agg(F.sum(F.col("v").cast("decimal(12,2)")))]
        for df in refused:
            assert not api.map_side_plan(df), df
            assert api.map_side(df) is None
        ranged = spark.range(0, 3000, 1, 3).selectExpr("id % 7 AS k").groupBy("k").count()
        assert api.map_side_plan(ranged) and api.map_side(ranged) is None  # no files read
        # two aggregations of one input, tagged and unioned (as SplitSet writes them): a map
        # stage each, their tasks in turn (Spark runs a stage's tasks in partition order: a
        # split's two tasks end together, not the second after every first)
        by_x = rows.groupBy("x").agg(F.count("*").alias("n"))
        both = good.select("k", "x", "n", F.lit(0).alias("tag")).unionByName(
            by_x.select("x", "n", F.lit(1).alias("tag")), allowMissingColumns=True)
        assert api.map_side_plan(both)
        found = api.map_side(both)
        assert found is not None and len(found[1]) == 8
        assert found[1] == [r for r in reads for _ in range(2)]
        parts = found[0].rdd.mapPartitions(lambda it: [sorted({r.tag for r in it})]).collect()
        assert parts == [[0], [1]] * 2 + [[], []] + [[0], [1]]
        counted = found[0].rdd.mapPartitions(lambda it: [sum(r.n for r in it)]).collect()
        assert counted == rows_read(found[1])  # each aggregation counts its task's rows
        # (the other aggregation's columns are nulls: the schema says so)
        assert [f.nullable for f in found[0].schema.fields] == \
            [f.nullable for f in both.schema.fields]
        again = found[0].groupBy("tag", "k", "x").agg(F.sum("n").alias("n"))
        assert sorted(map(repr, again.select(*both.columns).collect())) == \
            sorted(map(repr, both.collect()))
    assert frame_api(good).map_side_plan(good)  # planned under adaptive execution too


def test_a_split_of_map_side_partials_is_recorded_once_every_task_of_it_committed(
        spark, tmp_path):
    """FileWatcher with a task a file: the split of tasks 0 and 1 waits for both files; a
    split whose tasks are not all in place waits for its write's end; a file of a task that
    reads no split's file with rows is refused, not dropped. Real Parquet files, named as
    Spark's tasks name theirs."""
    import types

    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_ckpt.batch.file_watcher import FileWatcher, UnitWrite
    from spark_ckpt.clock import ManualClock
    from spark_ckpt.errors import TaskExecutionError
    from spark_ckpt.execution.job_graph import JobVertex

    recorded = []

    def finished(result):
        recorded.append((result.partition, sorted(o.path.rsplit("/", 1)[1][:10]
                                                   for o in result.outputs), result.rows))
        return True

    job = types.SimpleNamespace(spark=spark, settings=SETTINGS, clock=ManualClock(0),
                                run_id="j", finished={}, partition_finished=finished)
    progress = types.SimpleNamespace(advance=lambda vertex_id: None)
    executions = {p: types.SimpleNamespace(attempt_id=f"e{p}") for p in (4, 5)}
    out = tmp_path / "unit"
    out.mkdir()

    def task_file(index, rows):
        pq.write_table(pa.table({"n": list(range(rows))}),
                       str(out / f"part-{index:05d}-0f1e-c000.snappy.parquet"))

    def watcher(task_parts):
        write = UnitWrite("result", "v", str(out))
        return write, FileWatcher(job, {"v": "{}"}, progress, JobVertex("v", 2), [4, 5],
                                  [write], executions, 0, task_parts=task_parts)

    write, tracker = watcher([4, 4, 5, 5, -1])  # splits 4 and 5, two tasks each
    task_file(1, 3)
    tracker.record_visible()
    assert recorded == []  # split 4's task 0 has not committed
    task_file(3, 2)
    task_file(0, 1)
    tracker.record_visible()
    assert recorded == [(4, ["part-00000", "part-00001"], 4)]  # not 5: task 2 is missing
    write.done = True  # task 2 wrote no rows: its split's rows are task 3's
    tracker.finish()
    assert recorded[1:] == [(5, ["part-00003"], 2)]
    # rows in the file of a task that reads no split's file: a scheduling bug, said so
    recorded.clear()
    task_file(4, 1)
    write, tracker = watcher([4, 4, 5, 5, -1])
    write.done = True
    with pytest.raises(TaskExecutionError, match="map task 4 .* reads no file of"):
        tracker.finish()

    # which split each task's files belong to; a task reading two splits' files, or a file
    # of no split of the unit, or two files spelled alike: no mapping (the wave merges)
    from spark_ckpt.batch.vertex_runner import VertexRunner

    source = JobVertex("src", 3, source=types.SimpleNamespace())
    runner = types.SimpleNamespace(
        graph=None, job=types.SimpleNamespace(run_id="j", attempt=1),
        frames=types.SimpleNamespace(splits={"src": [[("file:///d/a%20b.parquet", 1)],
                                                     [("/d/c.parquet", 1)],
                                                     [("/d/e.parquet", 1), ("/d/f.parquet", 1)]]}))

    def task_parts(parts, reads):
        return VertexRunner._task_parts(runner, source, parts, reads)

    assert task_parts([0, 1, 2], [("file:/d/a b.parquet",), ("/d/f.parquet", "/d/e.parquet"),
                                  (), ("file:/d/c.parquet",)]) == [0, 2, -1, 1]
    assert task_parts([0, 1], [("/d/c.parquet", "/d/a b.parquet")]) is None
    assert task_parts([0, 1], [("/d/e.parquet",)]) is None  # split 2 is not in the unit
    runner.frames.splits["src"][1] = [("/d/a b.parquet", 1)]
    assert task_parts([0, 1], [("/d/a b.parquet",)]) is None


def test_an_aggregation_is_split_whatever_the_function_does_after_it(spark):
    """The aggregation inside the function is split (its distinct, holistic and plain
    aggregates) and the rest of the function (a join with a small table, a window function,
    a filter, a sort, a second aggregation) runs over the merged partials: plain Spark's
    rows, from partials of any number of waves."""
    from pyspark.sql import Window

    from spark_ckpt.sparkapi import empty_frame

    df = spark.range(3000).select(
        F.when(F.col("id") % 11 == 0, None).otherwise((F.col("id") % 4).cast("int")).alias("k"),
        F.when(F.col("id") % 5 == 0, None).otherwise(F.col("id") * 1.5).alias("d"),
        (F.col("id") % 97).cast("decimal(12,2)").alias("dec"),
        F.when(F.col("id") % 7 == 0, None)
        .otherwise(F.concat(F.lit("s"), (F.col("id") % 13).cast("string"))).alias("s"),
        F.col("id"))
    small = spark.createDataFrame([(0, "a"), (1, "b"), (2, "c")], "k int, name string")

    def report(x, names):
        per_k = x.where("id > 3").groupBy("k").agg(
            F.count("*").alias("n"), F.countDistinct("s").alias("distinct_s"),
            F.expr("max(DISTINCT s)").alias("max_distinct_s"), F.avg("d").alias("avg_d"),
            F.sum("dec").alias("sum_dec"), F.sort_array(F.collect_set("s")).alias("set_s"),
            F.min("id").alias("first_id"))
        w = Window.partitionBy(F.col("k") % 2).orderBy(F.desc("n"), "k")
        return per_k.join(F.broadcast(names), "k", "left") \
            .withColumn("rank", F.rank().over(w)).where("n > 0").orderBy("k")

    def percentiles(x, names):
        return x.groupBy("k").agg(F.median("d").alias("median_d"),
                                  F.percentile("d", [0.1, 0.9]).alias("p"),
                                  F.count("*").alias("n")).select("k", "median_d", "p")

    def second_aggregation(x, names):
        return x.groupBy("k", "s").agg(F.sum("id").alias("t")) \
            .groupBy("k").agg(F.max("t").alias("top"), F.count("*").alias("values"))

    leaf = empty_frame(spark, df.schema)
    for fn, after in ((report, {"Sort", "Window", "Join"}), (percentiles, {"Project"}),
                      (second_aggregation, {"Aggregate"})):
        over_leaf = fn(leaf, small)
        split = split_aggregate(over_leaf, leaf)
        check_split(split, over_leaf)
        assert after <= set(split.after), split.after
        waves = [split.partial_frame(fn(df.where(f"id % 3 = {i}"), small)) for i in range(3)]
        waves.append(split.partial_frame(fn(df.where("id < 0"), small)))  # an empty wave
        partials = waves[0]
        for wave in waves[1:]:
            partials = partials.unionByName(wave)
        got = split.final_fn(fn, df.schema)(partials, small)
        want = fn(df, small)
        assert got.schema.simpleString() == want.schema.simpleString()
        assert_same_rows(_arrays_as_text(got.toPandas()), _arrays_as_text(want.toPandas()))
        if fn is report:  # sorted by k: the same order too
            assert [r.k for r in got.collect()] == [r.k for r in want.collect()]


def test_a_function_that_plans_otherwise_over_rows_is_refused_not_misread(spark):
    """A function whose plan depends on its rows: over the empty input it was planned on the
    aggregation is under a sort, over a wave's rows under a projection and a limit too. The
    wave's partial step refuses it rather than take another node's rows for the aggregation's
    input."""
    from spark_ckpt.sparkapi import empty_frame

    df = spark.range(100).withColumn("k", F.col("id") % 3)

    def fn(x):
        per_k = x.groupBy("k").agg(F.sum("id").alias("t"))
        if x.isEmpty():
            return per_k.orderBy("k")
        return per_k.select("k", (F.col("t") + 1).alias("t")).limit(10).orderBy("k")

    leaf = empty_frame(spark, df.schema)
    split = split_aggregate(fn(leaf), leaf)
    with pytest.raises(NotSplittable, match="no aggregation where it had one"):
        split.partial_frame(fn(df))


def test_what_reads_rows_a_split_does_not_have_is_refused_and_identities_are_not(spark):
    """A subquery over the input (after the aggregation it would read the empty planning
    input, before it a wave's rows) is refused; an empty broadcast input of the input's column
    types is not taken for the input; an alias, a select of every column or a hint over the
    input are the input read once."""
    from spark_ckpt.batch.aggsplit import input_leaf
    from spark_ckpt.sparkapi import empty_frame

    df = spark.range(300).withColumn("k", F.col("id") % 3)
    leaf = input_leaf(spark, df.schema)
    above = leaf.groupBy("k").agg(F.sum("id").alias("t")).where(
        F.col("t") > leaf.select(F.avg("id")).scalar())
    with pytest.raises(NotSplittable, match="subquery"):
        split_aggregate(above, leaf)
    below = leaf.withColumn("m", leaf.select(F.max("id")).scalar()).groupBy("k").agg(
        F.max("m").alias("m"))
    with pytest.raises(NotSplittable, match="subquery"):
        split_aggregate(below, leaf)
    # a broadcast input with the same column types, empty as the planner makes it
    other = empty_frame(spark, df.schema)
    both = leaf.groupBy("k").agg(F.sum("id").alias("t")).join(
        other.groupBy("k").agg(F.sum("id").alias("goal")), "k")
    split = split_aggregate(both, leaf)
    assert not isinstance(split, SplitSet) and split.path, split
    for same in (leaf.alias("x"), leaf.select("*"), leaf.select("id", "k"), leaf.hint("foo")):
        one = split_aggregate(same.groupBy("k").agg(F.count("*").alias("n")), same)
        assert one.grouping == ("k",)


@pytest.mark.slow
def test_a_consumer_that_joins_a_broadcast_input_after_aggregating(spark, shape_input,
                                                                   tmp_path):
    """The consumer reads the chained vertex hashed and a small table broadcast, and joins the
    small table after its aggregation: the partial vertex reads the small table too (as the
    function does), the cut is the aggregation's partials, and the output is plain Spark's."""
    src = str(shape_input / "report")
    out, work = str(tmp_path / "out"), str(tmp_path / "work")

    def months(flights):
        return flights.withColumn("month", F.date_format("departed", "yyyy-MM"))

    def report(enriched, carriers):
        return enriched.groupBy("carrier_id", "month").agg(
            F.count("*").alias("n"), F.countDistinct("tail").alias("planes")) \
            .join(carriers, "carrier_id").orderBy("carrier_id", "month")

    settings = dataclasses.replace(SETTINGS, batch_cut_max_percent=400)
    job = BatchJob("bc", spark=spark, work_dir=work, settings=settings)
    flights = job.read_files("flights", f"{src}/flights")
    carriers = job.read_files("carriers", f"{src}/carriers", parallelism=1)
    enriched = job.vertex("enriched", months, flights)
    rows = job.vertex("report", report, enriched.by("carrier_id", "month"),
                      carriers.broadcast(), parallelism=4)
    job.write_parquet(rows, f"{out}/report")
    plan = job.explain(show=False)
    assert plan.cuts["report-partial"].durable, str(plan)
    result = job.run()
    assert result.vertices["report-partial"].ran == 8
    want = report(months(spark.read.parquet(f"{src}/flights")),
                  spark.read.parquet(f"{src}/carriers"))
    assert_same_rows(_load(f"{out}/report"), want.toPandas())


def _arrays_as_text(frame: pd.DataFrame) -> pd.DataFrame:
    for column in frame.columns:
        if frame[column].map(lambda v: isinstance(v, np.ndarray)).any():
            frame[column] = frame[column].map(lambda v: str(list(v)))
    return frame


@pytest.mark.parametrize("fn, why", [
    (lambda x: x.groupBy("k").agg(F.countDistinct("id"), F.countDistinct("k2")),
     "another distinct"),
    (lambda x: x.groupBy("k").agg(F.sum("id").alias("t")).join(x, "k"), "its input 2 times"),
    (lambda x: x.groupBy("k").agg(F.sum("id").alias("t")).join(
        x.groupBy("k").agg(F.max("id").alias("m")), "k").join(x, "k"),
     "input 3 times, once without"),
    (lambda x: x.groupBy("k").agg(F.percentile_approx("id", 0.5)), "no partial form"),
    (lambda x: x.groupBy((F.col("k") + 1).alias("k1")).agg(F.sum("id")), "not a column"),
    (lambda x: x.groupBy("k").agg(F.avg(F.col("id").cast("decimal(10,2)"))), "decimal"),
    (lambda x: x.groupBy("k").agg(F.collect_list("id")), "no partial form"),
    (lambda x: x.groupBy("k").agg(F.sum("id").alias("__sck_x")), "__sck_"),
    (lambda x: x.agg(F.sum("id")), "without grouping"),
    # what runs before the aggregation must be row by row: a wave is not a partition
    (lambda x: x.dropDuplicates(["id"]).groupBy("k").agg(F.count("*")), "Deduplicate"),
    (lambda x: x.limit(5).groupBy("k").agg(F.count("*")), "Limit"),
    (lambda x: x.withColumn("r", F.rand()).groupBy("k").agg(F.sum("r")), "deterministic"),
    (lambda x: x.groupBy("k").agg(F.expr("try_sum(id)")), "try_"),
    # an aggregate's text inside a literal or another name cannot be substituted (the literal
    # holds the text both kinds of session write: sum(id) on classic, sum(`id`) on Spark
    # Connect, whose client writes every column name backquoted)
    (lambda x: x.groupBy("k").agg(F.format_string("sum(id) sum(`id`) %d", F.sum("id"))),
     "elsewhere"),
])
def test_aggregations_without_a_partial_form_are_refused_naming_why(spark, fn, why):
    from spark_ckpt.sparkapi import empty_frame

    df = spark.range(10).withColumn("k", F.col("id") % 2).withColumn("k2", F.col("id") % 3)
    if "input" not in why:  # (without a leaf, the input cannot be told from other frames)
        with pytest.raises(NotSplittable, match=why):
            split_aggregate(fn(df))
    leaf = empty_frame(spark, df.schema)  # as the planner asks: the function over a leaf
    with pytest.raises(NotSplittable, match=why):
        split_aggregate(fn(leaf), leaf)


# -- the default cuts --------------------------------------------------------------------------
def test_default_cuts_chain_the_join_and_make_partial_aggregates_durable(
        spark, shape_input, tmp_path):
    out = str(tmp_path / "out")
    work = str(tmp_path / "work")
    job = shapes.build("report", BatchJob("report", spark=spark, work_dir=work,
                                          settings=SETTINGS),
                       str(shape_input / "report"), out, parallelism=4)
    plan = job.explain(show=False)
    assert not plan.cuts["enriched"].durable and plan.cuts["enriched"].partial
    assert plan.cuts["report-partial"].durable
    assert plan.cuts["report-partial"].est_bytes is not None
    assert plan.cuts["report-partial"].ratio < 0.10
    assert any("hashpartitioning(carrier, month" in e
               for e in plan.cuts["report-partial"].exchanges)
    # the partials are Spark's map stage alone, one task a split, each durable as it commits
    # (report then shuffles them, as Spark's own job does): no wave merges them
    assert "per split of enriched's splits (Spark's map stage alone" in \
        plan.cuts["report-partial"].reason, str(plan)
    assert plan.cuts["report-partial"].bucket_for is None
    text = str(plan)
    assert "enriched: chained: report aggregates it" in text
    assert "report: durable: has sinks (report-delta)" in text
    assert not (tmp_path / "work").exists(), "explain must write nothing"

    adaptive = spark.conf.get("spark.sql.adaptive.enabled")
    result = job.run()
    assert {v: s.ran for v, s in result.vertices.items()} == {"report-partial": 8, "report": 4}
    assert_same_rows(_load(f"{out}/report"),
                     _load(f"{plain_output(spark, 'report', shape_input, tmp_path)}/report"))
    # each partial wave is one stage, Spark's map stage, one task a split of the wave; the
    # session's settings are its own again
    tracker = spark.sparkContext.statusTracker()
    # the vertex's 8 splits in one Spark job (one unit, the whole vertex), one stage of one
    # task a split (no merge stage); waves of several splits: the next test
    jobs = tracker.getJobIdsForGroup("spark_ckpt-report-a1-report-partial-u0")
    stages = [tracker.getStageInfo(s) for j in jobs for s in tracker.getJobInfo(j).stageIds]
    ran = [(i.stageId, i.numTasks) for i in stages if i is not None and i.numCompletedTasks]
    assert [t for _, t in ran if t > 1] == [8], ran  # (broadcasts: jobs of one task each)
    assert not tracker.getJobIdsForGroup("spark_ckpt-report-a1-report-partial-u1")
    assert spark.conf.get("spark.sql.adaptive.enabled") == adaptive
    # each split's partials are its task's own file, recorded as that task committed
    storage = Storage(work)
    replayed = replay_table(read_table(storage, job_paths(storage, "report")["events"])[0])
    files = [tuple(o.path for o in f.outputs) for (v, _p), f in replayed.finished.items()
             if v == "report-partial"]
    assert len(files) == 8 and len(set(files)) == 8 and all(len(f) == 1 for f in files)

    printed = CliRunner().invoke(cli, ["plan", "report", "--work-dir", work, "--json"])
    assert printed.exit_code == 0, printed.output
    import json

    rows = {r["vertex"]: r for r in json.loads(printed.output)["vertices"]}
    assert rows["enriched"]["decision"] == "chained"
    assert rows["report-partial"]["decision"] == "durable"
    assert rows["report-partial"]["written_bytes"] > 0
    assert rows["report-partial"]["finished_partitions"] == 8
    table = CliRunner().invoke(cli, ["plan", "report", "--work-dir", work])
    assert "map-side partial aggregates" in table.output


def test_splits_too_large_for_one_task_keep_their_waves_merging(spark, shape_input, tmp_path,
                                                                  monkeypatch):
    """Map-side partials run one task a split: where a split is larger than the bound, the
    planner keeps waves that merge their partials (Spark splits their files as it likes)."""
    import spark_ckpt.batch.cuts as cuts

    def plan():
        job = shapes.build("report", BatchJob("report", spark=spark, work_dir=str(tmp_path),
                                              settings=SETTINGS),
                           str(shape_input / "report"), str(tmp_path / "out"), parallelism=4)
        return job.explain(show=False).cuts["report-partial"]

    assert plan().reason.count("Spark's map stage alone") == 1
    monkeypatch.setattr(cuts, "MAP_SIDE_MAX_SPLIT_BYTES", 1000)
    cut = plan()
    assert "per wave of enriched's splits" in cut.reason and not cut.map_side, cut.reason
    monkeypatch.setattr(cuts, "MAP_SIDE_MAX_SPLIT_BYTES", 1 << 40)
    off = dataclasses.replace(SETTINGS, batch_map_side_partials=False)
    job = shapes.build("report", BatchJob("report", spark=spark, work_dir=str(tmp_path),
                                          settings=off),
                       str(shape_input / "report"), str(tmp_path / "out"), parallelism=4)
    assert not job.explain(show=False).cuts["report-partial"].map_side


@pytest.mark.parametrize("shape, after", [
    ("sorted_report", "Sort"),
    # (f)'s window runs over the merged partials as (e)'s sort does (the same replacement);
    # test_an_aggregation_is_split_whatever_the_function_does_after_it checks a window
    pytest.param("ranked", "Window", marks=pytest.mark.skipif(
        not LONG_FAULTS, reason="the same replacement as (e); SPARK_CKPT_LONG_FAULTS=1")),
    ("two_aggregations", "Join")])
def test_the_cut_is_the_aggregations_exchange_whatever_follows_it(
        spark, shape_input, tmp_path, shape, after):
    """Shapes (e), (f) and (g): the report's function sorts its aggregation (with a distinct
    count), ranks it with a window function, or aggregates its input two ways and joins them;
    the cut is still the aggregations' partials, per wave of enriched's splits (both
    aggregations' in one unit for (g)), and the output is plain Spark's."""
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    # 5,000 rows a file here: a wave's partials hardly reduce it (millions of rows would);
    # waves of 3 splits. (g) reads its 8 files as 4 splits of 2 (each split a scan of its
    # own, one task, unioned); the others a file a split (one scan, a file a task)
    settings = dataclasses.replace(SETTINGS, batch_cut_max_percent=400,
                                   batch_partitions_per_wave=3)
    splits = 4 if shape == "two_aggregations" else 8
    job = shapes.build(shape, BatchJob(shape, spark=spark, work_dir=work, settings=settings),
                       str(shape_input / "report"), out, parallelism=4, splits=splits)
    plan = job.explain(show=False)
    partial = plan.cuts[f"{shape}-partial"]
    assert partial.durable and plan.cuts["enriched"].partial, str(plan)
    # Spark's map stage alone, task by task (one task a split and aggregation for (g))
    assert "per split of enriched's splits (Spark's map stage alone" in partial.reason
    assert f"{shape} then runs " in partial.reason and after in \
        partial.reason.split(f"{shape} then runs ")[1], str(plan)
    result = job.run()
    assert {v: s.ran for v, s in result.vertices.items()} == \
        {f"{shape}-partial": splits, shape: 4}
    assert_same_rows(_load(f"{out}/{shape}"),
                     _load(f"{plain_output(spark, shape, shape_input, tmp_path)}/{shape}"))
    # each split's partials are its own task's file (one an aggregation), not a wave's
    storage = Storage(work)
    replayed = replay_table(read_table(storage, job_paths(storage, shape)["events"])[0])
    kept = {p: f for (v, p), f in replayed.finished.items() if v == f"{shape}-partial"}
    aggregations = 2 if shape == "two_aggregations" else 1
    assert sorted(kept) == list(range(splits)) and not any(f.shared for f in kept.values())
    assert all(len(f.outputs) == aggregations for f in kept.values()), \
        [len(f.outputs) for f in kept.values()]
    assert len({o.path for f in kept.values() for o in f.outputs}) == splits * aggregations
    # the waves were Spark's map stages alone: a task a split (and aggregation), 3 splits a
    # wave, one stage a wave besides broadcasts' one-task stages
    tracker = spark.sparkContext.statusTracker()
    for number, wave in enumerate(map(len, waves_of(list(range(splits)), 3, ramp=False))):
        jobs = tracker.getJobIdsForGroup(f"spark_ckpt-{shape}-a1-{shape}-partial-u{number}")
        stages = [tracker.getStageInfo(s) for j in jobs for s in tracker.getJobInfo(j).stageIds]
        ran = [i.numTasks for i in stages if i is not None and i.numCompletedTasks]
        assert [t for t in ran if t > 1] == [wave * aggregations], (number, ran)


def test_cut_rules_and_settings_by_hand(spark, shape_input, tmp_path):
    src = str(shape_input / "report")

    def job(name: str, settings=SETTINGS, **durable):
        j = BatchJob(name, spark=spark, work_dir=str(tmp_path / "w"), settings=settings)
        flights = j.read_files("flights", f"{src}/flights")
        carriers = j.read_files("carriers", f"{src}/carriers", parallelism=1)
        wide = j.vertex("wide", lambda f, c: f.join(c, "carrier_id"), flights,
                        carriers.broadcast(), durable=durable.get("wide"))
        few = j.vertex("few", lambda w: w.where("distance < 120").select("flight_id", "carrier"),
                       wide, durable=durable.get("few"))
        a = j.vertex("a", lambda f: f.withColumn("x", F.lit(1)), few)
        b = j.vertex("b", lambda f: f.withColumn("y", F.lit(2)), few)
        j.write_parquet(a, str(tmp_path / name / "a"))
        j.write_parquet(b, str(tmp_path / name / "b"))
        return j.explain(show=False).cuts

    cuts = job("auto")
    assert not cuts["wide"].durable and "wide intermediate" in cuts["wide"].reason
    assert cuts["few"].durable  # read by a and b: computed once
    assert "read by 2 vertices" in cuts["few"].reason
    cuts = job("hand", wide=True, few=False)
    assert cuts["wide"].durable and cuts["wide"].by_hand
    assert not cuts["few"].durable and cuts["few"].by_hand
    cuts = job("all", dataclasses.replace(SETTINGS, batch_cuts="all"))
    assert cuts["wide"].durable and cuts["few"].durable
    cuts = job("sinks", dataclasses.replace(SETTINGS, batch_cuts="sinks"))
    assert not cuts["wide"].durable and not cuts["few"].durable

    # a filter keeping a few percent of its input is a cheap cut even with one consumer
    j = BatchJob("filter", spark=spark, work_dir=str(tmp_path / "w"), settings=SETTINGS)
    flights = j.read_files("flights", f"{src}/flights")
    few = j.vertex("few", lambda f: f.where("distance < 150").select("flight_id"), flights)
    j.write_parquet(j.vertex("out", lambda f: f.withColumn("z", F.lit(0)), few),
                    str(tmp_path / "filter"))
    cuts = j.explain(show=False).cuts
    assert cuts["few"].durable and "cheap cut" in cuts["few"].reason


# -- durable exchanges ---------------------------------------------------------------------------
def _join_job(spark, shape_input, out: str, work: str, settings=SETTINGS) -> BatchJob:
    return shapes.build("join", BatchJob("join", spark=spark, work_dir=work, settings=settings),
                        str(shape_input / "join"), out, parallelism=4)


def assert_placed(spark, directory: str, column: str, n: int) -> None:
    """Every row of file part-<j>-* is a row of partition j: pmod(hash(key), n) == j."""
    df = spark.read.parquet(directory).withColumn("file", F.input_file_name())
    misplaced = df.where(F.regexp_extract("file", r"part-(\d+)-", 1).cast("int")
                         != F.pmod(F.hash(column), F.lit(n)))
    assert df.count() > 0 and misplaced.count() == 0


def test_a_join_reads_its_inputs_through_durable_exchanges(spark, shape_input, tmp_path,
                                                           caplog):
    """Two large inputs joined by key: each is written per wave bucketed by the key into the
    join's partitions, and the join's own Spark job has no exchange at all."""
    from spark_ckpt.batch.buckets import job_table_prefix, layout_suffix

    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    plan = _join_job(spark, shape_input, out, work).explain(show=False)
    for source in ("orders", "details"):
        cut = plan.cuts[f"{source}-to-joined"]
        assert cut.durable and cut.bucket_for == "joined" and cut.exchanges == []
        assert plan.cuts[source].reason == f"read in place by {source}-to-joined"
    assert plan.cuts["joined"].exchanges == []  # bucket j joins bucket j: no shuffle
    assert "bucketed by ['order_id'] into joined's partitions" in str(plan)
    assert not (tmp_path / "work").exists(), "explain must write nothing"

    settings = dataclasses.replace(SETTINGS, batch_cleanup_on_success=False)
    # a table a killed driver of this job left in a lasting catalog is dropped
    leftover = f"spark_catalog.default.{job_table_prefix('join')}leftover"
    spark.sql(f"CREATE TABLE {leftover} (k INT) USING parquet LOCATION "
              f"'{(tmp_path / 'leftover').as_uri()}'")
    caplog.set_level("INFO", logger="spark_ckpt")
    result = _join_job(spark, shape_input, out, work, settings).run()
    assert "reads its inputs plainly" not in caplog.text
    assert {v: s.ran for v, s in result.vertices.items()} == \
        {"orders-to-joined": 8, "details-to-joined": 8, "joined": 4}
    plain = plain_output(spark, "join", shape_input, tmp_path)
    for name in ("joined", "joined_delta"):
        assert_same_rows(_load(f"{out}/{name}"), _load(f"{plain}/joined"))
    files = list((tmp_path / "work" / "join" / "results" / "orders-to-joined").rglob("*.parquet"))
    assert files
    suffix = layout_suffix(("order_id",), 4)
    for f in files:  # wave <tag>-b4-k.., bucket directory j, Spark's bucket id _0000j in names
        j = int(f.parent.name.removeprefix("spark_ckpt_bucket="))
        assert f.parent.parent.name.endswith(suffix) and f.name.split(".")[0].endswith(f"_{j:05d}")
    assert not spark.sql("SHOW TABLES IN spark_catalog.default LIKE 'spark_ckpt_*'").collect()
    assert_placed(spark, f"{out}/joined", "order_id", 4)

    # the same job without exchanges: the inputs are read in place, chained into the join
    off = dataclasses.replace(SETTINGS, batch_exchange_cuts=False)
    plan = _join_job(spark, shape_input, out, str(tmp_path / "w2"), off).explain(show=False)
    assert "orders-to-joined" not in plan.cuts
    assert any("hashpartitioning(order_id, 4" in e for e in plan.cuts["joined"].exchanges)

    # by default, files this small (a few KiB per wave and partition) make no exchange: its
    # writes, listings and catalog partitions would cost more than re-running its input
    default = Settings(progress="never")
    plan = _join_job(spark, shape_input, out, str(tmp_path / "w3"), default).explain(show=False)
    assert "orders-to-joined" not in plan.cuts and "details-to-joined" not in plan.cuts
    assert "below spark.ckpt.batch.exchangeMinBytes (8.0 MiB)" in plan.cuts["joined"].reason
    floor = dataclasses.replace(default, batch_exchange_min_bytes=1)
    plan = _join_job(spark, shape_input, out, str(tmp_path / "w4"), floor).explain(show=False)
    assert plan.cuts["orders-to-joined"].bucket_for == "joined"


def test_a_file_nobody_recorded_in_an_exchange_is_never_read(spark, shape_input, tmp_path,
                                                            caplog):
    """A catalog partition reads every file of its directory: a stray file in a finished
    wave's bucket directory (a copy, a leftover) makes the join read the recorded files
    plainly, never the stray one."""
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    os.environ["SPARK_CKPT_FAULT"] = "vertex.finished:2:fail"  # both exchanges finished
    try:
        with pytest.raises(OSError, match="injected"):
            _join_job(spark, shape_input, out, work).run()
    finally:
        del os.environ["SPARK_CKPT_FAULT"]
    wave = next((tmp_path / "work" / "join" / "results" / "details-to-joined").iterdir())
    bucket = next(d for d in wave.iterdir() if d.name.startswith("spark_ckpt_bucket="))
    original = next(bucket.glob("part-*.parquet"))
    stray = bucket / original.name.replace("part-", "part-99999-copy-", 1)
    stray.write_bytes(original.read_bytes())
    caplog.set_level("INFO", logger="spark_ckpt")
    result = _join_job(spark, shape_input, out, work).run()
    assert "differ from the recorded ones" in caplog.text
    assert "joined reads its inputs plainly" in caplog.text  # both, not one of them
    assert_placed(spark, f"{out}/joined", "order_id", 4)
    assert {v: (s.reused, s.ran) for v, s in result.vertices.items()} == \
        {"orders-to-joined": (8, 0), "details-to-joined": (8, 0), "joined": (0, 4)}
    plain = plain_output(spark, "join", shape_input, tmp_path)
    assert_same_rows(_load(f"{out}/joined"), _load(f"{plain}/joined"))


def test_bucket_layout_accepts_only_files_written_for_the_count():
    from spark_ckpt.batch.buckets import bucket_layout, layout_suffix

    key = ("order_id",)
    b4 = layout_suffix(key, 4)

    def path(wave: str, j: int, named: int | None = None) -> str:
        named = j if named is None else named
        return f"file:/w/{wave}/spark_ckpt_bucket={j}/part-00001-ab-cd_{named:05d}.c000.parquet"

    good = [path(f"a1-u0-x{b4}", 0), path(f"a1-u0-x{b4}", 3), path(f"a1-u1-y{b4}", 3)]
    assert bucket_layout(good, key, 4) == {f"file:/w/a1-u0-x{b4}": {0: [good[0]], 3: [good[1]]},
                                           f"file:/w/a1-u1-y{b4}": {3: [good[2]]}}
    assert bucket_layout(good, key, 8) is None  # written for 4 buckets, read for 8
    assert bucket_layout(good, ("customer_id",), 4) is None  # bucketed by another key
    assert layout_suffix(key, 4) == layout_suffix(("order_id",), 4) != layout_suffix(key, 8)
    assert bucket_layout([path(f"a1-u0-x{b4}", 2, named=1)], key, 4) is None
    assert bucket_layout([path(f"a1-u0-x{b4}", 5)], key, 4) is None
    assert bucket_layout(["file:/w/a1-u0-x/part-00001-ab.c000.parquet"], key, 4) is None
    assert bucket_layout([], key, 4) == {}


# -- failures ----------------------------------------------------------------------------------
def _shape_driver(shape: str, shape_input, out: str, work: str, fault: str,
                  **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "jobs" / "batch_shapes.py"), "--shape", shape,
           "--input", str(shape_input / shapes.INPUT_OF.get(shape, shape)), "--output", out,
           "--work-dir", work, "--parallelism", "4"]
    return subprocess.run(cmd, env=child_env(fault, **env), capture_output=True, text=True,
                          timeout=300, start_new_session=True, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    # (the report's plain groupBy().agg() runs through the same cut as (e), which sorts
    # after aggregating and counts distinct values: the long run kills both)
    pytest.param("report", marks=pytest.mark.skipif(
        not LONG_FAULTS, reason="the same cut as sorted_report; SPARK_CKPT_LONG_FAULTS=1")),
    # (g): two aggregations, a map-side task each per split: a split is kept once both are
    # (its cut runs in CI, killed with SPARK_CKPT_LONG_FAULTS=1)
    "sorted_report", pytest.param("two_aggregations", marks=pytest.mark.skipif(
        not LONG_FAULTS, reason="the kill of sorted_report's waves in CI; "
        "SPARK_CKPT_LONG_FAULTS=1"))])
def test_killed_during_partial_waves_resumes_from_them(spark, shape_input, tmp_path, shape):
    """SIGKILL after the second flush of finished partial waves; the resubmission (another
    PYTHONHASHSEED, and settings that would no longer choose this cut) keeps the recorded
    decision, reuses the partial waves and gives plain Spark's rows, committed once. Shape
    (e) sorts its aggregation and counts distinct tails: the partials are grouped by the tail
    too, and the sort runs over the merged partials."""
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    defaults = tmp_path / "defaults.conf"  # one event a flush: the kill lands after 2 waves
    defaults.write_text(defaults_text()
                        + "\nspark.ckpt.eventLog.flushMaxEvents 1\n"
                        # jobs of 2 splits (the map-side partials' one job of 8 tiny tasks
                        # may record all 8 before a second flush)
                        + "spark.ckpt.batch.partitionsPerWave 2\n"
                        # 5,000 rows a split: (e)'s partials hardly reduce so few
                        + "spark.ckpt.batch.cutMaxPercent 400\n")
    proc = _shape_driver(shape, shape_input, out, work, "partition.finished:2",
                         PYTHONHASHSEED="3", SPARK_CKPT_DEFAULTS=str(defaults))
    assert proc.returncode == KILLED, proc.stderr[-3000:]
    settings = dataclasses.replace(SETTINGS, batch_cut_max_percent=0)
    job = shapes.build(shape, BatchJob(shape, spark=spark, work_dir=work,
                                       settings=settings),
                       str(shape_input / "report"), out, parallelism=4)
    result = job.run()
    partial = result.vertices[f"{shape}-partial"]
    assert 0 < partial.reused < partial.partitions
    assert partial.reused + partial.ran == partial.partitions
    # what was reused, and how much of the work it was (the report partitions all ran)
    assert result.reused_in_waves == partial.reused and partial.waves
    assert 0 < result.durable_share < 1
    shown = CliRunner().invoke(cli, ["history", shape, "--work-dir", work, "--json"])
    assert shown.exit_code == 0, shown.output
    import json

    last = json.loads(shown.output)["attempts"][-1]
    assert last["reused_in_waves"] == partial.reused
    assert last["durable_share"] == pytest.approx(result.durable_share, abs=1e-4)
    assert_same_rows(_load(f"{out}/{shape}"),
                     _load(f"{plain_output(spark, shape, shape_input, tmp_path)}/{shape}"))
    from deltalake import DeltaTable

    assert sum(1 for h in DeltaTable(f"{out}/{shape}").history()
               if h.get("operation") != "CREATE TABLE") == 1


@pytest.mark.slow
def test_sinks_of_one_layout_are_written_once_and_survive_a_kill(spark, shape_input, tmp_path):
    """Parquet and Delta sinks of one vertex: Spark writes the rows once and the second
    sink's files are hard links; killed as the third partition's files are in place (linked,
    not yet logged), the resubmission commits both with exactly plain Spark's rows."""
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    # 16 exchange partitions (8 waves of each input) first, then joined's third
    proc = _shape_driver("join", shape_input, out, work, "partition.written:19")
    assert proc.returncode == KILLED, proc.stderr[-3000:]
    job = shapes.build("join", BatchJob("join", spark=spark, work_dir=work,
                                        settings=SETTINGS),
                       str(shape_input / "join"), out, parallelism=4)
    result = job.run()
    joined = result.vertices["joined"]
    assert joined.reused <= 2 and joined.ran == 4 - joined.reused
    assert result.vertices["orders-to-joined"].reused == 8
    plain = plain_output(spark, "join", shape_input, tmp_path)
    for name in ("joined", "joined_delta"):
        assert_same_rows(_load(f"{out}/{name}"), _load(f"{plain}/joined"))
    parquet = sorted((tmp_path / "out" / "joined").glob("part-*.parquet"))
    assert parquet and all(p.stat().st_nlink == 2 for p in parquet)


def test_a_wide_durable_intermediate_is_recomputed_not_read_back(spark, shape_input, tmp_path):
    """Every vertex durable (cuts=all): enriched's rows are wider than the flights they came
    from, so after a failure the resubmission recomputes them inside the aggregation rather
    than read them back, says so, and gives the same rows."""
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    settings = dataclasses.replace(SETTINGS, batch_cuts="all")

    def build():
        return shapes.build("report", BatchJob("report", spark=spark, work_dir=work,
                                               settings=settings),
                            str(shape_input / "report"), out, parallelism=4)

    os.environ["SPARK_CKPT_FAULT"] = "vertex.finished:1:fail"  # after enriched finished
    try:
        with pytest.raises(OSError, match="injected"):
            build().run()
    finally:
        del os.environ["SPARK_CKPT_FAULT"]
    result = build().run()
    assert result.recomputed and result.recomputed[0].startswith("enriched: kept output")
    assert "enriched" not in result.vertices  # computed inside report, not run on its own
    assert result.planning_s > 0
    assert_same_rows(_load(f"{out}/report"),
                     _load(f"{plain_output(spark, 'report', shape_input, tmp_path)}/report"))
