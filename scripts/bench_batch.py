"""Benchmark batch recovery against plain Spark, on one machine, in one invocation.

    python scripts/bench_batch.py --orders 5000000 --files 50 --reps 3

Measures, each as separate driver processes on the same generated input:

1. overhead: the example orders job (jobs/orders_report.py, 50 partitions per vertex) run with
   spark_ckpt, every vertex durable and only the sink vertices durable, versus the same
   DataFrame pipeline in plain Spark writing the same outputs (settled rows to Parquet, the
   daily report to a Delta table via delta-rs); the outputs of both sides are compared;
2. recovery: spark_ckpt runs SIGKILLed at 30%, 60%, 70% and 85% of a full run's job time, then
   resubmitted; recovered-run time versus a from-scratch run, and (killed + recovered) / fresh;
3. partial re-run: 10% of the partitions of ``settled`` lost after every vertex finished; the
   re-run's time in ``settled`` versus the whole vertex in a full run (each repetition a full
   run, then the re-run from the same crashed state; medians);
4. replay: reading and replaying an event log of 100,000 ExecutionVertexFinished events, plus
   the file checks recovery does next.

Prints raw figures and ratios, and writes them as JSON (``--json``).

    python scripts/bench_batch.py --shapes report,join,rollup,cleanup --reps 2 --json F

measures instead the job shapes of ``jobs/batch_shapes.py`` (the four above and
sorted_report, ranked, two_aggregations: (e)-(g)) (each sized with
``--rows-<shape>`` so plain Spark runs for minutes): per shape, plain Spark, spark_ckpt with its
default cuts and with every vertex durable (``spark.ckpt.batch.cuts=all``), alternating, each
a driver process timed from its start to its exit; outputs checked equal to plain Spark's;
then SIGKILLs at fractions of a default run and resubmissions, each recovered run timed
against the fresh one, with the durable share of the work at the kill (the reused partitions
of each vertex weighted by the vertex's time in a clean run) and the recovered output checked
too. Figures are appended to the JSON file as each shape finishes.
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

from spark_ckpt.storage.delta_reader import read_delta

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))


# -- child drivers -----------------------------------------------------------------------------
def child(mode: str, input_dir: str, output: str, work_dir: str, parallelism: int,
          agg_parallelism: int, sinks_only: bool = False, server_cache: bool = False) -> None:
    import logging

    from spark_ckpt import Settings, get_or_create_session

    logging.basicConfig(level=logging.WARNING)
    spark = get_or_create_session(f"bench-{mode}")
    _quiet(spark)
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
        # On Spark Connect the cache is the server's, shared by its clients and kept after
        # this one exits: left cached, the next plain run would read these rows from it
        settled.unpersist(blocking=True)
        info = {}
    else:
        import orders_report as report

        settings = Settings.from_conf(spark.conf, progress="never",
                                      batch_cleanup_on_success=False,
                                      batch_server_cache=server_cache)
        job = report.build_job("bench", input_dir, output, parallelism=parallelism,
                               agg_parallelism=agg_parallelism, work_dir=work_dir, spark=spark,
                               settings=settings, sinks_only=sinks_only)
        result = job.run()
        info = {"ran": result.ran, "reused": result.reused, "adopted": result.adopted,
                "reused_in_waves": result.reused_in_waves,
                "job_durable_share": result.durable_share, "summary": result.summary(),
                "attempt": result.attempt,
                "vertex_seconds": {v: s.seconds for v, s in result.vertices.items()},
                "vertex_ran": {v: s.ran for v, s in result.vertices.items()}}
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, **info}), flush=True)


def _quiet(spark) -> None:
    """Spark's own log at ERROR (a Spark Connect client has no driver log of its own)."""
    from spark_ckpt.sparkapi import is_connect

    if not is_connect(spark):
        spark.sparkContext.setLogLevel("ERROR")


DEFAULTS = ROOT / "spark-defaults.conf"  # --event-logs: a copy beside the JSON with them on


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYSPARK_PYTHON"] = sys.executable
    env["SPARK_CKPT_DEFAULTS"] = str(DEFAULTS)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _cmd(mode: str, args: argparse.Namespace, output: str, work_dir: str) -> list[str]:
    sinks_only = mode == "sinks"
    return [sys.executable, __file__, "--child", "ckpt" if sinks_only else mode,
            "--input", args.input, "--output", output,
            "--work-dir", work_dir, "--parallelism", str(args.parallelism),
            "--agg-parallelism", str(args.agg_parallelism)] + (["--sinks-only"] * sinks_only) \
        + (["--server-cache"] * bool(getattr(args, "server_cache", False)))


