"""Recurring and corrected runs: run keys, and what each sink mode does to rows already there.

Every case runs real jobs into a real Delta table and checks the table against what the same
writes in Spark's terms would leave (append, overwrite, dynamic partition overwrite, MERGE).
"""

from __future__ import annotations

from spark_ckpt.storage.delta_reader import read_delta
import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from spark_ckpt import BatchJob, JobDefinitionError, Settings

# exchanges however small the tests' inputs (spark.ckpt.batch.exchangeMinBytes=0): the
# orders report's join runs through its durable exchanges, as a large job's does
SETTINGS = Settings(progress="never", event_log_flush_interval_ms=200, batch_exchange_min_bytes=0)


def run(spark, tmp_path, run_key, rows, *, mode="append", partition_by=(), merge_keys=(),
        job_id="daily"):
    """One run of a job that writes ``rows`` ((id, day, value) tuples) to a Delta table."""
    job = BatchJob(job_id, run_key=run_key, spark=spark, work_dir=str(tmp_path / "work"),
                   settings=SETTINGS)
    data = list(rows)
    src = job.source("input", lambda s: s.createDataFrame(data, "id long, day string, "
                                                                "value long"),
                     parallelism=2, split_by=["id"])
    out = job.vertex("out", lambda df: df.withColumn("value", F.col("value") * 10),
                     src.by("id"))
    job.write_delta(out, str(tmp_path / "table"), mode=mode, partition_by=partition_by,
                    merge_keys=merge_keys)
    return job.run()


def table(tmp_path):
    frame = read_delta(str(tmp_path / "table")).to_pandas()
    return sorted(zip(frame["id"], frame["day"], frame["value"], strict=True))


def test_a_run_key_resumes_its_own_run_and_a_new_key_runs_afresh(spark, tmp_path):
    first = run(spark, tmp_path, "2026-11-21", [(1, "d1", 1), (2, "d1", 2)])
    again = run(spark, tmp_path, "2026-11-21", [(1, "d1", 1), (2, "d1", 2)])
    second = run(spark, tmp_path, "2026-11-22", [(3, "d2", 3)])
    assert first.status == "succeeded" and first.job_id == "daily@2026-11-21"
    assert again.status == "already-complete" and again.ran == 0
    assert second.status == "succeeded" and second.ran == 2
    assert table(tmp_path) == [(1, "d1", 10), (2, "d1", 20), (3, "d2", 30)]
    dt = DeltaTable(str(tmp_path / "table"))
    assert dt.transaction_version("spark_ckpt/daily@2026-11-21/out-delta") == 1
    assert dt.transaction_version("spark_ckpt/daily@2026-11-22/out-delta") == 1
    with pytest.raises(JobDefinitionError, match="run key"):
        BatchJob("daily", run_key="a/b")


def test_default_mode_refuses_a_table_that_already_holds_rows(spark, tmp_path):
    run(spark, tmp_path, "r1", [(1, "d1", 1)], mode="error")  # an empty new table is fine
    with pytest.raises(JobDefinitionError, match="already holds rows"):
        run(spark, tmp_path, "r2", [(2, "d1", 2)], mode="error")
    assert table(tmp_path) == [(1, "d1", 10)]  # nothing doubled, nothing lost


def test_overwrite_replaces_every_row(spark, tmp_path):
    run(spark, tmp_path, "r1", [(1, "d1", 1), (2, "d2", 2)], mode="overwrite")
    run(spark, tmp_path, "r2", [(3, "d1", 3)], mode="overwrite")
    assert table(tmp_path) == [(3, "d1", 30)]


