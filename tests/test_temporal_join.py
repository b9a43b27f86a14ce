"""Temporal joins with a Delta table (issue 35, item 3): ``stream.join_as_of(table, on, t)``
joins each row with the newest version of the table committed at or before the row's time
(Flink's ``FOR SYSTEM_TIME AS OF``, Delta's ``TIMESTAMP AS OF``); each batch records the
table's version it saw, so a driver SIGKILLed after allocating a batch replays it against
the same versions after the table moved on."""

from __future__ import annotations

import subprocess
import sys
import time

import pandas as pd
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from spark_ckpt import StreamingContext
from spark_ckpt.errors import JobDefinitionError, PipelineFailedError
from spark_ckpt.options import Settings
from helpers import ROOT, child_env, wait_for, write_batch_files

SCHEMA = "order_id BIGINT, currency STRING, t_ms BIGINT"
_RATES = pa.schema([("currency", pa.string()), ("rate", pa.float64())])


def _commit(path, rates: dict[str, float], mode: str) -> int:
    """One version of the rates table; its commit time (ms) as Delta's history gives it."""
    write_deltalake(str(path), pa.table({"currency": list(rates), "rate": list(rates.values())},
                                        schema=_RATES), mode=mode)
    return _committed(path)


def _committed(path) -> int:
    """The latest commit's time, once the wall clock is past it: the next commit's time is
    then later (delta-rs stamps commits with the wall clock, which a test cannot inject; the
    wait is on that condition, not on a duration)."""
    at = int(DeltaTable(str(path)).history(1)[0]["timestamp"])
    assert wait_for(lambda: time.time() * 1000 > at + 1, 10, 0.002)
    return at


def _expected(orders: pd.DataFrame, versions: list[tuple[int, dict[str, float]]],
              how: str) -> pd.DataFrame:
    """Each order with the rates of the newest version at or before its time."""
    rows = []
    for order in orders.to_dict("records"):
        rates = None
        for at, table in versions:
            if order["t_ms"] is not None and not pd.isna(order["t_ms"]) and at <= order["t_ms"]:
                rates = table
        rate = None if rates is None else rates.get(order["currency"])
        if rate is None and how == "inner":
            continue
        rows.append({**order, "rate": rate})
    return pd.DataFrame(rows, columns=[*orders.columns, "rate"])


def _normal(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("order_id").reset_index(drop=True)


def _context(spark, tmp_path, name: str) -> StreamingContext:
    return StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), name, settings=Settings(
        checkpoint_interval_ms=0, progress="never"))


@pytest.mark.parametrize("how", ["inner", "left"])
def test_each_row_joins_the_version_as_of_its_time(spark, tmp_path, how):
    """Three versions of a rates table; orders before the first, between each, after the
    last, with a null time and an unknown currency: each joins the rates valid at its time."""
    table = tmp_path / "rates"
    versions = [(_commit(table, {"EUR": 1.0, "GBP": 2.0}, "overwrite"), {"EUR": 1.0, "GBP": 2.0})]
    versions.append((_commit(table, {"EUR": 1.1, "GBP": 2.2}, "overwrite"),
                     {"EUR": 1.1, "GBP": 2.2}))
    versions.append((_commit(table, {"EUR": 1.2, "USD": 0.9}, "overwrite"),
                     {"EUR": 1.2, "USD": 0.9}))
    (t0, _), (t1, _), (t2, _) = versions
    times = [t0 - 5_000, t0, t0 + 1, t1 - 1, t1, t2 - 1, t2, t2 + 60_000, None]
    orders = pd.DataFrame([
        {"order_id": i * 10 + j, "currency": c, "t_ms": t}
        for i, t in enumerate(times) for j, c in enumerate(["EUR", "GBP", "USD", "CHF"])])
    orders["t_ms"] = orders["t_ms"].astype("Int64")
    frames = [orders.iloc[:18], orders.iloc[18:]]
    source = write_batch_files(spark, frames, SCHEMA, tmp_path / "in")
    ctx = _context(spark, tmp_path, f"as-of-{how}")
    from pyspark.sql import functions as F

    rates = ctx.delta_table("rates", str(table))
    ctx.file_stream("orders", source, "parquet", SCHEMA, max_files_per_batch=1) \
        .with_column("order_time", F.timestamp_millis("t_ms")) \
        .join_as_of(rates, "currency", "order_time", how) \
        .transform(lambda df: df.drop("order_time")).write_parquet(str(tmp_path / "out"),
                                                                    name="out")
    progress = ctx.process_available(timeout=300)
    assert [p["num_input_rows"] for p in progress] == [18, len(orders) - 18]
    assert [ctx.allocation(p["batch_id"]).pieces["rates"]["version"] for p in progress] == [2, 2]
    got = spark.read.parquet(str(tmp_path / "out")).toPandas()
    expected = _expected(orders, versions, how)
    assert len(expected) >= 14
    pd.testing.assert_frame_equal(_normal(got)[expected.columns], _normal(expected),
                                  check_dtype=False)


