"""One clock: the library reads the time and waits only through :class:`~spark_ckpt.clock.Clock`
(outside the few modules whose docstrings say why not), and a manual clock drives what is
timed, such as the generator source's rate."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import spark_ckpt
from spark_ckpt.clock import ManualClock, SystemClock
from spark_ckpt.sources.generator import GeneratorSource

PACKAGE = Path(spark_ckpt.__file__).parent

# what reads the machine's time or waits on it
_TIME_READS = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns",
               "process_time", "process_time_ns", "thread_time", "thread_time_ns", "sleep"}

# modules that may read `time` directly; each one's docstring says why (a "Time:" paragraph)
ALLOWED = {
    "state/task.py",  # a Python worker's task: no clock is injected there
    "state/process_task.py",  # the same
    "sources/kafka_reader.py",  # the same: the Kafka source's reading task
    "faults.py",  # fault points: set up by the environment, race real processes
    "storage/faulty.py",  # faulty storage: the same
}


def _time_reads(path: Path) -> list[str]:
    """``time.<read>(...)`` calls and ``from time import <read>`` in ``path``: ``line: text``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "time"
                and node.func.attr in _TIME_READS):
            found.append(f"{node.lineno}: time.{node.func.attr}()")
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [f"{node.lineno}: from time import {a.name}" for a in node.names
                      if a.name in _TIME_READS]
    return found


def test_no_module_reads_the_time_but_through_the_clock():
    offending = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "clock.py" or name in ALLOWED:
            continue
        if reads := _time_reads(path):
            offending[name] = reads
    assert not offending, (
        "read the time and wait through an injected spark_ckpt.clock.Clock (or justify the "
        f"module in its docstring and in ALLOWED): {offending}")


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_each_module_allowed_to_read_time_says_why_and_still_does(name):
    path = PACKAGE / name
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Time:" in docstring and "not a :class:`~spark_ckpt.clock.Clock`" in docstring
    assert _time_reads(path), f"{name} no longer reads time: drop it from ALLOWED"


def test_the_system_clock_reads_the_machine():
    import time

    clock = SystemClock()
    before = time.time()
    assert abs(clock.now_ms() / 1000 - before) < 5
    first = clock.monotonic_s()
    clock.sleep(0.01)
    clock.sleep(-1)  # nothing to wait
    assert clock.monotonic_s() - first >= 0.009


def test_a_manual_clock_moves_wall_and_monotonic_time_together_only_when_advanced():
    clock = ManualClock(start_ms=5_000)
    seen = []
    clock.on_advance(lambda: seen.append(clock.now_ms()))
    assert (clock.now_ms(), clock.monotonic_s()) == (5_000, 5.0)
    clock.advance(1_500)
    assert (clock.now_ms(), clock.monotonic_s()) == (6_500, 6.5)
    assert seen == [6_500]


def test_a_manual_clocks_sleep_waits_for_the_test_to_advance_it():
    clock = ManualClock(start_ms=0)
    woke = threading.Event()
    sleeper = threading.Thread(target=lambda: (clock.sleep(2.0), woke.set()), daemon=True)
    sleeper.start()
    assert not woke.wait(0.2)  # no real time moves it
    clock.advance(1_999)
    assert not woke.wait(0.2)
    clock.advance(1)
    assert woke.wait(5)
    sleeper.join(5)


def test_a_manual_clock_made_to_advance_on_sleep_advances_itself():
    clock = ManualClock(start_ms=0, sleep_advances=True)
    clock.sleep(0.25)
    clock.sleep(0)
    assert clock.now_ms() == 250 and clock.monotonic_s() == 0.25


def test_the_generator_sources_rate_runs_on_the_pipelines_clock():
    clock = ManualClock(start_ms=0)
    source = GeneratorSource("gen", rows_per_second=100, max_rows_per_batch=500)
    source.bind(SimpleNamespace(clock=clock))  # what a StreamingContext offers: its clock
    assert source.clock is clock
    assert source.plan()["rows"] == 0  # no time has passed on the pipeline's clock
    clock.advance(1_500)
    piece = source.plan()
    assert piece == {"start": 0, "end": 150, "rows": 150}
    source.advance(piece)
    assert source.plan()["rows"] == 0  # the rate counts from the previous batch
    clock.advance(250)
    assert source.plan() == {"start": 150, "end": 175, "rows": 25}
    clock.advance(60_000)
    assert source.plan()["rows"] == 500  # capped by max_rows_per_batch


def test_an_unbound_source_or_a_scope_without_a_clock_uses_the_system_clock():
    source = GeneratorSource("gen", rows_per_second=1)
    assert isinstance(source.clock, SystemClock)
    source.bind(SimpleNamespace(settings=None))
    assert isinstance(source.clock, SystemClock)
