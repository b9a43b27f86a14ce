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
