"""Kafka topics as a replayable source: each batch's offset range per topic-partition is in
its allocation before the batch runs, and a replay reads exactly that range.

The driver plans with a Kafka client (confluent-kafka, librdkafka underneath): which
partitions the topics (or the pattern) have now, their earliest and latest offsets, where the
source stands in each. A batch's piece lists every partition the source knows, with the range
``[start, end)`` it reads (``start == end``: nothing this batch), so the newest piece alone
says where the source stands. Partitions added to a topic and topics that come to match the
pattern are picked up between batches, from their earliest offset (as Spark's Kafka source
does). The topics' ids are recorded too: a topic deleted and created again under the same name
is found, not read as the old one.

Reading a piece: where Spark's Kafka connector is on the session's classpath (Databricks has
it), through it (``spark.read.format("kafka")`` with the ranges as ``startingOffsets`` and
``endingOffsets``); otherwise in Python tasks, one per range (``mapInArrow``), each with its
own Kafka consumer assigned to its partition. Both give Spark's Kafka schema, headers
included, and the same rows.

Offsets that are gone (retention deleted them before they were read, or the topic was
recreated) stop the pipeline with a :class:`~spark_ckpt.errors.SourceError` naming the topic,
the partition, the recorded offsets and the available ones, as Spark's ``failOnDataLoss=true``
does; with ``fail_on_data_loss=False`` they are skipped and counted in the progress
(``skipped_offsets``).

Secrets: ``options`` (``kafka.*`` keys, as Spark's source takes them) go to the Kafka clients
only. :meth:`KafkaSource.describe` (recorded in the checkpoint) and every log line and error
message name the bootstrap servers and the topics, never an option's value.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import EnvironmentError_, JobDefinitionError, RecordError, SourceError
from spark_ckpt.formats import BOOL, STR, ListOf, MapOf, Opt, Row, integer
from spark_ckpt.kafka_client import client_config, error_text
from spark_ckpt.kafka_client import load as load_kafka
from spark_ckpt.sources.kafka_reader import ReadRanges
from spark_ckpt.sources.kafka_values import ValueFormat
from spark_ckpt.sources.source import Source, SourceRun

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = ["KAFKA_SCHEMA", "KafkaSource"]

log = logging.getLogger(__name__)
# the driver's Kafka clients log through Python's logging (librdkafka writes to stderr else)
_LIBRDKAFKA = logging.getLogger("spark_ckpt.kafka.librdkafka")

# Spark's Kafka source schema with includeHeaders=true
KAFKA_SCHEMA = ("key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT, "
                "timestamp TIMESTAMP, timestampType INT, "
                "headers ARRAY<STRUCT<key: STRING, value: BINARY>>")
# the Python reader's fetches, unless the options say otherwise: librdkafka's defaults (1 MB
# per partition a fetch) read a range about 3x slower than these (measured, docs/kafka.md)
# (a kept consumer prefetches at most queued.max.messages.kbytes: 16 MB, not librdkafka's 64)
_READER_FETCH = {"max.partition.fetch.bytes": 16 << 20, "fetch.max.bytes": 64 << 20,
                 "queued.max.messages.kbytes": 16 << 10}
# a short batch's Python reading tasks hold about this many offsets each
_OFFSETS_PER_TASK = 100_000
# where a new pipeline may start, besides a map of offsets or a timestamp
_STARTING = ("earliest", "latest")


class KafkaSource(Source):
    """Records of Kafka topics (see the module's docstring).

    Args:
        name: the source's name, unique in the pipeline.
        bootstrap_servers: ``host:port[,host:port...]``.
        topics: the topics to read; or ``pattern``, a regular expression their names must
            match (in full, as Spark's ``subscribePattern``), checked again before every batch.
        starting_offsets: where a new pipeline starts: ``"earliest"``, ``"latest"`` (the
            default, as Spark's), ``{topic: {partition: offset}}`` (``-2``: earliest, ``-1``:
            latest; a partition not named starts at the latest), or a timestamp in
            milliseconds (the first offset at or after it, per partition). Only a new pipeline
            reads it; a restart goes on from its recorded position, and partitions found later
            start at their earliest offset.
        max_offsets_per_batch: at most this many offsets per batch over all partitions,
            shared in proportion to each partition's backlog (Spark's ``maxOffsetsPerTrigger``);
            None: everything there is.
        fail_on_data_loss: True (the default): offsets gone before they were read stop the
            pipeline with a SourceError naming them; False: they are skipped and counted.
        options: ``kafka.*`` options for the Kafka clients (security, timeouts...), as
            Spark's Kafka source takes them; ``kafka.isolation.level`` defaults to
            ``read_committed`` (transactions' records once committed, never aborted ones).
            With ``kafka.group.id``, the offsets each completed checkpoint covers are
            committed to that consumer group (for lag monitors; never read back: the
            checkpoint is where the source stands).
        reader: ``"auto"`` (Spark's connector where the session has it, else Python tasks),
            ``"spark"`` or ``"python"``.
        min_partitions: at least this many reading tasks a batch (ranges split by offsets,
            as Spark's ``minPartitions``); None: one per topic-partition range.
        value_format: None (the default): rows in Spark's Kafka schema; ``"json"``: each
            value parsed into ``value_schema``'s columns exactly as Spark's
            ``from_json(CAST(value AS STRING), value_schema)`` parses it (Flink SQL's
            ``'value.format' = 'json'``); Python tasks parse it with Arrow where that is
            certainly Spark's answer (sources/kafka_values.py).
        value_schema: the value's schema (DDL string or StructType), with ``value_format``.
        metadata_columns: with ``value_format``, the Kafka columns kept beside the value's
            fields: a list of names (``["timestamp", "partition"]``) or ``{output name:
            Kafka column}``.
    """

    kind = "kafka"
    PIECE = {"ranges": ListOf(Row(STR, integer(0), integer(0), integer(0))),
             "topic_ids": MapOf(STR), "offsets": integer(0), "skipped?": integer(0),
             "reset?": Opt(BOOL), "initial?": Opt(BOOL)}

    def __init__(self, name: str, bootstrap_servers: str, *,
                 topics: list[str] | None = None, pattern: str | None = None,
                 starting_offsets: str | int | dict[str, dict[Any, int]] = "latest",
                 max_offsets_per_batch: int | None = None, fail_on_data_loss: bool = True,
                 options: dict[str, str] | None = None, reader: str = "auto",
                 min_partitions: int | None = None, value_format: str | None = None,
                 value_schema: str | StructType | None = None,
                 metadata_columns: list[str] | dict[str, str] | None = None) -> None:
        super().__init__(name)
        if value_format is None and (value_schema is not None or metadata_columns):
            raise JobDefinitionError(
                f"kafka source {name}: value_schema and metadata_columns go with "
                "value_format='json'; found them without a value_format")
        self.value_format = (ValueFormat(name, value_format, value_schema, metadata_columns)
                             if value_format is not None else None)
        if (topics is None) == (pattern is None):
            raise JobDefinitionError(
                f"kafka source {name}: expected exactly one of topics=[...] and pattern=..., "
                f"found topics={topics!r}, pattern={pattern!r}")
        if topics is not None and (not topics or not all(isinstance(t, str) and t
                                                         for t in topics)):
            raise JobDefinitionError(
                f"kafka source {name}: expected topics as a non-empty list of names, found "
                f"{topics!r}")
        if not isinstance(bootstrap_servers, str) or not bootstrap_servers.strip():
            raise JobDefinitionError(
                f"kafka source {name}: expected bootstrap_servers as 'host:port[,host:port]', "
                f"found {bootstrap_servers!r}")
        if isinstance(starting_offsets, str) and starting_offsets not in _STARTING:
            raise JobDefinitionError(
                f"kafka source {name}: expected starting_offsets 'earliest', 'latest', "
                f"{{topic: {{partition: offset}}}} or a timestamp in milliseconds, found "
                f"{starting_offsets!r}")
        if max_offsets_per_batch is not None and max_offsets_per_batch < 1:
            raise JobDefinitionError(
                f"kafka source {name}: expected max_offsets_per_batch >= 1 or None, found "
                f"{max_offsets_per_batch}")
        if reader not in ("auto", "spark", "python"):
            raise JobDefinitionError(
                f"kafka source {name}: expected reader 'auto', 'spark' or 'python', found "
                f"{reader!r}")
        bad = [k for k in (options or {}) if not k.startswith("kafka.")]
        if bad:
            raise JobDefinitionError(
                f"kafka source {name}: expected options named kafka.<client option> (as "
                f"Spark's Kafka source takes them), found {sorted(bad)}")
        self.bootstrap = bootstrap_servers.strip()
        self.topics = list(topics) if topics is not None else None
        self.pattern = pattern
        self._regex = re.compile(pattern) if pattern is not None else None
        self.starting = starting_offsets
        self.max_offsets = max_offsets_per_batch
        self.fail_on_data_loss = fail_on_data_loss
        self.options = dict(options or {})
        self.options.setdefault("kafka.isolation.level", "read_committed")
        self.reader = reader
        self.min_partitions = min_partitions
        self._lock = threading.Lock()  # the positions: planned on the loop, read for progress
        self.positions: dict[tuple[str, int], int] = {}
        self.topic_ids: dict[str, str] = {}
        self._started = False  # a position was restored or advanced: not a new pipeline
        self._consumer: Any = None  # the planner's clients (the pipeline loop's thread)
        self._admin: Any = None
        self._connector: bool | None = None
        self.group_id = self.options.get("kafka.group.id")
        self._committer: _GroupCommitter | None = None

    # -- what is recorded -------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "bootstrap": self.bootstrap}
        if self.topics is not None:
            out["topics"] = sorted(self.topics)
        else:
            out["pattern"] = self.pattern
        return out

    def split_columns(self) -> tuple[str, ...]:
        """Kafka's topic and partition, as this source's rows name them: (``topic``,
        ``partition``) in Spark's Kafka schema; with ``value_format``, the metadata columns
        kept for them (the partition alone will do when one topic is read); () when the rows
        do not carry the partition."""
        if self.value_format is None:
            return ("topic", "partition")
        named = {kafka: out for out, kafka in self.value_format.metadata.items()}
        if "partition" not in named:
            return ()
        if "topic" in named:
            return (named["topic"], named["partition"])
        return (named["partition"],) if self.topics is not None and len(self.topics) == 1 \
            else ()

    def schema(self) -> StructType:
        from typing import cast

        from pyspark.sql.types import StructType

        if self.value_format is not None:
            return self.value_format.schema()
        return cast(StructType, StructType.fromDDL(KAFKA_SCHEMA))

    def _check_places(self, piece: dict[str, Any], field: str) -> None:
        for i, (topic, partition, start, end) in enumerate(piece["ranges"]):
            if end < start:
                raise RecordError(f"field {field}.ranges[{i}]: expected an end offset at least "
                                  f"its start {start} ({topic}-{partition}), found {end}")

    def restore(self, pieces: list[tuple[int, dict[str, Any]]]) -> None:
        with self._lock:
            for _batch, piece in pieces:
                for topic, partition, _start, end in piece["ranges"]:
                    self.positions[(topic, partition)] = end
                self.topic_ids.update(piece.get("topic_ids", {}))
                self._started = True

    def advance(self, piece: dict[str, Any]) -> None:
        with self._lock:
            for topic, partition, _start, end in piece["ranges"]:
                self.positions[(topic, partition)] = end
            self.topic_ids.update(piece["topic_ids"])
            self._started = True

    def position(self) -> dict[str, Any]:
        with self._lock:
            return {f"{t}-{p}": o for (t, p), o in sorted(self.positions.items())}

    def rows(self, piece: dict[str, Any]) -> int | None:
        return int(piece["offsets"])

    def is_empty(self, piece: dict[str, Any]) -> bool:
        """No offsets to read; but a new pipeline's first piece is recorded even so: it holds
        where ``starting_offsets`` put each partition ("latest" resolved now, not at the next
        start), as Structured Streaming records its initial offsets."""
        return int(piece["offsets"]) == 0 and not piece.get("initial")

    def commit_consumed(self, checkpoint_id: int, piece: dict[str, Any]) -> None:
        """Checkpoint ``checkpoint_id`` (-1: a pipeline without checkpoints, its batch
        committed) completed with ``piece`` as its barrier batch's: commit
        where each partition stands after it to ``kafka.group.id`` (in the background; a
        later commit replaces one not yet made). Nothing without a group id."""
        if not self.group_id:
            return
        if self._committer is None:
            self._committer = _GroupCommitter(self.name, self._client_config(self.group_id))
        self._committer.submit(checkpoint_id,
                               {(t, p): e for t, p, _s, e in piece["ranges"]})

    def stop(self) -> None:
        committer, self._committer = self._committer, None
        if committer is not None:
            committer.close()
        self._admin = None
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                consumer.close()
            except Exception as exc:  # noqa: BLE001 - closing a client of a dead broker
                log.debug("Kafka source %s: closing its client: %s", self.name, exc)

    # -- planning (the pipeline loop's thread) ----------------------------------------------
    def _client_config(self, group: str) -> dict[str, Any]:
        config = client_config(self.bootstrap, self.options)
        config.update({"group.id": group, "enable.auto.commit": False,
                       "enable.partition.eof": False, "auto.offset.reset": "error"})
        return config

    def _metadata_consumer(self) -> Any:
        if self._consumer is None:
            kafka = load_kafka()
            try:
                self._consumer = kafka.Consumer({**self._client_config(
                    f"spark-ckpt-{self.name}-planner-{uuid.uuid4().hex[:8]}"),
                    "logger": _LIBRDKAFKA})
            except kafka.KafkaException as exc:
                raise SourceError(
                    f"kafka source {self.name}: the Kafka client refused its options: "
                    f"{error_text(exc)} (nothing was allocated)") from None
        return self._consumer

    def _timeout(self) -> float:
        return float(self.options.get("kafka.default.api.timeout.ms", 60_000)) / 1000.0

    def _partitions(self) -> dict[str, list[int]]:
        """Topic -> partitions, as the brokers have them now (an unknown topic: SourceError)."""
        kafka = load_kafka()
        consumer = self._metadata_consumer()
        try:
            meta = consumer.list_topics(timeout=min(self._timeout(), 30.0))
        except kafka.KafkaException as exc:
            raise SourceError(
                f"kafka source {self.name}: expected the brokers at {self.bootstrap} to answer, "
                f"found {error_text(exc)}; check bootstrap_servers and the kafka.* security "
                "options (nothing was allocated)") from None
        out: dict[str, list[int]] = {}
        if self.topics is not None:
            for topic in self.topics:
                tm = meta.topics.get(topic)
                if tm is None or tm.error is not None or not tm.partitions:
                    raise SourceError(
                        f"kafka source {self.name}: expected topic {topic!r} at "
                        f"{self.bootstrap}, found "
                        f"{'no such topic' if tm is None or not tm.partitions else tm.error}"
                        f"; create it or correct topics= (nothing was allocated)")
                out[topic] = sorted(tm.partitions)
        else:
            assert self._regex is not None
            for topic, tm in meta.topics.items():
                if topic.startswith("__") or not self._regex.fullmatch(topic) or \
                        tm.error is not None:
                    continue
                out[topic] = sorted(tm.partitions)
        return out

    def _topic_ids(self, topics: list[str]) -> dict[str, str]:
        if not topics:
            return {}
        kafka = load_kafka()
        if self._admin is None:
            self._admin = kafka.admin.AdminClient({**client_config(self.bootstrap, self.options),
                                                   "logger": _LIBRDKAFKA})
        futures = self._admin.describe_topics(kafka.TopicCollection(topics),
                                        request_timeout=min(self._timeout(), 30.0))
        try:
            return {t: str(f.result().topic_id) for t, f in futures.items()}
        except kafka.KafkaException as exc:
            raise SourceError(
                f"kafka source {self.name}: expected a description of topics {topics} from "
                f"{self.bootstrap}, found {error_text(exc)} (nothing was allocated)") from None

    def _watermarks(self, tps: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int]]:
        kafka = load_kafka()
        consumer = self._metadata_consumer()
        out = {}
        for topic, partition in tps:
            try:
                low, high = consumer.get_watermark_offsets(
                    kafka.TopicPartition(topic, partition), timeout=min(self._timeout(), 30.0),
                    cached=False)
            except kafka.KafkaException as exc:
                raise SourceError(
                    f"kafka source {self.name}: expected the offsets of {topic}-{partition} "
                    f"from {self.bootstrap}, found {error_text(exc)} (nothing was "
                    "allocated)") from None
            out[(topic, partition)] = (int(low), int(high))
        return out

    def _start_offsets(self, new: list[tuple[str, int]],
                       marks: dict[tuple[str, int], tuple[int, int]]) -> dict[tuple[str, int],
                                                                              int]:
        """Where partitions the source has not read yet start."""
        if self._started:  # found after the start: from their earliest offset, as Spark does
            return {tp: marks[tp][0] for tp in new}
        start = self.starting
        if start == "earliest":
            return {tp: marks[tp][0] for tp in new}
        if start == "latest":
            return {tp: marks[tp][1] for tp in new}
        if isinstance(start, int) and not isinstance(start, bool):
            kafka = load_kafka()
            consumer = self._metadata_consumer()
            found = consumer.offsets_for_times(
                [kafka.TopicPartition(t, p, start) for t, p in new],
                timeout=min(self._timeout(), 30.0))
            return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0
                                                else marks[(tp.topic, tp.partition)][1])
                    for tp in found}
        assert isinstance(start, dict)
        out = {}
        for topic, partition in new:
            given = {int(k): int(v) for k, v in start.get(topic, {}).items()}
            offset = given.get(partition, -1)
            low, high = marks[(topic, partition)]
            out[(topic, partition)] = low if offset == -2 else high if offset == -1 else offset
        return out

    def plan(self) -> dict[str, Any]:
        partitions = self._partitions()
        tps = [(t, p) for t in sorted(partitions) for p in partitions[t]]
        ids = self._topic_ids(sorted(partitions))
        marks = self._watermarks(tps)
        with self._lock:
            positions = dict(self.positions)
            known_ids = dict(self.topic_ids)
        skipped = 0
        reset = False
        for topic, topic_id in ids.items():  # deleted and created again
            before = known_ids.get(topic)
            if before is not None and before != topic_id:
                message = (f"kafka source {self.name}: topic {topic!r} was deleted and created "
                           f"again (its id was {before}, it is {topic_id} now), so the offsets "
                           f"recorded for it ({self._ranges_text(positions, topic)}) are not "
                           "this topic's")
                if self.fail_on_data_loss:
                    raise SourceError(message + "; restart with a new checkpoint directory, "
                                      "or set fail_on_data_loss=False to read the new topic "
                                      "from its earliest offset (nothing was allocated)")
                log.warning("%s: reading the new topic from its earliest offsets "
                            "(fail_on_data_loss=False)", message)
                positions = {tp: o for tp, o in positions.items() if tp[0] != topic}
                for tp in [tp for tp in tps if tp[0] == topic]:
                    positions[tp] = marks[tp][0]
                reset = True
        new = [tp for tp in tps if tp not in positions]
        if new:
            positions.update(self._start_offsets(new, marks))
        starts: dict[tuple[str, int], int] = {}
        for tp in tps:
            position = positions[tp]
            low, high = marks[tp]
            if position < low or position > high:
                gone = (f"kafka source {self.name}: expected offset {position} of "
                        f"{tp[0]}-{tp[1]} (where the source stands) to be available, found "
                        f"offsets {low}..{high - 1 if high > low else low} available ("
                        + ("the offsets before them were deleted, by retention or by a "
                           "records deletion" if position < low else
                           "fewer than were read: the partition was truncated or the topic "
                           "recreated") + ")")
                if self.fail_on_data_loss:
                    raise SourceError(gone + "; set fail_on_data_loss=False to skip them and "
                                      "go on from the earliest available offset (nothing was "
                                      "allocated)")
                log.warning("%s: skipping to offset %d (fail_on_data_loss=False)", gone, low)
                if position < low:
                    skipped += low - position
                position = low
            starts[tp] = position
        ends = self._limit(starts, {tp: marks[tp][1] for tp in tps})
        ranges: list[list[Any]] = [[t, p, starts[(t, p)], ends[(t, p)]] for t, p in tps]
        # partitions the brokers no longer list (a topic deleted, one no longer matching the
        # pattern) keep their position in the record, reading nothing
        for (t, p), o in sorted(positions.items()):
            if (t, p) not in starts and t not in ids:
                ranges.append([t, p, o, o])
        piece: dict[str, Any] = {
            "ranges": ranges, "topic_ids": {**{t: i for t, i in known_ids.items()
                                              if t not in ids}, **ids},
            "offsets": sum(int(r[3]) - int(r[2]) for r in ranges)}
        if not self._started:
            piece["initial"] = True
        if skipped:
            piece["skipped"] = skipped
        if reset:
            piece["reset"] = True
        return piece

    @staticmethod
    def _ranges_text(positions: dict[tuple[str, int], int], topic: str) -> str:
        return ", ".join(f"partition {p} at {o}" for (t, p), o in sorted(positions.items())
                         if t == topic) or "none"

    def _limit(self, starts: dict[tuple[str, int], int],
               highs: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Each partition's end: its latest offset, or (``max_offsets_per_batch``) at least one
        offset for every partition with a backlog while the limit allows, and the rest of the
        limit shared in proportion to the backlogs (so a small partition is never starved by a
        large one)."""
        lag = {tp: max(0, highs[tp] - starts[tp]) for tp in starts}
        total = sum(lag.values())
        if self.max_offsets is None or total <= self.max_offsets:
            return {tp: starts[tp] + lag[tp] for tp in starts}
        limit = self.max_offsets
        backlogged = sorted((tp for tp in starts if lag[tp] > 0), key=lambda tp: (-lag[tp], tp))
        share = {tp: 0 for tp in starts}
        for tp in backlogged[:limit]:
            share[tp] = 1
        left = limit - sum(share.values())
        rest = {tp: lag[tp] - share[tp] for tp in starts}
        rest_total = sum(rest.values())
        if left > 0 and rest_total > 0:
            extra = {tp: (rest[tp] * left) // rest_total for tp in starts}
            for tp in starts:
                share[tp] += extra[tp]
            left -= sum(extra.values())
            for tp in sorted(starts, key=lambda tp: (-((rest[tp] * left) % rest_total), tp)):
                if left <= 0:
                    break
                if share[tp] < lag[tp]:
                    share[tp] += 1
                    left -= 1
        return {tp: starts[tp] + min(share[tp], lag[tp]) for tp in starts}

    # -- reading ----------------------------------------------------------------------------
    def _uses_connector(self, spark: SparkSession) -> bool:
        if self.reader == "python":
            return False
        if self._connector is None:
            self._connector = _has_connector(spark)
            log.info("Kafka source %s reads %s", self.name,
                     "through Spark's Kafka connector" if self._connector else
                     "with a Kafka client in Python tasks (Spark's Kafka connector is not on "
                     "this session's classpath)")
        if self.reader == "spark" and not self._connector:
            raise EnvironmentError_(
                f"kafka source {self.name}: reader='spark' expects Spark's Kafka connector "
                "(spark-sql-kafka-0-10) on the session's classpath, found "
                "none; add it with --packages, or use reader='auto' or 'python'")
        return self._connector

    def read(self, run: SourceRun, piece: dict[str, Any]) -> DataFrame:
        ranges = [(t, p, s, e) for t, p, s, e in piece["ranges"] if e > s]
        if not ranges:
            return self.empty(run.spark)
        if self._uses_connector(run.spark):
            return self._read_connector(run.spark, ranges)
        return self._read_python(run.spark, ranges)

    def _read_connector(self, spark: SparkSession, ranges: list[tuple[str, int, int, int]]
                        ) -> DataFrame:
        import json

        assign: dict[str, list[int]] = {}
        starting: dict[str, dict[str, int]] = {}
        ending: dict[str, dict[str, int]] = {}
        for topic, partition, start, end in ranges:
            assign.setdefault(topic, []).append(partition)
            starting.setdefault(topic, {})[str(partition)] = start
            ending.setdefault(topic, {})[str(partition)] = end
        # what Spark's source refuses as options (it sets them itself)
        refused = ("kafka.auto.offset.reset", "kafka.enable.auto.commit",
                   "kafka.interceptor.classes", "kafka.key.deserializer",
                   "kafka.value.deserializer")
        options = {k: v for k, v in self.options.items() if k not in refused}
        reader = (spark.read.format("kafka").options(**options)
                  .option("kafka.bootstrap.servers", self.bootstrap)
                  .option("assign", json.dumps(assign))
                  .option("startingOffsets", json.dumps(starting))
                  .option("endingOffsets", json.dumps(ending))
                  .option("includeHeaders", "true")
                  .option("failOnDataLoss", str(self.fail_on_data_loss).lower()))
        if self.min_partitions:
            reader = reader.option("minPartitions", str(self.min_partitions))
        if self.value_format is not None:
            return self.value_format.from_connector(reader.load())
        return reader.load()

    def _read_python(self, spark: SparkSession, ranges: list[tuple[str, int, int, int]]
                     ) -> DataFrame:

        tasks = (_pack(ranges) if not self.min_partitions
                 else [[r] for r in _split(ranges, self.min_partitions)])
        config = {**_READER_FETCH, **self._client_config(f"spark-ckpt-{self.name}-reader")}
        form = self.value_format
        spec = {"config": config, "fail_on_data_loss": self.fail_on_data_loss,
                "source": self.name, "bootstrap": self.bootstrap, "tasks": tasks,
                "format": form.reader_spec() if form is not None else None}
        # one task id in each partition (a range's partitions split evenly), no shuffle
        spread = spark.range(0, len(tasks), 1, len(tasks))
        if form is not None:
            return form.from_tasks(spread.mapInArrow(ReadRanges(spec), form.task_schema()))
        return spread.mapInArrow(ReadRanges(spec), self.schema())


class _GroupCommitter:
    """Commits consumed offsets to a consumer group on a thread of its own (a commit to a
    slow broker never holds the pipeline up); the newest request wins."""

    def __init__(self, source: str, config: dict[str, Any]) -> None:
        self.source = source
        self.config = config
        self._cond = threading.Condition()
        self._next: tuple[int, dict[tuple[str, int], int]] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"spark-ckpt-kafka-{source}",
                                        daemon=True)
        self._thread.start()

    def submit(self, checkpoint_id: int, offsets: dict[tuple[str, int], int]) -> None:
        with self._cond:
            self._next = (checkpoint_id, offsets)
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Make the last commit asked for, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        kafka = load_kafka()
        consumer = None
        try:
            while True:
                with self._cond:
                    while self._next is None and not self._closed:
                        self._cond.wait()
                    work, self._next = self._next, None
                    if work is None:
                        return
                checkpoint_id, offsets = work
                try:
                    if consumer is None:
                        consumer = kafka.Consumer(self.config)
                    consumer.commit(offsets=[kafka.TopicPartition(t, p, o)
                                             for (t, p), o in sorted(offsets.items())],
                                    asynchronous=False)
                    log.info("Kafka source %s: committed the offsets of %s to its consumer "
                             "group", self.source, f"checkpoint {checkpoint_id}"
                             if checkpoint_id >= 0 else "the last committed batch")
                except Exception as exc:  # noqa: BLE001 - informational: the next one retries
                    log.warning("Kafka source %s: committing checkpoint %d's offsets to its "
                                "consumer group failed (the next checkpoint's commit covers "
                                "them): %s", self.source, checkpoint_id, error_text(exc))
        finally:
            if consumer is not None:
                consumer.close()


def _pack(ranges: list[tuple[str, int, int, int]]) -> list[list[tuple[str, int, int, int]]]:
    """The reading tasks of a batch without ``min_partitions``: one per range where ranges
    are long (as Spark's connector reads), fewer where the batch is short (a task per
    ``_OFFSETS_PER_TASK`` offsets, at least two), the ranges packed largest first into the
    task with the fewest offsets."""
    total = sum(e - s for _t, _p, s, e in ranges)
    n = min(len(ranges), max(2, -(-total // _OFFSETS_PER_TASK)))
    tasks: list[list[tuple[str, int, int, int]]] = [[] for _ in range(n)]
    sizes = [0] * n
    for r in sorted(ranges, key=lambda r: (r[2] - r[3], r[0], r[1])):
        i = sizes.index(min(sizes))
        tasks[i].append(r)
        sizes[i] += r[3] - r[2]
    return tasks


def _split(ranges: list[tuple[str, int, int, int]], tasks: int
           ) -> list[tuple[str, int, int, int]]:
    """``ranges`` cut into at least ``tasks`` pieces where they are long enough, largest
    first (as Spark's ``minPartitions`` splits offset ranges)."""
    out = list(ranges)
    while len(out) < tasks:
        i = max(range(len(out)), key=lambda k: out[k][3] - out[k][2])
        t, p, s, e = out[i]
        if e - s < 2:
            break
        mid = s + (e - s) // 2
        out[i:i + 1] = [(t, p, s, mid), (t, p, mid, e)]
    return out


def _has_connector(spark: SparkSession) -> bool:
    """True when Spark's Kafka data source resolves in this session (classic or Connect)."""
    from spark_ckpt.sparkapi import spark_api

    # Spark's own lookup (classic), and the Kafka client its connector needs beside it
    found = spark_api(spark).data_source_available("kafka")
    if found is not None:
        return found
    try:
        schema = (spark.read.format("kafka").option("kafka.bootstrap.servers", "127.0.0.1:9")
                  .option("assign", '{"t":[0]}').option("startingOffsets", '{"t":{"0":0}}')
                  .option("endingOffsets", '{"t":{"0":0}}').load().schema)
        return "value" in schema.fieldNames()
    except Exception as exc:  # noqa: BLE001 - any refusal: not available here
        log.debug("Spark's Kafka connector is not available: %s", error_text(exc))
        return False
