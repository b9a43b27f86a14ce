"""Two real streaming driver processes on one checkpoint directory: exactly one commits.

Each driver is ``jobs/stream_orders.py`` (per-batch commits: Delta and Parquet) or
``jobs/stateful_counts.py`` (keyed state, barrier checkpoints, two-phase Delta sinks) run as
its own process group, with its own JVM, on the same checkpoint and output directories:

* two drivers started at once: the newest fence claim keeps running and commits everything,
  the other stops with ``JobFencedError``; every input row is in the output once;
* a second driver starting while the first is in the middle of a batch (outputs staged, not
  committed): the first is fenced before it commits that batch;
* a stale driver that wakes after a long pause at a precise point (fault point ``pause`` with
  reached/release files), after a newer driver recovered and committed everything: it stops
  with ``JobFencedError`` and changes nothing that was committed.

Exactly once means: for ``stream_orders`` the Delta and Parquet outputs equal plain Spark's
answer over the same files, each order once; for ``stateful_counts`` Flink's check (every id
once, each key's ``seq`` 1, 2, 3... linked by ``prev_id``, totals equal to the events).
Every wait is on an event (a file, a process exit, a log line, the output table), bounded by
``helpers.wait_for``.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import orders_data
import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers import LONG_FAULTS, LONG_ONLY, ROOT, child_env, defaults_text, kill_group, wait_for
from stream_orders import ORDER_EVENT_SCHEMA, enrich

from spark_ckpt.storage.delta_reader import read_delta

pytestmark = pytest.mark.slow

FILES = 12  # stream_orders: one file per batch; 12 batches so that batch 10's purge runs
ROWS = 20
TOTAL = 1000  # stateful_counts: 5 batches of 200 ids
KEYS = 5
SLOW = 300  # bound of any one wait (seconds): a loaded 2-core machine starts JVMs slowly
FENCED = "a newer driver started on this checkpoint directory"
COLUMNS = ["order_id", "customer_id", "region", "segment", "day", "amount", "quantity",
           "line_total"]


# -- inputs and expected answers ---------------------------------------------------------------
@pytest.fixture(scope="module")
def orders_input(tmp_path_factory):
    base = tmp_path_factory.mktemp("drivers-input")
    orders_data.generate(str(base / "static"), orders=50, files=1, customers=100)
    orders_data.drop_order_files(str(base / "landing"), files=FILES, rows_per_file=ROWS,
                                 customers=100)
    # records (and Parquet commit markers) of old batches purged after batch 10: a stale
    # driver cannot lean on a marker of the batch it wakes in to find it already committed
    defaults = base / "spark-defaults.conf"
    defaults.write_text(defaults_text() +
                        "\nspark.ckpt.stream.minBatchesToRetain 1\n"
                        "spark.sql.shuffle.partitions 2\n")
    return base


@pytest.fixture(scope="module")
def orders_expected(spark, orders_input):
    """Plain Spark's answer over the same files: every order with a positive amount, enriched."""
    customers = spark.read.parquet(str(orders_input / "static" / "customers")) \
        .select("customer_id", "region", "segment")
    orders = spark.read.schema(ORDER_EVENT_SCHEMA).json(str(orders_input / "landing"))
    frame = enrich(orders, customers).toPandas()
    assert len(frame) > FILES  # something to lose or duplicate in every batch
    return frame[COLUMNS].sort_values("order_id").reset_index(drop=True)


# -- drivers -----------------------------------------------------------------------------------
class Driver:
    """A real driver process in its own process group; stdout and stderr go to a file."""

    def __init__(self, name: str, cmd: list[str], tmp_path: Path, fault: str | None = None,
                 **env: str) -> None:
        self.name = name
        self.log = tmp_path / f"{name}.log"
        self.reached = tmp_path / f"{name}.reached"
        self.release_file = tmp_path / f"{name}.release"
        if fault is not None and fault.endswith(":pause"):
            env |= {"SPARK_CKPT_FAULT_REACHED": str(self.reached),
                    "SPARK_CKPT_FAULT_RELEASE": str(self.release_file)}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=child_env(fault, **env), stdout=out,
                                         stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True, cwd=ROOT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float = SLOW) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"driver {self.name} still running after {timeout} s:\n"
                        f"{self.text()[-3000:]}")

    def wait_paused(self) -> None:
        if not wait_for(lambda: self.reached.exists() or not self.running(), SLOW):
            pytest.fail(f"driver {self.name} never reached its pause:\n{self.text()[-3000:]}")
        assert self.reached.exists(), f"{self.name} exited before its pause:\n" \
                                      f"{self.text()[-3000:]}"

    def release(self) -> None:
        self.release_file.write_text("go")

    def run_number(self) -> int:
        found = re.search(r"Pipeline \S+ run (\d+): starting", self.text())
        assert found is not None, f"{self.name} never started:\n{self.text()[-3000:]}"
        return int(found.group(1))


