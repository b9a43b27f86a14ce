"""The README's first command: the demo must exit 0, and reading Delta tables in a driver
process must never abort it at exit."""

from __future__ import annotations

import re
import subprocess
import sys

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from helpers import LONG_FAULTS, ROOT, child_env
from helpers import test_java_options as java_options  # not collected as a test

from spark_ckpt.storage.delta_reader import read_delta


def test_read_delta_gives_delta_rs_answer_with_partition_values(tmp_path):
    path = str(tmp_path / "t")
    for day in ("2026-11-22", "2026-11-23", "é ü/x"):
        write_deltalake(path, pa.table({"id": [1, 2], "day": [day, day]}), mode="append",
                        partition_by=["day"])
    got = read_delta(path).sort_by([("day", "ascending"), ("id", "ascending")])
    want = DeltaTable(path).to_pyarrow_table().sort_by([("day", "ascending"), ("id", "ascending")])
    assert got.to_pylist() == want.to_pylist()
    assert read_delta(path, version=0, columns=["id"]).column_names == ["id"]


def test_a_process_that_read_delta_tables_exits_cleanly(tmp_path):
    path = str(tmp_path / "t")
    for n in range(8):
        write_deltalake(path, pa.table({"id": list(range(n * 100, n * 100 + 100))}),
                        mode="append")
    code = (f"from spark_ckpt.storage.delta_reader import read_delta; "
            f"read_delta({path!r}).to_pandas()")
    for _ in range(6):  # the abort this guards against struck one exit in three
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


# The README's demo end to end (both parts, the same scripts and spark-submit commands) at a
# size whose partitions and batches are few; the long run keeps the size the test used to have.
DEMO_SIZE = (["--orders", "40000", "--parallelism", "16"] if LONG_FAULTS
             else ["--orders", "8000", "--parallelism", "8"])


def demo_env() -> dict[str, str]:
    """The tests' environment; the demo's spark-submit drivers (which read the repository's
    spark-defaults.conf, not the tests') start with the tests' JVM options too: spark-submit
    adds ``SPARK_SUBMIT_OPTS`` to the driver JVM it launches."""
    env = child_env()
    env["SPARK_SUBMIT_OPTS"] = f"{env.get('SPARK_SUBMIT_OPTS', '')} {java_options()}".strip()
    return env


@pytest.mark.slow
def test_the_demo_exits_zero(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), *DEMO_SIZE,
                           "--dir", str(tmp_path / "demo")], env=demo_env(),
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "outputs equal" in done.stdout and "every valid order exactly once" in done.stdout
    # the batch job was killed part-way and its second run reused what the first made durable
    reused = re.search(r"RESULT status=succeeded attempt=2 ran=\d+ reused=(\d+)", done.stdout)
    assert reused is not None and int(reused.group(1)) > 0, done.stdout[-3000:]
