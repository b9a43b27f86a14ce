"""What the seam answers with: plain data (no handle into Spark) and the interface itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from spark_ckpt.clock import Clock

__all__ = ["Expr", "PlanNode", "SparkApi", "walk"]


@dataclasses.dataclass(frozen=True)
class Expr:
    """An expression of an analysed plan, as plain data (no handle into Spark).

    ``kind`` is Spark's class name (``AttributeReference``, ``Alias``, ``AggregateExpression``,
    ``Sum``...), ``sql`` its SQL text. For an ``AggregateExpression``: ``distinct``,
    ``filtered`` and ``function`` (the aggregate function); ``pretty_name`` is a function's.
    """

    kind: str
    sql: str
    name: str = ""
    data_type: str = ""  # SQL type name, e.g. BIGINT, DECIMAL(20,2)
    children: tuple[Expr, ...] = ()
    distinct: bool = False
    filtered: bool = False
    function: Expr | None = None
    pretty_name: str = ""


@dataclasses.dataclass(frozen=True)
class PlanNode:
    """A node of an analysed logical plan, as plain data."""

    kind: str  # Spark's class name: Aggregate, Project, Filter, LogicalRelation...
    name: str  # its nodeName
    deterministic: bool
    children: tuple[PlanNode, ...] = ()
    grouping: tuple[Expr, ...] = ()  # an Aggregate's grouping expressions
    aggregates: tuple[Expr, ...] = ()  # an Aggregate's output expressions
    # it is the plan of the frame analyzed_plan was asked to mark (the lowest such node: not
    # an identity projection or alias over it)
    marked: bool = False
    subquery: bool = False  # its expressions hold a subquery (a plan of their own)


class SparkApi(Protocol):
    """What spark_ckpt asks of a Spark session beyond the DataFrame API."""

    kind: str  # "classic" or "connect"

    def app_id(self) -> str:
        """The Spark application's id (the server's, on Connect)."""

    def default_parallelism(self) -> int:
        """How many tasks Spark runs at once by default."""

    def job_group(self, group: str, description: str, *,
                  owner: str | None = None) -> AbstractContextManager[None]:
        """Every Spark job this thread starts inside belongs to ``group`` (cancellable with
        :meth:`cancel_group`); the thread's previous group is back after it. ``owner`` tags the
        jobs with the driver attempt or run too (on Spark Connect, where a later driver
        interrupts by it what a killed one left running)."""

    def describe(self, text: str) -> None:
        """Label the next Spark jobs of this thread in the UI (no-op where unsupported)."""

    def cancel_group(self, group: str) -> None:
        """Cancel the running jobs of ``group``, interrupting their tasks."""

    def executed_plan(self, df: DataFrame) -> str:
        """The physical plan's text (what ``explain()`` prints as the physical plan)."""

    def hash_partitioning(self, df: DataFrame) -> tuple[tuple[str, ...] | None, int] | None:
        """How ``df``'s physical plan leaves its rows when the plan ends hash partitioned:
        (the key columns, or None when a key is an expression; the number of partitions).
        None when it is not hash partitioned or this session cannot tell."""

    def ends_hash_partitioned(self, df: DataFrame, key: tuple[str, ...], n: int,
                              plan: str | None = None) -> bool:
        """True only when ``df``'s physical plan ends with row *r* in partition
        ``pmod(hash(key), n)`` of *r*: a ``repartition(n, *key)`` on top would be redundant.
        False when it does not or this session cannot tell (the caller then repartitions).
        ``plan``: ``df``'s :meth:`executed_plan`, when the caller has it already."""

    def deterministic(self, df: DataFrame) -> bool | None:
        """Whether ``df``'s analysed plan is deterministic; None: cannot tell."""

    def size_estimate(self, df: DataFrame) -> int | None:
        """The optimizer's size estimate of ``df`` in bytes; None: cannot tell."""

    def data_source_available(self, name: str) -> bool | None:
        """Whether ``spark.read.format(name)`` resolves in this session (Spark's own lookup,
        runs nothing), with what it needs beside its own jar (Kafka's: its client library);
        None: cannot tell without building a read (Spark Connect)."""

    def observe(self, df: DataFrame, name: str, *columns: Column, clock: Clock | None = None
                ) -> tuple[DataFrame, Callable[[float], dict[str, Any] | None]] | None:
        """``df`` with the aggregates ``columns`` computed over its rows as a job reads them
        (Spark's ``observe``: no job of its own), and a reader of their values: a dict once a
        job that read ``df`` has reported them (waiting at most the seconds given, of ``clock``,
        for Spark to hand them over), None when none has. A job that reads only part of ``df`` (a
        limit) reports what it read. None: this session cannot tell when they are reported
        (Spark Connect)."""

    def provably_empty(self, df: DataFrame) -> bool:
        """True when the optimizer reduced ``df`` to no rows."""

    def analyzed_plan(self, df: DataFrame, mark: DataFrame | None = None) -> PlanNode | None:
        """``df``'s analysed logical plan as plain data; None: cannot tell. Nodes that are
        ``mark``'s own analysed plan (where ``df`` was built over ``mark``) are ``marked``."""

    def plan_child_frame(self, df: DataFrame) -> DataFrame | None:
        """A DataFrame of the analysed plan's single child (what an aggregation reads);
        None: cannot tell."""

    def plan_frame(self, df: DataFrame, path: tuple[int, ...]) -> DataFrame | None:
        """A DataFrame of the node of ``df``'s analysed plan at ``path`` (child indices from
        the root; ``()`` is ``df`` itself); None: cannot tell."""

    def replace_plan(self, df: DataFrame, path: tuple[int, ...],
                     replacement: DataFrame) -> DataFrame | None:
        """``df`` with the node of its analysed plan at ``path`` replaced by ``replacement``,
        whose columns are that node's, by position, of the same types: everything above the
        node reads ``replacement``'s rows as it read the node's. None: cannot tell."""

    def map_side_plan(self, df: DataFrame) -> bool:
        """True when :meth:`map_side` can cut ``df``'s plan (asked while planning; runs
        nothing)."""

    def map_side(self, df: DataFrame) -> tuple[DataFrame, list[tuple[str, ...]]] | None:
        """The rows that enter the shuffle of ``df``'s aggregation: its map stage alone, each
        task's partial aggregates (Spark's own, from its physical plan), in ``df``'s columns
        and types; merging them with the same aggregates gives ``df``'s rows. ``df`` may be a
        union of several such aggregations of one input (each branch's other columns
        constants): then each has its map stage, their tasks in turn in the answer's
        partitions where they have as many tasks (a split's tasks side by side). Returns
        (the rows, the files each of their Spark partitions reads: task *t* computes the
        partials of exactly those files' rows). None when ``df`` is not such
        an aggregation (an aggregate whose buffer is not its result, anything after the
        aggregation, a second shuffle), its map side reads anything but files, or this session
        cannot cut a physical plan (Spark Connect). Runs the plan's broadcasts."""

    def prefer_locations(self, df: DataFrame, partitions: int,
                         locations: Mapping[int, tuple[str, str]]
                         ) -> tuple[DataFrame, Callable[[], dict[int, tuple[str, str]]]] | None:
        """``df``'s rows, partition for partition (``partitions`` of them, a stateful stage's
        key-group ranges), each partition's task preferring the executor ``locations`` names
        for it, ``(host, executor id)``, while that executor is alive (Spark's
        ExecutorCacheTaskLocation, as Structured Streaming's state stores get; Spark's delay
        scheduling waits ``spark.locality.wait.process`` for it), else its host while another
        executor runs there, else (no place yet, or a host lost) the live executor with the
        fewest ranges so far. Returns the frame and a
        function that, once a job over it has ended, tells where each partition's successful
        task ran, ``(host, executor id)``. None where this cannot be done: Spark Connect, a
        classic session without spark_ckpt's jar, one executor (``local[*]``), or ``df`` not
        in ``partitions`` partitions; the caller runs ``df`` as it is."""

    def session_id(self) -> str | None:
        """The Spark Connect session this client works in; None on a classic session (whose
        jobs end with its driver)."""

    def session_user(self) -> str | None:
        """The user the Spark Connect server knows this client as; None on classic."""

    def interrupt_session(self, session_id: str, tag: str, user: str | None) -> list[str]:
        """Interrupt the operations tagged ``tag`` still running in another client's session
        (a crashed client's: the server runs them on after the client is gone); the ids
        interrupted. Nothing else of that session is touched (a notebook's session may have
        moved on to other work)."""

    def operation_id(self, operation_id: str) -> AbstractContextManager[None]:
        """Within the block, the next Spark operation this thread starts on Spark Connect has
        ``operation_id`` (a UUID4), so a record written before it names it; nothing on classic
        (whose jobs end with its driver)."""

    def await_operation(self, session_id: str, user: str | None, operation_id: str,
                        timeout_s: float, *, clock: Clock | None = None) -> str:
        """Wait up to ``timeout_s`` (of ``clock``, the system clock by default) for operation
        ``operation_id`` of another client's session (a killed client's: the server runs it
        on) to end: ``"succeeded"``, ``"failed"`` (it
        ended with an error or was interrupted), ``"gone"`` (the server has no such
        operation: never started, or ended and forgotten, or its session closed),
        ``"ended"`` (it ended, and the server cannot say how: tell by what it wrote) or
        ``"running"`` (still, at the timeout). Always ``"gone"`` on classic."""


def walk(node: PlanNode) -> Iterator[PlanNode]:
    """Every node under (and including) ``node``."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children)
