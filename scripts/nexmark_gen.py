"""A deterministic Nexmark event generator, after the benchmark's generator (as Flink's
nexmark suite and Beam's ``NexmarkUtils`` run it), writing Parquet files or a Kafka topic.

The stream is numbered events; event ``n`` is, by ``n % 50``: a person (0), an auction (1–3)
or a bid (4–49): persons, auctions and bids in proportion 1 : 3 : 46. Event ``n`` happens at
``base + n * inter_event_delay`` (10,000 events a second by default). Sellers, bidders and the
auctions bid on are skewed to a few hot ones (one in ``hot_*_ratio`` draws picks any, the rest
the newest hot one), prices are ``round(10 ** U(0, 6) * 100)``, as the original. Each chunk of
``CHUNK`` events is drawn from its own seeded generator, so the same events come out whatever
the file size.

Rows are Flink's nexmark table: ``event_type`` (0 person, 1 auction, 2 bid), one ROW per
kind (the others null), and ``dateTime``:

    python scripts/nexmark_gen.py --events 10000000 --files 100 --out /data/nexmark

To Kafka (``produce``), the same events as JSON values of those columns, one record each:

    python scripts/nexmark_gen.py --events 10000000 --kafka HOST:9092 --topic nexmark \
        --partitions 8

Event ``n`` goes to partition ``n % partitions`` with key ``n`` (its number, which names it)
and Kafka timestamp its ``dateTime``: every partition holds the same stretch of event time,
so a batch that reads the same share of each reads the same times (a source's watermark is
over all its partitions' rows, docs/operators.md). Values are read back with
``value_format="json"`` and ``SPARK_SCHEMA`` (``nexmark_queries.kafka_input``); times are
ISO-8601 UTC strings with milliseconds (``2026-01-01T00:00:00.123Z``), which Spark's
``from_json`` parses exactly into a TIMESTAMP (a JSON number would be read as seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CHUNK = 100_000
BASE_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
PROPORTION = 50
PERSON, AUCTION = 1, 3  # offsets below 1: person; below 4: auction; others: bid
FIRST_PERSON_ID = 1000
FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID = 10
NUM_CATEGORIES = 5
HOT_AUCTION_RATIO = 100
HOT_BIDDER_RATIO = 100
HOT_SELLER_RATIO = 100
NUM_ACTIVE_PEOPLE = 1000
NUM_IN_FLIGHT_AUCTIONS = 100
US_STATES = np.array(["AZ", "CA", "ID", "OR", "WA", "WY"])
US_CITIES = np.array(["Phoenix", "Los Angeles", "San Francisco", "Boise", "Portland",
                      "Bend", "Redmond", "Seattle", "Kent", "Cheyenne"])
FIRST_NAMES = np.array(["Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie",
                        "Sarah", "Deiter", "Walter"])
LAST_NAMES = np.array(["Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith",
                       "Jones", "Noris"])
CHANNELS = np.array(["Google", "Facebook", "Baidu", "Apple"])

PERSON_TYPE = pa.struct([("id", pa.int64()), ("name", pa.string()),
                         ("emailAddress", pa.string()), ("creditCard", pa.string()),
                         ("city", pa.string()), ("state", pa.string()),
                         ("dateTime", pa.timestamp("ms", "UTC")), ("extra", pa.string())])
AUCTION_TYPE = pa.struct([("id", pa.int64()), ("itemName", pa.string()),
                          ("description", pa.string()), ("initialBid", pa.int64()),
                          ("reserve", pa.int64()), ("dateTime", pa.timestamp("ms", "UTC")),
                          ("expires", pa.timestamp("ms", "UTC")), ("seller", pa.int64()),
                          ("category", pa.int64()), ("extra", pa.string())])
BID_TYPE = pa.struct([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()),
                      ("channel", pa.string()), ("url", pa.string()),
                      ("dateTime", pa.timestamp("ms", "UTC")), ("extra", pa.string())])
SCHEMA = pa.schema([("event_type", pa.int32()), ("person", PERSON_TYPE),
                    ("auction", AUCTION_TYPE), ("bid", BID_TYPE),
                    ("dateTime", pa.timestamp("ms", "UTC"))])
#: the same as Spark DDL (file_stream's schema)
SPARK_SCHEMA = (
    "event_type INT, "
    "person STRUCT<id: BIGINT, name: STRING, emailAddress: STRING, creditCard: STRING, "
    "city: STRING, state: STRING, dateTime: TIMESTAMP, extra: STRING>, "
    "auction STRUCT<id: BIGINT, itemName: STRING, description: STRING, initialBid: BIGINT, "
    "reserve: BIGINT, dateTime: TIMESTAMP, expires: TIMESTAMP, seller: BIGINT, "
    "category: BIGINT, extra: STRING>, "
    "bid STRUCT<auction: BIGINT, bidder: BIGINT, price: BIGINT, channel: STRING, "
    "url: STRING, dateTime: TIMESTAMP, extra: STRING>, dateTime TIMESTAMP")


def _last_base0(n: np.ndarray, kind_offset: int, kind_count: int) -> np.ndarray:
    """How many events of a kind precede event ``n`` (the newest id of that kind, 0-based)."""
    epoch, offset = n // PROPORTION, n % PROPORTION
    before = np.clip(offset - kind_offset, 0, kind_count)
    return epoch * kind_count + before - 1


def _strings(prefix: str, values: np.ndarray) -> np.ndarray:
    return np.char.add(prefix, values.astype(str))


def chunk(index: int, *, seed: int = 42, events_per_second: int = 10_000) -> pa.Table:
    """Events ``index * CHUNK`` to ``(index + 1) * CHUNK - 1``."""
    rng = np.random.default_rng([seed, index])
    n = np.arange(index * CHUNK, (index + 1) * CHUNK, dtype=np.int64)
    offset = n % PROPORTION
    kind = np.where(offset < PERSON, 0, np.where(offset < PERSON + AUCTION, 1, 2))
    delay_us = 1_000_000 / events_per_second
    ts = BASE_MS + (n * delay_us / 1000).astype(np.int64)
    size = len(n)
    u = rng.random((8, size))
    ints = rng.integers(0, 1 << 30, (6, size))
    # persons
    person_id = FIRST_PERSON_ID + (n // PROPORTION) * PERSON + np.clip(offset, 0, PERSON - 1)
    name = np.char.add(np.char.add(FIRST_NAMES[ints[0] % len(FIRST_NAMES)], " "),
                       LAST_NAMES[ints[1] % len(LAST_NAMES)])
    email = np.char.add(_strings("p", ints[2] % 100_000), "@nexmark.example")
    card = _strings("4000 0000 0000 ", ints[3] % 10_000)
    city = US_CITIES[ints[4] % len(US_CITIES)]
    state = US_STATES[ints[5] % len(US_STATES)]
    # auctions: the newest person sells most, an active one the rest
    last_person = _last_base0(n, 0, PERSON)
    auction_id = FIRST_AUCTION_ID + (n // PROPORTION) * AUCTION + np.clip(offset - PERSON, 0,
                                                                         AUCTION - 1)
    hot_seller = (ints[0] % HOT_SELLER_RATIO) > 0
    seller_base = np.where(hot_seller, last_person // HOT_SELLER_RATIO * HOT_SELLER_RATIO,
                           last_person - ints[1] % np.clip(last_person + 1, 1,
                                                            NUM_ACTIVE_PEOPLE))
    seller = FIRST_PERSON_ID + np.maximum(seller_base, 0)
    category = FIRST_CATEGORY_ID + ints[2] % NUM_CATEGORIES
    initial = np.round(10 ** (u[0] * 6) * 100).astype(np.int64)
    reserve = initial + np.round(10 ** (u[1] * 6) * 100).astype(np.int64)
    expires = ts + 1000 * (10 + (u[2] * 600).astype(np.int64))
    # bids: a hot auction and a hot bidder, or any recent one
    last_auction = _last_base0(n, PERSON, AUCTION)
    hot_auction = (ints[3] % HOT_AUCTION_RATIO) > 0
    auction_base = np.where(hot_auction, last_auction // HOT_AUCTION_RATIO * HOT_AUCTION_RATIO,
                            last_auction - ints[4] % np.clip(last_auction + 1, 1,
                                                              NUM_IN_FLIGHT_AUCTIONS))
    bid_auction = FIRST_AUCTION_ID + np.maximum(auction_base, 0)
    hot_bidder = (ints[5] % HOT_BIDDER_RATIO) > 0
    bidder_base = np.where(hot_bidder, last_person // HOT_BIDDER_RATIO * HOT_BIDDER_RATIO + 1,
                           last_person - ints[0] % np.clip(last_person + 1, 1,
                                                            NUM_ACTIVE_PEOPLE))
    bidder = FIRST_PERSON_ID + np.maximum(bidder_base, 0)
    price = np.round(10 ** (u[3] * 6) * 100).astype(np.int64)
    channel_pick = (u[4] * 10_000).astype(np.int64)
    channel = np.where(channel_pick < 4, CHANNELS[channel_pick % 4],
                       _strings("channel-", channel_pick % 10_000))
    dirs = [_strings("d", (u[5 + i] * 100_000).astype(np.int64)) for i in range(3)]
    url = np.char.add(np.char.add(np.char.add(np.char.add(np.char.add(np.char.add(
        "https://www.nexmark.com/", dirs[0]), "/"), dirs[1]), "/"), dirs[2]),
        np.char.add("/item.htm?query=1&channel_id=", (channel_pick % 10_000).astype(str)))
    extra = np.full(size, "", dtype=object)
    when = pa.array(ts, pa.timestamp("ms", "UTC"))

    def only(kind_id: int, struct_type: pa.StructType, columns: list[pa.Array]) -> pa.Array:
        mask = pa.array(kind != kind_id)
        return pa.StructArray.from_arrays(columns, fields=list(struct_type), mask=mask)

    person = only(0, PERSON_TYPE, [pa.array(person_id), pa.array(name), pa.array(email),
                                   pa.array(card), pa.array(city), pa.array(state), when,
                                   pa.array(extra, pa.string())])
    auction = only(1, AUCTION_TYPE, [
        pa.array(auction_id), pa.array(_strings("item-", auction_id)),
        pa.array(_strings("description of item ", auction_id)), pa.array(initial),
        pa.array(reserve), when, pa.array(expires, pa.timestamp("ms", "UTC")),
        pa.array(seller), pa.array(category), pa.array(extra, pa.string())])
    bid = only(2, BID_TYPE, [pa.array(bid_auction), pa.array(bidder), pa.array(price),
                             pa.array(channel), pa.array(url), when,
                             pa.array(extra, pa.string())])
    return pa.Table.from_arrays([pa.array(kind, pa.int32()), person, auction, bid, when],
                                schema=SCHEMA)


def write(out: Path, events: int, files: int, *, seed: int = 42,
          events_per_second: int = 10_000) -> list[Path]:
    """``events`` events in ``files`` Parquet files, in event order: whole chunks of
    ``CHUNK`` events a file, so fewer files than asked when there are fewer chunks."""
    chunks = math.ceil(events / CHUNK)
    out.mkdir(parents=True, exist_ok=True)
    per_file = math.ceil(chunks / files)
    written = []
    for f in range(files):
        parts = [chunk(c, seed=seed, events_per_second=events_per_second)
                 for c in range(f * per_file, min((f + 1) * per_file, chunks))]
        if not parts:
            break
        table = pa.concat_tables(parts)
        table = table.slice(0, max(0, min(table.num_rows, events - f * per_file * CHUNK)))
        path = out / f"part-{f:05d}.parquet"
        pq.write_table(table, path)
        written.append(path)
    return written


def json_values(table: pa.Table) -> list[bytes]:
    """Each event of ``table`` (``SCHEMA``) as a JSON object of its columns, the other kinds'
    ROWs left out (``from_json`` reads a missing field as null), times as ISO-8601 UTC with
    milliseconds."""
    def strings(array: pa.Array) -> pa.Array:
        if pa.types.is_timestamp(array.type):  # (numpy's: Arrow's strftime is 10x slower)
            ms = array.cast(pa.int64()).fill_null(0).to_numpy().astype("datetime64[ms]")
            return pa.array(np.char.add(np.datetime_as_string(ms, unit="ms"), "Z"),
                            pa.string(), mask=array.is_null().to_numpy(zero_copy_only=False))
        if pa.types.is_struct(array.type):
            return pa.StructArray.from_arrays(
                [strings(array.field(i)) for i in range(array.type.num_fields)],
                fields=[pa.field(f.name, pa.string() if pa.types.is_timestamp(f.type)
                                 else f.type) for f in array.type],
                mask=array.is_null())
        return array

    table = table.combine_chunks()
    columns = {name: strings(table.column(name).chunk(0)) for name in table.column_names}
    rows = pa.Table.from_pydict(columns).to_pylist()
    return [json.dumps({k: v for k, v in row.items() if v is not None},
                       separators=(",", ":")).encode() for row in rows]


def held(bootstrap: str, topic: str, options: dict[str, str] | None = None
         ) -> tuple[int, int] | None:
    """How many partitions topic ``topic`` has and how many records it holds (None when
    there is no such topic)."""
    from spark_ckpt.kafka_client import client_config, load

    kafka = load()
    consumer = kafka.Consumer(client_config(bootstrap, options or {})
                              | {"group.id": "nexmark-gen"})
    try:
        meta = consumer.list_topics(topic=topic, timeout=30).topics[topic]
        if meta.error is not None and \
                meta.error.code() == kafka.KafkaError.UNKNOWN_TOPIC_OR_PART:
            return None
        if meta.error is not None:
            raise kafka.KafkaException(meta.error)
        return len(meta.partitions), sum(high - low for low, high in (
            consumer.get_watermark_offsets(kafka.TopicPartition(topic, p), timeout=30)
            for p in meta.partitions))
    finally:
        consumer.close()


def _topic(config: dict[str, Any], topic: str, partitions: int,
           existing: tuple[int, int] | None) -> None:
    """Create ``topic`` with ``partitions`` partitions and no time retention (the events'
    timestamps are from ``BASE_MS`` on: a broker's retention would delete them), or check
    that the ``existing`` one has that many partitions, no records and keeps them."""
    from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

    admin = AdminClient(config)
    if existing is None:
        admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                      config={"retention.ms": "-1"})])[topic].result(timeout=60)
        return
    if existing[0] != partitions:
        raise ValueError(f"topic {topic} has {existing[0]} partitions, not {partitions}")
    if existing[1]:
        raise ValueError(f"topic {topic} already holds {existing[1]} records: the events "
                         "would be there twice (delete it or name another)")
    entries = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)])
    found = next(iter(entries.values())).result(timeout=30)
    kept = {name: found[name].value for name in ("retention.ms", "retention.bytes",
                                                  "message.timestamp.type")}
    wanted = {"retention.ms": "-1", "retention.bytes": "-1",
              "message.timestamp.type": "CreateTime"}
    if kept != wanted:
        raise ValueError(f"topic {topic} has {kept}; the events' timestamps start at "
                         f"{BASE_MS} (2026-01-01) and must stay their events' times: expected "
                         f"{wanted} (a finite retention deletes them sooner or later, "
                         "LogAppendTime replaces their times)")


def produce(bootstrap: str, topic: str, events: int, partitions: int, *, seed: int = 42,
            events_per_second: int = 10_000, options: dict[str, str] | None = None,
            progress: Callable[[str], None] | None = None) -> int:
    """``events`` events to Kafka topic ``topic`` (created with ``partitions`` partitions, or
    an empty one of that many): event ``n`` as ``json_values`` gives it, key ``n``,
    partition ``n % partitions``, timestamp its ``dateTime``, through an idempotent producer
    (``options``: ``kafka.*`` client options, as the source takes them). Returns the number
    delivered once every record is acknowledged; raises on any delivery error.
    ``progress`` is told of each chunk of ``CHUNK`` events sent."""
    from spark_ckpt.kafka_client import client_config, load

    kafka = load()
    config = client_config(bootstrap, options or {})
    _topic(config, topic, partitions, held(bootstrap, topic, options))
    producer = kafka.Producer(config | {"enable.idempotence": True, "acks": "all",
                                        "linger.ms": 50, "compression.type": "lz4"})
    errors: list[str] = []
    delivered = 0

    def on_delivery(err: Any, _msg: Any) -> None:
        nonlocal delivered
        if err is not None:
            errors.append(str(err))
        else:
            delivered += 1

    started = time.monotonic()
    for c in range(math.ceil(events / CHUNK)):
        table = chunk(c, seed=seed, events_per_second=events_per_second)
        table = table.slice(0, min(CHUNK, events - c * CHUNK))
        stamps = table.column("dateTime").cast(pa.int64()).to_pylist()
        for i, value in enumerate(json_values(table)):
            n = c * CHUNK + i
            while True:
                try:
                    producer.produce(topic, value=value, key=str(n).encode(),
                                     partition=n % partitions, timestamp=stamps[i],
                                     on_delivery=on_delivery)
                    break
                except BufferError:  # the local queue is full: wait for deliveries
                    producer.poll(0.1)
            producer.poll(0)
        if errors:
            break
        if progress is not None:
            sent = c * CHUNK + table.num_rows
            progress(f"{sent:,}/{events:,} events to {topic} "
                     f"({sent / max(time.monotonic() - started, 1e-3):,.0f} events/s)")
    left = producer.flush(300)
    if errors or left or delivered != events:
        raise RuntimeError(f"topic {topic}: {delivered} of {events} events delivered, "
                           f"{left} not acknowledged, {len(errors)} failed "
                           f"(first: {errors[:3]})")
    return delivered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--rate", type=int, default=10_000, help="events a second")
    parser.add_argument("--out", type=Path, help="Parquet files under this directory")
    parser.add_argument("--kafka", metavar="BOOTSTRAP", help="a Kafka topic")
    parser.add_argument("--topic", default="nexmark")
    parser.add_argument("--partitions", type=int, default=8)
    args = parser.parse_args()
    if args.out is None and args.kafka is None:
        parser.error("expected --out, --kafka or both")
    if args.out is not None:
        paths = write(args.out, args.events, args.files, seed=args.seed,
                      events_per_second=args.rate)
        print(f"{args.events} events in {len(paths)} files under {args.out}")
    if args.kafka is not None:
        n = produce(args.kafka, args.topic, args.events, args.partitions, seed=args.seed,
                    events_per_second=args.rate,
                    progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(f"{n} events in topic {args.topic} ({args.partitions} partitions) at "
              f"{args.kafka}")


if __name__ == "__main__":
    main()
