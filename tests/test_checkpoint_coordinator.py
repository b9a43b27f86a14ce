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


def task_acks(batch: int, files: list[str], token: str) -> list[TaskAck]:
    """A source's and a two-task operator's acknowledgements after ``batch`` (one file each)."""
    acks = [TaskAck("source:s", {"batch": batch, "piece": None})]
    for pid, f in enumerate(files):
        handle = {"range": f"kg{pid:05d}-{pid + 1:05d}", "token": token,
                  "files": [{"path": f, "kind": "changelog", "batch": batch, "rows": 1,
                             "bytes": 10, "range": "x"}]}
        acks.append(TaskAck(f"op:agg:{pid}", {"handle": handle},
                            {"sync_ms": 1, "async_ms": 2, "alignment_ms": 3}))
    return acks


class Harness:
    """A coordinator with one source and one two-task operator, acknowledged by hand."""

    def __init__(self, tmp_path, *, fence=None, pre_commit=None, **config) -> None:
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
            fence=fence or (lambda: None), clock=self.clock, pre_commit=pre_commit)
        self.coordinator.start()

    def barrier(self, timeout: float = 10) -> int:
        """Wait for a trigger (the scheduler's side) and return its id."""

        return self.coordinator.barriers.get(timeout=timeout)

    def ack_all(self, cid: int, batch: int, files: list[str]) -> None:
        c = self.coordinator
        c.place_barrier(cid, batch, {"source:s", "op:agg:0", "op:agg:1"})
        for ack in task_acks(batch, files, f"t{cid}"):
            c.acknowledge(cid, ack)

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


def test_statistics_history_keeps_only_the_newest_records(tmp_path):
    """A long run writes a statistics record per checkpoint: only the newest
    ``historyRetained`` stay (a soak found checkpoints/ gaining 12 files a minute)."""
    h = Harness(tmp_path, retained=1, history_retained=3)
    try:
        for i in range(6):
            h.clock.advance(1000)
            cid = h.barrier()
            h.ack_all(cid, i, [f"/s/a{i}", f"/s/b{i}"])
            assert h.coordinator.completion(cid).result(timeout=10) == "completed"
        names = sorted(p.name for p in (tmp_path / "checkpoints" / "history").iterdir())
        assert names == ["00000004.json", "00000005.json", "00000006.json"]
        assert [s["checkpoint_id"] for s in h.storage.history()] == [4, 5, 6]
        assert h.storage.completed_ids() == [6]
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


# -- barriers placed at published batch boundaries (the micro-batch runtime's mode) -----------

class BoundaryHarness(Harness):
    """The coordinator as the JobScheduler drives it: boundaries published after batches, one
    two-phase sink pre-committed by the coordinator itself."""

    def __init__(self, tmp_path, *, decline: bool = False, **config) -> None:
        self.pre_commits: list[tuple[int, int]] = []
        self.decline = decline
        super().__init__(tmp_path, pre_commit=lambda cid, batch: self.pre_commit(cid, batch),
                         **config)

    def pre_commit(self, cid: int, batch: int) -> dict:
        self.pre_commits.append((cid, batch))
        if self.decline:
            return {"sink:out": OSError("staged file missing")}
        return {"sink:out": TaskAck("sink:out", {"pending": [[cid, {"batch": batch}]]})}

    def boundary(self, batch: int, files: list[str]) -> None:
        from spark_ckpt.checkpoint import Boundary

        acks = task_acks(batch, files, f"t{batch}")
        self.coordinator.publish_boundary(Boundary(batch, tuple(acks), ("out",)))


@pytest.fixture
def boundaries(tmp_path):
    h = BoundaryHarness(tmp_path)
    yield h
    h.stop()


