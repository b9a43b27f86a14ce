"""The stateful-counts pipeline (jobs/stateful_counts.py) with its events also written to a
Parquet directory, for tests/test_s3.py: checkpoint and outputs on S3.

    python tests/s3_pipeline.py --checkpoint s3a://B/ckpt --output s3a://B/out --total-rows N

Runs until the source is exhausted (available-now); prints RESULT at the end."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))

from stateful_counts import EVENTS_SCHEMA, Printer, Sequencer

from spark_ckpt import StreamingContext, get_or_create_session
from spark_ckpt.options import Settings
from spark_ckpt.state import count, sum_


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--total-rows", type=int, default=1_000)
    parser.add_argument("--keys", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spark = get_or_create_session("s3-pipeline")
    settings = Settings.from_conf(spark.conf, checkpoint_interval_ms=500,
                                  state_parallelism=2, progress="never")
    ctx = StreamingContext(spark, 0.1, args.checkpoint, "s3-counts", settings=settings)
    ids = ctx.generator_stream("ids", rows_per_batch=200, total_rows=args.total_rows,
                               keys=args.keys)
    keyed = ids.key_by("key")
    events = keyed.process(Sequencer(), EVENTS_SCHEMA, name="sequencer")
    events.write_delta(f"{args.output}/events", name="events")
    events.write_parquet(f"{args.output}/events_parquet", name="events_parquet")
    keyed.agg(name="totals", n=count(), total=sum_("value")) \
        .write_delta(f"{args.output}/totals", name="totals", merge_keys=["key"])
    ctx.add_listener(Printer())
    progress = ctx.process_available()
    print(f"RESULT batches={len(progress)} "
          f"recovered={sum(1 for p in progress if p['recovered'])}", flush=True)


if __name__ == "__main__":
    main()
