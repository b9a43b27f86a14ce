"""The stateful task of a keyed processor: one per key-group range and batch, in a Python worker.

Per batch the task (see task.py for the parts shared with aggregations: cache, restore, the
changelog and snapshot files, the metadata row):

1. groups the batch's rows by key, in the order of each key's first row, keeping arrival order
   within a key (one dict pass over the keys and a stable argsort: no per-key slicing);
2. fetches the keys' state rows from the typed store in one call;
3. runs the processor: a ``KeyedProcessor`` once per key (a contiguous slice of one pandas
   frame, the key's values as plain Python values), a ``VectorizedProcessor`` once for every
   key; then writes the changed rows to the store in one ``put``;
4. fires the timers due (event time up to the watermark, processing time and TTL clean-ups up to
   the batch's time) the same way, and writes those changes;
5. fixes the version and writes the batch's output and changelog (task.py).

Time: ``time.perf_counter`` directly, not a :class:`~spark_ckpt.clock.Clock`: the task runs in
a Python worker, where no clock is injected, and only measures its own work for its metrics.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark_ckpt.state.evolution import evolve_table
from spark_ckpt.state.keygroups import KG_COLUMN, PID_COLUMN
from spark_ckpt.state.schema import (
    EXPIRES_COLUMN,
    STATE_FORMAT_TYPED,
    TIMERS_COLUMN,
    StateSchema,
)
from spark_ckpt.state.store import (
    MemoryStore,
    RocksStore,
    empty_rows,
    key_tuples,
    user_key,
)
from spark_ckpt.state.task import (
    CHANNEL_COLUMN,
    MARKER_COLUMN,
    SPLIT_COLUMN,
    _consume,
    _read,
    _Run,
    _user_call,
    _write,
)

if TYPE_CHECKING:
    from spark_ckpt.state.processor import KeyData

__all__ = ["processor_task", "schema_id"]

_INTERNAL = {KG_COLUMN, MARKER_COLUMN, CHANNEL_COLUMN, PID_COLUMN, SPLIT_COLUMN}


def schema_id(file_schema: pa.Schema, sources: dict[str, str] | None = None) -> str:
    """A short id of a state layout, the same in every process; with the renames a restore
    applies (``sources``), so that state built under a rename is never taken for state of the
    same layout built without it (locally cached copies are found by this id)."""
    digest = hashlib.sha256(file_schema.serialize().to_pybytes())
    for new, old in sorted((sources or {}).items()):
        digest.update(f"\0{new}\0{old}".encode())
    return digest.hexdigest()[:12]


def _typed(values: list[Any], field: pa.Field, keys: list[tuple[Any, ...]],
           operator: str) -> pa.Array:
    """An Arrow array of a variable's new values; a value of the wrong type names its key."""
    from spark_ckpt.errors import UserFunctionError

    try:
        return pa.array(values, field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        for i, v in enumerate(values):
            try:
                pa.array([v], field.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError,
                    OverflowError) as exc:
                raise UserFunctionError(
                    f"operator {operator}: state variable {field.name!r} of key {keys[i]!r}: "
                    f"expected a value of type {field.type}, found {type(v).__name__} "
                    f"{v!r:.200} ({exc})"
                ) from None
        raise


class _Grouped:
    """A batch's data rows grouped by key: group ids in the order of each key's first row
    (pandas' factorize for one integer key column, a dict of key tuples otherwise), and a
    stable argsort of them, which keeps arrival order within a key."""

    def __init__(self, data: pa.Table, key_names: list[str]) -> None:
        self.key_names = key_names
        column = data.column(key_names[0])
        self._keys: list[tuple[Any, ...]] | None = None
        if len(key_names) == 1 and pa.types.is_integer(column.type) and column.null_count == 0:
            import pandas as pd

            codes, _uniques = pd.factorize(column.to_numpy())
            gid = codes.astype(np.int64, copy=False)
            count = len(_uniques)
        else:
            keys = key_tuples(data, key_names)
            first: dict[tuple[Any, ...], int] = {}
            setdefault = first.setdefault
            gid = np.fromiter((setdefault(k, len(first)) for k in keys), dtype=np.int64,
                              count=len(keys))
            self._keys = list(first)
            count = len(first)
        self.order = np.argsort(gid, kind="stable")
        counts = np.bincount(gid, minlength=count)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.group = gid[self.order]
        first_rows = self.order[self.offsets[:-1]]
        self.key_table = data.select([KG_COLUMN, *key_names]).take(pa.array(first_rows))

    @property
    def keys(self) -> list[tuple[Any, ...]]:
        """Each key as a tuple of Python values (built on first use)."""
        if self._keys is None:
            self._keys = key_tuples(self.key_table, self.key_names)
        return self._keys


def processor_task(params: dict[str, Any], plans: dict[int, dict[str, Any]],
                   processor: Any) -> Any:
    """The mapInArrow function of a keyed processor (input: rows with _kg, plus marker rows)."""
    from spark_ckpt.state.processor import VectorizedProcessor

    key_names = list(params["keys"])
    out_schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(params["output_schema"])))
    schema = StateSchema.deserialize(params["state_schema"])
    key_schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(params["key_schema"])))
    ttl = params.get("ttl_ms")
    file_schema = schema.file_schema(list(key_schema), ttl=ttl is not None)
    params = {**params, "schema_id": schema_id(file_schema, params.get("state_sources"))}
    state_names = schema.names
    sources = dict(params.get("state_sources") or {})  # renamed variables: new -> old name
    event_time = params.get("event_time")
    vectorized = isinstance(processor, VectorizedProcessor)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        task = _Run(params, plans)
        table, align, channels = _consume(batches)
        task.check_input(table)

        def memory() -> MemoryStore:
            return MemoryStore(file_schema, key_names, state_names,
                               max_rows=int(params["memory_max_rows"]))

        store: MemoryStore | RocksStore | None = task.cached()
        ready = store is not None
        if store is None and params["backend"] == "memory":
            t0 = time.perf_counter()
            store = task.load_spill(memory)
            ready = store is not None
            task.metrics["local_load_ms"] = int((time.perf_counter() - t0) * 1000)
        if store is None and params["backend"] == "rocksdb":
            store, ready = task.open_rocks(lambda path, fresh: RocksStore(
                path, file_schema, key_names, state_names, fresh=fresh))
        if not ready:
            t0 = time.perf_counter()
            if store is None:
                store = memory()
            expires_of = state_names if params.get("rewrite") else None
            store.load([evolve_table(_read(f, task.range, STATE_FORMAT_TYPED), file_schema,
                                     sources, f"state file {f.path}", [KG_COLUMN, *key_names],
                                     expires_of=expires_of)
                        for f in task.chain])
            store.token = task.plan["token"]
            if isinstance(store, RocksStore):
                store.set_token(task.plan["token"] or "")
            task.metrics.update(restored=bool(task.chain),
                                restore_ms=int((time.perf_counter() - t0) * 1000))
        assert store is not None  # ready: a cached, spilled or opened store
        run = _Batch(params, task, store, processor, schema, file_schema, out_schema,
                     key_names, vectorized)
        t0 = time.perf_counter()
        rows_in, max_event = 0, None
        by_channel: dict[str, int] = {}
        by_split: dict[str, int] = {}
        if table is not None:
            data = table.filter(pc.invert(table.column(MARKER_COLUMN))) \
                if MARKER_COLUMN in table.column_names else table
            rows_in = data.num_rows
            if rows_in:
                if event_time and params.get("track_splits"):  # each input partition's
                    by_split = _max_event_by_split(data, event_time)  # (and from them, the
                    for key, top in by_split.items():               # inputs' and the max)
                        channel = key.split("|", 1)[0]
                        by_channel[channel] = max(top, by_channel.get(channel, top))
                    max_event = max(by_split.values(), default=None)
                    if CHANNEL_COLUMN not in data.column_names:
                        by_channel = {}
                elif event_time:
                    max_event = _max_event_ms(data.column(event_time))
                    if CHANNEL_COLUMN in data.column_names:  # each input's own watermark
                        by_channel = _max_event_by_channel(data, event_time)
                if SPLIT_COLUMN in data.column_names:
                    # one partition's rows after another's, the same on a replay (rows of
                    # several partitions arrive in the shuffle's order): a key's rows, and a
                    # window's partials, merge in that order
                    order = [(c, "ascending") for c in (CHANNEL_COLUMN, SPLIT_COLUMN)
                             if c in data.column_names]
                    data = data.take(pc.sort_indices(data, sort_keys=order,
                                                     null_placement="at_start"))
                    data = data.drop_columns([SPLIT_COLUMN])
                run.process(data)
        fired = run.fire_timers()
        apply_ms = int((time.perf_counter() - t0) * 1000)
        t1 = time.perf_counter()
        if isinstance(store, RocksStore):
            store.set_token(task.token)
        else:
            store.token = task.token
            store.compact()
        sync_ms = int((time.perf_counter() - t1) * 1000)
        out_file = None
        out = run.output()
        if out is not None and out.num_rows:
            uri, size = _write(out, f"{params['output_dir'].rstrip('/')}/b{task.batch:012d}",
                               f"{task.range.label}-{task.token}.parquet")
            out_file = {"path": uri, "rows": out.num_rows, "bytes": size}
        changelog = None if not run.changes else run.changes[0] if len(run.changes) == 1 \
            else _last_per_key(pa.concat_tables(run.changes), key_names)
        yield from task.finish(store, changelog, store.snapshot, file_schema, {
            "input_rows": rows_in, "changed": run.changed_keys, "apply_ms": apply_ms,
            "sync_ms": sync_ms, "alignment_ms": align, "channels": channels,
            "timers_fired": fired, "max_event_ms": max_event, "output": out_file,
            "max_event_by_channel": by_channel, "max_event_by_split": by_split,
            "next_processing_ms": store.next_processing_ms(),
            "user_ms": int(run.user_s * 1000), "counters": run.counters},
            fmt=STATE_FORMAT_TYPED)

    return run


