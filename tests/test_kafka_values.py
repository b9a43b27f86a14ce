"""A Kafka source's ``value_format="json"``: the Python tasks' parse (Arrow's JSON reader
where its answer is certainly Spark's, Spark's ``from_json`` for every other block) gives
exactly Spark's ``from_json(CAST(value AS STRING), schema)``, on a corpus of awkward values
and on random ones, blocks mixed; the options are checked."""

from __future__ import annotations

import json
import math
import random

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.sources.kafka_reader import ReadRanges
from spark_ckpt.sources.kafka_values import ValueFormat, parse_block

SCHEMA = "a BIGINT, b STRING, c DOUBLE, d BOOLEAN, e INT"

# values Spark and Arrow might read differently: each must come out as Spark reads it
AWKWARD = [
    '{"a":1,"b":"x","c":1.5,"d":true,"e":3}', '{"a":1.5}', '{"a":1e2}',
    '{"a":9223372036854775808}', '{"a":-9223372036854775808}', '{"e":3000000000}',
    '{"e":-2147483649}', '{"b":12}', '{"b":1.50}', '{"b":true}', '{"b":{"x":1}}',
    '{"b":[1,2]}', '{"a":1,"a":2}', '{"A":1}', '{"c":NaN}', '{"c":Infinity}',
    '{"c":-Infinity}', '{"c":"NaN"}', '{"c":1}', '{"c":-0.0}', '{"c":1e400}',
    '{"c":123456789012345678901234567890}', '{"c":4.9e-324}', '{"c":2.2250738585072011e-308}',
    '{"c":0.30000000000000004}', '{"c":123.456e5}', '{"a":"1"}', '{"d":"true"}', '{"d":1}',
    "{'a':1}", '{"a":1} xyz', '{"a":1}{"a":2}', '{"a":1} {"a":2}', 'null', '[{"a":1}]',
    '1', '"x"', 'true', '{"a":01}', '{"a":+1}', '{"a":.5}', '{"a":1.}', '{"a":-}',
    '{"b":"\\u00e9\\ud83d\\ude00"}', '{"b":"\\ud800"}', '{"b":"x\\u0000y"}', '{"b":"a\tb"}',
    '{"b":null}', '{"b":""}', '{}', '  {"a":5}  ', '{"a":5}\r', '\t{"a":5}', '{"a":1,}',
    '{"a":true}', '{"a":1,"zz":{"q":[1,2,{"r":null}]}}', '{"a" : 7 , "b" : "s p" }',
    '{"a":1,"b":"multi\nline"}', '{"a":1,\n"b":"x"}', '', ' ', '{', '}', '{"a":1',
    '{"b":"\\"quoted\\" \\\\ \\/ \\b\\f\\n\\r\\t"}', '{"e":2147483647,"a":0}', '{"d":null}',
    # found by review: tokens Arrow reads and Jackson (as Spark sets it) refuses or reads
    # otherwise, and Spark's parser limits
    '{"c":Inf}', '{"c":-Inf}', '{"c":-NaN}', '{"c":+Infinity}', '{"c":-0}', '{"a":-0}',
    '{"a":1,"zz":Inf}', '{"a":1,"zz":[NaN]}', '{"b":"-0 NaN Inf"}',
    '{"a":1,"zz":' + "[" * 1200 + "]" * 1200 + "}", '{"c":' + "9" * 1200 + "}",
    '{"a":2,"b":"' + "x" * 2000 + '"}',
]
INVALID_UTF8 = [b'{"b":"\xff"}', b'{"b":"ok\xc3"}', b'{"a":1,"b":"\xed\xa0\x80"}']


class _Message:
    """What a confluent-kafka consumer hands the reader: a record's fields (plain data)."""

    def __init__(self, offset: int, value: bytes | None) -> None:
        self._offset = offset
        self._value = value

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> None:
        return None

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return 1, 1_700_000_000_000 + self._offset

    def headers(self) -> None:
        return None

    def error(self) -> None:
        return None


