"""Keyed state on a real multi-process Spark: two executor JVMs (``local-cluster``), each with
its own Python workers. Left to Spark (``spark.ckpt.state.preferLocations=false``, or a Spark
Connect session), a key-group range runs on one executor in one batch and on the other in the
next; its state must then come from durable storage. The result equals plain Spark's. With
spark_ckpt's PreferredLocationsRDD (spark_ckpt/jvm.py), each range's task runs where the range
ran last, exactly as Spark's own scheduler reports it, and finds its state there."""

from __future__ import annotations

from spark_ckpt.storage.delta_reader import read_delta
import json
import subprocess
import sys

import pandas as pd
import pytest
from helpers import LONG_FAULTS, LONG_ONLY, ROOT, child_env, plain_sequenced
from helpers import test_java_options as java_options  # not collected as a test

pytestmark = pytest.mark.slow

CHILD = """
import sys
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local-cluster[2,1,1024]")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "4")
         .config("spark.driver.extraJavaOptions", "LOG4J JAVA")
         .config("spark.executor.extraJavaOptions", "JAVA")
         .config("spark.sql.session.timeZone", "UTC").getOrCreate())
from spark_ckpt import Settings, StreamingContext
from spark_ckpt.state import count, sum_
ctx = StreamingContext(spark, 0.1, sys.argv[1], "cluster", settings=Settings(
    progress="never", checkpoint_interval_ms=1, state_parallelism=4,
    state_local_spill=False, state_small_batch_bytes=0,  # one task per range, to move
    state_prefer_locations=False))  # (Spark places each task: what a Connect session gets)
gen = ctx.generator_stream("gen", rows_per_batch=500, total_rows=6000, keys=200, partitions=4)
agg = gen.key_by("key").agg(name="totals", n=count(), total=sum_("value"))
agg.write_delta(sys.argv[2], name="totals", merge_keys=["key"])
progress = ctx.process_available(timeout=900)
print("DONE", len(progress), spark.sparkContext.master, flush=True)
""".replace("LOG4J", f"-Dlog4j2.configurationFile=file:{ROOT / 'conf' / 'log4j2.properties'}") \
    .replace("JAVA", java_options())  # the tests' JVM options (helpers.test_java_options)


def test_ranges_move_between_executors_and_results_equal_plain_spark(spark, tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ckpt"),
                           str(tmp_path / "totals")], env=child_env(), capture_output=True,
                          text=True, timeout=900, start_new_session=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "DONE 12 local-cluster" in done.stdout
    progress = [json.loads(line) for line in
                (tmp_path / "ckpt" / "progress" / "progress.jsonl").read_text().splitlines()]
    placements: dict[str, set[str]] = {}
    restored_after_first = 0
    for p in progress:
        for pid, task in p["state"]["totals"]["tasks"].items():
            placements.setdefault(pid, set()).add(task["executor"])
            if p["batch_id"] > 0 and task["restored"]:
                restored_after_first += 1
    executors = set().union(*placements.values())
    assert len(executors) == 2, placements  # two executors ran state tasks
    assert any(len(e) == 2 for e in placements.values()), placements  # a range moved
    assert restored_after_first > 0  # ... and was rebuilt from durable state
    want = plain_sequenced(spark, 6000, 200)["totals"]
    got = read_delta(str(tmp_path / "totals")).to_pandas()[["key", "n", "total"]] \
        .sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-9)


