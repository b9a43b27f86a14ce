"""The one seam to Spark: only spark_ckpt/sparkapi touches py4j, the JVM handles or Connect
internals; the Connect side's explain-text readers; the classic side's plan as plain data."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import spark_ckpt
from spark_ckpt.sparkapi import connect as connect_api

PACKAGE = Path(spark_ckpt.__file__).parent
SEAM = PACKAGE / "sparkapi"
# handles into the driver's JVM and the Connect client's internals
FORBIDDEN_ATTRS = {"_jdf", "_jsc", "_jvm", "_jsparkSession", "_jconf", "_jcol", "sparkContext",
                   "_explain_string", "_plan", "client"}
FORBIDDEN_MODULES = ("py4j", "pyspark.sql.connect", "pyspark.sql.classic")


def violations(source: str, where: str) -> list[str]:
    """Each place ``source`` reaches past the seam."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS:
            found.append(f"{where}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in FORBIDDEN_ATTRS:
            found.append(f"{where}:{node.lineno}: {node.value!r}")  # getattr(x, "_jdf")
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith(FORBIDDEN_MODULES)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                FORBIDDEN_MODULES):
            found.append(f"{where}:{node.lineno}: from {node.module}")
    return found


def test_no_module_outside_the_seam_touches_py4j_jvm_handles_or_connect_internals():
    modules = [p for p in PACKAGE.rglob("*.py") if SEAM not in p.parents]
    assert len(modules) > 60  # the whole package is scanned
    found = [v for p in modules for v in violations(p.read_text(), str(p.relative_to(PACKAGE)))]
    assert found == [], "only spark_ckpt/sparkapi may reach into Spark:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "size = df._jdf.queryExecution()",
    "spark.sparkContext.setJobGroup('g', 'd')",
    "import py4j.java_gateway",
    "from pyspark.sql.connect.session import SparkSession",
    "handle = getattr(df, '_jdf')",
    "text = df._explain_string(mode='cost')",
])
def test_the_scan_finds_each_kind_of_reach(source):
    assert violations(source, "x.py"), source  # the scan above cannot pass vacuously


# words of Spark's plan text and names of the JVM's classes: only the seam reads or names them
PLAN_TEXT = re.compile(r"Exchange |REPARTITION_BY_NUM|ENSURE_REQUIREMENTS|plan_id=|"
                       r"hashpartitioning|AdaptiveSparkPlan|\b(?:org|com)\.apache\.")


def plan_text_literals(source: str, where: str) -> list[str]:
    """Each string in ``source`` (docstrings included) naming plan text or a JVM class."""
    return [f"{where}:{node.lineno}: {node.value[:60]!r}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and PLAN_TEXT.search(node.value)]


def test_no_module_outside_the_seam_reads_plan_text_or_names_jvm_classes():
    modules = [p for p in PACKAGE.rglob("*.py") if SEAM not in p.parents]
    assert len(modules) > 60  # the whole package is scanned
    found = [v for p in modules
             for v in plan_text_literals(p.read_text(), str(p.relative_to(PACKAGE)))]
    assert found == [], "only spark_ckpt/sparkapi may read Spark's plan text or name its " \
        "classes:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "shuffles = 'Exchange ' in plan",
    "ok = 'REPARTITION_BY_NUM' not in line",
    "text = re.sub(r',? ?\\[plan_id=\\d+\\]', '', text)",
    "conf = {'k': 'org.apache.parquet.hadoop.ParquetOutputCommitter'}",
])
def test_the_plan_text_scan_finds_each_kind(source):
    assert plan_text_literals(source, "x.py"), source


def test_the_seam_holds_the_plan_text_and_the_class_names():
    found = [v for p in SEAM.glob("*.py") for v in plan_text_literals(p.read_text(), p.name)]
    assert any("plans.py" in v and "REPARTITION_BY_NUM" in v for v in found)
    assert any("committers.py" in v and "org.apache" in v for v in found)


def test_the_seam_itself_is_where_the_reaching_is():
    found = [v for p in SEAM.glob("*.py") for v in violations(p.read_text(), p.name)]
    assert any("classic.py" in v and "_jdf" in v for v in found)
    assert any("connect.py" in v and "_explain_string" in v for v in found)


