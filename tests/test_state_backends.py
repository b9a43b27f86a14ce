"""State backends against a plain-Python reference: same merges, snapshots that reload."""

from __future__ import annotations

import random

import pyarrow as pa
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
