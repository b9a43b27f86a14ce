"""Typed state stores (memory and RocksDB): every Spark type a user can declare round-trips
through put, fetch, due timers and snapshot, and deletes and timers behave the same in both."""

from __future__ import annotations

import datetime as dt
import decimal
import math

import pyarrow as pa
import pytest

from spark_ckpt.state.schema import StateSchema, StateVar, json_safe, json_unsafe
from spark_ckpt.state.store import MemoryStore, RocksStore

UTC = dt.UTC
EVERY_TYPE = [
    StateVar("b", pa.bool_()), StateVar("i8", pa.int8()), StateVar("i16", pa.int16()),
    StateVar("i32", pa.int32()), StateVar("i64", pa.int64()), StateVar("f32", pa.float32()),
    StateVar("f64", pa.float64()), StateVar("dec", pa.decimal128(20, 4)),
    StateVar("s", pa.string()), StateVar("bin", pa.binary()), StateVar("d", pa.date32()),
    StateVar("ts", pa.timestamp("us", tz="UTC")), StateVar("ntz", pa.timestamp("us")),
    StateVar("st", pa.struct([("ts", pa.timestamp("us", tz="UTC")), ("dest", pa.string()),
                              ("inner", pa.struct([("x", pa.decimal128(10, 2))]))])),
    StateVar("arr", pa.list_(pa.int64())),
    StateVar("arr_st", pa.list_(pa.struct([("d", pa.date32()), ("b", pa.binary())]))),
    StateVar("m", pa.map_(pa.string(), pa.float64())),
    StateVar("m_arr", pa.map_(pa.int32(), pa.list_(pa.string()))),
    StateVar("doc", pa.string(), is_json=True),
]
SCHEMA = StateSchema(EVERY_TYPE)
KEYS = [pa.field("k", pa.string()), pa.field("n", pa.int64())]


def row(i: int, *, nulls: bool = False) -> dict:
    if nulls:  # only one variable set: the others null, the key still exists
        return {"s": f"only-{i}"}
    return {
        "b": i % 2 == 0, "i8": -i % 100, "i16": 300 + i, "i32": -70000 - i, "i64": 2**40 + i,
        "f32": 1.5 + i, "f64": [math.nan, math.inf, -0.0, 1e-300][i % 4],
        "dec": decimal.Decimal(f"{i}.1234"), "s": f"välue-{i}", "bin": bytes([0, 255, i % 256]),
        "d": dt.date(2026, 1, 1) + dt.timedelta(days=i),
        "ts": dt.datetime(2026, 3, 29, 1, 30, i % 60, tzinfo=UTC),
        "ntz": dt.datetime(1969, 12, 31, 23, 59, 59, 999999),
        "st": {"ts": None if i % 3 == 0 else dt.datetime(2020, 1, 1, tzinfo=UTC),
               "dest": None, "inner": {"x": decimal.Decimal("-1.25")}},
        "arr": [i, None, -i], "arr_st": [{"d": dt.date(2000, 2, 29), "b": b"\x00"}, None],
        "m": [("a", 1.0), ("b", None)], "m_arr": [(1, ["x", None]), (2, [])],
        "doc": '{"nested":[1,2,{"x":null}]}',
    }


def table(rows: list[dict], keys: list[tuple[str, int]], timers: list) -> pa.Table:
    file_schema = SCHEMA.file_schema(KEYS, ttl=True)
    data = {"_kg": [7] * len(rows), "k": [k[0] for k in keys], "n": [k[1] for k in keys],
            "_timers": timers, "_expires": [None] * len(rows)}
    for v in EVERY_TYPE:
        data[v.name] = [r.get(v.name) for r in rows]
    return pa.Table.from_pydict(data, schema=file_schema)


def make(kind: str, tmp_path):
    file_schema = SCHEMA.file_schema(KEYS, ttl=True)
    if kind == "memory":
        return MemoryStore(file_schema, ["k", "n"], SCHEMA.names, max_rows=100)
    return RocksStore(str(tmp_path / "db"), file_schema, ["k", "n"], SCHEMA.names, fresh=True)


def fetch(store, t: pa.Table) -> pa.Table:
    return store.fetch(t.select(["_kg", "k", "n"]))


def values(t: pa.Table) -> list[dict]:
    return t.select([v.name for v in EVERY_TYPE] + ["_timers"]).to_pylist()


