"""Benchmark spark_ckpt's keyed state against Spark Structured Streaming, same input, same run.

    python scripts/bench_state.py --small                # every scenario at toy sizes (check)
    python scripts/bench_state.py                        # every scenario, default sizes
    python scripts/bench_state.py --agg --restart        # only these scenarios

Input (both systems read the same files): the rows of spark_ckpt's generator source,
``id, key = pmod(id, K), value = pmod(xxhash64(id, 42), 1000000) / 100.0,
event_time = timestamp_millis(1767225600000 + id)``, pre-written as one Parquet file per batch
into a directory; spark_ckpt reads it with ``file_stream(..., max_files_per_batch=1)``,
Structured Streaming with ``maxFilesPerTrigger=1`` and ``trigger(availableNow=True)``.
Structured Streaming keeps its state in RocksDB with changelog checkpointing; spark_ckpt in its
memory backend (``state_parallelism=2``; Structured Streaming has ``shuffle.partitions=2``).

Scenarios (flags; none given runs them all). Default sizes in ``SIZES`` (``--help``):

``--agg``          keyed count + sum over 12 files x 250,000 rows, 1,000,000 keys. spark_ckpt:
                   ``key_by("key").agg(...)`` appended with ``write_parquet`` (two-phase,
                   checkpoint every 10 s); Structured Streaming: ``groupBy("key").agg(...)``,
                   update mode, ``foreachBatch`` appending to Parquet. Input rows per second over
                   the query's wall time (and from the second batch on, without the cold first).
                   With ``--pyflink PYTHON``: Flink SQL's ``GROUP BY`` (RocksDB, incremental
                   checkpoints every 10 s, parallelism 2) over the same rows as CSV, each key's
                   final row printed and checked.
``--totals``       keyed running totals of 5,000 keys, 30 batches of 10 files x 1,000 rows (daily
                   files; both systems take 10 files per batch), keyed by a string and an integer
                   column ``(carrier, key)``, count + sum + max, merged into a Delta table by
                   key. spark_ckpt: ``key_by("carrier", "key").agg(...)`` into
                   ``write_delta(merge_keys=[...])`` (two-phase, checkpoint every 10 s);
                   Structured Streaming: ``groupBy(...).agg(...)``, update mode, RocksDB,
                   ``foreachBatch`` turning the batch into Arrow and merging it with delta-rs
                   (the batch id as the table's app transaction). The output is the Delta table,
                   read with delta-rs and checked row by row.
``--process``      running per-key n/total in Python (4 files x 1,000,000 rows over 1,000,000
                   keys): a ``VectorizedProcessor`` (one call per task and batch, ``ckpt_vec``)
                   and a ``KeyedProcessor`` (one call per key and batch, ``ckpt``) vs
                   ``applyInPandasWithState`` (and ``transformWithStateInPandas`` when the
                   ``protobuf`` package it needs is installed and ``--tws`` is given), and
                   with ``--pyflink PYTHON`` PyFlink's ``KeyedProcessFunction`` with
                   ``ValueState`` (scripts/bench_pyflink.py; RocksDB, incremental checkpoints
                   every 10 s, parallelism 2; the same rows as CSV).
``--tiny``         20 batches of 10 rows over 10 keys through the agg pipeline: median batch
                   duration after 2 warm-up batches (spark_ckpt ``durations_ms.total``, also
                   with allocation; Structured Streaming ``durationMs.triggerExecution``), and the
                   period from one batch's start to the next. A third arm, ``floor``, times the
                   smallest Spark job a stateful batch can be (one stage, one Python task, no
                   state) on the same files: what this machine charges for any Python step.
``--interval``     the agg pipeline in spark_ckpt checkpointing every 10 s versus only the final
                   checkpoint (``checkpoint_interval_ms=0``): throughput ratio. With ``--agg`` the
                   two share the every-10-s runs (one rotation of three arms per repetition).
``--incremental``  1,000,000 keys loaded in 4 batches, then 10 batches touching 10,000 keys
                   each, a checkpoint after every batch (``checkpoint_interval_ms=1``): the first
                   full checkpoint's bytes versus later incremental bytes, p99 checkpoint
                   duration (trigger to end, and barrier to end), largest synchronous part.
``--big``          20,000,000 keys in the rocksdb backend (8 files of 2,500,000 rows, every key
                   once; spark_ckpt only): rows per second, checkpoint bytes; then one more
                   file on the same checkpoint twice: with the executor's RocksDB copies (found
                   locally) and with them deleted (restored from the durable chain), with the
                   tasks' restore times. The last run's output is checked.
``--restart``      the agg pipeline (6 files) in a driver SIGKILLed once 3 outputs are committed
                   (spark_ckpt: Parquet commit markers marked committed, checkpoint every 1 s;
                   Structured Streaming: commit log entries), then started again: wall time from
                   the restarted process's start to its first new output file (JVM start
                   included, same for both; also from the session being ready). The restarted
                   driver runs to the end and its output is checked like the others.

Every measurement is its own driver process (local[2], 4g driver, UI off, 2 shuffle partitions,
UTC), the order of the systems alternating between repetitions. Every run checks its output:
the newest row per key of the update output (the one with the largest n) against a plain Spark
``groupBy(key)`` over all input (n exactly, total within 1e-6 relative); the per-system digests
(keys, sum of n, sum of total) must also agree. Prints raw figures, medians and ratios and
writes them to ``benchmarks/results/benchmarks-state-<date>.json`` (``--json``; a file already
there keeps the scenarios not run this time). ``--small`` writes to a temporary directory
unless ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spark_ckpt.state.processor import KeyedProcessor, Result, VectorizedProcessor  # noqa: E402

SCHEMA = "id BIGINT, key BIGINT, value DOUBLE, event_time TIMESTAMP"
# the totals input: a string column too, and the pipelines key by (carrier, key)
TOTALS_SCHEMA = SCHEMA + ", carrier STRING"
CARRIERS = 20
OUT_SCHEMA = "key BIGINT, n BIGINT, total DOUBLE"
EPOCH_MS = 1767225600000
TINY_WARMUP = 2
TOLERANCE = 1e-6
SCENARIOS = ("agg", "totals", "process", "tiny", "interval", "incremental", "restart", "big")

# size knobs: (full default, --small default)
SIZES: dict[str, tuple[int, int]] = {
    "files": (12, 3), "rows_per_file": (250_000, 2000), "keys": (1_000_000, 1000),
    "totals_files": (30, 4), "totals_rows_per_file": (10_000, 1000), "totals_keys": (5_000, 100),
    "totals_files_per_batch": (10, 2),
    "process_files": (4, 3), "process_rows_per_file": (1_000_000, 2000),
    "process_keys": (1_000_000, 1000),
    "tiny_files": (20, 8), "tiny_rows": (10, 10), "tiny_keys": (10, 10),
    "incr_keys": (1_000_000, 1000), "incr_load_files": (4, 1), "incr_batches": (10, 4),
    "incr_touch": (10_000, 10),
    "big_keys": (20_000_000, 20_000), "big_files": (8, 4), "big_extra_rows": (100_000, 1000),
    "restart_files": (6, 10), "restart_kill_after": (3, 2), "restart_checkpoint_ms": (1000, 1000),
}


# -- the stateful logic, the same in both systems -------------------------------------------
class Running(KeyedProcessor):
    """spark_ckpt: running count and sum of ``value`` per key, one output row per key and batch."""

    state_schema = "s DOUBLE, c BIGINT"

    def process(self, key, rows, ctx):
        s = ctx.value("s")
        c = ctx.value("c")
        total = (s.get() or 0.0) + float(rows["value"].sum())
        n = (c.get() or 0) + len(rows)
        s.update(total)
        c.update(n)
        yield (key[0], n, total)


class RunningVec(VectorizedProcessor):
    """spark_ckpt, vectorized: the same running count and sum, one call per task and batch."""

    state_schema = "s DOUBLE, c BIGINT"

    def process_batch(self, batch):
        import numpy as np
        import pandas as pd

        sums = np.add.reduceat(batch.rows["value"].to_numpy(), batch.offsets[:-1])
        total = batch.state["s"].fillna(0.0).to_numpy() + sums
        n = batch.state["c"].fillna(0).to_numpy("int64") + batch.sizes
        return Result(state=pd.DataFrame({"s": total, "c": n}),
                      emit=batch.keys.assign(n=n, total=total))


def running_with_state(key, pdfs, state):
    """Structured Streaming ``applyInPandasWithState``: the same running count and sum."""
    import pandas as pd

    n, total = state.get if state.exists else (0, 0.0)
    for pdf in pdfs:
        n += len(pdf)
        total += float(pdf["value"].sum())
    state.update((n, total))
    yield pd.DataFrame({"key": [key[0]], "n": [n], "total": [total]})


def running_tws_processor():  # built in the child (imports pyspark there)
    import pandas as pd
    from pyspark.sql.streaming import StatefulProcessor

    class RunningTWS(StatefulProcessor):
        def init(self, handle):
            self.state = handle.getValueState("s", "n LONG, total DOUBLE")

        def handleInputRows(self, key, rows, timerValues):
            n, total = (0, 0.0)
            if self.state.exists():
                n, total = self.state.get()
            for pdf in rows:
                n += len(pdf)
                total += float(pdf["value"].sum())
            self.state.update((n, total))
            yield pd.DataFrame({"key": [key[0]], "n": [n], "total": [total]})

        def close(self):
            pass

    return RunningTWS()


# -- child drivers ---------------------------------------------------------------------------
def session(name: str):
    import logging

    from spark_ckpt import get_or_create_session

    logging.basicConfig(level=logging.WARNING)
    spark = get_or_create_session(name, conf={
        "spark.master": "local[2]", "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2", "spark.sql.session.timeZone": "UTC",
        "spark.driver.memory": "4g"})
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def generated(spark, start: int, end: int, keys: int):
    """The generator source's rows ``[start, end)``."""
    from pyspark.sql import functions as F

    return spark.range(start, end, 1, 1).select(
        "id", F.pmod(F.col("id"), F.lit(keys)).alias("key"),
        (F.pmod(F.xxhash64(F.col("id"), F.lit(42)), F.lit(1000000)) / 100.0).alias("value"),
        F.timestamp_millis(F.lit(EPOCH_MS) + F.col("id")).alias("event_time"))


