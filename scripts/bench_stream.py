"""Benchmark the streaming runtime against Spark Structured Streaming, same input, same run.

    python scripts/bench_stream.py --files 40 --rows-per-file 100000 --reps 3

Pipeline (both systems): Parquet order files -> keep amount > 0 -> project -> broadcast join
with customers -> append to a Parquet directory. Each measurement is a separate driver process
(local[2], the repository's spark-defaults.conf), alternating systems:

1. throughput at saturation: the whole backlog (``--files`` files, ``--files-per-batch`` per
   batch) processed available-now; input rows per second over the query's wall time;
2. per-batch fixed overhead: the query runs on a 0.5 s trigger while one 10-row file is dropped
   at a time; the median duration of such a batch (spark_ckpt: total incl. allocation and
   commit; Structured Streaming: triggerExecution). spark_ckpt also runs truly empty batches
   (Structured Streaming skips them), reported on their own.

Prints raw figures and ratios and writes them as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))

TINY_BATCHES = 12
WARMUP = 2


def pipeline(df, customers):  # the same DataFrame code for both
    from pyspark.sql import functions as F

    return (df.where(F.col("amount") > 0)
            .select("order_id", "customer_id", "order_ts", "amount", "quantity")
            .join(F.broadcast(customers), "customer_id")
            .withColumn("line_total", F.col("amount") * F.col("quantity")))


# -- child drivers -----------------------------------------------------------------------------
def child(mode: str, args: argparse.Namespace) -> None:
    import logging

    import orders_data

    from spark_ckpt import Settings, StreamingContext, get_or_create_session

    logging.basicConfig(level=logging.WARNING)
    spark = get_or_create_session(f"bench-{mode}")
    spark.sparkContext.setLogLevel("ERROR")
    work = Path(args.work)
    customers = spark.read.parquet(args.customers).select("customer_id", "region", "segment")
    schema = orders_data.ORDER_EVENT_SCHEMA
    system, kind = mode.split("-")
    landing = args.landing if kind == "throughput" else str(work / "tiny")
    result: dict = {}
    os.makedirs(landing, exist_ok=True)
    if system == "ss":
        reader = spark.readStream.schema(schema)
        if kind == "throughput":
            reader = reader.option("maxFilesPerTrigger", args.files_per_batch)
        stream = pipeline(reader.parquet(landing), customers)
        writer = (stream.writeStream.format("parquet").option("path", str(work / "out"))
                  .option("checkpointLocation", str(work / "ckpt")))
        if kind == "throughput":
            t0 = time.perf_counter()
            query = writer.trigger(availableNow=True).start()
            query.awaitTermination()
            seconds = time.perf_counter() - t0
            rows = sum(p["numInputRows"] for p in query.recentProgress)
            result = {"seconds": seconds, "rows": rows, "batches": len(query.recentProgress)}
        else:
            query = writer.trigger(processingTime="500 milliseconds").start()
            durations = []
            for i in range(TINY_BATCHES):
                before = query.lastProgress["batchId"] if query.lastProgress else -1
                orders_data.drop_order_files(landing, files=1, first_file=i, rows_per_file=10,
                                             fmt="parquet")
                while True:
                    p = query.lastProgress
                    if p and p["batchId"] > before and p["numInputRows"] > 0:
                        durations.append(p["durationMs"]["triggerExecution"])
                        break
                    time.sleep(0.02)
            query.stop()
            result = {"tiny_batch_ms": durations[WARMUP:]}
    else:
        settings = Settings.from_conf(spark.conf, progress="never",
                                      stream_skip_empty_batches=False)
        ctx = StreamingContext(spark, 0.5, str(work / "ckpt"), "bench", settings=settings)
        source = ctx.file_stream("orders", landing, "parquet", schema=schema,
                                 max_files_per_batch=(args.files_per_batch
                                                      if kind == "throughput" else None))
        source.transform(lambda df: pipeline(df, customers), name="enrich") \
            .write_parquet(str(work / "out"), name="out")
        if kind == "throughput":
            t0 = time.perf_counter()
            progress = ctx.process_available()
            seconds = time.perf_counter() - t0
            result = {"seconds": seconds, "rows": sum(p["num_input_rows"] for p in progress),
                      "batches": len(progress)}
        else:
            ctx.start()
            durations = []
            for i in range(TINY_BATCHES):
                seen = len(ctx.recent_progress)
                orders_data.drop_order_files(landing, files=1, first_file=i, rows_per_file=10,
                                             fmt="parquet")
                while True:
                    new = [p for p in ctx.recent_progress[seen:] if p["num_input_rows"]]
                    if new:
                        durations.append(new[0]["durations_ms"]["total"] +
                                         new[0]["durations_ms"]["allocation"])
                        break
                    time.sleep(0.02)
            time.sleep(3.0)  # a few truly empty batches
            ctx.stop()
            empty = [p["durations_ms"]["total"] + p["durations_ms"]["allocation"]
                     for p in ctx.recent_progress if p["num_input_rows"] == 0]
            result = {"tiny_batch_ms": durations[WARMUP:], "empty_batch_ms": empty[WARMUP:]}
    print("RESULT " + json.dumps(result), flush=True)


def run_child(mode: str, args: argparse.Namespace, work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
               SPARK_CKPT_DEFAULTS=str(ROOT / "spark-defaults.conf"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--child", mode, "--work", str(work), "--landing",
           args.landing, "--customers", args.customers, "--files-per-batch",
           str(args.files_per_batch)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = next(li for li in proc.stdout.splitlines() if li.startswith("RESULT "))
    return json.loads(line[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child")
    parser.add_argument("--work")
    parser.add_argument("--landing")
    parser.add_argument("--customers")
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--rows-per-file", type=int, default=100_000)
    parser.add_argument("--files-per-batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child:
        child(args.child, args)
        return

    import orders_data

    base = Path(tempfile.mkdtemp(prefix="spark-ckpt-bench-stream-"))
    args.landing = str(base / "landing")
    orders_data.generate(str(base / "static"), orders=100, files=1, customers=50_000)
    args.customers = str(base / "static" / "customers")
    orders_data.drop_order_files(args.landing, files=args.files, rows_per_file=args.rows_per_file,
                                 customers=50_000, fmt="parquet")
    figures: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "files": args.files, "rows_per_file": args.rows_per_file,
        "files_per_batch": args.files_per_batch, "reps": args.reps,
        "runs": {"ss-throughput": [], "ckpt-throughput": [], "ss-overhead": [],
                 "ckpt-overhead": []},
    }
    for rep in range(args.reps):
        order = ["ss", "ckpt"] if rep % 2 == 0 else ["ckpt", "ss"]
        for kind in ("throughput", "overhead"):
            for system in order:
                mode = f"{system}-{kind}"
                result = run_child(mode, args, base / "work" / mode)
                figures["runs"][mode].append(result)
                print(f"rep {rep + 1} {mode}: {json.dumps(result)}", flush=True)

    def rate(r: dict) -> float:
        return r["rows"] / r["seconds"]

    ss_rates = [rate(r) for r in figures["runs"]["ss-throughput"]]
    ck_rates = [rate(r) for r in figures["runs"]["ckpt-throughput"]]
    ss_tiny = [statistics.median(r["tiny_batch_ms"]) for r in figures["runs"]["ss-overhead"]]
    ck_tiny = [statistics.median(r["tiny_batch_ms"]) for r in figures["runs"]["ckpt-overhead"]]
    ck_empty = [statistics.median(r["empty_batch_ms"]) for r in figures["runs"]["ckpt-overhead"]
                if r["empty_batch_ms"]]
    summary = {
        "ss_rows_per_s": ss_rates, "ckpt_rows_per_s": ck_rates,
        "throughput_ratio_median": statistics.median(ck_rates) / statistics.median(ss_rates),
        "ss_tiny_batch_ms_median": ss_tiny, "ckpt_tiny_batch_ms_median": ck_tiny,
        "ckpt_empty_batch_ms_median": ck_empty,
        "overhead_ratio_median": statistics.median(ck_tiny) / statistics.median(ss_tiny),
    }
    figures["summary"] = summary
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
