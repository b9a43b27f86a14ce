"""Streaming drivers killed with SIGKILL, restarted: outputs equal an uninterrupted run's.

CI runs one chain of drivers killed at three points of a batch's protocol in turn (in a fresh
batch, in the rerun of a recovered one, and after it); SPARK_CKPT_LONG_FAULTS=1 runs the chain
at all five points and adds one test per kill point and a chain of seeded random kill points.
"""

from __future__ import annotations

import json

import random
import re
import shutil
import subprocess
import sys

import orders_data
import pandas as pd
import pytest
import stream_orders
from chispa import assert_df_equality
from deltalake import DeltaTable
from helpers import LONG_FAULTS, LONG_ONLY, ROOT, child_env, kill_group

from spark_ckpt import Settings

pytestmark = pytest.mark.slow

FILES = 8
ROWS = 1500
NAME = "stream-orders"


@pytest.fixture(scope="module")
def stream_input(tmp_path_factory):
    base = tmp_path_factory.mktemp("stream-input")
    orders_data.generate(str(base / "static"), orders=100, files=1, customers=500)
    orders_data.drop_order_files(str(base / "landing"), files=FILES, rows_per_file=ROWS,
                                 customers=500, malformed_every=300)
    return base


@pytest.fixture(scope="module")
def expected(spark, stream_input, tmp_path_factory):
    """The same pipeline run uninterrupted, in this process."""
    out = tmp_path_factory.mktemp("stream-expected")
    ctx = stream_orders.build_pipeline(
        spark, str(stream_input / "landing"), str(stream_input / "static" / "customers"),
        str(out / "out"), str(out / "ckpt"), interval=0.1, max_files_per_batch=1,
        settings=Settings(progress="never"))
    progress = ctx.process_available(timeout=600)  # generous: a shared, busy machine
    assert len(progress) == FILES
    return out


def command(stream_input, tmp_path):
    return [sys.executable, str(ROOT / "jobs" / "stream_orders.py"),
            "--landing", str(stream_input / "landing"),
            "--customers", str(stream_input / "static" / "customers"),
            "--output", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ckpt"),
            "--interval", "0.1", "--max-files-per-batch", "1", "--available-now"]


def run(stream_input, tmp_path, fault=None, timeout=300):
    return subprocess.run(command(stream_input, tmp_path), env=child_env(fault),
                          capture_output=True, text=True, timeout=timeout,
                          start_new_session=True, cwd=ROOT)


def assert_same_output(spark, expected, tmp_path):
    for table in ("out/enriched", "ckpt/deadletter"):
        got = DeltaTable(str(tmp_path / table))
        want = DeltaTable(str(expected / table))
        key = "order_id" if "enriched" in table else "record"
        got_df = got.to_pandas().sort_values(key).reset_index(drop=True)
        want_df = want.to_pandas().sort_values(key).reset_index(drop=True)
        assert len(got_df) == len(want_df)
        assert got_df[key].is_unique or table.endswith("deadletter")
        pd.testing.assert_frame_equal(got_df, want_df, check_like=True)
    pipeline_id = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["pipeline_id"]
    assert DeltaTable(str(tmp_path / "out/enriched")).transaction_version(
        f"spark_ckpt/{NAME}-{pipeline_id}/enriched") == FILES
    cols = ["order_id", "customer_id", "region", "segment", "day", "amount", "quantity"]
    got_pq = spark.read.parquet(str(tmp_path / "out" / "by_region")).select(*cols)
    want_pq = spark.read.parquet(str(expected / "out" / "by_region")).select(*cols)
    assert_df_equality(got_pq.orderBy("order_id"), want_pq.orderBy("order_id"),
                       ignore_nullable=True)


def committed(tmp_path) -> int:
    directory = tmp_path / "ckpt" / "commits"
    return len(list(directory.glob("*.json"))) if directory.exists() else 0


def pending_batches(tmp_path) -> list[int]:
    """Batches a restart must rerun: allocation records without a commit record."""
    def ids(log):
        directory = tmp_path / "ckpt" / log
        return {int(p.stem) for p in directory.glob("*.json")} if directory.exists() else set()
    return sorted(ids("allocations") - ids("commits"))


def allocated_not_committed(tmp_path) -> int:
    return len(pending_batches(tmp_path))


def rerun_at_start(output: str) -> list[int]:
    """The batches a driver said it reruns at start (its log line), in order."""
    found = re.search(r"(\d+) allocated batch\(es\) to rerun(?: \(\[([\d, ]*)\]\))?", output)
    assert found is not None, output[-3000:]
    ids = [int(b) for b in found.group(2).split(",")] if found.group(2) else []
    assert len(ids) == int(found.group(1))
    return ids


# Each driver is killed at the next point of a batch's protocol. A driver allocates up to two
# new batches as soon as it starts (reruns hold no slot), so from the second driver on, kills
# land in reruns of batches an earlier driver allocated, staged or half committed. Outputs
# commit in order: the Delta table (enriched), then the Parquet directory (by_region).
CHAIN = (
    "stream.batch.allocated:2",  # a fresh pipeline: batch 1's allocation durable, not submitted
    "stream.batch.staged:2",  # batch 1, never submitted before: both outputs staged, none committed
    "sink.commit.files:1",  # the rerun of batch 1: Delta committed, Parquet commit half done
    "stream.output.committed:3",  # batch 1 finished, then batch 2: Delta committed, Parquet not
    "stream.batch.committed:2",  # batch 2 finished, batch 3's commit record durable, no progress
)
# CI: staged (fresh), Parquet half moved (rerun), commit record; all 5: SPARK_CKPT_LONG_FAULTS=1
CI_CHAIN = ("stream.batch.staged:2", "sink.commit.files:1", "stream.batch.committed:2")


