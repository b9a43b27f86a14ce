import os
import stat

import pytest

from spark_ckpt.errors import EnvironmentError_
from spark_ckpt.javacheck import check_java, parse_java_version


@pytest.mark.parametrize("text, version", [
    ('openjdk version "17.0.15" 2025-04-15', 17),
    ('java version "1.8.0_392"', 8),
    ('openjdk version "21" 2023-09-19', 21),
    ("garbage", None),
])
def test_parse_java_version(text, version):
    assert parse_java_version(text) == version


def test_java_on_this_machine_is_accepted():
    assert check_java().endswith("java")


def test_bad_java_home_names_what_was_found(tmp_path):
    with pytest.raises(EnvironmentError_, match="JAVA_HOME is .* is not an executable"):
        check_java({"JAVA_HOME": str(tmp_path), "PATH": os.environ["PATH"]})


def test_missing_java_says_what_to_install(tmp_path):
    with pytest.raises(EnvironmentError_, match="no java on PATH"):
        check_java({"PATH": str(tmp_path)})


def test_old_java_is_refused_with_its_version(tmp_path):
    fake = tmp_path / "bin" / "java"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho \'java version "1.8.0_392"\' >&2\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(EnvironmentError_, match="is Java 8; Spark 4 needs Java 17"):
        check_java({"JAVA_HOME": str(tmp_path), "PATH": os.environ["PATH"]})
