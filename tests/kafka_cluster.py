"""Real Kafka brokers for tests and benchmarks: Kafka's own jars, KRaft mode, on loopback.

The jars come from Maven Central through ``jvm/kafka/pom.xml`` (``mvn
dependency:copy-dependencies``), once, into ``$SPARK_CKPT_TEST_CACHE`` or
``~/.cache/spark-ckpt-tests`` (``.ci/run`` fetches them before the tests; a test run on a fresh
machine fetches them itself). Each broker is a ``kafka.Kafka`` JVM in its own process group,
both broker and controller; a cluster of three has three voters (a static quorum), so one
broker may die and the others go on.

    python tests/kafka_cluster.py fetch          # the jars (broker, Spark's connector), now
    python tests/kafka_cluster.py run DIR [N]    # N brokers until Ctrl-C (their address printed)
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POM = ROOT / "jvm" / "kafka" / "pom.xml"
CONNECTOR_POM = ROOT / "jvm" / "spark-kafka" / "pom.xml"
# small heaps: the brokers share two cores and a test's data is small
BROKER_HEAP = os.environ.get("SPARK_CKPT_KAFKA_HEAP", "384m")


def _kafka_version() -> str:
    text = POM.read_text()
    return text.split("<kafka.version>", 1)[1].split("</kafka.version>", 1)[0].strip()


def cache_dir() -> Path:
    return Path(os.environ.get("SPARK_CKPT_TEST_CACHE")
                or Path.home() / ".cache" / "spark-ckpt-tests")


def jars_dir() -> Path:
    """The broker's jars (fetched first if they are not there yet)."""
    return _fetched(POM, f"kafka-{_kafka_version()}", "libs")


def connector_jars() -> list[str]:
    """Spark's own Kafka connector and what it needs beyond Spark's jars (fetched first if
    they are not there yet), for ``spark.jars``."""
    text = CONNECTOR_POM.read_text()
    version = text.split("<connector.version>", 1)[1].split("</connector.version>", 1)[0]
    target = _fetched(CONNECTOR_POM, f"spark-sql-kafka-{version.strip()}", "jars")
    return sorted(str(p) for p in (target / "jars").glob("*.jar"))