def child_generate(args: argparse.Namespace) -> dict:
    """Write every dataset of the spec (one Parquet file per range) and its expected result."""
    from pyspark.sql import functions as F

    spark = session("bench-state-gen")
    spec = json.loads(Path(args.spec).read_text())
    for ds in spec:
        target = Path(ds["dir"])
        target.mkdir(parents=True, exist_ok=True)
        tmp = Path(ds["dir"] + ".tmp")
        split = ds.get("split", 1)
        base_mtime = time.time() - 60 - len(ds["ranges"]) * split
        for i, (start, end) in enumerate(ds["ranges"]):
            rows = generated(spark, start, end, ds["keys"])
            if ds.get("carrier"):
                rows = rows.withColumn("carrier", F.format_string(
                    "C%02d", F.pmod(F.col("key"), F.lit(CARRIERS))))
            rows.write.mode("overwrite").parquet(str(tmp))
            part = next(tmp.glob("part-*.parquet"))
            if split == 1:
                pieces = [part]
            else:  # a batch of several files (daily files): the rows cut into `split` files
                import pyarrow.parquet as pq

                table = pq.read_table(part)
                step = -(-table.num_rows // split)
                pieces = []
                for j in range(split):
                    piece = tmp / f"piece-{j:03d}.parquet"
                    pq.write_table(table.slice(j * step, step), piece)
                    pieces.append(piece)
            for j, piece in enumerate(pieces):
                n = i * split + j
                dst = target / f"part-{n:05d}.parquet"
                os.replace(piece, dst)
                os.utime(dst, (base_mtime + n, base_mtime + n))  # strictly increasing: order
        shutil.rmtree(tmp, ignore_errors=True)
        (spark.read.schema(SCHEMA).parquet(str(target)).groupBy("key")
         .agg(F.count(F.lit(1)).alias("n"), F.sum("value").alias("total"))
         .write.mode("overwrite").parquet(ds["expected"]))
    return {}


def _as_json_lines(directory: str) -> str:
    """A copy of ``directory``'s Parquet files as JSON lines, file by file, with the same
    modification times (the same batches, in the same order); its path."""
    import pyarrow.parquet as pq

    target = Path(directory + "-json")
    target.mkdir(parents=True, exist_ok=True)
    for part in sorted(Path(directory).glob("*.parquet")):
        dst = target / (part.stem + ".json")
        frame = pq.read_table(part).to_pandas()
        frame["event_time"] = frame["event_time"].dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        dst.write_text(frame.to_json(orient="records", lines=True, double_precision=15))
        stat = part.stat()
        os.utime(dst, (stat.st_atime, stat.st_mtime))
    return str(target)


def check_output(spark, out_dir: str, expected_dir: str) -> dict:
    """The newest row per key (largest n) of an update output against the expected totals."""
    from pyspark.sql import functions as F

    out = spark.read.schema(OUT_SCHEMA).parquet(out_dir)
    final = out.groupBy("key").agg(F.max("n").alias("n"), F.max_by("total", "n").alias("total"))
    expected = spark.read.parquet(expected_dir)
    joined = final.alias("o").join(expected.alias("e"), "key", "full_outer")
    bad = joined.where(
        F.col("o.n").isNull() | F.col("e.n").isNull() | (F.col("o.n") != F.col("e.n")) |
        (F.abs(F.col("o.total") - F.col("e.total")) >
         F.lit(TOLERANCE) * F.greatest(F.abs(F.col("e.total")), F.lit(1.0))))
    digest = final.agg(F.count(F.lit(1)).alias("keys"), F.sum("n").alias("sum_n"),
                       F.sum("total").alias("sum_total")).first()
    return {"output_rows": out.count(), "keys": int(digest.keys or 0),
            "sum_n": int(digest.sum_n or 0), "sum_total": float(digest.sum_total or 0.0),
            "mismatches": bad.count(), "examples": [r.asDict() for r in bad.limit(3).collect()]}


def check_delta(out_dir: str, expected_dir: str) -> dict:
    """A Delta table merged by key (one row per key) against the expected totals."""
    import pandas as pd
    from deltalake import DeltaTable

    table = DeltaTable(out_dir).to_pandas()
    carriers = table.key % CARRIERS
    wrong_carrier = int((table.carrier != carriers.map(lambda c: f"C{c:02d}")).sum())
    out = table[["key", "n", "total"]]
    expected = pd.read_parquet(expected_dir)
    joined = out.merge(expected, on="key", how="outer", suffixes=("_o", "_e"))
    bad = joined[joined.n_o.isna() | joined.n_e.isna() | (joined.n_o != joined.n_e) |
                 ((joined.total_o - joined.total_e).abs() >
                  TOLERANCE * joined.total_e.abs().clip(lower=1.0))]
    return {"output_rows": len(out), "keys": int(out.key.nunique()),
            "sum_n": int(out.n.sum()), "sum_total": float(out.total.sum()),
            "mismatches": len(bad) + wrong_carrier,
            "examples": bad.head(3).astype(str).to_dict("records")}


def ckpt_settings(interval_ms: int):
    from spark_ckpt import Settings

    return Settings(progress="never", checkpoint_interval_ms=interval_ms, state_parallelism=2,
                    state_backend="memory")


def ss_conf(spark) -> None:
    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                   "true")


