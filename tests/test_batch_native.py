"""The batch data path runs no Python in Spark tasks: a driver whose executors cannot start a
Python worker at all (as on a cluster without spark_ckpt, or without Python) runs the example
job to the same answer as plain PySpark."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from helpers import ROOT, assert_outputs_equal, child_env, job_command

pytestmark = pytest.mark.slow


def test_example_job_runs_where_no_python_worker_can_start(
        spark, orders_input, expected_daily, tmp_path):
    marker = tmp_path / "python-worker-started"
    no_python = tmp_path / "no-python"
    no_python.write_text(f"#!/bin/sh\ntouch {marker}\necho 'no Python worker here' >&2\n"
                         "exit 1\n")
    no_python.chmod(no_python.stat().st_mode | stat.S_IEXEC)
    env = child_env()
    env["PYSPARK_PYTHON"] = str(no_python)
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    proc = subprocess.run(job_command(orders_input, out, work), env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert not os.path.exists(marker), "a Spark task started a Python worker"
    assert "RESULT status=succeeded" in proc.stdout
    # the catalog probe and the bucketed writes need no Python either: the exchange is made
    assert "the exchange of payments into settled" in proc.stdout + proc.stderr
    assert_outputs_equal(spark, out, expected_daily)
