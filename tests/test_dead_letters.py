"""Malformed rows reach the dead-letter table once per (source, batch), whatever order the
batches' sources are parsed in."""

from __future__ import annotations

import os
import time

import pytest

from spark_ckpt import StreamingContext
from spark_ckpt.storage.delta_reader import read_delta
from spark_ckpt.options import Settings

BASE_S = 1_767_225_600
JSON_OUTPUT_JOBS = 1  # the output's write (a Parquet file sink: one job)


@pytest.mark.slow
def test_two_windows_over_one_source_write_every_malformed_line_once(spark, tmp_path):
    """A window of length 1 every 2 batches, declared first, parses batch 1 before a window of
    length 2 every 2 batches parses batch 0: batch 1's dead letters are committed before
    batch 0's are asked for. A version counting batches said batch 0's were written; they
    were not, and its malformed lines were neither kept nor processed."""
    landing = tmp_path / "landing"
    landing.mkdir()
    bad: set[str] = set()
    for f in range(4):
        lines = [f"{f * 10 + i},name{i},{i}.5" for i in range(5)]
        broken = [f"{f * 10 + 5},oops{f},not-a-number", f"{f * 10 + 6},short{f}"]
        bad.update(broken)
        path = landing / f"f{f}.csv"
        path.write_text("\n".join(lines + broken) + "\n")
        os.utime(path, (BASE_S + f, BASE_S + f))
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "twowindows",
                           settings=Settings(progress="never"))
    src = ctx.file_stream("csv", str(landing), "csv", schema="id INT, name STRING, score DOUBLE",
                          max_files_per_batch=1)
    short: list[int] = []
    long: list[int] = []
    src.window(1, 2).foreach_batch(lambda df, b: short.extend(r.id for r in df.collect()),
                                   name="short")
    src.window(2, 2).foreach_batch(lambda df, b: long.extend(r.id for r in df.collect()),
                                   name="long")
    ctx.process_available(timeout=300)
    assert sorted(long) == sorted(f * 10 + i for f in range(4) for i in range(5))
    dead = read_delta(str(tmp_path / "ckpt" / "deadletter")).to_pandas()
    assert sorted(dead.record.str.strip()) == sorted(bad)  # each malformed line once
    assert sorted(dead.batch_id) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_json_rows_are_counted_and_routed_within_the_batchs_own_jobs(spark, tmp_path):
    """A JSON batch is parsed once, by the pipeline's own job: its rows are counted and its
    malformed rows found as that job reads them (no persist, no counting job before it), and
    only a batch with malformed rows reads its files again to write them to the dead-letter
    table. Every malformed line reaches it once, every good row the output, and the progress
    counts every line."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        pytest.skip("a Connect client persists and counts first (no metrics before an action)")
    landing = tmp_path / "landing"
    landing.mkdir()
    # the third is malformed only in a column the pipeline does not select: still malformed
    # (Spark's reader parses only the columns a query reads; the batch is read as a whole)
    bad = ['{"id": 15, "name": "oops", "score": "x"', "not json at all",
           '{"id": 16, "name": "typed", "score": "not-a-number"}']
    for f in range(3):
        lines = [f'{{"id": {f * 10 + i}, "name": "n{i}", "score": {i}.5}}' for i in range(5)]
        path = landing / f"f{f}.json"
        path.write_text("\n".join(lines + (bad if f == 1 else [])) + "\n")
        os.utime(path, (BASE_S + f, BASE_S + f))
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "jsononce",
                           settings=Settings(progress="never"))
    src = ctx.file_stream("js", str(landing), "json",
                          schema="id INT, name STRING, score DOUBLE", max_files_per_batch=1)
    src.select("id").write_parquet(str(tmp_path / "out"), name="rows")
    progress = ctx.process_available(timeout=300)
    assert [p["num_input_rows"] for p in progress] == [5, 8, 5]
    assert [p["sources"]["js"]["dead_letter_rows"] for p in progress] == [0, 3, 0]
    out = spark.read.parquet(str(tmp_path / "out")).toPandas()
    assert sorted(out.id) == [f * 10 + i for f in range(3) for i in range(5)]
    dead = read_delta(str(tmp_path / "ckpt" / "deadletter")).to_pandas()
    assert sorted(dead.record.str.strip()) == sorted(bad)
    assert list(dead.batch_id) == [1, 1, 1]
    tracker = spark.sparkContext.statusTracker()

    def jobs_of_batches() -> list[int]:
        return [len(tracker.getJobIdsForGroup(f"spark_ckpt-jsononce-b{b}")) for b in range(3)]

    deadline = time.monotonic() + 30
    jobs = jobs_of_batches()
    # the status tracker is fed by Spark's listener bus, which may lag the jobs' ends: polled
    # until every batch's jobs are listed (or a 30 s deadline), then checked. The sleep only
    # paces the poll: it cannot make the test flaky, since a lagging bus is waited for and the
    # counts asserted are those of jobs that have already ended
    while time.monotonic() < deadline and (min(jobs) < JSON_OUTPUT_JOBS or jobs[1] < 2):
        time.sleep(0.1)
        jobs = jobs_of_batches()
    # a batch without malformed rows runs its output's write alone; the one with them, the
    # write and then the dead letters' read and write
    assert jobs[0] == jobs[2] == JSON_OUTPUT_JOBS, jobs
    assert jobs[1] > jobs[0], jobs


def test_a_foreach_batch_that_reads_part_of_a_batch_still_dead_letters_all_of_it(spark,
                                                                                 tmp_path):
    """A foreach_batch function that first asks ``df.isEmpty()`` (a job that reads one row)
    and only then reads the batch: the batch is counted and routed as a whole, not by what
    its first job happened to read (counting as the pipeline's jobs read a batch is only for
    pipelines whose operators and sinks are all spark_ckpt's own)."""
    landing = tmp_path / "landing"
    landing.mkdir()
    good = [f'{{"id": {i}, "name": "n{i}", "score": {i}.5}}' for i in range(6)]
    bad = ["broken one", '{"id": 7, "name": "typed", "score": "nan-ish"}']
    (landing / "f0.json").write_text("\n".join(good[:3] + bad + good[3:]) + "\n")
    os.utime(landing / "f0.json", (BASE_S, BASE_S))
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "partial",
                           settings=Settings(progress="never"))
    seen: list[int] = []

    def peek_then_read(df, _b: int) -> None:
        if not df.isEmpty():
            seen.extend(r.id for r in df.collect())

    ctx.file_stream("js", str(landing), "json", schema="id INT, name STRING, score DOUBLE") \
        .foreach_batch(peek_then_read, name="peek")
    progress = ctx.process_available(timeout=300)
    assert sorted(seen) == list(range(6))
    assert progress[0]["num_input_rows"] == 8
    assert progress[0]["sources"]["js"]["dead_letter_rows"] == 2
    dead = read_delta(str(tmp_path / "ckpt" / "deadletter")).to_pandas()
    assert sorted(dead.record.str.strip()) == sorted(bad)
