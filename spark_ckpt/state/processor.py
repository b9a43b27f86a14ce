"""Arbitrary keyed state for Python, in two APIs on one typed store.

**Per key** (Flink's KeyedProcessFunction, PySpark's transformWithState): ``KeyedProcessor``
is called once per key with the key's rows of the batch::

    class RunningTotal(KeyedProcessor):
        state_schema = "total DOUBLE, seen ARRAY<STRING>"

        def process(self, key, rows, ctx):
            total = ctx.value("total")
            t = (total.get() or 0.0) + float(rows["amount"].sum())
            total.update(t)
            ctx.timers.register_processing_time(ctx.processing_time_ms + 60_000)
            yield (key[0], t)

        def on_timer(self, key, timer_ms, ctx):
            ctx.clear()          # nothing for a minute: forget the key

**Vectorized** (no Python call per key): ``VectorizedProcessor.process_batch`` sees every key of
a batch in a task's key-group range at once, its rows grouped by key and the keys' state as
columns, and returns the new state columns, the rows to emit and the timers to set (see
:class:`KeyedBatch` and :class:`Result`)::

    class RunningCount(VectorizedProcessor):
        state_schema = "n BIGINT"

        def process_batch(self, batch):
            n = batch.state["n"].fillna(0).to_numpy("int64") + batch.sizes
            out = batch.keys.assign(n=n)
            return Result(state=pd.DataFrame({"n": n}), emit=out)

State variables are declared with Spark types (schema.py): a value state of any type, a list
state an ``ARRAY<element>``, a map state a ``MAP<key, value>``, ``json`` for a JSON document.
Processing time is the batch's time (recorded with the batch, so a replayed batch sees the
same time); event time advances with the watermark, the largest event time seen in earlier
batches minus the allowed delay. With a time-to-live, a state variable expires ``ttl_ms`` of
processing time after it was last written.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from spark_ckpt.errors import JobDefinitionError

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    from spark_ckpt.state.schema import StateSchema

__all__ = ["KeyContext", "KeyRows", "KeyedBatch", "KeyedProcessor", "ListState", "MapState",
           "Result", "TimerService", "ValueState", "VectorizedProcessor"]


class KeyedProcessor:
    """Subclass, declare ``state_schema`` and override :meth:`process` (and :meth:`on_timer`
    if you register timers)."""

    #: The state variables: a DDL string (``"n BIGINT, last STRUCT<ts: TIMESTAMP>"``), a
    #: StructType or a dict of name to type. ``json`` declares a JSON document variable.
    state_schema: ClassVar[Any] = None
    #: What ``rows`` is: ``"numpy"`` (a :class:`KeyRows`, columns as numpy views: no copy and
    #: no pandas per key) or ``"pandas"`` (a slice of one pandas frame of the batch).
    rows_format: ClassVar[str] = "numpy"

    def process(self, key: tuple[Any, ...], rows: KeyRows | pd.DataFrame,
                ctx: KeyContext) -> Iterable[Any] | pd.DataFrame | None:
        """Called once per batch for every key with rows in the batch (in arrival order).
        Return or yield output rows (tuples or dicts in the output schema) or a DataFrame."""
        raise NotImplementedError

    def on_timer(self, key: tuple[Any, ...], timer_ms: int,
                 ctx: KeyContext) -> Iterable[Any] | pd.DataFrame | None:
        """A timer of this key fired (``ctx.timer_kind`` says which clock)."""
        return None


class KeyData:
    """One key's state as its task holds it during a call: the variables' values, the timers,
    the TTL deadlines, and whether the call changed any of them (the task then writes the key
    back). A processor reaches it only through its :class:`KeyContext`."""

    def __init__(self, schema: StateSchema, values: dict[str, Any],
                 timers: list[tuple[int, str]], expires: dict[str, int], *,
                 processing_time_ms: int, ttl_ms: int | None) -> None:
        self.json = schema.json_flags
        self.kinds = schema.kinds
        self.values = values
        self.timers = timers
        self.expires = expires
        self.dirty = False
        self.processing_time_ms = processing_time_ms
        self.ttl_ms = ttl_ms
        self.expire()

    def clear(self) -> None:
        """Forget every state and timer of the key."""
        if any(v is not None for v in self.values.values()) or self.timers:
            self.dirty = True
        self.values = dict.fromkeys(self.values)
        self.timers = []
        self.expires = {}

    # -- TTL: a state expires ttl_ms of processing time after its last update --------------
    def touched(self, name: str) -> None:
        """Variable ``name`` was written: the key changed, and its TTL deadline moves."""
        self.dirty = True
        if self.ttl_ms is not None:
            self.expires[name] = self.processing_time_ms + self.ttl_ms
            self.ttl_timer()

    def ttl_timer(self) -> None:
        """One TTL clean-up timer per key, at its earliest deadline."""
        self.timers = [t for t in self.timers if t[1] != "ttl"]
        if self.expires:
            self.timers.append((min(self.expires.values()), "ttl"))
            self.timers.sort()

    def expire(self) -> None:
        """Clear the variables whose deadline has passed (and re-set the TTL timer)."""
        expired = [n for n, deadline in self.expires.items()
                   if deadline <= self.processing_time_ms]
        for name in expired:
            self.values[name] = None
            del self.expires[name]
        due_ttl = any(k == "ttl" and m <= self.processing_time_ms for m, k in self.timers)
        if expired or due_ttl:
            self.ttl_timer()
            self.dirty = True


class _Var:
    def __init__(self, data: KeyData, name: str) -> None:
        self._data = data
        self._name = name

    def exists(self) -> bool:
        """Whether the variable has a value (a list or map state: a non-empty one)."""
        value = self._data.values.get(self._name)
        return value is not None and (not isinstance(value, list | dict) or bool(value))

    def clear(self) -> None:
        """Forget the variable's value (and its TTL deadline)."""
        data = self._data
        if data.values.get(self._name) is not None:
            data.values[self._name] = None
            data.dirty = True
        data.expires.pop(self._name, None)

    def _set(self, value: Any) -> None:
        self._data.values[self._name] = value
        self._data.touched(self._name)


