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
from spark_ckpt.state.store import int_values, integer_key, open_rocks, rocks_options

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

    def __init__(self, path: str, *, fresh: bool, wal: bool = True) -> None:
        self.path = path
        self.db = open_rocks(path, fresh=fresh, wal=wal)
        raw = self.db.get(TOKEN_KEY)
        self.token: str | None = raw.decode() if raw else None

    def _batch(self) -> Any:
        from rocksdict import WriteBatch

        return WriteBatch(raw_mode=True)

    def close(self) -> None:
        self.db.close()  # flushes the memtable (written without a WAL) first


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


# -- the local copy's encoding ----------------------------------------------------------------
# Format 1 (no FORMAT_KEY): key = key group (2 bytes, big-endian) + the key as JSON, row = JSON
# list of the state values, each through Python. Format 2 (FORMAT_KEY names it with its
# layout): one integer key column as fixed bytes, key group (2 bytes) + 1 (0 for the null key)
# + the value as 8 big-endian bytes with the sign bit flipped (bytes sort as the keys do),
# other keys as in format 1; rows of fixed-width columns (integers, floats, booleans: every
# count, sum, mean, min/max of numbers and timestamps, first/last of them) as one packed
# record, a validity byte and the little-endian value per column, encoded and decoded for a
# whole batch at once in numpy; rows with a string column as JSON, as in format 1. A copy
# keeps the format it was written in (format 1 copies still read and update); a copy rebuilt
# from the durable chain is written in format 2.
FORMAT_KEY = b"\xfe__format__"
ROCKS_FORMAT = 2
# format 2, integer keys: per key group the smallest and largest key the copy holds (int64
# little-endian, all the lows then all the highs), written with every change: a key outside
# its group's bounds is new without a lookup (keys that grow, as ids do, need none)
BOUNDS_KEY = b"\xfe__bounds__"
_INT_KEY = np.dtype([("g", ">u2"), ("z", "u1"), ("k", ">u8")])
_I64 = np.iinfo(np.int64)
_FLIP = np.uint64(1 << 63)
_CHUNK = 1 << 20  # rows per step of a bulk load or a snapshot (bounds the Python objects)


def _row_dtype(columns: Sequence[tuple[str, str, pa.DataType]]) -> np.dtype | None:
    """The packed record of a row, or None when a column has no fixed width (JSON rows)."""
    fields: list[tuple[str, Any]] = []
    for i, (_n, _k, t) in enumerate(columns):
        if pa.types.is_boolean(t):
            np_t = np.dtype("?")
        elif pa.types.is_integer(t) or (pa.types.is_floating(t) and t.bit_width >= 32):
            np_t = np.dtype(t.to_pandas_dtype()).newbyteorder("<")
        else:
            return None
        fields += [(f"m{i}", "u1"), (f"v{i}", np_t)]
    return np.dtype(fields)


def _format_name(int_key: bool, row: np.dtype | None,
                 columns: Sequence[tuple[str, str, pa.DataType]]) -> bytes:
    layout = ",".join(f"{n}:{t}" for n, _k, t in columns)
    return (f"{ROCKS_FORMAT};keys={'int64' if int_key else 'json'};"
            f"rows={'packed' if row is not None else 'json'}({layout})").encode()


def _int_key_bytes(kg: np.ndarray, values: np.ndarray, nulls: np.ndarray) -> np.ndarray:
    rec = np.empty(len(values), dtype=_INT_KEY)
    rec["g"] = kg
    rec["z"] = ~nulls
    rec["k"] = np.where(nulls, 0, values).astype(np.int64).view(np.uint64) ^ _FLIP
    rec["k"][nulls] = 0
    return rec


