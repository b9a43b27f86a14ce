"""PyFlink arm of ``bench_nexmark.py``: one Nexmark query in Flink SQL, as Flink's nexmark
suite writes it, over the generator's events (a Parquet copy with INT96 timestamps, which
Flink's Parquet format reads; flink-sql-parquet from Maven Central), on RocksDB with
incremental checkpoints every 10 s, parallelism 2, in streaming mode. The input is bounded:
Flink ends the run with the largest watermark, so it closes every window (the parent keeps
the windows the other systems' final watermark closes before comparing).

Run with the interpreter of a virtualenv that has ``apache-flink`` (bench_nexmark.py passes
it ``--pyflink``). The SQL here is written for this benchmark after the definitions of
Flink's nexmark suite (q7 takes ``window_time`` where the suite takes ``window_end``: the
1-ms-earlier rowtime of the older suite, which the batch reference uses).

Append-only results go to Flink's filesystem sink in Parquet (exactly once: files committed
on checkpoints and at the end of input). Results with updates (q5's regular join of two
aggregations) are collected by the client and their changelog applied; the final rows are
written as JSON lines. Prints ``RESULT {json}``: the job's net runtime (Flink's local executor
starts a mini-cluster for each job inside ``execute_sql``) and the time from submission.
"""

from __future__ import annotations

import argparse
import json
import time

SOURCE = """CREATE TABLE nexmark (
  event_type INT,
  person ROW<id BIGINT, name STRING, emailAddress STRING, creditCard STRING, city STRING,
             state STRING, `dateTime` TIMESTAMP(3), extra STRING>,
  auction ROW<id BIGINT, itemName STRING, description STRING, initialBid BIGINT,
              reserve BIGINT, `dateTime` TIMESTAMP(3), expires TIMESTAMP(3), seller BIGINT,
              category BIGINT, extra STRING>,
  bid ROW<auction BIGINT, bidder BIGINT, price BIGINT, channel STRING, url STRING,
          `dateTime` TIMESTAMP(3), extra STRING>,
  `dateTime` TIMESTAMP(3),
  WATERMARK FOR `dateTime` AS `dateTime` - INTERVAL '4' SECOND
) WITH ('connector' = 'filesystem', 'path' = 'file://{path}', 'format' = 'parquet',
        'parquet.utc-timezone' = 'true')"""

VIEWS = [
    """CREATE VIEW person AS SELECT person.id AS id, person.name AS name,
       person.emailAddress AS emailAddress, person.creditCard AS creditCard,
       person.city AS city, person.state AS state, `dateTime`, person.extra AS extra
       FROM nexmark WHERE event_type = 0""",
    """CREATE VIEW auction AS SELECT auction.id AS id, auction.itemName AS itemName,
       auction.description AS description, auction.initialBid AS initialBid,
       auction.reserve AS reserve, `dateTime`, auction.expires AS expires,
       auction.seller AS seller, auction.category AS category, auction.extra AS extra
       FROM nexmark WHERE event_type = 1""",
    """CREATE VIEW bid AS SELECT bid.auction AS auction, bid.bidder AS bidder,
       bid.price AS price, bid.channel AS channel, bid.url AS url, `dateTime`,
       bid.extra AS extra FROM nexmark WHERE event_type = 2""",
]

