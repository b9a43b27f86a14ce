"""Demo: a batch job and a streaming pipeline survive a driver crash.

    python scripts/demo.py [--orders 400000] [--dir demo-data] [--part batch|stream|both]
        [--parallelism 16]

Batch:

1. generates orders, customers and payments (Parquet) under DIR/input;
2. runs jobs/orders_report.py with spark-submit and SIGKILLs the driver's whole process
   group (JVM, Python driver, workers) once about half of the partitions are durable;
3. submits the same command again: it replays the Delta event log, reuses the finished
   partitions, and runs the rest;
4. runs the same job uninterrupted into another directory and checks both outputs are equal.

Streaming:

5. drops 10 JSON files of order events (a few malformed lines each) into a landing directory;
6. runs jobs/stream_orders.py with spark-submit (one file per batch) and SIGKILLs the driver
   after a few batches have committed;
7. submits it again: it reruns the batch it was in over the same files and goes on; checks
   that every valid order is in the Delta table exactly once and the malformed lines are in
   the dead-letter table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from spark_ckpt.storage.delta_reader import read_delta

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))


def spark_submit() -> list[str]:
    binary = shutil.which("spark-submit") or str(Path(sys.executable).parent / "spark-submit")
    return [binary, "--properties-file", str(ROOT / "spark-defaults.conf"),
            "--driver-java-options",
            f"-Dlog4j2.configurationFile=file:{ROOT / 'conf' / 'log4j2.properties'}"]


def submit_command(data: Path, output: Path, work: Path, parallelism: int = 16) -> list[str]:
    return [
        *spark_submit(),
        str(ROOT / "jobs" / "orders_report.py"), "--input", str(data / "input"),
        "--output", str(output), "--work-dir", str(work), "--job-id", "orders-demo",
        "--parallelism", str(parallelism), "--agg-parallelism", str(agg_parallelism(parallelism)),
    ]


def agg_parallelism(parallelism: int) -> int:
    return max(1, parallelism // 4)


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def durable_partitions(work: Path) -> int:

    events = work / "orders-demo" / "events"
    if not (events / "_delta_log").exists():
        return 0
    try:
        frame = read_delta(str(events), columns=["event_type"]).to_pandas()
    except Exception:  # noqa: BLE001 - a commit being written right now
        return 0
    return int((frame.event_type == "ExecutionVertexFinished").sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=400_000)
    parser.add_argument("--dir", default=str(ROOT / "demo-data"))
    parser.add_argument("--part", choices=["batch", "stream", "both"], default="both")
    parser.add_argument("--parallelism", type=int, default=16,
                        help="partitions of the batch job's vertices (the daily report: a quarter)")
    args = parser.parse_args()

    from spark_ckpt.javacheck import check_java

    check_java()
    import orders_data

    data = Path(args.dir)
    shutil.rmtree(data, ignore_errors=True)
    orders_data.generate(str(data / "input"), orders=args.orders, files=16, customers=20_000)
    print(f"[demo] generated {args.orders:,} orders in 16 files under {data / 'input'}")
    if args.part in ("batch", "both"):
        batch_demo(data, args.parallelism)
    if args.part in ("stream", "both"):
        stream_demo(data)


def batch_demo(data: Path, parallelism: int = 16) -> None:
    # enriched, settled, daily (sources are read in place)
    total = parallelism * 2 + agg_parallelism(parallelism)

    # 1. A run that dies: SIGKILL once about half of the partitions are durable.
    output, work = data / "output", data / "work"
    command = submit_command(data, output, work, parallelism)
    print("[demo] run 1: spark-submit jobs/orders_report.py; will SIGKILL the driver part-way")
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=environment(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while proc.poll() is None and durable_partitions(work) < total // 2:
        time.sleep(0.2)
    if proc.poll() is not None:
        raise SystemExit(f"[demo] the job ended (exit {proc.returncode}) before it was killed")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = durable_partitions(work)
    print(f"[demo] killed the driver after {time.perf_counter() - started:.1f} s with "
          f"{killed_at} of {total} partitions durable in the event log")

    # 2. The same command again: recovery.
    print("[demo] run 2: the same spark-submit command again")
    started = time.perf_counter()
    second = subprocess.run(command, env=environment(), cwd=ROOT,
                            capture_output=True, text=True)
    if second.returncode != 0:
        raise SystemExit(f"[demo] recovery failed:\n{second.stdout}\n{second.stderr[-4000:]}")
    for line in second.stdout.splitlines():
        if line.startswith(("RESULT", "  ")):
            print("[demo]   " + line.strip())
    print(f"[demo] recovered run took {time.perf_counter() - started:.1f} s")

    # 3. An uninterrupted run, for comparison.
    print("[demo] run 3: an uninterrupted run of the same job into another directory")
    clean_out, clean_work = data / "output-uninterrupted", data / "work-uninterrupted"
    third = subprocess.run(submit_command(data, clean_out, clean_work, parallelism),
                           env=environment(), cwd=ROOT, capture_output=True, text=True)
    if third.returncode != 0:
        raise SystemExit(f"[demo] uninterrupted run failed:\n{third.stderr[-4000:]}")

    import pandas as pd
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    def daily(path: Path) -> pd.DataFrame:
        return read_delta(str(path / "daily")).to_pandas().sort_values(
            ["region", "day"]).reset_index(drop=True)

    def settled(path: Path) -> pd.DataFrame:
        return pq.read_table(str(path / "settled")).to_pandas().sort_values(
            "order_id").reset_index(drop=True)

    pd.testing.assert_frame_equal(daily(output), daily(clean_out))
    pd.testing.assert_frame_equal(settled(output), settled(clean_out))
    commits = [h for h in DeltaTable(str(output / "daily")).history()
               if h.get("operation") != "CREATE TABLE"]
    print(f"[demo] outputs equal: daily report ({len(daily(output))} rows, {len(commits)} Delta "
          f"commit) and settled orders ({len(settled(output)):,} rows) match the uninterrupted run")
    print(f"[demo] history: spark-ckpt history orders-demo --work-dir {work}")


def stream_command(data: Path) -> list[str]:
    return [*spark_submit(), str(ROOT / "jobs" / "stream_orders.py"),
            "--landing", str(data / "landing"), "--customers", str(data / "input" / "customers"),
            "--output", str(data / "stream-output"), "--checkpoint", str(data / "stream-ckpt"),
            "--interval", "0.5", "--max-files-per-batch", "1", "--available-now"]


def stream_demo(data: Path) -> None:
    import json

    import orders_data

    files = orders_data.drop_order_files(str(data / "landing"), files=10, rows_per_file=5_000,
                                         customers=20_000, malformed_every=1_000)
    print(f"[demo] streaming: dropped {len(files)} JSON files of order events (5 malformed "
          f"lines each) into {data / 'landing'}")
    commits = data / "stream-ckpt" / "commits"
    print("[demo] run 1: spark-submit jobs/stream_orders.py; will SIGKILL it after 4 batches")
    proc = subprocess.Popen(stream_command(data), env=environment(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while proc.poll() is None and len(list(commits.glob("*.json"))) < 4:
        time.sleep(0.1)
    if proc.poll() is not None:
        raise SystemExit(f"[demo] the pipeline ended (exit {proc.returncode}) before the kill")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    allocated = len(list((data / "stream-ckpt" / "allocations").glob("*.json")))
    done = len(list(commits.glob("*.json")))
    print(f"[demo] killed: {done} batches committed, {allocated} allocated")
    print("[demo] run 2: the same spark-submit command again")
    second = subprocess.run(stream_command(data), env=environment(), cwd=ROOT,
                            capture_output=True, text=True)
    if second.returncode != 0:
        raise SystemExit(f"[demo] restart failed:\n{second.stdout}\n{second.stderr[-4000:]}")
    for line in second.stdout.splitlines():
        if line.startswith("RESULT"):
            print("[demo]   " + line.strip())
    expected, malformed = set(), 0
    for path in files:
        for line in Path(path).read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                malformed += 1
                continue
            if row["amount"] > 0:
                expected.add(row["order_id"])
    table = read_delta(str(data / "stream-output" / "enriched"), columns=["order_id"]).to_pandas()
    dead = read_delta(str(data / "stream-ckpt" / "deadletter"), columns=["record"]).to_pandas()
    assert len(table) == len(expected) and set(table.order_id) == expected, "stream output"
    assert len(dead) == malformed, "dead letters"
    print(f"[demo] every valid order exactly once: {len(table):,} rows in the Delta table "
          f"(no duplicates), {len(dead)} malformed lines in the dead-letter table")


if __name__ == "__main__":
    main()
