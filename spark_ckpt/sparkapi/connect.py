"""The seam on a Spark Connect session: what the client protocol offers.

A Connect client has no JVM: job groups become operation tags (thread-local in the client,
interrupted with ``interruptTag``), plan facts come from the server's ``explain`` text, an
aggregation's plan from the client's own plan tree (:mod:`spark_ckpt.sparkapi.connect_plan`),
and what Connect cannot tell is answered ``None`` so callers keep their guarantee (see
:mod:`spark_ckpt.sparkapi`). With ``connect_plan``, the only modules of spark_ckpt that touch
Connect internals.
"""
# ruff: noqa: SLF001 - the Connect DataFrame's explain text is this module's purpose

from __future__ import annotations

import contextlib
import copy
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from spark_ckpt.clock import Clock, SystemClock
from spark_ckpt.errors import EnvironmentError_
from spark_ckpt.sparkapi import plans
from spark_ckpt.sparkapi.types import PlanNode

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.connect.client import SparkConnectClient

__all__ = ["ConnectSpark"]

log = logging.getLogger(__name__)

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "PiB": 1 << 50, "EiB": 1 << 60}
_SIZE = re.compile(r"sizeInBytes=([0-9.]+(?:E[0-9]+)?) ?(B|KiB|MiB|GiB|TiB|PiB|EiB)")
# what a reattach to an operation the server no longer has answers
_GONE = ("OPERATION_NOT_FOUND", "SESSION_NOT_FOUND", "SESSION_CLOSED", "OPERATION_ABANDONED")
_PENDING = threading.local()  # operation_id(): the id the next operation of a thread takes
_SPLITS = re.compile(r"Range \(0, \d+, step=1, splits=(\d+)\)")


def _section(text: str, header: str) -> list[str]:
    """The lines of one ``== header ==`` section of an explain text."""
    lines = text.splitlines()
    try:
        start = lines.index(f"== {header} ==") + 1
    except ValueError:
        return []
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("== ")),
               len(lines))
    return lines[start:end]