def _random_value(rng: random.Random) -> bytes | None:
    """A value that is mostly a well-formed object of the schema, sometimes not."""
    roll = rng.random()
    if roll < 0.02:
        return None
    if roll < 0.06:
        return rng.choice(AWKWARD).encode("utf-8", "surrogatepass")
    fields: dict = {}
    if rng.random() < 0.9:
        fields["a"] = rng.choice([rng.randint(-2**63, 2**63 - 1), rng.randint(-1000, 1000)])
    if rng.random() < 0.9:
        fields["b"] = "".join(rng.choice("abcé😀\"\\/ \u0001xyz")
                              for _ in range(rng.randint(0, 12)))
    if rng.random() < 0.9:
        fields["c"] = rng.choice([rng.uniform(-1e6, 1e6),
                                  rng.random() * 10 ** rng.randint(-300, 300),
                                  rng.randint(-10**20, 10**20), float(rng.randint(-5, 5))])
    if rng.random() < 0.8:
        fields["d"] = rng.choice([True, False, None])
    if rng.random() < 0.8:
        fields["e"] = rng.randint(-2**31, 2**31 - 1)
    if rng.random() < 0.3:
        fields["extra"] = {"nested": [1, "two", None]}
    keys = list(fields)
    rng.shuffle(keys)
    return json.dumps({k: fields[k] for k in keys}, ensure_ascii=rng.random() < 0.5).encode()


def _same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x)
                                                      == math.copysign(1, y))
    return x == y and type(x) is type(y)


def _parse_like_the_tasks(spark, values: list[bytes | None], blocks: list[int],
                          schema: str = SCHEMA) -> tuple[list[dict], int]:
    """``values`` cut into blocks of the given sizes, each made into a batch by the reader's
    own code, then Spark's side of the parse (ValueFormat.from_tasks); rows by offset, and how
    many blocks the tasks parsed themselves."""
    form = ValueFormat("t", "json", schema, ["offset"])
    reader = ReadRanges({"format": form.reader_spec()})
    batches, offset, fast = [], 0, 0
    for size in blocks:
        messages = [_Message(offset + i, v) for i, v in enumerate(values[offset:offset + size])]
        batch = reader._batch(pa, "t", 0, messages)
        fast += batch.column(batch.schema.get_field_index("__spark_ckpt_raw_value")).null_count \
            == batch.num_rows
        batches.append(batch)
        offset += size
    table = pa.Table.from_batches(batches)
    got = form.from_tasks(spark.createDataFrame(table, schema=form.task_schema()))
    return [r.asDict() for r in got.orderBy("offset").collect()], fast


def _sparks(spark, values: list[bytes | None], schema: str = SCHEMA) -> list[dict]:
    frame = spark.createDataFrame([(i, v) for i, v in enumerate(values)],
                                  "offset BIGINT, value BINARY")
    parsed = frame.select("offset", F.from_json(F.col("value").cast("string"), schema)
                          .alias("p")).select("p.*", "offset")
    return [r.asDict() for r in parsed.orderBy("offset").collect()]


def _assert_rows_equal(got: list[dict], expected: list[dict], values: list) -> None:
    assert len(got) == len(expected) == len(values)
    for g, e in zip(got, expected, strict=True):
        bad = [k for k in e if not _same(g[k], e[k])]
        assert not bad, (values[e["offset"]], {k: (g[k], e[k]) for k in bad})


def test_awkward_values_parse_as_sparks_from_json(spark):
    """Each awkward value alone (a block of one), then all of them in one block: every row
    equals Spark's from_json of the value; the well-formed ones were parsed by the tasks."""
    values = [v.encode("utf-8", "surrogatepass") for v in AWKWARD] + INVALID_UTF8 + [None]
    got, fast = _parse_like_the_tasks(spark, values, [1] * len(values))
    _assert_rows_equal(got, _sparks(spark, values), values)
    assert fast >= 15  # the fast path was taken where it could be (the test is not vacuous)
    got, fast = _parse_like_the_tasks(spark, values, [len(values)])
    _assert_rows_equal(got, _sparks(spark, values), values)
    assert fast == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_values_in_random_blocks_parse_as_sparks_from_json(spark, seed):
    rng = random.Random(seed)
    values = [_random_value(rng) for _ in range(3000)]
    blocks, left = [], len(values)
    while left:
        size = min(left, rng.choice([1, 2, 5, 17, 60, 200]))
        blocks.append(size)
        left -= size
    got, fast = _parse_like_the_tasks(spark, values, blocks)
    _assert_rows_equal(got, _sparks(spark, values), values)
    assert fast >= len(blocks) // 10


