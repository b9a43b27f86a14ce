"""Delta Lake's own Spark connector for tests: delta-spark from Maven Central, on the PySpark it
was built for, in a virtual environment of its own.

No delta-spark release is built for pip PySpark's Spark 4.3 (spark_ckpt's): Delta 4.4.0, the
newest, is built for Spark 4.2.0 (``delta-spark_4.2_2.13``; also 4.1 and 4.0 builds), and its
pip package pins ``pyspark<=4.2.0``. Delta Spark reaches into Spark's internals, so it runs here
only with the Spark it was built for: PySpark 4.2.0 from PyPI in a virtual environment under
``$SPARK_CKPT_TEST_CACHE`` (or ``~/.cache/spark-ckpt-tests``), its jars from
``jvm/delta-spark/pom.xml`` by Maven beside it, both fetched once (``.ci/run`` fetches them
before the tests; a test run on a fresh machine fetches them itself). The tests talk to one
Delta Spark session per module, a child process (tests/delta_spark_worker.py), while
spark_ckpt runs on the suite's own Spark 4.3 session: both read and write the same tables on
disk, as a Databricks cluster and a spark_ckpt pipeline would.

    python tests/delta_spark_env.py fetch     # the jars and the environment, now
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kafka_cluster import _fetched, cache_dir

ROOT = Path(__file__).resolve().parent.parent
POM = ROOT / "jvm" / "delta-spark" / "pom.xml"
WORKER = Path(__file__).resolve().parent / "delta_spark_worker.py"
MARK = b"@@answer "


def _property(name: str) -> str:
    text = POM.read_text()
    return text.split(f"<{name}>", 1)[1].split(f"</{name}>", 1)[0].strip()


def versions() -> dict[str, str]:
    """Delta's version, the Spark line its build is for, and the PySpark it runs on."""
    return {"delta": _property("delta.version"), "spark": _property("delta.spark.version"),
            "pyspark": _property("pyspark.version")}


def delta_jars() -> list[str]:
    """delta-spark, delta-storage and what they need beyond Spark's jars (fetched first if
    they are not there yet), for ``spark.jars``."""
    v = versions()
    target = _fetched(POM, f"delta-spark-{v['delta']}-spark-{v['spark']}", "jars")
    return sorted(str(p) for p in (target / "jars").glob("*.jar"))


def python() -> str:
    """The Python of a virtual environment with pip PySpark at ``pyspark.version`` (made once;
    pytest-xdist workers: one makes it, the rest wait)."""
    name = f"pyspark-{versions()['pyspark']}-venv"
    target = cache_dir() / name
    done = target / ".complete"
    if not done.exists():
        cache_dir().mkdir(parents=True, exist_ok=True)
        with open(cache_dir() / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                shutil.rmtree(target, ignore_errors=True)
                subprocess.run([sys.executable, "-m", "venv", str(target)], check=True,
                               timeout=300)
                run = subprocess.run(
                    [str(target / "bin" / "python"), "-m", "pip", "install", "--quiet",
                     "--disable-pip-version-check", f"pyspark=={versions()['pyspark']}"],
                    capture_output=True, text=True, timeout=1800)
                if run.returncode != 0:
                    raise RuntimeError(f"installing pyspark=={versions()['pyspark']} into "
                                       f"{target} failed: {(run.stdout + run.stderr)[-2000:]}")
                done.touch()
    return str(target / "bin" / "python")


class DeltaSpark:
    """A Delta Spark session in a child process (tests/delta_spark_worker.py)."""

    def __init__(self, warehouse: Path, log: Path, timeout: float = 900) -> None:
        env = {k: v for k, v in os.environ.items()
               if k not in ("SPARK_HOME", "PYTHONPATH", "SPARK_CKPT_DEFAULTS", "SPARK_REMOTE",
                            "PYSPARK_DRIVER_PYTHON", "SPARK_CONF_DIR")}
        interpreter = python()
        env["PYSPARK_PYTHON"] = interpreter
        warehouse.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [interpreter, str(WORKER), ",".join(delta_jars()), str(warehouse)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            cwd=str(warehouse), start_new_session=True)
        self._buffer = b""
        self._requests = 0  # the id of the last request (0: the session's start)
        self._start_timeout = timeout
        self.spark_version: str | None = None  # once the session is up (the first run)

    def run(self, code: str, timeout: float = 600, **args: Any) -> Any:
        """Run ``code`` in the session (see tests/delta_spark_worker.py); its ``result``.
        The first call waits for the session to start (the process starts at once, so a
        test's own work overlaps the JVM's start)."""
        assert self.proc.stdin is not None
        if self.spark_version is None:
            self.spark_version = self._answer(self._start_timeout, 0)
        self._requests += 1
        self.proc.stdin.write((json.dumps({"id": self._requests, "code": code, "args": args})
                               + "\n").encode())
        self.proc.stdin.flush()
        return self._answer(timeout, self._requests)

    def sql(self, statement: str, **args: Any) -> list[dict[str, Any]]:
        """The rows of a SQL statement, as JSON objects (``to_json``)."""
        return self.run("result = [__import__('json').loads(r[0]) for r in spark.sql(args['q'])"
                        ".select(F.to_json(F.struct('*'))).collect()]", q=statement, **args)

    def _answer(self, timeout: float, request: int) -> Any:
        """The answer to ``request`` (answers to earlier ones, whose test gave up waiting,
        are dropped)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                if line.startswith(MARK):
                    answer = json.loads(line[len(MARK):])
                    if answer.get("id", 0) != request:
                        continue
                    if not answer["ok"]:
                        raise DeltaSparkError(answer["error"])
                    return answer["result"]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Delta Spark gave no answer in {timeout} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"the Delta Spark worker ended (exit {self.proc.wait()}); "
                                       f"its log: {self._log.name}")
                self._buffer += chunk

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class DeltaSparkError(RuntimeError):
    """What the Delta Spark session raised (its Python traceback)."""


def main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"]:
        for jar in delta_jars():
            print(jar)
        print(python())
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
