"""The stateful tasks' side of a stream-stream join: both inputs' rows of a key are kept in state
(one list per column, per side) until the watermark says no future row of the other side can
match them; each batch joins its new rows with the other side's kept and new rows.

A left row ``l`` and a right row ``r`` of the same key match when
``l.t + lower <= r.t <= l.t + upper`` (``lower``/``upper`` None: no bound). A future right row
has ``r.t > watermark`` (rows at or before it are late and dropped), so ``l`` can be dropped once
``l.t + upper <= watermark``, and ``r`` once ``r.t - lower <= watermark``. An outer join emits a
dropped row that never matched with nulls for the other side; a semi join emits a left row
when it first matches; an anti join emits a dropped left row that never matched.

Everything is vectorized with Arrow (a hash join of row indices per key, then ``take``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from spark_ckpt.state.aggregates import NULL_TIME, event_micros
from spark_ckpt.state.processor import KeyedBatch, Result, VectorizedProcessor

__all__ = ["SIDE_COLUMN", "TIME_COLUMN", "JoinProcessor"]

SIDE_COLUMN = "__ckpt_side"  # 0: left, 1: right (set on each input before the union)
TIME_COLUMN = "__ckpt_event_time"  # each input's own event time, one column for both
_SIDES = ("l", "r")


class JoinProcessor(VectorizedProcessor):
    def __init__(self, how: str, lower_ms: int | None, upper_ms: int | None,
                 columns: dict[str, list[str]], state_ddl: str) -> None:
        self.how = how
        self.lower = lower_ms
        self.upper = upper_ms
        self.columns = columns  # side -> its non-key columns (TIME_COLUMN not among them)
        self.state_schema = state_ddl  # type: ignore[misc]  # per instance: derived

    # -- state layout: per side, lists s_0.. (columns), s_time, s_matched ---------------------
    def _names(self, side: str) -> list[str]:
        return [f"{side}_{i}" for i in range(len(self.columns[side]))]

    def _kept(self, state: pa.Table, side: str) -> tuple[pa.Table, np.ndarray, np.ndarray,
                                                         np.ndarray]:
        """A side's kept rows (its columns), their owner key, time and matched flag."""
        times = state.column(f"{side}_time").combine_chunks()
        owner = np.asarray(pc.list_parent_indices(times).to_numpy(), dtype=np.int64)
        table = pa.table({c: pc.list_flatten(state.column(n).combine_chunks()) for c, n in
                          zip(self.columns[side], self._names(side), strict=True)})
        t = np.asarray(pc.list_flatten(times).to_numpy(zero_copy_only=False), dtype=np.int64)
        matched = np.asarray(pc.list_flatten(state.column(f"{side}_matched").combine_chunks())
                             .to_numpy(zero_copy_only=False), dtype=bool)
        return table, owner, t, matched

    def _state(self, n_keys: int, sides: dict[str, tuple[pa.Table, np.ndarray, np.ndarray,
                                                         np.ndarray]],
               types: dict[str, pa.DataType]) -> pa.Table:
        columns: dict[str, pa.Array] = {}
        for side in _SIDES:
            table, owner, t, matched = sides[side]
            order = np.argsort(owner, kind="stable")
            counts = np.bincount(owner, minlength=n_keys)
            offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]), pa.int32())
            present = pa.array(counts > 0)
            taken = table.take(pa.array(order, pa.int64()))

            def lists(values: pa.Array, offsets: pa.Array = offsets,
                      present: pa.Array = present) -> pa.Array:
                full = pa.ListArray.from_arrays(offsets, values)
                return pc.if_else(present, full, pa.nulls(len(full), full.type))

            for c, n in zip(self.columns[side], self._names(side), strict=True):
                columns[n] = lists(taken.column(c).combine_chunks().cast(types[c]))
            columns[f"{side}_time"] = lists(pa.array(t[order], pa.int64()))
            columns[f"{side}_matched"] = lists(pa.array(matched[order], pa.bool_()))
        return pa.table(columns)

    def _deadline(self, side: str, t: np.ndarray) -> np.ndarray | None:
        """When a kept row (time in µs) can no longer match: the first watermark (ms) at or
        past ``t + upper`` (left) or ``t - lower`` (right); None without a bound."""
        if side == "l":
            return None if self.upper is None else -(-(t + self.upper * 1000) // 1000)
        return None if self.lower is None else -(-(t - self.lower * 1000) // 1000)

    def _timers(self, n_keys: int, sides: dict[str, tuple[pa.Table, np.ndarray, np.ndarray,
                                                          np.ndarray]]) -> pd.array:
        first = np.full(n_keys, np.iinfo(np.int64).max, dtype=np.int64)
        for side in _SIDES:
            _table, owner, t, _matched = sides[side]
            deadline = self._deadline(side, t)
            if deadline is not None and len(owner):
                np.minimum.at(first, owner, deadline)
        timers = pd.array(np.where(first == np.iinfo(np.int64).max, -1, first), dtype="Int64")
        return timers

    # -- a batch's rows ----------------------------------------------------------------------
    def process_batch(self, batch: KeyedBatch) -> Result | None:
        rows, state, keys = batch.arrow_rows, batch.arrow_state, batch.arrow_keys
        assert rows is not None and state is not None and keys is not None
        n_keys = len(batch)
        group = np.asarray(batch.group, dtype=np.int64)
        side_of = np.asarray(rows.column(SIDE_COLUMN).to_numpy(zero_copy_only=False))
        t_all = event_micros(rows.column(TIME_COLUMN))
        late = np.zeros(rows.num_rows, dtype=bool)
        bounded = self.lower is not None or self.upper is not None
        no_time = (t_all == NULL_TIME) if bounded else np.zeros(rows.num_rows, dtype=bool)
        if batch.late_watermark_ms is not None:  # the previous batch's, as Spark's
            late = ~no_time & (t_all <= int(batch.late_watermark_ms) * 1000)
        # a null key never equals anything (Spark's equi-join): an outer or anti row is
        # emitted at once with nulls for the other side, an inner or semi row dropped
        null_key = np.zeros(len(batch), dtype=bool)
        for name in keys.column_names:
            null_key |= np.asarray(keys.column(name).is_null().to_numpy(zero_copy_only=False),
                                   dtype=bool)
        unkeyed = null_key[group] & ~late & ~no_time
        types = {}
        sides, fresh_from = {}, {}
        for s, side in enumerate(_SIDES):
            kept, owner, t, matched = self._kept(state, side)
            mine = np.flatnonzero((side_of == s) & ~late & ~no_time & ~unkeyed)
            new = rows.select(self.columns[side]).take(pa.array(mine, pa.int64()))
            for c in self.columns[side]:
                types[c] = new.schema.field(c).type
            fresh_from[side] = kept.num_rows
            sides[side] = (pa.concat_tables([kept.cast(new.schema), new]),
                           np.concatenate([owner, group[mine]]),
                           np.concatenate([t, t_all[mine]]),
                           np.concatenate([matched, np.zeros(len(mine), dtype=bool)]))
        pairs = self._pairs(sides, fresh_from)
        emit = self._emit_pairs(keys, sides, pairs)
        alone = self._unkeyed(keys, rows, group, side_of, unkeyed)
        for side, index in zip(_SIDES, pairs, strict=True):
            table, owner, t, matched = sides[side]
            newly = matched.copy()
            newly[index] = True
            if side == "l" and self.how == "left_semi":  # a left row's first match
                first = np.flatnonzero(newly & ~matched)
                emit = self._rows(keys, sides, "l", first)
            sides[side] = (table, owner, t, newly)
        if alone is not None:
            emit = alone if emit is None else pa.concat_tables(
                [emit, alone.cast(emit.schema)])
        counters = {k: int(v.sum()) for k, v in (("late_rows", late),
                                                 ("null_time_rows", no_time)) if v.any()}
        return Result(state=self._state(n_keys, sides, types),
                      event_timers=self._timers(n_keys, sides), emit=emit,
                      counters=counters or None)

    def _unkeyed(self, keys: pa.Table, rows: pa.Table, group: np.ndarray, side_of: np.ndarray,
                 unkeyed: np.ndarray) -> pa.Table | None:
        """Rows with a null key: an outer (or anti) join's, with nulls for the other side."""
        parts = []
        for s, side in enumerate(_SIDES):
            emits = (side == "l" and self.how in ("left_outer", "full_outer", "left_anti")) or \
                (side == "r" and self.how in ("right_outer", "full_outer"))
            index = np.flatnonzero(unkeyed & (side_of == s))
            if not emits or not len(index):
                continue
            out = keys.take(pa.array(group[index], pa.int64()))
            for t, other in enumerate(_SIDES):
                if other != side and self.how in ("left_semi", "left_anti"):
                    continue
                for c in self.columns[other]:
                    column = rows.column(c).take(pa.array(index, pa.int64())) if t == s \
                        else pa.nulls(len(index), rows.schema.field(c).type)
                    out = out.append_column(c, column)
            parts.append(out)
        return pa.concat_tables(parts) if parts else None

    def _pairs(self, sides: dict[str, tuple[pa.Table, np.ndarray, np.ndarray, np.ndarray]],
               fresh_from: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """Matching (left row, right row) index pairs with at least one new row."""
        _lt, l_owner, l_t, _lm = sides["l"]
        _rt, r_owner, r_t, _rm = sides["r"]
        left = pa.table({"k": l_owner, "li": np.arange(len(l_owner), dtype=np.int64)})
        right = pa.table({"k": r_owner, "ri": np.arange(len(r_owner), dtype=np.int64)})
        joined = left.join(right, "k", join_type="inner")
        li = np.asarray(joined.column("li").to_numpy(), dtype=np.int64)
        ri = np.asarray(joined.column("ri").to_numpy(), dtype=np.int64)
        keep = (li >= fresh_from["l"]) | (ri >= fresh_from["r"])
        delta = r_t[ri] - l_t[li]  # µs
        if self.lower is not None:
            keep &= delta >= self.lower * 1000
        if self.upper is not None:
            keep &= delta <= self.upper * 1000
        order = np.lexsort((ri[keep], li[keep]))
        return li[keep][order], ri[keep][order]

    def _emit_pairs(self, keys: pa.Table, sides: dict[str, tuple[pa.Table, np.ndarray,
                                                                 np.ndarray, np.ndarray]],
                    pairs: tuple[np.ndarray, np.ndarray]) -> pa.Table | None:
        if self.how in ("left_semi", "left_anti") or not len(pairs[0]):
            return None
        li, ri = pairs
        owner = sides["l"][1][li]
        out = keys.take(pa.array(owner, pa.int64()))
        for side, index in (("l", li), ("r", ri)):
            taken = sides[side][0].take(pa.array(index, pa.int64()))
            for c in self.columns[side]:
                out = out.append_column(c, taken.column(c))
        return out

    def _rows(self, keys: pa.Table, sides: dict[str, tuple[pa.Table, np.ndarray, np.ndarray,
                                                           np.ndarray]],
              side: str, index: np.ndarray) -> pa.Table | None:
        """Rows of one side alone (the other side's columns null, when the output has them)."""
        if not len(index):
            return None
        out = keys.take(pa.array(sides[side][1][index], pa.int64()))
        for s in _SIDES:
            if s != side and self.how in ("left_semi", "left_anti"):
                continue
            table = sides[s][0]
            for c in self.columns[s]:
                column = table.column(c).take(pa.array(index, pa.int64())) if s == side \
                    else pa.nulls(len(index), table.schema.field(c).type)
                out = out.append_column(c, column)
        return out

    # -- the watermark drops rows that can no longer match -----------------------------------
    def on_timers(self, batch: KeyedBatch) -> Result | None:
        state, keys = batch.arrow_state, batch.arrow_keys
        assert state is not None and keys is not None
        n_keys = len(batch)
        watermark = int(batch.watermark_ms or 0)
        sides, types, emits = {}, {}, []
        for side in _SIDES:
            table, owner, t, matched = self._kept(state, side)
            for c in self.columns[side]:
                types[c] = table.schema.field(c).type
            deadline = self._deadline(side, t)
            gone = np.zeros(len(t), dtype=bool) if deadline is None else deadline <= watermark
            outer = (side == "l" and self.how in ("left_outer", "full_outer", "left_anti")) or \
                (side == "r" and self.how in ("right_outer", "full_outer"))
            sides[side] = (table, owner, t, matched)
            if outer:
                emitted = self._rows(keys, sides if side == "r" else {**sides, "r": (
                    pa.table({c: pa.array([], pa.null()) for c in self.columns["r"]}),
                    np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))},
                    side, np.flatnonzero(gone & ~matched))
                if emitted is not None:
                    emits.append(emitted)
            keep = np.flatnonzero(~gone)
            sides[side] = (table.take(pa.array(keep, pa.int64())), owner[keep], t[keep],
                           matched[keep])
        emit = pa.concat_tables(emits, promote_options="permissive") if emits else None
        return Result(state=self._state(n_keys, sides, types),
                      event_timers=self._timers(n_keys, sides), emit=emit)
