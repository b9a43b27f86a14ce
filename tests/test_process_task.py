"""A keyed processor's batch, driven directly (no Spark): TTL, timers, one changelog row per
key, NaN keys and exact integers reach user code as they are, both APIs and both backends."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from spark_ckpt import KeyedProcessor, Result, VectorizedProcessor
from spark_ckpt.state.process_task import _Batch
from spark_ckpt.state.schema import StateSchema, StateVar
from spark_ckpt.state.store import MemoryStore, RocksStore

SCHEMA = StateSchema([StateVar("a", pa.int64()), StateVar("b", pa.int64())])
OUT = pa.schema([("key", pa.int64()), ("a", pa.int64()), ("b", pa.int64())])


class _Range:
    label = "kg00000-00128"


class _Task:
    pid = 0
    range = _Range()


def store_for(backend: str, tmp_path, key_type: pa.DataType | None = None, ttl: bool = True):
    fs = SCHEMA.file_schema([pa.field("key", key_type or pa.int64())], ttl=ttl)
    if backend == "memory":
        return MemoryStore(fs, ["key"], SCHEMA.names, max_rows=1000), fs
    return RocksStore(str(tmp_path / "db"), fs, ["key"], SCHEMA.names, fresh=True), fs


def batch(store, fs, processor, now: int, rows: dict | None, *, ttl: int | None = None,
          watermark: int | None = None, out=OUT) -> _Batch:
    run = _Batch({"processing_time_ms": now, "operator": "op", "ttl_ms": ttl,
                  "watermark_ms": watermark}, _Task(), store, processor, SCHEMA, fs, out,
                 ["key"], isinstance(processor, VectorizedProcessor))
    if rows:
        n = len(next(iter(rows.values())))
        data = pa.table({"_kg": pa.array([1] * n, pa.int32()), **rows})
        run.process(data)
    run.fire_timers()
    return run


def state_of(store) -> dict:
    return {r["key"]: (r["a"], r["b"]) for r in store.snapshot().to_pylist()}


class WriteAB(KeyedProcessor):
    """Writes a (and b, when the rows say so)."""

    def process(self, key, rows, ctx):
        ctx.value("a").update(int(rows["v"].sum()))
        if rows["with_b"].any():
            ctx.value("b").update(1)


class WriteABVec(VectorizedProcessor):
    def process_batch(self, batch):
        a = np.add.reduceat(batch.rows["v"].to_numpy("int64"), batch.offsets[:-1])
        with_b = np.logical_or.reduceat(batch.rows["with_b"].to_numpy(bool), batch.offsets[:-1])
        if with_b.all():
            return Result(state=pd.DataFrame({"a": a, "b": np.ones(len(batch), "int64")}))
        return Result(state=pd.DataFrame({"a": a}))  # b is not written: keeps its deadline


@pytest.mark.parametrize("api", ["per_key", "vectorized"])
@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_ttl_expires_each_variable_from_its_own_last_write(api, backend, tmp_path):
    store, fs = store_for(backend, tmp_path)
    proc = WriteAB() if api == "per_key" else WriteABVec()
    batch(store, fs, proc, 0, {"key": [7], "v": [5], "with_b": [True]}, ttl=100)
    batch(store, fs, proc, 90, {"key": [7], "v": [6], "with_b": [False]}, ttl=100)
    assert state_of(store) == {7: (6, 1)}
    # at 150, b (written at 0) has expired; a (written at 90) lives until 190
    batch(store, fs, proc, 150, None, ttl=100)
    assert state_of(store) == {7: (6, None)}
    batch(store, fs, proc, 190, None, ttl=100)
    assert state_of(store) == {}  # the key is gone, its TTL timers with it
    assert store.due(10**12).num_rows == 0
    store.close()


class WriteThenClear(KeyedProcessor):
    def process(self, key, rows, ctx):
        ctx.value("a").update(1)
        ctx.timers.register_processing_time(ctx.processing_time_ms)

    def on_timer(self, key, timer_ms, ctx):
        ctx.clear()


class WriteThenClearVec(VectorizedProcessor):
    def process_batch(self, batch):
        return Result(state=pd.DataFrame({"a": np.ones(len(batch), "int64")}),
                      processing_timers=np.full(len(batch), batch.processing_time_ms))

    def on_timers(self, batch):
        return Result(state=pd.DataFrame({"a": [None] * len(batch), "b": [None] * len(batch)}))


@pytest.mark.parametrize("api", ["per_key", "vectorized"])
def test_a_key_written_then_cleared_in_one_batch_has_one_changelog_row(api, tmp_path):
    from spark_ckpt.state.process_task import _last_per_key

    store, fs = store_for("memory", tmp_path)
    proc = WriteThenClear() if api == "per_key" else WriteThenClearVec()
    run = batch(store, fs, proc, 1000, {"key": [1, 2], "v": [0, 0], "with_b": [False, False]})
    assert len(run.changes) == 2  # the rows' write, then the timer's
    changelog = _last_per_key(pa.concat_tables(run.changes), ["key"])
    assert sorted(changelog.column("key").to_pylist()) == [1, 2]
    assert changelog.column("a").to_pylist() == [None, None]  # the last row: cleared
    assert state_of(store) == {}


class EchoKey(KeyedProcessor):
    def process(self, key, rows, ctx):
        yield (key[0], len(rows))


def test_a_nan_key_reaches_the_processor_as_nan(tmp_path):
    store, fs = store_for("memory", tmp_path, key_type=pa.float64())
    out = pa.schema([("key", pa.float64()), ("n", pa.int64())])
    run = batch(store, fs, EchoKey(), 0, {"key": [float("nan"), 1.0, float("nan")],
                                          "v": [1, 2, 3], "with_b": [False] * 3}, out=out)
    rows = sorted(run.output().to_pylist(), key=lambda r: r["n"])
    assert rows[0] == {"key": 1.0, "n": 1} and math.isnan(rows[1]["key"]) and rows[1]["n"] == 2


class KeepBig(VectorizedProcessor):
    def process_batch(self, batch):
        first = batch.rows["v"].iloc[batch.offsets[:-1]].reset_index(drop=True)  # Int64
        return Result(state=pd.DataFrame({"a": first}),
                      emit=batch.keys.assign(a=batch.state["a"], b=batch.state["b"]))


def test_vectorized_state_keeps_integers_past_2_53_exact(tmp_path):
    store, fs = store_for("memory", tmp_path)
    big = 2**53 + 1
    batch(store, fs, KeepBig(), 0, {"key": [1, 2], "v": pa.array([big, None], pa.int64()),
                                    "with_b": [False, False]})
    assert state_of(store) == {1: (big, None)}  # key 2's null a: no state
    run = batch(store, fs, KeepBig(), 1, {"key": [1], "v": [3], "with_b": [False]})
    assert run.output().to_pylist() == [{"key": 1, "a": big, "b": None}]


class BadMask(VectorizedProcessor):
    def process_batch(self, batch):
        return Result(state=pd.DataFrame({"a": [1] * len(batch)}),
                      changed=pd.array([True] + [None] * (len(batch) - 1), dtype="boolean"))


def test_a_changed_mask_with_nulls_is_refused(tmp_path):
    from spark_ckpt import UserFunctionError

    store, fs = store_for("memory", tmp_path)
    with pytest.raises(UserFunctionError, match="Result.changed to be booleans"):
        batch(store, fs, BadMask(), 0, {"key": [1, 2], "v": [1, 2], "with_b": [False] * 2})


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_timers_before_1970_fire_in_both_backends(backend, tmp_path):
    store, fs = store_for(backend, tmp_path, ttl=False)
    rows = pa.Table.from_pydict({
        "_kg": [1, 1], "key": [1, 2], "a": [1, 2], "b": [None, None],
        "_timers": [[{"ms": -5, "kind": "event"}], [{"ms": 1000, "kind": "event"}]]},
        schema=fs)
    store.put(rows)
    assert store.due(100).column("key").to_pylist() == [1]
    assert store.rows == 2
    store.close()
