"""Seven batch job shapes, written as a new user would, with their plain-Spark twins and data.

    python jobs/batch_shapes.py --shape report --input DIR --output OUT [--plain]

* ``report`` (a): flights joined with two small broadcast tables (carriers, airports), then
  aggregated by a low-cardinality key (carrier x month), to Delta;
* ``join`` (b): orders joined with their details, two large inputs on their key, to Parquet
  and to Delta;
* ``rollup`` (c): an aggregation of an aggregation: events per (user, day), then per day,
  a small report to Delta;
* ``cleanup`` (d): a map-only clean-up of wide raw rows to Parquet partitioned by day;
* ``sorted_report`` (e): the report's join, then ``groupBy`` with a distinct count, averages
  and sums, then ``orderBy``;
* ``ranked`` (f): the report's join, an aggregation per (carrier, city, month), then a window
  function (the ten routes of most fares per carrier and month);
* ``two_aggregations`` (g): the report's join, aggregated two ways (per month, per city),
  joined on the carrier.

Each shape is a function declaring its vertices (``build``) and the same DataFrame pipeline
for plain Spark (``plain``); ``generate`` writes its input. The vertices are declared without
``durable=``: spark_ckpt chooses where each job becomes durable (``job.explain()``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_ckpt import BatchJob

SHAPES = ("report", "join", "rollup", "cleanup", "sorted_report", "ranked", "two_aggregations")
# shapes (e)-(g) read the report's input
INPUT_OF = {"sorted_report": "report", "ranked": "report", "two_aggregations": "report"}
_START = dt.datetime(2025, 1, 1)


# -- data --------------------------------------------------------------------------------------
def _words(rng: np.random.Generator, n: int, length: int) -> pa.Array:
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    pool = [bytes(rng.choice(letters, length)).decode() for _ in range(n)]
    return pa.array(pool)


def _write(table: pa.Table, directory: str, files: int) -> None:
    os.makedirs(directory, exist_ok=True)
    rows = table.num_rows
    for i in range(files):
        piece = table.slice(i * rows // files, (i + 1) * rows // files - i * rows // files)
        pq.write_table(piece, os.path.join(directory, f"part-{i:05d}.parquet"))


def generate(shape: str, directory: str, *, rows: int, files: int, seed: int = 7) -> None:
    """Write ``shape``'s input: ``rows`` rows of its large table(s) in ``files`` files each,
    in chunks (bounded memory)."""
    shape = INPUT_OF.get(shape, shape)
    rng = np.random.default_rng(seed)
    notes = _words(rng, 4096, 48)
    chunk_files = max(1, min(files // 8, files * 4_000_000 // max(rows, 1)))  # ~4M rows a chunk
    chunks = (files + chunk_files - 1) // chunk_files
    for c in range(chunks):
        first = c * chunk_files
        count = min(chunk_files, files - first)
        lo = rows * first // files
        hi = rows * (first + count) // files
        n = hi - lo
        ids = np.arange(lo, hi, dtype=np.int64)
        if shape == "report":
            table = pa.table({
                "flight_id": ids,
                "carrier_id": rng.integers(0, 20, n, dtype=np.int32),
                "origin_id": rng.integers(0, 300, n, dtype=np.int32),
                "dest_id": rng.integers(0, 300, n, dtype=np.int32),
                "departed": pa.array(np.datetime64(_START, "s")
                                     + rng.integers(0, 365 * 86400, n).astype("timedelta64[s]")),
                "delay": pa.array(rng.normal(8, 20, n), mask=rng.random(n) < 0.05),
                "distance": rng.integers(100, 5000, n, dtype=np.int32),
                "fare": rng.integers(2000, 90000, n, dtype=np.int64),
                "tail": notes.take(pa.array(rng.integers(0, 4096, n))),
                "remarks": notes.take(pa.array(rng.integers(0, 4096, n))),
            })
            _write_chunk(table, f"{directory}/flights", first, count)
        elif shape == "join":
            order = rng.permutation(n)
            table = pa.table({
                "order_id": ids,
                "customer_id": rng.integers(0, 1_000_000, n, dtype=np.int64),
                "amount": rng.integers(100, 100000, n, dtype=np.int64),
                "status": notes.take(pa.array(rng.integers(0, 16, n))),
                "note": notes.take(pa.array(rng.integers(0, 4096, n))),
            })
            _write_chunk(table, f"{directory}/orders", first, count)
            keep = order[: n * 9 // 10]  # a tenth of the orders have no details
            details = pa.table({
                "order_id": ids[keep],
                "warehouse": rng.integers(0, 50, len(keep), dtype=np.int32),
                "weight": rng.random(len(keep)) * 30,
                "address": notes.take(pa.array(rng.integers(0, 4096, len(keep)))),
                "instructions": notes.take(pa.array(rng.integers(0, 4096, len(keep)))),
            })
            _write_chunk(details, f"{directory}/details", first, count)
        elif shape == "rollup":
            # event logs are written by time: each file holds a few days, every user active
            # on a day has about 8 events that day
            days = (lo * 365 // rows) + (np.arange(n) * 365 // rows)
            table = pa.table({
                "event_id": ids,
                "user_id": rng.integers(0, max(1, rows // (8 * 365)), n, dtype=np.int64),
                "day": pa.array(np.datetime64(_START.date(), "D")
                                + days.astype("timedelta64[D]")),
                "value": rng.integers(1, 1000, n, dtype=np.int64),
                "kind": notes.take(pa.array(rng.integers(0, 8, n))),
                "payload": notes.take(pa.array(rng.integers(0, 4096, n))),
            })
            _write_chunk(table, f"{directory}/events", first, count)
        elif shape == "cleanup":
            ts = np.datetime64(_START, "s") + rng.integers(0, 30 * 86400, n).astype(
                "timedelta64[s]")
            bad = rng.random(n) < 0.02
            amount = pc.cast(pa.array(rng.integers(0, 500000, n)), pa.string())
            amount = pc.if_else(pa.array(bad), pa.scalar("n/a"), amount)
            table = pa.table({
                "raw_id": pc.cast(pa.array(ids), pa.string()),
                "event_time": pc.strftime(pa.array(ts), format="%Y-%m-%d %H:%M:%S"),
                "country": notes.take(pa.array(rng.integers(0, 64, n))),
                "amount_cents": amount,
                "email": notes.take(pa.array(rng.integers(0, 4096, n))),
                "agent": notes.take(pa.array(rng.integers(0, 4096, n))),
                "referrer": notes.take(pa.array(rng.integers(0, 4096, n))),
                "extra": notes.take(pa.array(rng.integers(0, 4096, n))),
            })
            _write_chunk(table, f"{directory}/raw", first, count)
        else:
            raise ValueError(f"expected a shape in {SHAPES}, found {shape!r}")
    if shape == "report":
        carriers = pa.table({"carrier_id": np.arange(20, dtype=np.int32),
                             "carrier": [f"C{i:02d}" for i in range(20)],
                             "alliance": [["star", "oneworld", "skyteam", "none"][i % 4]
                                          for i in range(20)]})
        airports = pa.table({"airport_id": np.arange(300, dtype=np.int32),
                             "city": [f"city{i}" for i in range(300)],
                             "state": [f"S{i % 50:02d}" for i in range(300)]})
        _write(carriers, f"{directory}/carriers", 1)
        _write(airports, f"{directory}/airports", 1)


def _write_chunk(table: pa.Table, directory: str, first: int, count: int) -> None:
    os.makedirs(directory, exist_ok=True)
    rows = table.num_rows
    for i in range(count):
        piece = table.slice(i * rows // count, (i + 1) * rows // count - i * rows // count)
        pq.write_table(piece, os.path.join(directory, f"part-{first + i:05d}.parquet"))


# -- (a) report: broadcast joins, then a low-cardinality aggregation ----------------------------
def enrich_flights(flights: DataFrame, carriers: DataFrame, airports: DataFrame) -> DataFrame:
    return (flights.join(carriers, "carrier_id")
            .join(airports.withColumnRenamed("airport_id", "origin_id"), "origin_id")
            .withColumn("month", F.date_format("departed", "yyyy-MM"))
            .withColumn("revenue", F.col("fare") / 100))


def carrier_month(enriched: DataFrame) -> DataFrame:
    return enriched.groupBy("carrier", "month").agg(
        F.count("*").alias("flights"),
        F.round(F.sum("revenue"), 2).alias("revenue"),
        F.avg("delay").alias("avg_delay"),
        F.max("distance").alias("longest"),
        F.sum("fare").alias("fares"),
    )


# -- (e) sorted report: distinct counts, averages and sums, then an orderBy --------------------
def carrier_month_sorted(enriched: DataFrame) -> DataFrame:
    return enriched.groupBy("carrier", "month").agg(
        F.count("*").alias("flights"),
        F.avg("delay").alias("avg_delay"), F.avg("distance").alias("avg_distance"),
        F.avg("fare").alias("avg_fare"), F.avg("revenue").alias("avg_revenue"),
        F.sum("fare").alias("fares"), F.sum("distance").alias("miles"),
        F.countDistinct("tail").alias("planes"),
    ).orderBy("carrier", "month")


# -- (f) ranked: an aggregation, then a window function (rank within a group) ------------------
def ranked_routes(enriched: DataFrame) -> DataFrame:
    from pyspark.sql import Window

    per_route = enriched.groupBy("carrier", "city", "month").agg(
        F.count("*").alias("flights"), F.sum("fare").alias("fares"),
        F.max("delay").alias("worst_delay"))
    by_carrier_month = Window.partitionBy("carrier", "month").orderBy(
        F.desc("fares"), F.asc("city"))
    return per_route.withColumn("rank", F.rank().over(by_carrier_month)) \
        .where(F.col("rank") <= 10)


# -- (g) two aggregations of one input, joined -------------------------------------------------
def two_aggregations(enriched: DataFrame) -> DataFrame:
    per_month = enriched.groupBy("carrier", "month").agg(
        F.count("*").alias("flights"), F.sum("fare").alias("fares"))
    per_city = enriched.groupBy("carrier", "city").agg(
        F.avg("delay").alias("avg_delay"), F.max("distance").alias("longest"))
    return per_month.join(per_city.groupBy("carrier").agg(
        F.max("avg_delay").alias("worst_origin_delay"), F.max("longest").alias("longest")),
        "carrier")


# -- (b) join: two large inputs on their key -------------------------------------------------
def join_details(orders: DataFrame, details: DataFrame) -> DataFrame:
    return orders.join(details, "order_id", "left").withColumn(
        "weight", F.coalesce(F.col("weight"), F.lit(0.0)))


# -- (c) rollup: an aggregation of an aggregation ------------------------------------------------
def per_user_day(events: DataFrame) -> DataFrame:
    return events.groupBy("user_id", "day").agg(
        F.count("*").alias("events"), F.sum("value").alias("value"),
        F.max("value").alias("top"))


def per_day(user_days: DataFrame) -> DataFrame:
    return user_days.groupBy("day").agg(
        F.count("*").alias("users"), F.sum("events").alias("events"),
        F.sum("value").alias("value"), F.max("top").alias("top"))


# -- (d) cleanup: map-only ------------------------------------------------------------------
def clean(raw: DataFrame) -> DataFrame:
    return (raw.where(F.col("amount_cents") != "n/a")
            .select(F.col("raw_id").cast("long").alias("id"),
                    F.to_timestamp("event_time").alias("event_time"),
                    F.to_date("event_time").alias("dt"),
                    F.upper(F.trim("country")).alias("country"),
                    (F.col("amount_cents").cast("long") / 100).alias("amount"),
                    F.lower(F.trim("email")).alias("email"),
                    F.trim("agent").alias("agent"),
                    F.trim("referrer").alias("referrer"),
                    F.length("extra").alias("extra_length")))


# -- jobs and their plain twins ----------------------------------------------------------------
def build(shape: str, job: BatchJob, input_dir: str, output: str, *,
          parallelism: int, splits: int | None = None) -> BatchJob:
    """Declare ``shape`` on ``job`` (vertices without durable=: spark_ckpt decides);
    ``splits``: the flights' splits (None: a file each)."""
    if shape in FUNCTIONS:  # the report (a) and the shapes over its input (e)-(g)
        flights = job.read_files("flights", f"{input_dir}/flights", parallelism=splits)
        carriers = job.read_files("carriers", f"{input_dir}/carriers", parallelism=1)
        airports = job.read_files("airports", f"{input_dir}/airports", parallelism=1)
        enriched = job.vertex("enriched", enrich_flights, flights, carriers.broadcast(),
                              airports.broadcast())
        key = ("carrier",) if shape == "two_aggregations" else ("carrier", "month")
        report = job.vertex(shape, FUNCTIONS[shape], enriched.by(*key),
                            parallelism=parallelism)
        job.write_delta(report, f"{output}/{shape}", mode="append")
    elif shape == "join":
        orders = job.read_files("orders", f"{input_dir}/orders")
        details = job.read_files("details", f"{input_dir}/details")
        joined = job.vertex("joined", join_details, orders.by("order_id"),
                            details.by("order_id"), parallelism=parallelism)
        job.write_parquet(joined, f"{output}/joined")
        job.write_delta(joined, f"{output}/joined_delta", mode="append")
    elif shape == "rollup":
        events = job.read_files("events", f"{input_dir}/events")
        user_days = job.vertex("user_days", per_user_day, events.by("user_id", "day"),
                               parallelism=parallelism)
        days = job.vertex("days", per_day, user_days.by("day"), parallelism=4)
        job.write_delta(days, f"{output}/days", mode="append")
    elif shape == "cleanup":
        raw = job.read_files("raw", f"{input_dir}/raw")
        cleaned = job.vertex("cleaned", clean, raw)
        job.write_parquet(cleaned, f"{output}/cleaned", partition_by=["dt"])
    else:
        raise ValueError(f"expected a shape in {SHAPES}, found {shape!r}")
    return job


