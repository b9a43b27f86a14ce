"""Batch jobs on a real SparkSession with real Delta tables and Parquet files."""

from __future__ import annotations

from spark_ckpt.storage.delta_reader import read_delta
import pytest
from chispa import assert_df_equality
from deltalake import DeltaTable
from pyspark.sql import functions as F

import orders_report as report
from helpers import TOTAL_PARTITIONS, assert_outputs_equal, delta_writes, finished_in_log
from spark_ckpt import BatchJob, JobDefinitionError, Settings
from spark_ckpt.eventlog.reader import read_events
from spark_ckpt.storage import Storage

# exchanges however small the tests' inputs (spark.ckpt.batch.exchangeMinBytes=0): the
# orders report's join runs through its durable exchanges, as a large job's does
SETTINGS = Settings(progress="never", event_log_flush_interval_ms=200, batch_exchange_min_bytes=0)


def build(spark, orders_input, tmp_path, job_id="orders"):
    job = report.build_job(job_id, orders_input, str(tmp_path / "out"), parallelism=4,
                           agg_parallelism=2, work_dir=str(tmp_path / "work"), spark=spark,
                           settings=SETTINGS)
    return job


def test_job_output_equals_plain_spark_and_every_partition_is_logged(
        spark, orders_input, expected_daily, tmp_path):
    result = build(spark, orders_input, tmp_path).run()
    assert result.status == "succeeded"
    assert (result.ran, result.reused) == (TOTAL_PARTITIONS, 0)
    assert {v: s.partitions for v, s in result.vertices.items()} == {
        "enriched": 4, "payments-to-settled": 4, "settled": 4, "daily": 2}
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)
    assert result.sinks == {"settled-parquet": 1, "daily-delta": 1}
    assert len(finished_in_log(str(tmp_path / "work"))) == TOTAL_PARTITIONS

    events = read_events(Storage(str(tmp_path / "work")), str(tmp_path / "work/orders/events"))
    types = [e.type.value for e in events.events]
    assert types[0] == "JobAttemptStarted" and types[-1] == "JobAttemptFinished"
    assert types.count("JobVertexInitialized") == 7  # virtual sources too: their splits
    finished = [e for e in events.events if e.type.value == "ExecutionVertexFinished"]
    for e in finished:
        assert e.attempt_id and e.duration_ms is not None and e.bytes > 0
        assert e.payload["coordinator_state"] == {"checkpoint_id": -1}
        for out in e.payload["outputs"]:
            assert out["size"] > 0 and out["path"]
    assert sum(e.rows for e in finished if e.vertex_id == "settled") == \
        expected_daily["settled_rows"]
    splits = next(e for e in events.events if e.vertex_id == "orders").payload
    assert len(splits["coordinator_state"]["splits"]) == 4


def test_resubmitting_a_completed_job_runs_and_writes_nothing(
        spark, orders_input, tmp_path):
    build(spark, orders_input, tmp_path).run()
    again = build(spark, orders_input, tmp_path).run()
    assert again.status == "already-complete" and again.ran == 0
    assert delta_writes(str(tmp_path / "out")) == 1


def test_fresh_run_archives_the_old_log_and_appends_again(spark, orders_input, tmp_path):
    build(spark, orders_input, tmp_path).run()
    result = build(spark, orders_input, tmp_path).run(fresh=True)
    assert result.status == "succeeded" and result.ran == TOTAL_PARTITIONS
    assert result.sinks == {"settled-parquet": 2, "daily-delta": 2}
    assert delta_writes(str(tmp_path / "out")) == 2
    assert result.attempt == 2  # numbers go on, so the first attempt is fenced off
    job_dir = tmp_path / "work" / "orders"
    assert any(p.name.startswith("events.archived-") for p in job_dir.iterdir())
    from spark_ckpt.batch.runner import JobRunner

    import dataclasses

    settings = dataclasses.replace(SETTINGS, work_dir=str(tmp_path / "work"))
    old_job = build(spark, orders_input, tmp_path)
    old_driver = JobRunner(old_job.graph, old_job.run_id, spark, settings)
    old_driver.attempt = 1
    # the first attempt's claim is older than the fence's newest, the second attempt's
    from deltalake import DeltaTable

    old_driver.fence.version = DeltaTable(str(job_dir / "fence")).version() - 1
    assert old_driver._is_fenced()