@pytest.fixture
def drivers(tmp_path):
    """Start drivers; whatever is still running at the end is SIGKILLed (group and all)."""
    started: list[Driver] = []

    def start(name: str, cmd: list[str], fault: str | None = None, **env: str) -> Driver:
        driver = Driver(name, cmd, tmp_path, fault, **env)
        started.append(driver)
        return driver

    yield start
    for driver in started:
        if driver.running():
            kill_group(driver.proc)


def orders_command(orders_input: Path, tmp_path: Path, *, available_now: bool = True,
                   ) -> list[str]:
    cmd = [sys.executable, str(ROOT / "jobs" / "stream_orders.py"),
           "--landing", str(orders_input / "landing"),
           "--customers", str(orders_input / "static" / "customers"),
           "--output", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ckpt"),
           "--interval", "0.1", "--max-files-per-batch", "1"]
    return cmd + (["--available-now"] if available_now else [])


def orders_env(orders_input: Path) -> dict[str, str]:
    return {"SPARK_CKPT_DEFAULTS": str(orders_input / "spark-defaults.conf")}


def stateful_command(tmp_path: Path, *, available_now: bool = True,
                     checkpoint_ms: int = 500) -> list[str]:
    cmd = [sys.executable, str(ROOT / "jobs" / "stateful_counts.py"),
           "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
           "--total-rows", str(TOTAL), "--rows-per-batch", "200", "--keys", str(KEYS),
           "--interval", "0.2", "--checkpoint-ms", str(checkpoint_ms), "--parallelism", "1"]
    return cmd + (["--available-now"] if available_now else [])


# -- what is committed -------------------------------------------------------------------------
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def committed_state(tmp_path: Path) -> dict[str, object]:
    """Everything a commit changes: Delta log versions of the output tables, the visible
    Parquet files and commit markers, the batch commit records and completed checkpoints."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    state: dict[str, object] = {}
    for log in sorted(out.glob("*/_delta_log")):
        state[f"delta:{log.parent.name}"] = sorted(p.name for p in log.glob("*.json"))
    by_region = out / "by_region"
    if by_region.exists():
        state["parquet"] = sorted(
            str(p.relative_to(by_region)) for p in by_region.rglob("*.parquet")
            if not any(part.startswith(("_", ".")) for part in p.relative_to(by_region).parts))
        state["markers"] = {p.name: _digest(p)
                            for p in (by_region / "_spark_ckpt_commits").glob("*.json")}
    state["commits"] = {p.name: _digest(p) for p in (ckpt / "commits").glob("*.json")}
    state["checkpoints"] = sorted(p.parent.name for p in
                                  (ckpt / "checkpoints").glob("chk-*/_metadata.json"))
    return state


def rows_by_batch(tmp_path: Path) -> dict[int, int]:
    """Input rows of each committed batch, from the progress log (both drivers append)."""
    path = tmp_path / "ckpt" / "progress" / "progress.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    records = [json.loads(line) for line in lines if line.endswith("}")]
    return {int(r["batch_id"]): int(r["num_input_rows"] or 0) for r in records}


def fence_claims(tmp_path: Path) -> int:
    """Claims committed to the checkpoint directory's fence table (its version 0 creates it)."""
    log = tmp_path / "ckpt" / "fence" / "_delta_log"
    return max(len(list(log.glob("*.json"))) - 1, 0) if log.exists() else 0


def newest_claim(tmp_path: Path) -> str:
    """The owner named by the newest fence commit (the one that owns the directory)."""
    from deltalake import DeltaTable

    uri = str(tmp_path / "ckpt" / "fence")
    newest = DeltaTable(uri).version()
    now = set(read_delta(uri, version=newest).column("owner").to_pylist())
    before = set(read_delta(uri, version=newest - 1).column("owner").to_pylist())
    (owner,) = now - before
    return owner


