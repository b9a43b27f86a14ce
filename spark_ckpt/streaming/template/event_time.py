"""Event-time declarations on streams: ``stream.with_watermark(column, delay)``, as
Structured Streaming's ``withWatermark`` and Flink SQL's ``WATERMARK FOR column AS column -
INTERVAL ...``. A stateful operator downstream takes its event time and delay from the nearest
declaration upstream of it (through stateless transformations); its watermark is the largest
event time it has seen minus the delay (checkpointed with its state)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from spark_ckpt.errors import JobDefinitionError

__all__ = ["Watermark", "declared_watermark", "duration_ms", "stream_watermark",
           "upstream_clock"]

# Spark's interval units (singular or plural), in milliseconds
_UNITS = {"millisecond": 1, "ms": 1, "second": 1_000, "s": 1_000, "minute": 60_000,
          "min": 60_000, "hour": 3_600_000, "h": 3_600_000, "day": 86_400_000,
          "d": 86_400_000, "week": 604_800_000}
_PART = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*")


def duration_ms(value: Any, what: str) -> int:
    """``value`` in milliseconds: an int (milliseconds), a ``timedelta``, or an interval
    string as Spark writes them ("10 seconds", "1 minute 30 seconds", "500 milliseconds")."""
    if isinstance(value, bool):
        raise JobDefinitionError(f"{what}: expected a duration, found {value!r}")
    if isinstance(value, int):
        ms = value
    elif isinstance(value, timedelta):
        ms = int(value.total_seconds() * 1000)
    elif isinstance(value, str):
        text = value.strip().lower().removeprefix("interval").strip()
        parts = _PART.findall(text)
        if not parts or _PART.sub("", text):
            raise JobDefinitionError(
                f"{what}: expected a duration such as '10 seconds' or '1 minute 30 seconds', "
                f"found {value!r}")
        total = 0.0
        for number, unit in parts:
            scale = _UNITS.get(unit.removesuffix("s") if unit not in _UNITS else unit)
            if scale is None:
                raise JobDefinitionError(
                    f"{what}: expected units among {sorted(set(_UNITS))} in {value!r}, found "
                    f"{unit!r}")
            total += float(number) * scale
        ms = int(round(total))
    else:
        raise JobDefinitionError(
            f"{what}: expected a duration (milliseconds, a timedelta or '10 seconds'), found "
            f"{type(value).__name__}")
    if ms < 0:
        raise JobDefinitionError(f"{what}: expected a duration of at least 0, found {value!r}")
    return ms


class Watermark:
    """An event-time column and the delay the watermark trails its largest value by; the
    columns that name a row's source partition (``split``: Kafka's topic and partition, as the
    stream names them), whose watermarks are kept apart (the smallest counts, as Flink's
    per-partition watermarks); and how long a partition (or an input) may go without rows
    before it stops holding the watermark back (``idle_ms``, Flink's ``withIdleness``)."""

    def __init__(self, column: str, delay_ms: int, idle_ms: int | None = None,
                 split: tuple[str, ...] = ()) -> None:
        self.column = column
        self.delay_ms = delay_ms
        self.idle_ms = idle_ms
        self.split = tuple(split)

    def _identity(self) -> tuple[Any, ...]:
        return self.column, self.delay_ms, self.idle_ms, self.split

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Watermark) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        extra = "" if self.idle_ms is None else f", idle after {self.idle_ms} ms"
        per = "" if not self.split else f", per {'/'.join(self.split)}"
        return f"with_watermark({self.column!r}, {self.delay_ms} ms{extra}{per})"


def declared_watermark(streams: Iterable[Any], where: str) -> Watermark | None:
    """The watermark declared upstream of ``streams`` (through stateless transformations; a
    stateful operator's output starts afresh); None when none is. Inputs that declare
    different ones are refused (one event-time column per operator, for now)."""
    found: dict[tuple[str, int], Watermark] = {}  # (each input's partitions and idleness
    undeclared = False                            # are its own: see ProcessedStream)
    for stream in streams:
        mark = _upstream(stream)
        if mark is None:
            undeclared = True
        else:
            found.setdefault((mark.column, mark.delay_ms), mark)
    if len(found) > 1:
        raise JobDefinitionError(
            f"{where}: expected one event-time declaration over its inputs, found "
            f"{sorted(map(repr, found.values()))}; declare the same column and delay on every "
            "input")
    if found and undeclared:
        raise JobDefinitionError(
            f"{where}: some inputs declare {next(iter(found.values()))!r} and some declare no "
            "watermark; declare it on every input (an input without one would hold the "
            "watermark back forever)")
    return next(iter(found.values()), None)


def stream_watermark(stream: Any) -> Watermark | None:
    """The watermark declared on ``stream`` or upstream of it through stateless
    transformations (None past a stateful operator, or where none is)."""
    return _upstream(stream)


def _upstream(stream: Any) -> Watermark | None:
    mark = getattr(stream, "watermark", None)
    if mark is not None:
        return mark  # type: ignore[no-any-return]
    if getattr(stream, "operator", None) is not None:  # a stateful operator's output
        return None
    parents = list(getattr(stream, "parents", ()))
    if not parents:
        return None
    return declared_watermark(parents, f"stream {getattr(stream, 'name', stream)}")


def upstream_clock(streams: Iterable[Any], where: str) -> Any | None:
    """The event-time operator upstream of ``streams`` whose watermark flows on to an operator
    that declares none (through stateless transformations; a ``with_watermark`` on the way
    starts a new clock): None when there is none. Several different ones are refused."""
    found: dict[int, Any] = {}
    for stream in streams:
        clock = _clock(stream)
        if clock is not None:
            found[id(clock)] = clock
    if len(found) > 1:
        raise JobDefinitionError(
            f"{where}: expected one event-time operator upstream, found "
            f"{sorted(getattr(c, 'operator', '?') for c in found.values())}; declare the "
            "watermark with with_watermark on the input")
    return next(iter(found.values()), None)


def _clock(stream: Any) -> Any | None:
    if getattr(stream, "watermark", None) is not None:
        return None  # declared here: not inherited
    if getattr(stream, "operator", None) is not None:  # a stateful operator's output
        has_time = getattr(stream, "event_time", None) is not None or \
            getattr(stream, "clock", None) is not None
        return stream if has_time else None
    parents = list(getattr(stream, "parents", ()))
    return upstream_clock(parents, f"stream {getattr(stream, 'name', stream)}") \
        if parents else None
