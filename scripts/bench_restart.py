"""Benchmark a streaming pipeline's restart after a crashed driver, to its first committed output.

    python scripts/bench_restart.py --reps 3 --json out.json

The pipeline (both systems): Parquet order files -> keep amount > 0 -> project -> broadcast join
with customers -> append to a Parquet directory, on a 0.5 s trigger. Per repetition and system,
a driver runs until it committed the first files, is SIGKILLed (its process group), a new file
lands, and a new driver starts on the same checkpoint: the figure is the time from starting the
new driver's process to its first committed output (a batch with input rows), the whole cost a
user sees. Systems, alternating in order:

* ``ckpt-connect``: spark_ckpt, every driver a Spark Connect client of one standalone server
  this script starts (a killed driver is a crashed client; the server and its JVM stay warm);
* ``ss-connect``: Structured Streaming on the same server;
* ``ckpt-classic``, ``ss-classic``: each driver its own JVM (``local[2]``), cold at each start.

Prints raw figures and ratios against Structured Streaming's classic restart and writes them as
JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))
sys.path.insert(0, str(ROOT / "tests"))

SYSTEMS = ("ckpt-connect", "ss-connect", "ckpt-classic", "ss-classic")


def pipeline(df, customers):  # the same DataFrame code for both
    from pyspark.sql import functions as F

    return (df.where(F.col("amount") > 0)
            .select("order_id", "customer_id", "order_ts", "amount", "quantity")
            .join(F.broadcast(customers), "customer_id")
            .withColumn("line_total", F.col("amount") * F.col("quantity")))


# -- the child driver ------------------------------------------------------------------------
def child(system: str, work: str, landing: str, customers_path: str) -> None:
    """Run the pipeline; print COMMITTED after each batch with input rows."""
    import logging

    import orders_data

    from spark_ckpt import Settings, StreamingContext, StreamingListener, get_or_create_session

    logging.basicConfig(level=logging.WARNING)
    spark = get_or_create_session(f"restart-{system}")
    customers = spark.read.parquet(customers_path).select("customer_id", "region", "segment")
    schema = orders_data.ORDER_EVENT_SCHEMA
    if system.startswith("ss"):
        stream = pipeline(spark.readStream.schema(schema).parquet(landing), customers)
        query = (stream.writeStream.format("parquet").option("path", f"{work}/out")
                 .option("checkpointLocation", f"{work}/ckpt")
                 .trigger(processingTime="500 milliseconds").start())
        if system == "ss-connect":  # for the parent: the query outlives this client
            from spark_ckpt.sparkapi import spark_api

            Path(work, "session").write_text(str(spark_api(spark).session_id()))
        seen = -1
        while True:
            p = query.lastProgress
            if p and p["batchId"] > seen:
                seen = p["batchId"]
                print(f"PROGRESS {p['batchId']} {[s['numInputRows'] for s in p['sources']]} "
                      f"{p['numInputRows']}", file=sys.stderr, flush=True)
                # a Connect client's progress carries the rows per source only
                if sum(int(src["numInputRows"] or 0) for src in p["sources"]) > 0:
                    print(f"COMMITTED {p['batchId']}", flush=True)
            time.sleep(0.02)

    class Committed(StreamingListener):
        def on_batch_completed(self, progress):
            if progress["num_input_rows"]:
                print(f"COMMITTED {progress['batch_id']}", flush=True)

    settings = Settings.from_conf(spark.conf, progress="never")
    ctx = StreamingContext(spark, 0.5, f"{work}/ckpt", "restart", settings=settings)
    ctx.add_listener(Committed())
    ctx.file_stream("orders", landing, "parquet", schema=schema) \
        .transform(lambda df: pipeline(df, customers), name="enrich") \
        .write_parquet(f"{work}/out", name="out")
    ctx.start()
    ctx.await_termination()


# -- the parent ------------------------------------------------------------------------------
def _env(remote: str | None) -> dict[str, str]:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
               SPARK_CKPT_DEFAULTS=str(ROOT / "spark-defaults.conf"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("SPARK_REMOTE", None)
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)  # set by a Connect session this process made
    if remote:
        env["SPARK_REMOTE"] = remote
    return env


def start(system: str, work: Path, landing: str, customers: str,
          remote: str | None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", system, "--work", str(work), "--landing", landing,
         "--customers", customers], env=_env(remote if system.endswith("connect") else None),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        start_new_session=True)


def until_committed(proc: subprocess.Popen, timeout: float = 600) -> float:
    """Seconds until the driver printed its first COMMITTED line (fails on exit or timeout).
    A thread reads the lines: select() on a buffered pipe misses lines already buffered."""
    import queue
    import threading

    assert proc.stdout is not None
    t0 = time.perf_counter()
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put("")],
                     daemon=True).start()
    tail: list[str] = []
    while time.perf_counter() - t0 < timeout:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if not line:
            break
        tail = (tail + [line])[-40:]
        if line.startswith("COMMITTED"):
            return time.perf_counter() - t0
    kill(proc)
    raise SystemExit("the driver never committed:\n" + "".join(tail))


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stop_orphaned_queries(remote: str | None, session_file: Path) -> None:
    """A killed Connect client's streaming query runs on in the server (its session lives
    until it times out) and would take the file that lands next. Structured Streaming stops
    that run when the new driver starts the same query; stop it now, so the new driver's
    restart is what is measured. (spark_ckpt's next driver interrupts its predecessor's
    tagged operations itself; between batches a killed driver has none.)"""
    from pyspark.sql import SparkSession

    assert remote is not None
    orphan = SparkSession.builder.remote(
        f"{remote.rstrip('/')}/;session_id={session_file.read_text().strip()}").create()
    try:
        for query in orphan.streams.active:
            query.stop()
    finally:
        orphan.stop()


def one(system: str, base: Path, rep: int, customers: str, remote: str | None) -> dict:
    import orders_data

    work = base / f"{system}-{rep}"
    landing = str(work / "landing")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(landing)
    orders_data.drop_order_files(landing, files=2, first_file=0, rows_per_file=1000,
                                 fmt="parquet")
    first = start(system, work, landing, customers, remote)
    first_seconds = until_committed(first)
    time.sleep(2.0)  # a few more (empty) batches and, for spark_ckpt, its records
    kill(first)  # a crash: the whole process group, no shutdown
    if system == "ss-connect":
        stop_orphaned_queries(remote, work / "session")
    orders_data.drop_order_files(landing, files=1, first_file=2, rows_per_file=1000,
                                 fmt="parquet")
    started = time.perf_counter()
    second = start(system, work, landing, customers, remote)
    try:
        restart_seconds = until_committed(second)
    finally:
        kill(second)
    wall = time.perf_counter() - started
    return {"first_start_seconds": first_seconds, "restart_seconds": restart_seconds,
            "wall_seconds": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=SYSTEMS)
    parser.add_argument("--work")
    parser.add_argument("--landing")
    parser.add_argument("--customers")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.work, args.landing, args.customers)
        return

    import orders_data
    from connect_server import start_server, stop_server

    systems = [s for s in args.systems.split(",") if s]
    base = Path(tempfile.mkdtemp(prefix="spark-ckpt-restart-"))
    orders_data.generate(str(base / "data"), orders=1000, files=1, customers=5000)
    customers = str(base / "data" / "customers")
    server = None
    if any(s.endswith("connect") for s in systems):
        t0 = time.perf_counter()
        server = start_server(base)
        print(f"Spark Connect server at {server.url} (listening after "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    figures: dict = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}", "reps": args.reps,
        "runs": {s: [] for s in systems}}
    try:
        for rep in range(args.reps):
            order = systems if rep % 2 == 0 else list(reversed(systems))
            for system in order:
                run = one(system, base, rep, customers, server.url if server else None)
                figures["runs"][system].append(run)
                print(f"rep {rep + 1} {system}: restart to first commit "
                      f"{run['restart_seconds']:.1f} s (first start "
                      f"{run['first_start_seconds']:.1f} s)", flush=True)
    finally:
        if server is not None:
            stop_server(server)
    median = {s: statistics.median(r["restart_seconds"] for r in runs)
              for s, runs in figures["runs"].items() if runs}
    figures["median_restart_seconds"] = median
    if "ss-classic" in median:
        figures["ratio_to_ss_classic"] = {s: v / median["ss-classic"] for s, v in median.items()}
    if "ss-connect" in median:
        figures["ratio_to_ss_connect"] = {s: v / median["ss-connect"] for s, v in median.items()}
    print(json.dumps({k: v for k, v in figures.items() if k != "runs"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
