"""The Kafka source's reader in Python tasks (``mapInArrow``): each input row is one range of
one partition, ``[start, end)``, read with a consumer of its own assigned to the partition,
in offset order, as Arrow batches of Spark's Kafka schema (headers included).

Time: a Python worker's task waits for records with ``time.monotonic`` directly,
not a :class:`~spark_ckpt.clock.Clock`: none is injected in a worker, and the wait races a
real broker in real time.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from spark_ckpt.errors import SourceError
from spark_ckpt.kafka_client import load as load_kafka
from spark_ckpt.sources.kafka_values import RAW, TASK_PREFIX, parse_block

__all__ = ["ReadRanges"]

log = logging.getLogger(__name__)

# Spark's (Java's) timestamp type ids, by librdkafka's: not available, create time, log append
_TIMESTAMP_TYPES = {0: -1, 1: 0, 2: 1}
_READ_TIMEOUT_S = 120.0  # a range's consumer waits this long for records it knows exist
# a consumer that read nothing this long is replaced by a new one at the same position (a
# client stuck in a state of its own reads nothing however long it waits)
_RENEW_S = 20.0
_BATCH_ROWS = 10_000  # records per Arrow batch a reading task yields
# librdkafka's codes for an offset out of range: the broker's, and its own (auto.offset.reset
# is "error": a reader never jumps elsewhere by itself)
_OUT_OF_RANGE = (1, -140)
# Spark's Kafka schema (includeHeaders=true), in its order
_KAFKA_COLUMNS = ("key", "value", "topic", "partition", "offset", "timestamp", "timestampType",
                  "headers")


class _Consumers:
    """A Python worker's Kafka consumers, kept between its tasks (Spark reuses a Python worker
    for many tasks), per client configuration, as Spark's Kafka connector pools its consumers:
    a kept consumer has its connections and metadata (a new one costs a short batch's task
    about 150 ms). A task takes the one that last read its partition if there is one, else any,
    assigned to the range's partition at the range's start.
    A consumer is kept only after a range it read to its end, unassigned (an idle consumer
    fetches nothing); at most ``_KEPT`` a configuration, and none idle for ``_IDLE_S``."""

    _IDLE_S = 300.0
    _KEPT = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the pool: a worker may run tasks on several threads
        # configuration -> [(topic, partition, consumer, when given back)], oldest first
        self._idle: dict[str, list[tuple[str, int, Any, float]]] = {}

    def take(self, config: dict[str, Any], topic: str, partition: int, start: int
             ) -> tuple[str, Any]:
        """A consumer of ``topic``-``partition`` whose next record is ``start``."""
        kafka = load_kafka()
        key = json.dumps(config, sort_keys=True, default=str)
        now = time.monotonic()
        closing = []
        kept = None
        with self._lock:
            for pooled in self._idle.values():
                closing += [e[2] for e in pooled if now - e[3] > self._IDLE_S]
                pooled[:] = [e for e in pooled if now - e[3] <= self._IDLE_S]
            entries = self._idle.get(key, [])
            if entries:
                mine = [i for i, e in enumerate(entries) if (e[0], e[1]) == (topic, partition)]
                kept = entries.pop(mine[-1] if mine else 0)
        for consumer in closing:
            _close(consumer)
        if kept is not None:
            consumer = kept[2]
            try:
                # kept unassigned: assigned afresh at the range's start. Not paused and
                # resumed: librdkafka's pause/resume ops race an assign (versioned ops on
                # the partition, confluentinc/librdkafka#5591, #2190) and left a partition
                # paused for good, its position invalid, found reading nothing until the
                # timeout
                consumer.assign([kafka.TopicPartition(topic, partition, start)])
                return key, consumer
            except Exception as exc:  # noqa: BLE001 - a kept client that fails: a new one
                log.debug("kafka reader: a kept consumer failed (%s); a new one", exc)
                _close(consumer)
        return key, self.new(config, topic, partition, start)

    @staticmethod
    def new(config: dict[str, Any], topic: str, partition: int, start: int) -> Any:
        """A new consumer assigned to ``topic``-``partition`` at ``start``."""
        kafka = load_kafka()
        consumer = kafka.Consumer(config)
        consumer.assign([kafka.TopicPartition(topic, partition, start)])
        return consumer

    def give_back(self, key: str, topic: str, partition: int, consumer: Any) -> None:
        """Keep ``consumer``, unassigned (a kept one that went on prefetching cost the tasks
        CPU and memory, and threw its fetches away when another worker read the range next)."""
        try:
            consumer.unassign()
        except Exception as exc:  # noqa: BLE001 - a client that fails now is not kept
            log.debug("kafka reader: unassigning a consumer failed (%s); closed", exc)
            _close(consumer)
            return
        with self._lock:
            entries = self._idle.setdefault(key, [])
            entries.append((topic, partition, consumer, time.monotonic()))
            extra = entries[:-self._KEPT] if len(entries) > self._KEPT else []
            del entries[:len(extra)]
        for _t, _p, old, _at in extra:
            _close(old)


_CONSUMERS = _Consumers()


def _close(consumer: Any) -> None:
    try:
        consumer.close()
    except Exception as exc:  # noqa: BLE001 - closing a client of a broker gone
        log.debug("kafka reader: closing a consumer: %s", exc)


class ReadRanges:
    """The Python tasks' reader (``mapInArrow``): each input row is the id of a task, whose
    ranges (each of one partition) ``spec["tasks"]`` lists; their records, in offset order,
    as Arrow batches of Spark's Kafka schema (or of the value format's columns). Picklable
    by value (a plain object whose state is the client's configuration)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            for task in batch.column(0).to_pylist():
                for topic, partition, start, end in self.spec["tasks"][task]:
                    yield from self._range(topic, partition, start, end)

    def _range(self, topic: str, partition: int, start: int, end: int) -> Iterator[Any]:
        import pyarrow as pa

        kafka = load_kafka()
        key, consumer = _CONSUMERS.take(self.spec["config"], topic, partition, start)
        read_to_end = False
        try:
            first = True
            waited_since = renewed_since = time.monotonic()
            position = start
            while position < end:
                messages = consumer.consume(num_messages=min(_BATCH_ROWS, end - position),
                                            timeout=1.0)
                if not messages:
                    # the consumer's position moves past transaction markers and aborted
                    # records too: the range ends at its end offset whatever it held
                    at = consumer.position([kafka.TopicPartition(topic, partition)])[0].offset
                    if at >= end:
                        break
                    quiet = time.monotonic() - max(waited_since, renewed_since)
                    if quiet > _RENEW_S and time.monotonic() - waited_since <= _READ_TIMEOUT_S:
                        log.warning("kafka source %s: %s-%d read nothing at offset %d in %.0f s "
                                    "(the consumer stands at %d); a new consumer",
                                    self.spec["source"], topic, partition, position, quiet, at)
                        _close(consumer)
                        consumer = _CONSUMERS.new(self.spec["config"], topic, partition,
                                                  position)
                        renewed_since = time.monotonic()
                        continue
                    if time.monotonic() - waited_since > _READ_TIMEOUT_S:
                        raise SourceError(
                            f"kafka source {self.spec['source']}: expected the records of "
                            f"{topic}-{partition} offsets {position}..{end - 1} from "
                            f"{self.spec['bootstrap']}, found none in {_READ_TIMEOUT_S:.0f} s "
                            f"(the consumer stands at {at})")
                    continue
                waited_since = time.monotonic()
                failed = next((i for i, m in enumerate(messages) if m.error() is not None),
                              None)
                good = messages if failed is None else messages[:failed]
                if good and good[-1].offset() >= end:  # records past the range: not read
                    offsets = [m.offset() for m in good]
                    good = good[:bisect.bisect_left(offsets, end)]
                    failed = None
                    position = end
                if good:
                    if first and good[0].offset() > start:
                        self._check_gap(consumer, topic, partition, start, good[0].offset())
                    first = False
                    position = max(position, good[-1].offset() + 1)
                    yield self._batch(pa, topic, partition, good)
                    # the time the task's consumer (the JVM) took the batch is not a quiet
                    # broker's: waiting counts from here
                    waited_since = time.monotonic()
                if failed is not None:
                    error = messages[failed].error()
                    if error.code() in _OUT_OF_RANGE:
                        yield from self._lost(consumer, topic, partition, position, end)
                        return
                    raise SourceError(
                        f"kafka source {self.spec['source']}: reading {topic}-{partition} "
                        f"at offset {position}: {error.str()}")
            read_to_end = True
        finally:
            if read_to_end:
                _CONSUMERS.give_back(key, topic, partition, consumer)
            else:  # an error, a lost range, or the task cancelled: not kept
                _close(consumer)

    def _batch(self, pa: Any, topic: str, partition: int, messages: list[Any]) -> Any:
        """One Arrow batch of ``messages``: Spark's Kafka schema, or the value format's
        columns (values parsed where Arrow's answer is Spark's, else left raw to Spark)."""
        form = self.spec.get("format")
        wanted = _KAFKA_COLUMNS if form is None else form["metadata"]
        prefix = "" if form is None else TASK_PREFIX  # (a value field may be called offset)
        columns: dict[str, Any] = {}
        if form is not None:
            values = [m.value() for m in messages]
            parsed, ok = parse_block(pa, values, form)
            for i, (name, _kind) in enumerate(form["fields"]):
                # not parsed here: the fields null, Spark's from_json parses the raw values
                columns[name] = parsed[i] if ok else pa.nulls(len(values), form["types"][i])
        n = len(messages)
        for name in wanted:
            if name == "key":
                columns[prefix + name] = pa.array([m.key() for m in messages], pa.binary())
            elif name == "value":
                columns[prefix + name] = pa.array([m.value() for m in messages], pa.binary())
            elif name == "topic":
                columns[prefix + name] = pa.array([topic] * n, pa.string())
            elif name == "partition":
                columns[prefix + name] = pa.array([partition] * n, pa.int32())
            elif name == "offset":
                columns[prefix + name] = pa.array([m.offset() for m in messages], pa.int64())
            elif name in ("timestamp", "timestampType"):
                stamps = [m.timestamp() for m in messages]
                columns[prefix + name] = (
                    pa.array([s * 1000 if k else None for k, s in stamps],
                             pa.timestamp("us", tz="UTC")) if name == "timestamp" else
                    pa.array([_TIMESTAMP_TYPES.get(k, -1) for k, _s in stamps], pa.int32()))
            elif name == "headers":
                columns[prefix + name] = pa.array(
                    [[{"key": k, "value": v} for k, v in h] if (h := m.headers()) else []
                     for m in messages], _headers_type(pa))
        if form is not None:
            columns[RAW] = pa.nulls(n, pa.binary()) if ok else pa.array(values, pa.binary())
        return pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))

    def _check_gap(self, consumer: Any, topic: str, partition: int, start: int,
                   first: int) -> None:
        """The first record of a range is past its start: transaction markers, aborted or
        compacted records are gaps; offsets deleted since the range was allocated are lost."""
        kafka = load_kafka()
        low, _high = consumer.get_watermark_offsets(kafka.TopicPartition(topic, partition),
                                                    timeout=30.0, cached=False)
        if low > start:
            self._data_lost(topic, partition, start, low, first)

    def _lost(self, consumer: Any, topic: str, partition: int, position: int, end: int
              ) -> Iterator[Any]:
        kafka = load_kafka()
        low, high = consumer.get_watermark_offsets(kafka.TopicPartition(topic, partition),
                                                   timeout=30.0, cached=False)
        if low > position:
            self._data_lost(topic, partition, position, low, None)
        else:  # not deleted: the partition holds fewer offsets than were recorded
            self._lost_or_skipped(
                f"kafka source {self.spec['source']}: expected offsets {position}..{end - 1} "
                f"of {topic}-{partition} (recorded for this batch), found offsets {low}.."
                f"{high - 1} only: the partition was truncated (an unclean leader election) or "
                "the topic recreated")
        # skipping: what is left of the range, never before where this range stands
        resume = max(low, position)
        if low > position and resume < min(end, high):
            yield from self._range(topic, partition, resume, end)

    def _data_lost(self, topic: str, partition: int, start: int, low: int,
                   first: int | None) -> None:
        self._lost_or_skipped(
            f"kafka source {self.spec['source']}: expected offsets from {start} of "
            f"{topic}-{partition} (recorded for this batch), found the earliest available "
            f"offset {low}: offsets {start}..{low - 1} were deleted (by retention) after the "
            "batch was allocated")

    def _lost_or_skipped(self, message: str) -> None:
        """Offsets of the range are gone: fail (the default), or log the skip."""
        if self.spec["fail_on_data_loss"]:
            raise SourceError(message + "; set fail_on_data_loss=False to skip them")
        log.warning("%s; skipped (fail_on_data_loss=False)", message)


def _headers_type(pa: Any) -> Any:
    return pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
