"""The job graph both capabilities share: vertices with a parallelism, joined by edges.

A vertex is split into ``parallelism`` partitions (execution vertices). An edge says which of
the producer's partitions the consumer's partition *i* reads:

* ``hash`` by columns: sub-partition *i* of every producer partition (the producer splits its
  output by ``pmod(hash(columns), consumer parallelism)``),
* ``forward``: producer partition *i* only (equal parallelism),
* ``broadcast``: every producer partition, whole.

The graph is built once per job submission and never mutated after :meth:`JobGraph.validate`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.names import check_name

__all__ = ["Edge", "EdgeKind", "JobGraph", "JobVertex", "SinkSpec"]

EdgeKind = Literal["hash", "forward", "broadcast"]


@dataclasses.dataclass(frozen=True)
class Edge:
    """An input of a vertex: which upstream vertex, and how its output is partitioned."""

    upstream: str
    kind: EdgeKind
    columns: tuple[str, ...] = ()

    def producer_partitions(self, consumer_partition: int, producer_parallelism: int) -> range:
        """Producer partitions whose output the consumer's ``consumer_partition`` reads."""
        if self.kind == "forward":
            return range(consumer_partition, consumer_partition + 1)
        return range(producer_parallelism)

    def consumer_partitions(self, producer_partition: int, consumer_parallelism: int) -> range:
        """Consumer partitions that read anything of producer partition ``producer_partition``."""
        if self.kind == "forward":
            return range(producer_partition, producer_partition + 1)
        return range(consumer_parallelism)

    def describe(self) -> dict[str, Any]:
        return {"upstream": self.upstream, "kind": self.kind, "columns": list(self.columns)}


@dataclasses.dataclass(frozen=True)
class SinkSpec:
    """Where a vertex's final output goes; committed once per job (see spark_ckpt.sinks)."""

    name: str
    kind: Literal["delta", "parquet"]
    path: str
    mode: str = "append"  # error, append, overwrite, overwrite_partitions, merge
    partition_by: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()  # merge: the columns that identify a row

    def describe(self) -> dict[str, Any]:
        out = dataclasses.asdict(self) | {"partition_by": list(self.partition_by)}
        out["keys"] = list(self.keys)
        if not self.keys:
            del out["keys"]  # so fingerprints recorded before sinks had keys still match
        return out