def test_dataframe_source_and_partitioned_delta_sink(spark, tmp_path):
    job = BatchJob("numbers", spark=spark, work_dir=str(tmp_path / "work"), settings=SETTINGS)
    numbers = job.source("numbers", lambda s: s.range(0, 1000).withColumn(
        "bucket", (F.col("id") % 7).cast("int")), parallelism=3, split_by=["id"])
    sums = job.vertex("sums", lambda df: df.groupBy("bucket").agg(F.sum("id").alias("total")),
                      numbers.by("bucket"), parallelism=2)
    job.write_delta(sums, str(tmp_path / "sums"), partition_by=["bucket"])
    result = job.run()
    # the DataFrame source is read in place; its split's partial sums are the durable cut (on
    # Spark Connect too, from the client's plan tree)
    assert {v: s.ran for v, s in result.vertices.items()} == {"sums-partial": 3, "sums": 2}
    got = read_delta(str(tmp_path / "sums")).to_pandas().sort_values("bucket")
    want = spark.range(0, 1000).groupBy((F.col("id") % 7).cast("int").alias("bucket")).agg(
        F.sum("id").alias("total")).toPandas().sort_values("bucket")
    assert got["total"].tolist() == want["total"].tolist()
    assert DeltaTable(str(tmp_path / "sums")).metadata().partition_columns == ["bucket"]


def test_the_batch_runner_stamps_time_from_the_injected_clock(spark, tmp_path):
    import json

    from spark_ckpt.clock import ManualClock

    clock = ManualClock(start_ms=1_234_000)
    job = BatchJob("clocked", spark=spark, work_dir=str(tmp_path / "work"), settings=SETTINGS,
                   clock=clock)
    numbers = job.source("numbers", lambda s: s.range(0, 10), parallelism=2, split_by=["id"])
    job.write_parquet(numbers, str(tmp_path / "out"))
    assert job.run().status == "succeeded"
    marker = json.loads((tmp_path / "work" / "clocked" / "attempts" / "00001.json").read_text())
    assert marker["started_ms"] == 1_234_000
    events = read_delta(str(tmp_path / "work" / "clocked" / "events")).to_pandas()
    assert {t.value // 1000 for t in events["event_time"]} == {1_234_000_000}  # microseconds
    finished = events[events["event_type"] == "ExecutionVertexFinished"]
    assert len(finished) == 2
    for payload in finished["payload"]:
        body = json.loads(payload)
        assert body["started_ms"] == body["finished_ms"] == 1_234_000


def test_csv_and_json_sources_read_with_the_declared_schema(spark, tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "a.csv").write_text("id,name\n1,x\n2,y\n")
    (tmp_path / "csv" / "b.csv").write_text("id,name\n3,z\n")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "a.json").write_text('{"id": 1, "score": 0.5}\n{"id": 3, "score": 2.0}\n')
    job = BatchJob("mixed", spark=spark, work_dir=str(tmp_path / "work"), settings=SETTINGS)
    names = job.read_files("names", str(tmp_path / "csv"), format="csv",
                           schema="id long, name string", options={"header": "true"},
                           parallelism=2)
    scores = job.read_files("scores", str(tmp_path / "json"), format="json",
                            schema="id long, score double")
    joined = job.vertex("joined", lambda n, s: n.join(s, "id", "left"), names,
                        scores.broadcast())
    job.write_parquet(joined, str(tmp_path / "out"))
    job.run()
    got = spark.read.parquet(str(tmp_path / "out"))
    want = spark.createDataFrame([(1, "x", 0.5), (2, "y", None), (3, "z", 2.0)],
                                 "id long, name string, score double")
    assert_df_equality(got, want, ignore_row_order=True, ignore_nullable=True)