def _last_per_key(rows: pa.Table, key_names: list[str]) -> pa.Table:
    """Each key's last row (a key written by the batch's rows and again by a timer): a
    changelog holds one row per key, so a reader's newest-row-per-key has one answer."""
    column = rows.column(key_names[0])
    if len(key_names) == 1 and pa.types.is_integer(column.type) and column.null_count == 0:
        import pandas as pd

        keep = ~pd.Index(column.to_numpy()).duplicated(keep="last")
    else:
        seen: set[tuple[Any, ...]] = set()
        keep = np.zeros(rows.num_rows, dtype=bool)
        keys = key_tuples(rows, key_names)
        for i in range(rows.num_rows - 1, -1, -1):
            if keys[i] not in seen:
                seen.add(keys[i])
                keep[i] = True
    return rows if keep.all() else rows.filter(pa.array(keep))


def _max_event_by_channel(data: pa.Table, event_time: str) -> dict[str, int]:
    """The largest event time of each input channel's rows (ms)."""
    out: dict[str, int] = {}
    channels = data.column(CHANNEL_COLUMN)
    for channel in pc.unique(channels).to_pylist():
        if channel is None:
            continue
        top = _max_event_ms(data.column(event_time).filter(pc.equal(channels, channel)))
        if top is not None:
            out[str(channel)] = top
    return out


