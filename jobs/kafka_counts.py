"""Example Kafka pipeline: per-key counts and sums of a topic's records, exactly once, into Delta.

    spark-submit jobs/kafka_counts.py --bootstrap HOST:PORT --topic T --checkpoint CKPT
        --output OUT [--max-offsets N] [--reader auto|python|spark] [--available-now]

Each record's key is a key name and its value a JSON object ``{"amount": <integer>}``. The
pipeline keeps per key the number of records and the sum of the amounts (``OUT/totals``, merged
by key) and writes every record's topic, partition and offset (``OUT/records``, appended),
both through two-phase commits visible when a checkpoint completes. Kill the driver at any
moment and run the same command again: each offset of the topic is in ``OUT/records`` once,
and the totals are those of the topic's records (tests/test_kafka.py does it with SIGKILLs).
"""

from __future__ import annotations

import argparse
import logging

from pyspark.sql import functions as F

from spark_ckpt import StreamingContext, StreamingListener, get_or_create_session
from spark_ckpt.options import Settings
from spark_ckpt.state import count, sum_


class Printer(StreamingListener):
    def on_batch_completed(self, progress):
        print(f"PROGRESS batch={progress['batch_id']} rows={progress['num_input_rows']}",
              flush=True)


def build_pipeline(spark, bootstrap: str, topic: str, checkpoint: str, output: str, *,
                   max_offsets: int | None = None, reader: str = "auto",
                   settings: Settings | None = None, interval: float = 0.2,
                   options: dict[str, str] | None = None) -> StreamingContext:
    ctx = StreamingContext(spark, interval, checkpoint, "kafka-counts", settings=settings)
    records = ctx.kafka_stream("records", bootstrap, topics=[topic],
                               starting_offsets="earliest", max_offsets_per_batch=max_offsets,
                               reader=reader, options=options)
    parsed = records.select(
        F.col("key").cast("string").alias("k"),
        F.get_json_object(F.col("value").cast("string"), "$.amount").cast("long")
        .alias("amount"),
        "topic", "partition", "offset")
    parsed.select("topic", "partition", "offset", "k") \
        .write_delta(f"{output}/records", name="records")
    parsed.key_by("k").agg(name="totals", n=count(), total=sum_("amount")) \
        .write_delta(f"{output}/totals", name="totals", merge_keys=["k"])
    ctx.add_listener(Printer())
    return ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--max-offsets", type=int, default=None)
    parser.add_argument("--reader", default="auto")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--checkpoint-ms", type=int, default=1000)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--available-now", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spark = get_or_create_session("kafka-counts")
    settings = Settings.from_conf(spark.conf, checkpoint_interval_ms=args.checkpoint_ms,
                                  state_parallelism=args.parallelism, progress="never")
    ctx = build_pipeline(spark, args.bootstrap, args.topic, args.checkpoint, args.output,
                         max_offsets=args.max_offsets, reader=args.reader, settings=settings,
                         interval=args.interval)
    if args.available_now:
        progress = ctx.process_available()
    else:
        ctx.start()
        ctx.await_termination()
        progress = ctx.recent_progress
    print(f"RESULT batches={len(progress)}", flush=True)


if __name__ == "__main__":
    main()