class ConnectSpark:
    """:class:`spark_ckpt.sparkapi.SparkApi` over a Spark Connect client."""

    kind = "connect"

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark

    def app_id(self) -> str:
        return str(self.spark.conf.get("spark.app.id", "") or "")

    def default_parallelism(self) -> int:
        # spark.range without a partition count takes the server's default parallelism; the
        # physical plan says how many splits (analysis only: no job runs)
        text = self.executed_plan(self.spark.range(1 << 20))
        found = _SPLITS.search(text)
        if not found:
            log.warning("Spark Connect: no 'Range (..., splits=N)' in the server's plan of "
                        "spark.range; taking a default parallelism of 2. The plan:\n%s", text)
            return 2
        return int(found.group(1))

    @contextlib.contextmanager
    def job_group(self, group: str, description: str, *,
                  owner: str | None = None) -> Iterator[None]:
        tags = [t for t in (group, owner) if t]
        added = [t for t in tags if t not in self.spark.getTags()]
        for tag in added:
            self.spark.addTag(tag)
        try:
            yield
        finally:
            for tag in added:
                self.spark.removeTag(tag)

    def describe(self, text: str) -> None:
        """Connect has no per-thread job description; the operation tags name the work."""

    def cancel_group(self, group: str) -> None:
        self.spark.interruptTag(group)

    def executed_plan(self, df: DataFrame) -> str:
        text = df._explain_string(mode="simple")  # type: ignore[operator]
        lines = _section(text, "Physical Plan")
        if not lines:  # never read an unknown format as "no exchanges"
            raise EnvironmentError_("expected a '== Physical Plan ==' section in the Spark "
                                f"Connect server's explain text, found: {text[:500]!r}")
        return "\n".join(lines)

    def hash_partitioning(self, df: DataFrame) -> tuple[tuple[str, ...] | None, int] | None:
        return None  # not in the explain text: callers repartition by the key themselves

    def ends_hash_partitioned(self, df: DataFrame, key: tuple[str, ...], n: int,
                              plan: str | None = None) -> bool:
        """Asked the only way the explain text allows: Spark's planner drops a user's
        ``repartition(n, *key)`` whose child is already partitioned that way (the same hash
        partitioning, semantically), and nothing else makes the physical plan come out
        unchanged: a repartition of another partitioning either stays (an exchange more) or
        collapses into the child's repartition (an exchange that reads differently). So the
        answer is True only when the two plans' texts are the same but for expression ids."""
        try:
            before = plan if plan is not None else self.executed_plan(df)
            after = self.executed_plan(df.repartition(n, *key))
        except Exception as exc:  # noqa: BLE001 - e.g. an analysis error (a missing column)
            log.debug("Spark Connect: cannot compare plans for partitioning: %s", exc)
            return False
        for text in (before, after):
            # A bucketed scan turned plain after EnsureRequirements dropped the repartition
            # for it (DisableUnnecessaryBucketedScan runs later and does not know): both
            # texts read the same, and the rows are in file splits. And a plan printed with
            # fields left out may hide the partition count that tells two plans apart.
            if "disabled by query planner" in text or "more field" in text:
                return False
        return plans.normalized(before) == plans.normalized(after)

    def deterministic(self, df: DataFrame) -> bool | None:
        return None

    def size_estimate(self, df: DataFrame) -> int | None:
        lines = _section(df._explain_string(mode="cost"), "Optimized Logical Plan")  # type: ignore[operator]
        found = _SIZE.search(lines[0]) if lines else None
        if not found:
            return None
        return int(float(found.group(1)) * _UNITS[found.group(2)])

    def data_source_available(self, name: str) -> bool | None:
        return None  # the server resolves it: only a read built there tells

    def observe(self, df: DataFrame, name: str, *columns: Column, clock: Clock | None = None
                ) -> tuple[DataFrame, Callable[[float], dict[str, Any] | None]] | None:
        return None  # a Connect client learns metrics with an action's own result only

    def provably_empty(self, df: DataFrame) -> bool:
        lines = _section(df._explain_string(mode="extended"), "Optimized Logical Plan")  # type: ignore[operator]
        return bool(lines) and lines[0].startswith("LocalRelation <empty>")

    def analyzed_plan(self, df: DataFrame, mark: DataFrame | None = None) -> PlanNode | None:
        """From the client's plan tree, with the server asked once per aggregation for its
        output names and types (:mod:`spark_ckpt.sparkapi.connect_plan`)."""
        from spark_ckpt.sparkapi import connect_plan

        return connect_plan.analyzed_plan(df, mark)

    def plan_child_frame(self, df: DataFrame) -> DataFrame | None:
        from spark_ckpt.sparkapi import connect_plan

        if len(connect_plan.plan_children(df._plan)) != 1:  # type: ignore[attr-defined]
            return None
        return connect_plan.frame_at(df, (0,))

    def plan_frame(self, df: DataFrame, path: tuple[int, ...]) -> DataFrame | None:
        from spark_ckpt.sparkapi import connect_plan

        return connect_plan.frame_at(df, path)

    def map_side_plan(self, df: DataFrame) -> bool:
        return False  # a physical plan cannot be cut from a client

    def map_side(self, df: DataFrame) -> tuple[DataFrame, list[tuple[str, ...]]] | None:
        return None

    def prefer_locations(self, df: DataFrame, partitions: int,
                         locations: Mapping[int, tuple[str, str]]
                         ) -> tuple[DataFrame, Callable[[], dict[int, tuple[str, str]]]] | None:
        return None  # no jar reaches a Connect server from its client: Spark places the tasks

    def replace_plan(self, df: DataFrame, path: tuple[int, ...],
                     replacement: DataFrame) -> DataFrame | None:
        from spark_ckpt.sparkapi import connect_plan

        return connect_plan.replaced(df, path, replacement)

    def session_id(self) -> str | None:
        return str(self.spark.session_id)  # type: ignore[attr-defined]

    def session_user(self) -> str | None:
        user = getattr(self.spark.client, "_user_id", None)
        return str(user) if user else None

    def _client_of(self, session_id: str, user: str | None) -> SparkConnectClient:
        """A second client attached to ``session_id`` (as ``user``: the server finds sessions
        by user and id) over this client's channel settings (URL, token)."""
        from pyspark.sql.connect.client import SparkConnectClient

        builder = copy.copy(self.spark.client._builder)
        builder._params = {**builder._params, "session_id": session_id}
        if user:
            builder._params["user_id"] = user
        return SparkConnectClient(connection=builder)

    def interrupt_session(self, session_id: str, tag: str, user: str | None) -> list[str]:
        """Interrupt the operations tagged ``tag`` in session ``session_id`` (see
        :meth:`_client_of`). A session the server closed or forgot has nothing left."""
        if session_id == self.session_id():
            return []
        client = self._client_of(session_id, user)
        try:
            return list(client.interrupt_tag(tag) or [])
        except Exception as exc:
            if "SESSION_CLOSED" in str(exc) or "SESSION_NOT_FOUND" in str(exc):
                return []  # released by its driver, or expired: nothing runs there
            raise
        finally:
            client.close()

    @contextlib.contextmanager
    def operation_id(self, operation_id: str) -> Iterator[None]:
        """The Python client makes a new UUID for each operation inside its request builder.
        Two of its methods are wrapped (once per client): ``execute_command`` arms the
        thread's pending id for a write command only, and the request builder takes an armed
        id, once. An id the block's write did not take is reported (the record then names an
        operation the server never had, which the next attempt reads as gone)."""
        client = self.spark.client
        if not getattr(client, "_spark_ckpt_operation_ids", False):
            build = client._execute_plan_request_with_metadata
            execute = client.execute_command

            def build_with_id(*args: Any, **kwargs: Any) -> Any:
                request = build(*args, **kwargs)  # whatever this client's builder takes
                armed = getattr(_PENDING, "armed", None)
                if armed:
                    request.operation_id, _PENDING.armed = armed, None
                return request

            def execute_with_id(command: Any, observations: Any = None) -> Any:
                pending = getattr(_PENDING, "ids", None)
                if pending and command.HasField("write_operation"):
                    _PENDING.armed = pending.pop()
                try:
                    return execute(command, observations)
                finally:
                    _PENDING.armed = None

            client._execute_plan_request_with_metadata = build_with_id  # type: ignore[method-assign]
            client.execute_command = execute_with_id  # type: ignore[method-assign]
            client._spark_ckpt_operation_ids = True  # type: ignore[attr-defined]
        _PENDING.ids = [operation_id]
        try:
            yield
        finally:
            if _PENDING.ids:
                log.warning("Spark Connect: the write did not take operation id %s (this "
                            "client's writes are not write commands?); a client killed "
                            "during it leaves nothing the next one waits for", operation_id)
            _PENDING.ids = []

    def await_operation(self, session_id: str, user: str | None, operation_id: str,
                        timeout_s: float, *, clock: Clock | None = None) -> str:
        """Reattach to the operation (``ReattachExecute``, as a client whose stream broke
        does) and read its responses to the end: the stream ends with ``result_complete``, or
        the operation's error, or an unknown-handle error. Attached, a long operation is not
        abandoned by the server's detached timeout. Where the server cannot resend from the
        start (the killed client had released responses), the operation's status is polled
        (``GetStatus``) instead. After ``timeout_s`` of ``clock`` (the system clock by
        default): ``"running"``."""
        import grpc
        from pyspark.sql.connect.proto import base_pb2 as pb2

        clock = clock or SystemClock()
        deadline = clock.monotonic_s() + timeout_s
        unavailable = 0
        client = self._client_of(session_id, user)
        try:
            while True:
                remaining = deadline - clock.monotonic_s()
                if remaining <= 0:
                    return "running"
                request = pb2.ReattachExecuteRequest(session_id=session_id,
                                                     operation_id=operation_id,
                                                     client_type=client._builder.userAgent)
                if client._user_id:
                    request.user_context.user_id = client._user_id
                try:
                    for response in client._stub.ReattachExecute(
                            request, metadata=client._builder.metadata(), timeout=remaining):
                        if response.HasField("result_complete"):
                            return "succeeded"
                except grpc.RpcError as exc:
                    code = exc.code() if callable(getattr(exc, "code", None)) else None
                    text = f"{code}: {exc.details() if hasattr(exc, 'details') else exc}"
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        continue  # the deadline above says whether to go on
                    if code == grpc.StatusCode.UNAVAILABLE and unavailable < 5:
                        unavailable += 1  # the server restarting, or the network
                        clock.sleep(min(1.0 * unavailable, max(0.0, remaining)))
                        continue
                    if any(marker in text for marker in _GONE):
                        log.info("Spark Connect: no operation %s in session %s: %s",
                                 operation_id, session_id, text[:300])
                        return "gone"
                    if "INVALID_CURSOR" in text:
                        return _poll_status(client, operation_id, deadline, clock)
                    log.info("Spark Connect: operation %s of session %s ended with %s",
                             operation_id, session_id, text[:500])
                    return "failed"
                # the stream ended without the result: the server's longest stream; again
        finally:
            client.close()


