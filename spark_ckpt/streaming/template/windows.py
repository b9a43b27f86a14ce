"""Event-time windowed aggregations: ``key_by(...).window(tumbling("10 seconds")).agg(...)``;
also each window's first rows per key (``.top_n(n, order_by)``, Flink's Window Top-N), the
rows dropped as late as a stream of their own (``late_rows()``), and windows on processing
time.

Why a window *on the keyed stream* and not a ``group_by`` that accepts ``F.window(...)``: a
keyed stream is where spark_ckpt's state is partitioned and checkpointed (its key groups,
parallelism and name), so the window joins the key the state is kept by, and ``agg`` takes the
same aggregate functions as the unwindowed ``key_by().agg()``. The windows themselves are
Spark's: tumbling and sliding windows come from Spark's ``window()``, session windows from
``session_window()``, so a row lands in exactly the windows Structured Streaming puts it in.

Semantics (as Structured Streaming's, with ``withWatermark`` on the time column):

- The watermark is the largest event time seen in earlier batches minus the declared delay.
- **append** (default): a window's result is emitted once, in the first batch whose watermark
  reaches its end (``end <= watermark``), and its state is dropped. A bounded run ends with a
  batch without data that closes every window the final watermark reaches.
- **update**: each batch emits the windows its rows changed, with their values so far; a
  window's state is dropped once the watermark reaches its end.
- A row whose window ended at or before the watermark the *previous* batch ran with is
  *late*: dropped and counted (``late_rows`` in the batch's progress: rows, or (row, window)
  pairs for sliding and cumulate windows), as Structured Streaming drops them; the windows
  this batch's watermark closes are closed after its rows merged into them.
- ``collect_list`` keeps each batch's values in event-time order (then value), batches in
  order; ``first``/``last`` break a tie in time by the smaller/larger value; so a replayed
  batch computes the same state. Sums of floating-point values add in batch order, as any
  Spark plan adds partial sums in some order (the last bits may differ from a batch query's).
- The window definition is recorded with the state: a restart that changes it is refused.
- Rows with a null event time belong to no window and are dropped.

Processing-time windows (``tumbling(..., processing_time=True)``, also ``sliding`` and
``cumulate``; Flink SQL's ``TUMBLE(PROCTIME(), ...)``, Nexmark q12): a row's time is its
batch's time on the pipeline's clock (the injected one), as Spark's ``current_timestamp()`` is
one instant per micro-batch; Flink stamps each record as it arrives. A window is emitted in the
first batch at or after its end, also a batch without data when empty batches are skipped (a
batch is run when the clock passes the end of a window that holds rows); never in an
available-now run's extra batches (its time moves only with its input: windows still open at
its end stay in the checkpoint). The batch's time is recorded with its allocation, so a
replayed batch stamps its rows alike; a restart whose clock reads earlier than the last batch
keeps the last batch's time until the clock passes it (closed windows stay closed). No row is
ever late. Processing-time session windows are not built.

Output: the key columns, ``window`` (a ``STRUCT<start: TIMESTAMP, end: TIMESTAMP>``, as
Spark's ``window()`` column), and one column per aggregation.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.state.aggregates import Agg
from spark_ckpt.state.task import CHANNEL_COLUMN, SPLIT_COLUMN
from spark_ckpt.state.window_processors import (
    LATE_COLUMN,
    ROWS_COLUMN,
    WINDOW_END,
    WINDOW_START,
    SessionAggProcessor,
    WindowAggProcessor,
)
from spark_ckpt.streaming.template.derived import Derived, DerivedOperator
from spark_ckpt.streaming.template.event_time import duration_ms
from spark_ckpt.streaming.template.keyed import KeyedStream
from spark_ckpt.streaming.template.stream import Stream

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import StructType

    from spark_ckpt.state.window_aggs import WindowAggSpec
    from spark_ckpt.streaming.template.batch_run import BatchRun

PROCTIME_COLUMN = "__ckpt_proctime"  # a processing-time window's rows: their batch's time

__all__ = ["PROCTIME_COLUMN", "LateRows", "WindowAggStream", "WindowSpec", "WindowTopNStream",
           "WindowedKeyedStream",
           "cumulate", "session", "sliding", "tumbling", "window_agg_state",
           "window_top_n_state"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WindowSpec:
    """Which windows a row belongs to. Build with :func:`tumbling`, :func:`sliding`,
    :func:`session` or :func:`cumulate`."""

    kind: str  # tumbling | sliding | session | cumulate
    size_ms: int = 0
    slide_ms: int = 0
    gap_ms: int = 0
    offset_ms: int = 0
    on: str | None = None  # the event-time column; default: the declared watermark's
    time: str = "event"  # event | processing (the batch's time on the pipeline's clock)


def _positive(value: Any, what: str) -> int:
    ms = duration_ms(value, what)
    if ms <= 0:
        raise JobDefinitionError(f"{what}: expected a duration above 0, found {value!r}")
    return ms


def _offset(offset: Any, slide_ms: int) -> int:
    ms = duration_ms(offset, "offset")
    if ms >= slide_ms:
        raise JobDefinitionError(
            f"window offset {offset!r}: expected an offset shorter than the slide "
            f"({slide_ms} ms), as Spark's startTime")
    return ms


def _time(on: str | None, processing_time: bool, what: str) -> str:
    if processing_time and on is not None:
        raise JobDefinitionError(
            f"{what}: processing-time windows take no time column (a row's time is its "
            f"batch's time on the pipeline's clock), found on={on!r}")
    return "processing" if processing_time else "event"


def tumbling(size: Any, *, on: str | None = None, offset: Any = 0,
             processing_time: bool = False) -> WindowSpec:
    """Fixed windows of ``size`` ("10 seconds"), Spark's ``window(on, size)`` and Flink's
    ``TUMBLE``; ``offset`` shifts their start (Spark's ``startTime``).
    ``processing_time=True``: Flink's ``TUMBLE(PROCTIME(), ...)`` (see the module's
    docstring)."""
    size_ms = _positive(size, "tumbling(size)")
    return WindowSpec("tumbling", size_ms, size_ms, 0, _offset(offset, size_ms), on,
                      _time(on, processing_time, "tumbling()"))


def sliding(size: Any, slide: Any, *, on: str | None = None, offset: Any = 0,
            processing_time: bool = False) -> WindowSpec:
    """Windows of ``size`` starting every ``slide``: Spark's ``window(on, size, slide)``,
    Flink's ``HOP``; a row is in ``size / slide`` of them."""
    size_ms, slide_ms = _positive(size, "sliding(size)"), _positive(slide, "sliding(slide)")
    if slide_ms > size_ms:
        raise JobDefinitionError(
            f"sliding({size!r}, {slide!r}): expected a slide no longer than the size")
    return WindowSpec("sliding", size_ms, slide_ms, 0, _offset(offset, slide_ms), on,
                      _time(on, processing_time, "sliding()"))