def plain(shape: str, spark: SparkSession, input_dir: str, output: str) -> None:
    """The same pipeline in plain PySpark, as a competent user writes it (Delta tables
    through delta-rs: small ones from Arrow, large ones as Spark's Parquet files converted)."""
    from deltalake import convert_to_deltalake, write_deltalake

    def read(name: str) -> DataFrame:
        return spark.read.parquet(f"{input_dir}/{name}")

    if shape in FUNCTIONS:
        out = FUNCTIONS[shape](enrich_flights(read("flights"), F.broadcast(read("carriers")),
                                              F.broadcast(read("airports"))))
        write_deltalake(f"{output}/{shape}", out.toArrow(), mode="append")
    elif shape == "join":
        join_details(read("orders"), read("details")).write.parquet(f"{output}/joined")
        # the Delta table holds the same rows: copy them, then make the directory a table
        spark.read.parquet(f"{output}/joined").write.parquet(f"{output}/joined_delta")
        convert_to_deltalake(f"{output}/joined_delta")
    elif shape == "rollup":
        days = per_day(per_user_day(read("events")))
        write_deltalake(f"{output}/days", days.toArrow(), mode="append")
    elif shape == "cleanup":
        clean(read("raw")).write.partitionBy("dt").parquet(f"{output}/cleaned")
    else:
        raise ValueError(f"expected a shape in {SHAPES}, found {shape!r}")


FUNCTIONS = {"report": carrier_month, "sorted_report": carrier_month_sorted,
             "ranked": ranked_routes, "two_aggregations": two_aggregations}


def main() -> None:
    from spark_ckpt import get_or_create_session

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--job-id", default=None)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--parallelism", type=int, default=8)
    parser.add_argument("--plain", action="store_true", help="run the plain-Spark twin")
    parser.add_argument("--explain", action="store_true", help="print the plan, run nothing")
    args = parser.parse_args()
    spark = get_or_create_session(f"shape-{args.shape}")
    if args.plain:
        plain(args.shape, spark, args.input, args.output)
        return
    job = build(args.shape, BatchJob(args.job_id or args.shape, spark=spark,
                                     work_dir=args.work_dir), args.input, args.output,
                parallelism=args.parallelism)
    if args.explain:
        job.explain()
        return
    result = job.run()
    print(f"RESULT {result.summary()}")


if __name__ == "__main__":
    main()