def child_ckpt(args: argparse.Namespace, spark) -> dict:
    from spark_ckpt import StreamingContext
    from spark_ckpt.state.aggregates import count, max_, sum_

    work = Path(args.work)
    out = str(work / "out")
    settings = ckpt_settings(args.checkpoint_ms)
    if args.scenario == "big":  # state on local disk; the executor's copies kept in work/local
        import dataclasses

        settings = dataclasses.replace(settings, state_backend="rocksdb",
                                       state_local_dir=str(work / "local"))
    ctx = StreamingContext(spark, args.batch_interval, str(work / "ckpt"), "bench",
                           settings=settings)
    schema = TOTALS_SCHEMA if args.scenario == "totals" else SCHEMA
    src = ctx.file_stream("in", args.input, args.input_format, schema=schema,
                          max_files_per_batch=args.files_per_batch)
    if args.scenario == "process":
        processor = RunningVec() if args.system == "ckpt_vec" else Running()
        src.key_by("key").process(processor, OUT_SCHEMA, name="running") \
            .write_parquet(out, name="running")
    elif args.scenario == "totals":
        src.key_by("carrier", "key").agg(n=count(), total=sum_("value"), top=max_("value")) \
            .write_delta(out, name="totals", merge_keys=["carrier", "key"])
    else:
        src.key_by("key").agg(n=count(), total=sum_("value")).write_parquet(out, name="totals")
    print(f"READY {time.time():.3f}", flush=True)
    t0 = time.perf_counter()
    progress = ctx.process_available(timeout=3600)
    seconds = time.perf_counter() - t0
    end_ms = int(time.time() * 1000)
    checkpoints = [{k: c.get(k) for k in ("checkpoint_id", "status", "barrier_batch",
                                          "trigger_ms", "barrier_ms", "end_ms",
                                          "duration_ms", "full_bytes", "incremental_bytes",
                                          "sync_ms", "async_ms", "alignment_ms")}
                   for c in ctx.recent_checkpoints]
    return {"seconds": seconds, "rows": sum(p["num_input_rows"] or 0 for p in progress),
            "batches": len(progress),
            "end_ms": end_ms, "batch_rows": [p["num_input_rows"] for p in progress],
            "batch_start_ms": [_iso_ms(p["timestamp"]) for p in progress],
            "batch_ms": [p["durations_ms"]["total"] for p in progress],
            "allocation_ms": [p["durations_ms"]["allocation"] for p in progress],
            "state_ms": [p["durations_ms"].get("state") for p in progress],
            "checkpoints": checkpoints, "state_tasks": _task_cache(progress),
            "restore_ms": [max([t.get("restore_ms") or 0 for op in (p.get("state") or {}).values()
                                for t in (op.get("tasks") or {}).values()], default=0)
                           for p in progress],
            "state_rows": [sum(op.get("state_rows") or 0 for op in (p.get("state") or {}).values())
                           for p in progress],
            # per batch, each stateful task's (input rows, ms applying them to the state,
            # ms writing its files, the snapshot a thread materialized if it took one up)
            "state_task_work": [[[t.get("input_rows"), t.get("apply_ms"), t.get("async_ms"),
                                  t.get("materialized")]
                                 for op in (p.get("state") or {}).values()
                                 for t in (op.get("tasks") or {}).values()]
                                for p in progress]}


def _apply_rate(run: dict) -> float | None:
    """Input rows per second of the stateful tasks' time applying them (summed over tasks)."""
    work = [t for batch in run.get("state_task_work") or [] for t in batch
            if t[0] and t[1] is not None]
    ms = sum(t[1] for t in work)
    return sum(t[0] for t in work) / (ms / 1000) if ms else None


def _task_cache(progress: list[dict]) -> dict[str, int]:
    """Where each stateful task run found its range: the worker's memory (process), the
    executor's local copy (local), durable storage (restored), or nowhere (a new range)."""
    counts: dict[str, int] = {}
    for p in progress:
        for op in (p.get("state") or {}).values():
            for task in (op.get("tasks") or {}).values():
                where = task.get("cache") or ("restored" if task.get("restored") else "new")
                counts[where] = counts.get(where, 0) + 1
    return counts


def child_ss(args: argparse.Namespace, spark) -> dict:
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    ss_conf(spark)
    work = Path(args.work)
    out = str(work / "out")
    schema = TOTALS_SCHEMA if args.scenario == "totals" else SCHEMA
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", args.files_per_batch) \
        .format(args.input_format).load(args.input)
    if args.scenario == "totals":
        result = stream.groupBy("carrier", "key").agg(
            F.count(F.lit(1)).alias("n"), F.sum("value").alias("total"),
            F.max("value").alias("top"))
    elif args.system == "ss":
        result = stream.groupBy("key").agg(F.count(F.lit(1)).alias("n"),
                                           F.sum("value").alias("total"))
    elif args.system == "ss_apiws":
        result = stream.groupBy("key").applyInPandasWithState(
            running_with_state, OUT_SCHEMA, "n LONG, total DOUBLE", "update",
            GroupStateTimeout.NoTimeout)
    else:  # ss_tws
        result = stream.groupBy("key").transformWithStateInPandas(
            running_tws_processor(), OUT_SCHEMA, "Update", "None")

    def append(df, batch_id: int) -> None:
        df.write.mode("append").parquet(out)

    def merge(df, batch_id: int) -> None:
        """What a careful user writes: the batch's rows to Arrow, a delta-rs merge by key, the
        batch id as the table's app transaction (a replayed batch is not merged twice)."""
        from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

        rows = df.toArrow()
        app = "bench-totals"
        if not DeltaTable.is_deltatable(out):
            write_deltalake(out, rows, commit_properties=CommitProperties(
                app_transactions=[Transaction(app_id=app, version=batch_id)]))
            return
        table = DeltaTable(out)
        done = table.transaction_version(app)
        if done is not None and done >= batch_id:
            return
        table.merge(rows, "t.carrier = s.carrier AND t.key = s.key", source_alias="s",
                    target_alias="t", commit_properties=CommitProperties(app_transactions=[
                        Transaction(app_id=app, version=batch_id)])) \
            .when_matched_update_all().when_not_matched_insert_all().execute()

    sink = merge if args.scenario == "totals" else append
    writer = (result.writeStream.outputMode("update").foreachBatch(sink)
              .option("checkpointLocation", str(work / "ckpt")).trigger(availableNow=True))
    print(f"READY {time.time():.3f}", flush=True)
    t0 = time.perf_counter()
    query = writer.start()
    query.awaitTermination()
    seconds = time.perf_counter() - t0
    end_ms = int(time.time() * 1000)
    progress = query.recentProgress
    return {"seconds": seconds, "rows": sum(p["numInputRows"] for p in progress),
            "batches": len(progress),
            "end_ms": end_ms,
            "batch_rows": [p["numInputRows"] for p in progress if p["numInputRows"]],
            "batch_start_ms": [_iso_ms(p["timestamp"]) for p in progress if p["numInputRows"]],
            "batch_ms": [p["durationMs"]["triggerExecution"] for p in progress
                         if p["numInputRows"]],
            "state_rows": [sum(o.get("numRowsTotal", 0) for o in p["stateOperators"])
                           for p in progress]}


def _iso_ms(stamp: str) -> int:
    """Epoch milliseconds of a progress timestamp such as ``2026-11-21T23:41:02.123Z``."""
    from datetime import datetime

    return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)


