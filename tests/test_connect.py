"""The core scenarios again, on Spark Connect: the same tests, a different kind of session.

As PySpark's parity tests run the same test classes on a classic and a Connect session, each
group below runs chosen tests of this suite in a child pytest whose ``spark`` fixture is a
Spark Connect session to one standalone server (``sbin/start-connect-server.sh``, started once
for the run), and whose drivers (the batch and streaming jobs the fault tests start and
SIGKILL) are Connect clients of that server: a killed driver is a crashed client, the server
and its warm JVM stay, and the next client resumes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import LONG_FAULTS, ROOT

pytestmark = [pytest.mark.connect, pytest.mark.slow]

PARITY = {
    "seam": [
        "tests/test_seam.py::test_the_seam_answers_on_this_kind_of_session",
        "tests/test_seam.py::"
        "test_operations_a_killed_client_left_running_are_interrupted_by_the_next",
        "tests/test_seam.py::"
        "test_an_aggregation_is_split_and_replaced_in_its_plan_on_this_kind_of_session",
    ],
    "seam-long": [
        # the split of an aggregation, from the Connect client's plan tree
        "tests/test_batch_cuts.py::test_split_aggregate_gives_plain_sparks_answer",
        "tests/test_batch_cuts.py::"
        "test_an_aggregation_is_split_whatever_the_function_does_after_it",
        "tests/test_batch_cuts.py::"
        "test_aggregations_without_a_partial_form_are_refused_naming_why",
        "tests/test_batch_cuts.py::"
        "test_what_reads_rows_a_split_does_not_have_is_refused_and_identities_are_not",
        "tests/test_batch_cuts.py::"
        "test_a_function_that_plans_otherwise_over_rows_is_refused_not_misread",
    ],
    "batch": [
        "tests/test_batch_job.py::test_job_output_equals_plain_spark_and_every_partition_is_logged",
        "tests/test_batch_job.py::"
        "test_a_few_lost_partitions_of_a_keyed_vertex_run_as_that_many_spark_partitions",
    ],
    "batch-long": [
        "tests/test_batch_job.py::test_dataframe_source_and_partitioned_delta_sink",
        "tests/test_batch_job.py::"
        "test_rows_moved_out_of_the_partitions_running_are_refused_however_they_are_laid_out",
        "tests/test_batch_cuts.py::"
        "test_the_cut_is_the_aggregations_exchange_whatever_follows_it[sorted_report-Sort]",
        "tests/test_batch_cuts.py::"
        "test_killed_during_partial_waves_resumes_from_them[sorted_report]",
    ],
    # a killed batch client: SPARK_CKPT_LONG_FAULTS=1 (CI kills a streaming client on Connect,
    # stream-client-killed below; these two groups were four minutes of a 2-core machine)
    "batch-client-killed": [
        "tests/test_recovery_faults.py::test_kill_during_a_sink_commit_commits_exactly_once"
        "[sink.committed:2]",
        # (its six cases: kills at events and from outside, a killed re-run, a replaced input)
        "tests/test_recovery_faults.py::"
        "test_the_next_client_records_what_a_killed_clients_writes_finished_on_the_server",
    ],
    "batch-client-killed-long": [
        "tests/test_recovery_faults.py::test_kill_before_and_after_each_kind_of_event"
        "[vertex.finished:1-10]",
        "tests/test_recovery_faults.py::test_killed_from_outside_mid_vertex",
        "tests/test_recovery_faults.py::test_torn_event_log_tail_is_tolerated",
        "tests/test_recovery_faults.py::test_kill_before_and_after_each_kind_of_event"
        "[attempt.started-14]",
        "tests/test_recovery_faults.py::test_kill_before_and_after_each_kind_of_event"
        "[vertex.initialized-14]",
        "tests/test_recovery_faults.py::test_kill_during_a_sink_commit_commits_exactly_once"
        "[sink.commit.files]",
        "tests/test_recovery_faults.py::test_kill_before_and_after_each_kind_of_event"
        "[vertex.finished:3-2]",
        "tests/test_recovery_faults.py::test_kill_before_and_after_each_kind_of_event"
        "[vertex.finished:4-0]",
        "tests/test_recovery_faults.py::test_kill_during_a_sink_commit_commits_exactly_once"
        "[sink.commit.started:2]",
        "tests/test_recovery_faults.py::test_kill_after_the_job_finished_is_already_complete",
        "tests/test_recovery_faults.py::test_unreadable_event_log_starts_fresh_and_keeps_the_old_log",
        "tests/test_recovery_faults.py::"
        "test_event_log_appends_that_fail_twice_are_retried_and_the_job_completes",
        "tests/test_recovery_faults.py::test_killed_twice_in_a_row_then_recovered",
        "tests/test_recovery_faults.py::"
        "test_the_next_client_reads_what_a_killed_client_left_persisted_on_the_server",
    ],
    "keyed-state": [
        "tests/test_keyed_state.py::test_keyed_aggregates_equal_plain_spark_in_every_view"
        "[task-per-range]",
        "tests/test_keyed_state.py::test_rescale_4_to_2_to_8_gives_the_uninterrupted_result",
    ],
    "keyed-state-long": [
        "tests/test_keyed_state.py::test_keyed_aggregates_equal_plain_spark_in_every_view"
        "[one-task]",
        "tests/test_keyed_state.py::test_restore_by_id_replays_from_that_checkpoint",
        "tests/test_state_evolution.py::"
        "test_an_aggregation_gains_an_output_renames_one_and_widens_another",
    ],
    "event-time": [  # windows (Spark's window()/session_window() from the client)
        "tests/test_windows.py::test_every_window_kind_and_function_equals_batch_spark",
    ],
    "event-time-long": [  # stream-stream joins (two inputs' watermarks, kept rows)
        "tests/test_stream_joins.py::test_every_join_kind_equals_batch_sparks_join",
    ],
    "stream-client-killed": [
        "tests/test_checkpoint_recovery.py::test_exactly_once_across_sigkills_at_every_fault_point"
        "[per_key]",
    ],
    "kafka": [  # the Python reader and the commit's tasks run in the server's Python workers
        "tests/test_kafka.py::test_each_batch_reads_its_recorded_offsets_in_sparks_kafka_schema",
    ],
    "kafka-long": [  # the sink's transactions sent from the server's Python workers
        "tests/test_kafka.py::test_a_checkpoints_records_reach_read_committed_consumers_once",
    ],
}


# The batch client kills run from test_connect_clients.py: a test file runs on one xdist worker,
# so the parity run is split in two files the two workers take at the start of the run.
CLIENT_KILLS = ("batch-client-killed", "batch-client-killed-long")
# CI runs the seam on Connect and a killed stream client (test_options.py and test_notebook.py
# run a batch job and keyed pipelines on Connect sessions too); with SPARK_CKPT_LONG_FAULTS=1
# every group runs
LONG_ONLY_GROUPS = ("seam-long", "batch", "batch-long", "keyed-state", "keyed-state-long",
                    "event-time", "event-time-long", "kafka", "kafka-long",
                    "batch-client-killed", "batch-client-killed-long")


def run_parity(connect_url: str, groups: list[str]) -> None:
    """The groups' tests in one child pytest (one set of fixtures, one interpreter start) whose
    session is a Connect client of ``connect_url``: each passes, none skipped."""
    nodes = [node for group in groups for node in PARITY[group]]
    env = {**os.environ, "SPARK_CKPT_TEST_REMOTE": connect_url}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfE",
         *nodes], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1700)
    tail = (done.stdout + done.stderr)[-8000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= len(nodes), tail
    assert " skipped" not in done.stdout.splitlines()[-1], tail  # each ran on Connect


@pytest.mark.timeout(1800)
def test_the_same_tests_pass_on_spark_connect(connect_url):
    """Every group but the batch client kills (test_connect_clients.py) on Connect; the long
    groups too with SPARK_CKPT_LONG_FAULTS=1."""
    run_parity(connect_url, [g for g in PARITY if g not in CLIENT_KILLS and
                             (LONG_FAULTS or g not in LONG_ONLY_GROUPS)])
