import dataclasses
from pathlib import Path

import pytest

from spark_ckpt.errors import ConfigurationError
from spark_ckpt.options import OPTIONS, Settings, render_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_every_option_has_a_settings_field_with_its_default():
    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert len(OPTIONS) == len(fields)
    for option in OPTIONS:
        assert option.key.startswith("spark.ckpt.")
        assert fields[option.field] == option.default, option.key


def test_settings_fields_types_and_defaults_are_the_options_in_their_order():
    """OPTIONS declares each default once: Settings' fields are the options (name, type,
    default, in order), and CheckpointConfig's are the checkpoint options without their
    prefix, with the same defaults."""
    import typing

    from spark_ckpt.checkpoint import CheckpointConfig

    types = {"int": int, "bool": bool, "str": str, "choice": str}
    hints = typing.get_type_hints(Settings)
    assert [(f.name, hints[f.name], f.default) for f in dataclasses.fields(Settings)] == [
        (o.field, types[o.type_name], o.default) for o in OPTIONS]
    by_field = {o.field: o for o in OPTIONS}
    config = CheckpointConfig()
    for f in dataclasses.fields(CheckpointConfig):
        assert f.default == by_field[f"checkpoint_{f.name}"].default, f.name
    settings = Settings(checkpoint_interval_ms=7, checkpoint_mode="at_least_once")
    derived = CheckpointConfig.from_settings(settings)
    assert (derived.interval_ms, derived.mode, derived.retained) == (
        7, "at_least_once", config.retained)


def test_a_second_default_or_an_undeclared_field_is_refused_at_import():
    from spark_ckpt.errors import InternalError
    from spark_ckpt.options import FROM_OPTIONS, defaults_from_options

    class OwnDefault:
        interval_ms: int = 5

    class Unknown:
        interval_mss: int = FROM_OPTIONS

    class WrongType:
        interval_ms: str = FROM_OPTIONS

    class Missing:
        work_dir: str = FROM_OPTIONS

    for cls, why in [(OwnDefault, "expected = FROM_OPTIONS"), (Unknown, "found none"),
                     (WrongType, "expected the type int")]:
        with pytest.raises(InternalError, match=why):
            defaults_from_options("checkpoint_")(cls)
    with pytest.raises(InternalError, match="a field for every option"):
        defaults_from_options(every=True)(Missing)


def test_values_are_parsed_and_validated_once():
    s = Settings.from_conf({"spark.ckpt.eventLog.flushIntervalMs": "250",
                            "spark.ckpt.batch.cleanupOnSuccess": "false",
                            "spark.ckpt.progress": "NEVER"})
    assert (s.event_log_flush_interval_ms, s.batch_cleanup_on_success, s.progress) == (
        250, False, "never")


@pytest.mark.parametrize("key, value, message", [
    ("spark.ckpt.eventLog.flushIntervalMs", "soon", "expected an integer, found 'soon'"),
    ("spark.ckpt.eventLog.flushMaxEvents", "0", "expected an integer >= 1, found 0"),
    ("spark.ckpt.batch.cleanupOnSuccess", "maybe", "expected true or false"),
    ("spark.ckpt.progress", "loud", "expected one of auto, always, never"),
    ("spark.ckpt.nonsense", "1", "unknown option spark.ckpt.nonsense"),
])
def test_bad_values_name_the_key_what_was_expected_and_found(key, value, message):
    with pytest.raises(ConfigurationError, match=message):
        Settings.from_conf({key: value})


def test_settings_are_immutable_and_read_from_a_spark_conf_like_object():
    class Conf:
        def get(self, key, default=None):
            return {"spark.ckpt.workDir": "/w"}.get(key, default)

    s = Settings.from_conf(Conf())
    assert s.work_dir == "/w"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.work_dir = "x"  # type: ignore[misc]


def test_configuration_doc_is_generated_from_the_declarations():
    assert (ROOT / "docs" / "configuration.md").read_text() == render_markdown()


def test_a_misspelled_key_in_a_mapping_is_refused_with_the_closest_known_key():
    with pytest.raises(ConfigurationError, match=r"unknown option spark.ckpt.stream."
                       r"maxBatchesInFligt.*did you mean spark.ckpt.stream.maxBatchesInFlight"):
        Settings.from_conf({"spark.ckpt.stream.maxBatchesInFligt": "3"})


def test_a_misspelled_key_in_the_session_is_warned_once_with_the_closest_known_key(
        spark, caplog):
    import logging

    spark.conf.set("spark.ckpt.checkpoint.intervallMs", "5")
    try:
        with caplog.at_level(logging.WARNING, logger="spark_ckpt.options"):
            Settings.from_conf(spark.conf)
            Settings.from_conf(spark.conf)
    finally:
        spark.conf.unset("spark.ckpt.checkpoint.intervallMs")
    warnings = [r.getMessage() for r in caplog.records
                if "spark.ckpt.checkpoint.intervallMs" in r.getMessage()]
    assert warnings == ["Unknown option spark.ckpt.checkpoint.intervallMs is ignored: expected "
                        "a declared spark.ckpt.* key; did you mean "
                        "spark.ckpt.checkpoint.intervalMs?"]


CONNECT_CHILD = """
import sys
from pyspark.sql import SparkSession, functions as F
spark = (SparkSession.builder.remote("local[2]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2").getOrCreate())
from spark_ckpt import BatchJob, StreamingContext, get_or_create_session, read_state
from spark_ckpt.state.aggregates import count, sum_
from spark_ckpt.storage.delta_reader import read_delta
assert get_or_create_session() is spark
work = sys.argv[1]
job = BatchJob("j", spark=spark, work_dir=work + "/work")
src = job.source("numbers", spark.range(1000).withColumn("k", F.col("id") % 7))
sums = job.vertex("sums", lambda df: df.groupBy("k").agg(F.sum("id").alias("s")), src,
                  key=("k",), parallelism=2)
job.write_delta(sums, work + "/sums")
result = job.run()
got = {r["k"]: r["s"] for r in read_delta(work + "/sums").to_pylist()}
assert got == {k: sum(i for i in range(1000) if i % 7 == k) for k in range(7)}, got
ctx = StreamingContext(spark, 0.2, work + "/ckpt", "p")
ctx.generator_stream("g", rows_per_batch=500, total_rows=2000, keys=10) \
   .key_by("key").agg(n=count(), total=sum_("value")).write_delta(work + "/out", name="out")
ctx.process_available(timeout=300)
state = read_state(spark, work + "/ckpt", "agg").toPandas()
assert len(state) == 10 and int(state.n.sum()) == 2000, state
print("CONNECT_OK", result.status, len(state))
spark.stop()
"""


@pytest.mark.slow
def test_an_in_process_spark_connect_session_runs_a_batch_job_and_a_keyed_pipeline(tmp_path):
    """``SparkSession.builder.remote("local[2]")``: a Connect server inside the client's own
    process tree, the quickest way to a Connect session (tests/test_connect.py runs the core
    scenarios on a standalone server)."""
    import subprocess
    import sys

    from helpers import child_env

    done = subprocess.run([sys.executable, "-c", CONNECT_CHILD, str(tmp_path)],
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CONNECT_OK succeeded 10" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
