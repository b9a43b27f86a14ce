"""Example batch job: daily revenue per region from orders, customers and payments.

    spark-submit jobs/orders_report.py --input DIR --output OUT [--job-id ID]

Vertices: three file sources, read by Spark where they are needed; ``enriched`` (orders joined
with the broadcast customers table, no shuffle; ``--sinks-only`` runs it inside ``settled``);
``settled`` (enriched orders joined with payments, both hashed by order_id);
``daily`` (aggregated by region and day). Sinks: ``daily`` to a Delta table, ``settled`` to a
Parquet directory. Kill the driver at any point and submit the same command again: only the
partitions whose output is missing run.
"""

from __future__ import annotations

import argparse
import logging
import os

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_ckpt import BatchJob, get_or_create_session


def enrich(orders: DataFrame, customers: DataFrame) -> DataFrame:
    return (
        orders.where(F.col("amount") > 0)
        .join(customers, "customer_id")
        .withColumn("day", F.to_date("order_ts"))
        .select("order_id", "customer_id", "region", "segment", "day", "amount", "quantity")
    )


def settle(enriched: DataFrame, payments: DataFrame) -> DataFrame:
    return enriched.join(payments, "order_id", "left").withColumn(
        "paid", F.coalesce(F.col("paid"), F.lit(0.0))
    )


def _napping(df: DataFrame) -> DataFrame:
    """``df``'s rows, every fifth one's task sleeping 2 ms in the JVM first (the filter
    passes them all): tests that kill a driver while a vertex's Spark job still runs use it
    (``ORDERS_REPORT_SLOW=1``)."""
    nap = "java_method('java.lang.Thread', 'sleep', cast(if(order_id % 5 = 0, 2, 0) as bigint))"
    return df.where(F.expr(f"{nap} is distinct from 'slept'"))


def slow_enrich(orders: DataFrame, customers: DataFrame) -> DataFrame:
    return _napping(enrich(orders, customers))


def slow_settle(enriched: DataFrame, payments: DataFrame) -> DataFrame:
    return _napping(settle(enriched, payments))


def daily_revenue(settled: DataFrame) -> DataFrame:
    return settled.groupBy("region", "day").agg(
        F.count("*").alias("orders"),
        F.round(F.sum("amount"), 2).alias("revenue"),
        F.round(F.sum("paid"), 2).alias("paid"),
        F.sum("quantity").alias("items"),
    )


def build_job(job_id: str, input_dir: str, output: str, *, parallelism: int = 8,
              agg_parallelism: int = 4, work_dir: str | None = None,
              spark=None, settings=None, sinks_only: bool = False,
              run_key: str | None = None) -> BatchJob:
    """``sinks_only``: ``enriched`` is not durable (it runs inside ``settled``), so the only
    durable points are the two sink vertices."""
    job = BatchJob(job_id, run_key=run_key, spark=spark, work_dir=work_dir, settings=settings)
    orders = job.read_files("orders", f"{input_dir}/orders", parallelism=parallelism)
    customers = job.read_files("customers", f"{input_dir}/customers", parallelism=1)
    payments = job.read_files("payments", f"{input_dir}/payments", parallelism=parallelism)
    slow = bool(os.environ.get("ORDERS_REPORT_SLOW"))
    enriched = job.vertex("enriched", slow_enrich if slow else enrich, orders,
                          customers.broadcast(), durable=not sinks_only)
    settled = job.vertex("settled", slow_settle if slow else settle, enriched.by("order_id"),
                         payments.by("order_id"), parallelism=parallelism)
    daily = job.vertex("daily", daily_revenue, settled.by("region", "day"),
                       parallelism=agg_parallelism)
    job.write_delta(daily, f"{output}/daily", mode="append")
    job.write_parquet(settled, f"{output}/settled")
    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--job-id", default="orders-report")
    parser.add_argument("--run-key", default=None,
                        help="names one run (a date): the same key resumes, a new one runs afresh")
    parser.add_argument("--work-dir", default=None, help="overrides spark.ckpt.workDir")
    parser.add_argument("--parallelism", type=int, default=8)
    parser.add_argument("--agg-parallelism", type=int, default=4)
    parser.add_argument("--fresh", action="store_true", help="ignore earlier attempts")
    parser.add_argument("--sinks-only", action="store_true",
                        help="make only the sink vertices durable (enriched runs inside settled)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spark = get_or_create_session(f"orders-report:{args.job_id}")
    job = build_job(args.job_id, args.input, args.output, parallelism=args.parallelism,
                    agg_parallelism=args.agg_parallelism, work_dir=args.work_dir, spark=spark,
                    sinks_only=args.sinks_only, run_key=args.run_key)
    result = job.run(fresh=args.fresh)
    print(f"RESULT {result.summary()}")
    for vertex, summary in result.vertices.items():
        print(f"  {vertex}: {summary.partitions} partitions, reused {summary.reused}, "
              f"ran {summary.ran}" + (f", adopted {summary.adopted}" if summary.adopted else ""))


if __name__ == "__main__":
    main()
