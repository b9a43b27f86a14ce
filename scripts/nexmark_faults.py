"""Nexmark under faults (issue 35): a stateful query's driver SIGKILLed ``--kills`` times at
random points of its run, and restarted each time; then, for the queries named by
``--rescale``, a run in three parts: on 2 tasks, on 4, and a restore of an early checkpoint by
its id on 4 that replays the rest. Every run's output must equal batch Spark SQL's reference
over all events, each row exactly once.

    python scripts/nexmark_faults.py --events 10000000 --queries q5,q7,q8,q11 \\
        --kills 10 --rescale q5,q7,q8,q11 --json benchmarks/results/nexmark-faults.json

The pipeline is the benchmark's (scripts/bench_nexmark.py: the generator's files,
``--files-per-batch`` a batch, the query of scripts/nexmark_queries.py), its output through the
two-phase Delta sink (``write_delta``; an update stream's rows merged by its keys), with a
checkpoint every ``--checkpoint-ms``. A kill: once the attempt has completed a checkpoint of
its own, a random 0-4 s later (``--seed``), the driver's whole process group (its JVM and
Python workers with it) gets SIGKILL; the run is started again on the same directory until one
attempt ends by itself. So every kill lands mid-batch, mid-checkpoint or mid-commit, wherever
the clock puts it, and every attempt moves the pipeline on by at least one checkpoint.

Not a test (a 10,000,000-event run takes minutes); its results go to docs/benchmarks.md and
benchmarks/results/. tests/test_nexmark.py and the kill tests of tests/test_windows.py and
tests/test_stream_joins.py are its small forms in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_nexmark  # noqa: E402
import nexmark_gen  # noqa: E402
import nexmark_queries  # noqa: E402


# -- the child: one attempt of the pipeline -------------------------------------------------
def child(args: argparse.Namespace) -> None:
    from spark_ckpt import Settings, StreamingContext, StreamingListener

    class Marks(StreamingListener):
        def on_batch_completed(self, progress: dict[str, Any]) -> None:
            print(f"BATCH {progress.get('batch_id', progress.get('batch'))}", flush=True)
            if args.query == "q12":  # processing time: which files each batch read, when
                times = nexmark_queries.batch_files(ctx, [progress])
                print(f"FILES {json.dumps(times)}", flush=True)

        def on_checkpoint(self, stats: dict[str, Any]) -> None:
            if stats.get("status") == "completed":
                print(f"CHECKPOINT {stats.get('checkpoint_id')}", flush=True)

    spark = bench_nexmark.session(f"nexmark-faults-{args.query}")
    ctx = StreamingContext(spark, 0.1, f"{args.work}/ckpt", f"nexmark-{args.query}",
                           settings=Settings(progress="never", state_parallelism=args.parallelism,
                                             checkpoint_interval_ms=args.checkpoint_ms,
                                             checkpoint_retained=1000))
    ctx.add_listener(Marks())
    events = ctx.file_stream("events", args.source, "parquet", nexmark_gen.SPARK_SCHEMA,
                             max_files_per_batch=args.files_per_batch) \
        .with_watermark("dateTime", nexmark_queries.WATERMARK_DELAY)
    query = nexmark_queries.QUERIES[args.query][0](events)
    query.write_delta(f"{args.work}/out", name=args.query,
                      merge_keys=bench_nexmark.upsert_keys(args.query))
    print("STARTED", flush=True)
    restore = None if args.restore is None else int(args.restore)
    progress = ctx.process_available(timeout=7200, restore_checkpoint=restore)
    done = [c["checkpoint_id"] for c in ctx.recent_checkpoints if c["status"] == "completed"]
    print("RESULT " + json.dumps({"batches": len(progress), "checkpoints": done}), flush=True)


# -- the parent -----------------------------------------------------------------------------
def attempt(args: argparse.Namespace, query: str, work: Path, source: Path, parallelism: int,
            kill_after: float | None, restore: int | None = None) -> dict:
    """One driver: killed ``kill_after`` seconds after its first checkpoint (None: left to
    end). Returns how it ended and the checkpoints it completed."""
    cmd = [sys.executable, __file__, "--child", "--query", query, "--work", str(work),
           "--source", str(source), "--files-per-batch", str(args.files_per_batch),
           "--parallelism", str(parallelism), "--checkpoint-ms", str(args.checkpoint_ms)]
    if restore is not None:
        cmd += ["--restore", str(restore)]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYSPARK_SUBMIT_ARGS=f"--driver-memory {args.driver_memory} pyspark-shell",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    log = open(work.parent / f"{work.name}.log", "a")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                            cwd=ROOT, start_new_session=True)
    checkpoints: list[int] = []
    file_times: dict[str, int] = {}
    batches = 0
    killed = threading.Event()
    reaped = threading.Lock()  # held by the kill, and taken before the child is reaped: a
    # kill never reaches a process group that is no longer the child's
    result: dict[str, Any] = {}
    timer: threading.Timer | None = None

    def kill() -> None:
        with reaped:
            if proc.poll() is None:
                killed.set()
                os.killpg(proc.pid, signal.SIGKILL)

    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        if line.startswith("CHECKPOINT "):
            checkpoints.append(int(line.split()[1]))
            if kill_after is not None and len(checkpoints) == 1:
                timer = threading.Timer(kill_after, kill)
                timer.daemon = True
                timer.start()
        elif line.startswith("BATCH "):
            batches += 1
        elif line.startswith("FILES "):
            file_times.update(json.loads(line[6:]))
        elif line.startswith("RESULT "):
            result = json.loads(line[7:])
    if timer is not None:
        timer.cancel()
    with reaped:
        code = proc.wait()
    log.close()
    # a kill counts when it ended the run before the run's end (no RESULT printed)
    return {"code": code, "killed": killed.is_set() and code == -signal.SIGKILL and not result,
            "seconds": time.perf_counter() - t0, "batches_seen": batches,
            "checkpoints": result.get("checkpoints", checkpoints),
            **({"file_times": file_times} if file_times else {})}


def check(spark: Any, query: str, work: Path, expected: Any) -> dict:
    """The Delta output against the reference: every row once (a duplicate or a missing row
    fails the frame comparison)."""
    import pandas as pd
    from deltalake import DeltaTable

    if len(expected) == 0:
        raise SystemExit("the reference has no rows: too few events for this query's windows")
    try:
        got = DeltaTable(str(work / "out")).to_pandas()[list(expected.columns)]
    except Exception as exc:  # noqa: BLE001 - no table, or not the query's: a failed check
        return {"equal": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    a, b = nexmark_queries.normal(got, 6), nexmark_queries.normal(expected, 6)
    try:
        pd.testing.assert_frame_equal(a, b, check_dtype=False)
        return {"equal": True, "rows": len(a)}
    except AssertionError:
        merged = a.merge(b, how="outer", indicator=True)
        return {"equal": False, "rows": len(a), "expected_rows": len(b),
                "duplicated": int(a.duplicated().sum()),
                "sample": [str(merged[merged["_merge"] == side].head(2).to_dict("records"))
                           for side in ("left_only", "right_only")],
                "missing": int((merged["_merge"] == "right_only").sum()),
                "extra": int((merged["_merge"] == "left_only").sum())}


def killed_run(args: argparse.Namespace, query: str, events: Path, rng: random.Random) -> dict:
    work = args.work / "runs" / f"{query}-kills"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    attempts: list[dict[str, Any]] = []
    file_times: dict[str, int] = {}
    while True:
        kill_after = rng.uniform(0, 4) if len([a for a in attempts if a["killed"]]) < args.kills \
            else None
        one = attempt(args, query, work, events, 2, kill_after)
        for name, at in one.pop("file_times", {}).items():  # a replay stamps its batch alike
            if file_times.setdefault(name, at) != at:
                return {"failed": f"file {name} read at {file_times[name]} and at {at}",
                        "attempts": attempts}
        attempts.append({**one, "kill_after_s": kill_after})
        print(f"{query} attempt {len(attempts)}: {json.dumps(attempts[-1])}", flush=True)
        if not one["killed"]:
            if one["code"] != 0:
                return {"failed": f"exit {one['code']}", "attempts": attempts}
            break
        if len(attempts) > 3 * args.kills + 5:
            return {"failed": "no end after many attempts", "attempts": attempts}
    kills = sum(a["killed"] for a in attempts)
    return {"attempts": attempts, "kills": kills, "kills_short": kills < args.kills,
            "seconds": sum(a["seconds"] for a in attempts), "work": work,
            **({"file_times": file_times} if file_times else {})}


def rescaled_run(args: argparse.Namespace, query: str, events: Path) -> dict:
    """A third of the files on 2 tasks, the next third on 4 (the state of 2 ranges split
    into 4), then the last third with a restore by id of the first part's earliest checkpoint
    on 4 (the second part's output and checkpoints undone, every batch since replayed on 4):
    the output as if uninterrupted. The second part's own output is not checked apart."""
    work = args.work / "runs" / f"{query}-rescaled"
    shutil.rmtree(work, ignore_errors=True)
    source = work / "in"
    source.mkdir(parents=True)
    files = sorted(events.glob("*.parquet"))
    if len(files) < 3:
        raise SystemExit(f"a rescaled run takes three parts: {len(files)} files")
    thirds = [files[: len(files) // 3], files[len(files) // 3: 2 * len(files) // 3],
              files[2 * len(files) // 3:]]
    steps = []
    for part, (parallelism, restore) in enumerate([(2, None), (4, None), (4, "early")]):
        for path in thirds[part]:
            shutil.copy(path, source)
        if restore == "early":
            restore = steps[0]["checkpoints"][0]
        one = attempt(args, query, work, source, parallelism, None,
                      restore=restore if isinstance(restore, int) else None)
        steps.append({**one, "parallelism": parallelism, "restored": restore})
        print(f"{query} rescaled part {part + 1}: {json.dumps(steps[-1])}", flush=True)
        if one["code"] != 0 or not one["checkpoints"]:
            return {"failed": f"part {part + 1}: exit {one['code']}", "steps": steps}
    return {"steps": steps, "work": work}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default="10000000")
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--files-per-batch", type=int, default=10)
    parser.add_argument("--queries", default="q5,q7,q8,q11")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--rescale", default="q5,q7,q8,q11")
    parser.add_argument("--checkpoint-ms", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--work", type=Path, default=Path("/tmp/spark-ckpt-bench-nexmark"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--query")
    parser.add_argument("--source")
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--restore")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    args.events = int(args.events)
    events, _flink = bench_nexmark.prepare(args.work, args.events, args.files)

    spark = bench_nexmark.reference_session("nexmark-faults-reference")
    everything = spark.read.schema(nexmark_gen.SPARK_SCHEMA).parquet(str(events))
    final_watermark = nexmark_gen.BASE_MS + (args.events - 1) * 1000 // bench_nexmark.RATE \
        - 4_000
    rng = random.Random(args.seed)
    results: dict[str, Any] = {
        "command": " ".join(sys.argv), "machine": f"{platform.node()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "events": args.events,
        "files": args.files, "files_per_batch": args.files_per_batch,
        "checkpoint_ms": args.checkpoint_ms, "seed": args.seed, "queries": {}}
    rescale = set(args.rescale.split(",")) if args.rescale else set()
    for query in args.queries.split(","):
        _stream, reference, mode = nexmark_queries.QUERIES[query]
        expected = None if mode == "proctime" else nexmark_queries.closed(
            reference(spark, everything).toPandas(), mode, final_watermark, nexmark_gen.BASE_MS)
        outcome: dict[str, Any] = {}
        runs = [("kills", lambda q=query: killed_run(args, q, events, rng))]
        if query in rescale:
            runs.append(("rescaled", lambda q=query: rescaled_run(args, q, events)))
        for name, run in runs:
            one = run()
            work = one.pop("work", None)
            file_times = one.pop("file_times", None)
            if work is not None and mode == "proctime":  # q12: from the runs' batch times
                if not file_times:
                    raise SystemExit(f"{query}: no batch times reported")
                one["check"] = check(spark, query, work, nexmark_queries.q12_reference(
                    spark, everything, file_times, max(file_times.values())).toPandas())
            elif work is not None:
                one["check"] = check(spark, query, work, expected)
                shutil.rmtree(work, ignore_errors=True)
            outcome[name] = one
            brief = {k: v for k, v in one.items() if k not in ("attempts", "steps")}
            print(f"\n{query} {name}: {json.dumps(brief)}", flush=True)
        results["queries"][query] = outcome
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1))
    spark.stop()


if __name__ == "__main__":
    main()