def assert_fenced(driver: Driver) -> str:
    code = driver.wait()
    text = driver.text()
    assert code != 0, f"{driver.name} was not stopped (exit {code}):\n{text[-3000:]}"
    assert "JobFencedError" in text, f"{driver.name} exit {code}, not fenced:\n{text[-3000:]}"
    return text


def assert_ok(driver: Driver) -> str:
    code = driver.wait()
    text = driver.text()
    assert code == 0, f"{driver.name} exit {code}:\n{text[-4000:]}"
    return text


# -- exactly once ------------------------------------------------------------------------------
def assert_orders_exactly_once(tmp_path: Path, expected: pd.DataFrame) -> None:
    got = read_delta(str(tmp_path / "out" / "enriched")).to_pandas()
    assert got.order_id.is_unique, "an order shows twice in the Delta output"
    got = got[COLUMNS].sort_values("order_id").reset_index(drop=True)
    assert got.order_id.tolist() == expected.order_id.tolist(), "orders lost or added (Delta)"
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)
    parquet = pq.read_table(str(tmp_path / "out" / "by_region"), columns=["order_id"])
    ids = sorted(parquet.column("order_id").to_pylist())
    assert ids == expected.order_id.tolist(), \
        f"Parquet output: {len(ids)} rows for {len(expected)} orders (lost or duplicated)"


def events(tmp_path: Path) -> pd.DataFrame | None:
    path = tmp_path / "out" / "events"
    if not (path / "_delta_log").exists():
        return None
    return read_delta(str(path)).to_pandas()