class ValueState(_Var):
    """A value state variable of the current key (``ctx.value(name)``)."""

    def get(self) -> Any:
        """The value (None when the key has none)."""
        value = self._data.values.get(self._name)
        if value is not None and self._data.json.get(self._name):
            return json.loads(value)
        if isinstance(value, list) and value and isinstance(value[0], tuple) and \
                self._data.kinds.get(self._name) == "map":
            return dict(value)
        return value

    def update(self, value: Any) -> None:
        """Set the value (a JSON variable takes any JSON-serializable value)."""
        if value is not None and self._data.json.get(self._name):
            try:
                value = json.dumps(value, separators=(",", ":"))
            except (TypeError, ValueError) as exc:
                raise JobDefinitionError(
                    f"json state {self._name!r}: expected a JSON value (number, string, bool, "
                    f"None, list, dict with string keys), found {type(value).__name__}: {exc}"
                ) from None
        self._set(value)


class ListState(_Var):
    """A list state variable of the current key (``ctx.list(name)``)."""

    def get(self) -> list[Any]:
        """The elements (a copy; empty when the key has none)."""
        return list(self._data.values.get(self._name) or [])

    def append(self, value: Any) -> None:
        """Add one element at the end."""
        self._set([*self.get(), value])

    def extend(self, values: Iterable[Any]) -> None:
        """Add elements at the end."""
        self._set([*self.get(), *values])

    def put(self, values: Iterable[Any]) -> None:
        """Replace the elements."""
        self._set(list(values))


class MapState(_Var):
    """A map state variable of the current key (``ctx.map(name)``)."""

    def _map(self) -> dict[Any, Any]:
        raw = self._data.values.get(self._name)
        if raw is None:
            return {}
        if isinstance(raw, list):  # as Arrow gives a map: (key, value) pairs
            raw = dict(raw)
            self._data.values[self._name] = raw
        return raw

    def get(self, key: Any, default: Any = None) -> Any:
        """The value of ``key`` (``default`` when absent)."""
        return self._map().get(key, default)

    def put(self, key: Any, value: Any) -> None:
        """Set the value of ``key``."""
        items = dict(self._map())
        items[key] = value
        self._set(items)

    def remove(self, key: Any) -> None:
        """Remove ``key`` (nothing when absent)."""
        items = dict(self._map())
        if key in items:
            del items[key]
            self._set(items)

    def contains(self, key: Any) -> bool:
        """Whether ``key`` is in the map."""
        return key in self._map()

    def keys(self) -> list[Any]:
        """The map's keys."""
        return list(self._map())

    def items(self) -> list[tuple[Any, Any]]:
        """The map's (key, value) pairs."""
        return list(self._map().items())


