"""State backends against a plain-Python reference: same merges, snapshots that reload."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.compute  # pa.compute
import pytest

from spark_ckpt.errors import StateTooLargeError
from spark_ckpt.state.backends import (
    MemoryAggState,
    RocksAggState,
)
from spark_ckpt.state.keygroups import KG_COLUMN

COLUMNS = [("n", "add", pa.int64()), ("s", "add", pa.float64()), ("lo", "min", pa.float64()),
           ("hi", "max", pa.string()), ("v", "last_value", pa.float64()),
           ("v__ts", "last_ts", pa.int64())]


def partials(rng: random.Random, keys: int, rows: int) -> pa.Table:
    """One batch of per-key partials (unique keys), some values null."""
    ks = rng.sample(range(keys), rows)

    def maybe(v):
        return None if rng.random() < 0.2 else v

    return pa.table({
        KG_COLUMN: pa.array([k % 7 for k in ks], pa.int32()),
        "k": pa.array(ks, pa.int64()),
        "n": pa.array([rng.randint(1, 5) for _ in ks], pa.int64()),
        "s": pa.array([maybe(rng.uniform(-5, 5)) for _ in ks], pa.float64()),
        "lo": pa.array([maybe(rng.uniform(-5, 5)) for _ in ks], pa.float64()),
        "hi": pa.array([maybe(rng.choice("abcdef")) for _ in ks], pa.string()),
        "v": pa.array([rng.uniform(0, 1) for _ in ks], pa.float64()),
        "v__ts": pa.array([rng.randint(0, 50) for _ in ks], pa.int64()),
    })


def reference(batches: list[pa.Table]) -> dict[int, dict]:
    state: dict[int, dict] = {}

    def comb(a, b, f):
        return b if a is None else a if b is None else f(a, b)

    for t in batches:
        for row in t.to_pylist():
            old = state.get(row["k"])
            if old is None:
                state[row["k"]] = row
                continue
            new = dict(old)
            new["n"] = old["n"] + row["n"]
            new["s"] = comb(old["s"], row["s"], lambda a, b: a + b)
            new["lo"] = comb(old["lo"], row["lo"], min)
            new["hi"] = comb(old["hi"], row["hi"], max)
            if row["v__ts"] is not None and (old["v__ts"] is None or row["v__ts"] >= old["v__ts"]):
                new["v"], new["v__ts"] = row["v"], row["v__ts"]
            state[row["k"]] = new
    return state


def as_dict(table: pa.Table) -> dict[int, dict]:
    return {r["k"]: r for r in table.to_pylist()}


def close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        for col in ("n", "hi", "v", "v__ts", KG_COLUMN):
            assert a[k][col] == b[k][col], (k, col, a[k], b[k])
        for col in ("s", "lo"):
            assert (a[k][col] is None) == (b[k][col] is None)
            if a[k][col] is not None:
                assert a[k][col] == pytest.approx(b[k][col])


@pytest.fixture(params=["memory", "rocksdb"])
def backend(request, tmp_path):
    if request.param == "memory":
        state = MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=10_000)
    else:
        state = RocksAggState(str(tmp_path / "db"), ["k"], [pa.int64()], COLUMNS, fresh=True)
    yield state
    state.close()


def test_merges_equal_the_reference_and_changelogs_hold_the_new_values(backend):
    rng = random.Random(7)
    batches = [partials(rng, 300, rng.randint(1, 200)) for _ in range(12)]
    for i, batch in enumerate(batches):
        changelog = backend.apply(batch)
        want = reference(batches[:i + 1])
        got = as_dict(changelog)
        close(got, {k: want[k] for k in got})
    close(as_dict(backend.snapshot()), reference(batches))


def test_a_snapshot_reloads_into_either_backend(backend, tmp_path):
    rng = random.Random(3)
    for _ in range(5):
        backend.apply(partials(rng, 200, 80))
    snap = backend.snapshot()
    memory = MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=10_000)
    memory.load(snap)
    rocks = RocksAggState(str(tmp_path / "other"), ["k"], [pa.int64()], COLUMNS, fresh=True)
    rocks.apply(snap, replace=True)
    close(as_dict(memory.snapshot()), as_dict(snap))
    close(as_dict(rocks.snapshot()), as_dict(snap))
    rocks.close()


def test_memory_backend_refuses_more_keys_than_its_limit_clearly():
    state = MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=50)
    with pytest.raises(StateTooLargeError, match="memoryMaxRows=50.*rocksdb"):
        state.apply(partials(random.Random(1), 100, 60))


def test_rocksdb_token_is_written_with_the_changes(tmp_path):
    path = str(tmp_path / "db")
    state = RocksAggState(path, ["k"], [pa.int64()], COLUMNS, fresh=True)
    state.apply(partials(random.Random(1), 100, 10), token="v1")
    state.close()
    again = RocksAggState(path, ["k"], [pa.int64()], COLUMNS, fresh=False)
    assert again.token == "v1" and len(again.snapshot()) == 10
    again.close()


def test_a_state_file_of_an_unknown_format_is_refused(tmp_path):
    import pyarrow.parquet as pq

    from spark_ckpt.errors import FormatVersionError
    from spark_ckpt.state.chain import StateFile
    from spark_ckpt.state.keygroups import KeyGroupRange
    from spark_ckpt.state.task import _read, _write

    table = pa.table({KG_COLUMN: pa.array([1], pa.int32()), "k": [5]})
    uri, size = _write(table, str(tmp_path), "ok.parquet")
    ok = StateFile(uri, "snapshot", 0, 1, size, "kg00000-00004")
    assert _read(ok, KeyGroupRange(0, 4)).column("k").to_pylist() == [5]
    pq.write_table(table.replace_schema_metadata({b"spark_ckpt.state": b"9"}),
                   str(tmp_path / "new.parquet"))
    new = StateFile(str(tmp_path / "new.parquet"), "snapshot", 0, 1, 1, "kg00000-00004")
    with pytest.raises(FormatVersionError, match="expected spark_ckpt.state format 1, found 9"):
        _read(new, KeyGroupRange(0, 4))


def _retyped(table: pa.Table, key_type: pa.DataType) -> pa.Table:
    """The partials with key 0 as the null key and the key column of another type."""
    ks = [None if k == 0 else (str(k) if pa.types.is_string(key_type) else k)
          for k in table.column("k").to_pylist()]
    return table.set_column(1, "k", pa.array(ks, key_type))


@pytest.mark.parametrize("key_type", [pa.int64(), pa.int32(), pa.int8(), pa.string()],
                         ids=["int64", "int32", "int8", "string"])
def test_integer_and_other_keys_with_a_null_key_merge_alike(key_type, tmp_path):
    """One integer key column takes the numpy/pandas index, others the dict; both, and
    RocksDB, merge every batch (the null key included) as the reference does, and a snapshot
    reloads with the declared key type."""
    rng = random.Random(11)
    batches = [_retyped(partials(rng, 100, rng.randint(1, 90)), key_type) for _ in range(10)]
    memory = MemoryAggState(["k"], [key_type], COLUMNS, max_rows=10_000)
    rocks = RocksAggState(str(tmp_path / "db"), ["k"], [key_type], COLUMNS, fresh=True)
    assert memory.integer == pa.types.is_integer(key_type)
    for i, batch in enumerate(batches):
        want = reference(batches[:i + 1])
        for state in (memory, rocks):
            got = as_dict(state.apply(batch))
            assert set(got) == set(batch.column("k").to_pylist())  # every key of the batch
            close(got, {k: want[k] for k in got})
        assert (i, memory.rows, rocks.rows) == (i, len(want), len(want))
    snap = memory.snapshot()
    assert snap.schema.field("k").type == key_type
    close(as_dict(snap), reference(batches))
    close(as_dict(rocks.snapshot()), reference(batches))
    again = MemoryAggState(["k"], [key_type], COLUMNS, max_rows=10_000)
    again.load(snap)
    extra = _retyped(partials(rng, 100, 50), key_type)
    close(as_dict(again.apply(extra)), {k: v for k, v in reference([*batches, extra]).items()
                                         if k in as_dict(extra)})
    assert again.rows == len(reference([*batches, extra]))
    rocks.close()


def test_integer_keys_at_the_edges_and_key_zero_beside_the_null_key(tmp_path):
    """Key 0 and the null key are two keys; keys past 2**53 and at int64's ends stay apart;
    many batches adding a few keys each (the side index) and one adding many (the main index
    rebuilt) find every earlier key."""
    edges = [0, None, -1, 2**53, 2**53 + 1, -2**63, 2**63 - 1]
    memory = MemoryAggState(["k"], [pa.int64()], COLUMNS, max_rows=10**6)
    rocks = RocksAggState(str(tmp_path / "db"), ["k"], [pa.int64()], COLUMNS, fresh=True)
    rng = random.Random(5)

    def batch(keys):
        t = partials(rng, len(keys), len(keys))
        t = t.set_column(0, KG_COLUMN, pa.array([0 if k is None else k % 7 for k in keys],
                                                pa.int32()))
        return t.set_column(1, "k", pa.array(keys, pa.int64()))

    batches = [batch(edges)]
    batches += [batch(list(range(10 * i, 10 * i + 15))) for i in range(30)]  # overlapping
    batches += [batch(list(range(1000, 200_000, 3)))]  # the main index rebuilt
    batches += [batch([*edges, 5, 1000, 199_999 - 1, 7_777_777])]
    for i, b in enumerate(batches):
        got_m, got_r = as_dict(memory.apply(b)), as_dict(rocks.apply(b))
        want = reference(batches[:i + 1])
        assert set(got_m) == set(got_r) == set(b.column("k").to_pylist())
        if len(b) < 1000:
            close(got_m, {k: want[k] for k in got_m})
            close(got_r, {k: want[k] for k in got_r})
        assert memory.rows == rocks.rows == len(want), i
    final = reference(batches)
    snap = as_dict(memory.snapshot())
    assert 0 in snap and None in snap and len(snap) == len(final)
    close(snap, final)
    close(as_dict(rocks.snapshot()), final)
    rocks.close()


@pytest.mark.parametrize("key_type", [pa.int64(), pa.string()], ids=["int64", "string"])
@pytest.mark.parametrize("which", ["existing", "new", "null"])
@pytest.mark.parametrize("backend_name", ["memory", "rocksdb"])
def test_a_key_twice_in_one_update_is_refused_and_changes_nothing(key_type, which,
                                                                  backend_name, tmp_path):
    state = MemoryAggState(["k"], [key_type], COLUMNS, max_rows=10_000) \
        if backend_name == "memory" else \
        RocksAggState(str(tmp_path / "db"), ["k"], [key_type], COLUMNS, fresh=True)
    rng = random.Random(2)
    first = _retyped(partials(rng, 50, 20), key_type)
    first = first.filter(pa.compute.is_valid(first.column("k")))
    state.apply(first)
    before, rows = as_dict(state.snapshot()), state.rows
    other = partials(rng, 1000, 3)
    other = other.set_column(1, "k", pa.array([None, None, None] if which == "null" else
                                              [str(k) if pa.types.is_string(key_type) else k
                                               for k in [900, 901, 902]], key_type))
    if which == "existing":
        twice = pa.concat_tables([first.slice(0, 3), first.slice(2, 1)])
    elif which == "new":
        twice = pa.concat_tables([other.slice(0, 2), other.slice(1, 1)])
    else:  # the null key's key group is one (the hash of null)
        twice = other.slice(0, 2).set_column(0, KG_COLUMN, pa.array([3, 3], pa.int32()))
    with pytest.raises(ValueError, match="one partial per key"):
        state.apply(twice)
    assert as_dict(state.snapshot()) == before and state.rows == rows
    state.close()


def test_rocksdb_count_of_a_copy_written_before_the_count_was_kept(tmp_path):
    """A local copy with no count key is counted once, and the count is written with the next
    change even when it adds no key."""
    from spark_ckpt.state.backends import ROWS_KEY

    path = str(tmp_path / "db")
    state = RocksAggState(path, ["k"], [pa.int64()], COLUMNS, fresh=True)
    first = partials(random.Random(4), 100, 40)
    state.apply(first, token="v1")
    state.db.delete(ROWS_KEY)
    state.close()
    again = RocksAggState(path, ["k"], [pa.int64()], COLUMNS, fresh=False)
    assert again.rows == 40
    again.apply(first.slice(0, 5), token="v2")  # existing keys only
    again.close()
    third = RocksAggState(path, ["k"], [pa.int64()], COLUMNS, fresh=False)
    assert third.db.get(ROWS_KEY) == b"40" and third.rows == 40 and third.token == "v2"
    third.close()


@pytest.mark.parametrize("old,new", [(1, 1), (4, 4), (3, 7), (7, 3), (1000, 2000), (2000, 999),
                                     (5, 128)])
def test_rescale_plans_of_a_whole_layout_equal_each_range_planned_alone(old, new):
    """restore_plans (bisection over the old layout) gives every new range the files that
    restore_plan gives it alone, in the same order; also for handles not in layout order."""
    from spark_ckpt.state.chain import StateFile, StateHandle, restore_plan, restore_plans
    from spark_ckpt.state.keygroups import ranges

    max_parallelism = 2048
    handles = [StateHandle(r.label, None, tuple(
        StateFile(f"/s/{r.label}/{k}", "changelog", k, 1, 1, r.label) for k in range(2)), 1)
        for r in ranges(old, max_parallelism)]
    targets = ranges(new, max_parallelism)
    expected = [restore_plan(t, handles) for t in targets]
    assert restore_plans(targets, handles) == expected
    assert sum(len(p) for p in expected) >= 2 * old  # every old range's files are planned
    shuffled = handles[::-1]
    assert restore_plans(targets, shuffled) == [restore_plan(t, shuffled) for t in targets]


def test_a_worker_drops_the_cached_ranges_the_plans_moved_past():
    """Before a task looks for its range in its worker's memory, the worker drops every range
    of the operator it holds at a version the driver's plans no longer name (another worker
    ran it since), that a rescale removed, or of other state variables; the current ones and
    other operators' stay."""
    from spark_ckpt.state import task

    class Cached:
        def __init__(self, token):
            self.token, self.closed = token, False

        def close(self):
            self.closed = True

    saved = dict(task._CACHE)
    task._CACHE.clear()
    try:
        current, moved, gone, other_schema, other_op = (
            Cached("t1"), Cached("old"), Cached("t9"), Cached("t1"), Cached("x"))
        task._CACHE.update({("p", "op", "kg00000-00004", ""): current,
                            ("p", "op", "kg00004-00008", ""): moved,
                            ("p", "op", "kg00008-00012", ""): gone,  # rescaled away
                            ("p", "op", "kg00000-00004", "s2"): other_schema,
                            ("p", "other", "kg00004-00008", ""): other_op})
        plans = {0: {"range": "kg00000-00004", "token": "t1", "files": []},
                 1: {"range": "kg00004-00008", "token": "new", "files": []}}
        run = task._Run({"pipeline_id": "p", "operator": "op", "batch": 3,
                         "state_dir": "/nowhere"}, plans, 1)
        assert run.cached() is None  # its own range was moved past: dropped, not returned
        assert run.metrics["evicted"] == 3
        assert [moved.closed, gone.closed, other_schema.closed] == [True, True, True]
        assert not current.closed and not other_op.closed
        assert set(task._CACHE) == {("p", "op", "kg00000-00004", ""),
                                    ("p", "other", "kg00004-00008", "")}
        # a range an earlier task of this batch left (its token newer than the plans) stays
        task._CACHE[("p", "op", "kg00000-00004", "")] = fresh = Cached("made-in-batch-3")
        task._CACHED_AT[("p", "op", "kg00000-00004", "")] = 3
        again = task._Run({"pipeline_id": "p", "operator": "op", "batch": 3,
                           "state_dir": "/nowhere"}, plans, 1)
        assert again.cached() is None and again.metrics["evicted"] == 0 and not fresh.closed
        later = task._Run({"pipeline_id": "p", "operator": "op", "batch": 4,
                           "state_dir": "/nowhere"}, {**plans, 0: {**plans[0],
                                                                 "token": "made-in-batch-3"}},
                          0)
        assert later.cached() is fresh  # the next batch's plans name it: a process hit
    finally:
        task._CACHE.clear()
        task._CACHE.update(saved)
        task._CACHED_AT.clear()


