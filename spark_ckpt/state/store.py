"""Typed state stores: a processor's key-group range, one row per key, in Arrow columns.

Both backends hold rows of the range's *file schema* (``_kg``, the key columns, one column per
declared state variable, ``_timers`` and, with a time-to-live, ``_expires``; see schema.py) and
answer the same calls, a batch at a time:

* ``fetch(keys)``: the rows of these keys, aligned with them (a null row for a key with no state);
* ``put(rows, keys)``: the new rows of these keys; a row with no variable and no timer deletes
  its key (later rows of a key win, so a changelog replays by putting its rows in order);
* ``due(limit_ms)``: the rows with a timer at or before ``limit_ms``;
* ``snapshot()``: every row.

``MemoryStore`` keeps the rows as one Arrow table that grows by a chunk per ``put`` plus a dict
from key to row; rows a later ``put`` replaces are dropped when they outnumber the live ones
(compaction), so a batch costs a few Arrow operations on its own rows, whatever their types.
``RocksStore`` keeps one RocksDB entry per key (the key group and the key as JSON -> the row's
state as JSON, typed back through schema.json_unsafe) and an index entry per timer, for state
larger than memory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_ckpt.errors import StateTooLargeError
from spark_ckpt.state.schema import TIMERS_COLUMN, json_safe, json_unsafe

__all__ = ["MemoryStore", "RocksStore", "empty_rows", "int_values", "integer_key", "key_tuples",
           "next_timers", "open_rocks", "rocks_options", "user_key"]

NO_TIMER = np.iinfo(np.int64).max
_NAN = ("spark_ckpt", "NaN")  # NaN keys are one key, as in Spark's grouping
TOKEN_KEY = b"\xfe__token__"
ROWS_KEY = b"\xfe__rows__"  # the exact number of keys (RocksDB's estimate counts timers too)
TIMER_PREFIX = b"\xff"
# processing-time timers indexed again by time: the earliest is one seek away (local to a
# store: rebuilt with it from the state files, never in a checkpoint)
PROCESSING_PREFIX = b"\xfe\x00"
PROCESSING_INDEXED = b"\xfe__processing_index__"  # a store whose every put indexed them


def _timer_key(ms: int, raw_key: bytes) -> bytes:
    """A timer's index entry: the time with its sign bit flipped, so that the bytes sort as
    the times do (times before 1970 first)."""
    return TIMER_PREFIX + struct.pack(">Q", (int(ms) + (1 << 63)) & 0xFFFFFFFFFFFFFFFF) + raw_key


def _processing_key(ms: int, raw_key: bytes) -> bytes:
    return PROCESSING_PREFIX + _timer_key(ms, raw_key)[1:]


def _timer_ms(raw: bytes) -> int:
    biased: int = struct.unpack(">Q", raw[1:9])[0]
    return biased - (1 << 63)


def key_tuples(table: pa.Table, names: Sequence[str]) -> list[tuple[Any, ...]]:
    """Each row's key as a tuple of Python values (NaN as one value)."""
    columns = []
    for name in names:
        col = table.column(name)
        values = col.to_pylist()
        if pa.types.is_floating(col.type) and col.null_count < len(col) and \
                pc.any(pc.is_nan(col)).as_py():
            values = [_NAN if (v is not None and v != v) else v for v in values]
        columns.append(values)
    return list(zip(*columns, strict=True)) if columns else []


def user_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key tuple as the user sees it (the NaN stand-in back to NaN)."""
    if _NAN in key:
        return tuple(float("nan") if v is _NAN else v for v in key)
    return key


def empty_rows(table: pa.Table, state_names: Sequence[str]) -> np.ndarray:
    """Rows with no variable (null, or an empty list or map) and no timer: deleted keys."""
    empty = np.ones(table.num_rows, dtype=bool)
    for name in (*state_names, TIMERS_COLUMN):
        col = table.column(name)
        present = pc.is_valid(col)
        if pa.types.is_map(col.type):
            col = col.cast(pa.list_(pa.struct([("key", col.type.key_type),
                                               ("value", col.type.item_type)])))
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            present = pc.and_(present, pc.greater(pc.fill_null(pc.list_value_length(col), 0), 0))
        empty &= ~np.asarray(present.to_numpy(zero_copy_only=False), dtype=bool)
    return empty


def next_timers(timers: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The earliest timer of each row, and its earliest processing-time timer (``NO_TIMER``
    where it has none), from one pass over the timers."""
    if isinstance(timers, pa.ChunkedArray):
        timers = timers.combine_chunks()
    out = np.full(len(timers), NO_TIMER, dtype=np.int64)
    processing = out.copy()
    if len(timers) == 0 or timers.null_count == len(timers):
        return out, processing
    lengths = np.asarray(pc.fill_null(pc.list_value_length(timers), 0).to_numpy(), np.int64)
    has = lengths > 0
    if not has.any():
        return out, processing
    flat = pc.list_flatten(timers)
    ms = np.asarray(pc.struct_field(flat, "ms").to_numpy(zero_copy_only=False), dtype=np.int64)
    other = np.asarray(pc.fill_null(pc.not_equal(pc.struct_field(flat, "kind"), "processing"),
                                    True).to_numpy(zero_copy_only=False), dtype=bool)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[has]
    if len(ms):
        out[has] = np.minimum.reduceat(ms, starts)
        processing[has] = np.minimum.reduceat(np.where(other, NO_TIMER, ms), starts)
    return out, processing