class TimerService:
    """Timers of the current key: ``(time ms, "event" | "processing")`` entries."""

    def __init__(self, data: KeyData) -> None:
        self._data = data

    def _add(self, ms: int, kind: str) -> None:
        entry = (int(ms), kind)
        timers = self._data.timers
        if entry not in timers:
            timers.append(entry)
            timers.sort()
            self._data.dirty = True

    def register_event_time(self, ms: int) -> None:
        """Fire ``on_timer`` once the watermark reaches ``ms``."""
        self._add(ms, "event")

    def register_processing_time(self, ms: int) -> None:
        """Fire ``on_timer`` in the first batch whose processing time reaches ``ms``."""
        self._add(ms, "processing")

    def delete(self, ms: int, kind: str = "event") -> None:
        """Delete the timer at ``ms`` of clock ``kind`` (nothing when there is none)."""
        timers = self._data.timers
        if (int(ms), kind) in timers:
            timers.remove((int(ms), kind))
            self._data.dirty = True

    def list(self) -> list[tuple[int, str]]:
        """The key's timers, ``(ms, kind)``, earliest first."""
        return [t for t in self._data.timers if t[1] != "ttl"]


class KeyContext:
    """What a processor sees of one key: its typed states, its timers and the clocks."""

    def __init__(self, schema: StateSchema, data: KeyData, *, watermark_ms: int | None) -> None:
        self._schema = schema
        self._kinds = schema.kinds
        self._data = data
        self.processing_time_ms = data.processing_time_ms
        self.watermark_ms = watermark_ms
        self.timer_kind: str | None = None
        self.timers = TimerService(data)

    def _var(self, name: str, kind: str, declared: str | None) -> None:
        known = self._kinds.get(name)
        if declared is None and known is not None and (kind == "value" or known == kind):
            return  # declared, of the right kind: the common case, checked once per call
        var = self._schema.by_name.get(name)
        if var is None:
            raise JobDefinitionError(
                f"state variable {name!r} is not declared; declare it with its Spark type in "
                f"the processor's state_schema (declared: {self._schema.names or 'none'})"
            )
        if kind != "value" and var.kind != kind:
            raise JobDefinitionError(
                f"state variable {name!r}: {kind} state needs an "
                f"{'ARRAY<element>' if kind == 'list' else 'MAP<key, value>'} type, found "
                f"{var.type} in the state_schema"
            )
        if declared is not None and not _same_type(declared, var):
            raise JobDefinitionError(
                f"state variable {name!r}: declared here as {declared!r}, in the state_schema "
                f"as {var.type}{' (json)' if var.is_json else ''}; keep one declaration"
            )

    def value(self, name: str, type: str | None = None) -> ValueState:
        self._var(name, "value", type)
        return ValueState(self._data, name)

    def list(self, name: str, element_type: str | None = None) -> ListState:
        self._var(name, "list", None if element_type is None else f"ARRAY<{element_type}>")
        return ListState(self._data, name)

    def map(self, name: str, key_type: str | None = None,
            value_type: str | None = None) -> MapState:
        self._var(name, "map", None if key_type is None or value_type is None
                  else f"MAP<{key_type}, {value_type}>")
        return MapState(self._data, name)

    def clear(self) -> None:
        """Forget every state and timer of the key."""
        self._data.clear()


_SYNONYMS = {"long": "bigint", "integer": "int", "short": "smallint", "byte": "tinyint",
             "real": "float", "dec": "decimal", "numeric": "decimal", "bool": "boolean",
             "timestamp_ltz": "timestamp"}


def _norm(ddl: str) -> str:
    import re

    text = re.sub(r"\s+", "", ddl.lower()).replace(":", "")
    return re.sub(r"[a-z_]+", lambda m: _SYNONYMS.get(m.group(0), m.group(0)), text)


def _same_type(declared: str, var: Any) -> bool:
    """Whether a type written at the call matches the declared variable (loosely, by DDL)."""
    if declared.strip().lower() == "json":
        return bool(var.is_json)
    if var.is_json:
        return False
    import pyarrow as pa

    from spark_ckpt.arrowtypes import to_spark

    spark_type = to_spark(pa.schema([pa.field("v", var.type)])).fields[0].dataType
    return _norm(declared) == _norm(spark_type.simpleString())


class KeyRows:
    """One key's rows of the batch, column by column (``KeyedProcessor.rows_format = "numpy"``,
    the default): ``rows["amount"]`` is a numpy array, a view into the batch's column (strings
    and nested values as objects, timestamps as ``datetime64[us]`` in UTC, integers with
    nulls as floats with NaN, as Arrow's ``to_numpy`` gives them); ``len(rows)``,
    ``rows.columns``, ``"amount" in rows``; ``rows.to_pandas()`` and ``rows.to_pylist()`` when
    a frame or records are wanted. No copy and no pandas per key."""

    __slots__ = ("_batch", "_start", "_end")

    def __init__(self, batch: _BatchColumns, start: int, end: int) -> None:
        self._batch = batch
        self._start = start
        self._end = end

    def __getitem__(self, column: str) -> np.ndarray:
        return self._batch.column(column)[self._start:self._end]

    def __len__(self) -> int:
        return self._end - self._start

    def __contains__(self, column: object) -> bool:
        return column in self._batch.names

    @property
    def columns(self) -> list[str]:
        return list(self._batch.names)

    def to_pandas(self) -> pd.DataFrame:
        """The rows as a pandas frame (a slice of the batch's frame, built once per batch)."""
        return self._batch.frame().iloc[self._start:self._end]

    def to_pylist(self) -> list[dict[str, Any]]:
        """The rows as a list of dicts (column name to value)."""
        rows: list[dict[str, Any]] = \
            self._batch.table.slice(self._start, self._end - self._start).to_pylist()
        return rows

    def __repr__(self) -> str:
        return f"KeyRows({len(self)} rows: {', '.join(self._batch.names)})"