COST_EXPLAIN = """== Optimized Logical Plan ==
Aggregate [k#1L], [k#1L, count(1) AS n#4L], Statistics(sizeInBytes=1.5 MiB)
+- Project [(id#0L % 10) AS k#1L], Statistics(sizeInBytes=8.0 EiB)
   +- Range (0, 1000, step=1, splits=Some(2)), Statistics(sizeInBytes=7.8 KiB, rowCount=1.00E+3)

== Physical Plan ==
AdaptiveSparkPlan isFinalPlan=false
+- HashAggregate(keys=[k#1L], functions=[count(1)])
   +- Exchange hashpartitioning(k#1L, 8), ENSURE_REQUIREMENTS, [plan_id=12]
"""


def test_connect_reads_the_root_size_estimate_and_sections_of_explain_text():
    lines = connect_api._section(COST_EXPLAIN, "Optimized Logical Plan")
    assert len(lines) == 4 and lines[0].startswith("Aggregate")  # up to the next section
    found = connect_api._SIZE.search(lines[0])
    assert found and int(float(found.group(1)) * connect_api._UNITS[found.group(2)]) == \
        int(1.5 * 2**20)
    physical = connect_api._section(COST_EXPLAIN, "Physical Plan")
    assert physical[0] == "AdaptiveSparkPlan isFinalPlan=false"
    assert connect_api._section(COST_EXPLAIN, "Analyzed Logical Plan") == []


def test_the_plan_text_readers_shared_by_both_sessions():
    from spark_ckpt.sparkapi import plans

    physical = "\n".join(connect_api._section(COST_EXPLAIN, "Physical Plan"))
    assert plans.exchanges(physical) == ["Exchange hashpartitioning(k, 8), ENSURE_REQUIREMENTS"]
    assert plans.shuffles(physical) and not plans.only_repartitions_by_number(physical)
    by_number = "Exchange hashpartitioning(k#1L, 8), REPARTITION_BY_NUM, [plan_id=3]"
    assert plans.only_repartitions_by_number(by_number)
    broadcast = "+- BroadcastExchange HashedRelationBroadcastMode(List(k#1L)), [plan_id=5]"
    assert not plans.shuffles(broadcast) and plans.only_repartitions_by_number(broadcast)
    assert plans.exchanges(broadcast) == ["BroadcastExchange HashedRelationBroadcastMode(List(k))"]
    assert plans.normalized(by_number) == plans.normalized(by_number.replace("#1L", "#9L")
                                                           .replace("=3", "=4"))


def test_classic_plan_as_plain_data(spark):
    from pyspark.sql import functions as F

    from spark_ckpt.sparkapi import is_connect, spark_api, walk

    if is_connect(spark):
        pytest.skip("the classic JVM's answers (Connect's: the *_on_this_kind_of_session tests)")
    api = spark_api(spark)
    assert api.kind == "classic"
    df = spark.range(100).withColumn("k", F.col("id") % 3).groupBy("k").agg(
        F.sum("id").alias("s"), F.countDistinct("id").alias("d"))
    plan = api.analyzed_plan(df)
    assert plan is not None and plan.kind == "Aggregate"
    assert [e.name for e in plan.grouping] == ["k"]
    s, d = plan.aggregates[1], plan.aggregates[2]
    assert s.kind == "Alias" and s.name == "s"
    agg = s.children[0]
    assert agg.kind == "AggregateExpression" and agg.function is not None
    assert agg.function.kind == "Sum" and agg.data_type == "BIGINT" and not agg.distinct
    assert d.children[0].distinct
    assert {n.kind for n in walk(plan)} >= {"Aggregate", "Project", "Range"}
    assert api.deterministic(df) is True
    assert api.deterministic(spark.range(3).select(F.rand())) is False
    child = api.plan_child_frame(df)
    assert child is not None and child.columns == ["id", "k"]
    assert api.hash_partitioning(spark.range(10).repartition(4, "id")) == (("id",), 4)
    assert api.provably_empty(spark.range(10).where("1 = 0"))
    assert not api.provably_empty(spark.range(10))
    assert api.size_estimate(spark.range(1000)) == 8000
    assert api.default_parallelism() >= 1
    assert "Exchange" in api.executed_plan(spark.range(10).repartition(3))


def _sleep_per_batch(batches):  # a mapInArrow function
    import time

    for batch in batches:
        for i in range(batch.num_rows):
            time.sleep(1.0)  # the workload itself (an hour of it), which the test cancels
            yield batch.slice(i, 1)