def test_a_schema_with_types_arrow_might_read_otherwise_is_parsed_by_spark(spark):
    """A TIMESTAMP or DECIMAL field: Spark parses every block (no fast path)."""
    schema = "a BIGINT, t TIMESTAMP, m DECIMAL(10,2)"
    values = [b'{"a":1,"t":"2026-11-28T01:02:03Z","m":1.005}', b'{"a":2,"t":"bad","m":"x"}',
              b'{"a":3,"t":"2026-11-28 01:02:03.5","m":12345678.9}']
    got, fast = _parse_like_the_tasks(spark, values, [3], schema)
    assert fast == 0
    _assert_rows_equal(got, _sparks(spark, values, schema), values)


def test_a_block_is_parsed_by_arrow_only_when_every_value_is_one_object_line():
    spec = ValueFormat("t", "json", SCHEMA, None).reader_spec()
    assert parse_block(pa, [b'{"a":1}', b'{"a":2}'], spec)[1]
    for bad in ([b'{"a":1}', None], [b'{"a":1}', b""], [b"", b'{"a":1}'], [b'{"a":1}\n'],
                [b'{"a":1}', b"null"], [b'{"a":1}', b' {"a":1}'], [b'{"a":1}\n{"a":2}'],
                [b'{"a":1} {"a":2}'], [b'{"a":1}', b'{"a":"x"}'], []):
        assert not parse_block(pa, bad, spec)[1], bad


def test_value_format_options_are_checked():
    with pytest.raises(JobDefinitionError, match="value_format 'json'"):
        ValueFormat("t", "avro", SCHEMA, None)
    with pytest.raises(JobDefinitionError, match="DDL string"):
        ValueFormat("t", "json", "a BIGINT,, b", None)
    with pytest.raises(JobDefinitionError, match="metadata columns among"):
        ValueFormat("t", "json", SCHEMA, ["offst"])
    with pytest.raises(JobDefinitionError, match="'kafka_a': 'key'"):
        ValueFormat("t", "json", SCHEMA, {"a": "key"})
    form = ValueFormat("t", "json", SCHEMA, {"ts": "timestamp", "partition": "partition"})
    assert form.schema().simpleString() == ("struct<a:bigint,b:string,c:double,d:boolean,"
                                            "e:int,ts:timestamp,partition:int>")


def test_a_value_field_named_as_a_kafka_column_keeps_its_own_value(spark):
    """A value field called ``timestamp`` beside the Kafka timestamp renamed ``kafka_ts``
    (found by review: the tasks' columns clashed)."""
    form = ValueFormat("t", "json", "timestamp STRING, offset BIGINT",
                       {"kafka_ts": "timestamp", "at": "offset"})
    reader = ReadRanges({"format": form.reader_spec()})
    values = [b'{"timestamp":"noon","offset":7}', b'{"timestamp":"late","offset":8}']
    batch = reader._batch(pa, "t", 0, [_Message(i, v) for i, v in enumerate(values)])
    got = form.from_tasks(spark.createDataFrame(pa.Table.from_batches([batch]),
                                                schema=form.task_schema())).collect()
    assert [(r.timestamp, r.offset, r.at, r.kafka_ts.year) for r in got] == \
        [("noon", 7, 0, 2023), ("late", 8, 1, 2023)]


def test_short_batches_are_packed_into_fewer_reading_tasks():
    from spark_ckpt.sources.kafka import _pack

    ranges = [("t", p, 0, 3_000) for p in range(8)]
    assert sorted(len(t) for t in _pack(ranges)) == [4, 4]  # 24,000 offsets: two tasks
    big = [("t", p, 0, 125_000) for p in range(8)]
    assert [len(t) for t in _pack(big)] == [1] * 8  # a task per range
    mixed = [("t", 0, 0, 250_000), ("t", 1, 0, 10), ("t", 2, 5, 5), ("u", 0, 0, 40_000)]
    tasks = _pack(mixed)
    assert len(tasks) == 3 and sorted(r for t in tasks for r in t) == sorted(mixed)
    assert all(t for t in tasks)
