"""The Delta event log: buffered writes, fencing, and tolerant reads of damaged logs."""

from spark_ckpt.storage.delta_reader import read_delta
import time

import pytest

from spark_ckpt.clock import ManualClock
from spark_ckpt.errors import EventLogError, JobFencedError
from spark_ckpt.eventlog.events import Event, EventType
from spark_ckpt.eventlog.reader import EventLogUnreadable, read_events
from spark_ckpt.eventlog.replay import replay
from spark_ckpt.eventlog.writer import EventLogWriter
from spark_ckpt.storage import Storage


def writer(tmp_path, **kw):
    storage = Storage(str(tmp_path))
    options = dict(job_id="j", job_attempt=1, flush_interval_ms=60_000, flush_max_events=1000)
    options.update(kw)
    w = EventLogWriter(storage, storage.path("events"), **options)
    w.start()
    return storage, w


class SleepsClock(ManualClock):
    """A manual clock whose sleeps call ``on_sleep`` (and advance the clock) instead of waiting."""

    def __init__(self, on_sleep):
        super().__init__(sleep_advances=True)
        self.on_sleep = on_sleep

    def sleep(self, seconds):
        self.on_sleep(seconds)
        super().sleep(seconds)


def finished(p):
    return Event(EventType.EXECUTION_VERTEX_FINISHED, {"outputs": []}, vertex_id="v",
                 partition=p, attempt_id=f"a{p}", rows=p)


def test_events_are_buffered_and_one_flush_is_one_commit(tmp_path):
    storage, w = writer(tmp_path)
    for p in range(10):
        w.append(finished(p))
    assert read_events(storage, storage.path("events")).events == []
    w.flush()
    assert w.commits == 1
    events = read_events(storage, storage.path("events")).events
    assert [e.partition for e in events] == list(range(10))
    assert [e.seq for e in events] == list(range(1, 11))
    w.close()


def test_full_buffer_flushes_without_waiting_for_the_interval(tmp_path):
    storage, w = writer(tmp_path, flush_max_events=5)
    for p in range(5):
        w.append(finished(p))
    assert _eventually(lambda: len(read_events(storage, storage.path("events")).events) == 5)
    w.close()


def test_interval_flushes_in_the_background(tmp_path):
    storage, w = writer(tmp_path, flush_interval_ms=100)
    w.append(finished(1))
    assert _eventually(lambda: len(read_events(storage, storage.path("events")).events) == 1)
    w.close()


def test_fenced_writer_refuses_to_write(tmp_path):
    fenced = {"now": False}
    storage, w = writer(tmp_path, is_fenced=lambda: fenced["now"])
    w.append(finished(0))
    w.flush()
    fenced["now"] = True
    w.append(finished(1))
    with pytest.raises(JobFencedError, match="fenced off by a newer attempt"):
        w.flush()
    with pytest.raises(JobFencedError):
        w.append(finished(2))
    assert [e.partition for e in read_events(storage, storage.path("events")).events] == [0]