def assert_counts_exactly_once(tmp_path: Path) -> None:
    """Flink's check, as scripts/soak_stream.py::check_exactly_once makes it."""
    frame = events(tmp_path)
    assert frame is not None, "no events table"
    assert sorted(frame.id) == list(range(TOTAL)), \
        f"{len(frame)} events for ids 0..{TOTAL - 1}: an id is missing or shows twice"
    for key, rows in frame.sort_values("id").groupby("key"):
        assert rows.seq.tolist() == list(range(1, len(rows) + 1)), f"key {key}: seq gaps"
        assert rows.prev_id.iloc[1:].tolist() == rows.id.iloc[:-1].tolist(), \
            f"key {key}: rows not linked in order"
    totals = read_delta(str(tmp_path / "out" / "totals")).to_pandas()
    assert sorted(totals.key) == list(range(KEYS)) and set(totals.n) == {TOTAL // KEYS}


# CI runs one case of each scenario where it bites hardest; SPARK_CKPT_LONG_FAULTS=1 runs all.
LONG = pytest.mark.skipif(not LONG_FAULTS, reason=LONG_ONLY)


# -- 1. two drivers racing ---------------------------------------------------------------------
@pytest.mark.parametrize("pipeline", [pytest.param("orders", marks=LONG), "stateful"])
def test_two_drivers_started_at_once_exactly_one_commits(spark, orders_input, orders_expected,
                                                          tmp_path, drivers, pipeline):
    """Both run until stopped (not available-now, so neither can finish before the other
    claims): the one the newest fence commit names keeps running and commits every row; the
    other stops with JobFencedError."""
    if pipeline == "orders":
        cmd, env = orders_command(orders_input, tmp_path, available_now=False), \
            orders_env(orders_input)
    else:
        cmd, env = stateful_command(tmp_path, available_now=False), {}
    first, second = drivers("first", cmd, **env), drivers("second", cmd, **env)
    assert wait_for(lambda: not first.running() or not second.running(), SLOW), \
        "neither driver was fenced:\n" + first.text()[-2000:] + second.text()[-2000:]
    loser, winner = (first, second) if not first.running() else (second, first)
    assert_fenced(loser)
    assert fence_claims(tmp_path) == 2
    assert newest_claim(tmp_path) == f"run {winner.run_number()}"

    def done() -> bool:
        if pipeline == "orders":  # every file's rows in committed batches (progress lines
            # are written after a batch's commit record; a rerun batch counts once)
            return sum(rows_by_batch(tmp_path).values()) >= FILES * ROWS
        frame = events(tmp_path)
        if frame is None or len(frame) < TOTAL:
            return False
        totals = tmp_path / "out" / "totals"  # committed right after the events, same checkpoint
        return (totals / "_delta_log").exists() and \
            set(read_delta(str(totals)).to_pandas().n) == {TOTAL // KEYS}

    assert wait_for(lambda: done() or not winner.running(), SLOW, interval=0.5), \
        f"the owner never committed every row:\n{winner.text()[-4000:]}"
    assert winner.running(), f"the owner stopped:\n{winner.text()[-4000:]}"
    kill_group(winner.proc)  # it would run on forever, waiting for input
    if pipeline == "orders":
        assert_orders_exactly_once(tmp_path, orders_expected)
    else:
        assert_counts_exactly_once(tmp_path)


# -- 2. a second driver while the first is mid-batch ---------------------------------------------
@pytest.mark.parametrize("pipeline", ["orders", pytest.param("stateful", marks=LONG)])
def test_second_driver_starting_mid_batch_fences_the_first(spark, orders_input, orders_expected,
                                                           tmp_path, drivers, pipeline):
    """A has staged batch 1's outputs and not committed them when B claims the checkpoint; A
    goes on while B runs: it must stop before committing batch 1, and B commits every row."""
    if pipeline == "orders":
        cmd, env = orders_command(orders_input, tmp_path), orders_env(orders_input)
    else:
        cmd, env = stateful_command(tmp_path), {}
    a = drivers("a", cmd, "stream.batch.staged:2:pause", **env)
    a.wait_paused()
    before = committed_state(tmp_path)
    b = drivers("b", cmd, **env)
    assert wait_for(lambda: fence_claims(tmp_path) == 2 or not b.running(), SLOW)
    a.release()  # B has claimed the directory and is restoring or running its first batches
    text = assert_fenced(a)
    assert FENCED in text and "(run 1)" in text, text[-3000:]
    # A committed batch 0 at most, never batch 1 (each batch's completion is logged after its
    # commit record)
    assert not re.search(r"batch [1-9]\d*: \d+ rows in", text), text[-3000:]
    assert_ok(b)
    assert b.run_number() == 2 and newest_claim(tmp_path) == "run 2"
    if pipeline == "orders":
        assert sorted(before["commits"]) == ["000000000000.json"]  # type: ignore[arg-type]
        assert_orders_exactly_once(tmp_path, orders_expected)
    else:
        assert_counts_exactly_once(tmp_path)


# -- 3. a stale driver wakes after a long pause ---------------------------------------------------
@pytest.mark.parametrize("pipeline,point", [
    pytest.param("orders", "stream.batch.allocated:2", marks=LONG),  # batch 1 recorded, not run
    pytest.param("orders", "stream.batch.staged:2", marks=LONG),  # staged, none committed
    ("orders", "stream.output.committed:3"),  # batch 1: Delta committed, Parquet not
    pytest.param("stateful", "stream.batch.staged:2", marks=LONG),  # staged into the open txn
    pytest.param("stateful", "checkpoint.barrier:1", marks=LONG),  # barrier, no pre-commit
    pytest.param("stateful", "checkpoint.completed:1",  # metadata durable, sinks not committed
                 marks=LONG),
])
def test_stale_driver_waking_after_a_long_pause_commits_nothing(
        spark, orders_input, orders_expected, tmp_path, drivers, pipeline, point):
    """A is paused at ``point``; B starts, recovers and commits everything past it, and exits;
    then A wakes: it stops with JobFencedError, and nothing committed changes."""
    if pipeline == "orders":
        cmd, env = orders_command(orders_input, tmp_path), orders_env(orders_input)
    else:
        cmd, env = stateful_command(tmp_path), {}
    a = drivers("a", cmd, f"{point}:pause", **env)
    a.wait_paused()
    b = drivers("b", cmd, **env)
    assert_ok(b)
    assert newest_claim(tmp_path) == f"run {b.run_number()}" == "run 2"
    if pipeline == "orders":
        assert_orders_exactly_once(tmp_path, orders_expected)
    else:
        assert_counts_exactly_once(tmp_path)
    committed = committed_state(tmp_path)
    a.release()
    text = assert_fenced(a)
    assert FENCED in text and "(run 1)" in text, text[-3000:]
    assert committed_state(tmp_path) == committed, "the stale driver committed after waking"
    if pipeline == "orders":
        assert_orders_exactly_once(tmp_path, orders_expected)
    else:
        assert_counts_exactly_once(tmp_path)
