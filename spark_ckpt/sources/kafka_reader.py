"""The Kafka source's reader in Python tasks (``mapInArrow``): each input row is one range of
one partition, ``[start, end)``, read with a consumer of its own assigned to the partition,
in offset order, as Arrow batches of Spark's Kafka schema (headers included).

Time: a Python worker's task waits for records with ``time.monotonic`` directly,
not a :class:`~spark_ckpt.clock.Clock`: none is injected in a worker, and the wait races a
real broker in real time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from spark_ckpt.errors import SourceError
from spark_ckpt.kafka_client import load as load_kafka

__all__ = ["ReadRanges"]

log = logging.getLogger(__name__)

# Spark's (Java's) timestamp type ids, by librdkafka's: not available, create time, log append
_TIMESTAMP_TYPES = {0: -1, 1: 0, 2: 1}
_READ_TIMEOUT_S = 120.0  # a range's consumer waits this long for records it knows exist
_BATCH_ROWS = 10_000  # records per Arrow batch a reading task yields
# librdkafka's codes for an offset out of range: the broker's, and its own (auto.offset.reset
# is "error": a reader never jumps elsewhere by itself)
_OUT_OF_RANGE = (1, -140)


class ReadRanges:
    """The Python tasks' reader (``mapInArrow``): each input row is a range of one partition;
    its records, in offset order, as Arrow batches of Spark's Kafka schema. Picklable by
    value (a plain object whose state is the client's configuration)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            for row in batch.to_pylist():
                yield from self._range(row["topic"], row["partition"], row["start"], row["end"])

    def _range(self, topic: str, partition: int, start: int, end: int) -> Iterator[Any]:
        import pyarrow as pa

        kafka = load_kafka()
        consumer = kafka.Consumer(self.spec["config"])
        try:
            consumer.assign([kafka.TopicPartition(topic, partition, start)])
            columns: dict[str, list[Any]] = {c: [] for c in (
                "key", "value", "topic", "partition", "offset", "timestamp", "timestampType",
                "headers")}
            first = True
            waited_since = time.monotonic()
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
                    if time.monotonic() - waited_since > _READ_TIMEOUT_S:
                        raise SourceError(
                            f"kafka source {self.spec['source']}: expected the records of "
                            f"{topic}-{partition} offsets {position}..{end - 1} from "
                            f"{self.spec['bootstrap']}, found none in {_READ_TIMEOUT_S:.0f} s "
                            f"(the consumer stands at {at})")
                    continue
                waited_since = time.monotonic()
                for message in messages:
                    error = message.error()
                    if error is not None:
                        if error.code() in _OUT_OF_RANGE:
                            yield from self._lost(consumer, topic, partition, position, end,
                                                  columns)
                            return
                        raise SourceError(
                            f"kafka source {self.spec['source']}: reading {topic}-{partition} "
                            f"at offset {position}: {error.str()}")
                    offset = message.offset()
                    if offset >= end:
                        position = end
                        break
                    if first and offset > start:
                        self._check_gap(consumer, topic, partition, start, offset)
                    first = False
                    kind, stamp = message.timestamp()
                    columns["key"].append(message.key())
                    columns["value"].append(message.value())
                    columns["topic"].append(topic)
                    columns["partition"].append(partition)
                    columns["offset"].append(offset)
                    columns["timestamp"].append(stamp * 1000 if kind else None)
                    columns["timestampType"].append(_TIMESTAMP_TYPES.get(kind, -1))
                    headers = message.headers()
                    columns["headers"].append(
                        [{"key": k, "value": v} for k, v in headers] if headers else [])
                    position = offset + 1
                if len(columns["offset"]) >= _BATCH_ROWS:
                    yield _arrow_batch(pa, columns)
                    columns = {c: [] for c in columns}
            if columns["offset"]:
                yield _arrow_batch(pa, columns)
        finally:
            consumer.close()

    def _check_gap(self, consumer: Any, topic: str, partition: int, start: int,
                   first: int) -> None:
        """The first record of a range is past its start: transaction markers, aborted or
        compacted records are gaps; offsets deleted since the range was allocated are lost."""
        kafka = load_kafka()
        low, _high = consumer.get_watermark_offsets(kafka.TopicPartition(topic, partition),
                                                    timeout=30.0, cached=False)
        if low > start:
            self._data_lost(topic, partition, start, low, first)

    def _lost(self, consumer: Any, topic: str, partition: int, position: int, end: int,
              columns: dict[str, list[Any]]) -> Iterator[Any]:
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
        import pyarrow as pa

        if columns["offset"]:
            yield _arrow_batch(pa, columns)
            for c in columns:
                columns[c].clear()
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


def _arrow_batch(pa: Any, columns: dict[str, list[Any]]) -> Any:
    header = pa.struct([("key", pa.string()), ("value", pa.binary())])
    return pa.RecordBatch.from_arrays([
        pa.array(columns["key"], pa.binary()),
        pa.array(columns["value"], pa.binary()),
        pa.array(columns["topic"], pa.string()),
        pa.array(columns["partition"], pa.int32()),
        pa.array(columns["offset"], pa.int64()),
        pa.array(columns["timestamp"], pa.timestamp("us", tz="UTC")),
        pa.array(columns["timestampType"], pa.int32()),
        pa.array(columns["headers"], pa.list_(header)),
    ], names=list(columns))
