"""Recovery on faulty storage (spark_ckpt.storage.faulty): writes, creates, renames, reads and
listings
that fail, fill the disk, stall or tear, at chosen points of real pipelines and batch jobs on a
real SparkSession. Each case checks the same two things: the run stops with a clear storage
error (or rides it out, where that is the promise), and a restart on healthy storage gives
exactly the output of an uninterrupted run: nothing committed is lost or written twice."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys

from pathlib import Path

import orders_data
import pandas as pd
import pytest
import stream_orders
from deltalake import DeltaTable
from helpers import ROOT, assert_outputs_equal, child_env, delta_writes

from spark_ckpt import CheckpointError, PipelineFailedError, Settings
from spark_ckpt.storage import faulty as faultfs
from spark_ckpt.storage.delta_reader import read_delta
from spark_ckpt.storage import Storage

FILES = 4
ROWS = 400
NAME = "stream-orders"


def rules(*items: dict) -> str:
    return json.dumps(list(items))


@pytest.fixture(scope="module")
def stream_input(tmp_path_factory):
    base = tmp_path_factory.mktemp("faulty-input")
    orders_data.generate(str(base / "static"), orders=100, files=1, customers=200)
    orders_data.drop_order_files(str(base / "landing"), files=FILES, rows_per_file=ROWS,
                                 customers=200, malformed_every=150)
    return base


def pipeline(spark, stream_input, base, **settings):
    return stream_orders.build_pipeline(
        spark, str(stream_input / "landing"), str(stream_input / "static" / "customers"),
        str(base / "out"), str(base / "ckpt"), interval=0.05, max_files_per_batch=1,
        settings=Settings(progress="never", **settings))


@pytest.fixture(scope="module")
def expected(spark, stream_input, tmp_path_factory):
    out = tmp_path_factory.mktemp("faulty-expected")
    assert len(pipeline(spark, stream_input, out).process_available(timeout=300)) == FILES
    return out


def assert_stream_output(spark, expected, base) -> None:
    got = read_delta(str(base / "out" / "enriched")).to_pandas()
    want = read_delta(str(expected / "out" / "enriched")).to_pandas()
    assert got["order_id"].is_unique and len(got) == len(want)
    pd.testing.assert_frame_equal(
        got.sort_values("order_id").reset_index(drop=True),
        want.sort_values("order_id").reset_index(drop=True), check_like=True)
    dead = read_delta(str(base / "ckpt" / "deadletter")).to_pandas()
    dead_want = read_delta(str(expected / "ckpt" / "deadletter")).to_pandas()
    assert sorted(dead["record"]) == sorted(dead_want["record"])
    cols = ["order_id", "region", "amount"]
    got_pq = spark.read.parquet(str(base / "out" / "by_region")).select(*cols).toPandas()
    want_pq = spark.read.parquet(str(expected / "out" / "by_region")).select(*cols).toPandas()
    assert got_pq["order_id"].is_unique
    pd.testing.assert_frame_equal(got_pq.sort_values("order_id").reset_index(drop=True),
                                  want_pq.sort_values("order_id").reset_index(drop=True))
    pipeline_id = json.loads((base / "ckpt" / "metadata.json").read_text())["pipeline_id"]
    assert DeltaTable(str(base / "out" / "enriched")).transaction_version(
        f"spark_ckpt/{NAME}-{pipeline_id}/enriched") == FILES  # one Delta commit per batch


def test_the_fault_file_system_does_what_its_rules_say(tmp_path, monkeypatch):
    monkeypatch.setenv(faultfs.ENV, rules(
        {"op": "write", "path": "*/a/*", "nth": "2", "action": "fail"},
        {"op": "create", "path": "*/c/*", "action": "enospc"},
        {"op": "read", "path": "*/r.json", "action": "torn", "keep": 3},
        {"op": "rename", "path": "*/m/*", "nth": "2-", "action": "fail"},
        {"op": "delete", "path": "*/d/*", "action": "fail"}))
    store = Storage(str(tmp_path))
    store.write_atomic(store.path("a/1"), b"one")
    with pytest.raises(OSError, match="injected I/O error") as failed:
        store.write_atomic(store.path("a/2"), b"two")
    assert failed.value.errno == errno.EIO
    store.write_atomic(store.path("a/3"), b"three")
    assert sorted(os.listdir(tmp_path / "a")) == ["1", "3"]  # nothing published by the failure
    with pytest.raises(OSError, match="no space left") as full:
        store.create_exclusive(store.path("c/x"), b"xxxx")
    assert full.value.errno == errno.ENOSPC and os.listdir(tmp_path / "c") == []
    assert store.create_exclusive(store.path("c/x"), b"xxxx")  # the disk has room again
    store.write_atomic(store.path("r.json"), b"abcdefgh")
    assert store.read_bytes(store.path("r.json")) == b"abc"  # a short read, once
    assert store.read_bytes(store.path("r.json")) == b"abcdefgh"
    store.write_atomic(store.path("m/1"), b"1")
    store.move(store.path("m/1"), store.path("m/2"))
    with pytest.raises(OSError, match="injected I/O error"):
        store.fs.move(store.path("m/2"), store.path("m/3"))  # direct fs calls meet the rules
    store.write_atomic(store.path("d/f"), b"1")
    with pytest.raises(OSError, match="injected I/O error"):
        store.fs.delete_file(store.path("d/f"))
    monkeypatch.delenv(faultfs.ENV)
    assert Storage(str(tmp_path)).fs.type_name == "local"  # unset: pyarrow's own, unwrapped


def test_only_the_owner_sets_a_torn_record_aside_and_only_while_it_is_torn(tmp_path):
    from spark_ckpt.errors import JobFencedError, RecordError
    from spark_ckpt.streaming.runtime.metalog import MetadataLog

    log = MetadataLog(Storage(str(tmp_path)), str(tmp_path / "allocations"), "allocation")
    torn = tmp_path / "allocations" / "000000000003.json"
    torn.write_bytes(b'{"batch_id":3,"form')

    def fenced() -> None:
        raise JobFencedError("a newer driver owns the checkpoint directory")

    with pytest.raises(JobFencedError):  # a driver that lost the claim race moves nothing
        log.set_aside_torn_tail(lambda _b: True, fenced)
    assert torn.read_bytes() == b'{"batch_id":3,"form'

    def owner_rewrote_it() -> None:  # the owner set it aside and recorded it whole meanwhile
        torn.write_bytes(b'{"batch_id":3,"format_version":1,"kind":"allocation"}')

    with pytest.raises(RecordError, match="changed while this driver was setting it aside"):
        log.set_aside_torn_tail(lambda _b: True, owner_rewrote_it)
    assert json.loads(torn.read_bytes())["batch_id"] == 3  # the whole record stays
    torn.write_bytes(b'{"batch_id":3,"form')
    assert log.set_aside_torn_tail(lambda _b: True) == 3
    assert not torn.exists() and len(list((tmp_path / "allocations" / "torn").iterdir())) == 1


@pytest.mark.parametrize("action", ["fail", "enospc"])
def test_a_receiver_block_that_cannot_be_written_is_not_acknowledged_nor_half_kept(
        spark, tmp_path, monkeypatch, action):
    """A push whose block write fails raises to the pusher (nothing acknowledged); the pushes
    before and after it are read exactly once, also by a restarted source."""
    import pyarrow.parquet as pq
    from test_receivers import bound

    from spark_ckpt.sources.receivers import QueueSource

    monkeypatch.setenv(faultfs.ENV, rules(
        {"op": "write", "path": "*/receivedData/q/*", "nth": "2", "action": action}))
    source = bound(QueueSource("q", "id BIGINT"), tmp_path)
    source.push([(i,) for i in range(0, 5)])
    with pytest.raises(OSError, match="injected") as failed:
        source.push([(i,) for i in range(5, 10)])
    assert failed.value.errno == (errno.EIO if action == "fail" else errno.ENOSPC)
    source.push([(i,) for i in range(10, 15)])
    monkeypatch.delenv(faultfs.ENV)
    blocks_dir = tmp_path / "ckpt" / "receivedData" / "q"
    assert not [p for p in blocks_dir.rglob("*") if ".tmp-" in p.name]  # no half block kept

    def ids(piece: dict) -> list[int]:
        return sorted(i for b in piece["blocks"]
                      for i in pq.read_table(b[1]).column("id").to_pylist())

    assert ids(source.plan()) == list(range(0, 5)) + list(range(10, 15))
    restarted = bound(QueueSource("q", "id BIGINT"), tmp_path)
    restarted.restore([])
    assert ids(restarted.plan()) == list(range(0, 5)) + list(range(10, 15))


# Streaming, per-batch exactly once (jobs/stream_orders.py: Delta + Parquet outputs, a
# dead-letter table): a fault stops the pipeline with the storage error; a restart on healthy
# storage finishes with exactly the uninterrupted output.
STREAM_FAULTS = {
    "allocation-write-fails": {"op": "create", "path": "*/ckpt/allocations/*", "nth": "3"},
    "allocation-disk-full": {"op": "create", "path": "*/ckpt/allocations/*", "nth": "2",
                             "action": "enospc"},
    "commit-record-fails": {"op": "create", "path": "*/ckpt/commits/*", "nth": "2"},
    "parquet-marker-fails": {"op": "create", "path": "*/by_region/_spark_ckpt_commits/*",
                             "nth": "2"},
    "parquet-move-fails": {"op": "rename", "path": "*/by_region/*", "nth": "3"},
    "source-listing-fails": {"op": "list", "path": "*/landing", "nth": "3"},
}


@pytest.mark.parametrize("fault", list(STREAM_FAULTS), ids=list(STREAM_FAULTS))
def test_stream_storage_failure_stops_clearly_and_a_restart_is_exactly_once(
        spark, stream_input, expected, tmp_path, monkeypatch, fault):
    rule = {"action": "fail", **STREAM_FAULTS[fault]}
    monkeypatch.setenv(faultfs.ENV, rules(rule))
    ctx = pipeline(spark, stream_input, tmp_path)
    with pytest.raises(Exception) as stopped:  # noqa: PT011 - which error is checked below
        ctx.process_available(timeout=300)
    text = "".join(str(e) for e in _chain(stopped.value))
    assert "injected" in text, text  # the storage error itself is reported, not lost
    monkeypatch.delenv(faultfs.ENV)
    pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    assert_stream_output(spark, expected, tmp_path)


def test_slow_storage_changes_nothing(spark, stream_input, expected, tmp_path, monkeypatch):
    monkeypatch.setenv(faultfs.ENV, rules(
        {"op": "create", "path": "*", "nth": "1-", "action": "delay", "ms": 40},
        {"op": "write", "path": "*", "nth": "1-", "action": "delay", "ms": 40},
        {"op": "rename", "path": "*", "nth": "1-", "action": "delay", "ms": 40}))
    progress = pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    assert len(progress) == FILES
    monkeypatch.delenv(faultfs.ENV)
    assert_stream_output(spark, expected, tmp_path)


def test_a_commit_record_that_cannot_be_read_on_restart_stops_before_any_batch_runs(
        spark, stream_input, expected, tmp_path, monkeypatch):
    monkeypatch.setenv(faultfs.ENV, rules(  # two batches commit, the third is not allocated
        {"op": "create", "path": "*/ckpt/allocations/*", "nth": "3", "action": "fail"}))
    with pytest.raises(PipelineFailedError):
        pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    allocations = sorted(os.listdir(tmp_path / "ckpt" / "allocations"))
    version = DeltaTable(str(tmp_path / "out" / "enriched")).version()
    monkeypatch.setenv(faultfs.ENV, rules(
        {"op": "read", "path": "*/ckpt/commits/*", "action": "fail"}))
    with pytest.raises(Exception) as stopped:  # noqa: PT011 - its chain is checked below
        pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    assert "injected" in "".join(str(e) for e in _chain(stopped.value))
    assert sorted(os.listdir(tmp_path / "ckpt" / "allocations")) == allocations  # nothing ran
    assert DeltaTable(str(tmp_path / "out" / "enriched")).version() == version
    monkeypatch.delenv(faultfs.ENV)
    pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    assert_stream_output(spark, expected, tmp_path)


def _chain(exc: BaseException | None):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


# Torn writes: the record is published half written and the driver dies (a store without
# atomic publish, crashing mid-write). A restart must not take half a record for a whole one.
def stream_command(stream_input, tmp_path) -> list[str]:
    return [sys.executable, str(ROOT / "jobs" / "stream_orders.py"),
            "--landing", str(stream_input / "landing"),
            "--customers", str(stream_input / "static" / "customers"),
            "--output", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ckpt"),
            "--interval", "0.05", "--max-files-per-batch", "1", "--available-now"]


def run_stream(stream_input, tmp_path, fault_rules: str | None = None):
    env = child_env(**({faultfs.ENV: fault_rules} if fault_rules else {}))
    return subprocess.run(stream_command(stream_input, tmp_path), env=env, capture_output=True,
                          text=True, timeout=300, start_new_session=True, cwd=ROOT)


@pytest.mark.slow
def test_a_driver_killed_mid_write_of_an_allocation_restarts_exactly_once(
        spark, stream_input, expected, tmp_path):
    """The real thing: a driver process publishes half an allocation record and dies."""
    torn = run_stream(stream_input, tmp_path, rules(
        {"op": "create", "path": "*/ckpt/allocations/*", "nth": "3", "action": "torn"}))
    assert torn.returncode == -9, torn.stdout[-2000:] + torn.stderr[-3000:]
    again = run_stream(stream_input, tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "was torn by a crash mid-write" in again.stdout + again.stderr
    assert len(list((tmp_path / "ckpt" / "allocations" / "torn").glob("*.json"))) == 1
    assert_stream_output(spark, expected, tmp_path)


def tear_at(monkeypatch, spark, stream_input, tmp_path, pattern: str, nth: int) -> Path:
    """What a crash mid-write leaves, in this process: the ``nth`` create matching
    ``pattern`` fails (the pipeline stops there), then half its record is put in its place."""
    monkeypatch.setenv(faultfs.ENV, rules(
        {"op": "create", "path": pattern, "nth": str(nth), "action": "fail"}))
    with pytest.raises(Exception) as stopped:  # noqa: PT011 - its chain is read below
        pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    monkeypatch.delenv(faultfs.ENV)
    path = Path(re.search(r"injected I/O error \(\S+: create (\S+)\)",
                          "".join(str(e) for e in _chain(stopped.value))).group(1))
    assert not path.exists()
    path.write_bytes(b'{"batch_id":1,"format_version":1,"ki')
    return path


def test_a_torn_newest_commit_record_is_set_aside_and_the_batch_reruns_exactly_once(
        spark, stream_input, expected, tmp_path, monkeypatch, caplog):
    torn = tear_at(monkeypatch, spark, stream_input, tmp_path, "*/ckpt/commits/*", 2)
    pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    assert "was torn by a crash mid-write" in caplog.text
    assert torn.exists() and torn.read_bytes().startswith(b'{"')  # recorded again, whole
    assert_stream_output(spark, expected, tmp_path)


def test_a_torn_parquet_commit_marker_stops_clearly_and_commits_nothing_twice(
        spark, stream_input, tmp_path, monkeypatch):
    torn = tear_at(monkeypatch, spark, stream_input, tmp_path,
                   "*/by_region/_spark_ckpt_commits/*", 2)
    before = spark.read.parquet(str(tmp_path / "out" / "by_region")).count()
    with pytest.raises(Exception, match=rf"commit marker \S*{torn.name}: expected a JSON "
                       "parquet-sink-commit record, found unparseable data; its files may or "
                       "may not have been moved"):
        pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    assert spark.read.parquet(str(tmp_path / "out" / "by_region")).count() == before


def test_a_torn_allocation_of_a_batch_that_ran_stops_the_restart_and_names_the_file(
        spark, stream_input, tmp_path):
    pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    newest = sorted((tmp_path / "ckpt" / "allocations").glob("*.json"))[-1]
    newest.write_bytes(newest.read_bytes()[:40])  # torn after its batch committed
    version = DeltaTable(str(tmp_path / "out" / "enriched")).version()
    with pytest.raises(Exception, match=f"{newest.name}: expected a whole allocation record, "
                       "found 40 bytes that do not parse"):
        pipeline(spark, stream_input, tmp_path).process_available(timeout=300)
    assert newest.exists() and DeltaTable(str(tmp_path / "out" / "enriched")).version() \
        == version


# Keyed state with barrier checkpoints and two-phase Delta sinks.
def stateful(spark, base, total: int, **kw):
    from spark_ckpt import StreamingContext
    from spark_ckpt.state import count, sum_

    ctx = StreamingContext(spark, 0.05, str(base / "ckpt"), "faulty-agg", settings=Settings(
        progress="never", checkpoint_interval_ms=1, state_parallelism=2, **kw))
    gen = ctx.generator_stream("gen", rows_per_batch=300, total_rows=total, keys=37)
    agg = gen.key_by("key").agg(name="totals", n=count(), total=sum_("value"))
    agg.write_delta(str(base / "totals"), name="totals", merge_keys=["key"])
    return ctx


def expected_totals(spark, total: int) -> pd.DataFrame:
    from pyspark.sql import functions as F

    df = spark.range(0, total).select(
        F.pmod("id", F.lit(37)).alias("key"),
        (F.pmod(F.xxhash64("id", F.lit(42)), F.lit(1_000_000)) / 100.0).alias("value"))
    return df.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total")) \
        .toPandas().sort_values("key").reset_index(drop=True)


def assert_totals(spark, base, total: int) -> None:
    got = read_delta(str(base / "totals")).to_pandas()[["key", "n", "total"]]
    got = got.sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, expected_totals(spark, total), check_dtype=False,
                                  rtol=1e-9)


def test_a_checkpoint_whose_metadata_cannot_be_written_fails_and_a_restart_is_exactly_once(
        spark, tmp_path, monkeypatch):
    monkeypatch.setenv(faultfs.ENV, rules(
        {"op": "create", "path": "*/checkpoints/chk-*/_metadata.json", "nth": "2",
         "action": "enospc"}))
    with pytest.raises(CheckpointError, match="tolerableFailures=0; last: checkpoint 2: "
                       "writing the checkpoint metadata failed .*no space left"):
        stateful(spark, tmp_path, 1500).process_available(timeout=300)
    monkeypatch.delenv(faultfs.ENV)
    stateful(spark, tmp_path, 1500).process_available(timeout=300)
    assert_totals(spark, tmp_path, 1500)


def test_tolerated_checkpoint_failures_ride_out_a_storage_outage(spark, tmp_path, monkeypatch):
    monkeypatch.setenv(faultfs.ENV, rules(
        {"op": "create", "path": "*/checkpoints/chk-*/_metadata.json", "nth": "2-3"}))
    ctx = stateful(spark, tmp_path, 1500, checkpoint_tolerable_failures=2)
    ctx.process_available(timeout=300)
    statuses = [c["status"] for c in ctx.recent_checkpoints]
    assert statuses.count("aborted") == 2 and statuses[-1] == "completed", statuses
    monkeypatch.delenv(faultfs.ENV)
    assert_totals(spark, tmp_path, 1500)


# Batch jobs: a sink commit whose storage fails stops the run with the error; the same job
# submitted again commits exactly once.
BATCH_FAULTS = {
    "parquet-marker-fails": {"op": "create", "path": "*/settled/_spark_ckpt_commits/*"},
    "parquet-move-disk-full": {"op": "rename", "path": "*/settled/*", "nth": "2",
                               "action": "enospc"},
    "attempt-marker-fails": {"op": "create", "path": "*/attempts/*"},
}


@pytest.mark.parametrize("fault", list(BATCH_FAULTS), ids=list(BATCH_FAULTS))
def test_batch_storage_failure_then_resubmit_commits_exactly_once(
        spark, orders_input, expected_daily, tmp_path, monkeypatch, fault):
    import orders_report

    def run():
        job = orders_report.build_job("orders", orders_input, str(tmp_path / "out"),
                                      parallelism=4, agg_parallelism=2,
                                      work_dir=str(tmp_path / "work"), spark=spark)
        return job.run()

    monkeypatch.setenv(faultfs.ENV, rules({"action": "fail", **BATCH_FAULTS[fault]}))
    with pytest.raises(Exception) as failed:  # noqa: PT011 - its chain is checked below
        run()
    assert "injected" in "".join(str(e) for e in _chain(failed.value))
    monkeypatch.delenv(faultfs.ENV)
    run()
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)
    assert delta_writes(str(tmp_path / "out")) == 1