# -- the local copy's encoding (format 2: packed rows, fixed-width integer keys) -------------
NUMERIC = [("n", "add", pa.int64()), ("s", "add", pa.float64()), ("lo", "min", pa.float64()),
           ("hi", "max", pa.int64()), ("v", "last_value", pa.float64()),
           ("v__ts", "last_ts", pa.int64())]


def _numeric(table: pa.Table) -> pa.Table:
    """The partials with ``hi`` an integer column: every state column has a fixed width."""
    his = [None if h is None else ord(h) for h in table.column("hi").to_pylist()]
    return table.set_column(table.schema.get_field_index("hi"), "hi", pa.array(his, pa.int64()))


def _edge_batches(rng: random.Random, key_type: pa.DataType, columns) -> list[pa.Table]:
    """Batches over overlapping keys, the null key, key 0 and int64's ends."""
    edges = [0, None, -1, 2**53 + 1, -2**63, 2**63 - 1] if key_type == pa.int64() else \
        [None, "0", "-1", "a b", "é"]
    out = []
    for i in range(8):
        keys = list(range(100 + 10 * i, 125 + 10 * i)) + (edges if i in (0, 5) else [])
        t = partials(rng, len(keys), len(keys))
        t = t.set_column(0, KG_COLUMN, pa.array([0 if k is None else hash(str(k)) % 7
                                                 if isinstance(k, str) else k % 7
                                                 for k in keys], pa.int32()))
        if key_type != pa.int64():
            keys = [None if k is None else str(k) for k in keys]
        t = t.set_column(1, "k", pa.array(keys, key_type))
        out.append(_numeric(t) if columns is NUMERIC else t)
    return out


