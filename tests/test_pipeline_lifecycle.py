"""The pipeline's lifecycle and the owners of its shared state: start, stop, failures,
housekeeping, the batch queue's in-flight bound, the allocation store, the injected clock."""

from __future__ import annotations

import logging
import os
import threading

import pytest
from helpers import wait_for

from spark_ckpt import JobDefinitionError, PipelineFailedError, Settings, StreamingContext
from spark_ckpt.clock import ManualClock
from spark_ckpt.errors import IllegalStateTransition
from spark_ckpt.storage import Storage
from spark_ckpt.streaming.runtime.allocations import AllocationStore
from spark_ckpt.streaming.template.batch_run import BatchAllocation
from spark_ckpt.streaming.runtime.batch_queue import FINISH, BatchQueue, QueuedBatch
from spark_ckpt.streaming.runtime.lifecycle import Lifecycle, PipelineState
from spark_ckpt.streaming.runtime.metalog import MetadataLog
from spark_ckpt.streaming.runtime.pipeline_loop import (
    BatchCompleted,
    BatchFailed,
    CheckpointFailed,
    Finished,
    PipelineLoop,
    SchedulerExited,
    StartFailed,
    StopRequested,
)
from spark_ckpt.streaming.runtime.progress import ProgressLog


def make_ctx(spark, tmp_path, name="life", interval=0.2, clock=None, **settings):
    return StreamingContext(spark, interval, str(tmp_path / "ckpt"), name,
                            settings=Settings(progress="never", **settings), clock=clock)


# -- the lifecycle state machine -----------------------------------------------------------
def test_lifecycle_moves_only_along_its_table():
    life = Lifecycle("p")
    life.begin_start()
    assert life.state is PipelineState.STARTING
    assert life.started() is False
    assert life.finish(ValueError("x")) is True
    assert life.finish(None) is False  # the first outcome wins
    assert isinstance(life.error, ValueError)
    life.terminate()
    assert life.state is PipelineState.STOPPED and life.terminated.is_set()
    with pytest.raises(JobDefinitionError, match="a context starts once"):
        life.begin_start()
    with pytest.raises(IllegalStateTransition, match="STOPPED -> RUNNING"):
        life._set(PipelineState.RUNNING)


def test_stop_before_start_stops_and_a_failed_start_cannot_start_again():
    life = Lifecycle("p")
    assert life.request_stop() is PipelineState.CREATED
    assert life.state is PipelineState.STOPPED and life.terminated.is_set()
    failed = Lifecycle("q")
    failed.begin_start()
    failed.start_failed(OSError("disk gone"))
    with pytest.raises(JobDefinitionError, match=r"earlier start\(\) failed \(disk gone\)"):
        failed.begin_start()


# -- the pipeline loop: the one owner of the schedule, the in-flight bound and the outcome -----
def _alloc(b):
    return BatchAllocation(b, 1000 * b, {})


class _Generator:
    """The generator's steps as the loop sees them: a queued batch, or None when empty."""

    def __init__(self, batches, empty_from=None, time_moves=None):
        self.batches, self.next_batch, self.times = batches, 0, []
        self.empty_from, self.fail_at = empty_from, None
        # whether event time moved, asked when no input is left (None: no event time)
        self.time_moved = (lambda _t: bool(time_moves and time_moves.pop(0))) \
            if time_moves is not None else None
        self.no_data = []  # the no-data batches generated

    def generate(self, batch_time_ms, no_data=False):
        if no_data:
            self.no_data.append(self.next_batch)
        elif self.empty_from is not None and self.next_batch >= self.empty_from:
            return None
        if self.fail_at == self.next_batch:
            raise OSError("listing the source failed")
        queued = QueuedBatch(_alloc(self.next_batch), holds_slot=True)
        self.times.append(batch_time_ms)
        self.next_batch += 1
        self.batches.put(queued)
        return queued

    def next_tick(self, previous_ms):
        return previous_ms + 10_000


class _Scheduler:
    graceful = False

    def __init__(self):
        self.stops, self.cancels, self.running = [], 0, True
        self.final, self.final_error, self.final_taken = (None, None), None, False

    def stop(self, *, drain=False):
        self.stops.append(drain)

    def cancel_running(self):
        self.cancels += 1

    def started(self):
        return self.running

    def join(self):
        pass


class _Housekeeping:
    def __init__(self):
        self.completed, self.shutdowns = [], []

    def batch_completed(self, progress):
        self.completed.append(progress["batch_id"])

    def batch_started(self, info):
        pass

    def checkpoint_stats(self, stats):
        pass

    def failure(self, batch_id, error, *, drain):
        return error

    def checkpoint_failure(self, error):
        return error

    def shutdown(self, error):
        self.shutdowns.append(error)