def same(a: list[dict], b: list[dict]) -> None:
    """Equal, with NaN equal to NaN."""
    def norm(x):
        if isinstance(x, float) and math.isnan(x):
            return "NaN"
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [norm(v) for v in x]
        return x
    assert norm(a) == norm(b)


@pytest.mark.parametrize("kind", ["memory", "rocksdb"])
def test_every_declared_type_round_trips_through_the_store(kind, tmp_path):
    store = make(kind, tmp_path)
    keys = [("a", 1), ("a", 2), ("é", None), (None, 3)]
    rows = [row(0), row(1), row(2, nulls=True), row(3)]
    timers = [[{"ms": 100, "kind": "event"}], None, [{"ms": 50, "kind": "processing"}], None]
    t = table(rows, keys, timers)
    store.put(t)
    got = fetch(store, t)
    same(values(got), values(t))
    assert got.schema.field("st").type == SCHEMA.by_name["st"].type
    # a key never written: a null row
    missing = table([{}], [("zz", 9)], [None])
    assert all(v is None for v in values(fetch(store, missing))[0].values())
    # timers due up to 100 ms: the two keys with timers
    assert sorted(store.due(100).column("n").to_pylist(), key=str) == [1, None]
    assert store.due(60).column("n").to_pylist() == [None]
    # the snapshot holds every key once, with its values
    snap = store.snapshot()
    assert snap.num_rows == 4
    by_key = {(r["k"], r["n"]): r for r in snap.to_pylist()}
    same([{k: by_key[key][k] for k in values(t)[0]} for key in keys], values(t))
    store.close()


@pytest.mark.parametrize("kind", ["memory", "rocksdb"])
def test_a_row_with_nothing_deletes_its_key_and_the_last_row_of_a_key_wins(kind, tmp_path):
    store = make(kind, tmp_path)
    t = table([row(1), row(2)], [("a", 1), ("b", 2)],
              [[{"ms": 10, "kind": "event"}], [{"ms": 20, "kind": "event"}]])
    store.put(t)
    # one put with key a twice (the later row wins) and key b emptied (deleted, timer gone)
    update = table([{"s": "first"}, {}, {"s": "second"}], [("a", 1), ("b", 2), ("a", 1)],
                   [None, [], None])
    store.put(update)
    snap = store.snapshot()
    assert [(r["k"], r["s"]) for r in snap.to_pylist()] == [("a", "second")]
    assert store.due(1000).num_rows == 0  # a's new row has no timer, b is gone
    assert store.rows == 1
    store.close()


@pytest.mark.parametrize("kind", ["memory", "rocksdb"])
def test_the_earliest_processing_timer_is_known_without_a_scan(kind, tmp_path):
    """Event timers do not count; a replaced or deleted key's timers go with it; a RocksDB
    store reopened keeps its index (and one from before the index answers with any timer)."""
    store = make(kind, tmp_path)
    assert store.next_processing_ms() is None
    store.put(table([row(1), row(2), row(3)], [("a", 1), ("b", 2), ("c", 3)], [
        [{"ms": 5, "kind": "event"}, {"ms": 300, "kind": "processing"}],
        [{"ms": 200, "kind": "processing"}], [{"ms": 1, "kind": "event"}]]))
    assert store.next_processing_ms() == 200
    store.put(table([{"s": "x"}], [("b", 2)], [[{"ms": 400, "kind": "processing"}]]))
    assert store.next_processing_ms() == 300
    store.put(table([{"s": "y"}], [("b", 2)], [[{"ms": 250, "kind": "event"}]]))  # kind
    assert store.next_processing_ms() == 300
    if kind == "memory":
        store.compact()
        assert store.next_processing_ms() == 300
    store.put(table([{}, {}], [("a", 1), ("b", 2)], [[], []]))  # deleted, timers and all
    assert store.next_processing_ms() is None
    store.put(table([row(4)], [("d", 4)], [[{"ms": 700, "kind": "processing"}]]))
    store.close()
    if kind == "rocksdb":
        file_schema = SCHEMA.file_schema(KEYS, ttl=True)
        again = RocksStore(str(tmp_path / "db"), file_schema, ["k", "n"], SCHEMA.names,
                           fresh=False)
        assert again.next_processing_ms() == 700
        from spark_ckpt.state.store import PROCESSING_INDEXED

        # as a store kept from an earlier version: no index, no marker
        from spark_ckpt.state.store import PROCESSING_PREFIX

        it = again.db.iter()
        it.seek(PROCESSING_PREFIX)
        assert it.valid() and it.key().startswith(PROCESSING_PREFIX)
        stale = it.key()
        del it  # (an open iterator keeps the database open)
        again.db.delete(stale)
        again.db.delete(PROCESSING_INDEXED)
        again.close()
        old = RocksStore(str(tmp_path / "db"), file_schema, ["k", "n"], SCHEMA.names,
                         fresh=False)
        assert old.next_processing_ms() == 700  # indexed again at open (c's event timer: not)
        old.close()