def test_killed_at_each_point_of_a_batch_in_turn_then_restarted(spark, stream_input, expected,
                                                                tmp_path):
    """Drivers killed in a row (five with SPARK_CKPT_LONG_FAULTS=1, CI_CHAIN's three in CI),
    each at a different point (fresh batches and reruns of recovered ones), then one that
    finishes: every restart reruns exactly the batches the kill left allocated and not
    committed, no commit is ever taken back, and the outputs equal an uninterrupted run's, with
    one Delta commit per batch."""
    pending: list[int] = []
    for fault in CHAIN if LONG_FAULTS else CI_CHAIN:
        before = committed(tmp_path)
        crashed = run(stream_input, tmp_path, fault=fault)
        assert crashed.returncode == -9, (fault, crashed.stdout[-2000:], crashed.stderr[-3000:])
        assert rerun_at_start(crashed.stderr) == pending, fault
        assert before <= committed(tmp_path) < FILES, fault  # a commit is never taken back
        pending = pending_batches(tmp_path)
        assert pending or fault.startswith("stream.batch.committed"), fault
    done = run(stream_input, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert rerun_at_start(done.stderr) == pending
    recovered = re.search(r"RESULT .*recovered=(\d+)", done.stdout)
    assert recovered is not None, done.stdout[-500:]
    assert int(recovered.group(1)) == len(pending)  # exactly the batches the kill left
    assert committed(tmp_path) == FILES
    assert_same_output(spark, expected, tmp_path)


@pytest.mark.skipif(not LONG_FAULTS, reason=LONG_ONLY)  # the chain above kills at each point
@pytest.mark.parametrize("fault", [
    "stream.batch.allocated:3",  # allocation durable, batch never submitted
    "stream.batch.staged:2",  # both outputs staged, none committed
    "stream.output.committed:5",  # batch 2: Delta committed, Parquet not
    "stream.batch.committed:4",  # commit record durable, progress not reported
    "sink.commit.files:2",  # Parquet commit half done: marker created, files partly moved
])
def test_kill_at_each_point_of_a_batch_then_restart(spark, stream_input, expected, tmp_path,
                                                    fault):
    crashed = run(stream_input, tmp_path, fault=fault)
    assert crashed.returncode == -9, crashed.stdout[-2000:] + crashed.stderr[-3000:]
    assert committed(tmp_path) < FILES
    pending = allocated_not_committed(tmp_path)
    if not fault.startswith("stream.batch.committed"):
        assert pending >= 1  # the killed batch was allocated and not committed
    done = run(stream_input, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    recovered = re.search(r"RESULT .*recovered=(\d+)", done.stdout)
    assert recovered is not None, done.stdout[-500:]
    assert int(recovered.group(1)) == pending  # exactly the batches the kill left allocated
    assert committed(tmp_path) == FILES
    assert_same_output(spark, expected, tmp_path)


KILL_POINTS = ("stream.batch.allocated", "stream.batch.staged", "stream.output.committed",
               "stream.batch.committed", "sink.commit.files")


@pytest.mark.skipif(not LONG_FAULTS, reason=LONG_ONLY)
def test_killed_at_random_moments_over_many_batches(spark, stream_input, expected, tmp_path):
    """Kills at seeded random points of the batch protocol (not at random wall-clock times,
    which would make the number of kills depend on the machine's speed)."""
    rng = random.Random(20261121)
    schedule = [f"{rng.choice(KILL_POINTS)}:{rng.randint(1, 2)}" for _ in range(4)]
    for fault in schedule:
        before = committed(tmp_path)
        crashed = run(stream_input, tmp_path, fault=fault)
        assert crashed.returncode == -9, (fault, crashed.stdout[-2000:], crashed.stderr[-2000:])
        assert committed(tmp_path) < FILES
        assert committed(tmp_path) >= before  # a commit is never taken back
    done = run(stream_input, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert committed(tmp_path) == FILES
    assert_same_output(spark, expected, tmp_path)


QUEUE_CHILD = """
import sys, time
from spark_ckpt import Settings, StreamingContext, get_or_create_session
spark = get_or_create_session("wal")
ctx = StreamingContext(spark, 3600, sys.argv[1], "wal", settings=Settings(progress="never"))
q = ctx.queue_stream("q", "id BIGINT, name STRING")
q.write_parquet(sys.argv[2], name="out")
ctx.start()
while ctx.last_progress is None:  # batch 0 (empty) ran at start; the next tick is an hour away
    time.sleep(0.05)
for block in range(3):
    q.source.push([(block * 10 + i, f"n{i}") for i in range(10)])
print("PUSHED", flush=True)
time.sleep(3600)
"""


def test_received_blocks_not_yet_processed_survive_a_driver_kill(spark, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", QUEUE_CHILD, str(tmp_path / "ckpt"),
                             str(tmp_path / "out")], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            cwd=ROOT)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PUSHED"):
                break
        else:
            pytest.fail("the child driver exited before pushing")
    finally:
        kill_group(proc)
    from spark_ckpt import StreamingContext

    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "wal",
                           settings=Settings(progress="never"))
    q = ctx.queue_stream("q", "id BIGINT, name STRING")
    q.write_parquet(str(tmp_path / "out"), name="out")
    progress = ctx.process_available(timeout=120)
    assert [p["num_input_rows"] for p in progress] == [30]
    ids = sorted(spark.read.parquet(str(tmp_path / "out")).toPandas().id)
    assert ids == list(range(30))
    shutil.rmtree(tmp_path / "ckpt")
