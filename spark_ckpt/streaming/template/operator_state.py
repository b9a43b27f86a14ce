"""A stateful operator's state in a running pipeline, kept apart from its template node.

The template node (:class:`~spark_ckpt.streaming.template.keyed.StatefulStream`) is the recipe:
keys, aggregations or processor, requested parallelism; it never changes once ``start()``
runs. What a run learns and changes goes here:

* :class:`OperatorState` (and :class:`AggState`, :class:`ProcessState`): the live state handles
  per task, their measurements, the evolution found at a restore, the schemas learnt at the
  first batch. ``start()`` makes one per operator on the user's thread before any thread runs;
  from then on **one thread owns it, the JobScheduler's** (it runs the operators' jobs). No
  other thread reads it.
* :class:`OperatorSnapshot`: what other threads may read (``state_view()`` on the user's
  thread, the checkpoint coordinator's sweep through ``live_files``): a frozen value the owner
  builds after each change and publishes on the :class:`SnapshotBoard` by replacing one
  reference. A reader holding a snapshot keeps it whole while batches run.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from spark_ckpt.state.chain import StateHandle

__all__ = ["AggState", "OperatorSnapshot", "OperatorState", "ProcessState", "SnapshotBoard"]


@dataclasses.dataclass(eq=False)
class OperatorState:
    """One stateful operator's runtime state. Owner: the JobScheduler's thread (``start()``
    before it runs)."""

    parallelism: int
    max_parallelism: int
    live: dict[int, StateHandle]  # task index -> its state handle after the last batch
    metrics: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    restore_from: list[StateHandle] | None = None  # a rescale: the restored handles
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # kept in checkpoints
    restored_describe: dict[str, Any] = dataclasses.field(default_factory=dict)
    # set at a restore whose stored state differs from the declared one: where declared
    # columns come from, and whether the next job must rewrite every restored range
    evolution: Any = None  # state.evolution.Evolution | None
    rewrite: bool = False
    routing: dict[str, Any] | None = None  # the _kg and _pid columns, built once
    batch_id: int = -1  # the last batch that ran the operator's job
    # task index -> (host, executor id) its last successful task ran on, for this
    # parallelism (spark_ckpt.sparkapi's prefer_locations); not checkpointed: a new driver has
    # new executors
    locations: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    locations_parallelism: int = 0

    def live_files(self) -> frozenset[str]:
        return frozenset(f.path for h in self.live.values() for f in h.files)


@dataclasses.dataclass(eq=False)
class AggState(OperatorState):
    """An aggregation's runtime state: also what it learnt from the input's schema."""

    spec: Any = None  # state.aggregates.AggSpec, learnt at the first batch
    empty_view: Any = None  # the update stream's view with no rows
    chain_schemas: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    partials: list[Any] | None = None  # the partial aggregate columns
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)  # output renames: new -> old
    types_checked: bool = False  # the restored state's types, against the input's


@dataclasses.dataclass(eq=False)
class ProcessState(OperatorState):
    """A processor's runtime state: also its parsed schemas."""

    state_schema: Any = None  # state.schema.StateSchema, parsed at a restore or first batch
    key_schema: Any = None  # the keys' Arrow schema, learnt at the first batch
    output_schema: Any = None  # a StructType, parsed at the first batch


@dataclasses.dataclass(frozen=True)
class OperatorSnapshot:
    """What one operator's state was after ``batch_id`` (-1: as restored, before any batch),
    immutable: readers on any thread keep it whole while later batches run."""

    operator: str
    batch_id: int
    parallelism: int
    max_parallelism: int
    handles: tuple[StateHandle, ...]
    live_files: frozenset[str]
    describe: Mapping[str, Any]  # what a reader needs to decode the state files
    extra: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))  # e.g. a processor's max event time
    spec: Any = None  # an aggregation's AggSpec once known (turns state rows into its view)
    evolution: Any = None


class SnapshotBoard:
    """The newest :class:`OperatorSnapshot` of every operator. One writer at a time (the
    owner of the operators' state: ``start()``, then the JobScheduler's thread) publishes by
    replacing the whole mapping; readers on any thread take the current one without a lock."""

    def __init__(self) -> None:
        self._current: Mapping[str, OperatorSnapshot] = types.MappingProxyType({})

    def publish(self, snapshot: OperatorSnapshot) -> None:
        self._current = types.MappingProxyType({**self._current,
                                                snapshot.operator: snapshot})

    def get(self, operator: str) -> OperatorSnapshot | None:
        return self._current.get(operator)

    def all(self) -> Mapping[str, OperatorSnapshot]:
        return self._current
