"""Shared fixtures: one local SparkSession for the whole run, and small generated inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "tests"))

# Python workers import what tests pickle by reference (processors defined in test modules),
# as a cluster's executors get a job's modules through --py-files.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT / "tests"), str(ROOT / "jobs"), os.environ.get("PYTHONPATH")) if p)
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from helpers import CDS_ENV, make_class_archive, test_java_options  # noqa: E402 - after the path


def pytest_sessionstart(session):
    """One archive of Spark's classes for every JVM of the run (helpers.test_java_options);
    a child pytest (tests/test_connect.py) inherits it through the environment. The archive
    is kept between runs (it takes a Spark job to make) under ``$SPARK_CKPT_TEST_CACHE`` or
    ``~/.cache/spark-ckpt-tests``, named after the JVM and the jars it was made from: a JVM
    that does not match an archive ignores it."""
    if os.environ.get(CDS_ENV):
        return
    import atexit
    import shutil
    import tempfile

    cache = Path(os.environ.get("SPARK_CKPT_TEST_CACHE")
                 or Path.home() / ".cache" / "spark-ckpt-tests")
    kept = cache / f"classes-{_archive_key()}.jsa"
    if kept.is_file() and kept.stat().st_size > 0:
        os.environ[CDS_ENV] = str(kept)
        return
    try:
        cache.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix="spark-ckpt-test-classes-", dir=cache))
    except OSError:  # no cache: an archive for this run only
        directory = Path(tempfile.mkdtemp(prefix="spark-ckpt-test-classes-"))
    atexit.register(shutil.rmtree, directory, True)
    archive = make_class_archive(directory)
    if archive is None:
        return
    try:
        os.replace(archive, kept)  # another run may have kept one meanwhile: either will do
        archive = str(kept)
    except OSError:
        pass
    os.environ[CDS_ENV] = archive


def _archive_key() -> str:
    """What a class archive depends on: the java binary, Spark's jars, the JVM options."""
    import hashlib
    import shutil

    import pyspark
    from helpers import BASE_JAVA_OPTIONS

    home = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)
    java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") \
        else Path(shutil.which("java") or "java")
    parts = [str(java.resolve()), BASE_JAVA_OPTIONS, pyspark.__version__]
    if java.exists():
        parts.append(str(java.resolve().stat().st_mtime_ns))
    for jar in sorted((home / "jars").glob("*.jar")):
        parts.append(f"{jar.name}:{jar.stat().st_size}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# Set by tests/test_connect.py for the runs it starts: the same tests, on a Spark Connect
# session to that server (PySpark's parity tests run the same test classes both ways).
REMOTE = os.environ.get("SPARK_CKPT_TEST_REMOTE")


_TESTS = str(Path(__file__).resolve().parent)
_RUNNING: list[subprocess.Popen] = []  # children still running when their test ended


@pytest.fixture(autouse=True)
def _children_pipes_closed(monkeypatch):
    """The pipes of the children a test's own code starts (drivers killed by SIGKILL, CLI
    runs) are closed when the test ends, as warnings are errors and an unclosed pipe is a
    ResourceWarning. A child still running then (a server a fixture keeps) keeps its pipes
    until the run ends. Children Spark starts (its JVM watches its stdin) are not touched."""
    started: list[subprocess.Popen] = []
    original = subprocess.Popen.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if sys._getframe(1).f_code.co_filename.startswith(_TESTS):
            started.append(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", init)
    yield
    for proc in started:
        if proc.poll() is None:
            _RUNNING.append(proc)
            continue
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


# The test files in the order of their time in a full run (2026-11-29, two workers on 2 cores,
# the long tests left out; test_connect_clients.py, all long, first for the long runs), longest
# first; the others after them. xdist's loadfile mode hands
# each worker a file at a time in collection order (setup.cfg turns off its reordering by test
# count, which ran the one-test Connect files last, alone): longest first is how a greedy
# scheduler packs two workers best, and the long files overlap the rest instead of ending the
# run alone.
LONGEST_FIRST = ["test_connect_clients.py", "test_kafka.py", "test_netns_cluster.py",
                 "test_windows.py",
                 "test_recovery_faults.py", "test_batch_cuts.py", "test_storage_faults.py",
                 "test_stream_drivers.py", "test_connect.py", "test_read_state_operators.py",
                 "test_keyed_state.py", "test_demo.py", "test_cluster_faults.py",
                 "test_stream_recovery.py", "test_s3.py", "test_event_time.py",
                 "test_typed_state.py", "test_netns_locality.py", "test_relocate.py",
                 "test_stop.py", "test_nexmark.py", "test_checkpoint_recovery.py",
                 "test_delta_interop.py", "test_batch_job.py", "test_notebook.py",
                 "test_recipes.py", "test_options.py", "test_stream_joins.py",
                 "test_restored_copy.py", "test_state_cluster.py", "test_hostile_input.py",
                 "test_batch_input_identity.py", "test_state_evolution.py",
                 "test_delta_source_maintenance.py", "test_streaming.py",
                 "test_nexmark_kafka.py"]


def pytest_collection_modifyitems(items):
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    if REMOTE:
        session = (SparkSession.builder.remote(REMOTE)
                   .config("spark.sql.shuffle.partitions", "2")
                   .config("spark.sql.session.timeZone", "UTC").getOrCreate())
        assert type(session).__module__.startswith("pyspark.sql.connect"), type(session)
        yield session
        session.stop()
        return
    session = (
        SparkSession.builder.master("local[2]")
        .appName("spark_ckpt-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions",
                f"-Dlog4j2.configurationFile=file:{ROOT / 'conf' / 'log4j2.properties'} "
                f"{test_java_options()}")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def orders_input(tmp_path_factory) -> str:
    """20,000 orders in 4 files, payments in 4 files, 500 customers."""
    import orders_data

    directory = tmp_path_factory.mktemp("orders-input")
    orders_data.generate(str(directory), orders=20_000, files=4, customers=500, seed=11)
    return str(directory)


@pytest.fixture(scope="session")
def expected_daily(spark, orders_input):
    """The daily report computed by plain Spark, as a pandas frame sorted by key."""
    import orders_report as report

    orders = spark.read.parquet(f"{orders_input}/orders")
    customers = spark.read.parquet(f"{orders_input}/customers")
    payments = spark.read.parquet(f"{orders_input}/payments")
    settled = report.settle(report.enrich(orders, customers), payments)
    daily = report.daily_revenue(settled)
    return {
        "daily": daily.toPandas().sort_values(["region", "day"]).reset_index(drop=True),
        "settled_rows": settled.count(),
        "settled_ids": sorted(r.order_id for r in settled.select("order_id").collect()),
    }


@pytest.fixture(scope="session")
def connect_url(tmp_path_factory):
    """A standalone Spark Connect server (``sbin/start-connect-server.sh --wait``, local[2],
    the repository's defaults), started once for the run: ``sc://localhost:<port>``. Clients
    are child processes (a Spark Connect client and this process's classic session do not mix
    in one interpreter). Stopped (its process group killed) at the end."""
    from connect_server import start_server, stop_server

    server = start_server(tmp_path_factory.mktemp("connect-server"),
                          java_options=test_java_options())
    yield server.url
    stop_server(server)