def integer_key(schema: pa.Schema, key_names: Sequence[str]) -> bool:
    """Whether the key is one integer column: such keys are looked up in numpy and pandas
    (hash tables in C) instead of a dict of Python tuples."""
    return len(key_names) == 1 and pa.types.is_integer(schema.field(key_names[0]).type)


def int_values(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """An integer column as int64 values (nulls as 0) and its null flags."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    nulls = np.asarray(column.is_null().to_numpy(zero_copy_only=False), dtype=bool) \
        if column.null_count else np.zeros(len(column), dtype=bool)
    values = np.asarray(column.fill_null(0).cast(pa.int64()).to_numpy(), dtype=np.int64)
    return values, nulls


def rocks_options() -> Any:
    """The options of every local RocksDB copy (also those of the SST files a restore writes
    for it): raw bytes, Bloom filters, large write buffers."""
    from rocksdict import BlockBasedOptions, Options

    options = Options(raw_mode=True)
    options.create_if_missing(True)
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)  # a key new to the state is mostly told by the filter
    options.set_block_based_table_factory(table)
    options.set_write_buffer_size(128 << 20)
    options.set_max_write_buffer_number(3)
    options.set_target_file_size_base(128 << 20)
    return options


def open_rocks(path: str, *, fresh: bool, wal: bool = True) -> Any:
    """A RocksDB on the executor's local disk (``fresh``: emptied first; ``wal=False``: writes
    skip the write-ahead log, for a copy whose every version carries its own token)."""
    from rocksdict import Rdict, WriteOptions

    if fresh and os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    db = Rdict(path, options=rocks_options())
    if not wal:
        writes = WriteOptions()
        setattr(writes, "disable_wal", True)  # a property (the stub says a method)  # noqa: B010
        db.set_write_options(writes)
    return db


class MemoryStore:
    """A range's rows in the Python worker.

    The rows are one Arrow table growing by a chunk per ``put``, a ``live`` mask (a row
    replaced by a later one, or deleted, is dead) and an index from key to row: for one integer
    key column, the keys in a numpy array and a pandas index over the live ones (rebuilt after a
    ``put``); for any other key, a dict of key tuples.
    """

    backend = "memory"

    def __init__(self, schema: pa.Schema, key_names: Sequence[str],
                 state_names: Sequence[str], *, max_rows: int) -> None:
        self.schema = schema
        self.key_names = list(key_names)
        self.state_names = list(state_names)
        self.max_rows = max_rows
        self.value_names = [n for n in schema.names if n != "_kg" and n not in self.key_names]
        self.token: str | None = None
        self.integer = integer_key(schema, self.key_names)
        self.index: dict[tuple[Any, ...], int] = {}
        self.table = schema.empty_table()
        self.live = np.zeros(0, dtype=bool)
        self.next_ms = np.zeros(0, dtype=np.int64)
        self.next_processing = np.zeros(0, dtype=np.int64)  # each row's first processing timer
        # integer keys: the key of every row (nulls as 0, flagged), and the live rows' index
        self.int_keys = np.zeros(0, dtype=np.int64)
        self.null_keys = np.zeros(0, dtype=bool)
        self._lookup: tuple[Any, np.ndarray, int] | None = None
        self._live_count = 0

    @property
    def rows(self) -> int:
        return self._live_count if self.integer else len(self.index)

    def _combined(self) -> pa.Table:
        if self.table.column(0).num_chunks > 1:
            self.table = self.table.combine_chunks()
        return self.table

    # -- integer keys -------------------------------------------------------------------------
    @staticmethod
    def _ints(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
        return int_values(column)

    def _positions(self, values: np.ndarray, nulls: np.ndarray) -> np.ndarray:
        """Row of each key among the live rows (-1: none)."""
        import pandas as pd

        if self._lookup is None:
            live_rows = np.flatnonzero(self.live & ~self.null_keys)
            null_live = np.flatnonzero(self.live & self.null_keys)
            self._lookup = (pd.Index(self.int_keys[live_rows]), live_rows,
                            int(null_live[0]) if len(null_live) else -1)
        index, live_rows, null_row = self._lookup
        found = index.get_indexer(values) if len(live_rows) else \
            np.full(len(values), -1, dtype=np.int64)
        positions = np.full(len(values), -1, dtype=np.int64)
        hit = found >= 0
        positions[hit] = live_rows[found[hit]]
        if nulls.any():
            positions[nulls] = null_row
        return positions

    def _put_integer(self, rows: pa.Table, empty: np.ndarray) -> None:
        import pandas as pd

        values, nulls = self._ints(rows.column(self.key_names[0]))
        old = self._positions(values, nulls)
        self.live[old[old >= 0]] = False
        # a key twice in ``rows``: only its last row counts (the null key apart from the rest)
        last = np.ones(len(values), dtype=bool)
        if len(values) > 1:
            real = np.flatnonzero(~nulls)
            last[real] = ~pd.Index(values[real]).duplicated(keep="last")
            null_rows = np.flatnonzero(nulls)
            last[null_rows[:-1]] = False
        fresh = last & ~empty
        self.live = np.concatenate([self.live, fresh])
        self.int_keys = np.concatenate([self.int_keys, values])
        self.null_keys = np.concatenate([self.null_keys, nulls])
        self._lookup = None
        self._live_count = int(self.live.sum())

    # -- the store's calls --------------------------------------------------------------------
    def fetch(self, key_table: pa.Table) -> pa.Table:
        """The value columns (variables, timers, expiries) of the keys in ``key_table``,
        aligned with them (a null row for a key with no state)."""
        if self.integer:
            positions = self._positions(*self._ints(key_table.column(self.key_names[0])))
            taken = pa.array(positions, pa.int64(), mask=positions < 0)
        else:
            get = self.index.get
            taken = pa.array([get(k) for k in key_tuples(key_table, self.key_names)],
                             pa.int64())
        return self._combined().select(self.value_names).take(taken)

    def put(self, rows: pa.Table) -> None:
        """The new rows of their keys; a row with no variable and no timer deletes its key."""
        if rows.num_rows == 0:
            return
        rows = rows.select(self.schema.names).cast(self.schema)
        empty = empty_rows(rows, self.state_names)
        start = self.table.num_rows
        if self.integer:
            self._put_integer(rows, empty)
        else:
            keys = key_tuples(rows, self.key_names)
            empties = empty.tolist()
            index = self.index
            live = self.live
            for i, key in enumerate(keys):
                old = index.get(key)
                if old is not None and old < start:
                    live[old] = False
                if empties[i]:
                    index.pop(key, None)
                else:
                    index[key] = start + i
            fresh = np.zeros(len(keys), dtype=bool)  # only a key's last row in ``rows`` lives
            for key in keys:
                pos = index.get(key)
                if pos is not None and pos >= start:
                    fresh[pos - start] = True
            self.live = np.concatenate([live, fresh])
        first, processing = next_timers(rows.column(TIMERS_COLUMN))
        self.next_ms = np.concatenate([self.next_ms, first])
        self.next_processing = np.concatenate([self.next_processing, processing])
        self.table = pa.concat_tables([self.table, rows])
        if self.rows > self.max_rows:
            raise StateTooLargeError(
                f"the memory state backend holds at most spark.ckpt.state.memoryMaxRows="
                f"{self.max_rows} keys per task; this task's range needs {self.rows}. Use "
                "spark.ckpt.state.backend=rocksdb (state on local disk) or raise the keyed "
                "operator's parallelism"
            )

    def compact(self) -> None:
        """Drop replaced and deleted rows when they outnumber the live ones."""
        if self.table.num_rows <= 2 * self.rows + 4096:
            return
        keep = np.flatnonzero(self.live)
        self.table = self._combined().take(pa.array(keep, pa.int64()))
        self.next_ms = self.next_ms[keep]
        self.next_processing = self.next_processing[keep]
        if self.integer:
            self.int_keys = self.int_keys[keep]
            self.null_keys = self.null_keys[keep]
            self._lookup = None
        else:
            remap = np.full(len(self.live), -1, dtype=np.int64)
            remap[keep] = np.arange(len(keep))
            new_pos = remap.tolist()
            self.index = {k: new_pos[p] for k, p in self.index.items()}
        self.live = np.ones(len(keep), dtype=bool)

    def due(self, limit_ms: int) -> pa.Table:
        positions = np.flatnonzero(self.live & (self.next_ms <= limit_ms))
        return self._combined().take(pa.array(positions, pa.int64()))

    def next_processing_ms(self) -> int | None:
        """The earliest processing-time timer of any key (None: there is none)."""
        live = self.next_processing[self.live]
        first = int(live.min()) if len(live) else NO_TIMER
        return None if first == NO_TIMER else first

    def snapshot(self) -> pa.Table:
        self.compact()
        return self._combined().take(pa.array(np.flatnonzero(self.live), pa.int64()))

    def load(self, tables: list[pa.Table] | pa.Table) -> None:
        """Rebuild from a snapshot and changelogs, oldest first (or a spilled snapshot)."""
        for table in [tables] if isinstance(tables, pa.Table) else tables:
            for start in range(0, table.num_rows, 1_000_000):
                self.put(table.slice(start, 1_000_000))
        self.compact()

    def close(self) -> None:
        """Nothing to release."""


def _kg_key(kg: int, key_json: str) -> bytes:
    return struct.pack(">H", kg) + key_json.encode()


class RocksStore:
    """A range's rows in RocksDB on the executor's local disk: ``kg + key JSON`` -> the row's
    state as a JSON list; ``0xff + time + kg + key JSON`` for each timer."""

    backend = "rocksdb"

    def __init__(self, path: str, schema: pa.Schema, key_names: Sequence[str],
                 state_names: Sequence[str], *, fresh: bool) -> None:
        self.path = path
        self.schema = schema
        self.key_names = list(key_names)
        self.state_names = list(state_names)
        self.value_names = [n for n in schema.names if n != "_kg" and n not in self.key_names]
        self.db = open_rocks(path, fresh=fresh)
        raw = self.db.get(TOKEN_KEY)
        self.token: str | None = raw.decode() if raw else None
        count = self.db.get(ROWS_KEY)
        self._rows = int(count.decode()) if count else 0
        if self.db.get(PROCESSING_INDEXED) is None:  # a new store, or one kept from a
            self._index_processing()                  # version without the index: built once

    @property
    def rows(self) -> int:
        return self._rows

    def _raw_keys(self, table: pa.Table) -> list[bytes]:
        kgs = table.column("_kg").to_pylist()
        columns = []
        for n in self.key_names:
            column = table.column(n)
            if pa.types.is_floating(column.type):  # -0.0 is 0.0, as in Spark's grouping
                column = pc.if_else(pc.equal(column, 0.0), pa.scalar(0.0, column.type), column)
            columns.append(json_safe(column))
        return [_kg_key(g, json.dumps(list(k), separators=(",", ":"), allow_nan=True))
                for g, k in zip(kgs, zip(*columns, strict=True), strict=True)]

    def _decode(self, raws: list[bytes | None]) -> pa.Table:
        """Value columns of the stored rows (a null row where there is none)."""
        values = [json.loads(r) if r is not None else None for r in raws]
        arrays = []
        for i, name in enumerate(self.value_names):
            column = [v[i] if v is not None else None for v in values]
            arrays.append(json_unsafe(column, self.schema.field(name).type))
        return pa.Table.from_arrays(arrays, schema=pa.schema(
            [self.schema.field(n) for n in self.value_names]))

    def fetch(self, key_table: pa.Table) -> pa.Table:
        """The value columns of the keys in ``key_table`` (``_kg`` and the key columns)."""
        raw_keys = self._raw_keys(key_table)
        return self._decode(self.db.get(raw_keys) if raw_keys else [])

    def put(self, rows: pa.Table, token: str | None = None) -> None:
        from rocksdict import WriteBatch

        wb = WriteBatch(raw_mode=True)
        count = self._rows
        if rows.num_rows:
            rows = rows.select(self.schema.names).cast(self.schema)
            raw_keys = self._raw_keys(rows)
            empty = empty_rows(rows, self.state_names)
            olds = self.db.get(raw_keys)
            timer_at = self.value_names.index(TIMERS_COLUMN)
            columns = [json_safe(rows.column(n)) for n in self.value_names]
            written: dict[bytes, list[Any] | None] = {}
            for i, raw_key in enumerate(raw_keys):
                old = written[raw_key] if raw_key in written else \
                    (json.loads(olds[i]) if olds[i] is not None else None)
                for t in (old[timer_at] or []) if old is not None else []:
                    wb.delete(_timer_key(t["ms"], raw_key))
                    if t.get("kind") == "processing":
                        wb.delete(_processing_key(t["ms"], raw_key))
                if empty[i]:
                    wb.delete(raw_key)
                    written[raw_key] = None
                    count -= old is not None
                    continue
                count += old is None
                value = [c[i] for c in columns]
                wb.put(raw_key, json.dumps(value, separators=(",", ":")).encode())
                for t in value[timer_at] or []:
                    wb.put(_timer_key(t["ms"], raw_key), b"")
                    if t.get("kind") == "processing":
                        wb.put(_processing_key(t["ms"], raw_key), b"")
                written[raw_key] = value
            wb.put(ROWS_KEY, str(count).encode())
        if token is not None:
            wb.put(TOKEN_KEY, token.encode())
        self.db.write(wb)
        self._rows = count
        if token is not None:
            self.token = token

    def set_token(self, token: str) -> None:
        self.put(self.schema.empty_table(), token=token)

    def _rows_of(self, raw_keys: list[bytes]) -> pa.Table:
        """Whole rows (key group, keys, values) of stored keys."""
        kgs = [struct.unpack(">H", k[:2])[0] for k in raw_keys]
        key_values = [json.loads(k[2:]) for k in raw_keys]
        arrays = [pa.array(kgs, pa.int32())]
        for i, name in enumerate(self.key_names):
            arrays.append(json_unsafe([k[i] for k in key_values], self.schema.field(name).type))
        values = self._decode(self.db.get(raw_keys) if raw_keys else [])
        return pa.Table.from_arrays([*arrays, *values.columns], schema=self.schema)

    def due(self, limit_ms: int) -> pa.Table:
        keys: dict[bytes, None] = {}
        it = self.db.iter()
        it.seek(TIMER_PREFIX)
        while it.valid():
            raw = it.key()
            if not raw.startswith(TIMER_PREFIX) or _timer_ms(raw) > limit_ms:
                break
            keys[raw[9:]] = None
            it.next()
        return self._rows_of(list(keys))

    def _index_processing(self, chunk: int = 10_000) -> None:
        """Index the processing-time timers of the rows the store holds (their times are in
        the timer index; their kinds in the rows), then mark the store indexed."""
        from rocksdict import WriteBatch

        timer_at = self.value_names.index(TIMERS_COLUMN)
        it = self.db.iter()
        it.seek(TIMER_PREFIX)
        raw_keys: list[bytes] = []
        while True:
            done = not it.valid() or not it.key().startswith(TIMER_PREFIX)
            if not done:
                raw_keys.append(it.key()[9:])
                it.next()
            if raw_keys and (done or len(raw_keys) >= chunk):
                wb = WriteBatch(raw_mode=True)
                unique = list(dict.fromkeys(raw_keys))
                for raw_key, raw in zip(unique, self.db.get(unique), strict=True):
                    value = json.loads(raw) if raw is not None else None
                    for t in (value[timer_at] or []) if value is not None else []:
                        if t.get("kind") == "processing":
                            wb.put(_processing_key(t["ms"], raw_key), b"")
                self.db.write(wb)
                raw_keys = []
            if done:
                break
        self.db.put(PROCESSING_INDEXED, b"1")

    def next_processing_ms(self) -> int | None:
        """The earliest processing-time timer of any key (None: there is none)."""
        it = self.db.iter()
        it.seek(PROCESSING_PREFIX)
        if not it.valid() or not it.key().startswith(PROCESSING_PREFIX):
            return None
        return _timer_ms(it.key()[1:])

    def snapshot(self, chunk: int = 200_000) -> pa.Table:
        parts = []
        it = self.db.iter()
        it.seek_to_first()
        raw_keys: list[bytes] = []
        while it.valid():
            raw = it.key()
            if raw[:1] in (b"\xfe", b"\xff"):
                break
            raw_keys.append(raw)
            if len(raw_keys) >= chunk:
                parts.append(self._rows_of(raw_keys))
                raw_keys = []
            it.next()
        parts.append(self._rows_of(raw_keys))
        return pa.concat_tables(parts)

    def load(self, tables: list[pa.Table]) -> None:
        for table in tables:
            for start in range(0, table.num_rows, 200_000):
                self.put(table.slice(start, 200_000), token="")

    def close(self) -> None:
        self.db.close()

