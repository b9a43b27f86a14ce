"""The template: streams that record their parents, computed per batch from the outputs.

A :class:`Stream` is a recipe, not data: ``compute(run)`` builds this batch's DataFrame from
its parents' DataFrames of the same batch (``run.get_or_compute(parent)``). Dependencies point
backwards, as in Spark's DStreamGraph, because evaluation is lazy and starts at the outputs.
A parent's result of ``None`` (a window between slides) propagates: nothing downstream runs.

Threads and owners: streams are built on the user's thread before ``start()`` and never change
after it; each holds its pipeline's definition (a :class:`Template`), not the StreamingContext.
``compute`` runs on the JobScheduler's thread and changes nothing on the stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.sinks.per_batch import (
    BatchSink,
    DeltaBatchSink,
    ForeachBatchSink,
    ParquetBatchSink,
    PipelineScope,
)
from spark_ckpt.sinks.two_phase import (
    DeltaTwoPhaseSink,
    ParquetTwoPhaseSink,
    TwoPhaseCommitSink,
)
from spark_ckpt.sparkapi import union_by_name
from spark_ckpt.streaming.template.stream_graph import StreamGraph

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from spark_ckpt.sources.source import Source, SourceRun
    from spark_ckpt.streaming.template.batch_run import BatchRun


class Template(PipelineScope, Protocol):
    """The pipeline a stream belongs to, as its streams see it: its definition (name,
    checkpoint directory, graph), never the StreamingContext or anything that runs. It makes
    the keyed streams (a higher layer: template.keyed)."""

    graph: StreamGraph

    def keyed(self, parent: Stream, keys: Sequence[str], *, parallelism: int | None,
              max_parallelism: int | None) -> Any:
        """A KeyedStream of ``parent`` by ``keys``."""

    def stream_join(self, left: Stream, right: Stream, on: Any, how: str, between: Any,
                    ttl: Any, name: str) -> Any:
        """A stream-stream join (template.joins)."""

    def temporal_join(self, left: Stream, table: Stream, on: Any, time_column: str, how: str,
                      name: str) -> Any:
        """A temporal join with a Delta table (template.temporal)."""

__all__ = ["InputStream", "Output", "Stream", "union_by_name"]

_ids = itertools.count()


class Stream:
    """A stream of per-batch DataFrames. Build with a context's sources and these methods."""

    is_input = False

    def __init__(self, pipeline: Template, parents: Sequence[Stream], name: str) -> None:
        for parent in parents:
            if not isinstance(parent, Stream):
                raise JobDefinitionError(
                    f"stream {name}: expected parent streams, found {type(parent).__name__}"
                )
            if parent.pipeline is not pipeline:
                raise JobDefinitionError(
                    f"stream {name}: its parent {parent.name} belongs to another "
                    f"StreamingContext ({parent.pipeline.name}, not {pipeline.name}); streams "
                    "of different contexts cannot be combined"
                )
        self.pipeline: Template = pipeline
        self.parents: tuple[Stream, ...] = tuple(parents)
        self.id = next(_ids)
        self.name: str = name
        pipeline.graph.add_stream(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    def compute(self, run: BatchRun) -> DataFrame | None:
        """This stream's DataFrame in batch ``run`` (None: nothing in this batch)."""
        raise NotImplementedError

    # -- transformations -----------------------------------------------------------------
    def transform(self, fn: Callable[..., DataFrame], *others: Stream,
                  name: str | None = None) -> Stream:
        """Apply ``fn(df, *other_dfs) -> DataFrame`` to this batch's DataFrame(s)."""
        return Transformed(self.pipeline, (self, *others), fn, name or _fn_name(fn))

    def filter(self, condition: Column | str) -> Stream:
        """The rows where ``condition`` holds (``where`` is the same)."""
        return Transformed(self.pipeline, (self,), lambda df: df.where(condition),
                           f"{self.name}.filter", whole=True)

    where = filter

    def select(self, *columns: Column | str) -> Stream:
        """The given columns or expressions of each batch."""
        return Transformed(self.pipeline, (self,), lambda df: df.select(*columns),
                           f"{self.name}.select", whole=True)

    def with_column(self, name: str, column: Column) -> Stream:
        """Each batch with column ``name`` added or replaced."""
        return Transformed(self.pipeline, (self,), lambda df: df.withColumn(name, column),
                           f"{self.name}.with_column({name})", whole=True)

    def with_watermark(self, column: str, delay: Any, *, idle_timeout: Any = None) -> Stream:
        """Declare ``column`` (a TIMESTAMP) the rows' event time, and the watermark to trail
        its largest value by ``delay`` ("10 seconds", a timedelta, or milliseconds), as
        Structured Streaming's ``withWatermark``: the event-time operators downstream
        (windows, stream joins, deduplication, ``key_by().process(...)`` with timers) take
        their event time from it (docs/operators.md); ``key_by().agg()`` does not evict by it
        (a warning says so).

        Where the rows carry the partition they were read from (a Kafka source's ``topic``
        and ``partition``, kept up to the operator), the largest event time is kept per
        partition and the smallest of those counts, as Flink's per-partition watermarks: a
        partition behind the others holds the watermark back instead of having its rows
        dropped as late. ``idle_timeout`` (a duration, Flink's ``withIdleness``): a partition,
        or an input of a join, that had no rows for that long on the pipeline's clock stops
        holding the watermark back until its rows come again; None (the default): it holds
        it back for as long as it is idle."""
        from spark_ckpt.streaming.template.event_time import Watermark, duration_ms

        if not isinstance(column, str) or not column:
            raise JobDefinitionError(
                f"with_watermark on {self.name}: expected an event-time column name, found "
                f"{column!r}")
        idle_ms = None if idle_timeout is None else duration_ms(
            idle_timeout, f"with_watermark({column!r}, idle_timeout=...)")
        if idle_ms is not None and idle_ms <= 0:
            raise JobDefinitionError(
                f"with_watermark on {self.name}: expected idle_timeout > 0 or None, found "
                f"{idle_timeout!r}")
        marked = Transformed(self.pipeline, (self,), lambda df: df,
                             f"{self.name}.with_watermark({column})", whole=True)
        marked.watermark = Watermark(column, duration_ms(delay, f"with_watermark({column!r})"),
                                     idle_ms, _split_columns(self))
        return marked

    def union(self, *others: Stream) -> Stream:
        """Rows of this stream and ``others`` in each batch (columns matched by name)."""

        return Transformed(self.pipeline, (self, *others), lambda *dfs: union_by_name(dfs),
                           f"{self.name}.union", whole=True)

    def join(self, other: Stream, on: str | Sequence[str] | Column, how: str = "inner") -> Stream:
        """Join each batch of this stream with the same batch of ``other``."""
        cond: Any = on  # pyspark's stubs want a list where any sequence works
        return Transformed(self.pipeline, (self, other), lambda a, b: a.join(b, cond, how),
                           f"{self.name}.join({other.name})", whole=True)

    def join_static(self, table: DataFrame | Callable[[], DataFrame],
                    on: str | Sequence[str] | Column, how: str = "inner",
                    broadcast: bool = False) -> Stream:
        """Join each batch with a static table (a DataFrame, or a function returning one,
        called every batch so a table that changes is read afresh)."""
        from pyspark.sql import functions as F

        cond: Any = on  # pyspark's stubs want a list where any sequence works

        def join_it(df: DataFrame) -> DataFrame:
            right = table() if callable(table) else table
            return df.join(F.broadcast(right) if broadcast else right, cond, how)

        return Transformed(self.pipeline, (self,), join_it, f"{self.name}.join_static",
                           whole=True)

    def key_by(self, *keys: str, parallelism: int | None = None,
               max_parallelism: int | None = None) -> Any:
        """Partition by ``keys`` for keyed state (``.agg(...)`` or ``.process(...)``).

        ``parallelism``: tasks of the stateful operator (default
        ``spark.ckpt.state.parallelism``); may change between runs. ``max_parallelism``: key
        groups (default ``spark.ckpt.state.maxParallelism``); fixed for a checkpoint's life."""
        return self.pipeline.keyed(self, keys, parallelism=parallelism,
                              max_parallelism=max_parallelism)

    def join_stream(self, other: Stream, on: str | Sequence[str], how: str = "inner", *,
                    between: Any = None, ttl: Any = None, name: str | None = None) -> Stream:
        """A stateful join with ``other`` across batches: rows with equal ``on`` columns whose
        event times (each side's ``with_watermark`` column) satisfy
        ``left.t + lower <= right.t <= left.t + upper`` for ``between=(lower, upper)``
        ("-10 seconds", "5 seconds"), state dropped at the watermark (template/joins.py);
        ``how``: inner, left_outer, right_outer, full_outer, left_semi, left_anti."""
        return self.pipeline.stream_join(  # type: ignore[no-any-return]
            self, other, on, how, between, ttl, name or f"join_{self.name}_{other.name}")

    def join_as_of(self, table: Stream, on: str | Sequence[str], time_column: str,
                   how: str = "inner", *, name: str | None = None) -> Stream:
        """Each row joined with ``table`` (``ctx.delta_table(...)``) as of the row's
        ``time_column``: the newest version of the Delta table committed at or before it, as
        Flink SQL's ``FOR SYSTEM_TIME AS OF`` and Delta's ``TIMESTAMP AS OF``; ``how``: inner
        or left (template/temporal.py)."""
        return self.pipeline.temporal_join(  # type: ignore[no-any-return]
            self, table, on, time_column, how, name or f"as_of_{self.name}_{table.name}")

    def drop_duplicates(self, *columns: str, within: Any = None, ttl: Any = None,
                        name: str | None = None) -> Stream:
        """Each distinct ``columns`` value's first row: ``key_by(*columns).drop_duplicates``
        (``within``: event time past the first row, with a watermark declared; ``ttl``:
        processing time)."""
        keyed: Any = self.key_by(*columns)
        return keyed.drop_duplicates(within=within, ttl=ttl, name=name)  # type: ignore[no-any-return]

    def window(self, length: int, slide: int = 1) -> Stream:
        """The union of this stream's last ``length`` batches, every ``slide`` batches."""
        return Windowed(self.pipeline, self, length, slide)

    # -- outputs -------------------------------------------------------------------------
    def foreach_batch(self, fn: Callable[[DataFrame, int], Any],
                      name: str | None = None) -> Output:
        """Call ``fn(df, batch_id)`` every batch. At-least-once: a batch interrupted by a crash
        calls it again with the same id and data, so make ``fn`` idempotent on ``batch_id``."""
        return Output(self.pipeline, self, ForeachBatchSink(name or _fn_name(fn), fn))

    def write_parquet(self, path: str, name: str | None = None,
                      partition_by: Sequence[str] = ()) -> Output:
        """Append to a Parquet directory, exactly once: per batch, or, when the pipeline
        checkpoints, in two phases (visible when a checkpoint completes)."""
        name = name or "parquet"
        return Output(self.pipeline, self, ParquetBatchSink(name, path, tuple(partition_by),
                                                       self.pipeline),
                      ParquetTwoPhaseSink(name, path, tuple(partition_by), self.pipeline))

    def write_delta(self, path: str, name: str | None = None,
                    partition_by: Sequence[str] = (), *,
                    merge_keys: Sequence[str] = ()) -> Output:
        """Write to a Delta table exactly once: appended per batch (app transactions), or, when
        the pipeline checkpoints, committed in two phases when a checkpoint completes.

        ``merge_keys``: upsert rows by these keys instead of appending (for the update stream
        of a keyed aggregation: the table then holds the newest value per key). Needs
        checkpointing (a two-phase commit per checkpoint)."""
        name = name or "delta"
        per_batch = None if merge_keys else DeltaBatchSink(name, path, tuple(partition_by),
                                                           self.pipeline)
        return Output(self.pipeline, self, per_batch,
                      DeltaTwoPhaseSink(name, path, tuple(partition_by), self.pipeline,
                                        tuple(merge_keys)))

    def write_kafka(self, bootstrap_servers: str, *, topic: str | None = None,
                    topic_column: str | None = None, key: str | Column | None = "key",
                    value: str | Column = "value", headers: str | Column | None = None,
                    delivery: str = "exactly_once", name: str | None = None, slices: int = 2,
                    marker_topic: str | None = None,
                    options: dict[str, str] | None = None) -> Output:
        """Send the stream's rows to Kafka: with ``delivery="exactly_once"`` (the default) a
        checkpoint's records become visible to ``read_committed`` consumers when it completes,
        never twice; ``"at_least_once"`` sends each batch as it runs. Arguments as
        :class:`~spark_ckpt.sinks.kafka.KafkaSink` (docs/kafka.md)."""
        from spark_ckpt.sinks.kafka import KafkaSink

        sink = KafkaSink(name or "kafka", bootstrap_servers, self.pipeline, topic=topic,
                         topic_column=topic_column, key=key, value=value, headers=headers,
                         delivery=delivery, slices=slices, marker_topic=marker_topic,
                         options=options)
        return Output(self.pipeline, self, None, sink)

    def write_two_phase(self, sink: TwoPhaseCommitSink) -> Output:
        """Write with your own :class:`~spark_ckpt.sinks.two_phase.TwoPhaseCommitSink`."""
        if not isinstance(sink, TwoPhaseCommitSink):
            raise JobDefinitionError(
                f"write_two_phase(): expected a TwoPhaseCommitSink, found {type(sink).__name__}"
            )
        return Output(self.pipeline, self, None, sink)


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _split_columns(stream: Stream) -> tuple[str, ...]:
    """The partition columns of the one source upstream of ``stream`` (through stateless
    transformations), which its rows may still carry; () for several sources or none."""
    sources: list[Any] = []
    pending: list[Any] = [stream]
    while pending:
        s = pending.pop()
        if getattr(s, "operator", None) is not None:  # a stateful operator's output
            return ()
        if getattr(s, "source", None) is not None and not s.parents:
            sources.append(s.source)
        pending.extend(s.parents)
    return sources[0].split_columns() if len(sources) == 1 else ()


class InputStream(Stream):
    """A source's batches: the piece of the batch's allocation that belongs to the source."""

    is_input = True

    def __init__(self, pipeline: Template, source: Source) -> None:
        self.source = source
        super().__init__(pipeline, (), source.name)

    def compute(self, run: BatchRun) -> DataFrame:
        piece = run.allocation.pieces.get(self.source.name)
        if piece is None:
            raise JobDefinitionError(
                f"batch {run.batch_id}: its allocation has nothing for source "
                f"{self.source.name}; recorded sources: {sorted(run.allocation.pieces)}"
            )
        current = run.batch_id == run.stats.batch_id  # not an earlier batch of a window
        if current:
            run.stats.input_rows[self.source.name] = self.source.rows(piece)
        run.stats.whole_reads[self.source.name] = self.pipeline.graph.reads_whole(self)
        # a BatchRun is a SourceRun (its stats a RunStats; the protocol's attribute is invariant)
        return self.source.read(cast("SourceRun", run), piece)


class Transformed(Stream):
    def __init__(self, pipeline: Template, parents: Sequence[Stream],
                 fn: Callable[..., DataFrame], name: str, *, whole: bool = False) -> None:
        super().__init__(pipeline, parents, name)
        self.fn = fn
        self.watermark: Any = None  # with_watermark's declaration (event_time.Watermark)
        # spark_ckpt's own row-by-row operators read every row; a user's function may not
        self.reads_whole = whole

    def compute(self, run: BatchRun) -> DataFrame | None:
        inputs = [run.get_or_compute(p) for p in self.parents]
        if any(df is None for df in inputs):
            return None
        out = self.fn(*inputs)
        if out is None or not hasattr(out, "schema"):
            raise JobDefinitionError(
                f"stream {self.name}, batch {run.batch_id}: expected its function to return a "
                f"DataFrame, found {type(out).__name__}"
            )
        return out


class Windowed(Stream):
    def __init__(self, pipeline: Template, parent: Stream, length: int, slide: int) -> None:
        if length < 1 or slide < 1:
            raise JobDefinitionError(
                f"window over {parent.name}: expected length >= 1 and slide >= 1 batches, "
                f"found length={length}, slide={slide}"
            )
        super().__init__(pipeline, (parent,), f"{parent.name}.window({length},{slide})")
        self.length = length
        self.slide = slide
        pipeline.graph.remember(length)

    def compute(self, run: BatchRun) -> DataFrame | None:
        if (run.batch_id + 1) % self.slide:
            return None
        first = max(0, run.batch_id - self.length + 1)
        computed = [run.at(b).get_or_compute(self.parents[0]) for b in range(first,
                                                                             run.batch_id + 1)]
        frames = [f for f in computed if f is not None]
        return union_by_name(frames) if frames else None


class Output(Stream):
    """An output stream: runs its sink on its parent's DataFrame every batch.

    ``sink`` commits per batch; ``two_phase`` commits per checkpoint. A pipeline that
    checkpoints uses ``two_phase`` when there is one (foreach_batch has none); one that does not
    uses ``sink``, or a per-batch transaction of ``two_phase``."""

    def __init__(self, pipeline: Template, parent: Stream, sink: BatchSink | None,
                 two_phase: TwoPhaseCommitSink | None = None) -> None:
        name = (sink or two_phase).name  # type: ignore[union-attr]
        pipeline.graph.check_output_name(name)
        super().__init__(pipeline, (parent,), name)
        self.sink = sink
        self.two_phase = two_phase
        self.output_name = name
        # spark_ckpt's own sinks write every row; a foreach_batch function or a user's own
        # two-phase sink may read part of a batch
        self.reads_whole = all(_own_sink(x) for x in (sink, two_phase))
        pipeline.graph.add_output(self)

    def compute(self, run: BatchRun) -> DataFrame | None:
        return run.get_or_compute(self.parents[0])


def _own_sink(sink: Any) -> bool:
    """True for no sink or one of spark_ckpt's own (they write every row of a batch)."""
    from spark_ckpt.sinks.per_batch import ForeachBatchSink

    return sink is None or (type(sink).__module__.startswith("spark_ckpt.")
                            and not isinstance(sink, ForeachBatchSink))

