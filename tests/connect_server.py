"""Start and stop a standalone Spark Connect server for tests and benchmarks."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyspark

ROOT = Path(__file__).resolve().parent.parent
SPARK_HOME = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)


@dataclasses.dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_conf(port: int, java_options: str = "") -> list[str]:
    """--conf arguments: the repository's defaults (a client cannot set a server's master or
    memory), the gRPC port and the server JVM's extra ``java_options``."""
    conf = {"spark.connect.grpc.binding.port": str(port),
            "spark.driver.extraJavaOptions":
                f"-Dlog4j2.configurationFile=file:{ROOT / 'conf' / 'log4j2.properties'} "
                f"{java_options}".strip()}
    for line in (ROOT / "spark-defaults.conf").read_text().splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and not parts[0].startswith("#"):
            conf.setdefault(parts[0], parts[1])
    conf["spark.master"] = os.environ.get("SPARK_CKPT_CONNECT_MASTER", "local[2]")
    return [arg for k, v in conf.items() for arg in ("--conf", f"{k}={v}")]


def start_server(directory: Path, *, port: int | None = None, timeout: float = 180,
                 java_options: str = "") -> Server:
    """Start ``start-connect-server.sh --wait`` in its own process group; wait until it
    answers a query."""
    port = port or free_port()
    log = directory / "server.log"
    env = dict(os.environ)
    env.pop("SPARK_REMOTE", None)
    env.update(SPARK_HOME=str(SPARK_HOME), PYSPARK_PYTHON=sys.executable,
               SPARK_LOG_DIR=str(directory), SPARK_PID_DIR=str(directory),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "jobs"), str(ROOT / "tests"),
                                           env.get("PYTHONPATH", "")]))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", str(SPARK_HOME / "sbin" / "start-connect-server.sh"), "--wait",
             *server_conf(port, java_options)], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=directory)
    server = Server(f"sc://localhost:{port}", port, proc, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Connect server exited ({proc.returncode}):\n"
                               + log.read_text()[-3000:])
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"the Connect server did not listen on {port} in {timeout} s:\n"
                       + log.read_text()[-3000:])


def stop_server(server: Server, sig: int = signal.SIGTERM) -> None:
    """Stop the server: its whole process group (the JVM and its Python workers)."""
    try:
        os.killpg(server.proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=60)
