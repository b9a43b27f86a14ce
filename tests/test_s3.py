"""spark_ckpt on a real S3-compatible server (moto's, on loopback: tests/s3_server.py).

No mocks: the server speaks the S3 REST API over HTTP; pyarrow, delta-rs, botocore and
Spark's S3A connector talk to it as they would to S3. The configuration comes from one
place, Spark's ``spark.hadoop.fs.s3a.*`` keys (spark_ckpt/storage/s3.py).

- the server answers a second ``If-None-Match: *`` PUT with 412 (what the rest relies on);
- create-if-absent (checkpoint metadata, run and attempt numbers, commit markers) is a
  conditional PUT: of many writers racing for one key exactly one creates it;
- without botocore (no conditional PUT), create-if-absent says which guarantee is lost, or
  fails under ``spark.ckpt.storage.conditionalWrites=required``;
- delta-rs's commits (the fence, the event log, the Delta sinks) race safely: concurrent
  fence claims get distinct versions;
- a keyed pipeline checkpointing to s3a:// with Delta and Parquet outputs on s3a://, SIGKILLed
  after a checkpoint and restarted: every id once in both outputs, state restored from S3;
- a batch job whose work dir (event log, durable partitions) and outputs are on s3a://,
  SIGKILLed after a vertex finished: the next driver reuses the durable partitions from S3
  and the outputs are committed once.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import threading
import uuid

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

import s3_server
from helpers import LONG_FAULTS, LONG_ONLY, ROOT, child_env, job_command, kill_group
from spark_ckpt.errors import ConfigurationError, StorageGuaranteeError
from spark_ckpt.storage import Storage, delta_options, join
from spark_ckpt.storage import s3 as s3mod
from spark_ckpt.storage.fencing import Fence

KEYS = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module (it starts in seconds, but not in none)."""
    log = tmp_path_factory.mktemp("s3-server") / "server.log"
    with s3_server.running(log) as running:
        yield running


@pytest.fixture
def s3(server, monkeypatch):
    """The server with a fresh bucket, configured in this process as a driver would be from
    its session's conf (reset afterwards: other tests resolve s3:// URIs their own way)."""
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=bucket)
    fresh = dataclasses.replace(server, bucket=bucket)
    monkeypatch.setattr(s3mod, "_config", None)
    s3mod.configure(fresh.spark_conf())
    assert s3mod.current() is not None and s3mod.current().endpoint == fresh.endpoint
    return fresh