def _max_event_by_split(data: pa.Table, event_time: str) -> dict[str, int]:
    """The largest event time of each (input channel, source partition) of the rows (ms),
    keyed ``"<channel>|<partition>"`` (channel 0 for a single input; partition "" where the
    rows do not name one)."""
    n = data.num_rows
    channel = data.column(CHANNEL_COLUMN).cast(pa.string()) \
        if CHANNEL_COLUMN in data.column_names else pa.array(["0"] * n, pa.string())
    split = data.column(SPLIT_COLUMN).cast(pa.string()) \
        if SPLIT_COLUMN in data.column_names else pa.array([""] * n, pa.string())
    column = data.column(event_time)
    from spark_ckpt.state.aggregates import to_internal

    keyed = pa.table({"c": channel, "s": pc.fill_null(split, ""),
                      "t": to_internal(column.combine_chunks()
                                       if isinstance(column, pa.ChunkedArray) else column)})
    grouped = keyed.group_by(["c", "s"]).aggregate([("t", "max")])
    out: dict[str, int] = {}
    for c, s, top in zip(grouped.column("c").to_pylist(), grouped.column("s").to_pylist(),
                         grouped.column("t_max").to_pylist(), strict=True):
        if c is None or top is None:
            continue
        out[f"{c}|{s}"] = _as_ms(int(top), column.type)
    return out


def _as_ms(top: int, arrow_type: pa.DataType) -> int:
    if pa.types.is_timestamp(arrow_type):  # as ms: timestamps are micros, dates days
        return top // 1000
    if pa.types.is_date32(arrow_type):
        return top * 86_400_000
    return top


def _max_event_ms(column: pa.ChunkedArray) -> int | None:
    from spark_ckpt.state.aggregates import to_internal

    top = pc.max(to_internal(column)).as_py()
    return None if top is None else _as_ms(int(top), column.type)