def test_failed_appends_are_retried_with_backoff_and_keep_every_event(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_CKPT_FAULT", "eventlog.write:2-3:fail")
    waits: list[float] = []
    storage, w = writer(tmp_path, write_retries=5, retry_backoff_ms=200,
                        clock=SleepsClock(waits.append))
    w.append(finished(0))
    w.flush()  # pass 1: written
    for p in (1, 2):
        w.append(finished(p))
    w.flush()  # passes 2 and 3 fail, pass 4 writes
    assert waits == [0.2, 0.4]
    assert w.retried == 1 and w.commits == 2
    events = read_events(storage, storage.path("events")).events
    assert [(e.partition, e.seq) for e in events] == [(0, 1), (1, 2), (2, 3)]
    w.close()


def test_an_append_failing_past_its_retries_fails_clearly_and_keeps_the_events(
        tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_CKPT_FAULT", "eventlog.write:1-4:fail")
    waits: list[float] = []
    storage, w = writer(tmp_path, write_retries=2, retry_backoff_ms=8000,
                        clock=SleepsClock(waits.append))
    w.append(finished(0))
    with pytest.raises(EventLogError, match=r"could not append 1 events .* after 3 tries "
                       r"\(spark.ckpt.eventLog.writeRetries=2\).*injected storage failure"):
        w.flush()
    assert waits == [8.0, 10.0]  # doubled, capped at 10 s
    w.flush()  # pass 4 fails, pass 5 writes: the buffered event was kept
    assert [e.partition for e in read_events(storage, storage.path("events")).events] == [0]
    w.close()


def test_retries_stop_once_the_driver_is_fenced(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_CKPT_FAULT", "eventlog.write:1-:fail")
    fenced = {"now": False}

    def wait_and_get_fenced(seconds):
        fenced["now"] = True  # a newer attempt claimed the job while this one waited

    storage, w = writer(tmp_path, is_fenced=lambda: fenced["now"],
                        clock=SleepsClock(wait_and_get_fenced))
    w.append(finished(0))
    with pytest.raises(JobFencedError):
        w.flush()


def test_events_are_stamped_by_the_injected_clock(tmp_path):
    clock = ManualClock(start_ms=1_700_000_000_123)
    storage, w = writer(tmp_path, clock=clock)
    w.append(finished(0))
    clock.advance(5)
    w.append(finished(1))
    w.close()
    events = read_events(storage, storage.path("events")).events
    assert [e.time_us for e in events] == [1_700_000_000_123_000, 1_700_000_000_128_000]


def test_truncated_last_commit_is_tolerated_and_set_aside(tmp_path):
    storage, w = writer(tmp_path)
    for p in range(3):
        w.append(finished(p))
        w.flush()
    w.close()
    log_dir = tmp_path / "events" / "_delta_log"
    last = sorted(log_dir.glob("*.json"))[-1]
    last.write_text(last.read_text()[: len(last.read_text()) // 2])  # a torn write
    before = sorted(p.name for p in log_dir.iterdir())
    read_only = read_events(storage, storage.path("events"))  # a reader (the CLI): no repair
    assert [e.partition for e in read_only.events] == [0, 1]
    assert any("torn and was not read" in p for p in read_only.problems)
    assert sorted(p.name for p in log_dir.iterdir()) == before  # nothing moved
    result = read_events(storage, storage.path("events"), repair=True)  # the next appender
    assert [e.partition for e in result.events] == [0, 1]
    assert any("torn; moved to" in p for p in result.problems)
    # The next writer appends again at the version the torn commit had.
    storage, w2 = writer(tmp_path, job_attempt=2)
    w2.append(finished(2))
    w2.flush()
    w2.close()
    assert [e.partition for e in read_events(storage, storage.path("events")).events] == [0, 1, 2]


def test_unreadable_data_file_is_skipped_with_a_warning(tmp_path):
    storage, w = writer(tmp_path)
    w.append(finished(0))
    w.flush()
    w.append(finished(1))
    w.flush()
    w.close()
    newest = max((tmp_path / "events").glob("*.parquet"), key=lambda p: p.stat().st_mtime_ns)
    newest.write_bytes(b"PAR1 garbage")
    result = read_events(storage, storage.path("events"))
    assert len(result.events) == 1
    assert any("unreadable and was skipped" in p for p in result.problems)


def test_a_log_that_cannot_load_at_all_raises_unreadable(tmp_path):
    storage, w = writer(tmp_path)
    w.append(finished(0))
    w.close()
    for f in (tmp_path / "events" / "_delta_log").glob("*.json"):
        f.write_text("{broken")
    with pytest.raises(EventLogUnreadable):
        read_events(storage, storage.path("events"))


def test_the_cli_reads_a_torn_log_without_moving_a_file(tmp_path):
    from click.testing import CliRunner

    from spark_ckpt.ops.cli import main

    storage = Storage(str(tmp_path / "work" / "j"))
    w = EventLogWriter(storage, storage.path("events"), job_id="j", job_attempt=1,
                       flush_interval_ms=60_000, flush_max_events=1000)
    w.start()
    for p in range(2):
        w.append(finished(p))
        w.flush()
    w.close()
    log_dir = tmp_path / "work" / "j" / "events" / "_delta_log"
    last = sorted(log_dir.glob("*.json"))[-1]
    last.write_bytes(last.read_bytes()[:40])
    before = {p.name: p.read_bytes() for p in log_dir.iterdir()}
    result = CliRunner().invoke(main, ["events", "j", "--work-dir", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    assert {p.name: p.read_bytes() for p in log_dir.iterdir()} == before


def test_a_log_whose_commits_parse_but_do_not_load_stops_the_read_and_moves_nothing(tmp_path):
    import json

    storage, w = writer(tmp_path)
    w.append(finished(0))
    w.flush()
    w.close()
    log_dir = tmp_path / "events" / "_delta_log"
    newer = {"protocol": {"minReaderVersion": 99, "minWriterVersion": 99}}
    version = len(list(log_dir.glob("*.json")))
    (log_dir / f"{version:020d}.json").write_text(json.dumps(newer) + "\n")
    before = sorted(p.name for p in log_dir.iterdir())
    for repair in (False, True):
        with pytest.raises(EventLogError, match="none of its newest commits is torn"):
            read_events(storage, storage.path("events"), repair=repair)
    assert sorted(p.name for p in log_dir.iterdir()) == before


@pytest.mark.parametrize("error, skipped", [
    (TimeoutError(110, "Connection timed out"), False),  # the storage, not the file
    (PermissionError(13, "Permission denied"), False),
    (OSError("Couldn't deserialize thrift: TProtocolException: Invalid data"), True),
])
def test_only_a_damaged_data_file_is_skipped_a_storage_error_propagates(
        tmp_path, monkeypatch, error, skipped):
    import pyarrow.parquet as pq

    storage, w = writer(tmp_path)
    w.append(finished(0))
    w.close()

    def failing_read(*args, **kwargs):
        raise error

    monkeypatch.setattr(pq, "read_table", failing_read)  # the storage answers with ``error``
    if skipped:
        result = read_events(storage, storage.path("events"))
        assert result.events == [] and "skipped" in result.problems[0]
    else:
        with pytest.raises(type(error)):
            read_events(storage, storage.path("events"))


def test_users_can_query_the_log_with_pandas(tmp_path):
    storage, w = writer(tmp_path)
    for p in range(4):
        w.append(finished(p))
    w.close()
    frame = read_delta(str(tmp_path / "events")).to_pandas()
    assert set(frame.event_type) == {"ExecutionVertexFinished"}
    assert frame.rows.sum() == 6
    assert replay(read_events(storage, storage.path("events")).events).finished.keys() == {
        ("v", p) for p in range(4)}


def _eventually(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _live_files(storage) -> int:
    from deltalake import DeltaTable

    return len(DeltaTable(storage.path("events")).file_uris())


def test_the_writer_compacts_the_logs_small_files_and_keeps_every_event(tmp_path):
    """When an append leaves ``compact_at_files`` small files, they become one (an OPTIMIZE
    commit); readers see every event once, in order, before and after."""
    storage, w = writer(tmp_path, compact_at_files=4)
    for p in range(10):
        w.append(finished(p))
        w.flush()
        events = read_events(storage, storage.path("events")).events
        assert [e.partition for e in events] == list(range(p + 1))
        assert _live_files(storage) < 4
    assert w.commits == 10 and w.compactions == 3  # at 4 files: after appends 4, 7 and 10
    assert _live_files(storage) == 1
    w.close()
    history = replay(read_events(storage, storage.path("events")).events)
    assert sorted(k[1] for k in history.finished) == list(range(10))


def test_a_failed_compaction_loses_nothing_and_is_tried_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_CKPT_FAULT", "eventlog.compact:1:fail")
    storage, w = writer(tmp_path, compact_at_files=2)
    for p in range(3):
        w.append(finished(p))
        w.flush()  # the compaction after append 2 fails: a warning, the events stay
    assert w.commits == 3 and w.compactions == 1  # tried again after append 3
    assert _live_files(storage) == 1
    assert [e.partition for e in read_events(storage, storage.path("events")).events] == \
        list(range(3))
    w.close()


def test_overlapping_compactions_do_not_double_an_event(tmp_path):
    """Two compactions planned from the same files (a driver stalled between its fence check
    and its commit, compacting what a newer one already compacted) each add a copy of the
    rows: the reader keeps one row per (job_attempt, seq)."""
    from deltalake import DeltaTable

    storage, w = writer(tmp_path)
    for p in range(6):
        w.append(finished(p))
        w.flush()
    w.close()
    stale = DeltaTable(storage.path("events"))  # the stalled driver's view
    DeltaTable(storage.path("events")).optimize.compact()
    stale.optimize.compact()  # planned from files already compacted: a second copy
    copies = read_delta(storage.path("events"))
    assert len(copies) > 6  # the table itself holds duplicates (else this test tests nothing)
    events = read_events(storage, storage.path("events")).events
    assert [(e.job_attempt, e.seq, e.partition) for e in events] == \
        [(1, p + 1, p) for p in range(6)]


def test_a_fenced_writer_does_not_compact(tmp_path):
    """A newer attempt claimed the job between an append and the compaction due after it:
    the fenced writer leaves the table's files as they are."""
    checks: list[int] = []

    def is_fenced():  # checked before append 1, before append 2, then before compacting
        checks.append(1)
        return len(checks) > 2

    storage, w = writer(tmp_path, compact_at_files=2, is_fenced=is_fenced)
    for p in range(2):
        w.append(finished(p))
        w.flush()
    assert len(checks) == 3 and w.commits == 2 and w.compactions == 0
    assert _live_files(storage) == 2