def test_the_seam_answers_on_this_kind_of_session(spark, tmp_path):
    """Runs on the classic session here and on Spark Connect in tests/test_connect.py."""
    import threading
    import time

    from pyspark.sql import functions as F

    from spark_ckpt.sparkapi import is_connect, spark_api

    api = spark_api(spark)
    assert api.kind == ("connect" if is_connect(spark) else "classic")
    assert api.app_id()
    assert api.default_parallelism() >= 1
    shuffled = spark.range(100).groupBy((F.col("id") % 3).alias("k")).count()
    assert "Exchange hashpartitioning" in api.executed_plan(shuffled)
    assert "Exchange" not in api.executed_plan(spark.range(10).where("id > 3"))
    assert api.provably_empty(spark.range(10).where("1 = 0"))
    assert not api.provably_empty(spark.range(10))
    size = api.size_estimate(spark.range(1000))
    assert size is not None and 4000 <= size <= 16000
    # how a plan ends partitioned: True only for exactly pmod(hash(key), n)
    rows = spark.range(200).select("id", (F.col("id") % 7).alias("k"), (F.col("id") % 5)
                                   .alias("x"))
    by_k = rows.repartition(4, "k")
    assert api.ends_hash_partitioned(by_k, ("k",), 4)
    assert not api.ends_hash_partitioned(by_k, ("k",), 3)
    assert not api.ends_hash_partitioned(by_k, ("x",), 4)  # would collapse into it
    assert not api.ends_hash_partitioned(rows.repartition(4, "x"), ("k",), 4)
    assert not api.ends_hash_partitioned(rows, ("k",), 4)
    assert not api.ends_hash_partitioned(by_k, ("k", "x"), 4)
    joined = by_k.join(rows.select("k", F.col("x").alias("y")).repartition(4, "k"), "k")
    assert api.ends_hash_partitioned(joined.where("y > 1").select("k", "y"), ("k",), 4)
    assert not api.ends_hash_partitioned(joined.groupBy("x").count(), ("k",), 4)
    assert not api.ends_hash_partitioned(joined.select((F.col("k") + 1).alias("k")), ("k",), 4)
    assert not api.ends_hash_partitioned(by_k, ("nope",), 4)
    # a bucketed scan nobody needs is read plainly (file splits), even where a repartition
    # on top was dropped for its buckets first
    names = []
    try:
        for name in ("spark_ckpt_seam_a", "spark_ckpt_seam_b"):
            rows.write.bucketBy(4, "k").option("path", str(tmp_path / name)) \
                .saveAsTable(name)
            names.append(name)
        bucketed = spark.table(names[0])
        broadcast = bucketed.join(F.broadcast(spark.table(names[1]).select("k").distinct()),
                                  "k")
        assert not api.ends_hash_partitioned(broadcast, ("k",), 4)
    finally:
        for name in names:
            spark.sql(f"DROP TABLE IF EXISTS {name}")
    # a job group: its jobs are cancelled by name, the thread's earlier group comes back
    started = threading.Event()
    failure: list[BaseException] = []

    def slow_job() -> None:
        with api.job_group("spark_ckpt-test-cancel", "a job to cancel"):
            started.set()
            try:  # an hour of Python tasks, each checking for the kill between batches
                spark.range(0, 3600, numPartitions=2).mapInArrow(
                    _sleep_per_batch, "id long").collect()
            except BaseException as exc:  # noqa: BLE001 - the cancellation is the point
                failure.append(exc)

    # a group inside another: the outer one is back after it
    with api.job_group("spark_ckpt-test-outer", "outer"):
        with api.job_group("spark_ckpt-test-inner", "inner", owner="spark_ckpt-test-owner"):
            pass
        if is_connect(spark):
            assert spark.getTags() == {"spark_ckpt-test-outer"}
        else:
            assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") == \
                "spark_ckpt-test-outer"
    if is_connect(spark):
        assert spark.getTags() == set()
    else:
        assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None
    thread = threading.Thread(target=slow_job)
    thread.start()
    assert started.wait(60)
    deadline = 120.0
    while thread.is_alive() and deadline > 0:
        api.cancel_group("spark_ckpt-test-cancel")
        thread.join(1.0)
        deadline -= 1.0
    assert not thread.is_alive(), "the job group was not cancelled"
    assert failure, "the job finished instead of being cancelled"
    # and its tasks are gone: the next job gets the cores at once
    t0 = time.monotonic()
    assert spark.range(0, 1000, numPartitions=2).count() == 1000
    assert time.monotonic() - t0 < 30