def test_the_memory_store_compacts_replaced_rows():
    store = MemoryStore(SCHEMA.file_schema(KEYS, ttl=True), ["k", "n"], SCHEMA.names,
                        max_rows=1000)
    for round_ in range(30):
        t = table([row(i) for i in range(200)], [("k", i) for i in range(200)], [None] * 200)
        t = t.set_column(t.column_names.index("i64"), "i64", pa.array([round_] * 200))
        store.put(t)
        store.compact()
    assert store.table.num_rows <= 2 * 200 + 4096 and store.rows == 200
    assert set(store.snapshot().column("i64").to_pylist()) == {29}


def test_json_safe_values_read_back_to_the_same_typed_values():
    t = table([row(i) for i in range(4)], [("a", i) for i in range(4)], [None] * 4)
    for v in EVERY_TYPE:
        column = t.column(v.name)
        back = json_unsafe(json_safe(column), v.type)
        same(back.to_pylist(), column.to_pylist())


def test_the_memory_store_refuses_more_keys_than_its_limit(tmp_path):
    from spark_ckpt.errors import StateTooLargeError

    store = MemoryStore(SCHEMA.file_schema(KEYS, ttl=False), ["k", "n"], SCHEMA.names,
                        max_rows=3)
    t = table([row(i) for i in range(4)], [("a", i) for i in range(4)], [None] * 4)
    with pytest.raises(StateTooLargeError, match="memoryMaxRows=3.*rocksdb"):
        store.put(t.drop_columns(["_expires"]))


def test_integer_keys_are_looked_up_like_any_other_key(tmp_path):
    """One integer key column takes the numpy/pandas index: nulls, duplicates within a put,
    deletes, timers, compaction and large ids behave as the dict of tuples (string keys) and
    RocksDB do."""
    import random

    schema = StateSchema([StateVar("v", pa.int64())])
    runs = {}
    for name, key_type in (("integer", pa.int64()), ("dict", pa.string()),
                           ("rocksdb", pa.int64())):
        fs = schema.file_schema([pa.field("k", key_type)], ttl=False)
        store = RocksStore(str(tmp_path / "db"), fs, ["k"], ["v"], fresh=True) \
            if name == "rocksdb" else MemoryStore(fs, ["k"], ["v"], max_rows=10_000)
        assert getattr(store, "integer", True) == (name != "dict")
        conv = (lambda k: None if k is None else str(k)) if name == "dict" else (lambda k: k)
        rng = random.Random(7)
        universe = [None, 0, -1, 2**62, -(2**63), *range(1, 40)]
        seen = []
        for round_ in range(40):
            keys = [rng.choice(universe) for _ in range(rng.randint(1, 30))]
            values = [None if rng.random() < 0.2 else round_ * 100 + i
                      for i in range(len(keys))]  # None: delete the key
            timers = [[{"ms": rng.randint(-10, 50), "kind": "event"}] if rng.random() < 0.3
                      else None for _ in keys]
            rows = pa.Table.from_pydict(
                {"_kg": [1] * len(keys), "k": [conv(k) for k in keys], "v": values,
                 "_timers": timers}, schema=fs)
            store.put(rows)
            if round_ % 7 == 0 and name != "rocksdb":
                store.compact()
            probe = pa.Table.from_pydict({"_kg": [1] * len(universe),
                                          "k": [conv(k) for k in universe]},
                                         schema=pa.schema([fs.field("_kg"), fs.field("k")]))
            due = sorted(str(k) for k in store.due(20).column("k").to_pylist())
            seen.append((store.fetch(probe).column("v").to_pylist(), store.rows, due,
                         store.snapshot().num_rows))
        runs[name] = seen
        store.close()
    assert runs["integer"] == runs["dict"] == runs["rocksdb"]
    assert all(rows == snap for _v, rows, _d, snap in runs["integer"])
