"""spark_ckpt's jar (spark_ckpt/jvm.py): built by Maven into the package, on the spark.jars of a
session spark_ckpt builds, and used only where it can be (a classic session with more than one
executor); elsewhere stateful tasks run as Spark places them. Where it places tasks on a real
cluster: tests/test_state_cluster.py (local-cluster, against Spark's own event log) and
tests/test_netns_locality.py (three hosts)."""

from __future__ import annotations

import zipfile

import pytest

from spark_ckpt import jvm
from spark_ckpt.options import Settings
from spark_ckpt.session import _add_locality_jar
from spark_ckpt.sparkapi import spark_api


def test_the_package_ships_the_built_jar_with_its_class():
    path = jvm.jar_path()
    assert path is not None, "build it: python -m spark_ckpt.jvm build (.ci/run does)"
    assert path.parent.name == "jars" and path.parent.parent.name == "spark_ckpt"
    names = zipfile.ZipFile(path).namelist()
    assert jvm.LOCALITY_CLASS.replace(".", "/") + ".class" in names, names


def test_a_session_spark_ckpt_builds_gets_the_jar_once(monkeypatch, tmp_path):
    jar = tmp_path / jvm.JAR_NAME
    jar.write_bytes(b"")
    monkeypatch.setenv("SPARK_CKPT_LOCALITY_JAR", str(jar))
    settings = {"spark.jars": "/x/other.jar"}
    _add_locality_jar(settings)
    _add_locality_jar(settings)
    assert settings["spark.jars"] == f"/x/other.jar,{jar}"
    monkeypatch.setenv("SPARK_CKPT_LOCALITY_JAR", str(tmp_path / "missing.jar"))
    assert jvm.jar_path() is None
    empty: dict[str, str] = {}
    _add_locality_jar(empty)
    assert empty == {}  # no jar: the session is built as before


def test_the_option_is_on_by_default():
    assert Settings.from_conf({}).state_prefer_locations is True
    assert Settings.from_conf(
        {"spark.ckpt.state.preferLocations": "false"}).state_prefer_locations is False


def test_one_executor_or_spark_connect_runs_the_frame_as_it_is(spark):
    """local[*] has one executor (every task finds its range there); a Connect client cannot
    add a jar to its server: both answer None and the caller runs the frame unchanged."""
    df = spark.range(0, 10, 1, 2)
    assert spark_api(spark).prefer_locations(df, 2, {0: ("host", "1")}) is None


def test_the_build_needs_maven_and_says_so(monkeypatch):
    monkeypatch.setattr(jvm.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="Maven"):
        jvm.build()