def session(gap: Any, *, on: str | None = None) -> WindowSpec:
    """Sessions per key that close after ``gap`` without rows: Spark's
    ``session_window(on, gap)``, Flink's ``SESSION``."""
    return WindowSpec("session", 0, 0, _positive(gap, "session(gap)"), 0, on)


def cumulate(step: Any, size: Any, *, on: str | None = None,
             processing_time: bool = False) -> WindowSpec:
    """Flink's ``CUMULATE``: windows that start every ``size`` and grow by ``step`` (a row at
    ``t`` is in every window of its ``size`` period that ends after ``t``)."""
    step_ms, size_ms = _positive(step, "cumulate(step)"), _positive(size, "cumulate(size)")
    if size_ms % step_ms:
        raise JobDefinitionError(
            f"cumulate({step!r}, {size!r}): expected a size that is a whole number of steps")
    return WindowSpec("cumulate", size_ms, step_ms, 0, 0, on,
                      _time(on, processing_time, "cumulate()"))


_MODES = ("append", "update")


class WindowedKeyedStream:
    """A keyed stream with event-time windows; ``.agg(...)`` makes the windowed
    aggregation. Not a stream itself."""

    def __init__(self, keyed: KeyedStream, spec: WindowSpec, output_mode: str) -> None:
        if not isinstance(spec, WindowSpec):
            raise JobDefinitionError(
                "window(): expected tumbling(...), sliding(...), session(...) or "
                f"cumulate(...), found {spec!r}")
        if output_mode not in _MODES:
            raise JobDefinitionError(
                f"window(): expected output_mode in {_MODES}, found {output_mode!r}")
        self.keyed = keyed
        self.spec = spec
        self.output_mode = output_mode

    def agg(self, name: str | None = None, **aggs: Agg) -> WindowAggStream:
        """Aggregates per key and window: the functions of ``spark_ckpt.state.aggregates``
        and ``spark_ckpt.state.window_aggs`` (count_distinct, approx_count_distinct,
        collect_list, collect_set, percentile)."""
        return WindowAggStream(self, name or f"window_{self.spec.kind}", aggs)

    def top_n(self, n: int, order_by: Any, *, name: str | None = None) -> WindowTopNStream:
        """Each key's first ``n`` rows of each window by ``order_by``
        (``[("price", "desc")]``): Flink's Window Top-N (``ROW_NUMBER() OVER (PARTITION BY
        window_start, window_end, key ORDER BY ...) <= n`` over a window TVF). A window's rows
        are emitted once, with their ``rank`` and ``window``, when the watermark passes its
        end; its state is then dropped. Rows of a window that ended at or before the previous
        batch's watermark are late: dropped and counted."""
        return WindowTopNStream(self, name or "window_top_n", n, order_by)


