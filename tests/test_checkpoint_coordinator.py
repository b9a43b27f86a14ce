"""The CheckpointCoordinator driven step by step with a manual clock and real checkpoint files."""

from __future__ import annotations

import json
import threading

import pytest

from spark_ckpt.checkpoint import (
    AckResult,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointListener,
    CheckpointStorage,
    PendingCheckpoint,
    TaskAck,
)
from spark_ckpt.clock import ManualClock
from spark_ckpt.errors import CheckpointError


class Recorder(CheckpointListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.changed = threading.Condition()

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        with self.changed:
            self.events.append(("complete", checkpoint_id))
            self.changed.notify_all()

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        with self.changed:
            self.events.append(("aborted", checkpoint_id))
            self.changed.notify_all()

    def wait_for(self, n: int) -> list[tuple[str, int]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.events) >= n, timeout=10), self.events
            return list(self.events)


class Harness:
    """A coordinator with one source and one two-task operator, acknowledged by hand."""

    def __init__(self, tmp_path, **config) -> None:
        self.clock = ManualClock()
        self.storage = CheckpointStorage(str(tmp_path / "checkpoints"))
        self.listener = Recorder()
        self.failures: list[BaseException] = []
        self.deleted: list[str] = []
        self.live: set[str] = set()
        self.stats: list[dict] = []
        self.coordinator = CheckpointCoordinator(
            "p", "pid", CheckpointConfig(**{"interval_ms": 1000, **config}), self.storage,
            completed=[], next_id=1, listeners=[self.listener],
            on_failure=self.failures.append, on_stats=self.stats.append,
            delete_files=self.deleted.extend, live_files=lambda: set(self.live),
            clock=self.clock)
        self.coordinator.start()

    def barrier(self, timeout: float = 10) -> int:
        """Wait for a trigger (the scheduler's side) and return its id."""

        return self.coordinator.barriers.get(timeout=timeout)

    def ack_all(self, cid: int, batch: int, files: list[str]) -> None:
        c = self.coordinator
        c.place_barrier(cid, batch, {"source:s", "op:agg:0", "op:agg:1"})
        c.acknowledge(cid, TaskAck("source:s", {"batch": batch}))
        for pid, f in enumerate(files):
            handle = {"range": f"kg{pid:05d}-{pid + 1:05d}", "token": f"t{cid}",
                      "files": [{"path": f, "kind": "changelog", "batch": batch, "rows": 1,
                                 "bytes": 10, "range": "x"}]}
            c.acknowledge(cid, TaskAck(f"op:agg:{pid}", {"handle": handle},
                                       {"sync_ms": 1, "async_ms": 2, "alignment_ms": 3}))

    def stop(self) -> None:
        self.coordinator.stop()


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path)
    yield h
    h.stop()


def test_triggers_on_its_own_clock_not_on_batches(harness):
    assert harness.coordinator.take_barrier() is None
    harness.clock.advance(999)
    assert harness.coordinator.take_barrier() is None
    harness.clock.advance(1)
    assert harness.barrier() == 1


def test_completes_when_every_task_acknowledged_and_writes_metadata(harness):
    harness.clock.advance(1000)
    cid = harness.barrier()
    harness.ack_all(cid, 7, ["/s/a", "/s/b"])
    assert harness.coordinator.completion(1).result(timeout=10) == "completed"
    assert harness.listener.events == [("complete", 1)]
    meta = harness.storage.read_metadata(1, "pid")
    assert meta["barrier_batch"] == 7
    assert sorted(meta["operators"]["agg"]["handles"]) == ["0", "1"]
    assert harness.storage.completed_ids() == [1]
    stats = json.loads(harness.storage.store.read_bytes(
        harness.storage.root + "/history/00000001.json"))
    assert stats["status"] == "completed" and stats["alignment_ms"] == 3
    assert stats["full_bytes"] == 20 and stats["incremental_bytes"] == 20


def test_acknowledgement_races_are_outcomes_not_errors():
    pending = PendingCheckpoint(3, 0, timeout_ms=10)
    assert pending.acknowledge(TaskAck("op:a:0", {})) is AckResult.UNKNOWN  # no barrier yet
    pending.place_barrier(5, 0, {"op:a:0", "op:a:1"})
    assert pending.acknowledge(TaskAck("op:a:9", {})) is AckResult.UNKNOWN
    assert pending.acknowledge(TaskAck("op:a:0", {})) is AckResult.SUCCESS
    assert pending.acknowledge(TaskAck("op:a:0", {})) is AckResult.DUPLICATE
    pending.discard()
    assert pending.acknowledge(TaskAck("op:a:1", {})) is AckResult.DISCARDED


def test_late_acknowledgement_after_completion_is_logged_and_ignored(harness, caplog):
    harness.clock.advance(1000)
    cid = harness.barrier()
    harness.ack_all(cid, 1, ["/s/a", "/s/b"])
    harness.listener.wait_for(1)
    harness.coordinator.acknowledge(cid, TaskAck("op:agg:0", {}))
    harness.coordinator.acknowledge(99, TaskAck("op:agg:0", {}))
    assert harness.coordinator.completion(cid).result(timeout=10) == "completed"
    assert not harness.failures
    assert "discarded acknowledgement" in caplog.text and "unknown acknowledgement" in caplog.text


