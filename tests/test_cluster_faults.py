"""Executors and Python workers killed mid-task on a real multi-process Spark.

Each scenario runs a driver in a child process on ``local-cluster[2,1,1024]``: two executor JVMs,
each with its own pyspark daemon and Python workers, as on a cluster. A gate
(tests/processors_for_tests.py) stops one task on its first attempt and writes its pids; the test
SIGKILLs the executor JVM or the Python worker, Spark retries the task (local-cluster's worker
launches a new executor), and the test checks what the retry left behind.

* Batch: a Python UDF in the ``settled`` vertex stops task 1 of the vertex's Spark job (in the
  map stage before the exchange that lays the output out by partition; the executor's lost
  shuffle output makes Spark run map tasks again as well). Checked: one
  ``ExecutionVertexFinished`` per (vertex, partition) in one driver attempt, one file per
  partition recorded, staged and committed, nothing left in ``_temporary``, outputs equal to
  plain Spark's.
* Keyed state (RocksDB): a KeyedProcessor stops in ``process`` (executor killed, nothing written
  yet; with SPARK_CKPT_LONG_FAULTS=1) and later in ``on_timer`` (Python worker killed after the
  batch's changes went to the executor's RocksDB copy, before the task fixed its version).
  Checked: every id once with gap-free per-key sequence numbers, totals equal to plain Spark's,
  one state handle per key-group range in every checkpoint and no state file registered twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from deltalake import DeltaTable
from helpers import LONG_FAULTS, ROOT, child_env, plain_sequenced, wait_for
from helpers import test_java_options as java_options  # not collected as a test

from spark_ckpt.storage.delta_reader import read_delta

pytestmark = pytest.mark.slow

PARALLELISM = 4  # enriched and settled
AGG_PARALLELISM = 2  # daily
GATED_PARTITION = 1
PART = re.compile(r"part-(\d{5})-")

SESSION = """
import json, sys
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local-cluster[2,1,1024]")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "4")
         .config("spark.driver.extraJavaOptions", "-Dlog4j2.configurationFile=file:LOG4J JAVA")
         .config("spark.executor.extraJavaOptions", "JAVA")
         .config("spark.sql.session.timeZone", "UTC").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
""".replace("LOG4J", str(ROOT / "conf" / "log4j2.properties")).replace("JAVA", java_options())

BATCH_CHILD = SESSION + """
from pyspark import TaskContext
from pyspark.sql import functions as F
import orders_report as report
import processors_for_tests
from spark_ckpt import BatchJob, Settings

input_dir, output, work_dir, gate_dir, chosen = sys.argv[1:6]
chosen = int(chosen)


def build(job_id):
    \"\"\"orders_report's job, whose settled vertex stops its task ``chosen`` at the gate named
    after the job (a Python UDF computing the identity; it runs in the map stage before the
    exchange that lays the vertex's output out by partition).\"\"\"

    @F.udf("int")
    def gated(quantity):
        if TaskContext.get().partitionId() == chosen:
            processors_for_tests.gate(gate_dir, job_id)
        return quantity

    def settle(enriched, payments):
        return report.settle(enriched, payments).withColumn("quantity", gated("quantity"))

    job = BatchJob(job_id, spark=spark, work_dir=work_dir,
                   settings=Settings(progress="never", work_dir=work_dir,
                                     batch_exchange_min_bytes=0))
    orders = job.read_files("orders", f"{input_dir}/orders", parallelism=P)
    customers = job.read_files("customers", f"{input_dir}/customers", parallelism=1)
    payments = job.read_files("payments", f"{input_dir}/payments", parallelism=P)
    enriched = job.vertex("enriched", report.enrich, orders, customers.broadcast(),
                          durable=True)  # as orders_report declares it
    settled = job.vertex("settled", settle, enriched.by("order_id"), payments.by("order_id"),
                         parallelism=P)
    daily = job.vertex("daily", report.daily_revenue, settled.by("region", "day"),
                       parallelism=A)
    job.write_delta(daily, f"{output}/{job_id}/daily", mode="append")
    job.write_parquet(settled, f"{output}/{job_id}/settled")
    return job


for job_id in ("executor", "worker"):  # the test kills that process of the gated task
    result = build(job_id).run()
    print("RESULT " + json.dumps({"job": job_id, "status": result.status,
                                  "attempt": result.attempt, "ran": result.ran,
                                  "master": spark.sparkContext.master}), flush=True)
""".replace("=P)", f"={PARALLELISM})").replace("=A)", f"={AGG_PARALLELISM})")


@pytest.fixture(scope="module")
def small_orders(tmp_path_factory) -> str:
    """4,000 orders in 4 files, their payments, 200 customers."""
    import orders_data

    directory = tmp_path_factory.mktemp("cluster-orders")
    orders_data.generate(str(directory), orders=4_000, files=4, customers=200, seed=23)
    return str(directory)


@pytest.fixture(scope="module")
def plain_answer(spark, small_orders) -> dict[str, pd.DataFrame]:
    """The same job computed by plain PySpark in the test's own session."""
    import orders_report as report

    orders = spark.read.parquet(f"{small_orders}/orders")
    customers = spark.read.parquet(f"{small_orders}/customers")
    payments = spark.read.parquet(f"{small_orders}/payments")
    settled = report.settle(report.enrich(orders, customers), payments)
    return {"settled": _sorted(settled.toPandas(), ["order_id"]),
            "daily": _sorted(report.daily_revenue(settled).toPandas(), ["region", "day"])}


def _sorted(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    return frame.sort_values(by).reset_index(drop=True)


def _start(script: str, logs: Path, *args: str) -> subprocess.Popen:
    """The driver, in its own session; its output goes to files (a full pipe would stop it)."""
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", script, *args], env=child_env(),
                                stdout=out, stderr=err, text=True, start_new_session=True,
                                cwd=ROOT)
    proc.logs = logs  # type: ignore[attr-defined]
    return proc


def _output(proc: subprocess.Popen) -> tuple[str, str]:
    logs: Path = proc.logs  # type: ignore[attr-defined]
    return (logs / "stdout").read_text(), (logs / "stderr").read_text(errors="replace")


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the child's session (nothing, when it ended well)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _reached(proc: subprocess.Popen, gate: Path) -> dict:
    """Wait (bounded) until the gated task wrote its pids; the child must still be running."""
    assert wait_for(lambda: gate.exists() or proc.poll() is not None, timeout=300), \
        f"gate {gate.name} not reached"
    if not gate.exists():
        out, err = _output(proc)
        raise AssertionError(f"the child ended before gate {gate.name}:\n{out[-2000:]}"
                             f"{err[-4000:]}")
    return json.loads(gate.read_text())


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: _gone(pid), timeout=60), f"pid {pid} still alive after SIGKILL"