def _poll_status(client: SparkConnectClient, operation_id: str, deadline: float, clock: Clock,
                 interval_s: float = 0.5) -> str:
    """An operation's end by its status (``GetStatus``), until ``deadline`` (``clock``'s
    monotonic time).
    ``TERMINATING`` is ``"ended"``: the operation ran to its end (its result, or its error,
    waits for a client that will never release it, until the server abandons it), and the
    status does not say which; the caller tells by what it wrote. What a server too old to
    tell answers (no such RPC) is ``"gone"``."""
    from pyspark.sql.connect.proto import base_pb2 as pb2

    states = pb2.GetStatusResponse.OperationStatus.OperationState
    while True:
        try:
            statuses = client._get_operation_statuses([operation_id]).operation_statuses
        except Exception as exc:  # noqa: BLE001 - no status: nothing to wait for
            log.info("Spark Connect: no status of operation %s: %s", operation_id, exc)
            return "gone"
        state = next((s.state for s in statuses if s.operation_id == operation_id), None)
        if state == states.OPERATION_STATE_SUCCEEDED:
            return "succeeded"
        if state in (states.OPERATION_STATE_FAILED, states.OPERATION_STATE_CANCELLED):
            return "failed"
        if state == states.OPERATION_STATE_TERMINATING:
            return "ended"
        if state != states.OPERATION_STATE_RUNNING:
            return "gone"
        if clock.monotonic_s() >= deadline:
            return "running"
        clock.sleep(interval_s)