class _Batch:
    """One batch of one range: runs the processor and records what changed."""

    def __init__(self, params: dict[str, Any], task: _Run, store: Any, processor: Any,
                 schema: StateSchema, file_schema: pa.Schema, out_schema: pa.Schema,
                 key_names: list[str], vectorized: bool) -> None:
        self.params = params
        self.task = task
        self.store = store
        self.processor = processor
        self.schema = schema
        self.file_schema = file_schema
        self.out_schema = out_schema
        self.key_names = key_names
        self.vectorized = vectorized
        self.now = int(params["processing_time_ms"])
        self.watermark = params.get("watermark_ms")
        self.late_watermark = params.get("late_watermark_ms")
        self.ttl: int | None = params.get("ttl_ms")
        self.changes: list[pa.Table] = []
        self.dicts_out: list[dict[str, Any]] = []
        self.tuples_out: list[tuple[Any, ...]] = []
        self.tables_out: list[pa.Table] = []
        self.changed_keys = 0
        self.counters: dict[str, int] = {}
        self.user_s = 0.0
        self.value_names = [n for n in file_schema.names if n != KG_COLUMN and
                            n not in key_names]

    # -- reading and writing state ----------------------------------------------------------
    def _put(self, key_table: pa.Table, values: pa.Table) -> None:
        if not key_table.num_rows:
            return
        rows = pa.Table.from_arrays([*key_table.columns, *values.columns],
                                    names=[*key_table.column_names, *values.column_names])
        rows = rows.select(self.file_schema.names).cast(self.file_schema)
        # Until the new version is fixed, the local copy holds a version no driver knows:
        # each write says so (an empty token) in the same atomic write as its changes, so a
        # retry of a task killed in between rebuilds the range instead of applying the batch
        # again on top of it.
        if self.store.backend == "rocksdb":
            self.store.put(rows, token="")
        else:
            self.store.token = None
            self.store.put(rows)
        self.changes.append(rows)
        self.changed_keys += rows.num_rows

    def _values_table(self, columns: dict[str, list[Any]], keys: list[tuple[Any, ...]]
                      ) -> pa.Table:
        arrays = []
        for name in self.value_names:
            field = self.file_schema.field(name)
            arrays.append(_typed(columns[name], field, keys, self.params["operator"]))
        return pa.Table.from_arrays(arrays, names=self.value_names)

    # -- output ------------------------------------------------------------------------------
    def _emit(self, result: Any) -> None:
        if result is None:
            return
        if type(result) is list or hasattr(result, "__next__"):  # rows: tuples or dicts
            for row in result:
                (self.dicts_out if isinstance(row, dict) else self.tuples_out).append(row)
            return
        if isinstance(result, pa.Table | pa.RecordBatch):
            self.tables_out.append(pa.Table.from_batches([result]) if
                                   isinstance(result, pa.RecordBatch) else result)
            return
        if hasattr(result, "to_dict") and hasattr(result, "columns"):
            self.tables_out.append(pa.Table.from_pandas(
                result[self.out_schema.names], schema=self.out_schema, preserve_index=False))
            return
        for row in result:
            (self.dicts_out if isinstance(row, dict) else self.tuples_out).append(row)

    def output(self) -> pa.Table | None:
        parts = [t.select(self.out_schema.names).cast(self.out_schema) for t in self.tables_out]
        names = self.out_schema.names
        columns: list[list[Any]] = [[] for _ in names]
        if self.tuples_out:
            width = len(names)
            bad = next((r for r in self.tuples_out if len(r) != width), None)
            if bad is not None:
                from spark_ckpt.errors import UserFunctionError

                raise UserFunctionError(
                    f"operator {self.params['operator']}: expected output rows of "
                    f"{width} values ({', '.join(names)}), found {bad!r:.200}")
            columns = [list(c) for c in zip(*self.tuples_out, strict=True)]
        for row in self.dicts_out:
            for j, name in enumerate(names):
                columns[j].append(row.get(name))
        if self.tuples_out or self.dicts_out:
            parts.insert(0, pa.Table.from_arrays(
                [self._out_column(c, f) for c, f in zip(columns, self.out_schema, strict=True)],
                schema=self.out_schema))
        return pa.concat_tables(parts) if parts else None

    def _out_column(self, values: list[Any], field: pa.Field) -> pa.Array:
        """An output column from the rows' values: Python, numpy (a numpy datetime64 is UTC)."""
        from spark_ckpt.errors import UserFunctionError

        try:
            return pa.array(values, field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError,
                ValueError, OverflowError) as exc:
            try:
                return pa.array(values).cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError,
                    TypeError, ValueError, OverflowError):
                raise UserFunctionError(
                    f"operator {self.params['operator']}: output column {field.name!r}: "
                    f"expected values of type {field.type}, found {exc}"
                ) from None

    # -- the batch's rows --------------------------------------------------------------------
    def process(self, data: pa.Table) -> None:
        grouped = _Grouped(data, self.key_names)
        user_cols = [c for c in data.column_names if c not in _INTERNAL]
        rows = data.select(user_cols).take(pa.array(grouped.order))
        state = self.store.fetch(grouped.key_table)
        if self.vectorized:
            self._vectorized(grouped, rows, state)
        else:
            self._per_key(grouped, rows, state)

    def _contexts(self, state: pa.Table) -> Iterator[tuple[dict[str, Any], list[Any],
                                                           dict[str, int]]]:
        columns = {n: state.column(n).to_pylist() for n in self.schema.names}
        timers = state.column(TIMERS_COLUMN).to_pylist()
        expires = state.column(EXPIRES_COLUMN).to_pylist() \
            if EXPIRES_COLUMN in state.column_names else None
        names = self.schema.names
        for i in range(state.num_rows):
            t = timers[i]
            yield ({n: columns[n][i] for n in names},
                   [(e["ms"], e["kind"]) for e in t] if t else [],
                   dict(expires[i]) if expires is not None and expires[i] else {})

    def _record(self, out: dict[str, list[Any]], data: KeyData) -> None:
        for name in self.schema.names:
            value = data.values.get(name)
            out[name].append(None if isinstance(value, list | dict) and not value else value)
        out[TIMERS_COLUMN].append([{"ms": int(m), "kind": k} for m, k in data.timers]
                                  or None)
        if EXPIRES_COLUMN in out:
            out[EXPIRES_COLUMN].append(data.expires or None)

    def _per_key(self, grouped: _Grouped, rows: pa.Table, state: pa.Table) -> None:
        from spark_ckpt.state.processor import KeyContext, KeyData, KeyRows, _BatchColumns

        offsets = grouped.offsets.tolist()
        if getattr(self.processor, "rows_format", "numpy") == "pandas":
            pdf = rows.to_pandas()

            def rows_of(i: int) -> Any:
                return pdf.iloc[offsets[i]:offsets[i + 1]]
        else:
            columns = _BatchColumns(rows)

            def rows_of(i: int) -> Any:
                return KeyRows(columns, offsets[i], offsets[i + 1])
        changed: list[int] = []
        out: dict[str, list[Any]] = {n: [] for n in self.value_names}
        process = self.processor.process
        emit = self._emit
        t0 = time.perf_counter()
        key: tuple[Any, ...] = ()
        # one try around the loop (not a context manager per key): a raise names its key
        with _user_call(self.params, self.task, "process", lambda: key):
            for i, (values, timers, expires) in enumerate(self._contexts(state)):
                key = user_key(grouped.keys[i])
                data = KeyData(self.schema, values, timers, expires,
                               processing_time_ms=self.now, ttl_ms=self.ttl)
                ctx = KeyContext(self.schema, data, watermark_ms=self.watermark)
                emit(process(key, rows_of(i), ctx))
                if data.dirty:
                    changed.append(i)
                    self._record(out, data)
        self.user_s += time.perf_counter() - t0
        keys = [grouped.keys[i] for i in changed]
        self._put(grouped.key_table.take(pa.array(changed, pa.int64())),
                  self._values_table(out, keys))

    # -- timers ------------------------------------------------------------------------------
    def _due(self, ms: int, kind: str) -> bool:
        if kind == "event":
            return self.watermark is not None and ms <= self.watermark
        return ms <= self.now  # processing time and TTL clean-ups

    def fire_timers(self) -> int:
        limit = max(self.now, self.watermark if self.watermark is not None else self.now)
        due = self.store.due(limit)
        if due.num_rows == 0:
            return 0
        key_table = due.select([KG_COLUMN, *self.key_names])
        values = due.select(self.value_names)
        if self.vectorized:
            return self._vectorized_timers(key_table, values)
        keys = key_tuples(due, self.key_names)
        from spark_ckpt.state.processor import KeyContext, KeyData

        fired = 0
        changed: list[int] = []
        out: dict[str, list[Any]] = {n: [] for n in self.value_names}
        for i, (vals, timers, expires) in enumerate(self._contexts(values)):
            key = user_key(keys[i])
            data = KeyData(self.schema, vals, timers, expires, processing_time_ms=self.now,
                           ttl_ms=self.ttl)
            ctx = KeyContext(self.schema, data, watermark_ms=self.watermark)
            for ms, kind in sorted(timers):
                if not self._due(ms, kind) or (ms, kind) not in data.timers:
                    continue  # not yet due, or deleted by an earlier callback of this key
                ctx.timers.delete(ms, kind)
                if kind != "ttl":
                    ctx.timer_kind = kind
                    t0 = time.perf_counter()
                    with _user_call(self.params, self.task, "on_timer", key):
                        self._emit(self.processor.on_timer(key, ms, ctx))
                    self.user_s += time.perf_counter() - t0
                    fired += 1
                data.dirty = True
            if data.dirty:
                changed.append(i)
                self._record(out, data)
        ks = [keys[i] for i in changed]
        self._put(key_table.take(pa.array(changed, pa.int64())), self._values_table(out, ks))
        return fired

    # -- the vectorized API ------------------------------------------------------------------
    def _expired(self, values: pa.Table) -> tuple[pa.Table, np.ndarray]:
        """TTL: variables past their deadline nulled, TTL timers due dropped; and which rows
        that changed."""
        n = values.num_rows
        touched = np.zeros(n, dtype=bool)
        if EXPIRES_COLUMN not in values.column_names or n == 0:
            return values, touched
        expires = values.column(EXPIRES_COLUMN)
        for name in self.schema.names:
            deadline = pc.map_lookup(expires, pa.scalar(name), "first")
            touched |= np.asarray(pc.fill_null(pc.less_equal(deadline, self.now), False)
                                  .to_numpy(zero_copy_only=False), dtype=bool)
        if not touched.any():
            return values, touched
        idx = np.flatnonzero(touched)
        rows = values.take(pa.array(idx)).to_pylist()
        for row in rows:
            exp = dict(row[EXPIRES_COLUMN] or [])
            for name, deadline in list(exp.items()):
                if deadline <= self.now:
                    row[name] = None
                    del exp[name]
            row[EXPIRES_COLUMN] = exp or None
            row[TIMERS_COLUMN] = _ttl_timer(row[TIMERS_COLUMN], exp)
        fixed = pa.Table.from_pylist(rows, schema=values.schema)
        return _replace_rows(values, idx, fixed), touched

    def _vectorized(self, grouped: _Grouped, rows: pa.Table, state: pa.Table) -> None:
        from spark_ckpt.state.processor import KeyedBatch

        state, touched = self._expired(state)
        batch = KeyedBatch(
            keys=_pandas(grouped.key_table.select(self.key_names)),
            rows=_pandas(rows), offsets=grouped.offsets, group=grouped.group,
            state=_pandas(state.select(self.schema.names)),
            exists=~empty_rows(state, self.schema.names),
            processing_time_ms=self.now, watermark_ms=self.watermark,
                late_watermark_ms=self.late_watermark,
            arrow_keys=grouped.key_table.select(self.key_names), arrow_rows=rows,
            arrow_state=state.select(self.schema.names))
        t0 = time.perf_counter()
        with _user_call(self.params, self.task, "process_batch", ("<all keys of the task>",)):
            result = self.processor.process_batch(batch)
        self.user_s += time.perf_counter() - t0
        self._apply(result, grouped.key_table, state, touched)

    def _vectorized_timers(self, key_table: pa.Table, values: pa.Table) -> int:
        import pandas as pd

        from spark_ckpt.state.processor import KeyedBatch

        values, touched = self._expired(values)
        timers = values.column(TIMERS_COLUMN).to_pylist()
        fired: list[tuple[int, int, str]] = []
        kept: list[Any] = []
        for i, entries in enumerate(timers):
            remaining = []
            for e in entries or []:
                if self._due(e["ms"], e["kind"]):
                    if e["kind"] != "ttl":
                        fired.append((i, e["ms"], e["kind"]))
                    touched[i] = True
                else:
                    remaining.append(e)
            kept.append(remaining or None)
        values = values.set_column(values.column_names.index(TIMERS_COLUMN), TIMERS_COLUMN,
                                   pa.array(kept, values.schema.field(TIMERS_COLUMN).type))
        result = None
        if fired:
            with_timer = sorted({f[0] for f in fired})
            at = {k: j for j, k in enumerate(with_timer)}
            sub = values.take(pa.array(with_timer))
            empty_rows_frame = pd.DataFrame(columns=[])
            batch = KeyedBatch(
                keys=_pandas(key_table.select(self.key_names).take(pa.array(with_timer))),
                rows=empty_rows_frame, offsets=np.zeros(len(with_timer) + 1, dtype=np.int64),
                group=np.zeros(0, dtype=np.int64),
                state=_pandas(sub.select(self.schema.names)),
                exists=~empty_rows(sub, self.schema.names),
                processing_time_ms=self.now, watermark_ms=self.watermark,
                late_watermark_ms=self.late_watermark,
                timers=pd.DataFrame({"key": [at[f[0]] for f in fired],
                                     "ms": [f[1] for f in fired],
                                     "kind": [f[2] for f in fired]}),
                arrow_keys=key_table.select(self.key_names).take(pa.array(with_timer)),
                arrow_state=sub.select(self.schema.names))
            t0 = time.perf_counter()
            with _user_call(self.params, self.task, "on_timers", ("<keys with timers due>",)):
                result = self.processor.on_timers(batch)
            self.user_s += time.perf_counter() - t0
            if result is not None:
                result = _widen(result, with_timer, key_table.num_rows)
        self._apply(result, key_table, values, touched)
        return len(fired)

    def _apply(self, result: Any, key_table: pa.Table, values: pa.Table,
               touched: np.ndarray) -> None:
        """Write a vectorized call's result: ``values`` are the keys' rows before it (TTL
        applied), ``touched`` the rows that changed already (expired, timers fired)."""
        from spark_ckpt.errors import UserFunctionError
        from spark_ckpt.state.processor import Result

        n = key_table.num_rows
        write = touched.copy()
        columns = {name: values.column(name) for name in self.value_names}
        if result is not None and not isinstance(result, Result):
            raise UserFunctionError(
                f"operator {self.params['operator']}: expected process_batch/on_timers to "
                f"return a Result or None, found {type(result).__name__}"
            )
        if result is not None:
            self._emit(result.emit)
            for name, value in (result.counters or {}).items():
                self.counters[name] = self.counters.get(name, 0) + int(value)
            changed = np.ones(n, dtype=bool) if result.changed is None else \
                _mask(result.changed, self.params["operator"])
            if len(changed) != n:
                raise UserFunctionError(
                    f"operator {self.params['operator']}: Result.changed has {len(changed)} "
                    f"entries for {n} keys"
                )
            if result.state is not None:
                new = _as_table(result.state)
                if new.num_rows != n:
                    raise UserFunctionError(
                        f"operator {self.params['operator']}: expected Result.state to have "
                        f"one row per key of the call ({n}), found {new.num_rows}"
                    )
                unknown = [c for c in new.column_names if c not in self.schema.by_name]
                if unknown:
                    raise UserFunctionError(
                        f"operator {self.params['operator']}: Result.state has columns "
                        f"{unknown} that are not declared state variables "
                        f"({self.schema.names})"
                    )
                mask = pa.array(changed)
                for name in new.column_names:
                    field = self.file_schema.field(name)
                    try:
                        column = new.column(name).cast(field.type)
                    except (pa.ArrowInvalid, pa.ArrowNotImplementedError,
                            pa.ArrowTypeError) as exc:
                        raise UserFunctionError(
                            f"operator {self.params['operator']}: Result.state column "
                            f"{name!r}: expected {field.type}, found {new.column(name).type} "
                            f"({exc})"
                        ) from None
                    columns[name] = pc.if_else(mask, column, columns[name])
                write |= changed
            timer_sets = [(k, a) for k, a in (("event", result.event_timers),
                                              ("processing", result.processing_timers))
                          if a is not None]
            if timer_sets:
                columns[TIMERS_COLUMN], timer_rows = _set_timers(
                    columns[TIMERS_COLUMN], timer_sets, n)
                write |= timer_rows
            if self.ttl is not None and result.state is not None:
                columns[EXPIRES_COLUMN], columns[TIMERS_COLUMN] = self._refresh_ttl(
                    columns, changed, new.column_names)
        idx = np.flatnonzero(write)
        if not len(idx):
            return
        taken = pa.array(idx, pa.int64())
        table = pa.Table.from_arrays([pa.chunked_array([c]) if isinstance(c, pa.Array) else c
                                      for c in (columns[n] for n in self.value_names)],
                                     names=self.value_names).take(taken)
        self._put(key_table.take(taken), table)

    def _refresh_ttl(self, columns: dict[str, Any], changed: np.ndarray,
                     written: list[str]) -> tuple[Any, Any]:
        """The variables a call wrote (non-null in a changed row's ``Result.state`` columns)
        expire ``ttl_ms`` from now; the others keep their deadline. One TTL timer per key, at
        its earliest deadline."""
        assert self.ttl is not None  # called only when the operator has a TTL
        deadline = self.now + int(self.ttl)
        expires = columns[EXPIRES_COLUMN].to_pylist()
        timers = columns[TIMERS_COLUMN].to_pylist()
        present = {name: np.asarray(pc.is_valid(columns[name]).to_numpy(
            zero_copy_only=False), dtype=bool) for name in written}
        for i in np.flatnonzero(changed).tolist():
            exp = dict(expires[i] or [])
            for name in written:
                if present[name][i]:
                    exp[name] = deadline
                else:
                    exp.pop(name, None)
            expires[i] = exp or None
            timers[i] = _ttl_timer(timers[i], exp)
        return (pa.array(expires, self.file_schema.field(EXPIRES_COLUMN).type),
                pa.array(timers, self.file_schema.field(TIMERS_COLUMN).type))


