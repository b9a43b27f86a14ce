"""The Kafka client seam: librdkafka (confluent-kafka) loaded on demand, options as Spark's
Kafka source and sink take them (``kafka.*``) turned into librdkafka's, and secrets kept out of
what is written or logged. The source (sources/kafka.py) and the sink (sinks/kafka.py) share it.
"""

from __future__ import annotations

import re
from typing import Any

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import EnvironmentError_

_SYSTEM_CLOCK = SystemClock()

__all__ = ["client_config", "committed", "error_text", "load"]

_JAAS_FIELD = re.compile(r'(username|password)\s*=\s*"((?:[^"\\]|\\.)*)"')
# Java client options with no librdkafka counterpart, which Spark users pass: dropped
# (``default.api.timeout.ms`` bounds the source's metadata requests instead)
_JAVA_ONLY = frozenset({"default.api.timeout.ms", "interceptor.classes", "partitioner.class",
                        "max.poll.records", "sasl.login.callback.handler.class",
                        "sasl.client.callback.handler.class", "security.providers"})
# a group coordinator not there yet: NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS,
# COORDINATOR_NOT_AVAILABLE (librdkafka marks some of them retriable, not all)
_COORDINATOR_MOVING = frozenset({16, 14, 15})
# Java client option names that librdkafka spells otherwise
_RENAMED = {"sasl.mechanism": "sasl.mechanisms", "ssl.truststore.location": "ssl.ca.location"}


def client_config(bootstrap_servers: str, options: dict[str, str]) -> dict[str, Any]:
    """The librdkafka configuration of ``options`` (``kafka.*`` keys, as Spark's Kafka source
    takes them; the prefix is dropped), with ``bootstrap.servers``. A Java client's
    ``sasl.jaas.config`` with a username and password (PLAIN, SCRAM) becomes librdkafka's
    ``sasl.username``/``sasl.password``."""
    config: dict[str, Any] = {"bootstrap.servers": bootstrap_servers}
    for key, value in options.items():
        if not key.startswith("kafka."):
            continue
        name = key[len("kafka."):]
        if name == "sasl.jaas.config":
            fields = dict(_JAAS_FIELD.findall(str(value)))
            if "username" in fields:
                config["sasl.username"] = fields["username"]
            if "password" in fields:
                config["sasl.password"] = fields["password"]
            continue
        if name in ("enable.auto.commit", "auto.offset.reset", "group.id"):
            continue  # the source and the sink set these themselves
        if name in _JAVA_ONLY or name.endswith((".serializer", ".deserializer")):
            continue  # Java client options librdkafka does not have (see _JAVA_ONLY)
        config[_RENAMED.get(name, name)] = value
    return config


def error_text(exc: BaseException) -> str:
    """An exception's first line, short (for an error naming what failed)."""
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def load() -> Any:
    """The confluent_kafka module (with its admin client), or EnvironmentError_ saying how to
    install it."""
    try:
        import confluent_kafka
        import confluent_kafka.admin  # the admin client, used through the module
    except ImportError as exc:
        raise EnvironmentError_(
            "the Kafka source and sink expect the confluent-kafka package (pip install "
            f"'spark-ckpt[kafka]'), found it missing ({exc})") from None
    return confluent_kafka


def committed(consumer: Any, partitions: list[Any], timeout: float = 60.0,
              clock: Clock = _SYSTEM_CLOCK) -> list[Any]:
    """``consumer.committed(partitions)``, asked again while the group's coordinator is not
    ready (a new cluster creates its offsets topic; a coordinator moves after a broker's
    loss): those answers are retriable, and a commit marker must be read, not guessed."""
    kafka = load()
    deadline = clock.monotonic_s() + timeout
    while True:
        try:
            return list(consumer.committed(partitions, timeout=min(30.0, timeout)))
        except kafka.KafkaException as exc:
            error = exc.args[0] if exc.args else None
            retriable = getattr(error, "retriable", lambda: False)() or getattr(
                error, "code", lambda: None)() in _COORDINATOR_MOVING
            if not retriable or clock.monotonic_s() > deadline:
                raise
            clock.sleep(0.5)
