"""Helpers for tests that run real drivers and compare real outputs."""

from __future__ import annotations

from spark_ckpt.storage.delta_reader import read_delta
import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from deltalake import DeltaTable

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "orders_report.py"
PARALLELISM = 4
AGG_PARALLELISM = 2
# Partitions the example job runs: enriched, payments-to-settled (the durable exchange of
# payments into settled's join), settled (4 each), daily (2); sources are read in place.
TOTAL_PARTITIONS = 3 * PARALLELISM + AGG_PARALLELISM
# The long versions of the fault tests (many more SIGKILLs at random wall-clock moments, each
# kill point in its own test, the parity runs in full): SPARK_CKPT_LONG_FAULTS=1 python -m
# pytest -m slow. CI runs the short, deterministic versions, which kill at least once at each
# kind of point (an event log's, a sink's commit, a checkpoint's, a batch's), not at each point.
LONG_FAULTS = os.environ.get("SPARK_CKPT_LONG_FAULTS", "") not in ("", "0")
LONG_ONLY = "a long fault run: set SPARK_CKPT_LONG_FAULTS=1"


def job_command(input_dir: str, output: str, work_dir: str, job_id: str = "orders") -> list[str]:
    return [sys.executable, str(JOB), "--input", input_dir, "--output", output,
            "--work-dir", work_dir, "--job-id", job_id, "--parallelism", str(PARALLELISM),
            "--agg-parallelism", str(AGG_PARALLELISM)]


# The tests' JVMs compile with C1 only and collect with the serial collector: their jobs are
# small and short, and on 2 cores C2's compiler threads and a parallel collector cost about a
# third of a driver's CPU and buy nothing here. They also map one archive of Spark's classes
# (class data sharing, made once per run by conftest.py): a driver starts in ~11 s instead of
# ~17 on this machine. A JVM whose class path differs from the archive's ignores it silently.
# Benchmarks (scripts/) never use these.
BASE_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
CDS_ENV = "SPARK_CKPT_TEST_CDS"  # the archive's path, once made


def test_java_options() -> str:
    archive = os.environ.get(CDS_ENV)
    if archive and os.path.exists(archive):
        return (f"{BASE_JAVA_OPTIONS} -XX:SharedArchiveFile={archive} -Xshare:auto "
                "-Xlog:cds=off -Xlog:cds+dynamic=off")
    return BASE_JAVA_OPTIONS