def test_a_barrier_goes_at_once_at_the_latest_boundary(boundaries):
    h = boundaries
    h.boundary(2, ["/s/a2", "/s/b2"])
    h.boundary(3, ["/s/a3", "/s/b3"])
    assert h.coordinator.trigger_now().result(timeout=10) == 1  # after both, in event order
    assert h.listener.wait_for(1) == [("complete", 1)]  # nobody acknowledged by hand
    meta = h.storage.read_metadata(1, "pid")
    assert meta["barrier_batch"] == 3
    assert meta["sources"]["s"] == {"batch": 3, "piece": None}
    assert meta["sinks"]["out"] == {"pending": [[1, {"batch": 3}]]}
    assert [f["path"] for f in meta["operators"]["agg"]["handles"]["0"]["files"]] == ["/s/a3"]
    assert h.pre_commits == [(1, 3)]
    assert h.coordinator.latest_barrier == 3
    assert h.coordinator.take_barrier() is None  # no external placer is asked


def test_no_trigger_without_a_new_boundary_and_a_failed_commit_is_retried(boundaries):
    h = boundaries
    h.clock.advance(5000)  # no boundary yet: nothing to cut
    h.boundary(0, ["/s/a0", "/s/b0"])
    assert h.coordinator.completion(1).result(timeout=10) == "completed"
    h.clock.advance(5000)  # no batch ended since: no checkpoint 2
    h.coordinator.completion(1).result(timeout=10)  # a round trip: the tick after it ran
    assert h.listener.events == [("complete", 1)] and h.stats[-1]["checkpoint_id"] == 1
    h.boundary(1, ["/s/a1", "/s/b1"])
    h.clock.advance(1000)
    assert h.coordinator.completion(2).result(timeout=10) == "completed"

    class Broken(CheckpointListener):
        def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
            if checkpoint_id == 3:
                raise RuntimeError("sink down")

    h.coordinator.listeners.insert(0, Broken())
    h.boundary(2, ["/s/a2", "/s/b2"])
    h.clock.advance(1000)
    assert h.coordinator.completion(3).result(timeout=10) == "completed"
    h.clock.advance(1000)  # same boundary, but checkpoint 3's commit failed: retried
    assert h.coordinator.completion(4).result(timeout=10) == "completed"
    assert h.pre_commits[-1] == (4, 2)
    h.clock.advance(1000)
    h.coordinator.completion(4).result(timeout=10)  # a round trip: the tick after it ran
    assert h.stats[-1]["checkpoint_id"] == 4  # the retry succeeded: quiet again


def test_the_latest_boundary_keeps_its_files_from_the_sweep(tmp_path):
    h = BoundaryHarness(tmp_path, retained=1, interval_ms=0)
    try:
        h.boundary(0, ["/s/a0", "/s/b0"])
        # batch 1 runs: its tasks write new files and let go of batch 0's (and an older one)
        # before batch 1 ends; no checkpoint references batch 0's files yet
        h.coordinator.release_files({"/s/a0", "/s/b0", "/s/old"})
        cid = h.coordinator.trigger_now().result(timeout=10)  # events are handled in order
        assert h.coordinator.completion(cid).result(timeout=10) == "completed"
        assert h.deleted == ["/s/old"]  # the latest boundary's files survived the sweep
        files = {f["path"] for hd in h.storage.read_metadata(cid, "pid")["operators"]["agg"]
                 ["handles"].values() for f in hd["files"]}
        assert files == {"/s/a0", "/s/b0"}
        h.boundary(1, ["/s/a1", "/s/b1"])
        cid = h.coordinator.trigger_now().result(timeout=10)
        assert h.coordinator.completion(cid).result(timeout=10) == "completed"
        assert sorted(h.deleted) == ["/s/a0", "/s/b0", "/s/old"]  # checkpoint 1 subsumed
    finally:
        h.stop()


def test_a_declining_sink_aborts_and_the_next_boundary_completes(tmp_path):
    h = BoundaryHarness(tmp_path, decline=True, tolerable_failures=5)
    try:
        h.boundary(0, ["/s/a", "/s/b"])
        h.clock.advance(1000)
        outcome = h.coordinator.completion(1).result(timeout=10)
        assert outcome.startswith("aborted: a task declined") and "staged file missing" in outcome
        h.decline = False
        h.clock.advance(1000)  # the aborted checkpoint's boundary is still uncovered
        assert h.coordinator.completion(2).result(timeout=10) == "completed"
        assert h.storage.read_metadata(2, "pid")["barrier_batch"] == 0
    finally:
        h.stop()


