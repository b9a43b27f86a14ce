"""The spark-sql and spark-shell recipes of docs/operations.md, run with the shipped
``bin/spark-sql`` and ``bin/spark-shell`` (no Delta jars) against a real job's event log and
a real pipeline's checkpoint: they give what spark_ckpt itself reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter

import pytest
from connect_server import SPARK_HOME
from helpers import ROOT
from helpers import test_java_options as java_options
from pyspark.sql import functions as F

from spark_ckpt import Settings, StreamingContext, read_state
from spark_ckpt.state.aggregates import count, max_

pytestmark = pytest.mark.slow

DOC = (ROOT / "docs" / "operations.md").read_text()


def _block(lang: str, marker: str) -> str:
    for block in re.findall(rf"```{lang}\n(.*?)```", DOC, re.S):
        if marker in block:
            return block
    raise AssertionError(f"no {lang} block with {marker!r} in docs/operations.md")


def _spark(tool: str, args: list[str], cwd) -> str:
    done = subprocess.run(
        [str(SPARK_HOME / "bin" / tool), "--master", "local[2]", "--conf",
         "spark.ui.enabled=false", "--driver-java-options", java_options(), *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "SPARK_HOME": str(SPARK_HOME)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def written(spark, orders_input, tmp_path_factory):
    """A finished batch job's work directory and a stopped pipeline's checkpoint."""
    import orders_report as report

    base = tmp_path_factory.mktemp("recipes")
    report.build_job("recipe-job", orders_input, str(base / "out"), parallelism=4,
                     agg_parallelism=2, work_dir=str(base / "work"), spark=spark,
                     settings=Settings(progress="never", batch_exchange_min_bytes=0,
                                       event_log_flush_max_events=3,
                                       event_log_compact_at_files=4)).run()
    ckpt = base / "ckpt"
    ctx = StreamingContext(spark, 0.05, str(ckpt), "recipes",
                           settings=Settings(progress="never", checkpoint_interval_ms=1,
                                             state_parallelism=3, state_max_parallelism=12,
                                             state_materialize_every=3))
    gen = ctx.generator_stream("gen", rows_per_batch=250, total_rows=2000, keys=37)
    gen.key_by("key").agg("totals", n=count(), hi=max_("value")) \
        .write_parquet(str(base / "sink"), name="out")
    ctx.process_available(timeout=300)
    return base


def test_spark_sql_reads_the_event_log_history_and_progress(spark, written):
    from spark_ckpt.batch.runner import job_paths
    from spark_ckpt.eventlog.reader import read_events
    from spark_ckpt.storage import Storage

    sql = _block("sql", "committed").replace("WORK", str(written / "work")) \
        .replace("JOB", "recipe-job").replace("CKPT", str(written / "ckpt"))
    statements = [s.strip() for s in re.sub(r"--[^\n]*", "", sql).split(";") if s.strip()]
    script = ";\n".join(s if not s.upper().startswith("SELECT") else f"SELECT '=====';\n{s}"
                        for s in statements) + ";\n"
    (written / "recipe.sql").write_text(script)
    out = _spark("spark-sql", ["-f", str(written / "recipe.sql")], written)
    parts = [p.strip().splitlines() for p in out.split("=====")[1:]]
    assert len(parts) == 3, out
    got = Counter({(int(a), t): int(n) for a, t, n in (line.split("\t") for line in parts[0])})
    storage = Storage(str(written / "work"))
    read = read_events(storage, job_paths(storage, "recipe-job")["events"])
    assert got == Counter((e.job_attempt, e.type.value) for e in read.events)
    removed = [line for f in (written / "work" / "recipe-job" / "events" / "_delta_log")
               .glob("*.json") for line in f.read_text().splitlines() if '"remove"' in line]
    assert removed  # the writer compacted the log: the recipe left its removed files out
    history = [line.split("\t") for line in parts[1]]
    stats = json.loads((written / "ckpt" / "checkpoints" / "history" /
                        sorted(os.listdir(written / "ckpt" / "checkpoints" / "history"))[-1])
                       .read_text())
    assert history[-1][0] == str(stats["checkpoint_id"]) and history[-1][1] == "completed"
    progress = [line.split("\t") for line in parts[2]]
    assert [int(p[0]) for p in progress] == list(range(8))
    assert sum(int(p[1]) for p in progress) == 2000


def test_spark_shell_reads_an_operators_state_as_read_state_does(spark, written):
    ckpt = written / "ckpt"
    ids = sorted(int(d[4:]) for d in os.listdir(ckpt / "checkpoints") if d.startswith("chk-")
                 and (ckpt / "checkpoints" / d / "_metadata.json").exists())
    scala = _block("scala", "max_by").replace("CKPT", str(ckpt)) \
        .replace("chk-ID", f"chk-{ids[-1]:08d}").replace("OPERATOR", "totals") \
        .replace('"KEY"', '"key"')
    result = written / "state.json"
    scala = scala.replace("state.show()", f'state.coalesce(1).write.mode("overwrite")'
                                          f'.json("{result}")\nSystem.exit(0)')
    (written / "recipe.scala").write_text(scala)
    _spark("spark-shell", ["-i", str(written / "recipe.scala")], written)
    got = spark.read.json(str(result))
    want = read_state(spark, str(ckpt), "totals")
    assert sorted((r.key, r.n, r.hi) for r in got.collect()) == \
        sorted((r.key, r.n, r.hi) for r in want.collect())
    assert want.agg(F.sum("n")).first()[0] == 2000
