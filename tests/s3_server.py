"""A real S3-compatible server on loopback for tests and benchmarks, and Spark's S3A jars.

The server is moto's (``moto[server]``, Apache-2.0; MinIO is AGPL and is not used): a
Werkzeug HTTP server speaking the S3 REST API, run as ``python -m moto.server`` in its own
process group on a free port, state in memory. It implements conditional writes
(``If-None-Match: *`` on PutObject answers 412 when the key exists, ``If-Match`` with an
ETag), which is what delta-rs's commits (put-if-absent, its default on S3 since 0.23) and
spark_ckpt's create-if-absent need; ``tests/test_s3.py`` checks both against it.

Spark reaches it through Hadoop's S3A connector: ``hadoop-aws`` at pip PySpark's Hadoop
version and the AWS SDK v2 bundle its POM names, fetched by Maven from ``jvm/s3a/pom.xml``
once into ``$SPARK_CKPT_TEST_CACHE`` (``.ci/run`` fetches them before the tests).

    python tests/s3_server.py fetch        # the S3A jars, now
    python tests/s3_server.py run          # a server until Ctrl-C (its endpoint printed)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kafka_cluster import _fetched, free_port

ROOT = Path(__file__).resolve().parent.parent
POM = ROOT / "jvm" / "s3a" / "pom.xml"
ACCESS_KEY = "spark-ckpt-test"
SECRET_KEY = "spark-ckpt-test-secret"
REGION = "us-east-1"


def _hadoop_version() -> str:
    text = POM.read_text()
    return text.split("<hadoop.version>", 1)[1].split("</hadoop.version>", 1)[0].strip()


def pyspark_hadoop_version() -> str:
    """The Hadoop version pip PySpark ships (its ``hadoop-client-api-<v>.jar``)."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    found = sorted(p.name for p in jars.glob("hadoop-client-api-*.jar"))
    if not found:
        raise RuntimeError(f"expected hadoop-client-api-*.jar in {jars}, found none")
    return found[0].removeprefix("hadoop-client-api-").removesuffix(".jar")


def s3a_jars() -> list[str]:
    """hadoop-aws and the AWS SDK bundle, for ``spark.jars`` (fetched first if needed).

    Raises:
        RuntimeError: jvm/s3a/pom.xml names another Hadoop version than pip PySpark's.
    """
    version, spark = _hadoop_version(), pyspark_hadoop_version()
    if version != spark:
        raise RuntimeError(f"jvm/s3a/pom.xml: expected hadoop.version {spark} (pip PySpark's "
                           f"hadoop-client-api), found {version}")
    target = _fetched(POM, f"hadoop-aws-{version}", "jars")
    return sorted(str(p) for p in (target / "jars").glob("*.jar"))


@dataclasses.dataclass
class S3Server:
    """A moto S3 server on ``127.0.0.1:port`` with one fresh bucket."""

    port: int
    bucket: str
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def uri(self, *parts: str, scheme: str = "s3a") -> str:
        return "/".join([f"{scheme}://{self.bucket}", *(p.strip("/") for p in parts)])

    def spark_conf(self) -> dict[str, str]:
        """Spark's S3A settings for this server: the one place spark_ckpt reads S3 from."""
        prefix = "spark.hadoop.fs.s3a."
        return {prefix + "endpoint": self.endpoint,
                prefix + "path.style.access": "true",
                prefix + "access.key": ACCESS_KEY,
                prefix + "secret.key": SECRET_KEY,
                prefix + "endpoint.region": REGION,
                prefix + "connection.ssl.enabled": "false",
                # s3:// too, as Spark on EMR or Databricks names it
                "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem"}

    def client(self):
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                return True
        except OSError:
            return False


def start(log: Path, *, bucket: str | None = None, timeout: float = 60) -> S3Server:
    """Start a server in its own process group on a free port and create a bucket."""
    from helpers import wait_for

    server = S3Server(port=free_port(), bucket=bucket or f"ckpt-{uuid.uuid4().hex[:12]}")
    out = open(log, "ab")  # the child holds it open; closed here once it has it
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    server.proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(server.port)],
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True)
    out.close()
    if not wait_for(lambda: server.proc.poll() is not None or server.alive(), timeout):
        stop(server)
        raise RuntimeError(f"S3 server on port {server.port} did not answer in {timeout} s; "
                           f"see {log}")
    if server.proc.poll() is not None:
        raise RuntimeError(f"S3 server exited ({server.proc.returncode}); see {log}")
    try:
        server.client().create_bucket(Bucket=server.bucket)
    except BaseException:  # a server left running would outlive the caller
        stop(server)
        raise
    return server


def stop(server: S3Server) -> None:
    if server.proc is None or server.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=20)


@contextlib.contextmanager
def running(log: Path, **kw: str) -> Iterator[S3Server]:
    server = start(log, **kw)
    try:
        yield server
    finally:
        stop(server)


def defaults_file(server: S3Server, path: Path, *, jars_key: str = "spark.driver.extraClassPath",
                  base: str | None = None) -> Path:
    """The tests' spark-defaults.conf (or ``base``, a defaults file's text) plus S3A for
    ``server`` and its jars.

    ``jars_key``: the jars on the driver's class path by default (a local-mode driver is its
    own executor), not in ``spark.jars``: a driver copies every jar of ``spark.jars`` into its
    temporary directory at start-up, and one the tests SIGKILL leaves that copy behind (686 MB
    of the AWS SDK bundle each time). ``spark.jars`` works the same otherwise."""
    from helpers import defaults_text

    separator = "," if jars_key == "spark.jars" else ":"
    lines = [defaults_text() if base is None else base,
             f"{jars_key} {separator.join(s3a_jars())}"]
    lines += [f"{k} {v}" for k, v in server.spark_conf().items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"]:
        for jar in s3a_jars():
            print(jar)
        return 0
    if argv[:1] == ["run"]:
        with running(Path("s3-server.log")) as server:
            print(f"endpoint {server.endpoint} bucket {server.bucket}", flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
