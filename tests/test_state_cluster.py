"""Keyed state on a real multi-process Spark: two executor JVMs (``local-cluster``), each with
its own Python workers. Spark gives Python tasks no locality, so a key-group range runs on one
executor in one batch and on the other in the next; its state must then come from durable
storage. The result equals plain Spark's."""

from __future__ import annotations

from spark_ckpt.storage.delta_reader import read_delta
import json
import subprocess
import sys

import pandas as pd
import pytest
from helpers import ROOT, child_env, plain_sequenced
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
    state_local_spill=False, state_small_batch_bytes=0))  # one task per range, to move
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
