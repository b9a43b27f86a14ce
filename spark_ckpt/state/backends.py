"""State backends: where a task keeps its key-group range's state while it works on it.

Two backends with the trade-off of seeds 000/001:

* ``memory``: columns in numpy arrays and an index from key to slot, in the Python worker (a
  pandas index over a numpy array for one integer key column, a dict otherwise).
  Fast; bounded by ``spark.ckpt.state.memoryMaxRows`` rows per task, past which the task
  fails with :class:`~spark_ckpt.errors.StateTooLargeError` (use ``rocksdb``).
* ``rocksdb``: an embedded RocksDB (``rocksdict``) on the executor's local disk, for state
  larger than memory; reads and writes go through it, each batch's changes in one atomic
  ``WriteBatch`` together with the version token.

Either is only a *cache* of the durable state (a chain of Parquet snapshot and changelog files,
see chain.py): it carries a version ``token``, and a task uses it only when the token is the
one the driver expects; otherwise it rebuilds the range from the durable chain. Python tasks
get no locality in Spark, so the cache is a speed-up, never the truth.

These hold *aggregation rows* (key columns and fixed state columns, merged vectorially,
aggregates.py); a processor's typed state is in store.py.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from spark_ckpt.errors import InternalError, StateTooLargeError
from spark_ckpt.state.aggregates import merge, to_numpy
from spark_ckpt.state.keygroups import KG_COLUMN
from spark_ckpt.state.store import int_values, integer_key, open_rocks

__all__ = ["MemoryAggState", "RocksAggState"]

TOKEN_KEY = b"\xfe__token__"
ROWS_KEY = b"\xfe__rows__"  # the exact number of keys, in the same WriteBatch as the changes
TIMER_PREFIX = b"\xff"


def _keys(table: pa.Table, names: Sequence[str]) -> list[Any]:
    columns = [table.column(n).to_pylist() for n in names]
    return columns[0] if len(columns) == 1 else list(zip(*columns, strict=True))


def _key_arrays(keys: list[Any], names: Sequence[str],
                types: Sequence[pa.DataType]) -> list[pa.Array]:
    if len(names) == 1:
        return [pa.array(keys, type=types[0])]
    cols: list[Sequence[Any]] = list(zip(*keys, strict=True)) if keys else [[] for _ in names]
    return [pa.array(list(c), type=t) for c, t in zip(cols, types, strict=True)]


def _repeated(items: Sequence[Any]) -> Any:
    """The first item seen a second time."""
    seen: set[Any] = set()
    return next(k for k in items if k in seen or seen.add(k))  # type: ignore[func-returns-value]


def _twice(key: str) -> InternalError:
    return InternalError(f"internal error: expected one partial per key in a state update, "
                         f"found key {key} twice (no state was changed)")


class MemoryAggState:
    """Aggregation state of one key-group range in numpy arrays."""

    backend = "memory"

    def __init__(self, key_names: Sequence[str], key_types: Sequence[pa.DataType],
                 columns: Sequence[tuple[str, str, pa.DataType]], *, max_rows: int) -> None:
        self.key_names = list(key_names)
        self.key_types = list(key_types)
        self.columns = list(columns)  # (name, merge kind, internal arrow type)
        self.max_rows = max_rows
        self.token: str | None = None
        self.slots: dict[Any, int] = {}
        self.keys: list[Any] = []
        self.kg = np.zeros(0, dtype=np.int32)
        self.values: dict[str, np.ndarray] = {}
        self.valid: dict[str, np.ndarray] = {}
        # one integer key column: the keys in numpy (a null key flagged, its value 0) and a
        # pandas index over the non-null ones (hash tables in C, not a dict of Python ints)
        self.integer = integer_key(pa.schema([pa.field(n, t) for n, t in
                                              zip(self.key_names, self.key_types,
                                                  strict=True)]), self.key_names)
        self.n = 0
        self.int_keys = np.zeros(0, dtype=np.int64)
        self.null_keys = np.zeros(0, dtype=bool)
        # (main index, its slots, its end, (side index, its slots, its end) | None)
        self._index: tuple[Any, np.ndarray, int, Any] | None = None
        self.null_slot = -1

    @property
    def rows(self) -> int:
        return self.n if self.integer else len(self.keys)

    def _int_slots(self, column: pa.ChunkedArray, kg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import pandas as pd

        values, nulls = int_values(column)
        real = values[~nulls]
        if nulls.sum() > 1 or not pd.Index(real).is_unique:
            dup = "null" if nulls.sum() > 1 else \
                real[pd.Index(real).duplicated()][0].item()
            raise _twice(repr(dup))
        slots = self._int_lookup(values, nulls)
        fresh = np.flatnonzero(slots < 0)
        if len(fresh):
            start = self.n
            self._check_size(start + len(fresh))
            new_slots = np.arange(start, start + len(fresh))
            self._grow(start + len(fresh))
            self.int_keys[new_slots] = values[fresh]
            self.null_keys[new_slots] = nulls[fresh]
            self.kg[new_slots] = kg[fresh]
            self.n = start + len(fresh)
            slots[fresh] = new_slots
            if nulls[fresh].any():
                self.null_slot = int(new_slots[nulls[fresh]][0])
        return slots, fresh

    def _int_lookup(self, values: np.ndarray, nulls: np.ndarray) -> np.ndarray:
        """Slot of each key (-1: none). Two indexes over the non-null keys: the main one over
        slots ``[0, m)`` and a side one over the keys added since (``[m, n)``), so a batch
        that adds a few keys rebuilds only the side index; the main one is rebuilt when the
        side one outgrows an eighth of it."""
        import pandas as pd

        def build(lo: int, hi: int) -> tuple[Any, np.ndarray]:
            rows = lo + np.flatnonzero(~self.null_keys[lo:hi])
            return pd.Index(self.int_keys[rows]), rows

        n = self.n
        main_end = self._index[2] if self._index is not None else 0
        if self._index is None or n - main_end > max(main_end // 8, 65536):
            self._index = (*build(0, n), n, None)
            main_end = n
        main, main_rows, _m, side = self._index
        if side is None or side[2] != n:
            side = (*build(main_end, n), n)
            self._index = (main, main_rows, main_end, side)
        slots = np.full(len(values), -1, dtype=np.int64)
        for index, rows in ((main, main_rows), (side[0], side[1])):
            miss = np.flatnonzero(slots < 0)
            if not len(rows) or not len(miss):
                continue
            found = index.get_indexer(values[miss])
            hit = found >= 0
            slots[miss[hit]] = rows[found[hit]]
        slots[nulls] = self.null_slot  # -1 while the null key has no slot
        return slots

    def _check_size(self, rows: int) -> None:
        if rows > self.max_rows:
            raise StateTooLargeError(
                f"the memory state backend holds at most spark.ckpt.state.memoryMaxRows="
                f"{self.max_rows} keys per task; this task's range needs "
                f"{rows}. Use spark.ckpt.state.backend=rocksdb (state on local "
                "disk) or raise the parallelism of the keyed operator"
            )

    def _slots_for(self, keys: list[Any], kg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        get = self.slots.get
        slots = np.fromiter((get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        fresh = np.flatnonzero(slots < 0)
        if len({keys[i] for i in fresh}) != len(fresh) or \
                len(np.unique(slots[slots >= 0])) != len(slots) - len(fresh):
            raise _twice(repr(_repeated(keys)))
        if len(fresh):
            start = len(self.keys)
            self._check_size(start + len(fresh))
            new_slots = np.arange(start, start + len(fresh))
            for i, slot in zip(fresh.tolist(), new_slots.tolist(), strict=True):
                self.slots[keys[i]] = slot
                self.keys.append(keys[i])
            slots[fresh] = new_slots
            self._grow(start + len(fresh))
            self.kg[new_slots] = kg[fresh]
        return slots, fresh

    def _grow(self, n: int) -> None:
        if n <= len(self.kg):
            return
        cap = max(n, 2 * len(self.kg), 1024)
        self.kg = np.resize(self.kg, cap)
        if self.integer:
            self.int_keys = np.resize(self.int_keys, cap)
            self.null_keys = np.resize(self.null_keys, cap)
        for name, _kind, _t in self.columns:
            if name in self.values:
                old = self.values[name]
                grown = np.empty(cap, dtype=old.dtype)
                grown[:len(old)] = old
                self.values[name] = grown
                valid = np.zeros(cap, dtype=bool)
                valid[:len(old)] = self.valid[name][:len(old)]
                self.valid[name] = valid

    def _column(self, name: str, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.values:
            cap = len(self.kg)
            self.values[name] = np.zeros(cap, dtype=like.dtype) if like.dtype != object \
                else np.empty(cap, dtype=object)
            self.valid[name] = np.zeros(cap, dtype=bool)
        return self.values[name], self.valid[name]

    def apply(self, table: pa.Table, *, replace: bool = False) -> pa.Table:
        """Merge a batch's partials (or, ``replace``, durable rows) into the state; return the
        changed rows (the changelog) in internal types."""
        if table.num_rows == 0:
            return table
        kg = np.asarray(table.column(KG_COLUMN).to_numpy(), dtype=np.int32)
        slots, fresh = self._int_slots(table.column(self.key_names[0]), kg) if self.integer \
            else self._slots_for(_keys(table, self.key_names), kg)
        new = {name: to_numpy(table.column(name).combine_chunks())
               for name, _k, _t in self.columns}
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, kind, _t in self.columns:
            values, valid = self._column(name, new[name][0])
            if len(fresh):
                valid[slots[fresh]] = False
            if replace:
                out[name] = new[name]
                continue
            ts = None
            if kind.endswith(("_value", "_ts")):
                base = name.removesuffix("__ts")
                tname = f"{base}__ts"
                tv, tk = self._column(tname, new[tname][0])
                ts = ((tv[slots], tk[slots]), new[tname])
            out[name] = merge(kind, (values[slots], valid[slots]), new[name], ts)
        for name, (v, k) in out.items():
            self.values[name][slots] = v
            self.valid[name][slots] = k
        arrays = [pa.array(kg, type=pa.int32()),
                  *[table.column(n).combine_chunks() for n in self.key_names]]
        arrays += [pa.array(out[n][0], mask=~out[n][1], type=t) for n, _k, t in self.columns]
        return pa.Table.from_arrays(arrays, names=[KG_COLUMN, *self.key_names,
                                                   *[c[0] for c in self.columns]])

    def load(self, table: pa.Table) -> None:
        """Replace the whole state by ``table`` (a snapshot: one row per key), in bulk."""
        self._check_size(table.num_rows)
        if self.integer:
            values, nulls = int_values(table.column(self.key_names[0]))
            self.int_keys, self.null_keys = values.copy(), nulls.copy()
            self.n = len(values)
            self._index = None
            null_rows = np.flatnonzero(nulls)
            self.null_slot = int(null_rows[0]) if len(null_rows) else -1
        else:
            keys = _keys(table, self.key_names)
            self.keys = keys
            self.slots = dict(zip(keys, range(len(keys)), strict=True))
        self.kg = np.asarray(table.column(KG_COLUMN).to_numpy(), dtype=np.int32).copy()
        for name, _kind, _t in self.columns:
            values, valid = to_numpy(table.column(name).combine_chunks())
            self.values[name] = values.copy()
            self.valid[name] = valid.copy()

    def snapshot(self) -> pa.Table:
        n = self.rows
        if self.integer:
            keys = [pa.array(self.int_keys[:n], mask=self.null_keys[:n]).cast(self.key_types[0])]
        else:
            keys = _key_arrays(self.keys, self.key_names, self.key_types)
        arrays = [pa.array(self.kg[:n], type=pa.int32()), *keys]
        for name, _kind, t in self.columns:
            if name in self.values:
                arrays.append(pa.array(self.values[name][:n], mask=~self.valid[name][:n],
                                       type=t))
            else:
                arrays.append(pa.nulls(n, type=t))
        return pa.Table.from_arrays(arrays, names=[KG_COLUMN, *self.key_names,
                                                   *[c[0] for c in self.columns]])

    def close(self) -> None:
        """Nothing to release."""


class _Rocks:
    backend = "rocksdb"

    def __init__(self, path: str, *, fresh: bool) -> None:
        self.path = path
        self.db = open_rocks(path, fresh=fresh)
        raw = self.db.get(TOKEN_KEY)
        self.token: str | None = raw.decode() if raw else None

    def _batch(self) -> Any:
        from rocksdict import WriteBatch

        return WriteBatch(raw_mode=True)

    def close(self) -> None:
        self.db.close()


_KG = struct.Struct(">H").pack
# built once: json.dumps(..., separators=...) makes an encoder per call; the output is the same
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_ENCODE = _ENCODER.encode
_ITERENCODE = _ENCODER.iterencode
# the C scanner (not in typeshed): our values have no surrounding space
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _encode_row(row: tuple[Any, ...]) -> bytes:
    return "".join(_ITERENCODE(row, True)).encode()


def _decode(raw: bytes) -> Any:
    return _SCAN(raw.decode(), 0)[0]


class RocksAggState(_Rocks):
    """Aggregation state of one key-group range in RocksDB: key -> JSON list of state values."""

    def __init__(self, path: str, key_names: Sequence[str], key_types: Sequence[pa.DataType],
                 columns: Sequence[tuple[str, str, pa.DataType]], *, fresh: bool) -> None:
        super().__init__(path, fresh=fresh)
        self.key_names = list(key_names)
        self.key_types = list(key_types)
        self.columns = list(columns)
        raw = self.db.get(ROWS_KEY)  # written with the changes: exact, unlike RocksDB's estimate
        self._rows: int | None = int(raw) if raw else None  # None: counted when first needed

    def apply(self, table: pa.Table, *, replace: bool = False,
              token: str | None = None) -> pa.Table:
        if table.num_rows == 0 and token is None:
            return table
        keys = _keys(table, self.key_names)
        kgs = table.column(KG_COLUMN).to_pylist()
        if len(self.key_names) == 1 and pa.types.is_integer(self.key_types[0]):
            # JSON of a Python int is its str: the same bytes, without the encoder per key
            raw_keys = [_KG(g) + (b"null" if k is None else str(k).encode())
                        for g, k in zip(kgs, keys, strict=True)]
        else:
            raw_keys = [_KG(g) + _ENCODE(k).encode() for g, k in zip(kgs, keys, strict=True)]
        if len(set(raw_keys)) != len(raw_keys):
            raise _twice(_repeated(raw_keys)[2:].decode())
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        new = {n: to_numpy(table.column(n).combine_chunks()) for n, _k, _t in self.columns}
        found = self.db.get(raw_keys) if raw_keys else []
        added = sum(1 for v in found if v is None)  # keys new to the state: the exact count
        if replace:
            out = new
        else:
            olds = [_decode(v) if v is not None else None for v in found]
            old = {}
            for i, (name, _kind, t) in enumerate(self.columns):
                values = [o[i] if o is not None else None for o in olds]
                old[name] = to_numpy(pa.array(values, type=t))
            for name, kind, _t in self.columns:
                ts = None
                if kind.endswith(("_value", "_ts")):
                    tname = f"{name.removesuffix('__ts')}__ts"
                    ts = (old[tname], new[tname])
                out[name] = merge(kind, old[name], new[name], ts)
        arrays = [pa.array(out[n][0], mask=~out[n][1], type=t) for n, _k, t in self.columns]
        wb = self._batch()
        columns = [a.to_pylist() for a in arrays]
        put = wb.put
        for key, row in zip(raw_keys, zip(*columns, strict=True), strict=True):
            put(key, _encode_row(row))  # a tuple encodes as the JSON list json.dumps gave
        rows = self.rows + added
        if added or self.db.get(ROWS_KEY) is None:
            wb.put(ROWS_KEY, str(rows).encode())
        if token is not None:
            wb.put(TOKEN_KEY, token.encode())
        self.db.write(wb)
        self._rows = rows
        return pa.Table.from_arrays(
            [table.column(KG_COLUMN).combine_chunks(),
             *[table.column(n).combine_chunks() for n in self.key_names], *arrays],
            names=[KG_COLUMN, *self.key_names, *[c[0] for c in self.columns]])

    def set_token(self, token: str) -> None:
        self.db.put(TOKEN_KEY, token.encode())
        self.token = token

    def _items(self) -> Iterator[tuple[bytes, bytes]]:
        it = self.db.iter()
        it.seek_to_first()
        while it.valid():
            key = it.key()
            if key[:1] in (b"\xfe", b"\xff"):
                break
            yield key, it.value()
            it.next()

    @property
    def rows(self) -> int:
        if self._rows is None:  # a copy written before the count was kept: count it once
            self._rows = sum(1 for _ in self._items())
        return self._rows

    def snapshot(self) -> pa.Table:
        kgs, keys, values = [], [], []
        for key, value in self._items():
            kgs.append(struct.unpack(">H", key[:2])[0])
            k = _decode(key[2:])
            keys.append(tuple(k) if isinstance(k, list) else k)
            values.append(_decode(value))
        arrays = [pa.array(kgs, type=pa.int32()),
                  *_key_arrays(keys, self.key_names, self.key_types)]
        for i, (_n, _k, t) in enumerate(self.columns):
            arrays.append(pa.array([v[i] for v in values], type=t))
        return pa.Table.from_arrays(arrays, names=[KG_COLUMN, *self.key_names,
                                                   *[c[0] for c in self.columns]])