_KILLED = """
import sys
from pyspark.sql import functions as F
from spark_ckpt import StreamingContext, get_or_create_session
from spark_ckpt.options import Settings
source, table, ckpt, out = sys.argv[1:5]
spark = get_or_create_session("as_of_killed")
ctx = StreamingContext(spark, 0.05, ckpt, "as_of_killed", settings=Settings(
    checkpoint_interval_ms=0, progress="never"))
rates = ctx.delta_table("rates", table)
ctx.file_stream("orders", source, "parquet", "{schema}", max_files_per_batch=1) \\
    .with_column("order_time", F.timestamp_millis("t_ms")) \\
    .join_as_of(rates, "currency", "order_time", "left") \\
    .transform(lambda df: df.drop("order_time")) \\
    .write_delta(out, name="out")
ctx.process_available(timeout=300)
print("DONE", flush=True)
""".replace("{schema}", SCHEMA)


def test_a_batch_replayed_after_a_kill_joins_the_versions_it_recorded(spark, tmp_path):
    """Orders an hour ahead of the table join its newest version their batch saw. The driver
    is SIGKILLed right after recording batch 0 (version 0 seen); a new version is committed;
    the restarted driver replays batch 0 with version 0's rates, and batch 1, planned after
    the commit, joins version 1's."""
    table = tmp_path / "rates"
    first = _commit(table, {"EUR": 1.0}, "overwrite")
    ahead = first + 3_600_000
    frames = [pd.DataFrame({"order_id": [1, 2], "currency": ["EUR", "EUR"], "t_ms": [ahead] * 2}),
              pd.DataFrame({"order_id": [3], "currency": ["EUR"], "t_ms": [ahead]})]
    source = write_batch_files(spark, frames, SCHEMA, tmp_path / "in")
    command = [sys.executable, "-c", _KILLED, source, str(table), str(tmp_path / "ckpt"),
               str(tmp_path / "out")]
    killed = subprocess.run(command, env=child_env("stream.batch.allocated:1:kill"), cwd=ROOT,
                            capture_output=True, text=True, timeout=300, start_new_session=True)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-3000:]
    _commit(table, {"EUR": 9.0}, "overwrite")
    done = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300, start_new_session=True)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-3000:]
    got = DeltaTable(str(tmp_path / "out")).to_pandas().sort_values("order_id")
    assert got[["order_id", "rate"]].values.tolist() == [[1, 1.0], [2, 1.0], [3, 9.0]]


