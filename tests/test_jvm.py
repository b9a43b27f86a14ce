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


def test_ranges_keep_their_executor_and_new_ones_spread_evenly():
    from spark_ckpt.sparkapi.classic import spread_ranges

    three = [("1", "10.0.0.1"), ("2", "10.0.0.2"), ("10", "10.0.0.3")]
    # the first batch: nothing known, six ranges two to each executor (not by string order)
    first = spread_ranges(6, {}, three)
    assert sorted(first.values()) == sorted(
        [f"executor_10.0.0.{h}_{e}" for h, e in ((1, "1"), (2, "2"), (3, "10"))] * 2)
    # known ranges stay; a new range goes where fewest are
    known = {0: ("10.0.0.1", "1"), 1: ("10.0.0.1", "1"), 2: ("10.0.0.2", "2")}
    placed = spread_ranges(4, known, three)
    assert placed == {0: "executor_10.0.0.1_1", 1: "executor_10.0.0.1_1",
                      2: "executor_10.0.0.2_2", 3: "executor_10.0.0.3_10"}
    # executor 2 lost, its host gone: its range goes to the least loaded; a lost executor
    # whose host still runs one keeps the host
    lost = {0: ("10.0.0.1", "1"), 1: ("10.0.0.2", "2"), 2: ("10.0.0.3", "9")}
    assert spread_ranges(3, lost, [("1", "10.0.0.1"), ("10", "10.0.0.3")]) == {
        0: "executor_10.0.0.1_1", 2: "10.0.0.3", 1: "executor_10.0.0.1_1"}
    # ranges past the parallelism are ignored; no executors known: no preferences
    assert spread_ranges(1, {5: ("h", "1")}, []) == {}
    # an executor the scheduler has but the status store does not list yet keeps its range
    # (the host its task reported) and gets no new one
    assert spread_ranges(2, {0: ("10.0.0.1", "1")}, [("1", None), ("2", "10.0.0.2")]) == {
        0: "executor_10.0.0.1_1", 1: "executor_10.0.0.2_2"}


def test_hosts_are_read_from_sparks_host_port():
    from spark_ckpt.sparkapi.classic import _host_of

    assert _host_of("10.0.0.1:4040") == "10.0.0.1"
    assert _host_of("worker-3.example:35000") == "worker-3.example"
    assert _host_of("[fe80::1]:35000") == "fe80::1"
    assert _host_of("fe80::1") == "fe80::1"  # a bare IPv6 address, not a port
    assert _host_of("worker-3") == "worker-3"


def test_the_build_needs_maven_and_says_so(monkeypatch):
    monkeypatch.setattr(jvm.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="Maven"):
        jvm.build()