def _gone(pid: int) -> bool:
    """Dead (or a zombie its parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _reruns(gate_dir: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(gate_dir.glob(f"{name}.rerun-*"))]


def _finish(proc: subprocess.Popen) -> str:
    proc.wait(timeout=600)
    out, err = _output(proc)
    assert proc.returncode == 0, out[-2000:] + err[-6000:]
    return out


# -- batch ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def batch_runs(tmp_path_factory, small_orders) -> dict[str, dict]:
    """One driver on the cluster runs the job twice (job ids ``executor`` and ``worker``); in
    each run the test SIGKILLs that process of the gated settled task, mid-task."""
    base = tmp_path_factory.mktemp("batch-faults")
    gate_dir = base / "gate"
    gate_dir.mkdir()
    output, work = base / "out", base / "work"
    proc = _start(BATCH_CHILD, base, small_orders, str(output), str(work), str(gate_dir),
                  str(GATED_PARTITION))
    runs: dict[str, dict] = {}
    try:
        for target in ("executor", "worker"):
            where = _reached(proc, gate_dir / f"{target}.reached")
            assert where["executor"] is not None, where
            assert "CoarseGrainedExecutorBackend" in _cmdline(where["executor"])
            assert where["attempt"] == 0 and where["partition"] == GATED_PARTITION
            _kill(where[target])
            if target == "worker":  # only the worker died: its executor carries on
                assert not _gone(where["executor"])
            runs[target] = {"where": where, "output": output / target, "work": work / target}
        out = _finish(proc)
    finally:
        _stop(proc)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            runs[result["job"]]["result"] = result
    for target, run in runs.items():
        run["reruns"] = _reruns(gate_dir, target)
    return runs


def _finished_events(work: Path) -> pd.DataFrame:
    events = read_delta(str(work / "events")).to_pandas()
    assert set(events["job_attempt"]) == {1}, "Spark retried the task, not a new driver attempt"
    return events[events["event_type"] == "ExecutionVertexFinished"]


def _check_batch(run: dict, plain: dict[str, pd.DataFrame], spark) -> None:
    where, output = run["where"], run["output"]
    result = run["result"]  # Spark retried the task within the run: one driver attempt
    assert result["status"] == "succeeded" and result["attempt"] == 1, result
    assert result["master"].startswith("local-cluster"), result
    # the gated task ran again, as a new attempt of the same stage and partition, elsewhere
    assert run["reruns"], "the killed task was never retried"
    assert all(r["worker"] != where["worker"] for r in run["reruns"]), run["reruns"]

    # one ExecutionVertexFinished per (vertex, partition), and for every partition
    finished = _finished_events(run["work"])
    counts = Counter(zip(finished["vertex_id"], finished["partition"].astype(int),
                         strict=True))
    want = {(v, p) for v, n in (("enriched", PARALLELISM), ("payments-to-settled", PARALLELISM),
                                ("settled", PARALLELISM), ("daily", AGG_PARALLELISM))
            for p in range(n)}
    assert set(counts) == want, sorted(counts)
    doubled = {k: n for k, n in counts.items() if n != 1}
    assert not doubled, f"partitions recorded more than once: {doubled}"

    # each recorded hash-mode partition names one file per output, its own (part-0000j-*)
    recorded: dict[str, list[str]] = {}
    for row in finished.itertuples():
        outputs = json.loads(row.payload)["outputs"]
        if row.vertex_id in ("settled", "daily"):
            targets = Counter((o["kind"], o["target"]) for o in outputs)
            assert all(n == 1 for n in targets.values()), (row.vertex_id, row.partition, outputs)
            for o in outputs:
                assert int(PART.search(Path(o["path"]).name).group(1)) == row.partition, o
        for o in outputs:
            recorded.setdefault(o["target"], []).append(Path(o["path"]).name)
    for target, names in recorded.items():
        if target not in ("enriched", "payments-to-settled"):  # split mode: a wave's
            # partitions share its files
            assert len(names) == len(set(names)), (target, names)

    # committed and staged files: one per partition, exactly the recorded ones
    settled_files = _data_files(output / "settled")
    assert sorted(settled_files) == sorted(recorded["settled-parquet"]), settled_files
    daily_table = [Path(f).name for f in DeltaTable(str(output / "daily")).file_uris()]
    assert sorted(daily_table) == sorted(recorded["daily-delta"]), daily_table
    assert sorted(_data_files(output / "daily")) == sorted(daily_table), \
        "files staged in the Delta table directory that its log does not name"
    assert not [p for p in output.rglob("*") if "_temporary" in p.parts], \
        "the killed attempt's staged files were left behind"
    for files in (settled_files, daily_table):
        indexes = [PART.search(f).group(1) for f in files]
        assert len(indexes) == len(set(indexes)), f"two files for one partition: {files}"

    # the outputs equal plain Spark's answer on the same input
    got_settled = spark.read.parquet(str(output / "settled")).toPandas()
    pd.testing.assert_frame_equal(_sorted(got_settled[list(plain["settled"].columns)],
                                          ["order_id"]), plain["settled"], check_dtype=False)
    got_daily = read_delta(str(output / "daily")).to_pandas()
    pd.testing.assert_frame_equal(_sorted(got_daily[list(plain["daily"].columns)],
                                          ["region", "day"]), plain["daily"], check_dtype=False)


def _data_files(directory: Path) -> list[str]:
    """Data files under ``directory`` (not ``_delta_log``, ``_temporary``, ``.crc``...)."""
    out = []
    for path in directory.rglob("*.parquet"):
        relative = path.relative_to(directory).parts
        if not any(p.startswith(("_", ".")) for p in relative[:-1] if p != "_spark_ckpt_staging") \
                and not relative[-1].startswith((".", "_")):
            out.append(path.name)
    return out


def test_executor_killed_mid_task_batch_retried_once_each(spark, batch_runs, plain_answer):
    run = batch_runs["executor"]
    # the retry ran in another executor JVM (the other one, or the one relaunched)
    assert all(r["executor"] != run["where"]["executor"] for r in run["reruns"]), run
    _check_batch(run, plain_answer, spark)


def test_python_worker_killed_mid_task_batch_retried_once_each(spark, batch_runs,
                                                              plain_answer):
    _check_batch(batch_runs["worker"], plain_answer, spark)


# -- streaming keyed state -----------------------------------------------------------------------
ROWS_PER_BATCH, TOTAL_ROWS, KEYS = 200, 1_600, 10
GATED_KEY = 3
PER_BATCH = ROWS_PER_BATCH // KEYS  # rows of one key in a batch
# gate -> (what the test kills, where the task stops, rows the key has seen by then)
GATES = {"g0": ("executor", "process", 2 * PER_BATCH),  # batch 2, before any state is written
         "g1": ("worker", "on_timer", 5 * PER_BATCH)}  # batch 4, its changes in RocksDB already
# CI keeps g1 (executors are killed in the batch test); g0 too with SPARK_CKPT_LONG_FAULTS=1
if not LONG_FAULTS:
    GATES = {"g1": GATES["g1"]}
EVENTS_SCHEMA = "key BIGINT, id BIGINT, seq BIGINT, prev_id BIGINT"

STREAM_CHILD = SESSION + f"""
from processors_for_tests import GatedSequencer
from spark_ckpt import Settings, StreamingContext
from spark_ckpt.state import count, sum_

