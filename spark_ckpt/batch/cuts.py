"""Where a batch job becomes durable: cost-aware cuts, decided the way Spark places shuffles.

Spark keeps a job's data small where it crosses a stage boundary: a join with a broadcast
table is pipelined into the aggregation after it, and only the aggregation's partial results
are shuffled. A durable cut is a stage boundary that outlives the driver, so it belongs at the
same places: where the data is smallest on each path to a sink. For every vertex declared
without ``durable=`` (the default), the planner decides:

1. a vertex with sinks is durable (a sink is a durable point), a source is read in place;
2. a vertex whose consumer aggregates it (a ``groupBy(...).agg(...)`` with a partial form
   anywhere in the consumer's function, whatever follows it; or several, see batch.aggsplit)
   and that runs split by split (no shuffle of its own) is chained into a *partial* vertex:
   the consumer's map-side partial aggregates (what enters Spark's exchange), computed per
   wave of input splits, are the cut, not the wide rows; the consumer merges them and runs
   the rest of its function over the result. Chosen when a sample split's partials are at
   most ``spark.ckpt.batch.cutMaxPercent`` of its input, or a wave's are, estimated from two
   splits where the groups recur across splits (batch.wave_groups);
3. a vertex read by several consumers is durable (computed once, not once per consumer);
4. a split-by-split vertex whose output is at most ``cutMaxPercent`` of its input on a sample
   split (a filter, a projection) is durable: a cheap cut;
5. anything else (a wide intermediate, a shuffle intermediate with one consumer) is chained
   into its consumer, as Spark pipelines it;
6. a vertex that joins two or more inputs by its key, each computed split by split and read
   by it alone, gets *durable exchanges* (batch.buckets, ``spark.ckpt.batch.exchangeCuts``):
   what Spark would shuffle inside the join's job is written per wave of input splits,
   bucketed by the key into the join's partitions (a source gets an inserted
   ``<source>-to-<join>`` vertex; a chained input becomes durable so), and the join reads
   bucket *j* of each input without a shuffle. A killed job keeps every finished wave, and a
   re-run of some join partitions reads only their buckets.

The user's ``durable=True``/``False`` wins everywhere. The sample is one input split of the
vertex, run once when the vertex is first initialized; its figures and the decision are
recorded with the vertex in the event log, so a resubmitted job decides the same way and
pays no sample. Estimated bytes are the sample's ratio times the input's size on disk.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from spark_ckpt.batch.aggsplit import (
    AggSplit,
    NotSplittable,
    SplitSet,
    check_split,
    input_leaf,
    split_aggregate,
)
from spark_ckpt.execution.job_graph import Edge, JobGraph, JobVertex
from spark_ckpt.sparkapi import empty_frame, frame_api
from spark_ckpt.storage import human_size

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType, StructType

__all__ = ["Cut", "CutPlan", "Sampler", "plan_cuts", "row_width"]

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = "-partial"
# A sample reads at most this many rows of a source's first split: enough to see how much an
# aggregation reduces within a wave (fewer rows can only understate it), and cheap.
SAMPLE_ROWS = 500_000


@dataclasses.dataclass
class Cut:
    """The decision for one vertex, with its reason and the figures behind it."""

    vertex: str
    durable: bool
    reason: str
    by_hand: bool = False
    ratio: float | None = None  # sampled output bytes / input bytes
    est_bytes: int | None = None  # what the cut writes, estimated
    partial_of: str | None = None  # set on an inserted partial vertex: its consumer
    partial: bool = False  # set on a chained vertex whose consumer's partials are the cut
    source: bool = False  # a source: read in place, never written
    exchanges: list[str] = dataclasses.field(default_factory=list)
    bucket_for: str | None = None  # written bucketed for this consumer (a durable exchange)
    map_side: bool = False  # partials as Spark's map stage alone, durable task by task

    def record(self) -> dict[str, Any]:
        out = {"durable": self.durable, "reason": self.reason, "by_hand": self.by_hand,
               "ratio": self.ratio, "est_bytes": self.est_bytes, "partial": self.partial,
               "source": self.source}
        if self.partial_of:
            out["partial_of"] = self.partial_of
        if self.bucket_for:
            out["bucket_for"] = self.bucket_for
        if self.map_side:
            out["map_side"] = True
        return out

    @classmethod
    def from_record(cls, vertex: str, record: dict[str, Any]) -> Cut:
        return cls(vertex, bool(record["durable"]), str(record.get("reason", "")),
                   bool(record.get("by_hand", False)), record.get("ratio"),
                   record.get("est_bytes"), record.get("partial_of"),
                   bool(record.get("partial", False)), bool(record.get("source", False)),
                   bucket_for=record.get("bucket_for"),
                   map_side=bool(record.get("map_side", False)))


@dataclasses.dataclass
class CutPlan:
    job_id: str
    cuts: dict[str, Cut]
    splits: dict[str, AggSplit | SplitSet] = dataclasses.field(default_factory=dict)
    order: list[str] = dataclasses.field(default_factory=list)  # the graph's, once known

    def __str__(self) -> str:
        return self.text(self.order or None)

    def text(self, order: list[str] | None = None) -> str:
        """One line per vertex (in ``order``: the graph's), then the exchanges it keeps."""
        lines = [f"Job {self.job_id}: where it becomes durable"]
        for vid in order or list(self.cuts):
            cut = self.cuts.get(vid)
            if cut is None:
                continue
            what = "source" if cut.source else "durable" if cut.durable else "chained"
            est = f", writes ~{human_size(cut.est_bytes)}" if cut.est_bytes is not None and \
                cut.durable else ""
            lines.append(f"  {vid}: {what}{est}: {cut.reason}")
            for exchange in cut.exchanges:
                lines.append(f"      keeps Spark exchange {exchange}")
        return "\n".join(lines)

    def describe(self) -> dict[str, Any]:
        return {v: c.record() | {"exchanges": c.exchanges} for v, c in self.cuts.items()}


def row_width(schema: StructType) -> int:
    """Bytes a row takes, as Spark's size estimates count them (DataType.defaultSize)."""
    return sum(_width(f.dataType) for f in schema.fields) or 1


def _width(t: DataType) -> int:
    name = t.typeName()
    if name in ("long", "double", "timestamp", "timestamp_ntz"):
        return 8
    if name in ("integer", "float", "date"):
        return 4
    if name == "short":
        return 2
    if name in ("byte", "boolean"):
        return 1
    if name == "decimal":
        return 8 if t.precision <= 18 else 16  # type: ignore[attr-defined]
    if name == "struct":
        return row_width(t)  # type: ignore[arg-type]
    return 20  # strings, binary, arrays, maps: Spark's default guess


class Sampler:
    """Runs the sample a decision needs: one input split through a vertex (Spark jobs)."""

    def __init__(self, compute: Callable[[str, list[int]], DataFrame],
                 input_bytes: Callable[[str, int | None], int | None],
                 input_rows: Callable[[str, int], int | None],
                 limit: int | None = None,
                 compute_rows: Callable[..., DataFrame] | None = None
                 ) -> None:
        self.compute = compute  # (vertex id, partitions) -> its output, computed inline
        self.input_bytes = input_bytes  # (vertex id, partition or None) -> bytes on disk
        self.input_rows = input_rows  # (source id, split) -> rows, from footers (or None)
        self.limit = limit  # compute reads at most this many rows of a source split
        # (vertex id, split, rows, fraction=None) -> its output over the split's first rows
        # (rows None: all of them), or over a seeded random ``fraction`` of the split's rows
        # (sampled as read, before the chain's functions); None: only ``compute``'s sample,
        # and a wave's partials are not estimated
        self.compute_rows = compute_rows

    def ratio(self, output: DataFrame, source_id: str) -> float:
        """Estimated bytes of ``output`` (computed over ``source_id``'s split 0) over the
        split's own, both as rows times Spark's default column widths."""
        source = self.compute(source_id, [0])
        rows_in = self.input_rows(source_id, 0)
        if rows_in is None:
            rows_in = source.count()
        elif self.limit is not None:
            rows_in = min(rows_in, self.limit)
        if rows_in == 0:
            return 1.0  # an empty sample says nothing: assume no reduction
        rows_out = output.count()
        return (rows_out * row_width(output.schema)) / (rows_in * row_width(source.schema))


def planner_sampler(runner: Any, splits: dict[str, list[Any]]) -> Sampler:
    """A sampler over a VertexRunner in planning mode and the job's decided file splits."""
    def input_bytes(vertex_id: str, partition: int | None) -> int | None:
        if vertex_id not in splits:
            return None  # a DataFrame source: no size on disk
        chosen = splits[vertex_id] if partition is None else [splits[vertex_id][partition]]
        return sum(size for split in chosen for _path, size in split)

    def input_rows(vertex_id: str, partition: int) -> int | None:
        source = runner.graph.vertices[vertex_id].source
        if vertex_id not in splits or getattr(source, "format", None) != "parquet":
            return None
        import pyarrow.parquet as pq

        from spark_ckpt.storage import Storage

        rows = 0
        for path, _size in splits[vertex_id][partition]:
            store = Storage(path)
            rows += pq.read_metadata(store.root, filesystem=store.fs).num_rows
        return rows
    def compute_rows(vertex_id: str, split: int, rows: int | None,
                     fraction: float | None = None) -> DataFrame:
        before = runner.sample_rows, runner.sample_fraction
        runner.sample_rows, runner.sample_fraction = rows, fraction  # (read as its source
        try:  # frame is built; both None: the whole split)
            return runner.compute_inline(vertex_id, [split])
        finally:
            runner.sample_rows, runner.sample_fraction = before

    runner.sample_rows = SAMPLE_ROWS
    return Sampler(runner.compute_inline, input_bytes, input_rows, SAMPLE_ROWS, compute_rows)


def split_mode_chain(graph: JobGraph, vertex: JobVertex) -> bool:
    """True when the vertex runs split by split with no shuffle before it: a source, or a
    key-less vertex whose main inputs are forward edges from such vertices."""
    if vertex.is_source:
        return True
    if vertex.key:
        return False
    main = [e for e in vertex.inputs if e.kind != "broadcast"]
    return all(e.kind == "forward" and split_mode_chain(graph, graph.vertices[e.upstream])
               for e in main)


def split_source(graph: JobGraph, vertex: JobVertex) -> str:
    """The source whose splits a split-mode chain follows (its first forward input)."""
    while not vertex.is_source:
        main = next(e for e in vertex.inputs if e.kind != "broadcast")
        vertex = graph.vertices[main.upstream]
    return vertex.id


def wave_size(parallelism: int, per_wave: int, *, fine: bool) -> int:
    """Partitions per wave of a split-mode vertex: ``spark.ckpt.batch.partitionsPerWave``,
    or (0) a quarter of its partitions, an eighth for partial aggregates and durable
    exchanges (``fine``: their waves are the unit a killed job keeps, and what a wave costs
    does not grow with its size); a durable exchange's two first waves are smaller
    (:func:`waves_of`)."""
    if per_wave > 0:
        return per_wave
    return max(1, math.ceil(parallelism / (8 if fine else 4)))


def waves_of(parts: list[int], size: int, *, ramp: bool) -> list[list[int]]:
    """``parts`` in waves of ``size``; with ``ramp`` the first waves are a quarter and a half
    of it: a wave is what a killed job keeps, so a job killed early has kept something (the
    two first waves run at once and the small one finishes first), and what a wave costs
    besides its rows is small."""
    out: list[list[int]] = []
    at = 0
    if ramp:
        for small in (size // 4, size // 2):
            if small >= 1 and at < len(parts):
                out.append(parts[at:at + small])
                at += small
    out.extend(parts[i:i + size] for i in range(at, len(parts), size))
    return out


def plan_cuts(graph: JobGraph, sampler: Sampler, *, max_ratio: float, mode: str = "auto",
              recorded: dict[str, dict[str, Any]] | None = None,
              exchanges: Callable[[], bool] | None = None, exchange_min_bytes: int = 0,
              partitions_per_wave: int = 0, map_side: bool = False) -> CutPlan:
    """Decide every live vertex's durability and insert the partial vertices; mutates
    ``graph`` (before its vertices are initialized). ``recorded``: decisions logged for
    vertices whose definition is unchanged, reused as they are. ``exchanges``: whether
    durable exchanges can be written here (asked only when one would be chosen; None: no);
    ``exchange_min_bytes``: the least estimated bytes of one of their files; ``map_side``:
    partial aggregates may run as Spark's map stage alone, task by task
    (``spark.ckpt.batch.mapSidePartials`` on a classic session)."""
    recorded = recorded or {}
    plan = CutPlan(graph.job_id, {})
    live = graph.live_vertices()
    consumers: dict[str, list[tuple[str, Edge]]] = {v.id: [] for v in live}
    live_ids = {v.id for v in live}
    for v in live:
        for e in v.inputs:
            if e.upstream in live_ids:
                consumers[e.upstream].append((v.id, e))
    for vertex in live:
        if vertex.partial_of is not None:
            continue
        if mode != "auto" and vertex.is_source:
            cut = Cut(vertex.id, True, "read in place", source=True)
        elif mode != "auto" and vertex.declared_durable is None and not vertex.sinks:
            durable = mode == "all"
            cut = Cut(vertex.id, durable, f"spark.ckpt.batch.cuts={mode}")
        else:
            cut = _decide(graph, vertex, consumers, sampler, max_ratio, recorded, plan,
                          exchanges if mode == "auto" else None, partitions_per_wave,
                          map_side)
        plan.cuts[vertex.id] = cut
        vertex.durable = cut.durable
    for vid, cut in plan.cuts.items():  # a partial vertex re-made from a recorded decision
        if cut.partial_of and cut.ratio is None and vid in recorded:
            plan.cuts[vid] = Cut.from_record(vid, recorded[vid])
            plan.cuts[vid].bucket_for = graph.vertices[vid].bucket_for  # as inserted now
    if exchanges is not None and mode != "sinks":
        _plan_exchanges(graph, plan, consumers, sampler, exchanges, recorded,
                        insert=mode == "auto", min_bytes=exchange_min_bytes,
                        per_wave=partitions_per_wave)
    return plan


def exchange_rows(rows: DataFrame) -> DataFrame:
    """A durable exchange's function: its input's rows as they are (written bucketed)."""
    return rows


def _plan_exchanges(graph: JobGraph, plan: CutPlan, consumers: dict[str, list[tuple[str, Edge]]],
                    sampler: Sampler, supported: Callable[[], bool],
                    recorded: dict[str, dict[str, Any]], *, insert: bool, min_bytes: int = 0,
                    per_wave: int = 0) -> None:
    """Durable exchanges (batch.buckets) for every vertex that joins two or more inputs by
    its key, each of them computed split by split and read by that vertex alone: a durable
    input is written bucketed by the key into the joining vertex's partitions; a source (or
    a chained input) gets an inserted vertex that writes its rows so, per wave of its splits.
    Spark would shuffle exactly these rows inside the join's job; written, they survive the
    driver and the join reads bucket j of each without a shuffle. A decision recorded by an
    earlier attempt stands whatever this session's catalog can do (its fingerprints depend
    on it); the files are then read plainly, with the same rows."""
    for consumer in list(graph.live_vertices()):
        if not consumer.key or consumer.declared_durable is False or consumer.fn_final or \
                consumer.partial_of or consumer.exchange_of:
            continue
        main = [e for e in consumer.inputs if e.kind != "broadcast"]
        if len(main) < 2 or len({e.upstream for e in main}) != len(main) or \
                any(e.kind != "hash" or tuple(e.columns) != tuple(consumer.key) for e in main):
            continue
        ups = [graph.vertices[e.upstream] for e in main]
        if not all(_exchangeable(graph, u, consumers, insert) for u in ups):
            continue
        decided = all(recorded.get(f"{u.id}-to-{consumer.id}" if u.is_source else u.id, {})
                      .get("bucket_for") == consumer.id for u in ups)
        if not decided:
            small = _smallest_exchange_file(graph, plan, ups, consumer, sampler, per_wave)
            if small is not None and small < min_bytes:
                plan.cuts[consumer.id].reason += (
                    f"; no durable exchange into it: its inputs' files would hold "
                    f"~{human_size(small)} each (per wave and partition), below "
                    f"spark.ckpt.batch.exchangeMinBytes ({human_size(min_bytes)})")
                continue
            if not supported():
                continue
        columns = tuple(consumer.key)
        how = (f"bucketed by {list(columns)} into {consumer.id}'s partitions, so "
               f"{consumer.id} reads bucket j of each input without a shuffle")
        for edge, upstream in zip(main, ups, strict=True):
            cut = plan.cuts[upstream.id]
            if not upstream.is_source:
                upstream.bucket_for, upstream.bucket_by = consumer.id, columns
                if not upstream.durable:
                    upstream.durable = cut.durable = True
                    cut.reason = (f"{consumer.id} joins it by its key: its rows are the "
                                  f"exchange into {consumer.id}, written per wave, {how}")
                else:
                    cut.reason += f"; written per wave {how}"
                cut.bucket_for = consumer.id
                continue
            eid = f"{upstream.id}-to-{consumer.id}"
            while eid in graph.vertices:
                eid += "_"
            vertex = JobVertex(
                eid, upstream.parallelism, inputs=(Edge(upstream.id, "forward"),),
                fn=exchange_rows, key=(),
                # what its files mean: these columns, bucketed for the consumer's partitions
                version=f"exchange|{','.join(columns)}|{consumer.descriptor()['parallelism']}",
                durable=True, auto_parallelism=upstream.auto_parallelism,
                inherits=upstream.id if upstream.auto_parallelism else None,
                declared_parallelism=upstream.declared_parallelism,
            )
            vertex.exchange_of = vertex.bucket_for = consumer.id
            vertex.bucket_by = columns
            vertex.declared_durable = True
            graph.insert_before(consumer.id, vertex)
            consumer.inputs = tuple(Edge(eid, "hash", e.columns) if e is edge else e
                                    for e in consumer.inputs)
            total = sampler.input_bytes(split_source(graph, upstream), None)
            plan.cuts[eid] = Cut(eid, True, f"the exchange of {upstream.id} into "
                                 f"{consumer.id}, per wave of {upstream.id}'s splits, {how}",
                                 est_bytes=total, bucket_for=consumer.id)
            cut.reason = f"read in place by {eid}" if upstream.is_source else \
                f"chained into {eid}, the exchange into {consumer.id}"


def _smallest_exchange_file(graph: JobGraph, plan: CutPlan, ups: list[JobVertex],
                            consumer: JobVertex, sampler: Sampler,
                            per_wave: int) -> float | None:
    """The estimated bytes of the smallest file a durable exchange into ``consumer`` would
    write: each input's size (a computed input's sampled estimate if there is one, else its
    source's size on disk) over its waves times the consumer's partitions (None: an input's
    size is unknown, as for a DataFrame source)."""
    smallest = None
    for upstream in ups:
        estimate = None if upstream.is_source else plan.cuts[upstream.id].est_bytes
        total = estimate if estimate is not None else \
            sampler.input_bytes(split_source(graph, upstream), None)
        if total is None:
            return None
        fine = upstream.is_source  # an inserted exchange vertex runs fine waves
        waves = math.ceil(upstream.parallelism / wave_size(upstream.parallelism, per_wave,
                                                            fine=fine))
        each = total / (waves * consumer.parallelism)
        smallest = each if smallest is None else min(smallest, each)
    return smallest


def _exchangeable(graph: JobGraph, vertex: JobVertex,
                  consumers: dict[str, list[tuple[str, Edge]]], insert: bool) -> bool:
    """True when ``vertex``'s rows can be its one consumer's durable exchange: computed split
    by split, read by that consumer alone, no sinks, and durable (or free to become so)."""
    if vertex.sinks or len(consumers.get(vertex.id, ())) != 1 or vertex.partial_of or \
            not split_mode_chain(graph, vertex):
        return False
    if vertex.is_source:
        return insert
    if vertex.durable:
        return True
    return insert and vertex.declared_durable is None


def _decide(graph: JobGraph, vertex: JobVertex, consumers: dict[str, list[tuple[str, Edge]]],
            sampler: Sampler, max_ratio: float, records: dict[str, dict[str, Any]],
            plan: CutPlan, exchanges: Callable[[], bool] | None, per_wave: int = 0,
            map_side: bool = False) -> Cut:
    vid = vertex.id
    recorded = records.get(vid)
    if vertex.declared_durable is not None:
        how = "durable" if vertex.declared_durable else "chained into its consumers"
        cut = Cut(vid, vertex.declared_durable, f"set by hand ({how})", by_hand=True)
        if vertex.sinks and not vertex.declared_durable:
            return cut  # refused by the graph's validation
        return cut
    if vertex.sinks:
        return Cut(vid, True, "has sinks (" + ", ".join(s.name for s in vertex.sinks) + ")")
    if recorded is not None and "durable" in recorded:
        cut = Cut.from_record(vid, recorded)
        if cut.partial:
            readers = consumers[vid]
            consumer_id = readers[0][0] if len(readers) == 1 else None
            found = None
            if consumer_id is not None and split_mode_chain(graph, vertex) and \
                    _partial_candidate(vertex, graph.vertices[consumer_id], readers[0][1]) is None:
                try:
                    found = _split_over_sample(graph, vertex, consumer_id, sampler)
                except NotSplittable:
                    found = None
            pid = f"{consumer_id}{PARTIAL_SUFFIX}"
            # as recorded: the partials' layout does not change with this session's catalog
            bucketed = exchanges is not None and bool(records.get(pid, {}).get("bucket_for"))
            # as recorded too: what the run chose is what the files are
            mapped = map_side and bool(records.get(pid, {}).get("map_side"))
            if consumer_id is None or _insert_partial(graph, vertex, consumer_id, plan,
                                                      found, bucketed, mapped) is None:
                cut.partial = False
                cut.reason += " (its consumer no longer splits: chained)"
        return cut
    readers = consumers[vid]
    split_mode = split_mode_chain(graph, vertex)
    why: str | None = None
    if len(readers) == 1 and split_mode:
        consumer_id, edge = readers[0]
        consumer = graph.vertices[consumer_id]
        if _partial_candidate(vertex, consumer, edge) is None:
            try:
                split, partial, schema = _split_over_sample(graph, vertex, consumer_id,
                                                           sampler)
            except NotSplittable as exc:
                why = f"{consumer_id}'s function: {exc}"
            else:
                ratio = split_ratio = sampler.ratio(partial, split_source(graph, vertex))
                measured = f"{ratio:.2%} of the input on a sample split"
                if ratio > max_ratio:  # a wave holds fewer groups per row than a sample?
                    wave = _wave_ratio(graph, vertex, consumer_id, split, partial, sampler,
                                       per_wave)
                    if wave is not None and wave[0] is not None:
                        ratio, split_ratio = wave[0], wave[2]
                        measured = f"~{ratio:.2%} of a wave's input: {wave[1]}"
                    elif wave is not None:
                        measured += f"; per wave: {wave[1]}"
                est = _estimate(sampler, graph, vertex, ratio)
                # Written bucketed for the consumer, the partials are the exchange Spark
                # would run inside its job, made durable; but writing them costs far more
                # than Spark's shuffle of the same rows (the 480M-row rollup: partials at
                # 20% of the input made the job 1.29-1.47x plain Spark), so only partials
                # that reduce the input to cutMaxRatio are a cut
                if ratio <= max_ratio:
                    # Spark's map stage alone, task by task: no wave merges its partials;
                    # not where only a wave's merge makes them small (groups that recur in
                    # every split: a wave writes them once, its tasks would each write them)
                    mapped = map_side and split_ratio <= max_ratio and \
                        _map_side_plan(graph, vertex, consumer_id, split, sampler)
                    bucketed = exchanges is not None and not mapped and exchanges()
                    inserted = _insert_partial(graph, vertex, consumer_id, plan,
                                               Split(split, partial, schema), bucketed, mapped)
                    assert inserted is not None
                    plan.cuts[inserted].ratio, plan.cuts[inserted].est_bytes = ratio, est
                    plan.cuts[inserted].reason += f" ({measured})"
                    return Cut(vid, False, f"{consumer_id} aggregates it, so its map-side "
                               f"partial aggregates ({inserted}) are the cut, not these rows",
                               ratio=ratio, partial=True, source=vertex.is_source)
                why = (f"they are {measured} (more than {max_ratio:.0%}: writing them "
                       "would cost more than a re-run saves)")
    if vertex.is_source:
        reason = "read in place by " + why_text(readers)
        if why:
            reason += f"; not cut at partial aggregates: {why}"
        return Cut(vid, True, reason, source=True)
    if len(readers) > 1:
        return Cut(vid, True, f"read by {len(readers)} vertices "
                   f"({', '.join(c for c, _ in readers)}): computed once")
    if split_mode:
        ratio = sampler.ratio(sampler.compute(vid, [0]), split_source(graph, vertex))
        est = _estimate(sampler, graph, vertex, ratio)
        if ratio <= max_ratio:
            return Cut(vid, True, f"its output is {ratio:.1%} of its input on a sample split: "
                       "a cheap cut", ratio=ratio, est_bytes=est)
        reason = f"a wide intermediate ({ratio:.0%} of its input on a sample split)"
        if readers:
            reason += f" read only by {why_text(readers)}"
        if why:
            reason += f"; not cut at partial aggregates: {why}"
        return Cut(vid, False, reason, ratio=ratio, est_bytes=est)
    return Cut(vid, False, f"a shuffle intermediate read only by {why_text(readers)}: "
               "Spark keeps its exchange inside that vertex's job")


def why_text(readers: list[tuple[str, Edge]]) -> str:
    return ", ".join(c for c, _ in readers)


def _estimate(sampler: Sampler, graph: JobGraph, vertex: JobVertex, ratio: float) -> int | None:
    total = sampler.input_bytes(split_source(graph, vertex), None)
    return None if total is None else int(total * ratio)


def _partial_candidate(vertex: JobVertex, consumer: JobVertex, edge: Edge) -> str | None:
    """Why the consumer's partial aggregates cannot be the cut (None: they may be)."""
    if consumer.declared_durable is False:
        return f"{consumer.id} is chained by hand"
    main = [e for e in consumer.inputs if e.kind != "broadcast"]
    if len(main) != 1:
        return f"{consumer.id} has {len(main)} inputs besides broadcast ones"
    if edge.kind != "hash" or not consumer.key:
        return f"{consumer.id} does not read {vertex.id} hashed by a key"
    return None


def _wave_ratio(graph: JobGraph, vertex: JobVertex, consumer_id: str, split: Any,
                partial: DataFrame, sampler: Sampler,
                per_wave: int) -> tuple[float | None, str, float] | None:
    """The partials' estimated bytes over a wave's input bytes where a wave holds fewer groups
    per row than the sample split (groups that recur across splits: batch.wave_groups), why,
    and the same estimate for one whole split (what a task of map-side partials writes);
    (None, why, 1.0): groups that do not recur, keep the sample split's ratio; None: no
    estimate (one split a wave, row counts unknown, or it failed: it may cost a cut, never a
    job)."""
    try:
        return _wave_estimate(graph, vertex, consumer_id, split, partial, sampler, per_wave)
    except Exception as exc:  # noqa: BLE001 - an estimate, never a reason to fail a job
        log.warning("Job %s: vertex %s: no estimate of a wave's partials for %s (%s: %s); "
                    "the sample split's ratio decides", graph.job_id, vertex.id, consumer_id,
                    type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return None


def _wave_estimate(graph: JobGraph, vertex: JobVertex, consumer_id: str, split: Any,
                   partial: DataFrame, sampler: Sampler,
                   per_wave: int) -> tuple[float | None, str, float] | None:
    from spark_ckpt.batch.wave_groups import estimate_wave_groups, group_stats

    source_id = split_source(graph, vertex)
    splits = graph.vertices[source_id].parallelism
    last = min(wave_size(vertex.parallelism, per_wave, fine=True), splits) - 1
    if sampler.compute_rows is None or sampler.limit is None or last < 1:
        return None
    counts = [sampler.input_rows(source_id, p) for p in range(last + 1)]
    if any(c is None for c in counts):
        return None
    wave_rows = sum(c for c in counts if c is not None)
    half = sampler.limit // 2
    first_rows, last_rows = counts[0] or 0, counts[last] or 0
    read = min(half, first_rows) + min(half, last_rows)
    if not first_rows or not last_rows or wave_rows <= read:
        return None
    assert sampler.compute_rows is not None

    def group_counts(rows: DataFrame) -> list[DataFrame]:
        return split.group_counts(_consumer_over(graph, vertex, consumer_id, sampler, rows))

    # the first split's first rows, and a random sample of the last split (files sorted or
    # clustered by the key hold only their first keys in their first rows); a fixed seed,
    # sampled as the split is read (the chain's joins run on the sample alone)
    first = group_counts(sampler.compute_rows(vertex.id, 0, half))
    fraction = min(1.0, half / last_rows)
    sampled = sampler.compute_rows(vertex.id, last, None, fraction)
    groups, split_groups, whys, recur = 0.0, 0.0, [], False
    for a, b in zip(first, group_counts(sampled), strict=True):  # one job per aggregation
        stats = group_stats(a, b)
        # the wave's rows entering this aggregation: its input rows times the sample's share
        share = stats.rows / (min(half, first_rows) + fraction * last_rows)
        estimate = estimate_wave_groups(stats, int(wave_rows * share))
        split_groups += estimate_wave_groups(stats, int(first_rows * share)).groups
        groups += estimate.groups
        recur = recur or estimate.recur
        whys.append(estimate.why)
    why = "; ".join(dict.fromkeys(whys)) + \
        f" (sampled in splits 0 and {last} of a wave of {last + 1})"
    if not recur:
        return None, why, 1.0
    width = row_width(partial.schema) / row_width(sampler.compute(source_id, [0]).schema)
    return groups * width / wave_rows, why, split_groups * width / first_rows


def _consumer_over(graph: JobGraph, vertex: JobVertex, consumer_id: str, sampler: Sampler,
                   rows: DataFrame) -> DataFrame:
    """The consumer's function over ``rows`` as its input from ``vertex``, its other
    (broadcast) inputs empty."""
    consumer = graph.vertices[consumer_id]
    assert consumer.fn is not None
    main = next(i for i, e in enumerate(consumer.inputs) if e.upstream == vertex.id)
    return consumer.fn(*[rows if i == main else
                         empty_frame(rows.sparkSession, sampler.compute(e.upstream, [0]).schema)
                         for i, e in enumerate(consumer.inputs)])


# Map-side partials run one task a split: a larger split (few large files, or a declared
# parallelism below the file count) keeps Spark's own splitting of its files, in waves.
MAP_SIDE_MAX_SPLIT_BYTES = 512 << 20


def _map_side_plan(graph: JobGraph, vertex: JobVertex, consumer_id: str,
                   split: AggSplit | SplitSet, sampler: Sampler) -> bool:
    """True when the partial step over a whole split (planned, not run) is an aggregation
    Spark's map stage can run alone (:meth:`SparkApi.map_side_plan
    <spark_ckpt.sparkapi.SparkApi.map_side_plan>`; the sample's own plan has its limit's
    shuffle) and no split is larger than :data:`MAP_SIDE_MAX_SPLIT_BYTES`."""
    if sampler.compute_rows is None:
        return False
    source = split_source(graph, vertex)
    largest = max((sampler.input_bytes(source, p) or 0
                   for p in range(graph.vertices[source].parallelism)), default=0)
    if largest > MAP_SIDE_MAX_SPLIT_BYTES:  # one task a split: too long a task
        log.info("Map-side partials of %s not planned: a split of %d bytes would be one "
                 "task (more than %d)", consumer_id, largest, MAP_SIDE_MAX_SPLIT_BYTES)
        return False
    try:
        whole = sampler.compute_rows(vertex.id, 0, None)
        partial = split.partial_frame(_consumer_over(graph, vertex, consumer_id, sampler,
                                                     whole))
        return frame_api(partial).map_side_plan(partial)
    except Exception as exc:  # noqa: BLE001 - planning it failed: waves merge their partials
        log.info("Map-side partials of %s not planned: %s", consumer_id,
                 str(exc).splitlines()[0][:200])
        return False


def _split_over_sample(graph: JobGraph, vertex: JobVertex, consumer_id: str,
                       sampler: Sampler) -> Split:
    """The consumer's aggregation split and its partial step over the vertex's first split
    (planned, not run); or NotSplittable, with why. The function is analysed over an empty
    frame of the vertex's schema (its other, broadcast, inputs empty too), so what it runs
    before aggregating is its own (checked to be row by row) and the aggregation is found
    wherever it is in the function's plan; then applied to the sample."""
    consumer = graph.vertices[consumer_id]
    assert consumer.fn is not None
    main = next(i for i, e in enumerate(consumer.inputs) if e.upstream == vertex.id)
    edge = consumer.inputs[main]
    try:
        sample = sampler.compute(vertex.id, [0])
        spark = sample.sparkSession
        leaf = input_leaf(spark, sample.schema)
        aggregated = _consumer_over(graph, vertex, consumer_id, sampler, leaf)
        split = split_aggregate(aggregated, leaf)
        check_split(split, aggregated)
        missing = [c for c in edge.columns if c not in split.grouping]
        if missing:
            raise NotSplittable(f"it reads {vertex.id} hashed by {list(edge.columns)} but "
                                f"groups by {list(split.grouping)}")
        partial = split.partial_frame(_consumer_over(graph, vertex, consumer_id, sampler,
                                                     sample))
    except NotSplittable:
        raise
    except Exception as exc:  # an analysis error, a UDF: the consumer stays whole
        raise NotSplittable(f"its aggregation could not be planned in parts "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc
    return Split(split, partial, sample.schema)


class Split(NamedTuple):
    """A consumer's aggregation split, its partial step over a sample split, and the schema
    its aggregation reads (its ``fn_final`` plans the function over no rows of it)."""

    split: AggSplit | SplitSet
    sample: DataFrame
    schema: StructType


def _exchanges(split: AggSplit | SplitSet) -> str:
    """Which of Spark's exchanges the partials are what enters, in words."""
    parts = split.parts if isinstance(split, SplitSet) else (split,)
    each = [f"grouped by {list(p.grouping + p.distinct)}" for p in parts]
    if len(each) == 1:
        return f"what enters Spark's exchange of its aggregation, {each[0]}"
    return (f"what enters Spark's exchanges of its {len(each)} aggregations, "
            + "; ".join(each))


def _insert_partial(graph: JobGraph, vertex: JobVertex, consumer_id: str, plan: CutPlan,
                    split_and_sample: Split | None,
                    bucketed: bool, mapped: bool = False) -> str | None:
    """Insert ``<consumer>-partial`` between ``vertex`` and its aggregating consumer; return
    its id (None: the consumer no longer splits). ``bucketed``: its waves are written
    bucketed by the consumer's key into the consumer's partitions (a durable exchange), so
    the consumer merges them without a shuffle. ``mapped``: its waves run as Spark's map
    stage alone, each task's partials durable as it commits (the consumer shuffles them)."""
    consumer = graph.vertices[consumer_id]
    if split_and_sample is None:
        return None
    split = split_and_sample[0]
    assert consumer.fn is not None
    from spark_ckpt.execution.job_graph import _function_identity

    pid = f"{consumer_id}{PARTIAL_SUFFIX}"
    while pid in graph.vertices:
        pid += "_"
    main = next(i for i, e in enumerate(consumer.inputs) if e.upstream == vertex.id)
    partial = JobVertex(
        pid, vertex.parallelism,
        # the consumer's inputs, its main one read split by split (a broadcast one is read
        # whole by every wave, as the consumer's function reads it)
        inputs=tuple(Edge(vertex.id, "forward") if i == main else e
                     for i, e in enumerate(consumer.inputs)),
        fn=split.partial_fn(consumer.fn), key=(),
        # what it computes is the consumer's function's partial form: its identity
        version=f"{_function_identity(consumer.fn)}|{consumer.version}|"
                f"{split.describe()}",
        durable=True, auto_parallelism=vertex.auto_parallelism,
        inherits=vertex.id if vertex.auto_parallelism else None,
        declared_parallelism=vertex.declared_parallelism,
    )
    partial.partial_of = consumer_id
    partial.map_side = mapped
    partial.declared_durable = True
    graph.insert_before(consumer_id, partial)
    edge = consumer.inputs[main]
    consumer.inputs = tuple(Edge(pid, "hash", edge.columns) if i == main else e
                            for i, e in enumerate(consumer.inputs))
    consumer.fn_final = split.final_fn(consumer.fn, split_and_sample.schema, main)
    plan.splits[consumer_id] = split
    how = ""
    if bucketed:
        partial.bucket_for, partial.bucket_by = consumer_id, tuple(edge.columns)
        how = (f", bucketed by {list(edge.columns)} into {consumer_id}'s partitions (Spark's "
               f"exchange of the aggregation, made durable)")
    after = f"; {consumer_id} then runs {', '.join(dict.fromkeys(split.after))} over the " \
        "merged aggregates" if split.after else ""
    if mapped:
        how = (" (Spark's map stage alone, cut from its plan: each task's partials durable "
               "as it commits)")
    per = "per split" if mapped else "per wave"
    plan.cuts[pid] = Cut(pid, True, f"the map-side partial aggregates of {consumer_id} "
                         f"({_exchanges(split)}), {per} of {vertex.id}'s splits{how}{after}",
                         partial_of=consumer_id, bucket_for=partial.bucket_for,
                         map_side=mapped)
    return pid