def test_a_temporal_join_is_refused_on_what_it_cannot_join(spark, tmp_path):
    table = tmp_path / "rates"
    _commit(table, {"EUR": 1.0}, "overwrite")
    ctx = _context(spark, tmp_path, "as-of-refused")
    gen = ctx.generator_stream("gen", rows_per_batch=10, total_rows=10, keys=2)
    with pytest.raises(JobDefinitionError, match="expected a table from ctx.delta_table"):
        gen.join_as_of(gen, "key", "event_time")
    rates = ctx.delta_table("rates", str(table))
    with pytest.raises(JobDefinitionError, match="expected how in"):
        gen.join_as_of(rates, "key", "event_time", "full_outer")
    gen.join_as_of(rates, "key", "event_time").write_parquet(str(tmp_path / "o"), name="o")
    with pytest.raises(PipelineFailedError, match=r"expected the join columns \['key'\]"):
        ctx.process_available(timeout=120)


def test_read_as_a_stream_the_table_is_each_batchs_recorded_version(spark, tmp_path):
    """A processing-time lookup join (Flink's ``FOR SYSTEM_TIME AS OF proctime``): the table
    stream's batch is the table at the version the batch recorded."""
    table = tmp_path / "rates"
    _commit(table, {"EUR": 1.0}, "overwrite")
    _commit(table, {"EUR": 2.0, "GBP": 3.0}, "overwrite")
    frame = pd.DataFrame({"order_id": [1, 2, 3], "currency": ["EUR", "GBP", "USD"],
                          "t_ms": [0, 0, 0]})
    source = write_batch_files(spark, [frame], SCHEMA, tmp_path / "in")
    ctx = _context(spark, tmp_path, "lookup")
    rates = ctx.delta_table("rates", str(table))
    ctx.file_stream("orders", source, "parquet", SCHEMA) \
        .transform(lambda o, r: o.join(r, "currency", "left"), rates) \
        .write_parquet(str(tmp_path / "out"), name="out")
    assert [p["num_input_rows"] for p in ctx.process_available(timeout=300)] == [3]
    got = spark.read.parquet(str(tmp_path / "out")).toPandas().sort_values("order_id")
    assert got["rate"].tolist()[:2] == [2.0, 3.0] and pd.isna(got["rate"].tolist()[2])


def test_a_column_added_later_is_null_in_older_versions_and_a_cleaned_log_stops_by_name(
        spark, tmp_path):
    """Version 1 adds a column: rows as of version 0 read it as null. Then the log before
    version 1 is cleaned up (a checkpoint, the first commit file gone): a row older than
    version 1 cannot know its version, and the pipeline stops naming it."""
    table = tmp_path / "rates"
    t0 = _commit(table, {"EUR": 1.0}, "overwrite")
    write_deltalake(str(table), pa.table({"currency": ["EUR"], "rate": [2.0], "fee": [0.5]}),
                    mode="overwrite", schema_mode="merge")
    t1 = _committed(table)
    frame = pd.DataFrame({"order_id": [1, 2], "currency": ["EUR", "EUR"], "t_ms": [t0, t1]})
    source = write_batch_files(spark, [frame], SCHEMA, tmp_path / "in")
    from pyspark.sql import functions as F

    def run(name: str) -> list:
        ctx = _context(spark, tmp_path / name, name)
        ctx.file_stream("orders", source, "parquet", SCHEMA) \
            .with_column("order_time", F.timestamp_millis("t_ms")) \
            .join_as_of(ctx.delta_table("rates", str(table)), "currency", "order_time") \
            .write_parquet(str(tmp_path / name / "out"), name="out")
        return ctx.process_available(timeout=300)

    run("schema")
    got = spark.read.parquet(str(tmp_path / "schema" / "out")).toPandas().sort_values("order_id")
    assert got["rate"].tolist() == [1.0, 2.0]
    assert pd.isna(got["fee"].tolist()[0]) and got["fee"].tolist()[1] == 0.5
    DeltaTable(str(table)).create_checkpoint()
    (table / "_delta_log" / "00000000000000000000.json").unlink()
    with pytest.raises(PipelineFailedError, match="before version 1 of table rates"):
        run("cleaned")