def test_overwrite_partitions_replaces_only_the_partitions_written(spark, tmp_path):
    kw = {"mode": "overwrite_partitions", "partition_by": ["day"]}
    run(spark, tmp_path, "d1", [(1, "d1", 1), (2, "d1", 2)], **kw)
    run(spark, tmp_path, "d2", [(3, "d2", 3)], **kw)
    run(spark, tmp_path, "d1-corrected", [(1, "d1", 5)], **kw)  # a corrected run of day d1
    assert table(tmp_path) == [(1, "d1", 50), (3, "d2", 30)]
    # the same three writes in Spark's dynamic partition overwrite leave the same rows
    spark_dir = str(tmp_path / "spark")
    for rows in ([(1, "d1", 10), (2, "d1", 20)], [(3, "d2", 30)], [(1, "d1", 50)]):
        (spark.createDataFrame(rows, "id long, day string, value long").write
         .mode("overwrite").option("partitionOverwriteMode", "dynamic").partitionBy("day")
         .parquet(spark_dir))
    want = sorted(tuple(r) for r in spark.read.parquet(spark_dir).select(
        "id", "day", "value").collect())
    assert table(tmp_path) == want


def test_merge_upserts_on_the_keys_once(spark, tmp_path, monkeypatch):
    """A crash after the MERGE commit landed, before it was logged: the next attempt finds
    the run's app transaction in the table and does not merge again."""
    from spark_ckpt import faults

    kw = {"mode": "merge", "merge_keys": ["id"]}
    run(spark, tmp_path, "r1", [(i, "d1", 1) for i in range(10)], **kw)
    faults._spec_seen[0] = None
    monkeypatch.setenv("SPARK_CKPT_FAULT", "sink.committed:1:fail")
    with pytest.raises(OSError, match="injected"):
        run(spark, tmp_path, "r2", [(i, "d2", 2) for i in range(5, 15)], **kw)
    monkeypatch.delenv("SPARK_CKPT_FAULT")
    want = sorted([(i, "d1", 10) for i in range(5)] + [(i, "d2", 20) for i in range(5, 15)])
    assert table(tmp_path) == want
    again = run(spark, tmp_path, "r2", [(i, "d2", 3) for i in range(5, 15)], **kw)
    assert again.status == "succeeded" and again.ran == 0 and again.sinks == {"out-delta": 1}
    assert table(tmp_path) == want  # merged once, not twice, not with the new rows
    assert len(DeltaTable(str(tmp_path / "table")).history()) == 3  # create + two merges


@pytest.mark.parametrize("mode", ["append", "merge"])
def test_a_wave_of_partitions_sharing_files_commits_each_file_once(spark, tmp_path, mode):
    """Split mode: partitions of a wave share its files; the sink adds (or merges) each once."""
    import dataclasses

    src = tmp_path / "src"
    spark.range(0, 400).withColumn("v", F.col("id") * 2).repartition(4).write.parquet(str(src))
    settings = dataclasses.replace(SETTINGS, batch_partitions_per_wave=2)
    job = BatchJob("waves", spark=spark, work_dir=str(tmp_path / "work"), settings=settings)
    files = job.read_files("files", str(src))
    out = job.vertex("out", lambda df: df.withColumn("w", F.col("v") + 1), files)
    job.write_delta(out, str(tmp_path / "table"), mode=mode,
                    merge_keys=["id"] if mode == "merge" else ())
    result = job.run()
    assert result.vertices["out"].partitions == 4 and result.ran == 4
    frame = read_delta(str(tmp_path / "table")).to_pandas()
    assert sorted(frame["id"]) == list(range(400))


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "overwrite_partitions"}, "needs partition_by"),
    ({"mode": "merge"}, "needs merge_keys"),
    ({"mode": "append", "merge_keys": ["id"]}, "only for merge"),
    ({"mode": "upsert"}, "expected mode"),
])
def test_sink_modes_are_checked_when_declared(spark, tmp_path, kwargs, message):
    job = BatchJob("modes", spark=spark, work_dir=str(tmp_path))
    src = job.source("s", lambda s: s.range(3))
    with pytest.raises(JobDefinitionError, match=message):
        job.write_delta(src, str(tmp_path / "t"), **kwargs)
