"""The stateful tasks' side of deduplication and Top-N: vectorized processors over the rows of
a key (no Python call per key or row).

- :class:`DedupProcessor`: the first row of a key is emitted, the key remembered; later rows of
  the key are dropped until the key is forgotten, when the watermark passes the first row's
  event time plus ``within`` (Structured Streaming's ``dropDuplicatesWithinWatermark``), or
  ``ttl_ms`` of processing time after it (the operator's TTL).
- :class:`TopNProcessor`: a key's ``n`` first rows in an order (Flink's Top-N,
  ``ROW_NUMBER() OVER (PARTITION BY key ORDER BY ...) <= n``); its state holds those rows as
  parallel lists, one per column; a batch that changes a key's top rows emits all of them
  with their rank (an upsert stream by key and rank).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from spark_ckpt.state.aggregates import NULL_TIME, event_micros
from spark_ckpt.state.processor import KeyedBatch, Result, VectorizedProcessor

__all__ = ["DedupProcessor", "TopNProcessor", "WindowTopNProcessor"]

FIRST_SEEN = "first_event_ms"
RANK_COLUMN = "rank"


class DedupProcessor(VectorizedProcessor):
    """The first row of each key (see the module's docstring)."""

    state_schema = f"{FIRST_SEEN} BIGINT"

    def __init__(self, event_time: str | None, within_ms: int | None) -> None:
        self.event_time = event_time
        self.within_ms = within_ms

    def process_batch(self, batch: KeyedBatch) -> Result | None:
        rows = batch.arrow_rows
        assert rows is not None
        n = len(batch)
        starts = batch.offsets[:-1]
        late = np.zeros(rows.num_rows, dtype=bool)
        no_time = np.zeros(rows.num_rows, dtype=bool)
        event = None
        if self.event_time is not None:
            event = event_micros(rows.column(self.event_time))
            no_time = event == NULL_TIME  # no event time: dropped and counted
            if batch.late_watermark_ms is not None:  # at or before it: late, dropped
                late = ~no_time & (event <= int(batch.late_watermark_ms) * 1000)
        # each key's first row that is not late (arrival order within a key)
        position = np.where(late | no_time, rows.num_rows, np.arange(rows.num_rows))
        first = np.minimum.reduceat(position, starts) if rows.num_rows else \
            np.zeros(0, np.int64)
        keep = (~batch.exists) & (first < rows.num_rows)
        picked = first[keep]
        emit = rows.take(pa.array(picked, pa.int64()))
        seen = np.zeros(n, dtype=np.int64)  # the first row's event time (ms)
        if event is not None:
            seen[keep] = event[picked] // 1000
        timers = pd.array([pd.NA] * n, dtype="Int64")
        if event is not None and self.within_ms is not None:
            # forgotten once the watermark reaches the first row's time + within (µs: ceil)
            timers[keep] = -(-(event[picked] + int(self.within_ms) * 1000) // 1000)
        counters = {k: int(v.sum()) for k, v in (("late_rows", late),
                                                 ("null_time_rows", no_time)) if v.any()}
        return Result(state=pa.table({FIRST_SEEN: pa.array(seen, pa.int64())}),
                      changed=keep, emit=emit, event_timers=timers,
                      counters=counters or None)

    def on_timers(self, batch: KeyedBatch) -> Result | None:
        return Result(state=pa.table({FIRST_SEEN: pa.nulls(len(batch), pa.int64())}))


class TopNProcessor(VectorizedProcessor):
    """A key's first ``n`` rows in ``order`` (see the module's docstring)."""

    def __init__(self, n: int, order: list[tuple[str, bool]], columns: list[str],
                 state_ddl: str, with_rank: bool) -> None:
        self.n = n
        self.order = order  # (column, descending)
        self.columns = columns  # the input's columns; in state as lists row_0, row_1, ...
        self.names = [f"row_{i}" for i in range(len(columns))]
        self.state_schema = state_ddl  # type: ignore[misc]  # per instance: derived from input
        self.with_rank = with_rank

    def process_batch(self, batch: KeyedBatch) -> Result | None:
        rows, state, keys = batch.arrow_rows, batch.arrow_state, batch.arrow_keys
        assert rows is not None and state is not None and keys is not None
        new_state, changed, emit = self._merge(rows, np.asarray(batch.group, dtype=np.int64),
                                               state, len(batch))
        return Result(state=new_state, changed=changed, emit=emit)

    def _kept(self, state: pa.Table) -> tuple[pa.Table, np.ndarray]:
        """The kept rows of every key (flattened lists, in rank order) and their key."""
        kept_key = pc.list_parent_indices(state.column(self.names[0]).combine_chunks()) \
            .to_numpy().astype(np.int64)
        kept = pa.table({c: pc.list_flatten(state.column(s).combine_chunks())
                         for c, s in zip(self.columns, self.names, strict=True)})
        return kept, kept_key

    def _merge(self, rows: pa.Table, group: np.ndarray, state: pa.Table, n_keys: int) \
            -> tuple[pa.Table, np.ndarray, pa.Table]:
        """Each key's new top rows (as state), whether they changed, and the changed keys'
        top rows with their rank."""
        kept, kept_key = self._kept(state)
        fresh = rows.select(self.columns)
        both = pa.concat_tables([kept.cast(fresh.schema), fresh])
        owner = np.concatenate([kept_key, group])
        is_new = np.concatenate([np.zeros(kept.num_rows, bool), np.ones(fresh.num_rows, bool)])
        # order: by key, then the declared order; ties keep the kept rows, then arrival
        table = both.append_column("__owner", pa.array(owner)) \
            .append_column("__new", pa.array(is_new)) \
            .append_column("__seq", pa.array(np.arange(both.num_rows)))
        keys_order = [("__owner", "ascending"),
                      *[(c, "descending" if desc else "ascending") for c, desc in self.order],
                      ("__seq", "ascending")]
        ordered = table.take(pc.sort_indices(table, sort_keys=keys_order,
                                             null_placement="at_end"))
        owners = ordered.column("__owner").to_numpy()
        starts = np.searchsorted(owners, np.arange(n_keys), side="left")
        rank = np.arange(len(owners)) - starts[owners] + 1
        top = ordered.filter(pa.array(rank <= self.n))
        top_owner = top.column("__owner").to_numpy()
        changed = np.zeros(n_keys, dtype=bool)
        changed[top_owner[top.column("__new").to_numpy(zero_copy_only=False)]] = True
        offsets = np.concatenate([[0], np.cumsum(np.bincount(top_owner, minlength=n_keys))])
        new_state = pa.table({s: pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()), top.column(c).combine_chunks())
            for c, s in zip(self.columns, self.names, strict=True)})
        emit_rows = top.filter(pa.array(changed[top_owner]))
        emit_ranks = (rank[rank <= self.n])[changed[top_owner]]
        emit = emit_rows.select(self.columns)
        if self.with_rank:
            emit = emit.append_column(RANK_COLUMN, pa.array(emit_ranks, pa.int32()))
        return new_state, changed, emit