def test_malformed_source_rows_are_read_as_spark_reads_them(spark, tmp_path):
    """PERMISSIVE (Spark's default) gives nulls, FAILFAST fails the job, as in spark.read."""
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "bad.csv").write_text("id,name\nnot-a-number,x\n7,y\n")
    for mode in ("PERMISSIVE", "FAILFAST"):
        job = BatchJob(f"bad-{mode}", spark=spark, work_dir=str(tmp_path / "work"),
                       settings=SETTINGS)
        options = {"header": "true", "mode": mode}
        rows = job.read_files("rows", str(tmp_path / "csv"), format="csv",
                              schema="id long, name string", options=options)
        doubled = job.vertex("doubled", lambda df: df.withColumn("id2", F.col("id") * 2), rows)
        job.write_parquet(doubled, str(tmp_path / f"out-{mode}"))
        plain = spark.read.options(**options).schema("id long, name string").csv(
            str(tmp_path / "csv")).withColumn("id2", F.col("id") * 2)
        if mode == "PERMISSIVE":
            job.run()
            assert_df_equality(spark.read.parquet(str(tmp_path / f"out-{mode}")), plain,
                               ignore_row_order=True, ignore_nullable=True)
        else:
            with pytest.raises(Exception, match="(?i)malformed"):
                plain.collect()
            with pytest.raises(Exception, match="(?i)malformed"):
                job.run()


def test_shuffling_function_that_drops_its_key_is_refused_clearly(spark, orders_input, tmp_path):
    job = BatchJob("nokey", spark=spark, work_dir=str(tmp_path / "work"), settings=SETTINGS)
    orders = job.read_files("orders", f"{orders_input}/orders", parallelism=2)
    totals = job.vertex("totals", lambda df: df.groupBy("customer_id").agg(
        F.sum("amount").alias("total")).select("total"), orders.by("customer_id"))
    job.write_parquet(totals, str(tmp_path / "out"))
    with pytest.raises(JobDefinitionError, match=r"expected key columns \['customer_id'\]"):
        job.run()


def test_delta_sink_with_another_schema_is_refused_naming_both(spark, orders_input, tmp_path):
    import pyarrow as pa

    DeltaTable.create(str(tmp_path / "out" / "daily"), pa.schema([("x", pa.int64())]))
    with pytest.raises(JobDefinitionError, match=r"the job writes columns .* the table has "
                                                 r"\(x int64\)"):
        build(spark, orders_input, tmp_path).run()


