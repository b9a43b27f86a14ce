"""A Kafka topic as a two-phase-commit sink: a checkpoint's output becomes visible to
``read_committed`` consumers when the checkpoint completes, and never twice.

Design (docs/kafka.md, "The sink"): a staged commit, not Flink's open transactions.

* **Stage** (every batch, in the batch's Spark job): the rows to send (topic, key, value,
  headers) are written as Parquet under the checkpoint directory, split into ``slices`` by the
  record key's hash (Kafka's own murmur2 partitioner then sends a key to one partition, and a
  key is in one slice, so its records keep their order).
* **Pre-commit** (at the barrier): the staged files of the batches since the last barrier are
  the checkpoint's transaction (kept in the checkpoint's metadata).
* **Commit** (when the checkpoint completes, and again for whatever a restart finds pending):
  one Spark task per slice reads the slice's files in batch order and sends them in one Kafka
  transaction, from a producer whose ``transactional.id`` is the slice's
  (``spark-ckpt-<lineage>-<sink>-<slice>``). In the same transaction it commits a *marker*:
  offset ``<checkpoint id>`` of the marker topic's partition 0 for a consumer group of the same
  name (``send_offsets_to_transaction``), with the last batch in its metadata. Before sending,
  ``init_transactions`` fences every earlier producer of that id and ends its open
  transaction; the marker then says whether this checkpoint's slice is already in Kafka, and
  if so nothing is sent again.

So a transaction is open only while a slice is sent (seconds), not from one checkpoint to the
next as in Flink's KafkaSink: the broker's ``transaction.max.timeout.ms`` only has to exceed
one slice's sending (``transaction.timeout.ms`` is 10 minutes here), however long the
checkpoint interval or a driver's downtime. The price: every record is written twice (staged,
then sent), and a checkpoint's records reach readers when it completes, as with every
two-phase sink here.

``delivery="at_least_once"`` sends each batch's rows from its own Spark job, without
transactions; a batch run again after a crash sends its rows again.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import CommitError, JobDefinitionError
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.faults import fault_point
from spark_ckpt.formats import dump_record
from spark_ckpt.kafka_client import client_config, committed, error_text
from spark_ckpt.kafka_client import load as load_kafka
from spark_ckpt.sinks.files import micros_timestamps
from spark_ckpt.sinks.per_batch import PipelineScope, staged_files
from spark_ckpt.sinks.two_phase import TwoPhaseCommitSink
from spark_ckpt.storage import Storage, join, s3

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["KafkaSink"]

log = logging.getLogger(__name__)

SLICE = "spark_ckpt_slice"
_DELIVERIES = ("exactly_once", "at_least_once")
_TRANSACTION_TIMEOUT_MS = "600000"


def _client_config(bootstrap: str, options: dict[str, str]) -> dict[str, Any]:
    config = client_config(bootstrap, options)
    # Java's default partitioner (murmur2 of the key), so Java and Python producers agree
    config.setdefault("partitioner", "murmur2_random")
    return config


class KafkaSink(TwoPhaseCommitSink):
    """Records to Kafka (see the module's docstring).

    ``topic``: every record's topic; or ``topic_column``, a column naming each record's (then
    ``marker_topic`` names the topic whose partition 0 holds the sink's commit markers).
    ``key``, ``value``: columns (names or Columns), strings or binary; ``headers``: a column
    of ``array<struct<key: string, value: binary>>`` (Spark's Kafka schema). ``options``:
    ``kafka.*`` producer options, as Spark's Kafka sink takes them (``kafka.acks`` is
    ``all``). ``slices``: how many transactions (Spark tasks) send a checkpoint's records.
    """

    kind = "kafka"

    def __init__(self, name: str, bootstrap_servers: str, ctx: PipelineScope, *,
                 topic: str | None = None, topic_column: str | None = None,
                 key: str | Column | None = "key", value: str | Column = "value",
                 headers: str | Column | None = None, delivery: str = "exactly_once",
                 slices: int = 2, marker_topic: str | None = None,
                 options: dict[str, str] | None = None) -> None:
        super().__init__(name)
        if (topic is None) == (topic_column is None):
            raise JobDefinitionError(
                f"kafka sink {name}: expected exactly one of topic=... and topic_column=..., "
                f"found topic={topic!r}, topic_column={topic_column!r}")
        if delivery not in _DELIVERIES:
            raise JobDefinitionError(
                f"kafka sink {name}: expected delivery 'exactly_once' or 'at_least_once', "
                f"found {delivery!r}")
        if topic_column is not None and marker_topic is None and delivery == "exactly_once":
            raise JobDefinitionError(
                f"kafka sink {name}: with topic_column, exactly-once delivery needs "
                "marker_topic=<a topic whose partition 0 holds the sink's commit markers>")
        if slices < 1:
            raise JobDefinitionError(f"kafka sink {name}: expected slices >= 1, found {slices}")
        bad = [k for k in (options or {}) if not k.startswith("kafka.")]
        if bad:
            raise JobDefinitionError(
                f"kafka sink {name}: expected options named kafka.<producer option>, found "
                f"{sorted(bad)}")
        self.bootstrap = bootstrap_servers
        self.topic = topic
        self.topic_column = topic_column
        self.key = key
        self.value = value
        self.headers = headers
        self.delivery = delivery
        self.slices = slices
        self.marker_topic = marker_topic or topic
        self.options = {"kafka.acks": "all", **(options or {})}
        self.ctx = ctx
        self.store = Storage(join(ctx.root, "sinks", name))
        self._spark: SparkSession | None = getattr(ctx, "spark", None)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "bootstrap": self.bootstrap, "topic": self.topic,
                "topic_column": self.topic_column, "delivery": self.delivery,
                "slices": self.slices, "marker_topic": self.marker_topic}

    # -- the rows sent ------------------------------------------------------------------------
    def _column(self, spec: str | Column | None, df: DataFrame, what: str) -> Column | None:
        from pyspark.sql import Column
        from pyspark.sql import functions as F

        if spec is None:
            return None
        if isinstance(spec, Column):
            return spec
        if spec not in df.columns:
            if what == "key" and spec == "key":
                return None  # the default key column is optional: no key then
            raise JobDefinitionError(
                f"kafka sink {self.name}: expected a {what} column {spec!r}, found columns "
                f"{df.columns}")
        return F.col(spec)

    def records(self, df: DataFrame) -> DataFrame:
        """``df`` as the records to send: topic, key and value as binary, headers, and the
        record's slice (by the key's hash; no key: by the value's)."""
        from pyspark.sql import functions as F

        key = self._column(self.key, df, "key")
        value = self._column(self.value, df, "value")
        headers = self._column(self.headers, df, "headers")
        if value is None:  # pragma: no cover - value is never None
            raise JobDefinitionError(f"kafka sink {self.name}: expected a value column")
        key_bin = key.cast("binary") if key is not None else F.lit(None).cast("binary")
        value_bin = value.cast("binary")
        topic = F.col(self.topic_column) if self.topic_column else F.lit(self.topic)
        hdr = headers if headers is not None else F.lit(None).cast(
            "array<struct<key:string,value:binary>>")
        return df.select(
            topic.cast("string").alias("topic"), key_bin.alias("key"),
            value_bin.alias("value"), hdr.alias("headers"),
            F.pmod(F.xxhash64(F.coalesce(key_bin, value_bin)), F.lit(self.slices))
            .cast("int").alias(SLICE))

    def prepare(self, df: DataFrame) -> None:
        self._spark = df.sparkSession
        self.records(df)  # analysis refuses missing columns before any batch runs

    # -- staging ------------------------------------------------------------------------------
    def _staging_dir(self, batch_id: int) -> str:
        return join(self.store.root, "_spark_ckpt_staging", self.lineage,
                    f"{self.name}-b{batch_id:012d}-{uuid.uuid4().hex[:12]}")

    def write(self, df: DataFrame, batch_id: int) -> dict[str, Any] | None:
        from spark_ckpt.sparkapi import frame_api

        self._spark = df.sparkSession
        if frame_api(df).provably_empty(df):
            return None
        out = self.records(df)
        if self.delivery == "at_least_once":
            sent = out.mapInArrow(_Send(self._send_spec(None, None)), "sent BIGINT")
            sent.groupBy().sum("sent").collect()
            return None
        directory = self._staging_dir(batch_id)
        with micros_timestamps(df.sparkSession):
            out.write.mode("overwrite").partitionBy(SLICE).parquet(
                self.store.spark_path(directory))
        files = staged_files(self.store, directory, self.name)
        if not files:
            self.store.delete_dir(directory)
            return None
        return {"batch": batch_id, "dir": directory, "files": [f.to_json() for f in files]}

    def abort(self, pieces: list[dict[str, Any]]) -> None:
        for piece in pieces:
            self.store.delete_dir(self.store.fs_path(piece["dir"]))

    def cleanup_staging(self) -> None:
        staging = join(self.store.root, "_spark_ckpt_staging", self.lineage)
        if not self.store.exists(staging):
            return
        for info in self.store.list_files(staging, recursive=False):
            if info.base_name.startswith(f"{self.name}-b") and \
                    (self.claimed_at is None or info.mtime is None or
                     info.mtime < self.claimed_at):
                self.store.delete_dir(info.path)

    # -- committing ---------------------------------------------------------------------------
    def transactional_id(self, slice_: int) -> str:
        return f"spark-ckpt-{self.lineage}-{self.name}-{slice_}"

    def _send_spec(self, checkpoint_id: int | None, last_batch: int | None,
                   txn: dict[str, Any] | None = None) -> dict[str, Any]:
        config = _client_config(self.bootstrap, self.options)
        ids = (txn or {}).get("ids") or {str(i): self.transactional_id(i)
                                          for i in range(self.slices)}
        return {"config": config, "sink": self.name, "checkpoint": checkpoint_id,
                "last_batch": last_batch,
                "marker_topic": (txn or {}).get("marker_topic") or self.marker_topic,
                "ids": {str(k): v for k, v in ids.items()},
                # a URI (a bare pyarrow path is a local one to the task), and the driver's S3
                # settings (spark.hadoop.fs.s3a.*), which a Python worker cannot read
                "root": self.store.spark_path(self.store.root), "bootstrap": self.bootstrap,
                "s3": s3conf.to_json() if (s3conf := s3.current()) is not None else None}

    def pre_commit(self, checkpoint_id: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
        """The transaction: the pieces, and the slices' transactional ids and marker topic as
        they are now (a restart with another ``slices`` still sends this one as staged)."""
        return {"pieces": pieces, "ids": {str(i): self.transactional_id(i)
                                          for i in range(self.slices)},
                "marker_topic": self.marker_topic}

    def _commit_record(self, checkpoint_id: int) -> str:
        return join(self.store.root, "_spark_ckpt_commits",
                    f"{self.lineage}-c{checkpoint_id:08d}.json")

    def commit(self, checkpoint_id: int, txn: dict[str, Any]) -> None:
        record = self._commit_record(checkpoint_id)
        pieces = sorted(txn.get("pieces", []), key=lambda p: int(p["batch"]))
        if self.store.exists(record):  # every slice was sent: whatever the markers say now
            for piece in pieces:
                self.store.delete_dir(self.store.fs_path(piece["dir"]))
            return
        by_slice: dict[int, list[str]] = {}
        for piece in pieces:
            for f in sorted(piece["files"], key=lambda f: f["path"]):
                out = OutputFile.from_json(f)
                slice_ = int(out.partition_values.get(SLICE) or 0)
                by_slice.setdefault(slice_, []).append(self.store.fs_path(out.path))
        if not by_slice:
            return
        spark = self._spark
        if spark is None:
            raise CommitError(f"kafka sink {self.name}: expected a Spark session to send "
                              f"checkpoint {checkpoint_id}'s records, found none")
        last = max(int(p["batch"]) for p in pieces)
        from pyspark.sql import functions as F

        rows = spark.createDataFrame(
            [(s, json.dumps(paths)) for s, paths in sorted(by_slice.items())],
            "slice INT, files STRING")
        tasks = rows.repartitionById(len(by_slice), F.col("slice") % len(by_slice))
        try:
            sent = tasks.mapInArrow(_CommitSlices(self._send_spec(checkpoint_id, last, txn)),
                                    "slice INT, sent BIGINT, skipped BOOLEAN").collect()
        except Exception as exc:  # noqa: BLE001 - a failed Spark job, named and re-raised
            raise CommitError(
                f"kafka sink {self.name}: sending checkpoint {checkpoint_id}'s records "
                f"({len(by_slice)} slice(s)) failed; the transaction stays pending and is sent "
                f"by the next commit, nothing twice: {_task_failure(exc)}") from None
        log.info("Kafka sink %s: checkpoint %d committed (%s)", self.name, checkpoint_id,
                 ", ".join(f"slice {r['slice']}: " +
                           ("already in Kafka" if r["skipped"] else f"{r['sent']} records")
                           for r in sorted(sent, key=lambda r: r["slice"])))
        # Every slice is in Kafka. The markers say so only while Kafka keeps the groups'
        # offsets (offsets.retention.minutes, 7 days by default, for groups without
        # members): a record in the checkpoint directory says it for good, before the staged
        # files (which a commit sent again would read) are deleted.
        self.store.write_atomic(record, dump_record("kafka-sink-commit", 1, {
            "lineage": self.lineage, "checkpoint_id": checkpoint_id, "last_batch": last,
            "slices": sorted(by_slice)}))
        for piece in pieces:  # in Kafka: the staged files are not read again
            self.store.delete_dir(self.store.fs_path(piece["dir"]))

    def _markers(self) -> dict[int, dict[str, Any]]:
        """Each slice's last marker: {"checkpoint": id, "last_batch": b}."""
        kafka = load_kafka()
        out = {}
        config = _client_config(self.bootstrap, self.options)
        for slice_ in range(self.slices):
            consumer = kafka.Consumer({**config, "group.id": self.transactional_id(slice_),
                                       "enable.auto.commit": False})
            try:
                found = committed(consumer, [kafka.TopicPartition(self.marker_topic, 0)])[0]
            except kafka.KafkaException as exc:
                raise CommitError(
                    f"kafka sink {self.name}: expected the commit markers of slice {slice_} "
                    f"(group {self.transactional_id(slice_)}, topic {self.marker_topic} "
                    f"partition 0) from {self.bootstrap}, found {error_text(exc)}") from None
            finally:
                consumer.close()
            if found.offset >= 0:
                meta = json.loads(found.metadata or "{}")
                out[slice_] = {"checkpoint": found.offset,
                               "last_batch": int(meta.get("last_batch", -1))}
        return out

    def committed_checkpoint(self) -> int | None:
        if self.delivery != "exactly_once" or not self.lineage:
            return None
        markers = self._markers()
        return max((m["checkpoint"] for m in markers.values()), default=None)

    def committed_batch(self) -> int | None:
        if self.delivery != "exactly_once" or not self.lineage:
            return None
        markers = self._markers()
        return max((m["last_batch"] for m in markers.values()), default=None)


class _Send:
    """At-least-once: each task sends its rows, flushes, and yields how many it sent."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        kafka = load_kafka()
        producer = kafka.Producer({**self.spec["config"], "enable.idempotence": True})
        sent = 0
        errors: list[str] = []
        for batch in batches:
            sent += _produce(producer, batch, self.spec["sink"], errors)
        _flush(producer, self.spec["sink"], errors)
        yield pa.RecordBatch.from_arrays([pa.array([sent], pa.int64())], names=["sent"])


class _CommitSlices:
    """Exactly-once: each input row names a slice and its staged files; the slice is sent in
    one transaction with its marker, unless its marker says it already was."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        out_slices, out_sent, out_skipped = [], [], []
        for batch in batches:
            for row in batch.to_pylist():
                sent, skipped = self._slice(int(row["slice"]), json.loads(row["files"]))
                out_slices.append(int(row["slice"]))
                out_sent.append(sent)
                out_skipped.append(skipped)
        yield pa.RecordBatch.from_arrays(
            [pa.array(out_slices, pa.int32()), pa.array(out_sent, pa.int64()),
             pa.array(out_skipped, pa.bool_())], names=["slice", "sent", "skipped"])

    def _slice(self, slice_: int, files: list[str]) -> tuple[int, bool]:
        import pyarrow.parquet as pq

        kafka = load_kafka()
        spec = self.spec
        tid = spec["ids"].get(str(slice_))
        if tid is None:
            raise CommitError(
                f"kafka sink {spec['sink']}: checkpoint {spec['checkpoint']}'s records of slice "
                f"{slice_} have no transactional id in its transaction (ids for slices "
                f"{sorted(spec['ids'])}); refusing to send them under another slice's id")
        checkpoint = int(spec["checkpoint"])
        marker = kafka.TopicPartition(spec["marker_topic"], 0)
        producer = kafka.Producer({**spec["config"], "transactional.id": tid,
                                   "transaction.timeout.ms": spec["config"].get(
                                       "transaction.timeout.ms", _TRANSACTION_TIMEOUT_MS)})
        # fences every earlier producer of this slice and ends its open transaction
        producer.init_transactions(60)
        consumer = kafka.Consumer({**spec["config"], "group.id": tid,
                                   "enable.auto.commit": False,
                                   "isolation.level": "read_committed"})
        try:
            done = committed(consumer, [marker])[0].offset
            if done >= checkpoint:
                return 0, True
            s3.install(spec.get("s3"))
            store = Storage(spec["root"])
            producer.begin_transaction()
            sent = 0
            errors: list[str] = []
            for path in files:
                table = pq.read_table(store.fs_path(path), filesystem=store.fs)
                for batch in table.to_batches(max_chunksize=10_000):
                    sent += _produce(producer, batch, spec["sink"], errors)
            fault_point("sink.kafka.sent")  # (a worker dies: its transaction stays open)
            meta = json.dumps({"checkpoint": checkpoint, "last_batch": spec["last_batch"]})
            producer.send_offsets_to_transaction(
                [kafka.TopicPartition(spec["marker_topic"], 0, checkpoint, meta)],
                consumer.consumer_group_metadata(), 60)
            producer.commit_transaction(600)  # fails when a record was not delivered
            return sent, False
        except kafka.KafkaException as exc:
            try:
                producer.abort_transaction(60)
            except Exception:  # noqa: BLE001 - fenced or not begun: nothing to abort
                pass
            raise CommitError(
                f"kafka sink {spec['sink']}: sending checkpoint {checkpoint}'s slice {slice_} "
                f"to {spec['bootstrap']} failed: {exc}") from None
        finally:
            consumer.close()


def _task_failure(exc: BaseException) -> str:
    """What a failed Spark job of the sink's tasks says: the sink's own error, a crashed
    Python worker, or the error's first line."""
    text = str(exc)
    for mark in ("CommitError: ", "Python worker exited unexpectedly", "SourceError: "):
        at = text.find(mark)
        if at >= 0:
            return text[at:].splitlines()[0][:500]
    return error_text(exc)


def _produce(producer: Any, batch: Any, sink: str, errors: list[str]) -> int:
    """Send one Arrow batch of records (topic, key, value, headers), waiting for room in the
    producer's queue when it is full; failed deliveries are added to ``errors`` (as the
    producer learns of them)."""
    kafka = load_kafka()
    columns = batch.to_pydict()
    topics, keys, values = columns["topic"], columns["key"], columns["value"]
    headers = columns.get("headers") or [None] * len(topics)

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(str(err))

    for i in range(len(topics)):
        hdr = [(h["key"], h["value"]) for h in headers[i]] if headers[i] else None
        while True:
            try:
                producer.produce(topics[i], value=values[i], key=keys[i], headers=hdr,
                                 on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.1)
            except kafka.KafkaException as exc:
                raise CommitError(f"kafka sink {sink}: sending a record failed: {exc}") from None
        if i % 1000 == 0:
            producer.poll(0)
    return len(topics)


def _flush(producer: Any, sink: str, errors: list[str]) -> None:
    left = producer.flush(300)
    if left or errors:
        raise CommitError(f"kafka sink {sink}: {left + len(errors)} record(s) not delivered "
                          f"({errors[0] if errors else 'not within 300 s'})")
