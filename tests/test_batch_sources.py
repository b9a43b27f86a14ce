"""File sources give exactly ``spark.read``'s answer, with the options a user passes.

Each case writes real files, runs a batch job over them, and compares its Parquet output with
the same function over ``spark.read.format(...).options(...).load(path)`` in plain PySpark.
"""

from __future__ import annotations

import json

import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F

from spark_ckpt import BatchJob, Settings

# exchanges however small the tests' inputs (spark.ckpt.batch.exchangeMinBytes=0): the
# orders report's join runs through its durable exchanges, as a large job's does
SETTINGS = Settings(progress="never", event_log_flush_interval_ms=200, batch_exchange_min_bytes=0)


def flights_csv(directory):
    directory.mkdir()
    (directory / "a.csv").write_text(
        "carrier,tailnum,delay,day\n"
        "AA,N101,5,21/11/2026\nAA,NA,7,21/11/2026\nAA,N102,NA,22/11/2026\n"
        "UA,NA,1,22/11/2026\nUA,N201,3,23/11/2026\n"
    )
    (directory / "b.txt").write_text(  # Spark reads it too: it does not look at extensions
        "carrier,tailnum,delay,day\nUA,N202,2,23/11/2026\nDL,NA,9,24/11/2026\n"
    )
    (directory / "_ignored.csv").write_text("carrier,tailnum,delay,day\nXX,N9,9,01/01/2026\n")
    return str(directory)


def planes(df):
    return df.where(F.col("tailnum").isNotNull()).groupBy("carrier").agg(
        F.countDistinct("tailnum").alias("planes"), F.sum("delay").alias("delay"))


def json_multiline(directory):
    directory.mkdir()
    (directory / "a.json").write_text(json.dumps(
        [{"id": 1, "tags": ["x", "y"], "nested": {"v": 1.5}}, {"id": 2, "tags": [],
                                                               "nested": None}], indent=2))
    (directory / "b.json").write_text(json.dumps([{"id": 3, "nested": {"v": -2.0}}], indent=2))
    return str(directory)


def parquet_evolving(directory, spark):
    spark.createDataFrame([(1, "a")], "id long, name string").coalesce(1).write.parquet(
        str(directory / "v1"))
    spark.createDataFrame([(2, "b", 0.5)], "id long, name string, score double").coalesce(
        1).write.parquet(str(directory / "v2"))
    flat = directory / "flat"
    flat.mkdir()
    for i, sub in enumerate(("v1", "v2")):
        for f in (directory / sub).glob("part-*.parquet"):
            f.rename(flat / f"part-{i}.parquet")
    return str(flat)


def partitioned_parquet(directory, spark):
    spark.createDataFrame([(1, "eu", 10.0), (2, "us", 20.0), (3, "eu", 5.0)],
                          "id long, region string, amount double").write.partitionBy(
        "region").parquet(str(directory))
    return str(directory)


def identity(df):
    return df


CASES = {
    # the report of issue 8: "NA" tail numbers counted as a plane without nullValue
    "csv-nullValue-inferSchema-dateFormat": lambda tmp, spark: (
        flights_csv(tmp / "csv"), "csv",
        {"header": "true", "nullValue": "NA", "inferSchema": "true"}, None, planes),
    "csv-declared-schema-dateFormat": lambda tmp, spark: (
        flights_csv(tmp / "csv"), "csv", {"header": "true", "nullValue": "NA",
                                          "dateFormat": "dd/MM/yyyy"},
        "carrier string, tailnum string, delay int, day date", identity),
    "single-csv-file": lambda tmp, spark: (
        flights_csv(tmp / "csv") + "/a.csv", "csv", {"header": "true", "nullValue": "NA"},
        None, identity),
    "json-multiLine": lambda tmp, spark: (
        json_multiline(tmp / "json"), "json", {"multiLine": "true"}, None, identity),
    "parquet-mergeSchema": lambda tmp, spark: (
        parquet_evolving(tmp / "pq", spark), "parquet", {"mergeSchema": "true"}, None,
        identity),
    "parquet-partition-directories": lambda tmp, spark: (
        partitioned_parquet(tmp / "parts", spark), "parquet", {}, None, identity),
    "csv-pathGlobFilter": lambda tmp, spark: (
        flights_csv(tmp / "csv"), "csv", {"header": "true", "pathGlobFilter": "*.csv"},
        None, identity),
}


@pytest.mark.parametrize("case", list(CASES))
def test_file_source_reads_exactly_what_spark_read_reads(spark, tmp_path, case):
    path, fmt, options, schema, fn = CASES[case](tmp_path, spark)
    job = BatchJob(f"src-{case}", spark=spark, work_dir=str(tmp_path / "work"),
                   settings=SETTINGS)
    source = job.read_files("input", path, format=fmt, options=options, schema=schema,
                            parallelism=2)
    out = job.vertex("out", fn, source.by("carrier") if fn is planes else source)
    job.write_parquet(out, str(tmp_path / "out"))
    job.run()

    reader = spark.read.format(fmt).options(**options)
    if schema:
        reader = reader.schema(schema)
    want = fn(reader.load(path))
    got = spark.read.parquet(str(tmp_path / "out"))
    assert got.count() > 0
    assert_df_equality(got.select(*want.columns), want, ignore_row_order=True,
                       ignore_nullable=True)


@pytest.mark.parametrize("parallelism", [2, None])
def test_a_recovered_run_reads_the_recorded_files_with_the_recorded_schema(
        spark, tmp_path, monkeypatch, parallelism):
    """A file arriving after the first attempt is not read by the recovery of that run, and
    the schema Spark inferred then is kept (the new file would make ``delay`` a string).
    With ``parallelism=None`` (a split per file) the new file changes neither the job's
    identity nor its split count: the finished partition is reused, not run again."""
    import dataclasses

    path = flights_csv(tmp_path / "csv")
    options = {"header": "true", "nullValue": "NA", "inferSchema": "true"}
    plain = spark.read.options(**options).csv(path)

    def build(settings):
        job = BatchJob("recorded", spark=spark, work_dir=str(tmp_path / "work"),
                       settings=settings)
        source = job.read_files("input", path, format="csv", options=options,
                                parallelism=parallelism)
        job.write_parquet(job.vertex("out", identity, source), str(tmp_path / "out"))
        return job

    one_at_a_time = dataclasses.replace(SETTINGS, batch_partitions_per_wave=1,
                                        batch_concurrent_waves=1)
    from spark_ckpt import faults

    faults._spec_seen[0] = None  # count passes afresh in this test
    monkeypatch.setenv("SPARK_CKPT_FAULT", "partition.written:2:fail")
    with pytest.raises(OSError, match="injected"):
        build(one_at_a_time).run()
    monkeypatch.delenv("SPARK_CKPT_FAULT")
    (tmp_path / "csv" / "c.csv").write_text("carrier,tailnum,delay,day\nZZ,N1,oops,x\n")
    result = build(SETTINGS).run()
    assert (result.vertices["out"].reused, result.vertices["out"].ran) == (1, 1)
    assert result.vertices["out"].partitions == 2  # a.csv and b.txt, as first recorded
    got = spark.read.parquet(str(tmp_path / "out"))
    assert dict(got.dtypes)["delay"] == "int"
    assert_df_equality(got.select(*plain.columns), plain, ignore_row_order=True,
                       ignore_nullable=True)