ORPHAN_CHILD = r"""
import sys, threading
from pyspark.sql import SparkSession, functions as F
from spark_ckpt.storage.fencing import client_session
from spark_ckpt.formats import dump_record
from spark_ckpt.sparkapi import spark_api
spark = SparkSession.builder.getOrCreate()  # SPARK_REMOTE: a Connect client
with open(sys.argv[1], "wb") as f:
    f.write(dump_record("pipeline-run", 1, {"pipeline": "p", "started_ms": 0,
                                             **client_session(spark, "run-1-tag")}))
def slow(started):
    def run(batches):
        import pathlib, time
        pathlib.Path(started).touch()  # the server runs this operation's task now
        for batch in batches:
            for i in range(batch.num_rows):
                time.sleep(1.0)  # the workload itself: slow Python tasks, which stop when killed
                yield batch.slice(i, 1)
    return run
def ours():  # the run's operation: tagged, an hour long
    with spark_api(spark).job_group("g", "d", owner="run-1-tag"):
        spark.range(0, 3600, numPartitions=1).mapInArrow(slow(sys.argv[1] + ".ours"),
                                                         "id long").collect()
def others():  # other work of the same session (a notebook's): not ours to interrupt
    spark.range(0, 15, numPartitions=1).mapInArrow(slow(sys.argv[1] + ".others"),
                                                   "id long").collect()
threading.Thread(target=ours, daemon=True).start()
threading.Thread(target=others, daemon=True).start()
import os, time
deadline = time.monotonic() + 120
while not (os.path.exists(sys.argv[1] + ".ours") and os.path.exists(sys.argv[1] + ".others")):
    if time.monotonic() > deadline:
        sys.exit("the server never ran both operations")
    time.sleep(0.05)  # a poll of the files, not a wait: it ends when both tasks run (120 s bound)
print("RUNNING", flush=True)
threading.Event().wait()  # until the test SIGKILLs this client
"""


def test_operations_a_killed_client_left_running_are_interrupted_by_the_next(spark, tmp_path):
    """On Spark Connect a killed client's query runs on in the server; the next driver
    interrupts it through the session its marker names. A classic driver's jobs die with it."""
    import subprocess
    import sys

    from helpers import child_env, kill_group, wait_for

    from spark_ckpt.storage.fencing import client_session, interrupt_earlier_clients
    from spark_ckpt.sparkapi import is_connect
    from spark_ckpt.storage import Storage

    marker = tmp_path / "00000001.json"
    if not is_connect(spark):
        assert client_session(spark, "run-1-tag") == {}
        assert interrupt_earlier_clients(spark, Storage(str(tmp_path)), [str(marker)],
                                         "pipeline-run", "test") == 0
        return
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_CHILD, str(marker)],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "RUNNING" in line:
                break
        else:
            pytest.fail("the client never started its query")
    finally:
        kill_group(proc)  # SIGKILL: the query runs on in the server
    store = Storage(str(tmp_path))
    # the run's tagged operation, not the session's other one (both run in the server now)
    assert interrupt_earlier_clients(spark, store, [str(marker)], "pipeline-run", "test") == 1
    assert wait_for(lambda: interrupt_earlier_clients(  # and nothing is left running there
        spark, store, [str(marker)], "pipeline-run", "test") == 0, timeout=60)
    assert spark.range(0, 1000, numPartitions=2).count() == 1000  # the cores are free again