def run_child(mode: str, args: argparse.Namespace, output: str, work_dir: str,
              fault: str | None = None) -> dict:
    started = time.perf_counter()
    env = _env()
    if fault:
        env["SPARK_CKPT_FAULT"] = fault
    proc = subprocess.run(_cmd(mode, args, output, work_dir), env=env, capture_output=True,
                          text=True, cwd=ROOT, start_new_session=True)
    if fault:
        return {"returncode": proc.returncode}
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

    frame = read_delta(f"{work_dir}/bench/events").to_pandas()
    return {"durable_partitions": int((frame.event_type == "ExecutionVertexFinished").sum()),
            "killed_after_seconds": after}


def outputs_equal(plain: str, ckpt: str) -> dict:
    """Both sides wrote the same settled rows and the same daily report."""
    import pyarrow.dataset as ds

    def settled(out: str):
        table = ds.dataset(f"{out}/settled", format="parquet",
                           exclude_invalid_files=True).to_table()
        return table.to_pandas().sort_values("order_id").reset_index(drop=True)

    def daily(out: str):
        frame = read_delta(f"{out}/daily").to_pandas()
        return frame.sort_values(["region", "day"]).reset_index(drop=True)

    a, b = settled(plain), settled(ckpt)
    da, db = daily(plain), daily(ckpt)
    same_settled = len(a) == len(b) and a[list(b.columns)].equals(b)
    same_daily = da[list(db.columns)].equals(db)
    if not (same_settled and same_daily):
        raise SystemExit(f"outputs differ: settled {len(a)} vs {len(b)} rows "
                         f"(equal: {same_settled}), daily equal: {same_daily}")
    return {"settled_rows": len(a), "daily_rows": len(da)}


# -- replay ------------------------------------------------------------------------------------
def bench_replay(events: int, directory: str) -> dict:
    from spark_ckpt.eventlog.events import Event, EventType
    from spark_ckpt.eventlog.reader import read_table
    from spark_ckpt.eventlog.replay import replay_table
    from spark_ckpt.eventlog.writer import EventLogWriter
    from spark_ckpt.storage import Storage, stat_any

    storage = Storage(directory)
    path = storage.path("events")
    files_dir = Path(directory) / "files"
    for v in range((events + 999) // 1000):  # a real (small) file per finished partition
        (files_dir / f"v{v}").mkdir(parents=True, exist_ok=True)
    writer = EventLogWriter(storage, path, job_id="replay", job_attempt=1,
                            flush_interval_ms=3_600_000, flush_max_events=1_000_000)
    writer.start()
    t0 = time.perf_counter()
    batch = 2000
    for start in range(0, events, batch):
        for i in range(start, min(events, start + batch)):
            vertex, partition = f"v{i // 1000}", i % 1000
            file = files_dir / vertex / f"part-{partition:05d}.parquet"
            file.write_bytes(b"x")
            writer.append(Event(
                EventType.EXECUTION_VERTEX_FINISHED,
                {"outputs": [{"kind": "result", "target": vertex, "size": 1, "rows": 1000,
                              "path": str(file), "groups": {}, "partition_values": {}}],
                 "coordinator_state": {"checkpoint_id": -1}, "io": {"output_rows": 1000}},
                vertex_id=vertex, partition=partition, attempt_id=f"a1-{vertex}-{partition}",
                rows=1000, bytes=1, duration_ms=42,
            ))
        writer.flush()  # one Delta commit per 2,000 events, as a busy job would make
    writer.close()
    write_s = time.perf_counter() - t0
    timings, checks = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        table, _version, _problems = read_table(storage, path)
        history = replay_table(table)
        timings.append(time.perf_counter() - t0)
        assert len(history.finished) == events
        t0 = time.perf_counter()  # what recovery does next: check every finished file
        paths = [o.path for f in history.finished.values() for o in f.outputs]
        sizes = stat_any(paths)
        checks.append(time.perf_counter() - t0)
        assert len(paths) == events and all(size == 1 for size in sizes)
    return {"events": events, "commits": writer.commits, "write_seconds": write_s,
            "replay_seconds": timings, "file_checks_seconds": checks,
            "total_seconds": [a + b for a, b in zip(timings, checks, strict=True)]}


# -- the seven shapes --------------------------------------------------------------------------
SHAPE_OUTPUTS = {"report": ["report"], "join": ["joined", "joined_delta"], "rollup": ["days"],
                 "cleanup": ["cleaned"], "sorted_report": ["sorted_report"],
                 "ranked": ["ranked"], "two_aggregations": ["two_aggregations"]}


def shape_child(shape: str, mode: str, input_dir: str, output: str, work_dir: str,
                parallelism: int) -> None:
    import logging

    import batch_shapes

    from spark_ckpt import BatchJob, Settings, get_or_create_session

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("spark_ckpt").setLevel(logging.INFO)  # kept beside the JSON
    spark = get_or_create_session(f"bench-{shape}-{mode}")
    _quiet(spark)
    print("STARTED", flush=True)
    t0 = time.perf_counter()
    info: dict = {}
    if mode == "plain":
        batch_shapes.plain(shape, spark, input_dir, output)
    else:
        settings = Settings.from_conf(spark.conf, progress="never",
                                      batch_cleanup_on_success=False,
                                      batch_cuts="all" if mode == "all" else "auto")
        job = batch_shapes.build(shape, BatchJob(shape, spark=spark, work_dir=work_dir,
                                                 settings=settings),
                                 input_dir, output, parallelism=parallelism)
        result = job.run()
        info = {"ran": result.ran, "reused": result.reused, "adopted": result.adopted,
                "reused_in_waves": result.reused_in_waves,
                "job_durable_share": result.durable_share, "summary": result.summary(),
                "attempt": result.attempt,
                "planning_s": result.planning_s, "recomputed": result.recomputed,
                "vertices": {v: {"partitions": s.partitions, "ran": s.ran, "reused": s.reused,
                                 "seconds": s.seconds} for v, s in result.vertices.items()}}
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, **info}), flush=True)