PLACED_CHILD = """
import json, sys
from pyspark.sql import SparkSession, functions as F
spark = (SparkSession.builder.master("local-cluster[2,1,1024]")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "4")
         .config("spark.eventLog.enabled", "true").config("spark.eventLog.dir", sys.argv[3])
         .config("spark.eventLog.compress", "false")
         .config("spark.eventLog.rolling.enabled", "false")
         .config("spark.driver.extraJavaOptions", "LOG4J JAVA")
         .config("spark.executor.extraJavaOptions", "JAVA")
         .config("spark.sql.session.timeZone", "UTC").getOrCreate())
# a session spark_ckpt did not build: the package adds its jar to the running session itself
from spark_ckpt.sparkapi import spark_api
from spark_ckpt import Settings, StreamingContext
from spark_ckpt.state import count, sum_

api = spark_api(spark)
df = spark.range(0, 2000, 1, 3).withColumn("p", (F.col("id") % 4).cast("int")) \\
    .repartitionById(4, "p")
frame, ran = api.prefer_locations(df, 4, {})
ids = sorted(r.id for r in frame.collect())
first = ran()
executors = sorted({e for _h, e in first.values()})
host = first[0][0]
# every partition to the executor another partition ran on (both executors asked for)
want = {p: (host, executors[p % len(executors)]) for p in range(4)}
frame, ran = api.prefer_locations(df, 4, want)
spark.sparkContext.setJobDescription("placed")
placed = sorted(r.id for r in frame.where(F.col("id") >= 0).collect())
spark.sparkContext.setJobDescription(None)
got = ran()
frame, ran = api.prefer_locations(df, 4, {0: (host, "no-such-executor")})
frame.collect()
ctx = StreamingContext(spark, 0.1, sys.argv[1], "placed", settings=Settings(
    progress="never", checkpoint_interval_ms=1, state_parallelism=4,
    state_small_batch_bytes=0))
gen = ctx.generator_stream("gen", rows_per_batch=500, total_rows=4000, keys=200, partitions=4)
gen.key_by("key").agg(name="totals", n=count(), total=sum_("value")) \\
    .write_delta(sys.argv[2], name="totals", merge_keys=["key"])
progress = ctx.process_available(timeout=900)
print("PLACED " + json.dumps({"equal": ids == list(range(2000)) == placed,
                              "first": first, "want": want, "got": got,
                              "dead_ran": len(ran()), "batches": len(progress),
                              "master": spark.sparkContext.master}), flush=True)
spark.stop()
""".replace("LOG4J", f"-Dlog4j2.configurationFile=file:{ROOT / 'conf' / 'log4j2.properties'}") \
    .replace("JAVA", java_options())


def _placed_tasks(event_logs) -> list[dict]:
    """The tasks of the job described "placed" in Spark's own event log: partition, executor,
    host, locality."""
    stages: set[int] = set()
    tasks = []
    for path in event_logs.glob("*"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["Event"] == "SparkListenerJobStart" and \
                    (event.get("Properties") or {}).get("spark.job.description") == "placed":
                stages.update(event["Stage IDs"])
            elif event["Event"] == "SparkListenerTaskEnd" and event["Stage ID"] in stages:
                info = event["Task Info"]
                tasks.append({"partition": info["Partition ID"], "executor": info["Executor ID"],
                              "host": info["Host"], "locality": info["Locality"],
                              "ok": event["Task End Reason"]["Reason"] == "Success"})
    return tasks


@pytest.mark.skipif(not LONG_FAULTS, reason=LONG_ONLY)  # in CI on three hosts: test_netns_locality
def test_each_range_runs_where_it_ran_last_as_spark_reports_it(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    done = subprocess.run([sys.executable, "-c", PLACED_CHILD, str(tmp_path / "ckpt"),
                           str(tmp_path / "totals"), events.as_uri()], env=child_env(),
                          capture_output=True, text=True, timeout=900,
                          start_new_session=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    record = json.loads(done.stdout.split("PLACED ", 1)[1].splitlines()[0])
    assert record["equal"], record  # the wrapper passes every row through, partition for
    assert record["master"].startswith("local-cluster"), record
    want = {int(p): tuple(w) for p, w in record["want"].items()}
    got = {int(p): tuple(w) for p, w in record["got"].items()}
    assert len({e for _h, e in want.values()}) == 2, record  # both executors asked for
    assert got == want, record  # each task ran on the executor asked for ...
    spark_says = _placed_tasks(events)
    assert len(spark_says) == 4 and all(t["ok"] for t in spark_says), spark_says
    # ... and Spark's own record of the tasks agrees: executor, host and PROCESS_LOCAL
    assert {t["partition"]: (t["host"], t["executor"]) for t in spark_says} == got, spark_says
    assert {t["locality"] for t in spark_says} == {"PROCESS_LOCAL"}, spark_says
    assert record["dead_ran"] == 4, record  # a preference for no live executor: ignored

    progress = [json.loads(line) for line in
                (tmp_path / "ckpt" / "progress" / "progress.jsonl").read_text().splitlines()]
    assert len(progress) == record["batches"] == 8
    for p in progress[1:]:
        state = p["state"]["totals"]
        assert state["preferred_tasks"] == state["placed_tasks"] == 4, state
        assert all(t["cache"] in ("process", "local") and not t["restored"]
                   for t in state["tasks"].values()), state