class _BatchColumns:
    """The batch's rows, grouped by key, converted to numpy one column at a time on first use."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.names = table.column_names
        self._numpy: dict[str, np.ndarray] = {}
        self._frame: pd.DataFrame | None = None

    def column(self, name: str) -> np.ndarray:
        array = self._numpy.get(name)
        if array is None:
            if name not in self.names:
                raise KeyError(f"no column {name!r} in the rows; columns: {self.names}")
            array = self.table.column(name).to_numpy()
            self._numpy[name] = array
        return array

    def frame(self) -> pd.DataFrame:
        if self._frame is None:
            self._frame = self.table.to_pandas()
        return self._frame


# -- the vectorized API ---------------------------------------------------------------------
class VectorizedProcessor:
    """Subclass, declare ``state_schema`` and override :meth:`process_batch` (and
    :meth:`on_timers` if you set timers). One call per task and batch, with every key of the
    task's key-group range that has rows in the batch."""

    state_schema: ClassVar[Any] = None

    def process_batch(self, batch: KeyedBatch) -> Result | None:
        """Called once per task and batch with every key that has rows in it: return the new
        state, the rows to emit and the timers as a :class:`Result` (None: nothing)."""
        raise NotImplementedError

    def on_timers(self, batch: KeyedBatch) -> Result | None:
        """The keys with timers due (``batch.timers``: one row per fired timer), after the
        batch's rows were processed; ``batch.rows`` is empty."""
        return None


@dataclasses.dataclass
class KeyedBatch:
    """Every key of one call, in the order of their first row in the batch.

    Attributes:
        keys: one row per key (the key columns).
        rows: the batch's rows grouped by key: key ``i``'s rows are
            ``rows.iloc[offsets[i]:offsets[i + 1]]``, in arrival order.
        offsets: ``len(keys) + 1`` group boundaries into ``rows``.
        group: for each row, the index of its key in ``keys``.
        state: one row per key, a column per declared variable (null where a key has none).
        exists: whether each key had any state before this call.
        timers: (``on_timers``) the fired timers: ``key`` (index into ``keys``), ``ms``,
            ``kind`` ("event" or "processing").
        processing_time_ms: the batch's processing time.
        watermark_ms: the event-time watermark (None before any event time was seen).
        late_watermark_ms: the watermark the previous batch ran with: rows at or before it
            are late (Structured Streaming drops late rows against it, and closes state at
            ``watermark_ms``).
    """

    keys: pd.DataFrame
    rows: pd.DataFrame
    offsets: np.ndarray
    group: np.ndarray
    state: pd.DataFrame
    exists: np.ndarray
    processing_time_ms: int
    watermark_ms: int | None
    timers: pd.DataFrame | None = None
    late_watermark_ms: int | None = None
    arrow_keys: pa.Table | None = None
    arrow_rows: pa.Table | None = None
    arrow_state: pa.Table | None = None

    @property
    def sizes(self) -> np.ndarray:
        """Rows per key."""
        import numpy as np

        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.keys)


@dataclasses.dataclass
class Result:
    """What a vectorized call returns. Every field is optional.

    Attributes:
        state: new values, one row per key of the call, aligned with ``batch.keys`` (a pandas
            DataFrame or an Arrow table); only the columns given are written, and a row whose
            variables are all null (and that has no timers) deletes the key.
        changed: a boolean mask of the keys whose ``state`` row is written (default: all).
        emit: rows to output, in the operator's output schema.
        event_timers, processing_timers: per key (aligned with ``batch.keys``), the time in
            ms of the key's one timer of that clock: a value replaces the key's timers of that
            clock, a negative value deletes them, a null (None, NaN, pd.NA) keeps them.
        counters: named counts to add to the batch's progress for this operator (for
            example ``{"late_rows": 3}``), summed over the operator's tasks.
    """

    state: Any = None
    changed: Any = None
    emit: Any = None
    event_timers: Any = None
    processing_timers: Any = None
    counters: dict[str, int] | None = None