def test_a_forced_checkpoint_whose_coordinator_fails_answers_at_once(tmp_path):
    from spark_ckpt.errors import JobFencedError

    def fenced() -> None:
        raise JobFencedError("a newer driver owns the checkpoint directory")

    h = BoundaryHarness(tmp_path, fence=fenced, interval_ms=0)
    try:
        h.boundary(0, ["/s/a", "/s/b"])
        with pytest.raises(JobFencedError):
            h.coordinator.trigger_now().result(timeout=10)
        h.coordinator.thread.join(timeout=10)
        assert len(h.failures) == 1 and isinstance(h.failures[0], JobFencedError)
        # the loop has ended: later requests are answered, never left waiting
        with pytest.raises(CheckpointError):
            h.coordinator.trigger_now().result(timeout=10)
        assert h.coordinator.completion(1).result(timeout=10) == "unknown"
    finally:
        h.stop()


def test_a_forced_checkpoint_is_not_expired_by_a_slow_pre_commit(tmp_path, monkeypatch):
    h = BoundaryHarness(tmp_path, interval_ms=0, timeout_ms=500)
    try:
        h.boundary(0, ["/s/a", "/s/b"])
        slow = h.pre_commit

        def pre_commit(cid: int, batch: int) -> dict:
            h.clock.advance(2000)  # the sinks' pre-commit outlasts the timeout
            return slow(cid, batch)

        h.pre_commit = pre_commit
        cid = h.coordinator.trigger_now().result(timeout=10)
        assert h.coordinator.completion(cid).result(timeout=10) == "completed"
    finally:
        h.stop()


def test_sink_transactions_pre_commit_only_the_batches_up_to_the_barrier():
    from spark_ckpt.sinks.two_phase import SinkTransactions, TwoPhaseCommitSink

    class Recording(TwoPhaseCommitSink):
        def __init__(self) -> None:
            super().__init__("out")
            self.committed: list[tuple[int, list[int]]] = []

        def commit(self, checkpoint_id: int, txn: dict) -> None:
            self.committed.append((checkpoint_id, [p["batch"] for p in txn["pieces"]]))

    sink = Recording()
    txns = SinkTransactions(sink, "p")
    for batch in (3, 4, 5):
        txns.staged(batch, {"batch": batch})
    state = txns.pre_commit(7, 4)  # barrier after batch 4; batch 5 is still running
    assert state == {"pending": [[7, {"pieces": [{"batch": 3}, {"batch": 4}]}]]}
    assert txns.open == [(5, {"batch": 5})]
    assert txns.pre_commit(8, 4) == state  # nothing new up to batch 4: no new transaction
    txns.notify_checkpoint_complete(8)  # subsumes 7
    assert sink.committed == [(7, [3, 4])] and not txns.pending
    txns.pre_commit(9, 5)
    txns.notify_checkpoint_complete(9)
    assert sink.committed[-1] == (9, [5])


def test_a_driver_fenced_while_writing_the_metadata_commits_no_sink(tmp_path):
    """A driver that stalls between its fence check and the metadata write (a long GC, a
    frozen VM) and wakes after a newer driver took over must not commit its sinks."""
    from spark_ckpt.errors import JobFencedError

    newer_driver = threading.Event()

    def fence() -> None:
        if newer_driver.is_set():
            raise JobFencedError("a newer driver owns the checkpoint directory")

    h = Harness(tmp_path, fence=fence)
    write = h.storage.write_metadata

    def stalled_write(cid: int, body: dict) -> int:
        size = write(cid, body)
        newer_driver.set()  # the newer driver claimed the directory during the stall
        return size

    h.storage.write_metadata = stalled_write
    try:
        h.clock.advance(1000)
        cid = h.barrier()
        h.ack_all(cid, 0, ["/s/a", "/s/b"])
        h.coordinator.thread.join(timeout=10)
        assert len(h.failures) == 1 and isinstance(h.failures[0], JobFencedError)
        assert h.listener.events == []  # no notify-complete: no sink commits
        assert h.storage.completed_ids() == []  # nor a checkpoint a later start could restore
        assert (tmp_path / "checkpoints" / "chk-00000001" / "_metadata.abandoned.json").exists()
    finally:
        h.stop()
