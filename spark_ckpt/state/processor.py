"""Arbitrary keyed state for Python: the ``KeyedProcessor`` API (Flink's KeyedProcessFunction,
PySpark's transformWithState).

    class RunningTotal(KeyedProcessor):
        def process(self, key, rows, ctx):
            total = ctx.value("total")
            t = (total.get() or 0) + float(rows["amount"].sum())
            total.update(t)
            ctx.timers.register_processing_time(ctx.processing_time_ms + 60_000)
            yield (key[0], t)

        def on_timer(self, key, timer_ms, ctx):
            ctx.clear()          # nothing for a minute: forget the key

    totals = stream.key_by("user").process(RunningTotal(), "user STRING, total DOUBLE")

Per key a processor has named *value*, *list* and *map* states, processing-time and event-time
timers, and an optional time-to-live for its states. State values must be JSON values (numbers,
strings, booleans, None, lists, string-keyed dicts): state is persisted as JSON, never pickle.
Processing time is the batch's time (recorded with the batch, so a replayed batch sees the same
time); event time advances with the watermark, the largest event time seen in earlier batches
minus the allowed delay.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from spark_ckpt.errors import JobDefinitionError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["KeyContext", "KeyedProcessor", "ListState", "MapState", "TimerService",
           "ValueState"]


class KeyedProcessor:
    """Subclass and override :meth:`process` (and :meth:`on_timer` if you register timers)."""

    def process(self, key: tuple[Any, ...], rows: pd.DataFrame,
                ctx: KeyContext) -> Iterable[Any] | pd.DataFrame | None:
        """Called once per batch for every key with rows in the batch (in arrival order).
        Return or yield output rows (tuples or dicts in the output schema) or a DataFrame."""
        raise NotImplementedError

    def on_timer(self, key: tuple[Any, ...], timer_ms: int,
                 ctx: KeyContext) -> Iterable[Any] | pd.DataFrame | None:
        """A timer of this key fired (``ctx.timer_kind`` says which clock)."""
        return None


def _check_json(what: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise JobDefinitionError(
            f"{what}: expected a JSON value (number, string, bool, None, list, dict with string "
            f"keys), found {type(value).__name__}: {exc}"
        ) from None
    return value


class _Var:
    def __init__(self, ctx: KeyContext, kind: str, name: str) -> None:
        self._ctx = ctx
        self._kind = kind
        self._name = name

    def _slot(self) -> dict[str, Any]:
        return self._ctx._record.setdefault(self._kind, {})  # noqa: SLF001

    def _touch(self) -> None:
        self._ctx._touched(self._kind, self._name)  # noqa: SLF001

    def exists(self) -> bool:
        return self._ctx._live(self._kind, self._name) and self._name in self._slot()  # noqa: SLF001

    def clear(self) -> None:
        if self._slot().pop(self._name, None) is not None:
            self._ctx._dirty = True  # noqa: SLF001
        self._ctx._record.get("ttl", {}).pop(f"{self._kind}:{self._name}", None)  # noqa: SLF001


class ValueState(_Var):
    def get(self) -> Any:
        return self._slot().get(self._name) if self.exists() else None

    def update(self, value: Any) -> None:
        self._slot()[self._name] = _check_json(f"value state {self._name!r}", value)
        self._touch()


class ListState(_Var):
    def get(self) -> list[Any]:
        return list(self._slot().get(self._name, [])) if self.exists() else []

    def append(self, value: Any) -> None:
        items = self.get()
        items.append(_check_json(f"list state {self._name!r}", value))
        self._slot()[self._name] = items
        self._touch()

    def extend(self, values: Iterable[Any]) -> None:
        for v in values:
            self.append(v)

    def put(self, values: Iterable[Any]) -> None:
        self._slot()[self._name] = [_check_json(f"list state {self._name!r}", v) for v in values]
        self._touch()


class MapState(_Var):
    def _map(self) -> dict[str, Any]:
        return dict(self._slot().get(self._name, {})) if self.exists() else {}

    def get(self, key: str, default: Any = None) -> Any:
        return self._map().get(key, default)

    def put(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise JobDefinitionError(
                f"map state {self._name!r}: expected a string map key, found "
                f"{type(key).__name__}"
            )
        items = self._map()
        items[key] = _check_json(f"map state {self._name!r}", value)
        self._slot()[self._name] = items
        self._touch()

    def remove(self, key: str) -> None:
        items = self._map()
        if items.pop(key, None) is not None:
            self._slot()[self._name] = items
            self._touch()

    def contains(self, key: str) -> bool:
        return key in self._map()

    def keys(self) -> list[str]:
        return list(self._map())

    def items(self) -> list[tuple[str, Any]]:
        return list(self._map().items())


class TimerService:
    """Timers of the current key: ``[time ms, "event" | "processing"]`` entries."""

    def __init__(self, ctx: KeyContext) -> None:
        self._ctx = ctx

    def _timers(self) -> list[list[Any]]:
        return self._ctx._record.setdefault("timers", [])  # noqa: SLF001

    def _add(self, ms: int, kind: str) -> None:
        entry = [int(ms), kind]
        if entry not in self._timers():
            self._timers().append(entry)
            self._timers().sort()
            self._ctx._dirty = True  # noqa: SLF001

    def register_event_time(self, ms: int) -> None:
        self._add(ms, "event")

    def register_processing_time(self, ms: int) -> None:
        self._add(ms, "processing")

    def delete(self, ms: int, kind: str = "event") -> None:
        timers = self._timers()
        if [int(ms), kind] in timers:
            timers.remove([int(ms), kind])
            self._ctx._dirty = True  # noqa: SLF001

    def list(self) -> list[tuple[int, str]]:
        return [(int(t[0]), str(t[1])) for t in self._timers() if t[1] != "ttl"]


class KeyContext:
    """What a processor sees of one key: its states, its timers and the clocks."""

    def __init__(self, record: dict[str, Any] | None, *, processing_time_ms: int,
                 watermark_ms: int | None, ttl_ms: int | None) -> None:
        self._record: dict[str, Any] = record if record is not None else {}
        self._dirty = False
        self._ttl_ms = ttl_ms
        self.processing_time_ms = processing_time_ms
        self.watermark_ms = watermark_ms
        self.timer_kind: str | None = None
        self.timers = TimerService(self)
        self._expire()

    def value(self, name: str) -> ValueState:
        return ValueState(self, "v", name)

    def list(self, name: str) -> ListState:
        return ListState(self, "l", name)

    def map(self, name: str) -> MapState:
        return MapState(self, "m", name)

    def clear(self) -> None:
        """Forget every state and timer of the key."""
        if self._record:
            self._dirty = True
        self._record = {}

    # -- TTL: a state expires ttl_ms of processing time after its last update --------------
    def _touched(self, kind: str, name: str) -> None:
        self._dirty = True
        if self._ttl_ms is not None:
            expires = self.processing_time_ms + self._ttl_ms
            self._record.setdefault("ttl", {})[f"{kind}:{name}"] = expires
            self.timers._add(expires, "ttl")  # noqa: SLF001

    def _live(self, kind: str, name: str) -> bool:
        expires = self._record.get("ttl", {}).get(f"{kind}:{name}")
        return expires is None or expires > self.processing_time_ms

    def _expire(self) -> None:
        ttl = self._record.get("ttl")
        if not ttl:
            return
        for slot, expires in list(ttl.items()):
            if expires <= self.processing_time_ms:
                kind, name = slot.split(":", 1)
                self._record.get(kind, {}).pop(name, None)
                del ttl[slot]
                self._dirty = True
        timers = self._record.get("timers", [])
        kept = [t for t in timers if not (t[1] == "ttl" and t[0] <= self.processing_time_ms)]
        if len(kept) != len(timers):
            self._record["timers"] = kept
            self._dirty = True

    def _result(self) -> dict[str, Any] | None:
        """The record to store: None when nothing is left for the key."""
        record = {k: v for k, v in self._record.items() if v}
        return record or None