def _fetched(pom: Path, name: str, inner: str) -> Path:
    """``pom``'s dependencies copied once into ``<cache>/<name>/<inner>`` (pytest-xdist
    workers: one fetches, the rest wait)."""
    target = cache_dir() / name
    done = target / ".complete"
    if done.exists():
        return target
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            partial = target.with_name(target.name + f".partial-{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)
            mvn = shutil.which("mvn")
            if mvn is None:
                raise RuntimeError("expected Maven (mvn) on PATH to fetch jars from Maven "
                                   f"Central ({pom}), found none")
            run = subprocess.run(
                [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
                 f"-DoutputDirectory={partial / inner}"],
                capture_output=True, text=True, timeout=900)
            if run.returncode != 0:
                raise RuntimeError(f"fetching jars failed ({pom}): "
                                   f"{(run.stdout + run.stderr)[-2000:]}")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(partial, target)
            done.touch()
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_id() -> str:
    """A random cluster id as Kafka writes them (22 URL-safe base64 characters), never starting
    with "-": the storage tool would read that as an option (as Kafka's own Uuid avoids)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


@dataclasses.dataclass
class Broker:
    node_id: int
    port: int
    controller_port: int
    directory: Path
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.directory / "broker.log"


@dataclasses.dataclass
class KafkaCluster:
    """Brokers on loopback; ``bootstrap`` is their addresses."""

    brokers: list[Broker]
    directory: Path
    cluster_id: str

    @property
    def bootstrap(self) -> str:
        return ",".join(b.address for b in self.brokers)

    def _properties(self, broker: Broker) -> str:
        voters = ",".join(f"{b.node_id}@127.0.0.1:{b.controller_port}" for b in self.brokers)
        replication = min(3, len(self.brokers))
        return "\n".join([
            "process.roles=broker,controller",
            f"node.id={broker.node_id}",
            f"controller.quorum.voters={voters}",
            f"listeners=PLAINTEXT://127.0.0.1:{broker.port},"
            f"CONTROLLER://127.0.0.1:{broker.controller_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{broker.port}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            f"log.dirs={broker.directory / 'data'}",
            "num.partitions=1",
            f"default.replication.factor={replication}",
            f"offsets.topic.replication.factor={replication}",
            "offsets.topic.num.partitions=4",
            f"transaction.state.log.replication.factor={replication}",
            f"transaction.state.log.min.isr={min(2, replication)}",
            "transaction.state.log.num.partitions=4",
            f"min.insync.replicas={min(2, replication)}",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=false",
            # retention checks often, so a test can see offsets deleted
            "log.retention.check.interval.ms=1000",
            "log.segment.delete.delay.ms=0",
            "log.initial.task.delay.ms=0",
            "",
        ])

    def _java(self) -> list[str]:
        java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") \
            else Path(shutil.which("java") or "java")
        return [str(java), f"-Xmx{BROKER_HEAP}", f"-Xms{BROKER_HEAP}",
                "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                f"-Dlog4j2.configurationFile=file:{self.directory / 'log4j2.properties'}",
                "-cp", f"{jars_dir() / 'libs'}/*"]

    def format(self) -> None:
        (self.directory / "log4j2.properties").write_text(
            "rootLogger.level=WARN\nrootLogger.appenderRef.stdout.ref=STDOUT\n"
            "appender.stdout.type=Console\nappender.stdout.name=STDOUT\n"
            "appender.stdout.layout.type=PatternLayout\n"
            "appender.stdout.layout.pattern=[%d] %p %m (%c)%n\n"
            "logger.kafka.name=kafka\nlogger.kafka.level=INFO\n"
            "logger.state.name=state.change.logger\nlogger.state.level=WARN\n")
        for broker in self.brokers:
            broker.directory.mkdir(parents=True, exist_ok=True)
            conf = broker.directory / "server.properties"
            conf.write_text(self._properties(broker))
            run = subprocess.run(
                self._java() + ["kafka.tools.StorageTool", "format", "-t", self.cluster_id,
                                "-c", str(conf), "--ignore-formatted"],
                capture_output=True, text=True, timeout=120)
            if run.returncode != 0:
                raise RuntimeError(f"formatting broker {broker.node_id}'s storage failed: "
                                   f"{(run.stdout + run.stderr)[-2000:]}")

    def start(self, broker: Broker) -> None:
        with open(broker.log, "ab") as out:
            broker.proc = subprocess.Popen(
                self._java() + ["kafka.Kafka", str(broker.directory / "server.properties")],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, broker: Broker) -> None:
        """SIGKILL the broker's process group (its data stays: it may start again)."""
        if broker.proc is not None and broker.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(broker.proc.pid, signal.SIGKILL)
            broker.proc.wait(timeout=30)
        broker.proc = None

    def wait_ready(self, timeout: float = 120) -> None:
        """Until every running broker answers metadata requests with all brokers listed."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        running = [b for b in self.brokers if b.proc is not None]
        last: Exception | None = None
        while time.monotonic() < deadline:
            for b in running:
                if b.proc is not None and b.proc.poll() is not None:
                    raise RuntimeError(f"broker {b.node_id} exited ({b.proc.returncode}): "
                                       f"{b.log.read_text()[-3000:]}")
            try:
                admin = AdminClient({"bootstrap.servers": ",".join(b.address for b in running),
                                     "log_level": 0})  # no "connection refused" lines
                meta = admin.list_topics(timeout=5)
                if len(meta.brokers) >= len(running):
                    return
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = exc
            time.sleep(0.5)  # polling real JVMs until a deadline: a slow start waits longer
        raise RuntimeError(f"the Kafka brokers did not come up in {timeout} s ({last}); logs: "
                           f"{[str(b.log) for b in running]}")

    def stop(self) -> None:
        for broker in self.brokers:
            self.kill(broker)

    # -- topics ------------------------------------------------------------------------------
    def create_topic(self, name: str, partitions: int, *, replication: int | None = None,
                     config: dict[str, str] | None = None) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        topic = NewTopic(name, num_partitions=partitions,
                         replication_factor=replication or min(3, len(self.brokers)),
                         config=config or {})
        admin.create_topics([topic])[name].result(timeout=60)
        self.wait_for_partitions(name, partitions)

    def wait_for_partitions(self, name: str, partitions: int) -> None:
        """Until the brokers list ``partitions`` partitions of topic ``name``, each with a
        leader (polled until a deadline: a slow broker waits longer, never fails early)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            meta = admin.list_topics(topic=name, timeout=10).topics.get(name)
            if meta is not None and len(meta.partitions) == partitions and \
                    all(p.leader >= 0 for p in meta.partitions.values()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"topic {name}: not {partitions} partitions with leaders after 60 s")


def start_cluster(directory: Path, brokers: int = 1) -> KafkaCluster:
    """Format and start ``brokers`` brokers under ``directory``; wait until they answer."""
    directory.mkdir(parents=True, exist_ok=True)
    cluster = KafkaCluster(
        [Broker(i + 1, free_port(), free_port(), directory / f"broker-{i + 1}")
         for i in range(brokers)], directory, _cluster_id())
    cluster.format()
    try:
        for broker in cluster.brokers:
            cluster.start(broker)
        cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def kafka_cluster(directory: Path, brokers: int = 1) -> Iterator[KafkaCluster]:
    cluster = start_cluster(directory, brokers)
    try:
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["fetch"]:
        print(jars_dir())
        print("\n".join(connector_jars()))
    elif sys.argv[1:2] == ["run"]:
        with kafka_cluster(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1) \
                as running:
            print(running.bootstrap, flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    else:
        sys.exit(__doc__)