@dataclasses.dataclass(eq=False)
class JobVertex:
    """One vertex. ``fn`` maps the input DataFrames (in ``inputs`` order) to the output.

    Attributes:
        id: stable name, unique in the job; used in paths and events.
        parallelism: number of partitions.
        inputs: edges from upstream vertices (empty for sources).
        fn: DataFrame function; None for sources (their reader is ``source``).
        key: columns of the output that identify a row's partition when ``fn`` shuffles.
        source: a batch.sources.Source for source vertices.
        sinks: sinks fed with this vertex's output.
        version: user-chosen code version; changing it invalidates earlier finished work.
        durable: False runs the vertex inside each consumer (no result partitions, no events;
            it re-runs with its consumer), like an operator chained in Flink. The effective
            value, decided at run time (batch.cuts) unless ``declared_durable`` is set.
        declared_durable: what the user declared: True, False, or None (the planner decides).
        partial_of: set on a vertex the planner inserted: the map-side partial aggregates of
            this consumer, which then merges them with ``fn_final``.
        exchange_of: set on a vertex the planner inserted: a source's rows on their way to
            this consumer, which reads them bucketed (see ``bucket_for``).
        bucket_for: the one consumer that reads this vertex hashed by ``bucket_by``: its
            output is written bucketed by those columns into the consumer's partitions, a
            durable form of the exchange Spark would run inside the consumer (batch.cuts).
        map_side: set on a partial vertex whose waves run as Spark's map stage alone, one
            task a split and aggregation, each split durable when its tasks committed
            (batch.cuts; classic sessions).
    """

    id: str
    parallelism: int
    inputs: tuple[Edge, ...] = ()
    fn: Callable[..., Any] | None = None
    key: tuple[str, ...] = ()
    source: Any = None
    sinks: list[SinkSpec] = dataclasses.field(default_factory=list)
    version: str = ""
    durable: bool = True
    # Decided when the job runs, not when it is declared: a file source's split count (the
    # recorded splits, or the files found, capped by the declared parallelism) and, for a
    # vertex declared without one, the parallelism of the vertex it inherits from. The
    # identity (descriptor) holds what was declared: an int, or "auto" for None.
    auto_parallelism: bool = False
    inherits: str | None = None
    declared_parallelism: int | str = "auto"
    declared_durable: bool | None = None
    partial_of: str | None = None
    fn_final: Callable[..., Any] | None = None
    exchange_of: str | None = None
    bucket_for: str | None = None
    bucket_by: tuple[str, ...] = ()
    map_side: bool = False

    def __post_init__(self) -> None:
        if self.declared_durable is None and not self.durable:
            self.declared_durable = False  # built with durable=False: that is a declaration

    @property
    def is_source(self) -> bool:
        return self.source is not None

    def descriptor(self) -> dict[str, Any]:
        """What identifies this vertex's partitioning and output across driver attempts."""
        return {
            "id": self.id,
            # "auto" keeps the identity of a job whose source gained a file: a recovered run
            # reads the recorded files, so its partitions mean what they meant.
            "parallelism": self.declared_parallelism if self.auto_parallelism
            else self.parallelism,
            "inputs": [e.describe() for e in self.inputs],
            "key": list(self.key),
            "source": self.source.describe() if self.source is not None else None,
            "sinks": [s.describe() for s in self.sinks],
            "version": self.version,
            # undeclared counts as True, as before cuts were planned: fingerprints recorded
            # by earlier releases still match (the decision is recorded with the vertex)
            "durable": True if self.declared_durable is None else self.declared_durable,
            "fn": _function_identity(self.fn),
        }

    def fingerprint(self) -> str:
        blob = json.dumps(self.descriptor(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _function_identity(fn: Callable[..., Any] | None) -> str | None:
    """Name and code of ``fn``: the same under ``spark-submit`` (``__main__``) and import.

    An edited body changes the identity, so its earlier finished partitions run again. Values
    captured from the enclosing scope are not seen: change ``version=`` when they change.
    """
    if fn is None:
        return None
    name = getattr(fn, "__qualname__", type(fn).__name__)
    code = getattr(fn, "__code__", None)
    if code is None:
        return name
    digest = hashlib.sha256()
    stack = [code]
    while stack:
        c = stack.pop()
        digest.update(c.co_code)
        for const in c.co_consts:
            if hasattr(const, "co_code"):
                stack.append(const)
            else:
                digest.update(_stable_repr(const).encode())
        digest.update(repr(c.co_names).encode())
    return f"{name}:{digest.hexdigest()[:12]}"


def _stable_repr(value: Any) -> str:
    """``repr`` that is the same in every process: set constants iterate in an order that
    depends on ``PYTHONHASHSEED``, so their members are sorted."""
    if isinstance(value, frozenset | set):
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_stable_repr(v) for v in value) + ",)"
    return repr(value)


class JobGraph:
    """Vertices in insertion order plus the reverse (consumer) edges, computed on validate."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.vertices: dict[str, JobVertex] = {}
        self._consumers: dict[str, list[tuple[str, Edge]]] = {}

    def add(self, vertex: JobVertex) -> JobVertex:
        if vertex.id in self.vertices:
            raise JobDefinitionError(f"job {self.job_id}: vertex {vertex.id!r} is defined twice")
        check_name(f"job {self.job_id}: vertex id", vertex.id)
        if vertex.parallelism < 1:
            raise JobDefinitionError(
                f"vertex {vertex.id!r}: parallelism must be >= 1, found {vertex.parallelism}"
            )
        for edge in vertex.inputs:
            if edge.upstream not in self.vertices:
                raise JobDefinitionError(
                    f"vertex {vertex.id!r} reads {edge.upstream!r}, which is not a vertex of job "
                    f"{self.job_id} (known: {', '.join(self.vertices) or 'none'})"
                )
            upstream = self.vertices[edge.upstream]
            if edge.kind == "forward" and upstream.parallelism != vertex.parallelism:
                raise JobDefinitionError(
                    f"forward edge {edge.upstream!r} -> {vertex.id!r} needs equal parallelism, "
                    f"found {upstream.parallelism} and {vertex.parallelism}"
                )
            if edge.kind == "hash" and not edge.columns:
                raise JobDefinitionError(
                    f"hash edge {edge.upstream!r} -> {vertex.id!r} names no columns"
                )
        self.vertices[vertex.id] = vertex
        return vertex

    def validate(self) -> None:
        """Compute consumers; refuse a graph with no sink. Cycles are impossible by construction
        (a vertex can only read vertices added before it)."""
        self._consumers = {v: [] for v in self.vertices}
        for vertex in self.vertices.values():
            for edge in vertex.inputs:
                self._consumers[edge.upstream].append((vertex.id, edge))
        for vertex in self.vertices.values():
            if vertex.sinks and (vertex.declared_durable is False or not vertex.durable):
                raise JobDefinitionError(
                    f"vertex {vertex.id} has sinks ({', '.join(s.name for s in vertex.sinks)}) "
                    "but durable=False; a sink is a durable point, so its vertex must be durable"
                )
        if not any(v.sinks for v in self.vertices.values()):
            raise JobDefinitionError(f"job {self.job_id} has no sink; nothing would be written")

    def copy(self) -> JobGraph:
        """A copy a run may change (decided parallelism and cuts) without touching this one."""
        other = JobGraph(self.job_id)
        other.vertices = {vid: dataclasses.replace(v, sinks=list(v.sinks))
                          for vid, v in self.vertices.items()}
        return other

    def insert_before(self, vertex_id: str, vertex: JobVertex) -> None:
        """Insert a planner-made vertex just before ``vertex_id`` (a consumer of it), keeping
        insertion order topological; call :meth:`validate` afterwards."""
        if vertex.id in self.vertices:
            raise JobDefinitionError(f"job {self.job_id}: vertex {vertex.id!r} exists")
        items = list(self.vertices.items())
        at = next(i for i, (vid, _) in enumerate(items) if vid == vertex_id)
        self.vertices = dict(items[:at] + [(vertex.id, vertex)] + items[at:])

    def set_parallelism(self, vertex_id: str, parallelism: int) -> None:
        """Decide an auto parallelism at run time, for the vertex and those inheriting it."""
        vertex = self.vertices[vertex_id]
        if vertex.parallelism == parallelism:
            return
        if not vertex.auto_parallelism:
            raise JobDefinitionError(
                f"vertex {vertex_id}: expected parallelism {vertex.parallelism} as declared, "
                f"found {parallelism}"
            )
        vertex.parallelism = parallelism
        for other in self.vertices.values():
            if other.inherits == vertex_id:
                self.set_parallelism(other.id, parallelism)

    def consumers(self, vertex_id: str) -> list[tuple[str, Edge]]:
        return self._consumers[vertex_id]

    def is_virtual(self, vertex_id: str) -> bool:
        """A vertex read in place by its consumers: a source without sinks (Spark reads it
        again, natively, where it is needed) or a vertex marked ``durable=False`` (computed
        inside each consumer). Its partitions are never run and always available.
        """
        vertex = self.vertices[vertex_id]
        return (vertex.is_source and not vertex.sinks) or not vertex.durable

    def topological(self) -> list[JobVertex]:
        return list(self.vertices.values())  # insertion order is topological

    def live_vertices(self) -> list[JobVertex]:
        """Vertices some sink depends on; the rest are never computed (like DStreamGraph)."""
        live: set[str] = set()
        stack = [v.id for v in self.vertices.values() if v.sinks]
        while stack:
            vid = stack.pop()
            if vid in live:
                continue
            live.add(vid)
            stack.extend(e.upstream for e in self.vertices[vid].inputs)
        return [v for v in self.vertices.values() if v.id in live]

    def downstream_closure(self, seeds: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
        """Every (vertex, partition) that read, directly or not, one of ``seeds``."""
        seen: set[tuple[str, int]] = set()
        stack = list(seeds)
        while stack:
            vid, p = stack.pop()
            for consumer_id, edge in self._consumers[vid]:
                consumer = self.vertices[consumer_id]
                for q in edge.consumer_partitions(p, consumer.parallelism):
                    if (consumer_id, q) not in seen:
                        seen.add((consumer_id, q))
                        stack.append((consumer_id, q))
        return seen

    def restart_set(self, finished: set[tuple[str, int]],
                    virtual: set[tuple[str, int]] = frozenset()  # type: ignore[assignment]
                    ) -> dict[str, list[int]]:
        """Partitions to run so every sink partition is finished (FLIP-383, step 4).

        From every unfinished partition of a sink vertex, walk upstream through the edges and
        collect every unfinished producer partition it needs. ``virtual`` partitions (sources
        and ``durable=False`` vertices) never run themselves, but what they read is needed.
        """
        needed: set[tuple[str, int]] = set()
        seen: set[tuple[str, int]] = set()
        stack: list[tuple[str, int]] = []
        for vertex in self.live_vertices():
            if vertex.sinks:
                for p in range(vertex.parallelism):
                    if (vertex.id, p) not in finished:
                        stack.append((vertex.id, p))
        while stack:
            vid, p = stack.pop()
            if (vid, p) in seen:
                continue
            seen.add((vid, p))
            if (vid, p) not in virtual:
                needed.add((vid, p))
            for edge in self.vertices[vid].inputs:
                upstream = self.vertices[edge.upstream]
                for q in edge.producer_partitions(p, upstream.parallelism):
                    if (upstream.id, q) not in finished and (upstream.id, q) not in seen:
                        stack.append((upstream.id, q))
        plan: dict[str, list[int]] = {}
        for vertex in self.topological():
            parts = sorted(p for (vid, p) in needed if vid == vertex.id)
            if parts:
                plan[vertex.id] = parts
        return plan

    def ids(self) -> Sequence[str]:
        return list(self.vertices)
