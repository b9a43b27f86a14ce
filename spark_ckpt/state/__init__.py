"""Keyed state: key groups, aggregations, the KeyedProcessor API, backends, snapshots and their
chains, schemas and their evolution, and the stateful tasks that run on executors.

``read_state``, ``raw_state`` and ``rewrite_state`` (the state processor, a tool that works on a
pipeline's directory) live in :mod:`spark_ckpt.ops.state_processor` and are exported by
``spark_ckpt`` itself; the names here are deprecated aliases, resolved on first use (this
package sits below the tools, so it does not import them)."""

import importlib
import warnings
from typing import Any

from spark_ckpt.state.aggregates import Agg, count, first, last, max_, mean, min_, sum_
from spark_ckpt.state.processor import (
    KeyContext,
    KeyedBatch,
    KeyedProcessor,
    ListState,
    MapState,
    Result,
    TimerService,
    ValueState,
    VectorizedProcessor,
)
from spark_ckpt.state.window_aggs import (
    approx_count_distinct,
    collect_list,
    collect_set,
    count_distinct,
    percentile,
)

__all__ = [
    "Agg",
    "KeyContext",
    "KeyedBatch",
    "KeyedProcessor",
    "ListState",
    "MapState",
    "Result",
    "TimerService",
    "ValueState",
    "VectorizedProcessor",
    "approx_count_distinct",
    "collect_list",
    "collect_set",
    "count",
    "count_distinct",
    "first",
    "last",
    "max_",
    "mean",
    "min_",
    "percentile",
    "sum_",
]


_MOVED = {"read_state", "raw_state", "rewrite_state"}


def __getattr__(name: str) -> Any:
    """Deprecated aliases of the state processor's functions (in ``ops.state_processor``)."""
    if name in _MOVED:
        warnings.warn(f"spark_ckpt.state.{name} is deprecated: use spark_ckpt.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("spark_ckpt.ops.state_processor"), name)
    raise AttributeError(f"module 'spark_ckpt.state' has no attribute {name!r}")