def _loop(clock, max_in_flight=1, available_now=False, empty_from=None, control=None,
          time_moves=None):
    life = Lifecycle("p")
    life.begin_start()
    life.started()
    batches = BatchQueue()
    parts = (_Generator(batches, empty_from, time_moves), _Scheduler(), _Housekeeping())
    loop = PipelineLoop("p", lifecycle=life, generator=parts[0], batches=batches,
                        scheduler=parts[1], housekeeping=parts[2], clock=clock,
                        max_in_flight=max_in_flight,
                        available_now=available_now, stop_control=control, stop_poll_ms=1000)
    return loop, life, batches, *parts


def test_the_loop_ticks_on_its_clock_and_bounds_the_batches_in_flight():
    clock = ManualClock(start_ms=0)
    loop, life, batches, generator, scheduler, house = _loop(clock, max_in_flight=1)
    loop.start()
    first = batches.take()
    assert first.allocation.batch_id == 0 and generator.times == [0]
    clock.advance(30_000)  # three ticks due, one slot: nothing more is generated
    assert not wait_for(lambda: generator.next_batch > 1, 0.5, 0.02)
    loop.post(BatchCompleted({"batch_id": 0}, holds_slot=True))  # the slot is back
    assert batches.take().allocation.batch_id == 1
    assert generator.times == [0, 10_000]  # the next due tick
    assert house.completed == [0]
    loop.post(BatchFailed(1, ValueError("bad batch"), holds_slot=True))
    loop.post(CheckpointFailed(OSError("later")))  # the first outcome wins
    assert wait_for(lambda: scheduler.stops, 10, 0.02) and scheduler.stops == [False]
    assert loop.stopping.is_set() and not life.terminated.is_set()  # the scheduler still runs
    loop.post(SchedulerExited())
    assert life.terminated.wait(10)
    assert isinstance(life.error, ValueError) and house.shutdowns == [life.error]
    assert generator.next_batch == 2  # nothing generated after the failure


def test_a_cancelling_stop_is_no_failure_and_available_now_finishes():
    clock = ManualClock(start_ms=0)
    loop, life, batches, generator, scheduler, house = _loop(clock, max_in_flight=2)
    loop.start()
    assert batches.take().allocation.batch_id == 0
    loop.post(StopRequested(graceful=False, cancel=True))
    assert wait_for(lambda: scheduler.cancels == 1 and scheduler.stops == [False], 10, 0.02)
    loop.post(BatchFailed(0, RuntimeError("cancelled"), holds_slot=True))
    clock.advance(50_000)  # due five times over: a stopping loop generates nothing
    assert not wait_for(lambda: generator.next_batch > 1, 0.5, 0.02)
    loop.post(SchedulerExited())
    assert life.terminated.wait(10) and life.error is None

    loop, life, batches, generator, scheduler, house = _loop(
        ManualClock(start_ms=0), max_in_flight=5, available_now=True, empty_from=3)
    loop.start()
    items = [batches.take() for _ in range(4)]  # as fast as slots allow, then the end
    assert [i.allocation.batch_id for i in items[:3]] == [0, 1, 2] and items[3] == FINISH
    loop.post(Finished())
    loop.post(SchedulerExited())
    assert life.terminated.wait(10) and life.error is None and scheduler.stops == [False]


def test_available_now_waits_for_running_batches_then_runs_a_no_data_batch_if_time_moved():
    """No input left after batch 1: the loop asks nothing while batches 0 and 1 run (they may
    move event time), then asks once; time moved: a no-data batch; asked again after it, time
    stands: the end. Never asked while a batch runs, never a spin."""
    loop, life, batches, generator, scheduler, house = _loop(
        ManualClock(start_ms=0), max_in_flight=2, available_now=True, empty_from=2,
        time_moves=[True, False])
    loop.start()
    assert [batches.take().allocation.batch_id for _ in range(2)] == [0, 1]
    assert not wait_for(lambda: generator.no_data, 0.5, 0.02)  # batches still run: no asking
    loop.post(BatchCompleted({"batch_id": 0}, holds_slot=True))
    assert not wait_for(lambda: generator.no_data, 0.3, 0.02)  # batch 1 still runs
    loop.post(BatchCompleted({"batch_id": 1}, holds_slot=True))
    no_data = batches.take()
    assert no_data.allocation.batch_id == 2 and generator.no_data == [2]
    loop.post(BatchCompleted({"batch_id": 2}, holds_slot=True))
    assert batches.take() == FINISH
    loop.post(Finished())
    loop.post(SchedulerExited())
    assert life.terminated.wait(10) and life.error is None