@pytest.mark.parametrize("key_type", [pa.int64(), pa.string()], ids=["int64", "string"])
@pytest.mark.parametrize("columns", [NUMERIC, COLUMNS], ids=["packed", "json-rows"])
def test_rocksdb_encodings_merge_snapshot_and_restore_like_memory(key_type, columns, tmp_path):
    """Packed rows (every column fixed-width) and JSON rows (a string column), integer and
    other keys: updates give the changelogs the memory backend gives; a chain of changelogs
    restored into an empty copy (sorted and ingested as one SST file when the key is one
    integer column) holds what the memory backend holds; the copy reopens at its token and
    takes more updates alike."""
    from spark_ckpt.state.backends import FORMAT_KEY

    rng = random.Random(17)
    batches = _edge_batches(rng, key_type, columns)
    memory = MemoryAggState(["k"], [key_type], columns, max_rows=10_000)
    rocks = RocksAggState(str(tmp_path / "db"), ["k"], [key_type], columns, fresh=True)
    chain = []
    for batch in batches:
        got_m, got_r = memory.apply(batch), rocks.apply(batch, token="t")
        assert as_dict(got_r) == as_dict(got_m)
        chain.append(got_r)
    assert rocks.rows == memory.rows
    assert as_dict(rocks.snapshot()) == as_dict(memory.snapshot())
    packed = columns is NUMERIC
    assert (b"rows=packed" in rocks.db.get(FORMAT_KEY)) == packed
    assert (b"keys=int64" in rocks.db.get(FORMAT_KEY)) == (key_type == pa.int64())
    rocks.close()
    restored = RocksAggState(str(tmp_path / "restored"), ["k"], [key_type], columns,
                             fresh=True)
    # a snapshot first (the memory backend's, in another key order) and then the changelogs
    restored.restore([memory.snapshot().slice(0, 7), *chain[3:], chain[0].slice(0, 0)])
    partial = MemoryAggState(["k"], [key_type], columns, max_rows=10_000)
    partial.load(memory.snapshot().slice(0, 7))
    for t in chain[3:]:
        partial.apply(t, replace=True)
    assert restored.rows == partial.rows
    assert as_dict(restored.snapshot()) == as_dict(partial.snapshot())
    restored.set_token("r")
    restored.close()
    again = RocksAggState(str(tmp_path / "restored"), ["k"], [key_type], columns, fresh=False)
    assert again.token == "r" and again.rows == partial.rows
    more = batches[1]
    assert as_dict(again.apply(more)) == as_dict(partial.apply(more))
    assert as_dict(again.snapshot()) == as_dict(partial.snapshot())
    again.close()