def _shape_cmd(shape: str, mode: str, args: argparse.Namespace, input_dir: str, output: str,
               work_dir: str) -> list[str]:
    return [sys.executable, __file__, "--shape-child", shape, "--mode", mode,
            "--input", input_dir, "--output", output, "--work-dir", work_dir,
            "--parallelism", str(args.shape_parallelism)]


def run_shape(shape: str, mode: str, args: argparse.Namespace, input_dir: str, output: str,
              work_dir: str) -> dict:
    started = time.perf_counter()
    proc = subprocess.run(_shape_cmd(shape, mode, args, input_dir, output, work_dir),
                          env=_env(), capture_output=True, text=True, cwd=ROOT,
                          start_new_session=True)
    _keep_log(args, f"{shape}-{mode}", proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{shape} {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = next(li for li in proc.stdout.splitlines() if li.startswith("RESULT "))
    return {**json.loads(line[7:]), "process_seconds": time.perf_counter() - started}


def _keep_log(args: argparse.Namespace, name: str, text: str) -> None:
    """The driver's log (spark_ckpt at INFO: its plan, what each vertex read and ran) in
    ``<json>.logs/``, numbered in run order."""
    if not args.json:
        return
    directory = Path(f"{args.json}.logs")
    directory.mkdir(exist_ok=True)
    number = len(list(directory.iterdir()))
    (directory / f"{number:03d}-{name}.log").write_text(text)


def kill_shape(shape: str, args: argparse.Namespace, input_dir: str, output: str,
               work_dir: str, after: float) -> dict:
    """Start a default-cuts driver and SIGKILL its process group ``after`` s after its start."""
    started = time.perf_counter()
    proc = subprocess.Popen(_shape_cmd(shape, "auto", args, input_dir, output, work_dir),
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=ROOT, start_new_session=True)
    try:
        proc.wait(timeout=after)
        finished = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        finished = False
    frame = read_delta(f"{work_dir}/{shape}/events").to_pandas() \
        if os.path.isdir(f"{work_dir}/{shape}/events") else None
    durable = 0 if frame is None else int((frame.event_type == "ExecutionVertexFinished").sum())
    return {"killed_after_seconds": time.perf_counter() - started,
            "finished_before_kill": finished, "durable_partitions": durable}


def shape_outputs(shape: str, plain_out: str, ckpt_out: str) -> dict:
    """Every output of the shape holds the same rows on both sides (floating-point columns to
    1e-9 relative: Spark's own double sums depend on how rows are partitioned)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.dataset as ds

    def load(root: str, name: str):
        path = f"{root}/{name}"
        if os.path.isdir(f"{path}/_delta_log"):
            return read_delta(path)
        return ds.dataset(path, format="parquet", partitioning="hive",
                          exclude_invalid_files=True).to_table()

    rows = {}
    for name in SHAPE_OUTPUTS[shape]:
        size = _dataset(f"{plain_out}/{name}").count_rows()
        if size > LARGE_OUTPUT_ROWS:  # row digests, batch by batch: tens of millions of rows
            rows[name] = _compare_digests(shape, name, f"{plain_out}/{name}",
                                          f"{ckpt_out}/{name}")
            continue
        a, b = load(plain_out, name), load(ckpt_out, name)  # small: in Arrow, sorted
        b = b.select(a.column_names).cast(a.schema)
        floats = [c for c in a.column_names if pa.types.is_floating(a.schema.field(c).type)]
        exact = [c for c in a.column_names if c not in floats]
        order = [(c, "ascending") for c in exact]
        a, b = a.sort_by(order), b.sort_by(order)
        same = a.num_rows == b.num_rows and a.select(exact).equals(b.select(exact))
        for c in floats:
            same = same and bool(np.allclose(a.column(c).to_numpy(zero_copy_only=False),
                                             b.column(c).to_numpy(zero_copy_only=False),
                                             rtol=1e-9, equal_nan=True))
        if not same:
            raise SystemExit(f"{shape}: output {name} differs from plain Spark's "
                             f"({a.num_rows} vs {b.num_rows} rows)")
        rows[name] = a.num_rows
    return rows


# Outputs larger than this are compared as sorted 64-bit digests of their rows, read batch by
# batch (sorting two 37-million-row tables in Arrow took more than the machine's 24 GiB).
LARGE_OUTPUT_ROWS = 2_000_000


def _dataset(path: str):
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

    if os.path.isdir(f"{path}/_delta_log"):
        return DeltaTable(path).to_pyarrow_dataset()
    return ds.dataset(path, format="parquet", partitioning="hive", exclude_invalid_files=True)


def _digests(dataset, schema):
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    out = []
    for batch in dataset.to_batches(columns=schema.names, batch_size=1 << 20):
        table = pa.Table.from_batches([batch]).select(schema.names).cast(schema)
        out.append(pd.util.hash_pandas_object(table.to_pandas(), index=False).to_numpy())
    return np.sort(np.concatenate(out)) if out else np.zeros(0, dtype=np.uint64)


def _compare_digests(shape: str, name: str, plain: str, ckpt: str) -> int:
    """Exact equality of two large outputs as multisets of rows (every column, floating-point
    ones bit for bit: these outputs copy values, they sum none)."""
    import numpy as np

    a_set, b_set = _dataset(plain), _dataset(ckpt)
    schema = a_set.schema
    a = _digests(a_set, schema)
    b = _digests(b_set, schema)
    if len(a) != len(b) or not np.array_equal(a, b):
        raise SystemExit(f"{shape}: output {name} differs from plain Spark's "
                         f"({len(a)} vs {len(b)} rows)")
    return len(a)


def durable_share(recovered: dict, clean: dict) -> float:
    """The share of a clean run's work that the recovered run found durable: per vertex, the
    reused fraction of its partitions times the vertex's share of the clean run's time."""
    total = sum(v["seconds"] for v in clean["vertices"].values()) or 1.0
    share = 0.0
    for vid, v in clean["vertices"].items():
        got = recovered["vertices"].get(vid)
        if got and v["partitions"]:
            share += got["reused"] / v["partitions"] * v["seconds"] / total
    return share


def bench_shapes(args: argparse.Namespace, base: Path, figures: dict) -> None:
    import batch_shapes

    median = statistics.median
    fractions = [float(f) for f in args.kill_at.split(",") if f.strip()]  # "": no kills
    figures["shapes"] = {}
    for shape in args.shapes.split(","):
        rows = getattr(args, f"rows_{shape}")
        input_dir = str(base / shape / "input")
        t0 = time.perf_counter()
        batch_shapes.generate(shape, input_dir, rows=rows, files=args.shape_files)
        out: dict = {"rows": rows, "files": args.shape_files,
                     "parallelism": args.shape_parallelism,
                     "input_bytes": sum(p.stat().st_size for p in Path(input_dir).rglob("*")
                                        if p.is_file()),
                     "generation_seconds": time.perf_counter() - t0, "reps": args.reps}
        figures["shapes"][shape] = out
        print(f"{shape}: {rows:,} rows in {args.shape_files} files "
              f"({out['input_bytes'] / 1e9:.2f} GB)", flush=True)

        def fresh(name: str, shape: str = shape) -> tuple[str, str]:
            o, w = base / shape / f"out-{name}", base / shape / f"work-{name}"
            shutil.rmtree(o, ignore_errors=True)
            shutil.rmtree(w, ignore_errors=True)
            return str(o), str(w)

        runs: dict[str, list[dict]] = {"plain": [], "auto": [], "all": []}
        for rep in range(args.reps):
            order = ["plain", "auto", "all"] if rep % 2 == 0 else ["all", "auto", "plain"]
            for mode in order:
                if mode == "all" and len(runs["all"]) >= args.all_reps:
                    continue
                o, w = fresh(mode)
                runs[mode].append(run_shape(shape, mode, args, input_dir, o, w))
            if rep == 0:
                out["outputs_checked"] = {
                    m: shape_outputs(shape, str(base / shape / "out-plain"),
                                     str(base / shape / f"out-{m}"))
                    for m in ("auto", "all") if runs[m]}
            print(f"  rep {rep + 1}: " + ", ".join(
                f"{m} {runs[m][-1]['process_seconds']:.1f} s" for m in runs if runs[m]),
                flush=True)
        wall = {m: [r["process_seconds"] for r in rs] for m, rs in runs.items()}
        out["overhead"] = {
            "process_seconds": wall,
            "job_seconds": {m: [r["seconds"] for r in rs] for m, rs in runs.items()},
            "default_cuts_ratio": median(wall["auto"]) / median(wall["plain"]),
            "every_vertex_durable_ratio": (median(wall["all"]) / median(wall["plain"])
                                           if wall["all"] else None),
            "auto_vertices": [r["vertices"] for r in runs["auto"]],
            "all_vertices": [r["vertices"] for r in runs["all"]],
            "planning_s": [r["planning_s"] for r in runs["auto"]],
        }
        print(f"  overhead: default cuts {out['overhead']['default_cuts_ratio']:.3f}x, every "
              f"vertex durable {out['overhead']['every_vertex_durable_ratio']}x plain",
              flush=True)
        _dump(args, figures)
        fresh_runs = list(wall["auto"])
        clean = runs["auto"][0]
        recoveries = []
        for fraction in fractions:
            kill_after = fraction * median(fresh_runs)
            adjacent = None
            if args.fresh_beside_kills:
                # a fresh run just before each kill: the machine's drift over a long
                # invocation lands on both sides, and every fresh run joins the median
                o, w = fresh("auto")
                adjacent = run_shape(shape, "auto", args, input_dir, o, w)
                fresh_runs.append(adjacent["process_seconds"])
            fresh_s = median(fresh_runs)
            o, w = fresh("recovery")
            killed = kill_shape(shape, args, input_dir, o, w, kill_after)
            recovered = run_shape(shape, "auto", args, input_dir, o, w)
            shape_outputs(shape, str(base / shape / "out-plain"), o)
            share = durable_share(recovered, clean)
            ratio = recovered["process_seconds"] / fresh_s
            recoveries.append({
                **killed, "kill_fraction": fraction, "fresh_seconds": fresh_s,
                "fresh_runs_so_far": list(fresh_runs),
                "adjacent_fresh_seconds": adjacent and adjacent["process_seconds"],
                "adjacent_fresh_vertices": adjacent and adjacent["vertices"],
                "ratio_to_adjacent": adjacent and
                recovered["process_seconds"] / adjacent["process_seconds"],
                "recovered_seconds": recovered["process_seconds"], "ratio": ratio,
                "durable_share": share, "job_durable_share": recovered["job_durable_share"],
                "summary": recovered["summary"],
                # issue 33's targets: recovered / fresh <= (1 - f) + 0.15, never above 1.0;
                # the durable share at the kill at least 0.8 f
                "target": min(1.0, 1 - fraction + 0.15),
                "share_target": 0.8 * fraction,
                "planning_s": recovered["planning_s"], "recomputed": recovered["recomputed"],
                "ran": recovered["ran"], "reused": recovered["reused"],
                "vertices": recovered["vertices"], "output_checked": True,
            })
            if adjacent:
                print(f"  fresh run beside it: {adjacent['process_seconds']:.1f} s",
                      flush=True)
            print(f"  kill at {fraction:.0%} ({killed['killed_after_seconds']:.1f} s, "
                  f"{killed['durable_partitions']} partitions durable): recovered in "
                  f"{recovered['process_seconds']:.1f} s = {ratio:.2f}x fresh, target <= "
                  f"{min(1.0, 1 - fraction + 0.15):.2f}; durable share {share:.2f} (the job's "
                  f"own {recovered['job_durable_share']:.2f}), target >= {0.8 * fraction:.2f}; "
                  f"planning {recovered['planning_s']:.1f} s; {recovered['summary']}",
                  flush=True)
            out["recovery"] = recoveries
            _dump(args, figures)
        shutil.rmtree(base / shape, ignore_errors=True)


def _dump(args: argparse.Namespace, figures: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


# -- orchestration -----------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=["plain", "ckpt"])
    parser.add_argument("--sinks-only", action="store_true")
    parser.add_argument("--server-cache", action="store_true",
                        help="with --connect: spark.ckpt.batch.serverCache=true in every "
                             "spark_ckpt driver")
    parser.add_argument("--input")
    parser.add_argument("--output")
    parser.add_argument("--work-dir")
    parser.add_argument("--orders", type=int, default=5_000_000)
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--parallelism", type=int, default=50)
    parser.add_argument("--agg-parallelism", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kill-at", default=None,  # "" for none (overhead only)
                        help="comma list of fractions of a full run's time")
    parser.add_argument("--replay-events", type=int, default=100_000)
    parser.add_argument("--connect", action="store_true",
                        help="run every driver as a Spark Connect client of one standalone "
                             "server this script starts (a killed driver is a crashed client)")
    parser.add_argument("--connect-cold", action="store_true",
                        help="with --connect: SIGKILL the server too at each kill and start a "
                             "new one before recovering (a cold start)")
    parser.add_argument("--skip", default="",
                        help="comma list of: overhead,recovery,rerun,replay")
    parser.add_argument("--json", default=None, help="write the figures here too")
    parser.add_argument("--shapes", default="",
                        help="comma list of jobs/batch_shapes.py shapes to measure instead")
    parser.add_argument("--shape-child")
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--shape-files", type=int, default=64)
    parser.add_argument("--shape-parallelism", type=int, default=8)
    parser.add_argument("--all-reps", type=int, default=1,
                        help="runs of the every-vertex-durable arm (0: skip it)")
    # sized so plain Spark runs at least 3 minutes on a 2-core machine (process wall time)
    parser.add_argument("--rows-report", type=int, default=270_000_000)
    parser.add_argument("--rows-join", type=int, default=33_000_000)
    parser.add_argument("--rows-rollup", type=int, default=265_000_000)
    parser.add_argument("--rows-cleanup", type=int, default=37_000_000)
    # (e)-(g) read the report's input, sized from plain Spark's time at 60M rows (issue 33)
    parser.add_argument("--rows-sorted_report", type=int, default=240_000_000)
    parser.add_argument("--rows-ranked", type=int, default=300_000_000)
    parser.add_argument("--rows-two_aggregations", type=int, default=380_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the generated input")
    parser.add_argument("--fresh-beside-kills", action="store_true",
                        help="a fresh default run before each kill; ratios against the "
                             "median of every fresh run")
    parser.add_argument("--event-logs", action="store_true",
                        help="Spark event logs of every driver in <json>.logs/events")
    args = parser.parse_args()
    if args.event_logs and args.json and not args.shape_child and not args.child:
        global DEFAULTS
        events = Path(f"{args.json}.logs/events").resolve()
        events.mkdir(parents=True, exist_ok=True)
        DEFAULTS = events.parent / "spark-defaults.conf"
        DEFAULTS.write_text((ROOT / "spark-defaults.conf").read_text() +
                            f"spark.eventLog.enabled true\nspark.eventLog.dir file://{events}\n" +
                            (f"spark.driver.extraJavaOptions -Dlog4j2.configurationFile="
                             f"file:{ROOT / 'conf/log4j2.properties'}\n"
                             if (ROOT / "conf/log4j2.properties").is_file() else ""))
    if args.shape_child:
        shape_child(args.shape_child, args.mode, args.input, args.output, args.work_dir,
                    args.parallelism)
        return
    if args.kill_at is None:
        args.kill_at = "0.1,0.3,0.6,0.85" if args.shapes else "0.3,0.6,0.7,0.85"
    if args.shapes:
        base = Path(tempfile.mkdtemp(prefix="spark-ckpt-shapes-"))
        figures = {"date": time.strftime("%Y-%m-%d"),
                   "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} "
                              f"cores, Python {platform.python_version()}",
                   "command": " ".join(sys.argv)}
        try:
            bench_shapes(args, base, figures)
        finally:
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
        print(json.dumps(figures, indent=2))
        return
    if args.child:
        child(args.child, args.input, args.output, args.work_dir, args.parallelism,
              args.agg_parallelism, args.sinks_only, args.server_cache)
        return

    import orders_data

    skip = set(filter(None, args.skip.split(",")))
    base = Path(tempfile.mkdtemp(prefix="spark-ckpt-bench-"))
    server = None
    if args.connect:  # every driver (plain and spark_ckpt) a client of one warm server
        sys.path.insert(0, str(ROOT / "tests"))
        from connect_server import start_server

        server = start_server(base)
        os.environ["SPARK_REMOTE"] = server.url
        print(f"Spark Connect server at {server.url}", flush=True)
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
    full_process: list[float] = []
    full_runs: list[dict] = []
    if "overhead" not in skip:
        plain, ckpt, sinks = [], [], []
        for rep in range(args.reps):  # alternate so drift hits both alike
            order = ["plain", "ckpt", "sinks"] if rep % 2 == 0 else ["sinks", "ckpt", "plain"]
            for mode in order:
                out, work = fresh(mode)
                run = run_child(mode, args, out, work)
                {"plain": plain, "ckpt": ckpt, "sinks": sinks}[mode].append(run["seconds"])
                if mode == "ckpt":
                    full_runs.append(run)
            if rep == 0:
                figures["outputs_checked"] = {
                    "every_vertex_durable": outputs_equal(str(base / "out-plain"),
                                                          str(base / "out-ckpt")),
                    "sinks_only": outputs_equal(str(base / "out-plain"),
                                                str(base / "out-sinks")),
                }
            print(f"rep {rep + 1}: plain {plain[-1]:.1f} s, spark_ckpt {ckpt[-1]:.1f} s, "
                  f"sinks only {sinks[-1]:.1f} s ({full_runs[-1]['vertex_seconds']})",
                  flush=True)
        full_ckpt = ckpt
        full_process = [r["process_seconds"] for r in full_runs]
        median = statistics.median
        figures["overhead"] = {
            "plain_seconds": plain, "ckpt_seconds": ckpt, "sinks_only_seconds": sinks,
            "ratio_of_medians": median(ckpt) / median(plain),
            "sinks_only_ratio_of_medians": median(sinks) / median(plain),
            "vertex_seconds": [r["vertex_seconds"] for r in full_runs],
        }
        print(f"overhead: spark_ckpt / plain = {figures['overhead']['ratio_of_medians']:.3f}; "
              f"sinks only / plain = {figures['overhead']['sinks_only_ratio_of_medians']:.3f}")

    if "recovery" not in skip:
        if not full_ckpt:
            full_ckpt = [run_child("ckpt", args, *fresh("ckpt"))["seconds"]]
        full = statistics.median(full_ckpt)
        runs = []
        for fraction in [float(f) for f in args.kill_at.split(",")]:
            out, work = fresh("recovery")
            killed = kill_at(args, out, work, fraction * full)
            if server is not None and args.connect_cold:  # the server dies with the client
                from connect_server import start_server, stop_server

                stop_server(server, signal.SIGKILL)
                started = time.perf_counter()
                server = start_server(base, port=server.port)
                killed["server_restart_seconds"] = time.perf_counter() - started
            recovered = run_child("ckpt", args, out, work)
            runs.append({**killed, "kill_fraction": fraction,
                         "recovered_seconds": recovered["seconds"],
                         "recovered_process_seconds": recovered["process_seconds"],
                         "fresh_process_seconds": statistics.median(full_process) if
                         full_process else None,
                         "reran": recovered["ran"], "reused": recovered["reused"],
                         "adopted": recovered.get("adopted", 0),
                         "process_ratio": (recovered["process_seconds"]
                                           / statistics.median(full_process)
                                           if full_process else None),
                         "fresh_seconds": full, "ratio": recovered["seconds"] / full,
                         "total_ratio": (fraction * full + recovered["seconds"]) / full,
                         "outputs_checked": outputs_equal(str(base / "out-plain"), out)
                         if (base / "out-plain").exists() else None})
            print(f"kill at {fraction:.0%} of {full:.1f} s with {killed['durable_partitions']} "
                  f"partitions durable: recovered in {recovered['seconds']:.1f} s (ran "
                  f"{recovered['ran']}, reused {recovered['reused']}, adopted "
                  f"{recovered.get('adopted', 0)}): {runs[-1]['ratio']:.2f}x "
                  f"a fresh run, killed + recovered {runs[-1]['total_ratio']:.2f}x; as "
                  f"processes {runs[-1]['process_ratio'] or float('nan'):.2f}x", flush=True)
        figures["recovery"] = {"fresh_seconds_median": full, "runs": runs}

    if "rerun" not in skip:
        out, work = fresh("rerun")
        # after every vertex finished (how many there are depends on the plan: a durable
        # exchange adds one; a full run of this invocation says), before the sinks commit
        vertices = len(full_runs[0]["vertex_seconds"]) if full_runs else 4
        crashed = run_child("ckpt", args, out, work, fault=f"vertex.finished:{vertices}")
        staged = sorted((Path(out) / "settled" / "_spark_ckpt_staging" / "bench" / "settled")
                        .glob("*/part-*.parquet"))
        lost = max(1, args.parallelism // 10)
        for victim in staged[:lost]:
            victim.unlink()
        snapshot = base / "rerun-snapshot"
        shutil.copytree(out, snapshot / "out", symlinks=True)
        shutil.copytree(work, snapshot / "work", symlinks=True)
        # each repetition: a whole run of the job (the baseline), then the re-run from the
        # same crashed state, alternating, so both see the server in the same shape
        fulls, reruns, checked = [], [], None
        for rep in range(max(1, args.reps)):
            fout, fwork = fresh("rerun-full")
            fulls.append(run_child("ckpt", args, fout, fwork)["vertex_seconds"]["settled"])
            for name, target in (("out", out), ("work", work)):
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(snapshot / name, target, symlinks=True)
            rerun = run_child("ckpt", args, out, work)
            reruns.append({"settled_seconds": rerun["vertex_seconds"]["settled"],
                           "settled_ran": rerun["vertex_ran"]["settled"],
                           "total_seconds": rerun["seconds"]})
            if (base / "out-plain").exists():
                checked = outputs_equal(str(base / "out-plain"), out)
            print(f"rep {rep + 1}: the whole vertex {fulls[-1]:.2f} s in a full run, re-run of "
                  f"{lost} settled partitions {reruns[-1]['settled_seconds']:.2f} s "
                  f"(ran {reruns[-1]['settled_ran']})", flush=True)
        full_settled = statistics.median(fulls)
        rerun_settled = statistics.median(r["settled_seconds"] for r in reruns)
        figures["rerun"] = {
            "crash_returncode": crashed["returncode"], "lost_partitions": lost,
            "settled_full_seconds": fulls, "settled_full_seconds_median": full_settled,
            "reruns": reruns, "settled_rerun_seconds_median": rerun_settled,
            "ratio": rerun_settled / full_settled,
            "settled_full_seconds_median_overhead_reps": statistics.median(
                r["vertex_seconds"]["settled"] for r in full_runs) if full_runs else None,
            "outputs_checked": checked,
        }
        print(f"re-run of {lost} settled partitions: median {rerun_settled:.2f} s vs the whole "
              f"vertex {full_settled:.2f} s: {rerun_settled / full_settled:.3f}", flush=True)

    if "replay" not in skip:
        figures["replay"] = bench_replay(args.replay_events, str(base / "replay"))
        print(f"replay of {args.replay_events:,} events in {figures['replay']['commits']} "
              f"commits, with the file checks: "
              f"{', '.join(f'{s:.2f} s' for s in figures['replay']['total_seconds'])}")

    if server is not None:
        from connect_server import stop_server

        figures["connect"] = {"cold_recovery": bool(args.connect_cold),
                              "server_cache": bool(args.server_cache)}
        stop_server(server)
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