class _WindowedOperator(DerivedOperator):
    """What a windowed operator's windows share: the time they are on (a watermarked column,
    an upstream operator's watermark, or processing time), the windows a row is in, and a
    restart's check that the windows did not change."""

    what = "windowed operator"

    def __init__(self, windowed: WindowedKeyedStream, name: str) -> None:
        from spark_ckpt.streaming.template.event_time import declared_watermark, upstream_clock

        keyed = windowed.keyed
        what = f"{self.what} {name}"
        self.processing_time = windowed.spec.time == "processing"
        if self.processing_time:  # the batch's time: no watermark to take from the input
            mark, clock = None, None
        else:
            mark = declared_watermark(keyed.inputs, what)
            clock = upstream_clock(keyed.inputs, what) if mark is None else None
        if mark is None and not self.processing_time and \
                (clock is None or windowed.spec.on is None):
            raise JobDefinitionError(
                f"{what}: expected a watermark on its input, found none; "
                "declare one with stream.with_watermark('event_time', '10 seconds') (the "
                "watermark decides when a window is complete), or window on=a column of an "
                "event-time operator's output (its watermark then flows on)")
        on = PROCTIME_COLUMN if self.processing_time else \
            windowed.spec.on or mark.column  # type: ignore[union-attr]  # one of them is set
        if mark is not None and on != mark.column:
            raise JobDefinitionError(
                f"{what}: windows on {on!r}, the watermark is on "
                f"{mark.column!r}; expected windows on the watermark's column")
        self.window_spec = dataclasses.replace(windowed.spec, on=on)
        self.output_mode = windowed.output_mode
        self.user_keys = tuple(keyed.keys)
        super().__init__(keyed, name, event_time=on, delay_ms=mark.delay_ms if mark else 0)
        self.clock = clock
        if self.window_spec.kind != "session":
            self.keys = (*self.user_keys, WINDOW_START, WINDOW_END)

    def _time_field(self, schema: StructType) -> tuple[StructType, Any]:
        """The input's schema as the operator sees it (with the processing time when the
        windows are on it), and the field of the windows' time (checked: a TIMESTAMP)."""
        from pyspark.sql.types import StructField, StructType, TimestampType

        if self.processing_time:
            if PROCTIME_COLUMN in schema.fieldNames():
                raise JobDefinitionError(
                    f"{self.what} {self.operator}: its input has a column "
                    f"{PROCTIME_COLUMN!r}, the name processing-time windows stamp rows with")
            schema = StructType([*schema.fields, StructField(PROCTIME_COLUMN, TimestampType())])
        time_field = {f.name: f for f in schema.fields}.get(str(self.window_spec.on))
        if time_field is None or time_field.dataType.typeName() != "timestamp":
            raise JobDefinitionError(
                f"{self.what} {self.operator}: expected "
                f"{self.window_spec.on!r} to be a TIMESTAMP column, found "
                f"{time_field.dataType.simpleString() if time_field else 'no such column'}")
        return schema, time_field

    def configure(self, restored: dict[str, Any] | None) -> Any:
        state = super().configure(restored)
        self._keep_definition(state, "window", dataclasses.asdict(self.window_spec),
                              {"time": "event"}, "windows cannot change under a checkpoint")
        return state

    def _keep_definition(self, state: Any, field: str, definition: dict[str, Any],
                         defaults: dict[str, Any], why: str) -> None:
        """Record ``definition`` with the state; refuse a restart whose differs from the one
        recorded (``defaults``: the values of fields added since, for older records)."""
        recorded = state.extra.get(field)
        if recorded is not None and {**defaults, **recorded} != definition:
            from spark_ckpt.errors import StateSchemaError

            raise StateSchemaError(
                f"{self.what} {self.operator}: the checkpoint's {field} is {recorded}, the "
                f"pipeline asks for {definition}; {why} (keep the old definition or start a "
                "new checkpoint directory)")
        state.extra[field] = definition

    def input_keys(self) -> tuple[str, ...]:
        return self.user_keys

    # -- late rows: dropped and counted, or kept as a stream of their own -------------------
    late_stream: LateRows | None = None

    def late_rows(self, name: str | None = None) -> LateRows:
        """The rows this operator drops as late, as a stream (Flink's ``sideOutputLateData``):
        each batch, the input's columns of every late row and the ``window`` it was late for
        (a row late for several sliding windows once per window), to write to a table of
        their own with any sink (exactly once through the two-phase ones)."""
        if self.late_stream is None:
            self.late_stream = LateRows(self, name or f"{self.operator}.late_rows")
        return self.late_stream

    def _keep_late(self, run: BatchRun, windowed: DataFrame, late: Column) -> None:
        """Hand this batch's late rows to the late-rows stream (its memo for the batch: a
        frame over the batch's input and a literal watermark, the same on a replay)."""
        if self.late_stream is not None:
            run.memo[(self.late_stream.id, run.batch_id)] = self._late_view(windowed.where(late))

    def late_schema_frame(self, schema_run: Any) -> DataFrame:
        """The late rows over no input (the template's dry run at start)."""
        from pyspark.sql import functions as F

        from spark_ckpt.sparkapi import empty_frame

        df = empty_frame(self.pipeline.spark, schema_run.input_schema(self))
        if self.processing_time:
            df = df.withColumn(PROCTIME_COLUMN, F.current_timestamp())
        return self._late_view(self._assign(df)[0])

    def _late_view(self, windowed: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        if self.window_spec.kind == "session":  # a late row's own session: [t, t + gap)
            start = F.col(str(self.window_spec.on))
            end = start + F.expr(f"INTERVAL {self.window_spec.gap_ms} MILLISECONDS")
        else:
            start, end = F.col(WINDOW_START), F.col(WINDOW_END)

        columns = [c for c in windowed.columns
                   if not c.startswith("__ckpt") and c != CHANNEL_COLUMN]
        out: DataFrame = windowed.select(*columns, F.struct(
            start.alias("start"), end.alias("end")).alias(
            "window", metadata={"spark.timeWindow": True}))
        return out

    def _timed(self, run: BatchRun) -> tuple[DataFrame, int | None] | None:
        """The batch's rows with a time (stamped with the batch's when the windows are on
        processing time), and the watermark the previous batch ran with (rows of a window
        that ended at or before it are late)."""
        from pyspark.sql import functions as F

        df = super()._unrouted(run)
        if df is None:
            return None
        if self.processing_time:  # every row of the batch at the batch's processing time
            df = df.withColumn(PROCTIME_COLUMN,
                               F.timestamp_millis(F.lit(self._processing_ms(run))))
        watermark = self._state(run).extra.get("applied_watermark_ms")
        return df.where(F.col(str(self.window_spec.on)).isNotNull()), \
            None if watermark is None else int(watermark)

    # -- processing time: the batch's time is the watermark ------------------------------------
    def _processing_ms(self, run: BatchRun) -> int:
        """The batch's processing time: its time on the pipeline's clock (recorded with its
        allocation, so a replay stamps its rows alike), never before the time the tasks last
        ran with (a restart on a clock that reads earlier does not reopen closed windows)."""
        applied = self._state(run).extra.get("applied_watermark_ms")
        at = int(run.allocation.batch_time_ms)
        return at if applied is None else max(at, int(applied))

    def _watermark(self, extra: Any, now_ms: int | None = None) -> int | None:
        if not self.processing_time:
            return super()._watermark(extra, now_ms)
        applied = extra.get("applied_watermark_ms")
        return None if applied is None else int(applied)

    def watermark_of(self, state: Any, run: BatchRun | None = None) -> int | None:
        if not self.processing_time:
            return super().watermark_of(state, run)
        if run is None:
            return self._watermark(state.extra)
        return self._processing_ms(run)

    def time_moved(self, batch_time_ms: int | None = None) -> bool:
        """Processing time: whether a batch at ``batch_time_ms`` would close a window that
        holds rows (the clock passed the end of one since the last batch); never in an
        available-now run (None), whose processing time moves only with its input."""
        if not self.processing_time:
            return super().time_moved(batch_time_ms)
        snapshot = self.snapshot()
        if batch_time_ms is None or snapshot is None:
            return False
        applied, top = snapshot.extra.get("applied_watermark_ms"), \
            snapshot.extra.get("max_event_ms")
        if applied is None or top is None:
            return False
        return _next_end(self.window_spec, int(applied)) <= min(
            int(batch_time_ms), _last_end(self.window_spec, int(top)))

    def _assign(self, df: DataFrame) -> tuple[DataFrame, Column]:
        """Each row with its window(s) (one row per window it belongs to), and the window's
        end in microseconds (for sessions, the row's own session end: its time + gap)."""
        from pyspark.sql import functions as F

        w, on = self.window_spec, str(self.window_spec.on)
        if w.kind == "session":
            return df, F.unix_micros(F.col(on)) + F.lit(w.gap_ms * 1000)
        if w.kind == "cumulate":
            size_us, step_us = w.size_ms * 1000, w.slide_ms * 1000
            t = F.unix_micros(F.col(on))
            base = t - F.pmod(t, F.lit(size_us))
            first_end = base + (F.floor((t - base) / F.lit(step_us)) + 1) * F.lit(step_us)
            ends = F.sequence(first_end, base + F.lit(size_us), F.lit(step_us))
            out = df.withColumn("__ckpt_base", base).withColumn("__ckpt_end", F.explode(ends)) \
                .withColumn(WINDOW_START, F.timestamp_micros(F.col("__ckpt_base"))) \
                .withColumn(WINDOW_END, F.timestamp_micros(F.col("__ckpt_end"))) \
                .drop("__ckpt_base", "__ckpt_end")
            return out, F.unix_micros(F.col(WINDOW_END))
        window = F.window(on, f"{w.size_ms} milliseconds", f"{w.slide_ms} milliseconds",
                          f"{w.offset_ms} milliseconds")
        out = df.withColumn("__ckpt_w", window) \
            .withColumn(WINDOW_START, F.col("__ckpt_w.start")) \
            .withColumn(WINDOW_END, F.col("__ckpt_w.end")).drop("__ckpt_w")
        return out, F.unix_micros(F.col(WINDOW_END))


class WindowAggStream(_WindowedOperator):
    """An event-time windowed aggregation (see the module's docstring)."""

    what = "windowed aggregation"

    def __init__(self, windowed: WindowedKeyedStream, name: str, aggs: dict[str, Agg]) -> None:
        self.aggs = dict(aggs)
        for agg in self.aggs.values():
            if not isinstance(agg, Agg):
                raise JobDefinitionError(
                    f"windowed aggregation {name}: expected aggregations such as count() or "
                    f"max_('price'), found {agg!r}")
        super().__init__(windowed, name)

    # -- derived at start from the input's schema -------------------------------------------
    def derive(self, schema: StructType) -> Derived:
        from pyspark.sql.types import LongType, StructField, StructType

        from spark_ckpt.arrowtypes import to_arrow
        from spark_ckpt.state.window_aggs import WindowAggSpec

        schema, time_field = self._time_field(schema)
        fields = {f.name: f for f in schema.fields}
        spec = WindowAggSpec(self.aggs, schema, order_by=str(self.window_spec.on),
                             reserved=[*self.user_keys, "window", str(self.window_spec.on)])
        state_fields = [StructField(n, t) for o in spec.outputs for n, _k, t in o.state]
        emit_updates = self.output_mode == "update"
        window_type = time_field.dataType if self.window_spec.kind != "session" else LongType()
        raw = StructType([*[fields[k] for k in self.user_keys],
                          StructField(WINDOW_START, window_type),
                          StructField(WINDOW_END, window_type), *state_fields])
        if self.window_spec.kind == "session":
            types = {f.name: to_arrow(StructType([f])).field(0).type for f in state_fields}
            processor: Any = SessionAggProcessor(spec.merges(), types, emit_updates)
        else:
            processor = WindowAggProcessor(spec.merges(), spec.state_ddl(), emit_updates)
        return Derived(processor, raw, spec)

    # -- per batch -------------------------------------------------------------------------
    def _unrouted(self, run: BatchRun) -> DataFrame | None:
        from pyspark.sql import functions as F

        timed = self._timed(run)
        if timed is None:
            return None
        df, watermark = timed
        spec: WindowAggSpec = self.derived().extra
        # late: at or before the watermark the previous batch ran with, as Structured
        # Streaming drops them (windows then close at this batch's, after its rows merged)
        on = str(self.window_spec.on)
        windowed, end_us = self._assign(df)
        late = F.lit(False) if watermark is None else end_us <= F.lit(int(watermark) * 1000)
        self._keep_late(run, windowed, late)
        extra = [F.max(on).alias(on), F.count(F.lit(1)).alias(ROWS_COLUMN)]
        # rows of each source partition apart, for their own watermarks (the tasks merge a
        # window's partials of several partitions)
        split = [c for c in (CHANNEL_COLUMN, SPLIT_COLUMN) if c in windowed.columns] \
            if SPLIT_COLUMN in windowed.columns else []
        if self.window_spec.kind == "session":
            gap = f"{self.window_spec.gap_ms} milliseconds"
            grouped = windowed.withColumn(LATE_COLUMN, late).groupBy(
                *self.user_keys, LATE_COLUMN, *split,
                F.session_window(on, gap).alias("__ckpt_s"))
            out: DataFrame = grouped.agg(*spec.partial_columns(), *extra).select(
                *self.user_keys,
                F.unix_micros(F.col("__ckpt_s.start")).alias(WINDOW_START),
                F.unix_micros(F.col("__ckpt_s.end")).alias(WINDOW_END),
                *[F.col(n) for n in spec.state_names()], F.col(on), F.col(ROWS_COLUMN),
                F.col(LATE_COLUMN), *split)
            return out
        out = windowed.withColumn(LATE_COLUMN, late).groupBy(
            *self.user_keys, WINDOW_START, WINDOW_END, LATE_COLUMN, *split).agg(
            *spec.partial_columns(), *extra)
        return out

    def configure(self, restored: dict[str, Any] | None) -> Any:
        """As any windowed operator's, and an output kept under a checkpoint keeps its
        function and columns (an output added or removed is state evolution; ``count``
        turned ``sum`` under the same name would merge old values as new ones)."""
        state = super().configure(restored)
        defined = {name: [a.func, a.column, a.time_column] for name, a in self.aggs.items()}
        recorded = state.extra.get("window_aggs") or {}
        changed = sorted(n for n in set(recorded) & set(defined) if recorded[n] != defined[n])
        if changed:
            from spark_ckpt.errors import StateSchemaError

            raise StateSchemaError(
                f"{self.what} {self.operator}: outputs {changed} are "
                f"{[recorded[n] for n in changed]} in the checkpoint, the pipeline asks for "
                f"{[defined[n] for n in changed]}; an output's function and columns cannot "
                "change under a checkpoint (name the new one otherwise, or start a new "
                "checkpoint directory)")
        state.extra["window_aggs"] = defined
        return state

    def finish(self, raw: DataFrame) -> DataFrame:
        """The emitted rows as the user sees them: the keys, ``window``, the outputs."""
        return _finish_windows(raw, self.derived().extra, self.user_keys,
                               session=self.window_spec.kind == "session")

    def definition(self) -> dict[str, Any]:
        spec: WindowAggSpec = self.derived().extra
        return {"operator": "window_agg", "keys": list(self.user_keys),
                "window": dataclasses.asdict(self.window_spec), "aggs": spec.describe()}


def _finish_windows(raw: DataFrame, spec: WindowAggSpec, user_keys: Sequence[str], *,
                    session: bool) -> DataFrame:
    """Windows' raw rows (the keys, the window's bounds, the state columns) as the user sees
    them: the keys, ``window``, each output's final value."""
    from pyspark.sql import functions as F

    start, end = F.col(WINDOW_START), F.col(WINDOW_END)
    if session:
        start, end = F.timestamp_micros(start), F.timestamp_micros(end)
    out = raw.select(*user_keys,
                     F.struct(start.alias("start"), end.alias("end")).alias(
                         # marked as Spark marks window()'s column: window_time() takes it
                         "window", metadata={"spark.timeWindow": True}),
                     *spec.final_columns())
    finished: DataFrame = spec.spark_finals(out, [*user_keys, "window"])
    return finished


def window_agg_state(state: DataFrame, definition: dict[str, Any]) -> DataFrame:
    """A windowed aggregation's state (its keys and state variables, as a checkpoint stores
    them) as ``read_state`` shows it: one row per open window (session), the keys, ``window``
    and each output's value over the rows merged so far, finalized as the operator finalizes
    the windows it emits. ``definition``: what :meth:`WindowAggStream.definition` recorded."""
    from pyspark.sql import functions as F

    from spark_ckpt.state.window_aggs import WindowAggSpec
    from spark_ckpt.state.window_processors import SESSION_ENDS, SESSION_STARTS

    spec = WindowAggSpec.from_description(definition["aggs"])
    keys = list(definition["keys"])
    session = definition["window"]["kind"] == "session"
    if session:  # a key's open sessions, parallel lists: one row each, as the task emits them
        at = F.col("__ckpt_i") + 1
        state = state.select(
            *[F.col(f"`{k}`") for k in keys],
            F.posexplode(F.col(f"`{SESSION_STARTS}`")).alias("__ckpt_i", WINDOW_START),
            F.col(f"`{SESSION_ENDS}`"), *[F.col(f"`{n}`") for n in spec.state_names()]
        ).select(*[F.col(f"`{k}`") for k in keys], F.col(WINDOW_START),
                 F.element_at(F.col(f"`{SESSION_ENDS}`"), at).alias(WINDOW_END),
                 *[F.element_at(F.col(f"`{n}`"), at).alias(n) for n in spec.state_names()])
    return _finish_windows(state, spec, keys, session=session)


class WindowTopNStream(_WindowedOperator):
    """Flink's Window Top-N (see :meth:`WindowedKeyedStream.top_n`)."""

    what = "window top_n"

    def __init__(self, windowed: WindowedKeyedStream, name: str, n: int, order_by: Any) -> None:
        from spark_ckpt.streaming.template.row_operators import parse_order

        if windowed.spec.kind == "session":
            raise JobDefinitionError(
                f"window top_n {name}: expected tumbling, sliding or cumulate windows, found "
                "session windows (their bounds move as rows merge them)")
        if windowed.output_mode != "append":
            raise JobDefinitionError(
                f"window top_n {name}: expected output_mode 'append' (a window's rows are "
                f"emitted once, when it closes), found {windowed.output_mode!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise JobDefinitionError(f"window top_n {name}: expected n >= 1, found {n!r}")
        self.n = n
        self.order = parse_order(f"window top_n {name}", order_by)
        super().__init__(windowed, name)

    def configure(self, restored: dict[str, Any] | None) -> Any:
        state = super().configure(restored)
        self._keep_definition(state, "top_n",
                              {"n": self.n, "order": [[c, desc] for c, desc in self.order]}, {},
                              "a window's kept rows cannot be ranked anew")
        return state

    def derive(self, schema: StructType) -> Derived:
        from pyspark.sql.types import ArrayType, IntegerType, StructField, StructType

        from spark_ckpt.state.row_processors import RANK_COLUMN, WindowTopNProcessor
        from spark_ckpt.streaming.template.row_operators import check_order

        schema, time_field = self._time_field(schema)
        names = schema.fieldNames()
        check_order(f"window top_n {self.operator}", self.order, names)
        for reserved in (RANK_COLUMN, "window"):
            if reserved in names:
                raise JobDefinitionError(
                    f"window top_n {self.operator}: its input has a column {reserved!r}, a "
                    "name of the output's; rename it")
        ddl = ", ".join(f"row_{i} {ArrayType(f.dataType, True).simpleString()}"
                        for i, f in enumerate(schema.fields))
        raw = StructType([*schema.fields, StructField(WINDOW_START, time_field.dataType),
                          StructField(WINDOW_END, time_field.dataType),
                          StructField(RANK_COLUMN, IntegerType())])
        return Derived(WindowTopNProcessor(self.n, self.order, names, ddl), raw)

    def _unrouted(self, run: BatchRun) -> DataFrame | None:
        from pyspark.sql import functions as F

        timed = self._timed(run)
        if timed is None:
            return None
        df, watermark = timed
        windowed, end_us = self._assign(df)
        late = F.lit(False) if watermark is None else end_us <= F.lit(watermark * 1000)
        self._keep_late(run, windowed, late)
        return windowed.withColumn(LATE_COLUMN, late)

    def finish(self, raw: DataFrame) -> DataFrame:
        """The input's columns, ``window`` and ``rank``."""
        return _finish_top_n(raw)

    def definition(self) -> dict[str, Any]:
        return {"operator": "window_top_n", "keys": list(self.user_keys),
                "window": dataclasses.asdict(self.window_spec),
                "columns": list(self.derived().processor.columns), "n": self.n,
                "order": [[c, desc] for c, desc in self.order]}


def _finish_top_n(raw: DataFrame) -> DataFrame:
    """A window's ranked rows (the input's columns, the window's bounds, ``rank``) as the
    user sees them: the input's columns, ``window`` and ``rank``."""
    from pyspark.sql import functions as F

    from spark_ckpt.state.row_processors import RANK_COLUMN

    columns = [c for c in raw.columns if c not in (WINDOW_START, WINDOW_END, RANK_COLUMN,
                                                   PROCTIME_COLUMN)]
    window = F.struct(F.col(WINDOW_START).alias("start"), F.col(WINDOW_END).alias("end"))
    out: DataFrame = raw.select(*[F.col(f"`{c}`") for c in columns], window.alias(
        "window", metadata={"spark.timeWindow": True}), F.col(RANK_COLUMN))
    return out


def window_top_n_state(state: DataFrame, definition: dict[str, Any]) -> DataFrame:
    """A Window Top-N's state as ``read_state`` shows it: each open window's kept rows in rank
    order, as it emits them when the window closes (the input's columns, ``window``,
    ``rank``). ``definition``: what :meth:`WindowTopNStream.definition` recorded."""
    from spark_ckpt.streaming.template.row_operators import kept_rows

    return _finish_top_n(kept_rows(state, definition["columns"], carry=[WINDOW_START,
                                                                          WINDOW_END],
                                   with_rank=True))


class LateRows(Stream):
    """The rows a windowed operator drops as late (:meth:`_WindowedOperator.late_rows`)."""

    def __init__(self, operator: _WindowedOperator, name: str) -> None:
        super().__init__(operator.pipeline, (operator,), name)
        self.operator = operator

    def compute(self, run: BatchRun) -> DataFrame | None:
        run.get_or_compute(self.operator)  # it hands this batch's late rows over as it runs
        late: DataFrame | None = run.memo.get((self.id, run.batch_id))
        return late

    def schema_frame(self, schema_run: Any) -> DataFrame:
        """The late rows' schema (the template's dry run at start)."""
        return self.operator.late_schema_frame(schema_run)


def _last_end(w: WindowSpec, t: int) -> int:
    """The end (ms) of the last window a row at ``t`` (ms) is in."""
    if w.kind == "cumulate":
        return t - t % w.size_ms + w.size_ms
    return t - (t - w.offset_ms) % w.slide_ms + w.size_ms


def _next_end(w: WindowSpec, t: int) -> int:
    """The first window end (ms) after ``t`` (ms): window ends lie on a grid of the slide (the
    step for cumulate windows)."""
    first = 0 if w.kind == "cumulate" else (w.offset_ms + w.size_ms) % w.slide_ms
    return first + ((t - first) // w.slide_ms + 1) * w.slide_ms