def test_a_stop_request_from_outside_is_taken_on_the_clock_and_answered_after_the_stop(
        tmp_path):
    from spark_ckpt.streaming.runtime.stop_control import StopControl, read_answer, request_stop

    store = Storage(str(tmp_path))
    stale = request_stop(store, store.root, 1, 0)  # for run 1, whose driver is gone
    clock = ManualClock(start_ms=0)
    control = StopControl(store, store.root, "p", 2)
    loop, life, batches, generator, scheduler, house = _loop(clock, max_in_flight=2,
                                                             control=control)
    loop.start()
    assert batches.take().allocation.batch_id == 0
    # the first look answers the stale request and does not stop this run
    assert wait_for(lambda: read_answer(store, store.root, stale.request_id), 10, 0.02)
    gone = read_answer(store, store.root, stale.request_id)
    assert (gone.status, gone.run, gone.checkpoint_id) == ("abandoned", 2, None)
    assert "run 1" in gone.message and not loop.stopping.is_set()
    mine = request_stop(store, store.root, 2, 5)
    assert not wait_for(lambda: loop.stopping.is_set(), 0.3, 0.02)  # not looked for yet
    clock.advance(1000)  # the next look
    assert wait_for(lambda: scheduler.stops == [False], 10, 0.02)
    assert scheduler.graceful and loop.stopping.is_set()
    assert read_answer(store, store.root, mine.request_id) is None  # not before it stopped
    scheduler.final, scheduler.final_taken = (7, 41), True  # the final checkpoint
    loop.post(SchedulerExited())
    assert life.terminated.wait(10) and life.error is None
    done = read_answer(store, store.root, mine.request_id)
    assert (done.status, done.checkpoint_id, done.barrier_batch) == ("stopped", 7, 41)
    assert "restoreFrom=7" in done.message

    # a final checkpoint that failed is answered as such, with no checkpoint id
    control = StopControl(store, store.root, "p", 3)
    loop, life, batches, generator, scheduler, house = _loop(ManualClock(start_ms=0),
                                                             control=control)
    third = request_stop(store, store.root, 3, 0)
    loop.start()
    assert wait_for(lambda: scheduler.stops == [False], 10, 0.02)
    scheduler.final_error = OSError("checkpoint storage full")
    loop.post(SchedulerExited())
    assert life.terminated.wait(10)
    failed = read_answer(store, store.root, third.request_id)
    assert (failed.status, failed.checkpoint_id) == ("failed", None)
    assert "checkpoint storage full" in failed.message

    # a cancelling stop after the request (no final checkpoint taken) is no "stopped"
    control = StopControl(store, store.root, "p", 4)
    loop, life, batches, generator, scheduler, house = _loop(ManualClock(start_ms=0),
                                                             control=control)
    fourth = request_stop(store, store.root, 4, 0)
    loop.start()
    assert wait_for(lambda: scheduler.stops == [False], 10, 0.02)
    loop.post(StopRequested(graceful=False, cancel=True))
    loop.post(SchedulerExited())
    assert life.terminated.wait(10)
    cancelled = read_answer(store, store.root, fourth.request_id)
    assert (cancelled.status, cancelled.checkpoint_id) == ("failed", None)
    assert "without a final checkpoint" in cancelled.message
    # the first answer stands
    assert control.answer(fourth, "stopped", 9, 9, "late", 1).status == "stopped"
    assert read_answer(store, store.root, fourth.request_id).status == "failed"


def test_stop_requests_that_cannot_be_read_are_skipped_with_a_warning(tmp_path, caplog):
    from spark_ckpt.streaming.runtime.stop_control import StopControl, request_stop, withdraw

    store = Storage(str(tmp_path))
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "stop-bad.request.json").write_text('{"kind": "nope"}')
    control = StopControl(store, store.root, "p", 4)
    with caplog.at_level(logging.WARNING):
        assert control.poll(0) is None
        assert control.poll(1) is None
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1  # once
    later = request_stop(store, store.root, 5, 0)  # for a newer run: not this driver's
    assert control.poll(2) is None
    mine = request_stop(store, store.root, 4, 3)
    assert control.poll(4) == mine
    withdraw(store, store.root, mine.request_id)
    withdraw(store, store.root, mine.request_id)  # gone already: no error
    assert control.poll(5) is None
    assert os.path.exists(tmp_path / "control" / f"stop-{later.request_id}.request.json")


