"""Keyed processors from docs/checkpointing.md: dedup, top-N and sessions, each written with the
vectorized API (one call per task and batch) and the per-key API (one call per key and batch).
tests/test_typed_state.py runs them against plain Spark."""

from __future__ import annotations

import numpy as np
import pandas as pd

from spark_ckpt import KeyedProcessor, Result, VectorizedProcessor

TOP_N = 3


# -- dedup: emit a key's first row ever, drop the rest -----------------------------------------
class Dedup(VectorizedProcessor):
    state_schema = "seen BOOLEAN"

    def process_batch(self, batch):
        new = ~batch.exists  # keys never seen before
        first_rows = batch.offsets[:-1][new]  # each new key's first row of the batch
        return Result(state=pd.DataFrame({"seen": np.ones(len(batch), dtype=bool)}),
                      changed=new, emit=batch.rows.iloc[first_rows])


class DedupPerKey(KeyedProcessor):
    state_schema = "seen BOOLEAN"

    def process(self, key, rows, ctx):
        seen = ctx.value("seen")
        if not seen.get():
            seen.update(True)
            return rows.to_pandas().iloc[:1]
        return None


# -- top-N: the N largest values per key so far -------------------------------------------------
class TopN(VectorizedProcessor):
    state_schema = "top ARRAY<DOUBLE>"

    def process_batch(self, batch):
        old = batch.state["top"]
        counts = np.array([0 if v is None else len(v) for v in old])
        old_values = np.concatenate([np.asarray(v, dtype=float) for v in old if v is not None]
                                    or [np.zeros(0)])
        values = np.concatenate([old_values, batch.rows["value"].to_numpy(dtype=float)])
        group = np.concatenate([np.repeat(np.arange(len(batch)), counts), batch.group])
        order = np.lexsort((-values, group))  # by key, then largest first
        group, values = group[order], values[order]
        starts = np.searchsorted(group, np.arange(len(batch)))
        rank = np.arange(len(group)) - starts[group]
        keep = rank < TOP_N
        tops = np.split(values[keep], np.searchsorted(group[keep], np.arange(1, len(batch))))
        top = [t.tolist() for t in tops]
        return Result(state=pd.DataFrame({"top": top}), emit=batch.keys.assign(top=top))


class TopNPerKey(KeyedProcessor):
    state_schema = "top ARRAY<DOUBLE>"

    def process(self, key, rows, ctx):
        top = ctx.list("top")
        best = sorted([*top.get(), *rows["value"].tolist()], reverse=True)[:TOP_N]
        top.put(best)
        yield (key[0], best)


# -- sessions: a session closes `gap` ms of event time after a key's last event ---------------
GAP_MS = 30


class Sessions(VectorizedProcessor):
    state_schema = "n BIGINT, start_ms BIGINT, last_ms BIGINT"

    def process_batch(self, batch):
        import pyarrow as pa

        ms = batch.arrow_rows.column("event_time").cast(pa.int64()).to_numpy() // 1000
        first = np.minimum.reduceat(ms, batch.offsets[:-1])
        last = np.maximum.reduceat(ms, batch.offsets[:-1])
        st = batch.state
        start = np.where(batch.exists, st["start_ms"].fillna(0).to_numpy("int64"), first)
        last = np.maximum(st["last_ms"].fillna(0).to_numpy("int64"), last)
        n = st["n"].fillna(0).to_numpy("int64") + batch.sizes
        return Result(state=pd.DataFrame({"n": n, "start_ms": start, "last_ms": last}),
                      event_timers=last + GAP_MS)  # one timer per key, moved every batch

    def on_timers(self, batch):
        st = batch.state
        out = batch.keys.assign(n=st["n"].to_numpy("int64"),
                                start_ms=st["start_ms"].to_numpy("int64"),
                                end_ms=st["last_ms"].to_numpy("int64"))
        gone = pd.DataFrame({c: [None] * len(batch) for c in ("n", "start_ms", "last_ms")})
        return Result(state=gone, emit=out)  # all null: the key is forgotten


class SessionsPerKey(KeyedProcessor):
    state_schema = "n BIGINT, start_ms BIGINT, last_ms BIGINT"

    def process(self, key, rows, ctx):
        ms = rows["event_time"].astype("datetime64[ms]").astype("int64")  # numpy, UTC
        n, start, last = ctx.value("n"), ctx.value("start_ms"), ctx.value("last_ms")
        if last.get() is not None:
            ctx.timers.delete(last.get() + GAP_MS, "event")
        n.update((n.get() or 0) + len(rows))
        start.update(start.get() if start.get() is not None else int(ms.min()))
        last.update(max(last.get() or 0, int(ms.max())))
        ctx.timers.register_event_time(last.get() + GAP_MS)

    def on_timer(self, key, timer_ms, ctx):
        row = (key[0], ctx.value("n").get(), ctx.value("start_ms").get(),
               ctx.value("last_ms").get())
        ctx.clear()
        yield row
