from spark_ckpt.eventlog.events import Event, EventType as T
from spark_ckpt.eventlog.replay import replay


def ev(t, attempt, seq, **kw):
    return Event(t, kw.pop("payload", {}), job_id="j", job_attempt=attempt, seq=seq, **kw)


def finished(attempt, seq, vertex, p, attempt_id):
    return ev(T.EXECUTION_VERTEX_FINISHED, attempt, seq, vertex_id=vertex, partition=p,
              attempt_id=attempt_id, payload={"outputs": [
                  {"kind": "result", "target": "c", "path": f"/x/{attempt_id}", "size": 1,
                   "rows": 1, "groups": {"0": [0, 1, 1]}}]})


def test_last_finished_event_of_a_partition_wins():
    h = replay([finished(1, 1, "v", 0, "first"), finished(2, 1, "v", 0, "second")])
    assert h.finished[("v", 0)].attempt_id == "second"
    assert h.finished[("v", 0)].outputs[0].groups == {0: [0, 1, 1]}


def test_reset_after_finished_makes_partition_unfinished_until_finished_again():
    events = [finished(1, 1, "v", 0, "a"), finished(1, 2, "v", 1, "b"),
              ev(T.EXECUTION_VERTEX_RESET, 2, 1, vertex_id="v", partition=0)]
    h = replay(events)
    assert set(h.finished) == {("v", 1)}
    h = replay(events + [finished(2, 2, "v", 0, "c")])
    assert h.finished[("v", 0)].attempt_id == "c"


def test_every_partition_ever_logged_keeps_the_last_attempt_that_logged_it():
    h = replay([finished(1, 1, "v", 0, "a"), finished(1, 2, "v", 1, "b"),
                ev(T.EXECUTION_VERTEX_RESET, 2, 1, vertex_id="v", partition=0),
                finished(3, 1, "v", 1, "c")])
    assert h.ever_finished == {("v", 0): 1, ("v", 1): 3}


def test_vertex_wide_reset_clears_every_partition():
    h = replay([finished(1, 1, "v", 0, "a"), finished(1, 2, "v", 1, "b"),
                finished(1, 3, "w", 0, "c"), ev(T.EXECUTION_VERTEX_RESET, 2, 1, vertex_id="v")])
    assert set(h.finished) == {("w", 0)}


def test_attempts_sinks_and_completion():
    h = replay([
        ev(T.JOB_ATTEMPT_STARTED, 1, 1, payload={"mode": "fresh"}),
        ev(T.SINK_COMMIT_STARTED, 1, 2, payload={"sink": "s", "version": 3}),
        ev(T.JOB_ATTEMPT_STARTED, 2, 1, payload={"mode": "recovery"}),
        ev(T.SINK_COMMITTED, 2, 2, payload={"sink": "s", "version": 3}),
        ev(T.JOB_ATTEMPT_FINISHED, 2, 3, payload={"status": "succeeded", "ran": 4}),
    ])
    assert h.attempts[1].status.startswith("unknown")
    assert h.attempts[2].status == "succeeded" and h.attempts[2].ran == 4
    assert h.sink_started == {"s": 3} and h.sink_committed == {"s": 3}
    assert h.completed and h.last_attempt == 2


def test_failed_attempt_does_not_complete_the_job():
    h = replay([ev(T.JOB_ATTEMPT_STARTED, 1, 1),
                ev(T.JOB_ATTEMPT_FINISHED, 1, 2, payload={"status": "failed", "error": "x"})])
    assert not h.completed and h.attempts[1].error == "x"


def test_event_row_round_trip_keeps_every_field():
    e = Event(T.EXECUTION_VERTEX_FINISHED, {"a": [1, 2]}, vertex_id="v", partition=3,
              attempt_id="x", rows=5, bytes=6, duration_ms=7, job_id="j", job_attempt=2, seq=9,
              time_us=1_700_000_000_000_000)
    assert Event.from_row(e.row()) == e


def test_columnar_replay_of_a_table_equals_event_by_event_replay():
    import random

    from spark_ckpt.eventlog.events import events_to_table
    from spark_ckpt.eventlog.replay import replay_table

    rng = random.Random(5)
    events, seq = [], {1: 0, 2: 0, 3: 0}
    for attempt in (1, 2, 3):
        events.append(ev(T.JOB_ATTEMPT_STARTED, attempt, 0, payload={"mode": "x"}))
        for _ in range(200):
            seq[attempt] += 1
            vertex, p = rng.choice("abc"), rng.randrange(6)
            if rng.random() < 0.15:
                whole = rng.random() < 0.2
                events.append(ev(T.EXECUTION_VERTEX_RESET, attempt, seq[attempt],
                                 vertex_id=vertex, partition=None if whole else p))
            else:
                events.append(finished(attempt, seq[attempt], vertex, p, f"{attempt}-{seq}"))
    events.append(ev(T.SINK_COMMIT_STARTED, 3, 999, payload={"sink": "s", "version": 2}))
    rng.shuffle(events)  # the log holds rows in no order; (attempt, seq) orders them
    one = replay(sorted(events, key=lambda e: (e.job_attempt, e.seq)))
    two = replay_table(events_to_table(events))
    assert {k: f.attempt_id for k, f in one.finished.items()} == \
        {k: f.attempt_id for k, f in two.finished.items()}
    assert [f.outputs for f in one.finished.values()] == \
        [two.finished[k].outputs for k in one.finished]
    assert (one.resets, one.sink_started, one.events) == (two.resets, two.sink_started, two.events)
    assert one.attempts.keys() == two.attempts.keys()
    # the last attempt that logged each partition finished, resets or not (batch.adoption)
    assert one.ever_finished == two.ever_finished and len(one.ever_finished) == 18
    assert set(one.ever_finished.values()) <= {1, 2, 3} and 3 in one.ever_finished.values()