# name -> (sink columns, query, append-only)
QUERIES: dict[str, tuple[str, str, bool]] = {
    "q0": ("auction BIGINT, bidder BIGINT, price BIGINT, `dateTime` TIMESTAMP(3), "
           "extra STRING",
           "SELECT auction, bidder, price, `dateTime`, extra FROM bid", True),
    "q1": ("auction BIGINT, bidder BIGINT, price DOUBLE, `dateTime` TIMESTAMP(3), "
           "extra STRING",
           "SELECT auction, bidder, CAST(0.908 * price AS DOUBLE) AS price, `dateTime`, extra "
           "FROM bid", True),
    "q2": ("auction BIGINT, price BIGINT",
           "SELECT auction, price FROM bid WHERE MOD(auction, 123) = 0", True),
    "q5": ("auction BIGINT, num BIGINT, starttime TIMESTAMP(3)", """
        SELECT AuctionBids.auction, AuctionBids.num, AuctionBids.starttime FROM (
          SELECT auction, count(*) AS num, window_start AS starttime, window_end AS endtime
          FROM TABLE(HOP(TABLE bid, DESCRIPTOR(`dateTime`), INTERVAL '2' SECOND,
                         INTERVAL '10' SECOND))
          GROUP BY auction, window_start, window_end) AS AuctionBids
        JOIN (
          SELECT max(CountBids.num) AS maxn, CountBids.starttime, CountBids.endtime FROM (
            SELECT count(*) AS num, window_start AS starttime, window_end AS endtime
            FROM TABLE(HOP(TABLE bid, DESCRIPTOR(`dateTime`), INTERVAL '2' SECOND,
                           INTERVAL '10' SECOND))
            GROUP BY auction, window_start, window_end) AS CountBids
          GROUP BY CountBids.starttime, CountBids.endtime) AS MaxBids
        ON AuctionBids.starttime = MaxBids.starttime AND AuctionBids.endtime = MaxBids.endtime
          AND AuctionBids.num >= MaxBids.maxn""", False),
    "q7": ("auction BIGINT, price BIGINT, bidder BIGINT, `dateTime` TIMESTAMP(3), "
           "extra STRING", """
        SELECT B.auction, B.price, B.bidder, B.`dateTime`, B.extra FROM bid B JOIN (
          SELECT MAX(price) AS maxprice, window_time AS `dateTime`
          FROM TABLE(TUMBLE(TABLE bid, DESCRIPTOR(`dateTime`), INTERVAL '10' SECOND))
          GROUP BY window_start, window_end, window_time) B1
        ON B.price = B1.maxprice
        WHERE B.`dateTime` BETWEEN B1.`dateTime` - INTERVAL '10' SECOND AND B1.`dateTime`""",
           True),
    "q8": ("id BIGINT, name STRING, starttime TIMESTAMP(3)", """
        SELECT P.id, P.name, P.starttime FROM (
          SELECT id, name, window_start AS starttime, window_end AS endtime
          FROM TABLE(TUMBLE(TABLE person, DESCRIPTOR(`dateTime`), INTERVAL '10' SECOND))
          GROUP BY id, name, window_start, window_end) P
        JOIN (
          SELECT seller, window_start AS starttime, window_end AS endtime
          FROM TABLE(TUMBLE(TABLE auction, DESCRIPTOR(`dateTime`), INTERVAL '10' SECOND))
          GROUP BY seller, window_start, window_end) A
        ON P.id = A.seller AND P.starttime = A.starttime AND P.endtime = A.endtime""", True),
    "q11": ("bidder BIGINT, bid_count BIGINT, starttime TIMESTAMP(3), endtime TIMESTAMP(3)",
            """
        SELECT bidder, count(*) AS bid_count, window_start AS starttime,
          window_end AS endtime
        FROM TABLE(SESSION(TABLE bid PARTITION BY bidder, DESCRIPTOR(`dateTime`),
                           INTERVAL '10' SECOND))
        GROUP BY bidder, window_start, window_end""", True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--query", required=True, choices=sorted(QUERIES))
    parser.add_argument("--events", required=True, help="directory of the Flink copy")
    parser.add_argument("--jars", required=True, help="';'-separated jar URLs")
    parser.add_argument("--work", required=True)
    args = parser.parse_args()

    from pyflink.common import Configuration
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.table import StreamTableEnvironment

    conf = Configuration()
    conf.set_string("state.backend.type", "rocksdb")
    conf.set_string("execution.checkpointing.incremental", "true")
    conf.set_string("execution.checkpointing.dir", f"file://{args.work}/ckpt")
    conf.set_string("pipeline.jars", args.jars)
    conf.set_string("table.local-time-zone", "UTC")
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(2)
    env.enable_checkpointing(10_000)
    t_env = StreamTableEnvironment.create(env)
    t_env.execute_sql(SOURCE.format(path=args.events))
    for view in VIEWS:
        t_env.execute_sql(view)
    columns, query, append = QUERIES[args.query]
    print(f"READY {time.time():.3f}", flush=True)
    t0 = time.perf_counter()
    net_ms = None
    if append:
        t_env.execute_sql(f"""CREATE TABLE sink ({columns}) WITH ('connector' = 'filesystem',
            'path' = 'file://{args.work}/out', 'format' = 'parquet',
            'parquet.utc-timezone' = 'true')""")
        done = t_env.execute_sql(f"INSERT INTO sink {query}")
        done.wait()
        net_ms = done.get_job_client().get_job_execution_result().result().get_net_runtime()
        rows = None
    else:
        from collections import Counter

        from pyflink.common import RowKind

        final: Counter = Counter()
        collected = t_env.execute_sql(query)
        with collected.collect() as results:
            for row in results:
                key = tuple(str(v) for v in row)
                if row.get_row_kind() in (RowKind.INSERT, RowKind.UPDATE_AFTER):
                    final[key] += 1
                else:
                    final[key] -= 1
        net_ms = collected.get_job_client().get_job_execution_result().result() \
            .get_net_runtime()
        if any(n < 0 for n in final.values()):
            raise SystemExit("a retraction of a row never inserted")
        rows = [list(k) for k, n in final.items() for _ in range(n)]
    submitted = time.perf_counter() - t0
    if rows is not None:
        with open(f"{args.work}/out.jsonl", "w") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    # the job's net runtime (its local executor starts a mini-cluster per job inside
    # execute_sql); the time from submission beside it
    seconds = net_ms / 1000 if net_ms else submitted
    print("RESULT " + json.dumps({"seconds": seconds, "submitted_seconds": submitted}),
          flush=True)


if __name__ == "__main__":
    main()