def make_class_archive(directory: Path) -> str | None:
    """Run a small Spark job in a driver whose JVM dumps the classes it loaded into
    ``directory/spark.jsa`` when it exits; the path, or None if no archive came of it."""
    archive = directory / "spark.jsa"
    conf = directory / "spark-defaults.conf"
    conf.write_text((ROOT / "spark-defaults.conf").read_text() +
                    f"\nspark.driver.extraJavaOptions {BASE_JAVA_OPTIONS} "
                    f"-XX:ArchiveClassesAtExit={archive}\n")
    script = (
        "import sys\n"
        "from spark_ckpt import get_or_create_session\n"
        "spark = get_or_create_session('class-archive')\n"
        "d = sys.argv[1]\n"
        "df = spark.range(2000).selectExpr('id', 'id % 7 AS k', 'cast(id AS string) AS s')\n"
        "df.write.mode('overwrite').partitionBy('k').parquet(d + '/p')\n"
        "r = spark.read.parquet(d + '/p')\n"
        "r.groupBy('k').count().join(r, 'k').repartition(3, 'k').collect()\n"
        "spark.stop()\n")
    env = dict(os.environ, SPARK_CKPT_DEFAULTS=str(conf), PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        subprocess.run([sys.executable, "-c", script, str(directory / "data")], env=env,
                       capture_output=True, timeout=300, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    # the JVM writes the archive as it exits, after its Python driver is gone
    flag = f"-XX:ArchiveClassesAtExit={archive}".encode()

    def dumping() -> bool:
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and flag in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                continue
        return False

    wait_for(lambda: not dumping(), 120)
    return str(archive) if archive.exists() and archive.stat().st_size > 0 else None


def defaults_text(driver_java_options: str = "", *, exchanges: bool = True) -> str:
    """The repository's spark-defaults.conf with the tests' JVM options (and
    ``driver_java_options`` besides), for a test that writes a defaults file of its own.
    ``exchanges``: durable exchanges however small the tests' inputs (the orders report's
    join runs through them, as a large job's does)."""
    options = test_java_options()
    return ((ROOT / "spark-defaults.conf").read_text() +
            f"\nspark.driver.extraJavaOptions {driver_java_options} {options}\n"
            f"spark.executor.extraJavaOptions {options}\n"
            + ("spark.ckpt.batch.exchangeMinBytes 0\n" if exchanges else ""))


_defaults: list[str] = []


def test_defaults() -> str:
    """A defaults file (written once per test process): :func:`defaults_text`."""
    if not _defaults:
        fd, path = tempfile.mkstemp(prefix="spark-ckpt-test-defaults-", suffix=".conf")
        with os.fdopen(fd, "w") as out:
            out.write(defaults_text())
        atexit.register(lambda: os.path.exists(path) and os.unlink(path))
        _defaults.append(path)
    return _defaults[0]


def child_env(fault: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SPARK_CKPT_FAULT", None)
    env["PYSPARK_PYTHON"] = sys.executable
    env["SPARK_CKPT_DEFAULTS"] = test_defaults()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if fault:
        env["SPARK_CKPT_FAULT"] = fault
    if os.environ.get("SPARK_CKPT_TEST_REMOTE"):  # drivers are Spark Connect clients too
        env["SPARK_REMOTE"] = os.environ["SPARK_CKPT_TEST_REMOTE"]
    env.update(extra)
    return env


def run_driver(input_dir: str, output: str, work_dir: str, *, fault: str | None = None,
               job_id: str = "orders", timeout: float = 300,
               **extra: str) -> subprocess.CompletedProcess:
    """Run the example job as a real driver process in its own process group."""
    return subprocess.run(
        job_command(input_dir, output, work_dir, job_id), env=child_env(fault, **extra),
        capture_output=True, text=True, timeout=timeout, start_new_session=True, cwd=ROOT,
    )


def start_driver(input_dir: str, output: str, work_dir: str, *, fault: str | None = None,
                 job_id: str = "orders", **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        job_command(input_dir, output, work_dir, job_id), env=child_env(fault, **extra),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        cwd=ROOT,
    )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (JVM, Python workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def wait_for(predicate, timeout: float, interval: float = 0.2) -> bool:
    """Poll ``predicate`` every ``interval`` seconds: True as soon as it holds, False once
    ``timeout`` seconds passed without it (after a last look at the deadline, so a condition
    that came true during the final sleep is not missed). The one wait loop of the tests."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        # a poll interval, not a wait for an outcome: the predicate decides, so a slow
        # machine only polls more times before the same deadline
        time.sleep(min(interval, remaining))


def finished_in_log(work_dir: str, job_id: str = "orders") -> set[tuple[str, int]]:
    """Finished partitions per the Delta event log, read with delta-rs (not spark_ckpt)."""
    path = Path(work_dir) / job_id / "events"
    if not (path / "_delta_log").exists():
        return set()
    frame = read_delta(str(path)).to_pandas().sort_values(["job_attempt", "seq"])
    finished: set[tuple[str, int]] = set()
    for row in frame.itertuples():
        if row.event_type == "ExecutionVertexFinished":
            finished.add((row.vertex_id, int(row.partition)))
        elif row.event_type == "ExecutionVertexReset":
            finished.discard((row.vertex_id, int(row.partition)))
    return finished


def read_daily(output: str) -> pd.DataFrame:
    frame = read_delta(f"{output}/daily").to_pandas()
    return frame.sort_values(["region", "day"]).reset_index(drop=True)


def delta_writes(output: str) -> int:
    """How many data-writing commits the daily table has (exactly-once means one)."""
    return sum(1 for h in DeltaTable(f"{output}/daily").history()
               if h.get("operation") not in ("CREATE TABLE",))


def assert_outputs_equal(spark, output: str, expected: dict) -> None:
    """The job's outputs equal an uninterrupted run's: Delta table and Parquet directory."""
    from chispa import assert_df_equality

    got = read_daily(output)
    want = expected["daily"]
    assert_df_equality(
        spark.createDataFrame(got[list(want.columns)]),
        spark.createDataFrame(want),
        ignore_row_order=True, ignore_nullable=True,
    )
    settled = spark.read.parquet(f"{output}/settled")
    ids = sorted(r.order_id for r in settled.select("order_id").collect())
    assert ids == expected["settled_ids"], "settled output lost or duplicated rows"


def write_batch_files(spark, frames, schema: str, source) -> str:
    """Each pandas frame one Parquet file in ``source`` (a new directory), named in order so a
    file stream with ``max_files_per_batch=1`` reads frame ``b`` as batch ``b``."""
    source.mkdir()
    for b, frame in enumerate(frames):
        spark.createDataFrame(frame, schema).coalesce(1).write.parquet(str(source / f"b{b}"))
    for n, f in enumerate(sorted(source.glob("b*/*.parquet"))):
        f.rename(source / f"part-{n:02d}.parquet")
    return str(source)


def generated_rows(spark, total_rows: int, keys: int):
    """The rows ``ctx.generator_stream(total_rows=..., keys=...)`` produces, by plain Spark:
    a pure function of id (key = id % keys, value from xxhash64(id, seed 42))."""
    from pyspark.sql import functions as F

    return spark.range(0, total_rows).select(
        "id", F.pmod("id", F.lit(keys)).alias("key"),
        (F.pmod(F.xxhash64("id", F.lit(42)), F.lit(1_000_000)) / 100.0).alias("value"))


def plain_sequenced(spark, total_rows: int, keys: int) -> dict[str, pd.DataFrame]:
    """What a Sequencer (jobs/stateful_counts.py) and a count/sum aggregation per key make of
    the generator's rows, by plain Spark: ``events`` (key, id, seq, prev_id: numbered per key
    in id order) sorted by id, ``totals`` (key, n, total) sorted by key."""
    from pyspark.sql import functions as F
    from pyspark.sql.window import Window

    rows = generated_rows(spark, total_rows, keys)
    per_key = Window.partitionBy("key").orderBy("id")
    events = rows.select("key", "id", F.row_number().over(per_key).cast("long").alias("seq"),
                         F.lag("id").over(per_key).alias("prev_id"))
    totals = rows.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total"))
    return {"events": events.toPandas().sort_values("id").reset_index(drop=True),
            "totals": totals.toPandas().sort_values("key").reset_index(drop=True)}
