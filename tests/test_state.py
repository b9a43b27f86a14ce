import threading

import pytest

from spark_ckpt.errors import IllegalStateTransition
from spark_ckpt.execution.attempts import ExecutionRegistry
from spark_ckpt.execution.attempt_states import TRANSITIONS, ExecutionState as S, StateMachine


def test_happy_path_reaches_finished():
    m = StateMachine("t")
    assert m.transition(S.CREATED, S.DEPLOYING)
    assert m.transition(S.DEPLOYING, S.RUNNING)
    assert m.transition(S.RUNNING, S.FINISHED)
    assert m.state is S.FINISHED


def test_cancel_path():
    m = StateMachine("t")
    assert m.move_to(S.DEPLOYING) and m.move_to(S.RUNNING)
    assert m.move_to(S.CANCELING) and m.move_to(S.CANCELED)


@pytest.mark.parametrize("state", [s for s in S if not s.is_final])
def test_failed_is_reachable_from_every_live_state(state):
    assert S.FAILED in TRANSITIONS[state]


def test_illegal_transition_names_both_states():
    m = StateMachine("attempt x")
    with pytest.raises(IllegalStateTransition, match="CREATED -> FINISHED"):
        m.transition(S.CREATED, S.FINISHED)
    with pytest.raises(IllegalStateTransition, match="RUNNING -> DEPLOYING"):
        m.transition(S.RUNNING, S.DEPLOYING)


def test_compare_and_set_loses_when_state_moved():
    m = StateMachine("t")
    m.move_to(S.DEPLOYING)
    assert not m.transition(S.CREATED, S.DEPLOYING)


def test_final_state_is_reported_exactly_once_across_threads():
    m = StateMachine("t")
    m.move_to(S.DEPLOYING)
    m.move_to(S.RUNNING)
    wins = []
    barrier = threading.Barrier(8)

    def report(target):
        barrier.wait()
        wins.append(m.move_to(target))

    threads = [threading.Thread(target=report, args=(S.FINISHED if i % 2 else S.FAILED,))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 1
    assert m.state.is_final


def test_registry_refuses_duplicate_attempt_id_and_counts_attempts():
    registry = ExecutionRegistry()
    first = registry.create(1, "v", 0, attempt_id="a-1")
    with pytest.raises(ValueError, match="already registered"):
        registry.create(1, "v", 0, attempt_id="a-1")
    second = registry.create(1, "v", 0)
    assert (first.attempt_number, second.attempt_number) == (0, 1)
    assert first.attempt_id != second.attempt_id
    assert registry.get("a-1") is first