def _ttl_timer(timers: list[dict[str, Any]] | None,
               expires: dict[str, int]) -> list[dict[str, Any]] | None:
    """A key's timers with one TTL clean-up, at its earliest deadline (none without one)."""
    rest = [t for t in timers or [] if t["kind"] != "ttl"]
    if expires:
        rest.append({"ms": min(expires.values()), "kind": "ttl"})
    return sorted(rest, key=lambda t: (t["ms"], t["kind"])) or None


_NULLABLE_INTS: dict[pa.DataType, str] = {
    pa.int8(): "Int8", pa.int16(): "Int16", pa.int32(): "Int32", pa.int64(): "Int64"}


def _pandas(table: pa.Table) -> Any:
    """A table as pandas, integers as pandas' nullable integers: a BIGINT with a null stays
    exact (numpy would make it a float and lose values past 2**53)."""
    import pandas as pd

    return table.to_pandas(types_mapper=lambda t: pd.api.types.pandas_dtype(
        _NULLABLE_INTS[t]) if t in _NULLABLE_INTS else None)


def _as_table(frame: Any) -> pa.Table:
    if isinstance(frame, pa.Table):
        return frame
    if isinstance(frame, pa.RecordBatch):
        return pa.Table.from_batches([frame])
    return pa.Table.from_pandas(frame, preserve_index=False)


