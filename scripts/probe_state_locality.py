"""Where a keyed processor's tasks find their range's state, on one executor and on two.

    python scripts/probe_state_locality.py                     # local[2] and local-cluster
    python scripts/probe_state_locality.py --keys 200000 400000 --batches 8

For each master and key count, one driver process runs a vectorized running count/sum (memory
backend, 4 key-group ranges, one generated batch of ``rows`` rows after another) and reads its
progress records: for every stateful task run after the first batch, whether it found its range
in its Python worker (process), on the executor's local disk (local: another worker of the same
executor left it), or rebuilt it from the durable chain (restored), and how long a rebuild took
for how many rows. Prints one JSON line per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[5])
from pyspark.sql import SparkSession
from spark_ckpt import Settings, StreamingContext
from bench_state import RunningVec

master, work, keys, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
spark = (SparkSession.builder.master(master).appName("probe-locality")
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
         .config("spark.executor.memory", "1g").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
ctx = StreamingContext(spark, 0.05, f"{work}/ckpt", "probe", settings=Settings(
    progress="never", checkpoint_interval_ms=10_000, state_parallelism=4,
    state_backend="memory", state_small_batch_bytes=0))
gen = ctx.generator_stream("gen", rows_per_batch=keys, total_rows=keys * batches, keys=keys,
                           partitions=4)
gen.key_by("key").process(RunningVec(), "key BIGINT, n BIGINT, total DOUBLE", name="run") \
    .write_parquet(f"{work}/out", name="out")
t0 = time.perf_counter()
progress = ctx.process_available(timeout=3600)
tasks = []
for p in progress:
    op = p["state"]["run"]
    for pid, t in op["tasks"].items():
        tasks.append({"batch": p["batch_id"], "pid": int(pid), **t})
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "tasks": tasks,
                              "state_rows": progress[-1]["state"]["run"]["state_rows"]}))
"""


def run(master: str, keys: int, batches: int) -> dict:
    work = tempfile.mkdtemp(prefix="probe-locality-")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHILD, master, work, str(keys), str(batches),
                           str(ROOT / "scripts")], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=3600)
    line = next((li for li in proc.stdout.splitlines() if li.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{master} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(line[7:])
    later = [t for t in result["tasks"] if t["batch"] > 0]
    where: dict[str, int] = {}
    for t in later:
        kind = t.get("cache") or ("restored" if t.get("restored") else "new")
        where[kind] = where.get(kind, 0) + 1
    moved = sum(1 for t in later if t.get("cache") != "process")
    return {"master": master, "keys": keys, "batches": batches,
            "seconds": round(result["seconds"], 1), "task_runs_after_first": len(later),
            "found": where,
            "found_without_durable_read": round(
                sum(v for k, v in where.items() if k in ("process", "local")) / len(later), 3)
            if later else None,
            "runs_not_in_their_worker": moved,
            "executors": sorted({t["executor"] for t in result["tasks"]}),
            # a rebuild from the durable chain: (rows of the range after the batch, ms)
            "restores": [(t.get("rows"), t.get("restore_ms")) for t in later
                         if t.get("restored")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[100_000, 400_000])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--masters", nargs="+", default=["local[2]", "local-cluster[2,1,1024]"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for master in args.masters:
        for keys in args.keys:
            t0 = time.perf_counter()
            r = run(master, keys, args.batches)
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
            "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