class RocksAggState(_Rocks):
    """Aggregation state of one key-group range in RocksDB: key -> the row's state values
    (format 2: packed records for fixed-width columns; format 1: a JSON list)."""

    def __init__(self, path: str, key_names: Sequence[str], key_types: Sequence[pa.DataType],
                 columns: Sequence[tuple[str, str, pa.DataType]], *, fresh: bool) -> None:
        # no write-ahead log: the copy is a cache; a process killed before its memtable was
        # flushed leaves the copy at an earlier flushed version, whose token (written in the
        # same write batch as its rows) the driver no longer names, so it is rebuilt
        super().__init__(path, fresh=fresh, wal=False)
        self.key_names = list(key_names)
        self.key_types = list(key_types)
        self.columns = list(columns)
        raw = self.db.get(ROWS_KEY)  # written with the changes: exact, unlike RocksDB's estimate
        self._rows: int | None = int(raw) if raw else None  # None: counted when first needed
        int_key = len(self.key_names) == 1 and pa.types.is_integer(self.key_types[0])
        row = _row_dtype(self.columns)
        wanted = _format_name(int_key, row, self.columns)
        found = self.db.get(FORMAT_KEY)
        if found == b"1" or (found is None and self._written()):
            # a copy written in format 1: read and updated as it was written
            self.format, self.int_key, self.row = b"1", False, None
            found = b"1"
        elif found is None or found == wanted:
            self.format, self.int_key, self.row = wanted, int_key, row
        else:  # another layout: never read (rebuilt from the durable chain)
            self.format, self.int_key, self.row = wanted, int_key, row
            self.token = None
        self._format_written = found is not None
        # the key bounds (None: unknown, look every key up)
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None
        if self.int_key:
            bounds = self.db.get(BOUNDS_KEY)
            if bounds is not None:
                both = np.frombuffer(bounds, dtype="<i8").astype(np.int64)
                self._bounds = both[:len(both) // 2].copy(), both[len(both) // 2:].copy()
            elif found is None:  # an empty copy
                self._bounds = np.zeros(0, np.int64), np.zeros(0, np.int64)

    def _maybe_present(self, kg: np.ndarray, values: np.ndarray,
                       nulls: np.ndarray) -> np.ndarray:
        """The keys the copy may hold (the others are certainly new)."""
        if self._bounds is None:
            return np.ones(len(values), dtype=bool)
        lo, hi = self._bounds
        inside = kg < len(lo)
        maybe = nulls.copy()
        k, v = kg[inside], values[inside]
        maybe[inside] |= (v >= lo[k]) & (v <= hi[k])
        return maybe

    def _grown_bounds(self, kg: np.ndarray, values: np.ndarray,
                      nulls: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        if self._bounds is None:
            return None
        lo, hi = self._bounds
        k, v = kg[~nulls], values[~nulls]
        size = max(len(lo), int(k.max()) + 1 if len(k) else 0)
        new_lo = np.full(size, _I64.max, dtype=np.int64)
        new_hi = np.full(size, _I64.min, dtype=np.int64)
        new_lo[:len(lo)], new_hi[:len(hi)] = lo, hi
        np.minimum.at(new_lo, k, v)
        np.maximum.at(new_hi, k, v)
        return new_lo, new_hi

    @staticmethod
    def _bounds_bytes(bounds: tuple[np.ndarray, np.ndarray]) -> bytes:
        return bounds[0].astype("<i8").tobytes() + bounds[1].astype("<i8").tobytes()

    def _written(self) -> bool:
        """Whether the copy holds anything (a row, a count, a token, even an empty one)."""
        if self.db.get(TOKEN_KEY) is not None or self.db.get(ROWS_KEY) is not None:
            return True
        it = self.db.iter()
        it.seek_to_first()
        return bool(it.valid())

    # -- encoding ---------------------------------------------------------------------------
    def _raw_keys(self, table: pa.Table) -> list[bytes]:
        kgs = table.column(KG_COLUMN)
        if self.int_key:
            values, nulls = int_values(table.column(self.key_names[0]))
            kg = np.asarray(kgs.to_numpy(), dtype=np.int64)
            out: list[bytes] = _int_key_bytes(kg, values, nulls).view("V11").tolist()
            return out
        keys = _keys(table, self.key_names)
        if len(self.key_names) == 1 and pa.types.is_integer(self.key_types[0]):
            # JSON of a Python int is its str: the same bytes, without the encoder per key
            return [_KG(g) + (b"null" if k is None else str(k).encode())
                    for g, k in zip(kgs.to_pylist(), keys, strict=True)]
        return [_KG(g) + _ENCODE(k).encode() for g, k in zip(kgs.to_pylist(), keys, strict=True)]

    def _key_label(self, raw: bytes) -> str:
        if self.int_key:
            rec = np.frombuffer(raw, dtype=_INT_KEY)[0]
            return "null" if not rec["z"] else str(int((rec["k"] ^ _FLIP).view(np.int64)))
        return raw[2:].decode()

    def _decode_rows(self, found: Sequence[bytes | None]) -> dict[str, tuple[np.ndarray,
                                                                            np.ndarray]]:
        """Each column's (values, valid) of the stored rows (a missing row: all null)."""
        out = {}
        if self.row is not None:
            empty = bytes(self.row.itemsize)
            rec = np.frombuffer(b"".join([v if v is not None else empty for v in found]),
                                dtype=self.row)
            for i, (name, _k, t) in enumerate(self.columns):
                values = rec[f"v{i}"].astype(t.to_pandas_dtype())
                out[name] = values, rec[f"m{i}"].astype(bool)
            return out
        olds = [_decode(v) if v is not None else None for v in found]
        for i, (name, _kind, t) in enumerate(self.columns):
            out[name] = to_numpy(pa.array([o[i] if o is not None else None for o in olds],
                                          type=t))
        return out

    def _encode_rows(self, out: dict[str, tuple[np.ndarray, np.ndarray]],
                     arrays: Sequence[pa.Array]) -> list[bytes]:
        if self.row is not None:
            n = len(arrays[0]) if arrays else 0
            rec = np.zeros(n, dtype=self.row)
            for i, (name, _k, _t) in enumerate(self.columns):
                values, valid = out[name]
                rec[f"m{i}"] = valid
                rec[f"v{i}"] = np.where(valid, values, 0) if values.dtype != bool \
                    else values & valid
            rows: list[bytes] = rec.view(f"V{self.row.itemsize}").tolist()
            return rows
        columns = [a.to_pylist() for a in arrays]
        # a tuple encodes as the JSON list json.dumps gave
        return [_encode_row(row) for row in zip(*columns, strict=True)]

    def apply(self, table: pa.Table, *, replace: bool = False,
              token: str | None = None) -> pa.Table:
        if table.num_rows == 0 and token is None:
            return table
        raw_keys = self._raw_keys(table)
        if len(set(raw_keys)) != len(raw_keys):
            raise _twice(self._key_label(_repeated(raw_keys)))
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        new = {n: to_numpy(table.column(n).combine_chunks()) for n, _k, _t in self.columns}
        # a state with no key yet (the first batch, a rebuild) has nothing to look up, nor
        # has a key outside its key group's bounds
        bounds = None
        if self.int_key and raw_keys:
            values, nulls = int_values(table.column(self.key_names[0]))
            kg = np.asarray(table.column(KG_COLUMN).to_numpy(), dtype=np.int64)
            look = np.flatnonzero(self._maybe_present(kg, values, nulls)) if self.rows \
                else np.zeros(0, np.int64)
            found: list[bytes | None] = [None] * len(raw_keys)
            if len(look) == len(raw_keys):
                found = self.db.get(raw_keys)
            elif len(look):
                for i, value in zip(look.tolist(), self.db.get([raw_keys[i] for i in look]),
                                    strict=True):
                    found[i] = value
            bounds = self._grown_bounds(kg, values, nulls)
        else:
            found = self.db.get(raw_keys) if raw_keys and self.rows else [None] * len(raw_keys)
        added = sum(1 for v in found if v is None)  # keys new to the state: the exact count
        if replace:
            out = new
        else:
            old = self._decode_rows(found)
            for name, kind, _t in self.columns:
                ts = None
                if kind.endswith(("_value", "_ts")):
                    tname = f"{name.removesuffix('__ts')}__ts"
                    ts = (old[tname], new[tname])
                out[name] = merge(kind, old[name], new[name], ts)
        arrays = [pa.array(out[n][0], mask=~out[n][1], type=t) for n, _k, t in self.columns]
        wb = self._batch()
        put = wb.put
        for key, row in zip(raw_keys, self._encode_rows(out, arrays), strict=True):
            put(key, row)
        rows = self.rows + added
        if added or self.db.get(ROWS_KEY) is None:
            wb.put(ROWS_KEY, str(rows).encode())
        if not self._format_written:
            wb.put(FORMAT_KEY, self.format)
        if bounds is not None:
            wb.put(BOUNDS_KEY, self._bounds_bytes(bounds))
        if token is not None:
            wb.put(TOKEN_KEY, token.encode())
        self.db.write(wb)
        self._format_written = True
        self._rows = rows
        if bounds is not None:
            self._bounds = bounds
        return pa.Table.from_arrays(
            [table.column(KG_COLUMN).combine_chunks(),
             *[table.column(n).combine_chunks() for n in self.key_names], *arrays],
            names=[KG_COLUMN, *self.key_names, *[c[0] for c in self.columns]])

    def restore(self, tables: Sequence[pa.Table]) -> None:
        """Rebuild from a durable chain (a snapshot and changelogs, oldest first: a key's
        last row wins). Into an empty copy of format 2 with an integer key: every row at once,
        the last row of each key picked in numpy, the keys sorted, written into one SST file
        and ingested (no lookup, no write batch); otherwise one file after another."""
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return
        if not self.int_key or self.rows or self.row is None:
            for t in tables:
                self.apply(t, replace=True)
            return
        import os

        from rocksdict import IngestExternalFileOptions, SstFileWriter

        names = [KG_COLUMN, *self.key_names, *[c[0] for c in self.columns]]
        table = pa.concat_tables([t.select(names) for t in tables]) if len(tables) > 1 \
            else tables[0].select(names)
        values, nulls = int_values(table.column(self.key_names[0]))
        kg = np.asarray(table.column(KG_COLUMN).to_numpy(), dtype=np.int64)
        keys = _int_key_bytes(kg, values, nulls)
        del values, nulls, kg
        # stable: a key's rows stay in chain order, so the last of each run is its newest
        order = np.lexsort((keys["k"], keys["z"], keys["g"]))
        keys = keys[order]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        order, keys = order[last], keys[last]
        sst = os.path.join(self.path, f"restore-{os.getpid()}.sst")
        writer = SstFileWriter(options=rocks_options())
        writer.open(sst)
        for lo in range(0, len(order), _CHUNK):
            part = table.take(pa.array(order[lo:lo + _CHUNK]))
            cols = {n: to_numpy(part.column(n).combine_chunks()) for n, _k, _t in self.columns}
            arrays = [pa.array(cols[n][0], mask=~cols[n][1], type=t)
                      for n, _k, t in self.columns]
            raw_keys = keys[lo:lo + _CHUNK].view("V11").tolist()
            for key, row in zip(raw_keys, self._encode_rows(cols, arrays), strict=True):
                writer[key] = row
        writer.finish()
        ingest = IngestExternalFileOptions()
        ingest.set_move_files(True)
        self.db.ingest_external_file([sst], ingest)
        if os.path.exists(sst):
            os.unlink(sst)
        nulls = keys["z"] == 0
        bounds = self._grown_bounds(keys["g"].astype(np.int64),
                                    (keys["k"] ^ _FLIP).view(np.int64), nulls)
        wb = self._batch()
        wb.put(ROWS_KEY, str(len(order)).encode())
        wb.put(FORMAT_KEY, self.format)
        if bounds is not None:
            wb.put(BOUNDS_KEY, self._bounds_bytes(bounds))
        self.db.write(wb)
        self._format_written = True
        self._rows = len(order)
        self._bounds = bounds

    def set_token(self, token: str) -> None:
        self.db.put(TOKEN_KEY, token.encode())
        self.token = token

    def _chunks(self) -> Iterator[tuple[list[bytes], list[bytes]]]:
        """The rows (not the token, count or timers), in key order, a chunk at a time."""
        from rocksdict import ReadOptions

        bound = ReadOptions()
        bound.set_iterate_upper_bound(b"\xfe")  # the data keys' key groups sort below it
        keys: list[bytes] = []
        values: list[bytes] = []
        for key, value in self.db.items(read_opt=bound):
            keys.append(key)
            values.append(value)
            if len(keys) == _CHUNK:
                yield keys, values
                keys, values = [], []
        if keys:
            yield keys, values

    @property
    def rows(self) -> int:
        if self._rows is None:  # a copy written before the count was kept: count it once
            self._rows = sum(len(k) for k, _v in self._chunks())
        return self._rows

    def snapshot(self) -> pa.Table:
        names = [KG_COLUMN, *self.key_names, *[c[0] for c in self.columns]]
        parts = []
        for raw_keys, raw_values in self._chunks():
            if self.int_key:
                rec = np.frombuffer(b"".join(raw_keys), dtype=_INT_KEY)
                values = (rec["k"] ^ _FLIP).view(np.int64)
                key_arrays = [pa.array(values, mask=rec["z"] == 0).cast(self.key_types[0])]
                kg = pa.array(rec["g"].astype(np.int32))
            else:
                kgs, keys = [], []
                for key in raw_keys:
                    kgs.append(struct.unpack(">H", key[:2])[0])
                    k = _decode(key[2:])
                    keys.append(tuple(k) if isinstance(k, list) else k)
                key_arrays = _key_arrays(keys, self.key_names, self.key_types)
                kg = pa.array(kgs, type=pa.int32())
            if self.row is not None:
                cols = self._decode_rows(raw_values)
                arrays = [pa.array(cols[n][0], mask=~cols[n][1], type=t)
                          for n, _k, t in self.columns]
            else:
                rows = [_decode(v) for v in raw_values]
                arrays = [pa.array([v[i] for v in rows], type=t)
                          for i, (_n, _k, t) in enumerate(self.columns)]
            parts.append(pa.Table.from_arrays([kg, *key_arrays, *arrays], names=names))
        if not parts:
            schema = pa.schema([pa.field(KG_COLUMN, pa.int32()),
                                *[pa.field(n, t) for n, t in zip(self.key_names, self.key_types,
                                                                 strict=True)],
                                *[pa.field(n, t) for n, _k, t in self.columns]])
            return schema.empty_table()
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]