def code_version() -> str:
    """The commit and a digest of the spark_ckpt sources this process runs (the working tree
    may change between runs: the results say so)."""
    import hashlib

    digest = hashlib.sha1()
    for path in sorted((ROOT / "spark_ckpt").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = "unknown"
    return f"{head}+{digest.hexdigest()[:12]}"


def child_floor(args: argparse.Namespace, spark) -> dict:
    """What one Spark job with a Python task costs on this machine now: per input file, the
    smallest job a stateful batch could be (read, aggregate by key, a ``mapInArrow`` task
    that counts the aggregated rows it is given, collect), with no state at all. ``--big``:
    the file's own splits, the aggregation's shuffle into the pipeline's two ranges (not
    coalesced by AQE, as the pipeline's ``repartitionById`` is not), two Python tasks."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    def passthrough(batches):
        n = 0
        for b in batches:
            n += b.num_rows
        yield pa.RecordBatch.from_pydict({"rows": pa.array([n], pa.int64())})

    files = sorted(str(p) for p in Path(args.input).glob("*.parquet"))
    if args.scenario == "big":  # as the pipeline's batch: the file's splits, two ranges
        spark.conf.set("spark.sql.shuffle.partitions", "2")
        spark.conf.set("spark.sql.adaptive.coalescePartitions.enabled", "false")
    batch_ms = []
    for f in files:
        t0 = time.perf_counter()
        df = spark.read.schema(SCHEMA).parquet(f)
        if args.scenario != "big":
            df = df.coalesce(1)
        df.groupBy("key").agg(F.count(F.lit(1)).alias("n"), F.sum("value").alias("total")) \
            .mapInArrow(passthrough, "rows LONG").collect()
        batch_ms.append(int(round((time.perf_counter() - t0) * 1000)))
    return {"batches": len(files), "batch_ms": batch_ms}


def child_cold_floor(args: argparse.Namespace, spark) -> dict:
    """The least a restarted driver does before its first output, in a fresh process: one
    Spark job with a Python task over one input file, writing one Parquet file (no state, no
    checkpoint). The parent times it from the process's start to the file."""
    def passthrough(batches):
        yield from batches

    first = sorted(str(p) for p in Path(args.input).glob("*.parquet"))[0]
    t0 = time.perf_counter()
    spark.read.schema(SCHEMA).parquet(first).coalesce(1).mapInArrow(passthrough, SCHEMA) \
        .write.parquet(str(Path(args.work) / "out"))
    return {"job_s": time.perf_counter() - t0}


def child(args: argparse.Namespace) -> None:
    code = code_version()
    if args.scenario == "gen":
        result = child_generate(args)
    else:
        spark = session(f"bench-state-{args.scenario}-{args.system}")
        os.makedirs(args.work, exist_ok=True)
        if args.system == "floor" and args.scenario == "restart":
            result = child_cold_floor(args, spark)
        elif args.system == "floor":
            result = child_floor(args, spark)
        elif args.system in ("ckpt", "ckpt_vec"):
            result = child_ckpt(args, spark)
        else:
            result = child_ss(args, spark)
        if args.skip_check:
            pass
        elif args.system != "floor" and args.scenario == "totals":
            result["check"] = check_delta(str(Path(args.work) / "out"), args.expected)
        elif args.system != "floor":
            result["check"] = check_output(spark, str(Path(args.work) / "out"), args.expected)
    result["code"] = code
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent: runs children, alternates, summarizes ---------------------------------------
class ChildFailed(RuntimeError):
    pass


def child_env() -> dict[str, str]:
    return dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                PYSPARK_SUBMIT_ARGS="--driver-memory 4g pyspark-shell",
                SPARK_CKPT_DEFAULTS=str(ROOT / "spark-defaults.conf"),
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def child_cmd(scenario: str, system: str, **opts: Any) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--scenario", scenario,
           "--system", system]
    for key, value in opts.items():
        cmd += [f"--{key.replace('_', '-')}"] if value is True else \
            [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def parse_result(stdout: str) -> dict:
    line = next((li for li in stdout.splitlines() if li.startswith("RESULT ")), None)
    if line is None:
        raise ChildFailed("no RESULT line")
    return json.loads(line[7:])


def run_child(scenario: str, system: str, work: Path | None, **opts: Any) -> dict:
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        opts["work"] = work
    cmd = child_cmd(scenario, system, **opts)
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise ChildFailed(f"{scenario}/{system} failed (exit {proc.returncode}):\n"
                          f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    return parse_result(proc.stdout)


def rate(r: dict) -> float:
    return r["rows"] / r["seconds"]


def steady_rate(r: dict) -> float | None:
    """Input rows per second from the second batch's start to the query's end."""
    if len(r.get("batch_start_ms", [])) < 2:
        return None
    return (r["rows"] - r["batch_rows"][0]) * 1000 / (r["end_ms"] - r["batch_start_ms"][1])


def _known(values: list[Any]) -> list[Any]:
    return [v for v in values if v is not None]


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def orders(systems: list[str], rep: int) -> list[str]:
    """The systems rotated by repetition, so none is always first."""
    k = rep % len(systems)
    return systems[k:] + systems[:k]


def check_digests(label: str, runs: dict[str, list[dict]], errors: list[str]) -> None:
    """Every run matched the expected totals, and all systems' digests agree."""
    digests = []
    for system, results in runs.items():
        for r in results:
            c = r.get("check")
            if c is None:
                continue
            if c["mismatches"]:
                errors.append(f"{label}/{system}: {c['mismatches']} keys differ from the expected "
                              f"totals, e.g. {c['examples']}")
            digests.append((system, c))
    for system, c in digests[1:]:
        ref_system, ref = digests[0]
        if (c["keys"], c["sum_n"]) != (ref["keys"], ref["sum_n"]) or \
                abs(c["sum_total"] - ref["sum_total"]) > TOLERANCE * max(abs(ref["sum_total"]), 1):
            errors.append(f"{label}: digest of {system} {c} differs from {ref_system} {ref}")


class Bench:
    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.base = base
        self.sizes = {k: (getattr(args, k) if getattr(args, k) is not None
                          else v[1 if args.small else 0]) for k, v in SIZES.items()}
        self.errors: list[str] = []
        self.data: dict[str, dict[str, str]] = {}
        self.scenarios: list[str] = []
        self._agg_runs: dict[str, list[dict]] | None = None

    # -- input ---------------------------------------------------------------------------
    def datasets(self, scenarios: list[str]) -> list[dict]:
        s = self.sizes
        spec: dict[str, tuple[list[tuple[int, int]], int]] = {}

        def uniform(files: int, rows: int) -> list[tuple[int, int]]:
            return [(i * rows, (i + 1) * rows) for i in range(files)]

        if {"agg", "interval"} & set(scenarios):
            spec["agg"] = (uniform(s["files"], s["rows_per_file"]), s["keys"])
        if "totals" in scenarios:
            spec["totals"] = (uniform(s["totals_files"], s["totals_rows_per_file"]),
                              s["totals_keys"])
        if "big" in scenarios:  # every key once, then two files touching a few of them
            k, n = s["big_keys"], s["big_files"]
            bounds = [round(k * i / n) for i in range(n + 1)]
            extra = s["big_extra_rows"]
            spec["big"] = ([(bounds[i], bounds[i + 1]) for i in range(n)] +
                           [(k + j * extra, k + (j + 1) * extra) for j in range(2)], k)
        if "restart" in scenarios:
            spec["restart"] = (uniform(s["restart_files"], s["rows_per_file"]), s["keys"])
        if "process" in scenarios:
            spec["process"] = (uniform(s["process_files"], s["process_rows_per_file"]),
                               s["process_keys"])
        if "tiny" in scenarios:
            spec["tiny"] = (uniform(s["tiny_files"], s["tiny_rows"]), s["tiny_keys"])
        if "incremental" in scenarios:
            k, load = s["incr_keys"], s["incr_load_files"]
            bounds = [round(k * i / load) for i in range(load + 1)]
            ranges = [(bounds[i], bounds[i + 1]) for i in range(load)]
            ranges += [(k + j * s["incr_touch"], k + (j + 1) * s["incr_touch"])
                       for j in range(s["incr_batches"])]
            spec["incremental"] = (ranges, k)
        out = []
        for name, (ranges, keys) in spec.items():
            d = {"dir": str(self.base / "input" / name),
                 "expected": str(self.base / "expected" / name), "ranges": ranges, "keys": keys,
                 "split": s["totals_files_per_batch"] if name == "totals" else 1,
                 "carrier": name == "totals"}
            self.data[name] = {"input": d["dir"], "expected": d["expected"],
                               "rows": str(sum(e - b for b, e in ranges))}
            out.append(d)
        return out

    def generate(self, scenarios: list[str]) -> float:
        spec = self.datasets(scenarios)
        path = self.base / "spec.json"
        path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        run_child("gen", "spark", None, spec=path)
        if self.args.input_format == "json" and "totals" in self.data:
            self.data["totals"]["input"] = _as_json_lines(self.data["totals"]["input"])
        return time.perf_counter() - t0

    def run_flink(self, data: str) -> dict:
        """The PyFlink arm (scripts/bench_pyflink.py in the --pyflink interpreter)."""
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        d = self.data[data]
        csv_dir = self.base / f"csv-{data}"
        if not csv_dir.exists():  # the same rows, as CSV: PyFlink has no Parquet format jar
            tmp = self.base / f"csv-{data}.tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            for f in sorted(Path(d["input"]).glob("*.parquet")):
                table = pq.read_table(f)
                table = table.set_column(3, "event_time", table.column(3).cast("string"))
                pacsv.write_csv(table, tmp / f"{f.stem}.csv",
                                write_options=pacsv.WriteOptions(include_header=False))
            tmp.rename(csv_dir)
        work = self.base / "work" / f"{data}-flink"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        agg = data == "agg"
        keys = self.sizes["keys" if agg else "process_keys"]
        rows = int(d["rows"])
        cmd = [self.args.pyflink, str(ROOT / "scripts" / "bench_pyflink.py"), "--csv",
               str(csv_dir), "--work", str(work), "--rows-per-key", str(rows // keys),
               "--rows", str(rows), *(["--agg"] if agg else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0 or "RESULT " not in proc.stdout:
            raise ChildFailed(f"{data}/flink failed (exit {proc.returncode}):\n"
                              f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
        result = parse_result(proc.stdout)
        import pandas as pd

        if agg:  # the print connector's lines: "OUT:1> +U[key, n, total]"
            import re

            printed = re.compile(r"^OUT(:\d+)?> [+-][IU]\[(.*)\]$")  # "OUT>" at parallelism 1
            found = [m.group(2).split(", ") for m in map(printed.match, proc.stdout.splitlines())
                     if m]
            out = pd.DataFrame([(int(k), int(n), float(t)) for k, n, t in found],
                               columns=["key", "n", "total"])
        else:
            parts = [pd.read_csv(f, header=None, names=["key", "n", "total"])
                     for f in (work / "out").rglob("*")
                     if f.is_file() and not f.name.startswith(".")]
            out = pd.concat(parts) if parts else pd.DataFrame(columns=["key", "n", "total"])
        expected = pd.read_parquet(d["expected"])
        joined = out.merge(expected, on="key", how="outer", suffixes=("_o", "_e"))
        bad = joined[joined.n_o.isna() | joined.n_e.isna() | (joined.n_o != joined.n_e) |
                     ((joined.total_o - joined.total_e).abs() >
                      TOLERANCE * joined.total_e.abs().clip(lower=1.0))]
        result["check"] = {"output_rows": len(out), "keys": int(out.key.nunique()),
                           "sum_n": int(out.n.sum()), "sum_total": float(out.total.sum()),
                           "mismatches": len(bad),
                           "examples": bad.head(3).astype(str).to_dict("records")}
        result["code"] = "pyflink"
        return result

    def run(self, scenario: str, system: str, data: str, **opts: Any) -> dict:
        if system == "flink":
            return self.run_flink(data)
        d = self.data[data]
        opts.setdefault("checkpoint_ms", 10000)
        opts.setdefault("batch_interval", 0.5)
        label = f"{scenario}-{system}" + (f"-{opts['tag']}" if "tag" in opts else "")
        opts.pop("tag", None)
        if data == "totals" and self.args.input_format != "parquet":
            opts["input_format"] = self.args.input_format
        return run_child(scenario, system, self.base / "work" / label, input=d["input"],
                         expected=d["expected"], **opts)

    def report(self, label: str, result: dict) -> None:
        brief = {k: v for k, v in result.items()
                 if k not in ("batch_ms", "batch_start_ms", "batch_rows", "end_ms",
                              "allocation_ms", "state_ms", "checkpoints", "state_rows",
                              "code")}
        if "check" in brief:
            brief["check"] = {k: v for k, v in brief["check"].items() if k != "examples"}
        print(f"  {label}: {json.dumps(brief)}", flush=True)

    # -- scenarios -----------------------------------------------------------------------
    def agg_family(self) -> dict[str, list[dict]]:
        """The runs over the agg input: Structured Streaming (agg), spark_ckpt checkpointing every
        10 s (agg and interval), spark_ckpt with only the final checkpoint (interval); one
        rotation per repetition, so the arms the two scenarios share are measured once."""
        if self._agg_runs is None:
            configs: dict[str, tuple[str, int]] = {}
            if "agg" in self.scenarios:
                configs["ss"] = ("ss", 10000)
            configs["ckpt"] = ("ckpt", 10000)
            if "interval" in self.scenarios:
                configs["ckpt_final_only"] = ("ckpt", 0)
            if "agg" in self.scenarios and self.args.pyflink:
                configs["flink"] = ("flink", 10000)
            runs: dict[str, list[dict]] = {k: [] for k in configs}
            for rep in range(self.args.reps):
                for name in orders(list(configs), rep):
                    system, interval_ms = configs[name]
                    r = self.run("agg", system, "agg", checkpoint_ms=interval_ms, tag=name) \
                        if system != "flink" else self.run_flink("agg")
                    if system == "ckpt":
                        r["completed_checkpoints"] = sum(1 for c in r["checkpoints"]
                                                         if c["status"] == "completed")
                    runs[name].append(r)
                    self.report(f"rep {rep + 1} agg {name}", r)
            check_digests("agg", runs, self.errors)
            self._agg_runs = runs
        return self._agg_runs

    def agg(self) -> dict:
        family = self.agg_family()
        runs = {"ss": family["ss"], "ckpt": family["ckpt"]}
        extra: dict[str, Any] = {}
        if "flink" in family:
            runs["flink"] = family["flink"]
            fl = [rate(r) for r in family["flink"]]
            extra = {"flink_rows_per_s": fl, "flink_rows_per_s_median": med(fl),
                     "flink_seconds": [r["seconds"] for r in family["flink"]],
                     "throughput_ratio_ckpt_over_flink": ratio(
                         med([rate(r) for r in runs["ckpt"]]), med(fl))}
        ss = [rate(r) for r in runs["ss"]]
        ck = [rate(r) for r in runs["ckpt"]]
        ss_steady = [steady_rate(r) for r in runs["ss"]]
        ck_steady = [steady_rate(r) for r in runs["ckpt"]]
        return {"runs": runs, "summary": {
            "ss_rows_per_s": ss, "ckpt_rows_per_s": ck,
            "ss_rows_per_s_median": med(ss), "ckpt_rows_per_s_median": med(ck),
            "throughput_ratio_ckpt_over_ss": ratio(med(ck), med(ss)),
            "ss_seconds": [r["seconds"] for r in runs["ss"]],
            "ckpt_seconds": [r["seconds"] for r in runs["ckpt"]],
            # from the second batch's start to the end: without the cold first batch
            "ss_steady_rows_per_s": ss_steady, "ckpt_steady_rows_per_s": ck_steady,
            "steady_throughput_ratio_ckpt_over_ss": ratio(med(_known(ck_steady)),
                                                          med(_known(ss_steady)))} | extra}

    def totals(self) -> dict:
        """Keyed running totals of a few thousand keys merged into Delta by key."""
        runs: dict[str, list[dict]] = {"ss": [], "ckpt": []}
        for rep in range(self.args.reps):
            for system in orders(["ss", "ckpt"], rep):
                r = self.run("totals", system, "totals",
                             files_per_batch=self.sizes["totals_files_per_batch"])
                runs[system].append(r)
                self.report(f"rep {rep + 1} totals {system}", r)
        check_digests("totals", runs, self.errors)
        ss = [rate(r) for r in runs["ss"]]
        ck = [rate(r) for r in runs["ckpt"]]
        ss_b = [med(r["batch_ms"][1:]) for r in runs["ss"]]
        ck_b = [med(r["batch_ms"][1:]) for r in runs["ckpt"]]
        ss_steady = [steady_rate(r) for r in runs["ss"]]
        ck_steady = [steady_rate(r) for r in runs["ckpt"]]
        return {"runs": runs, "summary": {
            "ss_rows_per_s": ss, "ckpt_rows_per_s": ck,
            "ss_seconds": [r["seconds"] for r in runs["ss"]],
            "ckpt_seconds": [r["seconds"] for r in runs["ckpt"]],
            "throughput_ratio_ckpt_over_ss": ratio(med(ck), med(ss)),
            "ss_steady_rows_per_s": ss_steady, "ckpt_steady_rows_per_s": ck_steady,
            "steady_throughput_ratio_ckpt_over_ss": ratio(med(_known(ck_steady)),
                                                          med(_known(ss_steady))),
            "ss_batch_ms_median": ss_b, "ckpt_batch_ms_median": ck_b}}

    def process(self) -> dict:
        systems = ["ckpt_vec", "ckpt", "ss_apiws"]
        if self.args.pyflink:
            systems.append("flink")
        skip = {s for s in (self.args.process_skip or "").split(",") if s}
        unknown = skip - {*systems, "ss_tws"}
        if unknown:
            raise SystemExit(f"--process-skip: unknown arm(s) {sorted(unknown)}; expected "
                             f"some of {[*systems, 'ss_tws']}")
        systems = [s for s in systems if s not in skip]
        failures: dict[str, str] = {}
        if not self.args.tws:
            failures["ss_tws"] = "skipped (pass --tws)"
        elif not _has_module("google.protobuf"):
            # its Python side talks to the state server in protobuf messages
            failures["ss_tws"] = ("skipped: transformWithStateInPandas needs the protobuf "
                                  "package (google.protobuf), which is not installed")
        else:
            systems.append("ss_tws")
        for system, reason in failures.items():
            print(f"  process {system}: {reason}", flush=True)
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for rep in range(self.args.reps):
            for system in orders(systems, rep):
                if system in failures:
                    continue
                try:
                    r = self.run("process", system, "process")
                except ChildFailed as exc:
                    if system != "ss_tws":
                        raise
                    failures[system] = _error_tail(str(exc))
                    print(f"  rep {rep + 1} process {system}: FAILED, dropped: "
                          f"{failures[system]}", flush=True)
                    continue
                runs[system].append(r)
                self.report(f"rep {rep + 1} process {system}", r)
        runs = {k: v for k, v in runs.items() if v}
        check_digests("process", runs, self.errors)
        rates = {s: [rate(r) for r in v] for s, v in runs.items()}
        summary: dict[str, Any] = {f"{s}_rows_per_s": v for s, v in rates.items()}
        summary |= {f"{s}_rows_per_s_median": med(v) for s, v in rates.items()}
        steady = {s: _known([steady_rate(r) for r in v]) for s, v in runs.items()}
        summary |= {f"{s}_steady_rows_per_s": v for s, v in steady.items()}
        for mine in ("ckpt_vec", "ckpt"):
            for s in rates:
                if not s.startswith("ckpt"):
                    summary[f"throughput_ratio_{mine}_over_{s}"] = ratio(
                        med(rates.get(mine, [])), med(rates[s]))
                    summary[f"steady_throughput_ratio_{mine}_over_{s}"] = ratio(
                        med(steady.get(mine, [])), med(steady[s]))
        summary["throughput_ratio_ckpt_vec_over_ckpt"] = ratio(
            med(rates.get("ckpt_vec", [])), med(rates.get("ckpt", [])))
        if failures:
            summary["failed"] = failures
        return {"runs": runs, "summary": summary}

    def tiny(self) -> dict:
        runs: dict[str, list[dict]] = {"ss": [], "ckpt": [], "floor": []}
        for rep in range(self.args.reps):
            for system in orders(["ss", "ckpt", "floor"], rep):
                r = self.run("tiny", system, "tiny")
                runs[system].append(r)
                self.report(f"rep {rep + 1} tiny {system}", r)
        floor = [med(r["batch_ms"][TINY_WARMUP:]) for r in runs["floor"]]
        check_digests("tiny", {k: v for k, v in runs.items() if k != "floor"}, self.errors)
        ss = [med(r["batch_ms"][TINY_WARMUP:]) for r in runs["ss"]]
        ck = [med(r["batch_ms"][TINY_WARMUP:]) for r in runs["ckpt"]]
        ck_alloc = [med([b + a for b, a in zip(r["batch_ms"], r["allocation_ms"],
                                               strict=True)][TINY_WARMUP:])
                    for r in runs["ckpt"]]
        ss_wall = [_period(r["batch_start_ms"]) for r in runs["ss"]]
        ck_wall = [_period(r["batch_start_ms"]) for r in runs["ckpt"]]
        return {"runs": runs, "summary": {
            "ss_batch_ms_median": ss, "ckpt_batch_ms_median": ck,
            "ckpt_batch_plus_allocation_ms_median": ck_alloc,
            "batch_ms_ratio_ckpt_over_ss": ratio(med(ck), med(ss)),
            "batch_plus_allocation_ms_ratio_ckpt_over_ss": ratio(med(ck_alloc), med(ss)),
            "ss_batch_period_ms": ss_wall, "ckpt_batch_period_ms": ck_wall,
            "batch_period_ratio_ckpt_over_ss": ratio(med(ck_wall), med(ss_wall)),
            "floor_job_ms_median": floor,
            "floor_job_ratio_over_ss": ratio(med(floor), med(ss))}}

    def interval(self) -> dict:
        family = self.agg_family()
        runs = {"every_10s": family["ckpt"], "final_only": family["ckpt_final_only"]}
        on = [rate(r) for r in runs["every_10s"]]
        off = [rate(r) for r in runs["final_only"]]
        on_steady = [steady_rate(r) for r in runs["every_10s"]]
        off_steady = [steady_rate(r) for r in runs["final_only"]]
        return {"runs": runs, "shared_with_agg": "agg" in self.scenarios, "summary": {
            "every_10s_rows_per_s": on, "final_only_rows_per_s": off,
            "every_10s_checkpoints": [r["completed_checkpoints"] for r in runs["every_10s"]],
            "final_only_checkpoints": [r["completed_checkpoints"] for r in runs["final_only"]],
            "throughput_ratio_every_10s_over_final_only": ratio(med(on), med(off)),
            "every_10s_steady_rows_per_s": on_steady, "final_only_steady_rows_per_s": off_steady,
            "steady_throughput_ratio_every_10s_over_final_only": ratio(
                med(_known(on_steady)), med(_known(off_steady)))}}

    def incremental(self) -> dict:
        load = self.sizes["incr_load_files"]
        runs: dict[str, list[dict]] = {"ckpt": []}
        per_rep = []
        for rep in range(self.args.reps):
            r = self.run("incremental", "ckpt", "incremental", checkpoint_ms=1,
                         batch_interval=0.1)
            runs["ckpt"].append(r)
            done = [c for c in r["checkpoints"] if c["status"] == "completed"]
            loaded = [c for c in done if c["barrier_batch"] >= load - 1]
            first = loaded[0] if loaded else None
            later = [c for c in loaded[1:] if c["incremental_bytes"]]
            figures = {
                "checkpoints": len(done),
                "barrier_batches": [c["barrier_batch"] for c in done],
                "first_full_checkpoint": first["checkpoint_id"] if first else None,
                "first_full_bytes": first["full_bytes"] if first else None,
                "later_incremental_bytes": [c["incremental_bytes"] for c in later],
                "later_full_bytes": [c["full_bytes"] for c in later],
                "incremental_bytes_median": med([c["incremental_bytes"] for c in later]),
                "duration_ms": [c["duration_ms"] for c in done],
                "duration_ms_p99": percentile([c["duration_ms"] for c in done], 99),
                # trigger -> end includes waiting for the running batch to finish (the barrier
                # goes after it); barrier -> end is the checkpoint's own work
                "after_barrier_ms": [c["end_ms"] - c["barrier_ms"] for c in done],
                "after_barrier_ms_p99": percentile([c["end_ms"] - c["barrier_ms"]
                                                    for c in done], 99),
                "sync_ms_max": max((c["sync_ms"] for c in done), default=None),
                "async_ms_max": max((c["async_ms"] for c in done), default=None),
            }
            figures["incremental_over_full_median"] = ratio(figures["incremental_bytes_median"],
                                                            figures["first_full_bytes"])
            per_rep.append(figures)
            r["figures"] = figures
            self.report(f"rep {rep + 1} incremental ckpt",
                        {"seconds": r["seconds"], "batches": r["batches"], **figures,
                         "check": r["check"]})
        check_digests("incremental", runs, self.errors)
        return {"runs": runs, "summary": {
            "first_full_bytes": [f["first_full_bytes"] for f in per_rep],
            "incremental_bytes_median": [f["incremental_bytes_median"] for f in per_rep],
            "incremental_over_full_median": med([f["incremental_over_full_median"]
                                                 for f in per_rep
                                                 if f["incremental_over_full_median"]]),
            "checkpoint_duration_ms_p99": [f["duration_ms_p99"] for f in per_rep],
            "checkpoint_after_barrier_ms_p99": [f["after_barrier_ms_p99"] for f in per_rep],
            "sync_ms_max": [f["sync_ms_max"] for f in per_rep]}}

    def big(self) -> dict:
        """20,000,000 keys in the rocksdb backend: load them (every key once), then two runs
        on the same checkpoint with one more file each: the first finds the executor's RocksDB
        copies, the second has them deleted (a range moved to another executor) and restores
        from the durable chain. Rows per second, checkpoint bytes, restore times."""
        d = self.data["big"]
        work = self.base / "work" / "big"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        files = sorted(Path(d["input"]).glob("*.parquet"))
        held = self.base / "held-big"
        held.mkdir(exist_ok=True)
        for f in files[-2:]:  # the two later files wait outside the input directory
            os.replace(f, held / f.name)
        opts = {"work": work, "input": d["input"], "expected": d["expected"],
                "checkpoint_ms": 10000, "batch_interval": 0.5}
        runs: dict[str, list[dict]] = {}
        try:
            self._big_runs(work, held, files, opts, runs)
        finally:  # the input as it was generated, whatever happened
            for f in files[-2:]:
                if (held / f.name).exists():
                    os.replace(held / f.name, f)
        check_digests("big", {"restart_durable": runs["restart_durable"]}, self.errors)
        # the floor: per load file, the least Spark job a batch could be (read, partial
        # aggregation, shuffle into the two ranges, a Python task that passes the partials
        # through), no state, in a fresh driver like the load's
        floor_input = self.base / "floor-big"
        shutil.rmtree(floor_input, ignore_errors=True)
        floor_input.mkdir()
        for f in files[:-2]:
            os.symlink(f, floor_input / f.name)
        proc = subprocess.run(child_cmd("big", "floor", work=work, input=floor_input),
                              env=child_env(), capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0 or "RESULT " not in proc.stdout:
            raise ChildFailed(f"big/floor failed: {proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        runs["floor"] = [parse_result(proc.stdout)]
        self.report("big floor", runs["floor"][0])
        return self._big_summary(runs)

    def _big_runs(self, work: Path, held: Path, files: list[Path], opts: dict[str, Any],
                  runs: dict[str, list[dict]]) -> None:
        for label, extra in (("load", None), ("restart_local", files[-2]),
                             ("restart_durable", files[-1])):
            if extra is not None:
                os.replace(held / extra.name, extra)
            if label == "restart_durable":
                shutil.rmtree(work / "local", ignore_errors=True)
            cmd = child_cmd("big", "ckpt", **opts,
                            **({"skip_check": True} if label != "restart_durable" else {}))
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0 or "RESULT " not in proc.stdout:
                raise ChildFailed(f"big/{label} failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
            r = parse_result(proc.stdout)
            r["process_seconds"] = time.perf_counter() - t0
            r["checkpoint_dir_bytes"] = _tree_bytes(work / "ckpt")
            r["local_dir_bytes"] = _tree_bytes(work / "local")
            runs[label] = [r]
            self.report(f"big {label}", r | {"restore_ms": r["restore_ms"],
                                              "state_rows": r["state_rows"][-1:]})

    @staticmethod
    def _big_summary(runs: dict[str, list[dict]]) -> dict:
        load = runs["load"][0]
        done = [c for c in load["checkpoints"] if c["status"] == "completed"]
        return {"runs": runs, "summary": {
            "keys": runs["restart_durable"][0]["check"]["keys"],
            "load_rows_per_s": rate(load), "load_seconds": load["seconds"],
            # the backend alone: rows a task applied per second of applying them
            "load_apply_rows_per_s_per_task": _apply_rate(load),
            "load_batch_ms": load["batch_ms"],
            "load_checkpoints": len(done),
            "load_checkpoint_full_bytes": [c["full_bytes"] for c in done],
            "load_checkpoint_incremental_bytes": [c["incremental_bytes"] for c in done],
            "load_checkpoint_duration_ms": [c["duration_ms"] for c in done],
            "checkpoint_dir_bytes": load["checkpoint_dir_bytes"],
            "local_rocksdb_bytes": load["local_dir_bytes"],
            "restart_local_batch_ms": runs["restart_local"][0]["batch_ms"],
            "restart_local_restore_ms": runs["restart_local"][0]["restore_ms"],
            "restart_local_tasks": runs["restart_local"][0]["state_tasks"],
            "restart_durable_batch_ms": runs["restart_durable"][0]["batch_ms"],
            "restart_durable_restore_ms": runs["restart_durable"][0]["restore_ms"],
            "restart_durable_tasks": runs["restart_durable"][0]["state_tasks"],
            "restart_durable_seconds": runs["restart_durable"][0]["seconds"],
            "floor_batch_ms": runs["floor"][0]["batch_ms"],
            # the load's rows over the floor's jobs' time: the most a pipeline could load
            "floor_rows_per_s": load["rows"] * 1000 / max(sum(runs["floor"][0]["batch_ms"]), 1),
            "load_batch_ms_over_floor": (sum(load["batch_ms"][:len(runs["floor"][0]["batch_ms"])])
                                         / max(sum(runs["floor"][0]["batch_ms"]), 1))}}

    def restart(self) -> dict:
        runs: dict[str, list[dict]] = {"ss": [], "ckpt": []}
        for rep in range(self.args.reps):
            for system in orders(["ss", "ckpt"], rep):
                r = self.restart_once(system, rep)
                runs[system].append(r)
                self.report(f"rep {rep + 1} restart {system}", r)
        check_digests("restart", runs, self.errors)
        floor = []  # the floor: a fresh driver's first Python job writing a file
        for rep in range(self.args.reps):
            work = self.base / "work" / "restart-floor"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            t0 = time.time()
            proc = subprocess.Popen(child_cmd("restart", "floor", work=work,
                                              input=self.data["restart"]["input"],
                                              expected="-", skip_check=True),
                                    env=child_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            out_dir = work / "out"
            first = None
            while proc.poll() is None and first is None:
                if any(out_dir.glob("part-*")):
                    first = time.time() - t0
                time.sleep(0.01)
            stdout = proc.communicate()[0]
            if proc.returncode != 0:
                raise ChildFailed(f"restart/floor failed: {stdout[-4000:]}")
            floor.append(first if first is not None else time.time() - t0)
            print(f"  rep {rep + 1} restart floor: {floor[-1]:.2f} s", flush=True)
        ss = [r["first_output_s"] for r in runs["ss"]]
        ck = [r["first_output_s"] for r in runs["ckpt"]]
        ss_r = [r["first_output_after_ready_s"] for r in runs["ss"]]
        ck_r = [r["first_output_after_ready_s"] for r in runs["ckpt"]]
        return {"runs": runs, "summary": {
            "ss_first_output_s": ss, "ckpt_first_output_s": ck,
            "ss_first_output_s_median": med(ss), "ckpt_first_output_s_median": med(ck),
            "first_output_ratio_ckpt_over_ss": ratio(med(ck), med(ss)),
            "ss_first_output_after_session_s": ss_r, "ckpt_first_output_after_session_s": ck_r,
            "first_output_after_session_ratio_ckpt_over_ss": ratio(med(ck_r), med(ss_r)),
            "floor_first_output_s": floor,
            "floor_ratio_over_ss": ratio(med(floor), med(ss))}}

    def restart_once(self, system: str, rep: int) -> dict:
        """SIGKILL the driver after a few committed outputs, start it again, time the first
        new output file."""
        d = self.data["restart"]
        kill_after = self.sizes["restart_kill_after"]
        work = self.base / "work" / f"restart-{system}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        out = work / "out"
        markers = out / "_spark_ckpt_commits" if system == "ckpt" else work / "ckpt" / "commits"
        cmd = child_cmd("restart", system, work=work, input=d["input"], expected=d["expected"],
                        checkpoint_ms=self.sizes["restart_checkpoint_ms"], batch_interval=0.5)

        def start(log: str) -> tuple[subprocess.Popen, Any]:
            fh = open(work / log, "w")  # closed below
            return subprocess.Popen(cmd, env=child_env(), stdout=fh, stderr=subprocess.STDOUT,
                                    cwd=ROOT, start_new_session=True), fh

        first, fh = start("first.log")
        t0 = time.time()
        try:
            while _commits(markers, system) < kill_after:
                if first.poll() is not None:
                    raise ChildFailed(
                        f"restart/{system}: the first driver ended (exit {first.returncode}) "
                        f"before {kill_after} committed outputs; use more --restart-files\n"
                        f"{(work / 'first.log').read_text()[-4000:]}")
                if time.time() - t0 > 3600:
                    raise ChildFailed(f"restart/{system}: no {kill_after} commits in an hour")
                time.sleep(0.02)
            os.killpg(first.pid, signal.SIGKILL)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            fh.close()
        killed_after_s = time.time() - t0
        committed_before = _commits(markers, system)
        before = _outputs(out)
        second, fh = start("second.log")
        t1 = time.time()
        first_output = None
        try:
            while first_output is None:
                if _outputs(out) - before:
                    first_output = time.time() - t1
                    break
                if second.poll() is not None:
                    break
                time.sleep(0.01)
            second.wait(timeout=3600)
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
                second.wait()
            fh.close()
        log = (work / "second.log").read_text()
        if second.returncode != 0 or first_output is None:
            raise ChildFailed(f"restart/{system}: the restarted driver exited "
                              f"{second.returncode}, new output: {first_output}\n{log[-6000:]}")
        ready = next(float(li.split()[1]) for li in log.splitlines() if li.startswith("READY "))
        result = parse_result(log)
        return {"first_output_s": first_output,
                "first_output_after_ready_s": first_output - (ready - t1),
                "session_ready_s": ready - t1, "killed_after_s": killed_after_s,
                "commits_before_kill": committed_before,
                "output_files_before_restart": len(before),
                "restarted_run_seconds": result["seconds"],
                "restarted_run_batches": result["batches"], "check": result["check"],
                "code": result["code"]}


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def _period(starts: list[int]) -> float | None:
    """Milliseconds from one batch's start to the next, after the warm-up batches."""
    steady = starts[TINY_WARMUP:]
    return (steady[-1] - steady[0]) / (len(steady) - 1) if len(steady) > 1 else None


def _names(directory: Path, suffix: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory)
                if not n.startswith((".", "_")) and n.endswith(suffix)]
    except FileNotFoundError:
        return []


def _commits(directory: Path, system: str) -> int:
    """Committed outputs so far: Structured Streaming's commit log entries, or spark_ckpt's
    Parquet commit markers once they say committed (a marker is created before the files
    move into place, and rewritten when they have)."""
    if system != "ckpt":
        return len(_names(directory, ""))
    done = 0
    for name in _names(directory, ".json"):
        try:
            done += '"status":"committed"' in (directory / name).read_text()
        except OSError:
            pass
    return done


def _outputs(directory: Path) -> set[str]:
    return set(_names(directory, ".parquet"))


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _error_tail(text: str) -> str:
    lines = [li for li in text.splitlines() if li.strip()]
    errors = [li for li in lines if "Error" in li or "Exception" in li]
    return (errors[-1] if errors else lines[-1] if lines else text)[:500]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in SCENARIOS:
        parser.add_argument(f"--{name}", action="store_true", help=f"run the {name} scenario")
    parser.add_argument("--small", action="store_true", help="toy sizes, to check the script")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--pyflink", default=None, metavar="PYTHON",
                        help="add PyFlink to the process scenario: the interpreter of a "
                        "virtualenv with apache-flink (see scripts/bench_pyflink.py)")
    parser.add_argument("--tws", action="store_true",
                        help="add transformWithStateInPandas to the process scenario")
    parser.add_argument("--process-skip", default=None, metavar="ARMS",
                        help="comma-separated arms of the process scenario to leave out "
                        "(ckpt_vec, ckpt, ss_apiws, flink): the two long anchors take 70 and "
                        "90 minutes, so each can run with the spark_ckpt arms on its own")
    for key, (full, small) in SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                            help=f"default {full} ({small} with --small)")
    # child mode
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for option in ("scenario", "system", "work", "input", "expected", "spec"):
        parser.add_argument(f"--{option}", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-ms", type=int, default=10000, help=argparse.SUPPRESS)
    parser.add_argument("--batch-interval", type=float, default=0.5, help=argparse.SUPPRESS)
    parser.add_argument("--files-per-batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--skip-check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--input-format", choices=["parquet", "json"], default="parquet",
                        help="the totals scenario's input: its Parquet files, or the same rows "
                        "as JSON lines (one JSON file per Parquet file, same order)")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    scenarios = [s for s in SCENARIOS if getattr(args, s)] or list(SCENARIOS)
    base = Path(tempfile.mkdtemp(prefix="spark-ckpt-bench-state-"))
    bench = Bench(args, base)
    bench.scenarios = scenarios
    date = time.strftime("%Y-%m-%d")
    default_json = (base / f"benchmarks-state-small-{date}.json" if args.small
                    else ROOT / "benchmarks" / "results" / f"benchmarks-state-{date}.json")
    json_path = Path(args.json) if args.json else default_json
    figures: dict[str, Any] = {}
    if json_path.is_file():
        figures = json.loads(json_path.read_text())
    figures.update({
        "date": date,
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "code_at_start": code_version(),
    })
    figures.setdefault("scenarios", {})
    t_all = time.perf_counter()
    print(f"sizes: {json.dumps(bench.sizes)}", flush=True)
    print(f"generating input for {', '.join(scenarios)} in {base}", flush=True)
    gen_s = bench.generate(scenarios)
    print(f"  generated in {gen_s:.1f} s: "
          f"{json.dumps({k: int(v['rows']) for k, v in bench.data.items()})}", flush=True)
    failed: dict[str, str] = {}
    for scenario in scenarios:
        print(f"== {scenario}", flush=True)
        t0 = time.perf_counter()
        try:
            entry = getattr(bench, scenario)()
        except ChildFailed as exc:
            failed[scenario] = str(exc)
            print(f"  FAILED: {exc}", flush=True)
            figures["scenarios"][scenario] = {"date": date, "error": str(exc)[-4000:]}
            continue
        versions = sorted({r.get("code") or "unknown" for rs in entry["runs"].values() for r in rs})
        entry["code_versions"] = versions
        if len(versions) > 1:
            print(f"  WARNING: spark_ckpt changed during {scenario}: {versions}", flush=True)
        entry["date"] = date
        entry["sizes"] = bench.sizes
        entry["reps"] = args.reps
        entry["scenario_seconds"] = time.perf_counter() - t0
        figures["scenarios"][scenario] = entry
        print(f"-- {scenario} summary ({entry['scenario_seconds']:.0f} s):", flush=True)
        print(json.dumps(entry["summary"], indent=2), flush=True)
    figures["errors"] = bench.errors
    figures["total_seconds"] = time.perf_counter() - t_all
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {json_path} ({figures['total_seconds']:.0f} s in all)", flush=True)
    shutil.rmtree(base / "work", ignore_errors=True)
    shutil.rmtree(base / "input", ignore_errors=True)
    shutil.rmtree(base / "expected", ignore_errors=True)
    if bench.errors or failed:
        for error in bench.errors:
            print(f"CHECK FAILED: {error}", file=sys.stderr)
        for scenario in failed:
            print(f"SCENARIO FAILED: {scenario}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