def test_connect_expressions_are_written_as_sql_without_a_server():
    """The Connect client's expressions as the analysed plan's plain data, without a server:
    the SQL text the split builds its steps from (an aggregate's text inside its output's), the
    kinds it reads, and what is refused, naming why."""
    import datetime
    from decimal import Decimal

    from pyspark.sql.connect import functions as CF
    from pyspark.sql.connect import plan as connect_plan_nodes
    from pyspark.sql.connect.window import Window
    from pyspark.sql.types import (
        ArrayType,
        DateType,
        DecimalType,
        DoubleType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    from spark_ckpt.sparkapi import connect_plan as cp

    def written(column):
        return cp._Writer().expr(column._expr)

    total = written(CF.sum("d"))
    assert (total.kind, total.sql, total.function.kind) == ("AggregateExpression", "sum(`d`)",
                                                            "Sum")
    count = written(CF.count("*"))
    assert (count.sql, count.function.kind) == ("count(1)", "Count")
    distinct = written(CF.countDistinct("s"))
    assert distinct.sql == "count(DISTINCT `s`)" and distinct.distinct
    assert [c.name for c in distinct.function.children] == ["s"]
    assert written(CF.round(CF.sum("d"), 2)).sql == "round(sum(`d`), 2)"
    assert written(CF.sum("id") / CF.count("d")).sql == "(sum(`id`) / count(`d`))"
    percentile = written(CF.percentile("d", [0.1, 0.9])).function
    assert percentile.kind == "Percentile"
    assert [(c.kind, c.sql) for c in percentile.children[1:]] == [
        ("CreateArray", "array(0.1D, 0.9D)"), ("Literal", "1")]
    assert written(CF.when(CF.col("a.b") > 1, "x").otherwise(None)).sql == \
        "CASE WHEN (`a`.`b` > 1) THEN 'x' ELSE NULL END"
    assert written(CF.col("x").cast("decimal(10,2)")).sql == "CAST(`x` AS decimal(10,2))"
    # F.expr text that is one call is taken apart, its pieces verbatim
    text = written(CF.expr("max(DISTINCT s)"))
    assert (text.sql, text.distinct, text.function.kind) == ("max(DISTINCT s)", True, "Max")
    assert text.function.children[0].name == "s"
    assert written(CF.expr("try_sum(id)")).function.pretty_name == "try_sum"
    assert written(CF.expr("count(x) FILTER (WHERE y > 0)")).filtered
    assert written(CF.expr("percentile(x, 0.5)")).function.children[2].sql == "1L"
    assert written(CF.expr("round(sum(x), 2)")).children[0].sql == "sum(x)"
    assert written(CF.expr("a + 1")).sql == "(a + 1)"
    # what cannot be written is an aggregate the split refuses, saying why
    for column, why in ((CF.expr("sum(a) / count(b)"), "operators around its aggregates"),
                        (CF.sum(CF.col("x")).over(Window.orderBy("y")), "window function")):
        output = cp._named(cp._Writer(), column.alias("out")._expr)
        inner = output.children[0]
        assert output.kind == "Alias" and inner.kind == "AggregateExpression"
        assert why in inner.function.kind and "cannot write as SQL" in inner.function.kind
    assert cp._named(cp._Writer(), CF.col("k")._expr).kind == "AttributeReference"
    # literals of each type, names, types
    assert cp.literal_sql("it's", StringType()) == "CAST(X'69742773' AS STRING)"
    assert cp.literal_sql("sum(id)", StringType()) == "'sum(id)'"
    assert cp.literal_sql(-5, LongType()) == "CAST(-5 AS BIGINT)"
    assert cp.literal_sql(7, IntegerType()) == "7"
    assert cp.literal_sql(1.5, DoubleType()) == "1.5D"
    assert cp.literal_sql(float("nan"), DoubleType()) == "CAST('NaN' AS DOUBLE)"
    assert cp.literal_sql(Decimal("1.50"), DecimalType(3, 2)) == "1.50BD"
    assert cp.literal_sql(None, LongType()) == "CAST(NULL AS BIGINT)"
    assert cp.literal_sql(DateType().toInternal(datetime.date(2024, 2, 29)), DateType()) == \
        "DATE '2024-02-29'"
    assert cp.name_parts("a.`b.c`") == ["a", "b.c"] and cp.name_parts("`x``y`") == ["x`y"]
    assert cp.sql_type(DecimalType(22, 2)) == "DECIMAL(22,2)"
    assert cp.sql_type(ArrayType(StringType())) == "ARRAY<STRING>"
    assert cp.sql_type(StructType([StructField("a", IntegerType())])) == "STRUCT<`a`: INT>"
    # plan nodes: a projection with a window function is a Window (not row by row), one with
    # rand() is not deterministic, one with an aggregate aggregates
    source = connect_plan_nodes.Range(0, 10, 1)

    def kind_of(*columns):
        node = connect_plan_nodes.Project(source, list(columns))
        facts = cp._expressions_facts(cp._node_expressions(node))
        return cp._kind(node, facts), facts.nondeterministic

    assert kind_of(CF.col("id")) == ("Project", False)
    assert kind_of(CF.rank().over(Window.orderBy("id"))) == ("Window", False)
    assert kind_of(CF.expr("sum(id) OVER (ORDER BY id)")) == ("Window", False)
    assert kind_of(CF.rand()) == ("Project", True)
    assert kind_of(CF.expr("uuid()")) == ("Project", True)
    assert kind_of(CF.sum("id")) == ("Aggregate", False)
    assert kind_of(CF.explode(CF.array(CF.col("id")))) == ("Generate", False)
    assert cp._kind(connect_plan_nodes.Limit(source, 5), cp._Facts()) == "GlobalLimit"


def test_an_aggregation_is_split_and_replaced_in_its_plan_on_this_kind_of_session(
        spark, monkeypatch):
    """Runs on the classic session here and on Spark Connect in tests/test_connect.py: the
    plan as plain data (kinds, names, types, the marked input), and the aggregation replaced
    by its merged partials under steps that take the aggregation's columns by reference
    (``agg["k"]``), with plain Spark's rows."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from spark_ckpt.batch.aggsplit import NotSplittable, check_split, split_aggregate
    from spark_ckpt.sparkapi import connect_plan, empty_frame, is_connect, spark_api, walk

    api = spark_api(spark)
    df = spark.range(300).select((F.col("id") % 5).alias("k"), F.col("id"),
                                 (F.col("id") * 0.5).alias("x"))
    names = spark.createDataFrame([(i, f"n{i}") for i in range(4)], "k long, name string")

    def fn(x, small):
        agg = x.where("id > 2").groupBy("k").agg(
            F.sum("id").alias("total"), F.avg("x").alias("mean"),
            F.countDistinct("id").alias("ids"), F.max(F.col("x") * 2).alias("top"))
        return agg.join(small, agg["k"] == small["k"], "left") \
            .select(agg["k"], "name", "total", "mean", "ids", "top").orderBy(agg["k"])

    leaf = empty_frame(spark, df.schema)
    over_leaf = fn(leaf, names)
    plan = api.analyzed_plan(over_leaf, leaf)
    assert plan is not None and plan.kind == "Sort"
    (aggregate,) = [n for n in walk(plan) if n.kind == "Aggregate"]
    assert [g.name for g in aggregate.grouping] == ["k"]
    assert [e.name for e in aggregate.aggregates] == ["k", "total", "mean", "ids", "top"]
    total, mean, ids = (e.children[0] for e in aggregate.aggregates[1:4])
    assert (total.function.kind, total.data_type) == ("Sum", "BIGINT")
    assert (mean.function.kind, mean.data_type) == ("Average", "DOUBLE")
    assert mean.function.children[0].data_type == "DOUBLE"
    assert ids.distinct and ids.function.kind == "Count"
    assert sum(1 for n in walk(plan) if n.marked) == 1 and plan.deterministic
    assert api.analyzed_plan(spark.range(3).select(F.rand())).deterministic is False
    windowed = spark.range(3).withColumn("r", F.rank().over(Window.orderBy("id")))
    assert "Window" in {n.kind for n in walk(api.analyzed_plan(windowed))}

    split = split_aggregate(over_leaf, leaf)
    check_split(split, over_leaf)
    assert {"Sort", "Join"} <= set(split.after)
    waves = [split.partial_frame(fn(df.where(f"id % 3 = {i}"), names)) for i in range(3)]
    partials = waves[0].unionByName(waves[1]).unionByName(waves[2])
    got = split.final_fn(fn, df.schema)(partials, names)
    want = fn(df, names)
    assert got.schema.simpleString() == want.schema.simpleString()
    assert got.collect() == want.collect()  # sorted by k; sums of halves are exact
    child = api.plan_frame(over_leaf, (*split.path, 0))
    assert child is not None and child.columns == ["k", "id", "x"]
    if is_connect(spark):
        # an aggregate function the Connect client does not know by name is taken for a
        # scalar one and left in the final step, whose select then does not analyse: refused,
        # not a wrong answer
        monkeypatch.setattr(connect_plan, "AGGREGATES", connect_plan.AGGREGATES - {"max"})
        unknown = leaf.groupBy("k").agg(F.max("k").alias("m"), F.sum("id").alias("t"))
        split = split_aggregate(unknown, leaf)
        assert dict(split.outputs)["m"] == "max(`k`)"
        with pytest.raises(NotSplittable, match="does not analyse"):
            check_split(split, unknown)