def test_server_answers_a_second_put_if_none_match_with_412(s3):
    client = s3.client()
    client.put_object(Bucket=s3.bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(client.exceptions.ClientError) as err:
        client.put_object(Bucket=s3.bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=s3.bucket, Key="k")["Body"].read() == b"first"


@pytest.mark.parametrize("scheme", ["s3a", "s3"])
def test_create_exclusive_is_a_conditional_put_one_writer_of_many_wins(s3, scheme):
    store = Storage(s3.uri("ckpt", scheme=scheme))
    path = store.path("checkpoints", "00000001", "_metadata")
    assert store.create_exclusive(path, b"one")
    assert not store.create_exclusive(path, b"two")
    assert store.read_bytes(path) == b"one"
    # writers released together at one key, 10 times: a check-then-write lets several pass
    for round_ in range(10):
        key = store.path("runs", f"{round_:08d}.json")
        start = threading.Barrier(8)
        won: list[int] = []

        def race(i: int, key: str = key, start: threading.Barrier = start,
                 won: list[int] = won) -> None:
            start.wait()
            if store.create_exclusive(key, str(i).encode()):
                won.append(i)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1, f"round {round_}: {len(won)} writers created {key}"
        assert store.read_bytes(key) == str(won[0]).encode()


_NO_BOTOCORE = """
import logging, sys
sys.modules["botocore"] = None  # not installed: no conditional PUT can be made
from spark_ckpt.storage import Storage, s3
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
s3.configure({conf!r})
store = Storage({uri!r})
print("first", store.create_exclusive(store.path("marker"), b"1"))
print("second", store.create_exclusive(store.path("marker"), b"2"))
"""


@pytest.mark.parametrize("policy", ["auto", "required"])
def test_without_conditional_puts_create_exclusive_names_the_lost_guarantee(s3, policy):
    conf = s3.spark_conf() | {"spark.ckpt.storage.conditionalWrites": policy}
    code = _NO_BOTOCORE.format(conf=conf, uri=s3.uri("nobotocore"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=child_env())
    if policy == "auto":
        assert run.returncode == 0, run.stderr[-3000:]
        assert "first True" in run.stdout and "second False" in run.stdout
        assert "WARNING create-if-absent on s3a://" in run.stderr
        assert "is a check then a write" in run.stderr and "could both write" in run.stderr
    else:
        assert run.returncode != 0
        assert StorageGuaranteeError.__name__ in run.stderr
        assert "Expected conditional writes (spark.ckpt.storage.conditionalWrites=required)" \
            in run.stderr
        assert s3.keys("nobotocore") == []  # nothing written


@pytest.mark.parametrize("conf,message", [
    ({"spark.hadoop.fs.s3a.endpoint": "ftp://127.0.0.1:1"},
     "expected http:// or https:// (or a host:port), found 'ftp://127.0.0.1:1'"),
    ({"spark.hadoop.fs.s3a.access.key": "a"},
     "expected both or neither, found only access.key"),
    ({"spark.hadoop.fs.s3a.path.style.access": "yes"}, "expected true or false, found 'yes'"),
    ({"spark.ckpt.storage.conditionalWrites": "always"},
     "expected one of auto, required, found 'always'"),
])
def test_bad_s3_configuration_is_refused_naming_expected_and_found(conf, message):
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        s3mod.S3Config.from_conf(conf.get)


def test_concurrent_fence_claims_on_s3_get_distinct_versions(s3):
    """The fence is a Delta table; its claims are delta-rs commits, put-if-absent on S3."""
    directory = Storage(s3.uri("job")).root
    versions: list[int] = []
    start = threading.Barrier(6)

    def claim(i: int) -> None:
        fence = Fence(Storage(s3.uri("job")), directory, "job j")
        start.wait()
        versions.append(fence.claim(f"driver-{i}"))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each claim its own version (its epoch), after version 0's creation of the table; a
    # driver that raced to create the table too may have committed its metadata as well, and
    # the claims that conflicted with it claimed again
    assert len(set(versions)) == 6 and min(versions) >= 1, versions
    uri = s3.uri("job", "fence")
    table = DeltaTable(uri, storage_options=delta_options(uri))
    assert table.to_pyarrow_table().num_rows == 6
    first = Fence(Storage(s3.uri("job")), directory, "job j")
    first.version = min(versions)
    assert first.is_fenced()


def _delta(uri: str) -> pd.DataFrame:
    return DeltaTable(uri, storage_options=delta_options(uri)).to_pyarrow_table().to_pandas()


def _parquet(store: Storage, directory: str) -> pd.DataFrame:
    files = [i.path for i in store.list_files(directory, recursive=False)
             if i.base_name.endswith(".parquet")]
    return pa.concat_tables([pq.read_table(f, filesystem=store.fs) for f in files]).to_pandas()


def _assert_sequenced(events: pd.DataFrame, total: int, what: str) -> None:
    assert sorted(events.id) == list(range(total)), f"{what}: an id is missing or twice"
    for key, rows in events.groupby("key"):
        rows = rows.sort_values("seq")
        assert rows.seq.tolist() == list(range(1, len(rows) + 1)), f"{what}: key {key} gaps"
        assert rows.prev_id.iloc[1:].tolist() == rows.id.iloc[:-1].tolist(), \
            f"{what}: key {key}: state lost across the restart"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_keyed_pipeline_checkpoints_to_s3_and_restores_exactly_once(s3, tmp_path):
    # 3 batches of 200 (8 with SPARK_CKPT_LONG_FAULTS=1): the first driver dies at the first
    # checkpoint, the second replays what followed it and finishes
    total = 1_600 if LONG_FAULTS else 600
    defaults = s3_server.defaults_file(s3, tmp_path / "s3-defaults.conf")
    command = [sys.executable, str(ROOT / "tests" / "s3_pipeline.py"),
               "--checkpoint", s3.uri("ckpt"), "--output", s3.uri("out"),
               "--total-rows", str(total), "--keys", str(KEYS)]
    # killed right after its first checkpoint completed (metadata on S3, sinks not committed)
    crashed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                             start_new_session=True,
                             env=child_env("checkpoint.completed:1:kill",
                                           SPARK_CKPT_DEFAULTS=str(defaults)))
    assert crashed.returncode == -9, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    assert "RESULT" not in crashed.stdout
    # the first checkpoint's metadata, created by a conditional PUT, is in the bucket
    assert any(k.endswith("/chk-00000001/_metadata.json") for k in s3.keys("ckpt/")), \
        s3.keys("ckpt/")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          start_new_session=True,
                          env=child_env(SPARK_CKPT_DEFAULTS=str(defaults)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "restored checkpoint" in done.stderr, done.stderr[-3000:]
    _assert_sequenced(_delta(s3.uri("out", "events")), total, "Delta events")
    store = Storage(s3.uri("out"))
    _assert_sequenced(_parquet(store, store.path("events_parquet")), total, "Parquet events")
    totals = _delta(s3.uri("out", "totals"))
    assert sorted(totals.key) == list(range(KEYS)) and set(totals.n) == {total // KEYS}
    # nothing of it on the local disk: the checkpoint store is the bucket
    assert not (ROOT / "s3a:").exists()
    # the command line reads S3 from the same defaults file as the drivers
    validate = subprocess.run(
        [sys.executable, "-c", "from spark_ckpt.ops.cli import main; main()", "validate",
         s3.uri("ckpt"), "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=child_env(SPARK_CKPT_DEFAULTS=str(defaults)))
    assert validate.returncode == 0, validate.stdout[-3000:] + validate.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not LONG_FAULTS, reason=LONG_ONLY)  # two more drivers: over the budget
def test_batch_job_on_s3_recovers_after_sigkill_reusing_durable_partitions(s3, tmp_path):
    sys.path.insert(0, str(ROOT / "jobs"))
    import orders_data

    inputs = tmp_path / "input"
    orders_data.generate(str(inputs), orders=2_000, files=2, customers=50, seed=5)
    defaults = s3_server.defaults_file(s3, tmp_path / "s3-defaults.conf")
    command = job_command(str(inputs), s3.uri("out"), s3.uri("work"))
    env = child_env(SPARK_CKPT_DEFAULTS=str(defaults))
    # SIGKILLed by its own fault point once the first vertex (enriched: one partition per
    # input file) finished
    proc = subprocess.Popen(command, env={**env, "SPARK_CKPT_FAULT": "vertex.finished:1:kill"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == -9, out[-5000:]
    durable = [k for k in s3.keys("work/") if k.endswith(".parquet") and "/enriched" in k]
    assert durable, s3.keys("work/")[:50]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                          start_new_session=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    # the event log read back from S3, the two durable partitions of enriched found there
    assert "enriched: 2 partitions, reused 2, ran 0" in done.stdout, \
        done.stdout + done.stderr[-5000:]
    assert "unreadable" not in done.stderr
    # the outputs equal the report computed from the inputs, committed once
    orders = pq.read_table(inputs / "orders").to_pandas()
    customers = pq.read_table(inputs / "customers").to_pandas()
    settled = orders[orders.amount > 0].merge(customers, on="customer_id")
    payments = pq.read_table(inputs / "payments").to_pandas()
    settled = settled.merge(payments, on="order_id", how="left")
    store = Storage(s3.uri("out"))
    got = _parquet(store, store.path("settled"))
    assert sorted(got.order_id) == sorted(settled.order_id), "settled rows lost or repeated"
    daily = _delta(s3.uri("out", "daily"))
    assert daily.orders.sum() == len(settled)
    uri = s3.uri("out", "daily")
    history = DeltaTable(uri, storage_options=delta_options(uri)).history()
    assert sum(1 for h in history if h.get("operation") != "CREATE TABLE") == 1


def test_no_warning_on_s3_with_conditional_puts(s3, caplog):
    store = Storage(s3.uri("quiet"))
    with caplog.at_level(logging.WARNING, logger="spark_ckpt.storage.s3"):
        assert store.create_exclusive(join(store.root, "a"), b"x")
    assert not caplog.records
