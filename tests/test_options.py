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
from pyspark.sql import SparkSession
spark = SparkSession.builder.remote("local[1]").config("spark.ui.enabled", "false").getOrCreate()
from spark_ckpt import BatchJob, StreamingContext, get_or_create_session
from spark_ckpt.errors import EnvironmentError_
refused = []
for attempt in (lambda: StreamingContext(spark, 1.0, sys.argv[1], "p"),
                lambda: BatchJob("j", spark=spark, work_dir=sys.argv[1]).run(),
                lambda: get_or_create_session()):
    try:
        attempt()
    except EnvironmentError_ as exc:
        refused.append(str(exc))
print("REFUSED", len(refused), refused[0] if refused else "")
spark.stop()
"""


@pytest.mark.slow
def test_a_spark_connect_session_is_refused_up_front(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("grpc", reason="Spark Connect's client needs grpcio (test extra)")
    done = subprocess.run([sys.executable, "-c", CONNECT_CHILD, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED 3 " in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "found a Spark Connect session" in done.stdout