def test_the_loop_drains_after_an_allocation_failure_and_a_failure_beats_a_graceful_stop():
    clock = ManualClock(start_ms=0)
    loop, life, batches, generator, scheduler, house = _loop(clock, max_in_flight=3)
    generator.fail_at = 2
    loop.start()
    assert batches.take().allocation.batch_id == 0
    clock.advance(10_000)
    assert batches.take().allocation.batch_id == 1
    clock.advance(10_000)  # batch 2 cannot be allocated: batches 0 and 1 still run (drain)
    assert wait_for(lambda: scheduler.stops == [True], 10, 0.02)
    loop.post(SchedulerExited())
    assert life.terminated.wait(10)
    assert isinstance(life.error, OSError) and "listing the source" in str(life.error)

    loop, life, batches, generator, scheduler, house = _loop(ManualClock(start_ms=0))
    loop.start()
    batches.take()
    loop.post(StopRequested(graceful=True, cancel=False))
    assert wait_for(lambda: scheduler.stops == [False], 10, 0.02) and scheduler.graceful
    loop.post(BatchFailed(0, ValueError("the running batch failed"), holds_slot=True))
    loop.post(SchedulerExited())
    assert life.terminated.wait(10)
    assert isinstance(life.error, ValueError)  # not hidden behind the stop


def test_a_start_that_failed_before_the_scheduler_ran_terminates_at_once():
    loop, life, batches, generator, scheduler, house = _loop(ManualClock(start_ms=0))
    scheduler.running = False
    error = OSError("receiver could not bind")
    life.finish(error)  # start() records the outcome before the loop runs
    loop.post(StartFailed(error))
    loop.start()
    assert life.terminated.wait(10) and life.error is error
    assert house.shutdowns == [error] and scheduler.stops == []


# -- the allocation store ------------------------------------------------------------------
def test_allocation_store_records_reads_and_purges_from_several_threads(tmp_path):
    storage = Storage(str(tmp_path))
    store = AllocationStore(MetadataLog(storage, str(tmp_path / "allocations"), "allocation"))
    errors: list[BaseException] = []
    done = threading.Event()

    def generator():
        try:
            for b in range(300):
                assert store.record(_alloc(b))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            done.set()

    def scheduler():
        try:
            while not done.is_set():
                for a in store.below(10_000):
                    store.get(a.batch_id)
                store.purge(max(0, len(store.below(10_000)) - 5))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=generator), threading.Thread(target=scheduler)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert store.get(299) == _alloc(299)
    assert not store.record(_alloc(299))  # a second record of a batch is refused


# -- a running pipeline --------------------------------------------------------------------
def test_the_generator_ticks_on_the_injected_clock(spark, tmp_path):
    clock = ManualClock(start_ms=5_000_000)
    ctx = make_ctx(spark, tmp_path, interval=10.0, clock=clock)
    ctx.generator_stream("g", rows_per_batch=3).foreach_batch(lambda df, b: None, name="o")
    ctx.start()
    try:
        assert wait_for(lambda: len(ctx.recent_progress) == 1, 60, 0.02)
        for n in (2, 3):
            clock.advance(10_000)
            assert wait_for(lambda n=n: len(ctx.recent_progress) == n, 60, 0.02)
    finally:
        ctx.stop(graceful=False, timeout=60)
    assert [p["batch_time_ms"] for p in ctx.recent_progress] == [5_000_000, 5_010_000,
                                                                 5_020_000]
    # the scheduler's timestamps come from the same clock
    assert ctx.recent_progress[0]["timestamp"] == "1970-01-01T01:23:20.000Z"


def test_a_restart_with_more_pending_batches_than_slots_runs_them_all(spark, tmp_path):
    clock = ManualClock()
    first = make_ctx(spark, tmp_path, clock=clock, interval=1.0,
                     stream_max_batches_in_flight=3)
    release = threading.Event()

    def stuck_then_fail(df, batch):
        release.wait(60)
        raise RuntimeError("batch 0 gives up")

    first.generator_stream("g", rows_per_batch=4, total_rows=40).foreach_batch(
        stuck_then_fail, name="o")
    first.start()
    allocations = tmp_path / "ckpt" / "allocations"
    for n in (2, 3):
        clock.advance(1000)
        assert wait_for(lambda n=n: len(os.listdir(allocations)) == n, 60, 0.02)
    release.set()
    with pytest.raises(PipelineFailedError, match="batch 0 gives up"):
        first.await_termination(60)
    assert not (tmp_path / "ckpt" / "commits").exists() or \
        not os.listdir(tmp_path / "ckpt" / "commits")
    seen: list[int] = []
    second = make_ctx(spark, tmp_path, stream_max_batches_in_flight=1)
    second.generator_stream("g", rows_per_batch=4, total_rows=40).foreach_batch(
        lambda df, b: seen.append(b), name="o")
    progress = second.process_available(timeout=120)
    assert [p["recovered"] for p in progress[:3]] == [True, True, True]
    assert seen[:3] == [0, 1, 2]


