"""PyFlink arm of ``bench_state.py --process``: the same per-key running count and sum in a
Python ``KeyedProcessFunction`` with ``ValueState``, on Flink's RocksDB state backend with
incremental checkpoints every 10 s, parallelism 2, over the same rows. With ``--agg``, the arm
of ``bench_state.py --agg``: the keyed count/sum as a Flink SQL ``GROUP BY``.

Run by bench_state.py with the interpreter of a virtualenv that has ``apache-flink`` (PyFlink
bundles Flink's jars and runs a local mini-cluster on Java 17)::

    python -m venv /opt/flinkenv && /opt/flinkenv/bin/pip install apache-flink
    python scripts/bench_state.py --process --pyflink /opt/flinkenv/bin/python

Input: the benchmark's Parquet files as CSV copies (PyFlink ships no Parquet format jar), read
by Flink's filesystem source. Every key has the same number of rows, so the function emits a
key's totals when its count reaches that number: one output row per key, written as CSV and
checked against the expected totals by the parent. Prints ``RESULT {json}`` like the other
children: wall time from job submission to its end (the mini-cluster's start is before).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", help="directory of the input as CSV files")
    parser.add_argument("--kafka", help="bootstrap servers: read topic --topic instead "
                        "(scripts/bench_kafka.py), its JSON records, bounded at the latest "
                        "offsets when the job starts")
    parser.add_argument("--topic", default="events")
    parser.add_argument("--jars", default="", help="';'-separated connector jars (file URLs)")
    parser.add_argument("--work", required=True)
    parser.add_argument("--rows-per-key", type=int, required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--agg", action="store_true",
                        help="the keyed count/sum in Flink SQL (GROUP BY) instead of the "
                        "Python KeyedProcessFunction")
    parser.add_argument("--cache-size", type=int, default=1_000_000,
                        help="python.state.cache-size (keys cached in the Python worker)")
    args = parser.parse_args()

    from pyflink.common import Configuration, Types
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.datastream.functions import KeyedProcessFunction, RuntimeContext
    from pyflink.datastream.state import ValueStateDescriptor
    from pyflink.table import StreamTableEnvironment

    conf = Configuration()
    conf.set_string("state.backend.type", "rocksdb")
    conf.set_string("execution.checkpointing.incremental", "true")
    conf.set_string("execution.checkpointing.dir", f"file://{args.work}/ckpt")
    conf.set_string("python.state.cache-size", str(args.cache_size))
    if args.jars:
        conf.set_string("pipeline.jars", args.jars)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(2)
    env.enable_checkpointing(10_000)
    t_env = StreamTableEnvironment.create(env)
    if args.kafka:
        run_kafka(t_env, args)
        return
    t_env.execute_sql(f"""CREATE TABLE src (id BIGINT, `key` BIGINT, `value` DOUBLE,
        event_time STRING) WITH ('connector' = 'filesystem', 'path' = 'file://{args.csv}',
        'format' = 'csv')""")
    target = args.rows_per_key
    if args.agg:
        run_agg(t_env, args)
        return
    rows = t_env.to_data_stream(t_env.sql_query("SELECT `key`, `value` FROM src"))

    class Running(KeyedProcessFunction):
        def open(self, ctx: RuntimeContext) -> None:
            self.state = ctx.get_state(ValueStateDescriptor(
                "running", Types.TUPLE([Types.LONG(), Types.DOUBLE()])))

        def process_element(self, row, ctx):
            current = self.state.value()
            n, total = (current[0], current[1]) if current is not None else (0, 0.0)
            n += 1
            total += row[1]
            self.state.update((n, total))
            if n == target:
                yield row[0], n, total

    out = rows.key_by(lambda r: r[0], key_type=Types.LONG()).process(
        Running(), output_type=Types.TUPLE([Types.LONG(), Types.LONG(), Types.DOUBLE()]))
    t_env.create_temporary_view("totals", t_env.from_data_stream(out))
    t_env.execute_sql(f"""CREATE TABLE sink (`key` BIGINT, n BIGINT, total DOUBLE) WITH (
        'connector' = 'filesystem', 'path' = 'file://{args.work}/out', 'format' = 'csv')""")
    print(f"READY {time.time():.3f}", flush=True)
    t0 = time.perf_counter()
    t_env.execute_sql("INSERT INTO sink SELECT * FROM totals").wait()
    seconds = time.perf_counter() - t0
    print("RESULT " + json.dumps({"seconds": seconds, "rows": args.rows, "batches": 1}),
          flush=True)


def run_agg(t_env, args: argparse.Namespace) -> None:
    """What a PyFlink user writes for a keyed count/sum: a SQL GROUP BY (Flink's own operator
    in the JVM; the state in RocksDB). Its update stream is filtered to each key's final row
    (every key has ``rows_per_key`` rows) and printed by the ``print`` connector, which takes
    updates (the filesystem sink takes only appends); the parent parses those lines."""
    t_env.execute_sql("""CREATE TABLE sink (`key` BIGINT, n BIGINT, total DOUBLE)
        WITH ('connector' = 'print', 'print-identifier' = 'OUT')""")
    print(f"READY {time.time():.3f}", flush=True)
    t0 = time.perf_counter()
    t_env.execute_sql(f"""INSERT INTO sink SELECT `key`, n, total FROM (
        SELECT `key`, COUNT(*) AS n, SUM(`value`) AS total FROM src GROUP BY `key`)
        WHERE n = {args.rows_per_key}""").wait()
    seconds = time.perf_counter() - t0
    print("RESULT " + json.dumps({"seconds": seconds, "rows": args.rows, "batches": 1}),
          flush=True)


def run_kafka(t_env, args: argparse.Namespace) -> None:
    """What a Flink SQL user writes for bench_kafka.py's keyed count/sum: a Kafka table in
    Flink's JSON format (Flink's Kafka connector, bounded at the offsets that are the latest
    when the job starts, as an available-now run), a ``GROUP BY`` (RocksDB, incremental
    checkpoints every 10 s), each key's final row printed (every key has ``rows_per_key``
    records) for the parent to check."""
    t_env.execute_sql(f"""CREATE TABLE src (`key` BIGINT, carrier STRING, `value` DOUBLE,
        event_time BIGINT, note STRING) WITH ('connector' = 'kafka', 'topic' = '{args.topic}',
        'properties.bootstrap.servers' = '{args.kafka}',
        'properties.group.id' = 'bench-flink', 'scan.startup.mode' = 'earliest-offset',
        'scan.bounded.mode' = 'latest-offset', 'format' = 'json')""")
    run_agg(t_env, args)


if __name__ == "__main__":
    main()