def _replace_rows(table: pa.Table, idx: np.ndarray, rows: pa.Table) -> pa.Table:
    """``table`` with its rows at ``idx`` replaced by ``rows`` (one ``take``)."""
    n = table.num_rows
    position = np.arange(n, dtype=np.int64)
    position[idx] = n + np.arange(len(idx), dtype=np.int64)
    return pa.concat_tables([table, rows.cast(table.schema)]).take(pa.array(position))


def _mask(values: Any, operator: str) -> np.ndarray:
    """Result.changed as booleans; a null or a non-boolean is refused, not guessed."""
    from spark_ckpt.errors import UserFunctionError

    array = np.asarray(values)
    if array.dtype != bool:
        raise UserFunctionError(
            f"operator {operator}: expected Result.changed to be booleans (a numpy bool array "
            f"or a list of True/False, no nulls), found dtype {array.dtype}"
        )
    return array


def _widen(result: Any, rows: list[int], n: int) -> Any:
    """A Result of a call over some of ``n`` keys, as one over all ``n`` (others unchanged)."""
    import dataclasses

    import pandas as pd

    from spark_ckpt.errors import UserFunctionError

    changed = np.zeros(n, dtype=bool)
    sub = np.ones(len(rows), dtype=bool) if result.changed is None else \
        _mask(result.changed, "on_timers")
    if len(sub) != len(rows):
        raise UserFunctionError(
            f"on_timers: Result.changed has {len(sub)} entries for {len(rows)} keys")
    changed[rows] = sub
    state = None
    if result.state is not None:
        table = _as_table(result.state)
        if table.num_rows != len(rows):
            raise UserFunctionError(
                f"on_timers: expected Result.state to have one row per key of the call "
                f"({len(rows)}), found {table.num_rows}")
        position = np.full(n, -1, dtype=np.int64)
        position[rows] = np.arange(len(rows))
        state = table.take(pa.array(np.where(position >= 0, position, 0)))

    def widen(values: Any) -> Any:
        if values is None:
            return None
        full = pd.array([pd.NA] * n, dtype="Int64")
        full[rows] = pd.array(values, dtype="Int64")
        return full

    return dataclasses.replace(result, state=state, changed=changed,
                               event_timers=widen(result.event_timers),
                               processing_timers=widen(result.processing_timers))


def _set_timers(timers: Any, sets: list[tuple[str, Any]], n: int) -> tuple[pa.Array, np.ndarray]:
    """Replace each key's timers of a clock where the array gives a time (negative: none)."""
    import pandas as pd

    values = timers.to_pylist()
    touched = np.zeros(n, dtype=bool)
    for kind, given in sets:
        arr = pd.array(given, dtype="Int64") if not isinstance(given, pd.arrays.IntegerArray) \
            else given
        if len(arr) != n:
            from spark_ckpt.errors import UserFunctionError

            raise UserFunctionError(
                f"Result.{kind}_timers has {len(arr)} entries for {n} keys")
        mask = ~np.asarray(arr.isna())
        ms = np.asarray(arr.fillna(-1).to_numpy(dtype=np.int64))
        for i in np.flatnonzero(mask).tolist():
            rest = [t for t in values[i] or [] if t["kind"] != kind]
            if ms[i] >= 0:
                rest.append({"ms": int(ms[i]), "kind": kind})
            values[i] = sorted(rest, key=lambda t: (t["ms"], t["kind"])) or None
        touched |= mask
    return pa.array(values, timers.type), touched
