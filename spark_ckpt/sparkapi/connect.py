"""The seam on a Spark Connect session: what the client protocol offers.

A Connect client has no JVM: job groups become operation tags (thread-local in the client,
interrupted with ``interruptTag``), plan facts come from the server's ``explain`` text, and
what Connect cannot tell is answered ``None`` so callers keep their guarantee (see
:mod:`spark_ckpt.sparkapi`). The only module of spark_ckpt that touches Connect internals.
"""
# ruff: noqa: SLF001 - the Connect DataFrame's explain text is this module's purpose

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from spark_ckpt.errors import EnvironmentError_
from spark_ckpt.sparkapi.types import PlanNode

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["ConnectSpark"]

log = logging.getLogger(__name__)

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "PiB": 1 << 50, "EiB": 1 << 60}
_SIZE = re.compile(r"sizeInBytes=([0-9.]+(?:E[0-9]+)?) ?(B|KiB|MiB|GiB|TiB|PiB|EiB)")
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


def _normalized_plan(text: str) -> str:
    """A physical plan's text without what differs between two analyses of one plan:
    expression ids (``#12``, ``#12L``) and plan ids."""
    text = re.sub(r"#\d+L?", "", text)
    return re.sub(r",? ?\[plan_id=\d+\]", "", text).strip()


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
        text = df._explain_string(mode="simple")
        lines = _section(text, "Physical Plan")
        if not lines:  # never read an unknown format as "no exchanges"
            raise EnvironmentError_("expected a '== Physical Plan ==' section in the Spark "
                                f"Connect server's explain text, found: {text[:500]!r}")
        return "\n".join(lines)

    def hash_partitioning(self, df: DataFrame) -> tuple[tuple[str, ...] | None, int] | None:
        return None  # not in the explain text: callers repartition by the key themselves

    def ends_hash_partitioned(self, df: DataFrame, key: tuple[str, ...], n: int) -> bool:
        """Asked the only way the explain text allows: Spark's planner drops a user's
        ``repartition(n, *key)`` whose child is already partitioned that way (the same hash
        partitioning, semantically), and nothing else makes the physical plan come out
        unchanged: a repartition of another partitioning either stays (an exchange more) or
        collapses into the child's repartition (an exchange that reads differently). So the
        answer is True only when the two plans' texts are the same but for expression ids."""
        try:
            before = self.executed_plan(df)
            after = self.executed_plan(df.repartition(n, *key))
        except Exception as exc:  # an analysis error names a missing column elsewhere
            log.debug("Spark Connect: cannot compare plans for partitioning: %s", exc)
            return False
        for text in (before, after):
            # A bucketed scan turned plain after EnsureRequirements dropped the repartition
            # for it (DisableUnnecessaryBucketedScan runs later and does not know): both
            # texts read the same, and the rows are in file splits. And a plan printed with
            # fields left out may hide the partition count that tells two plans apart.
            if "disabled by query planner" in text or "more field" in text:
                return False
        return _normalized_plan(before) == _normalized_plan(after)

    def deterministic(self, df: DataFrame) -> bool | None:
        return None

    def size_estimate(self, df: DataFrame) -> int | None:
        lines = _section(df._explain_string(mode="cost"), "Optimized Logical Plan")
        found = _SIZE.search(lines[0]) if lines else None
        if not found:
            return None
        return int(float(found.group(1)) * _UNITS[found.group(2)])

    def provably_empty(self, df: DataFrame) -> bool:
        lines = _section(df._explain_string(mode="extended"), "Optimized Logical Plan")
        return bool(lines) and lines[0].startswith("LocalRelation <empty>")

    def analyzed_plan(self, df: DataFrame) -> PlanNode | None:
        return None

    def plan_child_frame(self, df: DataFrame) -> DataFrame | None:
        return None

    def session_id(self) -> str | None:
        return str(self.spark.session_id)

    def session_user(self) -> str | None:
        user = getattr(self.spark.client, "_user_id", None)
        return str(user) if user else None

    def interrupt_session(self, session_id: str, tag: str, user: str | None) -> list[str]:
        """Attach a second client to ``session_id`` (as ``user``: the server finds sessions
        by user and id) over this client's channel settings (URL, token) and interrupt the
        operations tagged ``tag``. A session the server closed or forgot has nothing left."""
        from pyspark.sql.connect.client import SparkConnectClient

        if session_id == self.session_id():
            return []
        builder = copy.copy(self.spark.client._builder)
        builder._params = {**builder._params, "session_id": session_id}
        if user:
            builder._params["user_id"] = user
        client = SparkConnectClient(connection=builder)
        try:
            return list(client.interrupt_tag(tag) or [])
        except Exception as exc:
            if "SESSION_CLOSED" in str(exc) or "SESSION_NOT_FOUND" in str(exc):
                return []  # released by its driver, or expired: nothing runs there
            raise
        finally:
            client.close()
