"""Checkpoints and commits on S3 against local disk, and against Structured Streaming's
checkpoint on the same S3 server.

    python scripts/bench_s3.py [--reps 3] [--batches 10] [--rows-per-batch 20000]
        [--keys 10000] [--json out.json]

The S3 server is the tests' (moto on loopback, tests/s3_server.py); Spark reaches it through
Hadoop's S3A connector, spark_ckpt through pyarrow, botocore and delta-rs, all configured from
the same ``spark.hadoop.fs.s3a.*`` keys. Four arms, each its own driver process, the order
rotated between repetitions:

- ``ckpt-local`` / ``ckpt-s3``: spark_ckpt, a keyed count/sum of ``--rows-per-batch`` rows per
  batch over ``--keys`` keys (the generator source), a checkpoint after every batch (state
  files, metadata, the two-phase Delta sink's commit), checkpoint and table on local disk /
  on S3;
- ``ss-local`` / ``ss-s3``: Structured Streaming, the same aggregation of the same number of
  rows per batch (``rate-micro-batch``, ``key = value % keys``), Spark's default (HDFS-backed)
  state store (``_arm_ss`` says why not RocksDB), update mode,
  ``foreachBatch`` appending to Parquet; checkpoint and output on local disk / on S3.

Each arm reports the time from its first batch's start to the end of its last (the session's
start is not counted), and the time per batch; and its output is checked: the final count of
every key adds up to the rows the arm read. Printed: per arm the raw figures and median, and
the ratios S3 / local of each system and spark_ckpt on S3 / Structured Streaming on S3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
ARMS = ("ckpt-local", "ckpt-s3", "ss-local", "ss-s3")


def _arm_ckpt(spark, base: str, args: argparse.Namespace) -> dict[str, float]:
    from spark_ckpt import StreamingContext
    from spark_ckpt.options import Settings
    from spark_ckpt.state import count, sum_

    settings = Settings.from_conf(spark.conf, checkpoint_interval_ms=1, state_parallelism=2,
                                  progress="never")
    ctx = StreamingContext(spark, 0.001, f"{base}/ckpt", "bench-s3", settings=settings)
    total = args.batches * args.rows_per_batch
    ids = ctx.generator_stream("ids", rows_per_batch=args.rows_per_batch, total_rows=total,
                               keys=args.keys)
    ids.key_by("key").agg(name="totals", n=count(), total=sum_("value")) \
        .write_delta(f"{base}/totals", name="totals", merge_keys=["key"])
    checkpoints: list[float] = []

    from spark_ckpt import StreamingListener

    class Timings(StreamingListener):
        def on_checkpoint(self, stats):
            if stats.get("status") == "completed" and stats.get("duration_ms") is not None:
                checkpoints.append(float(stats["duration_ms"]))

    ctx.add_listener(Timings())
    start = time.perf_counter()
    progress = ctx.process_available()
    elapsed = time.perf_counter() - start
    from deltalake import DeltaTable

    from spark_ckpt.storage import delta_options

    uri = f"{base}/totals"
    totals = DeltaTable(uri, storage_options=delta_options(uri)).to_pyarrow_table().to_pandas()
    return {"seconds": elapsed, "batches": len(progress),
            "checkpoints": len(checkpoints),
            "checkpoint_ms_median": statistics.median(checkpoints) if checkpoints else -1,
            # every input row counted once: the final totals' counts add up to the input
            "rows": sum(p["num_input_rows"] or 0 for p in progress),
            "counted": int(totals.n.sum()), "keys": len(totals)}


def _arm_ss(spark, base: str, args: argparse.Namespace) -> dict[str, float]:
    from pyspark.sql import functions as F

    # Spark's default state store (HDFS-backed: state in memory, a delta file per partition
    # and batch), as spark_ckpt's memory backend here. Not RocksDB: its SST files over 1 MB
    # are uploaded by S3A's asynchronous AWS SDK client with ``Expect: 100-continue``, and
    # moto's server answers those with a 100 the client takes as the final status (the
    # query fails: "S3Exception: Status Code: 100"); real S3 does not.
    source = (spark.readStream.format("rate-micro-batch")
              .option("rowsPerBatch", args.rows_per_batch).option("numPartitions", 2).load())
    agg = (source.withColumn("key", F.col("value") % args.keys)
           .groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total")))

    def write(df, _batch_id):
        df.write.mode("append").parquet(f"{base}/totals")

    query = (agg.writeStream.outputMode("update").foreachBatch(write)
             .option("checkpointLocation", f"{base}/ckpt").trigger(processingTime="0 seconds")
             .start())
    start = time.perf_counter()
    while True:
        done = [p for p in query.recentProgress if p["numInputRows"] > 0]
        if len(done) >= args.batches:
            break
        if query.exception() is not None:
            raise RuntimeError(f"Structured Streaming failed: {query.exception()}")
        time.sleep(0.05)
    elapsed = time.perf_counter() - start
    query.stop()
    ran = [p for p in query.recentProgress if p["numInputRows"] > 0]
    # update mode appends each batch's changed keys with their running counts: a key's
    # largest count is its final one
    final = spark.read.parquet(f"{base}/totals").groupBy("key").agg(F.max("n").alias("n"))
    counted = final.agg(F.sum("n"), F.count("*")).first()
    return {"seconds": elapsed, "batches": len(done), "checkpoints": len(done),
            "checkpoint_ms_median": statistics.median(
                p["durationMs"].get("commitOffsets", 0) + p["durationMs"].get("walCommit", 0)
                for p in done),
            "rows": sum(p["numInputRows"] for p in ran), "counted": int(counted[0]),
            "keys": int(counted[1])}


def run_arm(arm: str, base: str, args: argparse.Namespace) -> None:
    """In the arm's own driver process: print one JSON line with its figures."""
    from spark_ckpt import get_or_create_session

    spark = get_or_create_session(f"bench-s3-{arm}")
    figures = (_arm_ckpt if arm.startswith("ckpt") else _arm_ss)(spark, base, args)
    figures["per_batch_s"] = figures["seconds"] / max(1, figures["batches"])
    print("FIGURES " + json.dumps({"arm": arm, **figures}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--rows-per-batch", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        run_arm(args.arm, args.base, args)
        return

    import s3_server

    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with s3_server.running(work / "server.log") as server:
        # the repository's defaults (not the tests' JVM options) plus S3A
        defaults = s3_server.defaults_file(server, work / "defaults.conf",
                                           base=(ROOT / "spark-defaults.conf").read_text())
        env = dict(os.environ, SPARK_CKPT_DEFAULTS=str(defaults), PYSPARK_PYTHON=sys.executable,
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for rep in range(args.reps):
            order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]  # rotated each repetition
            for arm in order:
                base = (server.uri(f"{arm}-{rep}") if arm.endswith("s3")
                        else str(work / f"{arm}-{rep}"))
                command = [sys.executable, __file__, "--arm", arm, "--base", base,
                           "--batches", str(args.batches),
                           "--rows-per-batch", str(args.rows_per_batch), "--keys", str(args.keys)]
                run = subprocess.run(command, env=env, capture_output=True, text=True,
                                     timeout=3600, cwd=ROOT)
                line = next((x for x in run.stdout.splitlines() if x.startswith("FIGURES ")),
                            None)
                if run.returncode != 0 or line is None:
                    raise SystemExit(f"{arm} failed ({run.returncode}): "
                                     f"{(run.stdout + run.stderr)[-4000:]}")
                figures = json.loads(line.removeprefix("FIGURES "))
                # spark_ckpt's generator stops at its total; SS's source may run a batch more
                # before the query stops, never less, never a part of one
                want = args.batches * args.rows_per_batch
                if figures["counted"] != figures["rows"] or figures["keys"] != args.keys or \
                        (figures["rows"] != want if arm.startswith("ckpt") else
                         figures["rows"] < want or figures["rows"] % args.rows_per_batch):
                    raise SystemExit(f"{arm}: its output does not count every input row once:"
                                     f" {figures}")
                results[arm].append(figures)
                print(f"rep {rep} {arm}: {figures['seconds']:.2f} s, {figures['batches']} "
                      f"batches, checkpoint median {figures['checkpoint_ms_median']:.0f} ms",
                      flush=True)

    def median(arm: str) -> float:
        return statistics.median(r["seconds"] for r in results[arm])

    ratios = {"ckpt s3/local": median("ckpt-s3") / median("ckpt-local"),
              "ss s3/local": median("ss-s3") / median("ss-local"),
              "ckpt-s3/ss-s3": median("ckpt-s3") / median("ss-s3"),
              "ckpt-local/ss-local": median("ckpt-local") / median("ss-local")}
    print("\nmedians: " + ", ".join(f"{a} {median(a):.2f} s" for a in ARMS))
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results,
                                               "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
