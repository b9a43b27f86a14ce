"""A Delta Spark session in its own process, for tests/test_delta_interop.py: Delta Lake's own
reader and writer (delta-spark from jvm/delta-spark/pom.xml) on the PySpark it was built for,
which is not spark_ckpt's (tests/delta_spark_env.py says why and where it lives).

Run by that environment's Python, never spark_ckpt's, and imports nothing of spark_ckpt:

    <venv>/bin/python tests/delta_spark_worker.py JAR[,JAR...] WAREHOUSE

Requests come on stdin, one JSON object a line: ``{"id": n, "code": "...", "args": {...}}``;
the code runs with ``spark``, ``F`` (pyspark.sql.functions), ``args`` and the helpers below in
scope and sets ``result`` (anything JSON can write; other objects as their ``str``). Each
answer is one line on stdout starting with ``@@answer `` and the JSON ``{"id": n, "ok": true,
"result": ...}`` or ``{"id": n, "ok": false, "error": "<traceback>"}`` (the session's start
answers id 0). The session lives until stdin closes.
"""

from __future__ import annotations

import json
import sys
import traceback

MARK = "@@answer "


def scan_metrics(df) -> dict:
    """Run ``df`` and return the file scan's metrics (files read, files pruned...), as Spark's
    FileSourceScanExec counts them: Delta's data skipping leaves out files before the scan,
    so ``numFiles`` is what the reader kept."""
    df.collect()
    plan = df._jdf.queryExecution().executedPlan()
    leaves = plan.collectLeaves()
    out: dict = {}
    for i in range(leaves.size()):
        leaf = leaves.apply(i)
        if "Scan" not in leaf.nodeName():
            continue
        metrics = leaf.metrics()
        keys = metrics.keys().iterator()
        while keys.hasNext():
            key = keys.next()
            out[key] = metrics.apply(key).value()
    return out


def main() -> None:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    jars, warehouse = sys.argv[1], sys.argv[2]
    spark = (
        SparkSession.builder.master("local[1]")
        .appName("delta-spark-interop")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.jars", jars)
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config("spark.sql.catalog.spark_catalog",
                "org.apache.spark.sql.delta.catalog.DeltaCatalog")
        .config("spark.sql.warehouse.dir", warehouse)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "1")
        # the plan run is the plan whose scan metrics scan_metrics reads
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions",
                f"-Dderby.system.home={warehouse} -XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    print(MARK + json.dumps({"id": 0, "ok": True, "result": spark.version}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        scope = {"spark": spark, "F": F, "args": request.get("args", {}),
                 "scan_metrics": scan_metrics, "result": None}
        try:
            exec(request["code"], scope)
            answer = {"id": request.get("id"), "ok": True, "result": scope["result"]}
        except Exception:  # noqa: BLE001 - sent back to the test whole
            answer = {"id": request.get("id"), "ok": False, "error": traceback.format_exc()}
        print(MARK + json.dumps(answer, default=str), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