class WindowTopNProcessor(TopNProcessor):
    """A window's first ``n`` rows per key (Flink's Window Top-N): the keys are (key, window
    start, window end); a window's rows are kept as :class:`TopNProcessor` keeps them and
    emitted once, with their rank, when the watermark passes its end (an event timer at the
    end); rows its input flagged late change nothing and are counted."""

    def __init__(self, n: int, order: list[tuple[str, bool]], columns: list[str],
                 state_ddl: str) -> None:
        super().__init__(n, order, columns, state_ddl, with_rank=True)

    def process_batch(self, batch: KeyedBatch) -> Result | None:
        from spark_ckpt.state.window_processors import LATE_COLUMN, WINDOW_END, micros, timer_ms

        rows, state, keys = batch.arrow_rows, batch.arrow_state, batch.arrow_keys
        assert rows is not None and state is not None and keys is not None
        late = np.asarray(rows.column(LATE_COLUMN).to_numpy(zero_copy_only=False), dtype=bool)
        on_time = np.flatnonzero(~late)
        group = np.asarray(batch.group, dtype=np.int64)
        new_state, changed, _emit = self._merge(
            rows.take(pa.array(on_time, pa.int64())), group[on_time], state, len(batch))
        timers = pd.array([pd.NA] * len(batch), dtype="Int64")
        ends = timer_ms(micros(keys.column(WINDOW_END)))
        timers[changed] = ends[changed]
        return Result(state=new_state, changed=changed, event_timers=timers,
                      counters={"late_rows": int(late.sum())} if late.any() else None)

    def on_timers(self, batch: KeyedBatch) -> Result | None:
        state, keys = batch.arrow_state, batch.arrow_keys
        assert state is not None and keys is not None
        kept, owner = self._kept(state)
        starts = np.searchsorted(owner, np.arange(len(batch)), side="left")
        rank = np.arange(len(owner)) - starts[owner] + 1
        window = keys.select(keys.column_names[-2:]).take(pa.array(owner, pa.int64()))
        emit = pa.Table.from_arrays(
            [*kept.columns, *window.columns, pa.array(rank, pa.int32())],
            names=[*kept.column_names, *window.column_names, RANK_COLUMN])
        cleared = pa.table({s: pa.nulls(len(batch), state.schema.field(s).type)
                            for s in self.names})
        return Result(state=cleared, emit=emit)