def _write_format_1(path: str, table: pa.Table, columns, token: str) -> None:
    """A local copy as spark_ckpt wrote it before format 2 (up to commit 7fad7f7): the key
    group as 2 big-endian bytes and the key as JSON (an integer key as its str) -> the row's
    state values as a JSON list, the count and the token beside them."""
    import json
    import struct

    from spark_ckpt.state.backends import ROWS_KEY, TOKEN_KEY
    from spark_ckpt.state.store import open_rocks

    db = open_rocks(path, fresh=True)
    names = [c[0] for c in columns]
    for row in table.to_pylist():
        key = "null" if row["k"] is None else json.dumps(row["k"], separators=(",", ":"))
        db.put(struct.pack(">H", row[KG_COLUMN]) + key.encode(),
               json.dumps([row[n] for n in names], separators=(",", ":")).encode())
    db.put(ROWS_KEY, str(table.num_rows).encode())
    db.put(TOKEN_KEY, token.encode())
    db.close()


@pytest.mark.parametrize("columns", [NUMERIC, COLUMNS], ids=["packed", "json-rows"])
def test_a_copy_in_the_first_encoding_still_reads_and_takes_updates(columns, tmp_path):
    """A copy an earlier version left on an executor (format 1: JSON keys and rows) opens at
    its token, snapshots, and takes updates in its own encoding (never mixing two); a rebuilt
    copy is written in format 2."""
    from spark_ckpt.state.backends import FORMAT_KEY

    rng = random.Random(23)
    batches = _edge_batches(rng, pa.int64(), columns)
    memory = MemoryAggState(["k"], [pa.int64()], columns, max_rows=10_000)
    for batch in batches[:4]:
        memory.apply(batch)
    path = str(tmp_path / "old")
    _write_format_1(path, memory.snapshot(), columns, "v1")
    old = RocksAggState(path, ["k"], [pa.int64()], columns, fresh=False)
    assert old.token == "v1" and old.format == b"1" and old.rows == memory.rows
    assert as_dict(old.snapshot()) == as_dict(memory.snapshot())
    for batch in batches[4:]:
        assert as_dict(old.apply(batch, token="v2")) == as_dict(memory.apply(batch))
    old.close()
    again = RocksAggState(path, ["k"], [pa.int64()], columns, fresh=False)
    assert again.format == b"1" and again.token == "v2"
    assert as_dict(again.snapshot()) == as_dict(memory.snapshot())
    again.close()
    rebuilt = RocksAggState(path, ["k"], [pa.int64()], columns, fresh=True)
    rebuilt.restore([memory.snapshot()])
    assert rebuilt.db.get(FORMAT_KEY).startswith(b"2;keys=int64")
    assert as_dict(rebuilt.snapshot()) == as_dict(memory.snapshot())
    rebuilt.close()