ckpt, out, gate_dir, local_dir = sys.argv[1:5]
# RocksDB state in one local directory for both executors, as one host's executors would
# share a disk: a retried task finds the copy its killed attempt was updating.
ctx = StreamingContext(spark, 0.1, ckpt, "faults", settings=Settings(
    progress="never", checkpoint_interval_ms=1, state_parallelism=2, state_backend="rocksdb",
    state_local_dir=local_dir, state_small_batch_bytes=0))  # one task per key-group range
gen = ctx.generator_stream("gen", rows_per_batch={ROWS_PER_BATCH}, total_rows={TOTAL_ROWS},
                           keys={KEYS}, partitions=2)
keyed = gen.key_by("key")
gates = {({g: (w, a) for g, (_k, w, a) in GATES.items()})!r}
keyed.process(GatedSequencer(gate_dir, {GATED_KEY}, gates), "{EVENTS_SCHEMA}", name="sequencer") \\
    .write_delta(f"{{out}}/events", name="events")
keyed.agg(name="totals", n=count(), total=sum_("value")) \\
    .write_delta(f"{{out}}/totals", name="totals", merge_keys=["key"])
progress = ctx.process_available(timeout=900)
print("RESULT " + json.dumps({{"batches": len(progress),
                              "recovered": sum(1 for p in progress if p["recovered"]),
                              "master": spark.sparkContext.master}}), flush=True)
