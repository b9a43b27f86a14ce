"""Example stateful pipeline: per-key running counts with barrier checkpoints, exactly once.

    spark-submit jobs/stateful_counts.py --checkpoint CKPT --output OUT [--total-rows N]
        [--rows-per-batch N] [--keys K] [--interval S] [--checkpoint-ms MS] [--available-now]

A deterministic source emits unique, increasing ids; ``key = id % keys``. A KeyedProcessor keeps
per key the number of rows seen and the last id, and emits for every row
``(key, id, seq, prev_id)``: ``seq`` is the row's position in its key's sequence and ``prev_id``
the id before it. Both go to Delta tables through two-phase commits (visible when a checkpoint
completes): ``OUT/events`` (append) and ``OUT/totals`` (count and sum per key, merged by key).
Kill the driver at any moment and run the same command again: every id shows exactly once,
``seq`` counts 1, 2, 3... per key with no gap, and ``prev_id`` chains the ids in order. That is
Flink's exactly-once check, which tests/test_checkpoint_recovery.py runs through nine SIGKILLs
(and 20+ with SPARK_CKPT_LONG_FAULTS=1).
"""

from __future__ import annotations

import argparse
import logging

from spark_ckpt import (
    KeyedProcessor,
    Result,
    StreamingContext,
    StreamingListener,
    VectorizedProcessor,
    get_or_create_session,
)
from spark_ckpt.options import Settings
from spark_ckpt.state import count, sum_

EVENTS_SCHEMA = "key BIGINT, id BIGINT, seq BIGINT, prev_id BIGINT"


class Sequencer(KeyedProcessor):
    """Numbers each key's rows in id order and links each to the id before it."""

    state_schema = "seen BIGINT, last_id BIGINT"

    def process(self, key, rows, ctx):
        seen = ctx.value("seen")
        last = ctx.value("last_id")
        n, prev = seen.get() or 0, last.get()
        for i in sorted(rows["id"].tolist()):
            n += 1
            yield (key[0], i, n, prev)
            prev = i
        seen.update(n)
        last.update(prev)


class VectorizedSequencer(VectorizedProcessor):
    """The Sequencer with the vectorized API: every key of a task's range in one call."""

    state_schema = "seen BIGINT, last_id BIGINT"

    def process_batch(self, batch):
        import numpy as np
        import pandas as pd

        ids = batch.rows["id"].to_numpy("int64")
        order = np.lexsort((ids, batch.group))  # by key, then id
        group, ids = batch.group[order], ids[order]
        rank = np.arange(len(ids)) - batch.offsets[group]  # position within the key
        seen = batch.state["seen"].fillna(0).to_numpy("int64")
        last = batch.state["last_id"]
        prev = pd.array(np.roll(ids, 1), dtype="Int64")
        first = rank == 0
        prev[first] = pd.array(last.to_numpy()[group[first]], dtype="Int64")
        out = pd.DataFrame({"key": batch.keys["key"].to_numpy()[group], "id": ids,
                            "seq": seen[group] + rank + 1, "prev_id": prev})
        ends = batch.offsets[1:] - 1  # each key's last row, in sorted order
        return Result(state=pd.DataFrame({"seen": seen + batch.sizes, "last_id": ids[ends]}),
                      emit=out)


class Printer(StreamingListener):
    def on_batch_completed(self, progress):
        print(f"PROGRESS batch={progress['batch_id']} recovered={progress['recovered']}",
              flush=True)

    def on_checkpoint(self, stats):
        print(f"CHECKPOINT id={stats['checkpoint_id']} status={stats['status']} "
              f"batch={stats['barrier_batch']}", flush=True)


def build_pipeline(spark, checkpoint: str, output: str, *, total_rows: int = 12_000,
                   rows_per_batch: int = 200, keys: int = 10, interval: float = 0.2,
                   settings: Settings | None = None,
                   vectorized: bool = False) -> StreamingContext:
    ctx = StreamingContext(spark, interval, checkpoint, "stateful-counts", settings=settings)
    ids = ctx.generator_stream("ids", rows_per_batch=rows_per_batch, total_rows=total_rows,
                               keys=keys)
    keyed = ids.key_by("key")
    keyed.process(VectorizedSequencer() if vectorized else Sequencer(), EVENTS_SCHEMA,
                  name="sequencer") \
        .write_delta(f"{output}/events", name="events")
    keyed.agg(name="totals", n=count(), total=sum_("value")) \
        .write_delta(f"{output}/totals", name="totals", merge_keys=["key"])
    ctx.add_listener(Printer())
    return ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--total-rows", type=int, default=12_000)
    parser.add_argument("--rows-per-batch", type=int, default=200)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--checkpoint-ms", type=int, default=1000)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--available-now", action="store_true")
    parser.add_argument("--vectorized", action="store_true",
                        help="the sequencer as a VectorizedProcessor")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spark = get_or_create_session("stateful-counts")
    settings = Settings.from_conf(spark.conf, checkpoint_interval_ms=args.checkpoint_ms,
                                  state_parallelism=args.parallelism, progress="never")
    ctx = build_pipeline(spark, args.checkpoint, args.output, total_rows=args.total_rows,
                         rows_per_batch=args.rows_per_batch, keys=args.keys,
                         interval=args.interval, settings=settings,
                         vectorized=args.vectorized)
    if args.available_now:
        progress = ctx.process_available()
    else:
        ctx.start()
        ctx.await_termination()
        progress = ctx.recent_progress
    print(f"RESULT batches={len(progress)} "
          f"recovered={sum(1 for p in progress if p['recovered'])}", flush=True)


if __name__ == "__main__":
    main()