def test_a_failed_start_stops_cleanly_and_says_why_on_a_second_start(spark, tmp_path):
    owner = make_ctx(spark, tmp_path, name="owner")
    owner.generator_stream("g", rows_per_batch=1, total_rows=1).foreach_batch(
        lambda df, b: None, name="o")
    owner.process_available(timeout=120)
    ctx = make_ctx(spark, tmp_path, name="intruder")
    ctx.generator_stream("g", rows_per_batch=1).foreach_batch(lambda df, b: None, name="o")
    with pytest.raises(JobDefinitionError, match="belongs to pipeline 'owner'"):
        ctx.start()
    ctx.stop()  # a no-op, not an AttributeError
    with pytest.raises(JobDefinitionError, match=r"earlier start\(\) failed.*'owner'"):
        ctx.start()
    with pytest.raises(JobDefinitionError, match="belongs to pipeline 'owner'"):
        ctx.await_termination(0)


def test_housekeeping_failures_after_a_commit_are_warnings(spark, tmp_path, monkeypatch,
                                                           caplog):
    monkeypatch.setenv("SPARK_CKPT_FAULT", "stream.purge:1:fail")

    def no_progress_line(self, progress):
        if progress["batch_id"] == 3:
            raise OSError("progress volume full")

    monkeypatch.setattr(ProgressLog, "append", no_progress_line)
    ctx = make_ctx(spark, tmp_path, stream_min_batches_to_retain=2)
    ctx.generator_stream("g", rows_per_batch=2, total_rows=24).foreach_batch(
        lambda df, b: None, name="o")
    with caplog.at_level(logging.WARNING, logger="spark_ckpt.streaming"):
        progress = ctx.process_available(timeout=180)
    assert [p["batch_id"] for p in progress] == list(range(12))
    text = caplog.text
    assert "batch 3 committed; writing its progress line failed: progress volume full" in text
    assert "batch 10 committed; purging the records of older batches failed" in text
    assert len(os.listdir(tmp_path / "ckpt" / "commits")) == 12  # not purged: it failed


def test_a_stop_while_start_is_restoring_stops_the_pipeline_once_it_is_up(spark, tmp_path,
                                                                           monkeypatch):
    from spark_ckpt.sources.receivers import QueueSource

    restoring, release = threading.Event(), threading.Event()
    original = QueueSource.restore

    def slow_restore(self, pieces):
        restoring.set()
        assert release.wait(60)
        original(self, pieces)

    monkeypatch.setattr(QueueSource, "restore", slow_restore)
    ctx = make_ctx(spark, tmp_path)
    ctx.queue_stream("q", "id BIGINT").foreach_batch(lambda df, b: None, name="o")
    starter = threading.Thread(target=ctx.start)
    starter.start()
    assert restoring.wait(60)
    stopper = threading.Thread(target=ctx.stop, kwargs={"timeout": 60})
    stopper.start()
    assert wait_for(lambda: ctx._lifecycle._stop_requested, 60, 0.02)
    release.set()
    starter.join(60)
    stopper.join(60)
    assert ctx.await_termination(0)  # stopped on request, no error
    assert ctx._lifecycle.state is PipelineState.STOPPED
    ctx.loop.thread.join(10)  # it sets the termination as its last act
    assert not ctx.loop.thread.is_alive() and not ctx.scheduler.thread.is_alive()


def test_the_progress_log_rotates_and_keeps_the_newest_files(tmp_path):
    import json

    log = ProgressLog(Storage(str(tmp_path)), str(tmp_path), max_bytes=200, keep=3)
    for b in range(40):
        log.append({"batch_id": b, "pad": "x" * 20})
    files = sorted(p.name for p in (tmp_path / "progress").iterdir())
    assert files == ["progress.jsonl", "progress.jsonl.1", "progress.jsonl.2"]
    sizes = [(tmp_path / "progress" / f).stat().st_size for f in files]
    assert all(size <= 200 for size in sizes)
    newest = [json.loads(line)["batch_id"] for line in
              (tmp_path / "progress" / "progress.jsonl").read_text().splitlines()]
    previous = [json.loads(line)["batch_id"] for line in
                (tmp_path / "progress" / "progress.jsonl.1").read_text().splitlines()]
    assert newest[-1] == 39 and previous[-1] == newest[0] - 1  # nothing lost across a rotation
