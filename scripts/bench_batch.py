"""Benchmark batch recovery against plain Spark, on one machine, in one invocation.

    python scripts/bench_batch.py --orders 5000000 --files 50 --reps 3

Measures, each as separate driver processes on the same generated input:

1. overhead: the example orders job (jobs/orders_report.py, 50 partitions per vertex) run with
   spark_ckpt versus the same DataFrame pipeline in plain Spark writing the same outputs
   (settled rows to Parquet, the daily report to a Delta table via delta-rs);
2. recovery: a spark_ckpt run SIGKILLed at 70% of a full run's job time, then resubmitted;
   recovered-run time versus a from-scratch run;
3. replay: reading and replaying an event log of 100,000 ExecutionVertexFinished events.

Prints raw figures and ratios, and writes them as JSON (``--json``).
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


# -- child drivers -----------------------------------------------------------------------------
def child(mode: str, input_dir: str, output: str, work_dir: str, parallelism: int,
          agg_parallelism: int) -> None:
    import logging

    from spark_ckpt import Settings, get_or_create_session

    logging.basicConfig(level=logging.WARNING)
    spark = get_or_create_session(f"bench-{mode}")
    spark.sparkContext.setLogLevel("ERROR")
    print("STARTED", flush=True)
    t0 = time.perf_counter()
    if mode == "plain":
        import orders_report as report
        from deltalake import write_deltalake

        orders = spark.read.parquet(f"{input_dir}/orders")
        customers = spark.read.parquet(f"{input_dir}/customers")
        payments = spark.read.parquet(f"{input_dir}/payments")
        settled = report.settle(report.enrich(orders, customers), payments).cache()
        settled.write.mode("overwrite").parquet(f"{output}/settled")
        daily = report.daily_revenue(settled)
        write_deltalake(f"{output}/daily", daily.toArrow(), mode="overwrite")
        info = {}
    else:
        import orders_report as report

        job = report.build_job("bench", input_dir, output, parallelism=parallelism,
                               agg_parallelism=agg_parallelism, work_dir=work_dir, spark=spark,
                               settings=Settings.from_conf(spark.conf, progress="never"))
        result = job.run()
        info = {"ran": result.ran, "reused": result.reused, "attempt": result.attempt}
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, **info}), flush=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYSPARK_PYTHON"] = sys.executable
    env["SPARK_CKPT_DEFAULTS"] = str(ROOT / "spark-defaults.conf")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _cmd(mode: str, args: argparse.Namespace, output: str, work_dir: str) -> list[str]:
    return [sys.executable, __file__, "--child", mode, "--input", args.input, "--output", output,
            "--work-dir", work_dir, "--parallelism", str(args.parallelism),
            "--agg-parallelism", str(args.agg_parallelism)]


def run_child(mode: str, args: argparse.Namespace, output: str, work_dir: str) -> dict:
    started = time.perf_counter()
    proc = subprocess.run(_cmd(mode, args, output, work_dir), env=_env(), capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = next(li for li in proc.stdout.splitlines() if li.startswith("RESULT "))
    result = json.loads(line[7:])
    result["process_seconds"] = time.perf_counter() - started
    return result


def kill_at(args: argparse.Namespace, output: str, work_dir: str, after: float) -> dict:
    """Start a spark_ckpt driver and SIGKILL its process group ``after`` s into the job."""
    proc = subprocess.Popen(_cmd("ckpt", args, output, work_dir), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT, start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("STARTED"):
            break
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    from deltalake import DeltaTable

    frame = DeltaTable(f"{work_dir}/bench/events").to_pandas()
    return {"durable_partitions": int((frame.event_type == "ExecutionVertexFinished").sum())}


# -- replay ------------------------------------------------------------------------------------
def bench_replay(events: int, directory: str) -> dict:
    from spark_ckpt.eventlog.events import Event, EventType
    from spark_ckpt.eventlog.reader import read_table
    from spark_ckpt.eventlog.replay import replay_table
    from spark_ckpt.eventlog.writer import EventLogWriter
    from spark_ckpt.storage import Storage

    storage = Storage(directory)
    path = storage.path("events")
    writer = EventLogWriter(storage, path, job_id="replay", job_attempt=1,
                            flush_interval_ms=3_600_000, flush_max_events=1_000_000)
    writer.start()
    t0 = time.perf_counter()
    batch = 2000
    for start in range(0, events, batch):
        for i in range(start, min(events, start + batch)):
            vertex, partition = f"v{i // 1000}", i % 1000
            writer.append(Event(
                EventType.EXECUTION_VERTEX_FINISHED,
                {"outputs": [{"kind": "result", "target": "next", "size": 123456, "rows": 1000,
                              "path": f"/w/replay/results/{vertex}/p-{partition:05d}.parquet",
                              "groups": {str(s): [s, 1, 20] for s in range(8)},
                              "partition_values": {}}],
                 "coordinator_state": {"checkpoint_id": -1}, "io": {"output_rows": 1000}},
                vertex_id=vertex, partition=partition, attempt_id=f"a1-{vertex}-{partition}",
                rows=1000, bytes=123456, duration_ms=42,
            ))
        writer.flush()  # one Delta commit per 2,000 events, as a busy job would make
    writer.close()
    write_s = time.perf_counter() - t0
    timings, parse = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        table, _version, _problems = read_table(storage, path)
        history = replay_table(table)
        timings.append(time.perf_counter() - t0)
        assert len(history.finished) == events
        t0 = time.perf_counter()  # what recovery adds next: every finished partition's files
        files = sum(len(f.outputs) for f in history.finished.values())
        parse.append(time.perf_counter() - t0)
        assert files == events
    return {"events": events, "commits": writer.commits, "write_seconds": write_s,
            "replay_seconds": timings, "file_lists_seconds": parse}


# -- orchestration -----------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=["plain", "ckpt"])
    parser.add_argument("--input")
    parser.add_argument("--output")
    parser.add_argument("--work-dir")
    parser.add_argument("--orders", type=int, default=5_000_000)
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--parallelism", type=int, default=50)
    parser.add_argument("--agg-parallelism", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kill-at", type=float, default=0.7)
    parser.add_argument("--replay-events", type=int, default=100_000)
    parser.add_argument("--skip", default="", help="comma list of: overhead,recovery,replay")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.input, args.output, args.work_dir, args.parallelism,
              args.agg_parallelism)
        return

    import orders_data

    skip = set(filter(None, args.skip.split(",")))
    base = Path(tempfile.mkdtemp(prefix="spark-ckpt-bench-"))
    args.input = str(base / "input")
    t0 = time.perf_counter()
    orders_data.generate(args.input, orders=args.orders, files=args.files, customers=50_000)
    figures: dict = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "orders": args.orders, "files": args.files, "parallelism": args.parallelism,
        "agg_parallelism": args.agg_parallelism, "reps": args.reps,
        "input_generation_seconds": time.perf_counter() - t0,
    }
    print(f"input: {args.orders:,} orders in {args.files} files under {args.input}", flush=True)

    def fresh(name: str) -> tuple[str, str]:
        out, work = base / f"out-{name}", base / f"work-{name}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        return str(out), str(work)

    full_ckpt: list[float] = []
    if "overhead" not in skip:
        plain, ckpt = [], []
        for rep in range(args.reps):  # alternate so drift hits both alike
            plain.append(run_child("plain", args, *fresh("plain"))["seconds"])
            ckpt.append(run_child("ckpt", args, *fresh("ckpt"))["seconds"])
            print(f"rep {rep + 1}: plain {plain[-1]:.1f} s, spark_ckpt {ckpt[-1]:.1f} s",
                  flush=True)
        full_ckpt = ckpt
        figures["overhead"] = {"plain_seconds": plain, "ckpt_seconds": ckpt,
                               "ratio_of_medians":
                                   statistics.median(ckpt) / statistics.median(plain)}
        print(f"overhead: spark_ckpt / plain = {figures['overhead']['ratio_of_medians']:.3f}")

    if "recovery" not in skip:
        if not full_ckpt:
            full_ckpt = [run_child("ckpt", args, *fresh("ckpt"))["seconds"]]
        full = statistics.median(full_ckpt)
        runs = []
        for rep in range(max(1, args.reps - 1)):
            out, work = fresh("recovery")
            killed = kill_at(args, out, work, args.kill_at * full)
            scratch = run_child("ckpt", args, *fresh("scratch"))["seconds"]
            recovered = run_child("ckpt", args, out, work)
            runs.append({**killed, "recovered_seconds": recovered["seconds"],
                         "reran": recovered["ran"], "reused": recovered["reused"],
                         "scratch_seconds": scratch,
                         "ratio": recovered["seconds"] / scratch})
            print(f"recovery rep {rep + 1}: killed at {args.kill_at:.0%} of {full:.1f} s with "
                  f"{killed['durable_partitions']} partitions durable; recovered in "
                  f"{recovered['seconds']:.1f} s (ran {recovered['ran']}, reused "
                  f"{recovered['reused']}) vs from scratch {scratch:.1f} s: "
                  f"{runs[-1]['ratio']:.2f}x", flush=True)
        figures["recovery"] = {"kill_after_seconds": args.kill_at * full, "runs": runs,
                               "median_ratio": statistics.median(r["ratio"] for r in runs)}

    if "replay" not in skip:
        figures["replay"] = bench_replay(args.replay_events, str(base / "replay"))
        print(f"replay of {args.replay_events:,} events in {figures['replay']['commits']} "
              f"commits: {', '.join(f'{s:.2f} s' for s in figures['replay']['replay_seconds'])}")

    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