"""


def _plain_stream(spark) -> dict[str, pd.DataFrame]:
    """What the pipeline must produce, by plain Spark (helpers.plain_sequenced)."""
    return plain_sequenced(spark, TOTAL_ROWS, KEYS)


def _check_checkpoints(ckpt: Path) -> None:
    """Every retained checkpoint names one state handle per key-group range of each operator;
    no state file is named by two ranges, or twice in one chain, and each has one batch."""
    metas = sorted(ckpt.glob("checkpoints/chk-*/_metadata.json"))
    assert metas, "no completed checkpoint"
    for meta_path in metas:
        meta = json.loads(meta_path.read_text())
        operators = meta["operators"]
        assert set(operators) == {"sequencer", "totals"}, operators
        for name, op in operators.items():
            handles = list(op["handles"].values())
            ranges = [h["range"] for h in handles]
            assert len(ranges) == 2 and len(set(ranges)) == 2, (meta_path, name, ranges)
            files = [f["path"] for h in handles for f in h["files"]]
            assert len(files) == len(set(files)), f"a state file registered twice: {files}"
            for h in handles:
                batches = [(f["kind"], f["batch"]) for f in h["files"]]
                assert len(batches) == len(set(batches)), (meta_path, name, h)
                for f in h["files"]:  # inside the checkpoint directory: relative to it
                    path = Path(f["path"].removeprefix("file:"))
                    assert (path if path.is_absolute() else ckpt / path).exists(), f


def test_executor_and_worker_killed_mid_stateful_task_exactly_once(spark, tmp_path):
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    proc = _start(STREAM_CHILD, tmp_path, str(ckpt), str(out), str(gate_dir),
                  str(tmp_path / "local"))
    killed = {}
    try:
        for gate, (target, _where, _after) in GATES.items():
            where = _reached(proc, gate_dir / f"{gate}.reached")
            assert where["executor"] is not None, where
            assert "CoarseGrainedExecutorBackend" in _cmdline(where["executor"])
            _kill(where[target])
            if target == "worker":
                assert not _gone(where["executor"])
            killed[gate] = where
        result = json.loads(_finish(proc).split("RESULT ", 1)[1].splitlines()[0])
    finally:
        _stop(proc)
    assert result["master"].startswith("local-cluster"), result
    # Spark retried the tasks: no batch was recovered by a restarted driver
    assert result == {**result, "batches": TOTAL_ROWS // ROWS_PER_BATCH, "recovered": 0}
    for gate, (target, _where, _after) in GATES.items():
        reruns = _reruns(gate_dir, gate)
        assert reruns, f"the task stopped at {gate} was never retried"
        assert all(r[target] != killed[gate][target] for r in reruns), (gate, reruns)

    want = _plain_stream(spark)
    events = _sorted(read_delta(str(out / "events")).to_pandas(), ["id"])
    assert events["id"].is_unique, "an id in the output twice"
    pd.testing.assert_frame_equal(events[list(want["events"].columns)], want["events"],
                                  check_dtype=False)
    totals = _sorted(read_delta(str(out / "totals")).to_pandas(), ["key"])
    pd.testing.assert_frame_equal(totals[list(want["totals"].columns)], want["totals"],
                                  check_dtype=False, rtol=1e-9)
    _check_checkpoints(ckpt)
