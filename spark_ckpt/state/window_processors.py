"""The stateful tasks' side of windowed aggregations: vectorized processors that merge each
batch's partials (window_aggs.py) into the windows' state and emit a window when the watermark
passes its end.

- :class:`WindowAggProcessor` (tumbling, sliding, cumulate): state is keyed by (key, window
  start, window end); one event timer per window, at its end. A window is one row of state.
- :class:`SessionAggProcessor`: state is keyed by the key; its sessions are parallel lists
  (starts, ends, one list per state column), merged when they overlap, as Spark's
  ``session_window`` merges them; one event timer per key, at its earliest session end.

Both emit the raw state columns with the window; Spark computes the outputs from them (a mean's
division, Spark's own ``approx_count_distinct`` and ``percentile``) on the driver's side.
Rows the operator's input flagged late (their window ended at or before the watermark) change
nothing and are counted (``late_rows`` in the batch's progress).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from spark_ckpt.state.processor import KeyedBatch, Result, VectorizedProcessor
from spark_ckpt.state.window_aggs import merge_columns, merge_scalars

__all__ = ["LATE_COLUMN", "ROWS_COLUMN", "SessionAggProcessor", "WindowAggProcessor",
           "WINDOW_END", "WINDOW_START", "micros", "timer_ms"]

WINDOW_START = "__ckpt_window_start"
WINDOW_END = "__ckpt_window_end"
LATE_COLUMN = "__ckpt_late"
ROWS_COLUMN = "__ckpt_rows"
SESSION_STARTS = "session__starts"  # no output name holds "__"
SESSION_ENDS = "session__ends"


def micros(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A timestamp column as int64 microseconds since the epoch."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return np.asarray(column.cast(pa.timestamp("us", tz=getattr(column.type, "tz", None)))
                      .cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)


def timer_ms(end_us: np.ndarray) -> np.ndarray:
    """A window's timer: due when ``end <= watermark`` (µs against ms, as Spark compares)."""
    return -(-end_us // 1000)


def _late(rows: pa.Table) -> tuple[np.ndarray, int]:
    late = np.asarray(rows.column(LATE_COLUMN).to_numpy(zero_copy_only=False), dtype=bool)
    dropped = int(pc.sum(rows.column(ROWS_COLUMN).filter(pa.array(late))).as_py() or 0) \
        if late.any() else 0
    return late, dropped


class WindowAggProcessor(VectorizedProcessor):
    """Windows keyed by (key, start, end): a batch's partial per window merges into its row."""

    def __init__(self, merges: list[tuple[str, str, str | None]], state_ddl: str,
                 emit_updates: bool) -> None:
        self.merges = merges
        self.state_schema = state_ddl  # type: ignore[misc]  # per instance: derived from input
        self.names = [m[0] for m in merges]
        self.emit_updates = emit_updates

    def process_batch(self, batch: KeyedBatch) -> Result | None:
        rows = batch.arrow_rows
        state = batch.arrow_state
        keys = batch.arrow_keys
        assert rows is not None and state is not None and keys is not None
        n = len(batch)
        late, dropped = _late(rows)
        partials = rows.select(self.names)
        if rows.num_rows != n:  # one per window and source partition: merged into one
            partials, late = self._one_per_window(partials, late, np.asarray(batch.offsets))
        merged = merge_columns(self.merges, state, partials)
        new = pa.table(merged)
        timers = pd.array(np.where(late, 0, timer_ms(micros(keys.column(WINDOW_END)))),
                          dtype="Int64")
        timers[late] = pd.NA
        emit = None
        if self.emit_updates and (~late).any():
            emit = _with_keys(keys, new).filter(pa.array(~late))
        return Result(state=new, changed=~late, event_timers=timers, emit=emit,
                      counters={"late_rows": dropped} if dropped else None)

    def _one_per_window(self, partials: pa.Table, late: np.ndarray, offsets: np.ndarray
                        ) -> tuple[pa.Table, np.ndarray]:
        """A window's partials (Spark grouped the batch by window and source partition, whose
        watermarks are kept apart) merged into one, in window order; a window is late or not
        whatever the partition."""
        counts = np.diff(offsets)
        if counts.min(initial=1) < 1:
            from spark_ckpt.errors import InternalError

            raise InternalError("windowed aggregation: expected at least one partial per "
                                "window, found a window without any")
        firsts = offsets[:-1].astype(np.int64)
        acc = partials.take(pa.array(firsts))
        for r in range(1, int(counts.max())):
            sel = np.nonzero(counts > r)[0]
            merged = merge_columns(self.merges, acc.take(pa.array(sel)),
                                   partials.take(pa.array(firsts[sel] + r)))
            index = np.arange(len(firsts))
            index[sel] = len(firsts) + np.arange(len(sel))
            acc = pa.table({name: pa.concat_arrays([
                acc.column(name).combine_chunks(),
                merged[name].cast(acc.column(name).type)]).take(pa.array(index))
                for name in self.names})
        return acc, late[firsts]

    def on_timers(self, batch: KeyedBatch) -> Result | None:
        state = batch.arrow_state
        keys = batch.arrow_keys
        assert state is not None and keys is not None
        emit = None if self.emit_updates else _with_keys(keys, state)
        cleared = pa.table({n: pa.nulls(len(batch), state.schema.field(n).type)
                            for n in self.names})
        return Result(state=cleared, emit=emit)


def _with_keys(keys: pa.Table, values: pa.Table) -> pa.Table:
    return pa.Table.from_arrays([*keys.columns, *values.columns],
                                names=[*keys.column_names, *values.column_names])


class SessionAggProcessor(VectorizedProcessor):
    """Session windows per key: a batch's sessions (Spark's ``session_window`` over the
    batch) merge with the key's open sessions where they overlap."""

    def __init__(self, merges: list[tuple[str, str, str | None]], state_types: dict[str, Any],
                 emit_updates: bool) -> None:
        self.merges = merges
        self.names = [m[0] for m in merges]
        self.types = state_types  # state column -> Arrow type of one session's value
        self.state_schema = ", ".join(  # type: ignore[misc]  # per instance: derived
            [f"`{SESSION_STARTS}` ARRAY<BIGINT>", f"`{SESSION_ENDS}` ARRAY<BIGINT>",
             *[f"`{n}` ARRAY<{_ddl(t)}>" for n, t in state_types.items()]])
        self.emit_updates = emit_updates

    # one key's sessions: a list of dicts {start, end, <state columns>}
    def _sessions(self, state: dict[str, list[Any]], i: int) -> list[dict[str, Any]]:
        starts = state[SESSION_STARTS][i] or []
        ends = state[SESSION_ENDS][i] or []
        return [{"start": s, "end": e, **{n: state[n][i][j] for n in self.names}}
                for j, (s, e) in enumerate(zip(starts, ends, strict=True))]

    def _merge(self, sessions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[int]]:
        """Sessions sorted by start, overlapping ones merged (as Spark's ``session_window``: a
        session that starts at or before the current one's end joins it, so rows exactly the
        gap apart are one session); and which merged sessions took new rows."""
        sessions.sort(key=lambda s: (s["start"], s["end"]))
        out: list[list[dict[str, Any]]] = []
        for s in sessions:
            if out and s["start"] <= max(x["end"] for x in out[-1]):
                out[-1].append(s)
            else:
                out.append([s])
        merged, touched = [], set()
        for j, group in enumerate(out):
            if any(s.get("new") for s in group):
                touched.add(j)
            if len(group) == 1:
                merged.append({k: v for k, v in group[0].items() if k != "new"})
                continue
            values = merge_scalars(self.merges, [{n: s[n] for n in self.names} for s in group],
                                   self.types)
            merged.append({"start": min(s["start"] for s in group),
                           "end": max(s["end"] for s in group), **values})
        return merged, touched

    def _state_row(self, sessions: list[dict[str, Any]]) -> dict[str, Any]:
        if not sessions:
            return {SESSION_STARTS: None, SESSION_ENDS: None, **dict.fromkeys(self.names)}
        return {SESSION_STARTS: [s["start"] for s in sessions],
                SESSION_ENDS: [s["end"] for s in sessions],
                **{n: [s[n] for s in sessions] for n in self.names}}

    def _emit_rows(self, key: dict[str, Any], sessions: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
        return [{**key, WINDOW_START: s["start"], WINDOW_END: s["end"],
                 **{n: s[n] for n in self.names}} for s in sessions]

    def process_batch(self, batch: KeyedBatch) -> Result | None:
        rows, state, keys = batch.arrow_rows, batch.arrow_state, batch.arrow_keys
        assert rows is not None and state is not None and keys is not None
        late, dropped = _late(rows)
        starts = micros(rows.column(WINDOW_START))
        ends = micros(rows.column(WINDOW_END))
        values = {n: rows.column(n).to_pylist() for n in self.names}
        st = state.to_pydict()
        key_rows = keys.to_pylist()
        new_state, timers, emitted, changed = [], [], [], np.zeros(len(batch), dtype=bool)
        for i in range(len(batch)):
            sessions = self._sessions(st, i)
            fresh = [{"start": int(starts[r]), "end": int(ends[r]), "new": True,
                      **{n: values[n][r] for n in self.names}}
                     for r in range(int(batch.offsets[i]), int(batch.offsets[i + 1]))
                     if not late[r]]
            if not fresh:
                new_state.append(self._state_row(sessions))
                timers.append(pd.NA)
                continue
            merged, touched = self._merge(sessions + fresh)
            changed[i] = True
            new_state.append(self._state_row(merged))
            timers.append(int(timer_ms(np.array([min(s["end"] for s in merged)]))[0]))
            if self.emit_updates:
                emitted += self._emit_rows(key_rows[i], [merged[j] for j in sorted(touched)])
        return Result(state=self._table(new_state), changed=changed,
                      event_timers=pd.array(timers, dtype="Int64"),
                      emit=emitted or None, counters={"late_rows": dropped} if dropped else None)

    def on_timers(self, batch: KeyedBatch) -> Result | None:
        state, keys = batch.arrow_state, batch.arrow_keys
        assert state is not None and keys is not None
        watermark_us = int(batch.watermark_ms or 0) * 1000
        st = state.to_pydict()
        key_rows = keys.to_pylist()
        new_state, timers, emitted = [], [], []
        for i in range(len(batch)):
            sessions = self._sessions(st, i)
            closed = [s for s in sessions if s["end"] <= watermark_us]
            open_ = [s for s in sessions if s["end"] > watermark_us]
            if not self.emit_updates:
                emitted += self._emit_rows(key_rows[i], closed)
            new_state.append(self._state_row(open_))
            timers.append(int(timer_ms(np.array([min(s["end"] for s in open_)]))[0])
                          if open_ else -1)
        return Result(state=self._table(new_state), event_timers=pd.array(timers, dtype="Int64"),
                      emit=emitted or None)

    def _table(self, rows: list[dict[str, Any]]) -> pa.Table:
        schema = pa.schema([pa.field(SESSION_STARTS, pa.list_(pa.int64())),
                            pa.field(SESSION_ENDS, pa.list_(pa.int64())),
                            *[pa.field(n, pa.list_(t)) for n, t in self.types.items()]])
        return pa.Table.from_pylist(rows, schema=schema)


def _ddl(arrow_type: pa.DataType) -> str:
    from spark_ckpt.arrowtypes import to_spark

    return str(to_spark(pa.schema([pa.field("v", arrow_type)])).fields[0].dataType
               .simpleString())
