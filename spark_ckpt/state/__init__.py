"""Keyed state: key groups, aggregations, the KeyedProcessor API, backends, and reading state."""

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
from spark_ckpt.state.reader import read_state
from spark_ckpt.state.rewrite import raw_state, rewrite_state

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
    "count",
    "first",
    "last",
    "max_",
    "mean",
    "min_",
    "raw_state",
    "read_state",
    "rewrite_state",
    "sum_",
]
