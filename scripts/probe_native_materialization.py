"""Probe: what would materializing every vertex cost with no Python at all?

    python scripts/probe_native_materialization.py [--orders 5000000]

Runs, in one driver process and alternating, the example orders job as plain Spark and as a
native-Spark stand-in for spark_ckpt's durable result partitions: every vertex written as a
bucketed Parquet table (Spark's own writer, bucketed by the consumer's key into its
parallelism) and read back with bucketed scans, so co-partitioned joins need no shuffle.
``native-50`` keeps one task per source split (50 tasks, 50 x 50 bucket files), as
partition identity needs; ``native-packed`` lets Spark pack the splits (2-3 tasks), which
partition identity forbids: a lower bound. Prints wall times; see
docs/benchmarks-history.md (issue 2).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "jobs"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=5_000_000)
    parser.add_argument("--parallelism", type=int, default=50)
    args = parser.parse_args()

    import orders_data
    import orders_report as report
    from deltalake import write_deltalake
    from pyspark.sql import SparkSession

    base = Path(tempfile.mkdtemp(prefix="spark-ckpt-probe-"))
    data, out = str(base / "input"), str(base / "out")
    orders_data.generate(data, orders=args.orders, files=50, customers=50_000)
    spark = (SparkSession.builder.master("local[2]").config("spark.driver.memory", "4g")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "8")
             .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    def plain() -> None:
        shutil.rmtree(out, ignore_errors=True)
        orders = spark.read.parquet(f"{data}/orders")
        customers = spark.read.parquet(f"{data}/customers")
        payments = spark.read.parquet(f"{data}/payments")
        settled = report.settle(report.enrich(orders, customers), payments).cache()
        settled.write.mode("overwrite").parquet(f"{out}/settled")
        write_deltalake(f"{out}/daily", report.daily_revenue(settled).toArrow(), mode="overwrite")
        settled.unpersist()

    def native(one_task_per_split: bool) -> None:
        shutil.rmtree(out, ignore_errors=True)
        p = args.parallelism
        s = spark.newSession()
        for table in ("enr", "pay", "set"):
            s.sql(f"DROP TABLE IF EXISTS {table}")
        if one_task_per_split:
            s.conf.set("spark.sql.files.maxPartitionBytes", str(1 << 40))
            s.conf.set("spark.sql.files.openCostInBytes", str(1 << 40))
        s.conf.set("spark.sql.shuffle.partitions", str(p))
        orders = s.read.parquet(f"{data}/orders")
        customers = s.read.parquet(f"{data}/customers")
        payments = s.read.parquet(f"{data}/payments")
        report.enrich(orders, customers).write.bucketBy(p, "order_id") \
            .option("path", f"{out}/r/enr").saveAsTable("enr")
        payments.write.bucketBy(p, "order_id").option("path", f"{out}/r/pay").saveAsTable("pay")
        settled = report.settle(s.table("enr"), s.table("pay"))
        settled.write.bucketBy(8, "region", "day").option("path", f"{out}/r/set") \
            .saveAsTable("set")
        s.table("set").write.parquet(f"{out}/settled")
        write_deltalake(f"{out}/daily", report.daily_revenue(s.table("set")).toArrow(),
                        mode="overwrite")

    runs = [("plain", plain), ("native-50", lambda: native(True)), ("plain", plain),
            ("native-50", lambda: native(True)), ("native-packed", lambda: native(False))]
    for name, fn in runs:
        t0 = time.perf_counter()
        fn()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