def test_retains_n_and_deletes_only_files_no_checkpoint_or_task_still_uses(tmp_path):
    h = Harness(tmp_path, retained=2)
    try:
        chains = [["/s/shared", "/s/a1"], ["/s/shared", "/s/a2"], ["/s/shared", "/s/a3"]]
        h.live = {"/s/a1"}  # a running task still holds it
        for i, files in enumerate(chains):
            h.clock.advance(1000)
            cid = h.barrier()
            h.ack_all(cid, i, files)
            assert h.coordinator.completion(cid).result(timeout=10) == "completed"
        assert h.storage.completed_ids() == [2, 3]
        assert h.deleted == []  # /s/a1 is live, /s/shared is shared
        h.clock.advance(1000)
        cid = h.barrier()
        h.ack_all(cid, 3, ["/s/shared", "/s/a4"])
        assert h.coordinator.completion(cid).result(timeout=10) == "completed"
        assert h.deleted == ["/s/a2"]
        assert h.stats[-1]["incremental_bytes"] == 10  # only /s/a4 is new
        h.live = set()  # the task let go of /s/a1: the next sweep deletes it
        h.coordinator.release_files({"/s/a1"})
        h.clock.advance(1000)
        cid = h.barrier()
        h.ack_all(cid, 4, ["/s/shared", "/s/a5"])
        assert h.coordinator.completion(cid).result(timeout=10) == "completed"
        assert sorted(h.deleted) == ["/s/a1", "/s/a2", "/s/a3"]
    finally:
        h.stop()


def test_min_pause_and_max_concurrent_hold_back_triggers(tmp_path):
    h = Harness(tmp_path, min_pause_ms=5000)
    try:
        h.clock.advance(1000)
        first = h.barrier()
        h.clock.advance(3000)  # interval passed, but checkpoint 1 is still pending
        assert h.coordinator.completion(first).done() is False
        assert h.coordinator.take_barrier() is None
        h.ack_all(first, 0, ["/s/a", "/s/b"])
        h.listener.wait_for(1)
        h.clock.advance(4000)  # only 4 s since checkpoint 1 ended
        assert h.coordinator.take_barrier() is None
        h.clock.advance(1000)
        assert h.barrier() == 2
    finally:
        h.stop()


def test_timeout_aborts_tells_listeners_and_fails_past_tolerable(tmp_path):
    h = Harness(tmp_path, timeout_ms=2000, tolerable_failures=1)
    try:
        h.clock.advance(1000)
        h.barrier()
        h.clock.advance(2000)
        assert h.listener.wait_for(1) == [("aborted", 1)]
        assert not h.failures  # one failure tolerated
        h.clock.advance(1000)
        h.barrier()
        h.clock.advance(2000)
        assert h.coordinator.completion(2).result(timeout=10).startswith("aborted: the "
                                                                        "checkpoint expired")
        h.listener.wait_for(2)
        assert len(h.failures) == 1 and isinstance(h.failures[0], CheckpointError)
        assert "tolerableFailures=1" in str(h.failures[0])
        assert h.stats[-1]["status"] == "aborted"
    finally:
        h.stop()


def test_a_success_resets_the_failure_count(tmp_path):
    h = Harness(tmp_path, timeout_ms=2000, tolerable_failures=1)
    try:
        for expected in (1, 3):
            h.clock.advance(1000)
            cid = h.barrier()
            h.clock.advance(2000)  # times out
            h.listener.wait_for(expected)
            h.clock.advance(1000)
            cid = h.barrier()
            h.ack_all(cid, cid, ["/s/a", "/s/b"])
            h.listener.wait_for(expected + 1)
        assert not h.failures
    finally:
        h.stop()


def test_failing_metadata_storage_aborts_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_CKPT_FAULT", "checkpoint.metadata:1:fail")
    h = Harness(tmp_path, tolerable_failures=3)
    try:
        h.clock.advance(1000)
        cid = h.barrier()
        h.ack_all(cid, 0, ["/s/a", "/s/b"])
        assert h.coordinator.completion(cid).result(timeout=10).startswith("aborted")
        assert h.listener.events == [("aborted", 1)]
        assert "injected storage failure" in h.stats[-1]["reason"]
        assert h.storage.completed_ids() == []
        h.clock.advance(1000)
        cid = h.barrier()
        h.ack_all(cid, 1, ["/s/a", "/s/b"])
        assert h.listener.wait_for(2)[-1] == ("complete", 2)
    finally:
        h.stop()


def test_decline_aborts_and_a_failing_listener_does_not_stop_the_coordinator(tmp_path):
    h = Harness(tmp_path, tolerable_failures=5)

    class Broken(CheckpointListener):
        def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
            raise RuntimeError("sink down")

    h.coordinator.listeners.insert(0, Broken())
    try:
        h.clock.advance(1000)
        cid = h.barrier()
        h.coordinator.place_barrier(cid, 0, {"sink:x"})
        h.coordinator.decline(cid, "sink:x", "staged file missing")
        assert h.listener.wait_for(1) == [("aborted", 1)]
        h.clock.advance(1000)
        cid = h.barrier()
        h.ack_all(cid, 1, ["/s/a", "/s/b"])
        assert h.listener.wait_for(2)[-1] == ("complete", 2)
        assert not h.failures
    finally:
        h.stop()


def test_trigger_now_ignores_the_interval(harness):
    future = harness.coordinator.trigger_now()
    cid = future.result(timeout=10)
    assert harness.barrier() == cid