def test_a_copy_of_another_layout_is_never_read(tmp_path):
    """A copy whose format names other state columns is not taken at its token (the task
    rebuilds the range from the durable chain)."""
    path = str(tmp_path / "db")
    state = RocksAggState(path, ["k"], [pa.int64()], NUMERIC, fresh=True)
    state.apply(_numeric(partials(random.Random(1), 100, 10)), token="v1")
    state.close()
    other = [*NUMERIC[:3], ("hi", "max", pa.float64()), *NUMERIC[4:]]
    again = RocksAggState(path, ["k"], [pa.int64()], other, fresh=False)
    assert again.token is None
    again.close()


def test_integer_keys_outside_their_groups_bounds_are_not_looked_up(tmp_path):
    """Format 2 keeps each key group's smallest and largest key: keys that grow past them (as
    ids do) are new without a lookup, keys inside them are looked up, and the bounds reopen
    with the copy and come with a restore."""
    class Counting:
        def __init__(self, db):
            self.db, self.asked = db, []

        def get(self, keys, *args, **kwargs):
            if isinstance(keys, list):
                self.asked.extend(keys)
            return self.db.get(keys, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.db, name)

    def ones(keys):
        return pa.table({KG_COLUMN: pa.array([0 if k is None else k % 7 for k in keys],
                                             pa.int32()),
                         "k": pa.array(keys, pa.int64()), "n": pa.array([1] * len(keys))})

    columns = [("n", "add", pa.int64())]
    path = str(tmp_path / "db")
    state = RocksAggState(path, ["k"], [pa.int64()], columns, fresh=True)
    state.db = Counting(state.db)
    state.apply(ones(list(range(100))))
    state.apply(ones(list(range(100, 200))))
    state.apply(ones([-5, 250, 10**12]))
    assert state.db.asked == []  # every key past its group's bounds
    state.apply(ones([50, 150, 300, None]))
    assert len(state.db.asked) == 3  # 50 and 150 inside, the null key always; 300 new
    state.apply(ones([None, 0]))
    got = {r["k"]: r["n"] for r in state.snapshot().to_pylist()}
    assert got[50] == got[150] == 2 and got[None] == 2 and got[0] == 2 and got[300] == 1
    assert state.rows == 205
    state.db = state.db.db
    state.close()
    again = RocksAggState(path, ["k"], [pa.int64()], columns, fresh=False)
    again.db = Counting(again.db)
    again.apply(ones([1000, 199]))
    assert len(again.db.asked) == 1  # 199: the bounds came back with the copy
    restored = RocksAggState(str(tmp_path / "r"), ["k"], [pa.int64()], columns, fresh=True)
    restored.restore([again.snapshot()])
    restored.db = Counting(restored.db)
    restored.apply(ones([2000, 3]))
    assert len(restored.db.asked) == 1
    assert {r["k"]: r["n"] for r in restored.snapshot().to_pylist()}[3] == 2
    again.close()
    restored.db = restored.db.db
    restored.close()
