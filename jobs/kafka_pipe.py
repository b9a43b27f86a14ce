"""Example Kafka-to-Kafka pipeline, exactly once: a keyed processor numbers each key's records.

    spark-submit jobs/kafka_pipe.py --bootstrap HOST:PORT --source-topic IN --sink-topic OUT
        --checkpoint CKPT --output OUT [--max-offsets N] [--available-now]

Each input record's key is a key name and its value a JSON object ``{"id": <integer>}``. A
KeyedProcessor keeps per key how many records it has seen and emits, for each record in offset
order, ``{"key", "id", "seq"}`` (``seq``: 1, 2, 3... per key). The output goes to the Kafka
topic ``OUT`` (exactly once: visible to ``read_committed`` consumers when a checkpoint
completes) and to the Delta table ``OUTPUT/seq``. Kill the driver, an executor's Python worker
or a broker at any moment and run the command again: a ``read_committed`` consumer of ``OUT``
sees every id once, each key's ``seq`` counting 1, 2, 3... in order, and the Delta table has
the same rows (tests/test_kafka.py).
"""

from __future__ import annotations

import argparse
import logging
import os

from pyspark.sql import functions as F

from spark_ckpt import KeyedProcessor, StreamingContext, get_or_create_session
from spark_ckpt.options import Settings

OUT_SCHEMA = "k STRING, id BIGINT, seq BIGINT"


class Numbering(KeyedProcessor):
    """Numbers each key's records in (partition, offset) order."""

    state_schema = "seen BIGINT"

    def process(self, key, rows, ctx):
        seen = ctx.value("seen")
        n = seen.get() or 0
        order = rows["offset"].argsort(kind="stable")
        for i in rows["id"][order].tolist():
            n += 1
            yield (key[0], int(i), n)
        seen.update(n)


def build_pipeline(spark, bootstrap: str, source_topic: str, sink_topic: str, checkpoint: str,
                   output: str, *, max_offsets: int | None = None,
                   settings: Settings | None = None,
                   interval: float = 0.2) -> StreamingContext:
    ctx = StreamingContext(spark, interval, checkpoint, "kafka-pipe", settings=settings)
    records = ctx.kafka_stream("in", bootstrap, topics=[source_topic],
                               starting_offsets="earliest", max_offsets_per_batch=max_offsets)
    parsed = records.select(
        F.col("key").cast("string").alias("k"),
        F.get_json_object(F.col("value").cast("string"), "$.id").cast("long").alias("id"),
        "offset")
    numbered = parsed.key_by("k").process(Numbering(), OUT_SCHEMA, name="numbering")
    numbered.select(F.col("k").alias("key"),
                    F.to_json(F.struct("k", "id", "seq")).alias("value")) \
        .write_kafka(bootstrap, topic=sink_topic, name="out")
    numbered.write_delta(f"{output}/seq", name="seq")
    return ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--source-topic", required=True)
    parser.add_argument("--sink-topic", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--max-offsets", type=int, default=None)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--checkpoint-ms", type=int, default=1000)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--available-now", action="store_true")
    parser.add_argument("--master", default=None,
                        help="a master URL (the tests run local-cluster[2,1,1024] to kill an "
                        "executor); default: the defaults file's or spark-submit's")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    conf = {}
    if args.master:
        conf["spark.master"] = args.master
        # a fault point reached in an executor's Python worker (the tests): its environment
        for name in ("SPARK_CKPT_FAULT", "SPARK_CKPT_FAULT_ONCE"):
            if os.environ.get(name):
                conf[f"spark.executorEnv.{name}"] = os.environ[name]
    spark = get_or_create_session("kafka-pipe", conf=conf)
    settings = Settings.from_conf(spark.conf, checkpoint_interval_ms=args.checkpoint_ms,
                                  state_parallelism=args.parallelism, progress="never")
    ctx = build_pipeline(spark, args.bootstrap, args.source_topic, args.sink_topic,
                         args.checkpoint, args.output, max_offsets=args.max_offsets,
                         settings=settings, interval=args.interval)
    if args.available_now:
        progress = ctx.process_available()
    else:
        ctx.start()
        ctx.await_termination()
        progress = ctx.recent_progress
    print(f"RESULT batches={len(progress)}", flush=True)


if __name__ == "__main__":
    main()