def test_job_definition_errors(spark, tmp_path):
    with pytest.raises(JobDefinitionError, match="job id"):
        BatchJob("a/b")
    job = BatchJob("defs", spark=spark, work_dir=str(tmp_path))
    with pytest.raises(JobDefinitionError, match="found nothing at that path"):
        job.read_files("x", str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_text("")
    with pytest.raises(JobDefinitionError, match="found none"):
        job.read_files("y", str(tmp_path / "empty"), format="csv")
    src = job.source("src", lambda s: s.range(3))
    with pytest.raises(JobDefinitionError, match="every input is broadcast"):
        job.vertex("v", lambda d: d, src.broadcast())
    with pytest.raises(JobDefinitionError, match="needs split_by"):
        job.source("src2", lambda s: s.range(3), parallelism=2)


def _failed_after_every_vertex(job, monkeypatch, vertices: int) -> None:
    """Run ``job`` to its sinks' commit, which fails: every vertex finished, nothing
    committed, the sinks' files still staged."""
    from spark_ckpt import faults

    monkeypatch.setattr(faults, "_spec_seen", [None])  # passes counted afresh
    monkeypatch.setenv("SPARK_CKPT_FAULT", f"vertex.finished:{vertices}:fail")
    with pytest.raises(OSError, match="injected storage failure at fault point vertex.finished"):
        job.run()
    monkeypatch.delenv("SPARK_CKPT_FAULT")


def test_a_few_lost_partitions_of_a_keyed_vertex_run_as_that_many_spark_partitions(
        spark, orders_input, expected_daily, tmp_path, monkeypatch):
    """Two of settled's eight partitions lost: the re-run writes them through three Spark
    partitions (partition parts[i] in Spark partition i, the last for rows of no running
    partition), not eight of which six would be empty tasks; its answer is plain Spark's. With
    the extra shuffle judged dearer than the empty tasks, the same re-run goes through a stage
    as wide as the vertex (Spark partition j is partition j), with the same answer."""
    import dataclasses

    from spark_ckpt.batch import planning

    settings = dataclasses.replace(SETTINGS, batch_exchange_min_bytes=8 << 20)  # no exchange

    def job(out):
        return report.build_job("orders", orders_input, str(out), parallelism=8,
                                agg_parallelism=2, work_dir=str(out / "work"), spark=spark,
                                settings=settings)

    for positional in (True, False):
        out = tmp_path / f"positional-{positional}"
        if not positional:
            monkeypatch.setattr(planning, "_EMPTY_TASK_BYTES", 0)
        _failed_after_every_vertex(job(out), monkeypatch, 3)  # enriched, settled, daily
        staged = out / "settled" / "_spark_ckpt_staging" / "orders" / "settled"
        for p in (2, 5):
            next(staged.glob(f"a1-*/part-0000{p}-*.parquet")).unlink()
        result = job(out).run()
        assert result.status == "succeeded"
        assert {v: s.ran for v, s in result.vertices.items()} == {
            "enriched": 0, "settled": 2, "daily": 2}
        assert result.lost == [("settled", 2), ("settled", 5)]
        events = read_events(Storage(str(out / "work")), str(out / "work/orders/events"))
        paths = {e.partition: e.payload["outputs"][0]["path"] for e in events.events
                 if e.type.value == "ExecutionVertexFinished" and e.vertex_id == "settled"
                 and e.job_attempt == 2}
        spark_partition = {p: path.rsplit("/", 1)[1].split("-")[1] for p, path in paths.items()}
        assert spark_partition == ({2: "00000", 5: "00001"} if positional else
                                   {2: "00002", 5: "00005"}), paths
        assert_outputs_equal(spark, str(out), expected_daily)


def test_rows_moved_out_of_the_partitions_running_are_refused_however_they_are_laid_out(
        spark, tmp_path, monkeypatch):
    """A keyed vertex whose function changes its key: a whole run places each row by its new
    key, but a re-run of some partitions would write rows of partitions it does not run. It
    is refused as the rows are moved, before any task writes (so the poller can log no
    partition of it), laid out by position or as wide as the vertex."""
    from spark_ckpt import TaskExecutionError
    from spark_ckpt.batch import planning

    def job(out):
        job = BatchJob("shift", spark=spark, work_dir=str(out / "work"), settings=SETTINGS)
        numbers = job.source("numbers", lambda s: s.range(0, 400).withColumn(
            "k", F.col("id") % 40), parallelism=2, split_by=["id"])
        shifted = job.vertex("shifted", lambda df: df.withColumn("k", F.col("k") + 1),
                             numbers.by("k"), parallelism=8)
        job.write_parquet(shifted, str(out / "shifted"))
        return job

    for positional in (True, False):
        out = tmp_path / f"positional-{positional}"
        if not positional:
            monkeypatch.setattr(planning, "_EMPTY_TASK_BYTES", 0)
        _failed_after_every_vertex(job(out), monkeypatch, 1)
        staged = out / "shifted" / "_spark_ckpt_staging" / "shift" / "shifted"
        next(staged.glob("a1-*/part-00003-*.parquet")).unlink()
        with pytest.raises(TaskExecutionError, match=r"vertex shifted: a row of partition \d+, "
                           r"which is not running, came out of partitions 3\.\.3"):
            job(out).run()
        assert ("shifted", 3) not in finished_in_log(str(out / "work"), "shift")
        assert not list(staged.glob("a2-*/part-*.parquet"))  # no task wrote
