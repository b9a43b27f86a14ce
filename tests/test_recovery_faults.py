"""Recovery after real driver crashes: a driver process (Python + JVM + workers) is SIGKILLed
at a named moment, or from outside at an arbitrary one; the job is submitted again and must
produce exactly an uninterrupted run's output, re-running exactly the partitions that had to."""

from __future__ import annotations

import json
import os

from spark_ckpt.storage.delta_reader import read_delta
import signal

import pytest

import orders_report as report
from helpers import (
    LONG_FAULTS,
    TOTAL_PARTITIONS,
    assert_outputs_equal,
    delta_writes,
    finished_in_log,
    kill_group,
    run_driver,
    start_driver,
    wait_for,
)
from spark_ckpt import InputChangedError, Settings

pytestmark = pytest.mark.slow

# exchanges however small the tests' inputs (spark.ckpt.batch.exchangeMinBytes=0): the
# orders report's join runs through its durable exchanges, as a large job's does
SETTINGS = Settings(progress="never", event_log_flush_interval_ms=200, batch_exchange_min_bytes=0)
KILLED = -signal.SIGKILL


def crash(orders_input, tmp_path, fault, job_id="orders", **env):
    proc = run_driver(orders_input, str(tmp_path / "out"), str(tmp_path / "work"), fault=fault,
                      job_id=job_id, **env)
    assert proc.returncode == KILLED, (
        f"driver was not killed at {fault} (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
        f"\n{proc.stderr[-3000:]}"
    )
    if os.environ.get("SPARK_CKPT_TEST_REMOTE"):  # the driver was a Spark Connect client
        newest = sorted((tmp_path / "work" / job_id / "attempts").glob("*.json"))[-1]
        assert json.loads(newest.read_text()).get("connect_session"), newest.read_text()


def resubmit(spark, orders_input, tmp_path, job_id="orders", settings=SETTINGS):
    job = report.build_job(job_id, orders_input, str(tmp_path / "out"), parallelism=4,
                           agg_parallelism=2, work_dir=str(tmp_path / "work"), spark=spark,
                           settings=settings)
    return job.run()


def replace_a_payments_file(input_dir):
    """Rewrite the first payments file with one row fewer and tripled amounts: another size
    under the same path, which recovery sees as replaced."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    victim = sorted((input_dir / "payments").glob("*.parquet"))[0]
    rows = pq.read_table(victim)
    rows = rows.set_column(rows.schema.get_field_index("paid"), "paid",
                           pc.multiply(rows.column("paid"), 3))
    pq.write_table(rows.slice(1), victim)


def assert_daily_is_plain_sparks(spark, input_dir, output):
    """The job's daily report equals plain Spark's over ``input_dir`` (after files in it were
    replaced); plain Spark's settled rows, for more checks."""
    from helpers import read_daily

    orders = spark.read.parquet(str(input_dir / "orders"))
    customers = spark.read.parquet(str(input_dir / "customers"))
    payments = spark.read.parquet(str(input_dir / "payments"))
    settled = report.settle(report.enrich(orders, customers), payments)
    want = report.daily_revenue(settled).toPandas().sort_values(["region", "day"])
    got = read_daily(str(output))
    assert got[list(want.columns)].reset_index(drop=True).equals(want.reset_index(drop=True))
    return settled


def durable(work_dir) -> int:
    return len(finished_in_log(str(work_dir)))


# Scenarios of the driver's own protocol (event log, sinks, recovery planning) that do not
# depend on how the driver's JVM dies, and cases the ones CI runs cover (a kill mid-vertex, a
# Parquet and a Delta commit, a deleted file): SPARK_CKPT_LONG_FAULTS=1 runs them on classic
# drivers and, with Spark Connect clients, in tests/test_connect.py's batch-client-killed groups.
ON_CONNECT_IN_CI = pytest.mark.skipif(
    not (LONG_FAULTS or os.environ.get("SPARK_CKPT_TEST_REMOTE")),
    reason="SPARK_CKPT_LONG_FAULTS=1 runs it, on classic and on Connect")


@pytest.mark.parametrize("fault, expected_ran", [
    pytest.param("attempt.started", TOTAL_PARTITIONS,  # before any vertex was initialized
                 marks=ON_CONNECT_IN_CI),
    pytest.param("vertex.initialized", TOTAL_PARTITIONS,  # vertices recorded, nothing finished
                 marks=ON_CONNECT_IN_CI),
    ("partition.written:7", None),  # a task's file is in place, its event is not logged yet
    pytest.param("partition.finished:2", None,  # right after finished events became durable
                 marks=ON_CONNECT_IN_CI),
    pytest.param("vertex.finished:1", TOTAL_PARTITIONS - 4, marks=ON_CONNECT_IN_CI),  # enriched
    pytest.param("vertex.finished:3", 2, marks=ON_CONNECT_IN_CI),  # all but daily done
    pytest.param("vertex.finished:4", 0, marks=ON_CONNECT_IN_CI),  # all done, none committed
])
def test_kill_before_and_after_each_kind_of_event(
        spark, orders_input, expected_daily, tmp_path, fault, expected_ran):
    crash(orders_input, tmp_path, fault)
    durable_before = durable(tmp_path / "work")
    if expected_ran is None:
        expected_ran = TOTAL_PARTITIONS - durable_before
        assert 0 < durable_before < TOTAL_PARTITIONS
    else:
        assert durable_before == TOTAL_PARTITIONS - expected_ran
    result = resubmit(spark, orders_input, tmp_path)
    assert result.status == "succeeded"
    assert result.ran == expected_ran
    assert result.reused == TOTAL_PARTITIONS - expected_ran
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)
    assert delta_writes(str(tmp_path / "out")) == 1


@pytest.mark.parametrize("fault", [
    "sink.commit.started",  # SinkCommitStarted durable, Parquet marker not yet created
    pytest.param("sink.commit.files", marks=ON_CONNECT_IN_CI),  # marker made, a file moved
    pytest.param("sink.committed:1", marks=ON_CONNECT_IN_CI),  # Parquet committed, not logged
    pytest.param("sink.commit.started:2", marks=ON_CONNECT_IN_CI),  # Delta: logged, untouched
    "sink.committed:2",  # Delta committed, not logged
])
def test_kill_during_a_sink_commit_commits_exactly_once(
        spark, orders_input, expected_daily, tmp_path, fault):
    crash(orders_input, tmp_path, fault)
    result = resubmit(spark, orders_input, tmp_path)
    assert result.status == "succeeded" and result.ran == 0
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)
    assert delta_writes(str(tmp_path / "out")) == 1
    markers = list((tmp_path / "out" / "settled" / "_spark_ckpt_commits").glob("*.json"))
    assert [m.name for m in markers] == ["orders-v00001.json"]


@ON_CONNECT_IN_CI
def test_kill_after_the_job_finished_is_already_complete(
        spark, orders_input, expected_daily, tmp_path):
    crash(orders_input, tmp_path, "attempt.finished")
    result = resubmit(spark, orders_input, tmp_path)
    assert result.status == "already-complete" and result.ran == 0
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)
    assert delta_writes(str(tmp_path / "out")) == 1


@ON_CONNECT_IN_CI
def test_killed_twice_in_a_row_then_recovered(spark, orders_input, expected_daily, tmp_path):
    crash(orders_input, tmp_path, "partition.finished:2")
    first = durable(tmp_path / "work")
    crash(orders_input, tmp_path, "vertex.finished:1")  # the recovery attempt dies too
    second = durable(tmp_path / "work")
    # the second attempt made progress; on a warm Spark Connect server the first may already
    # have logged enriched and settled, so the second can finish every partition before dying
    assert first < second <= TOTAL_PARTITIONS
    result = resubmit(spark, orders_input, tmp_path)
    assert result.attempt == 3
    assert result.ran + result.adopted == TOTAL_PARTITIONS - second
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)


@ON_CONNECT_IN_CI
def test_killed_from_outside_mid_vertex(spark, orders_input, expected_daily, tmp_path):
    proc = start_driver(orders_input, str(tmp_path / "out"), str(tmp_path / "work"))
    try:
        assert wait_for(lambda: durable(tmp_path / "work") >= 6, timeout=240), proc.stdout
    finally:
        kill_group(proc)
    done = durable(tmp_path / "work")
    result = resubmit(spark, orders_input, tmp_path)
    # on Spark Connect, partitions the killed client's writes finished on the server are
    # recorded (adopted), not run; a classic driver's jobs died with it
    assert result.ran + result.adopted == TOTAL_PARTITIONS - done
    if not os.environ.get("SPARK_CKPT_TEST_REMOTE"):
        assert result.adopted == 0
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)


def test_deleted_result_file_reruns_its_partition_and_everything_that_read_it(
        spark, orders_input, expected_daily, tmp_path):
    crash(orders_input, tmp_path, "vertex.finished:3")  # all but daily finished
    # enriched has no key: a wave per partition here (4 partitions), its files in one
    # directory, bucketed for settled (its durable exchange)
    victim = sorted((tmp_path / "work" / "orders" / "results" / "enriched")
                    .glob("a1-u2-*/spark_ckpt_bucket=*/part-*.parquet"))
    assert len(victim) >= 1
    victim[0].unlink()
    from click.testing import CliRunner

    from spark_ckpt.ops.cli import main

    checked = CliRunner().invoke(main, ["validate", "--job", "orders", "--work-dir",
                                        str(tmp_path / "work"), "--json"])
    assert checked.exit_code == 1, checked.output  # found, not repaired
    assert json.loads(checked.output)["lost"] == [["enriched", 2]]
    assert victim[0].name in checked.output
    result = resubmit(spark, orders_input, tmp_path)
    # enriched 2 again, then settled (all 4 read it through a hash edge) and daily
    assert {v: s.ran for v, s in result.vertices.items()} == {
        "enriched": 1, "payments-to-settled": 0, "settled": 4, "daily": 2}
    assert result.lost == [("enriched", 2)]
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)


@ON_CONNECT_IN_CI
def test_deleted_file_of_a_consumed_partition_invalidates_its_consumers(
        spark, orders_input, expected_daily, tmp_path):
    crash(orders_input, tmp_path, "vertex.finished:4")  # all finished, nothing committed
    # settled is keyed by order_id: partition 1 is its task's file, staged for the Parquet
    # sink and read from there by daily
    victim = next((tmp_path / "out" / "settled" / "_spark_ckpt_staging" / "orders" / "settled")
                  .glob("a1-*/part-00001-*.parquet"))
    victim.unlink()
    result = resubmit(spark, orders_input, tmp_path)
    # settled 1 alone runs again (enriched is reused, its hash input filtered to partition 1);
    # both daily partitions read it (hash edge), so they are invalidated and run again
    assert {v: s.ran for v, s in result.vertices.items()} == {
        "enriched": 0, "payments-to-settled": 0, "settled": 1, "daily": 2}
    assert result.lost == [("settled", 1)]
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)


@ON_CONNECT_IN_CI
def test_event_log_appends_that_fail_twice_are_retried_and_the_job_completes(
        spark, orders_input, expected_daily, tmp_path):
    done = run_driver(orders_input, str(tmp_path / "out"), str(tmp_path / "work"),
                      fault="eventlog.write:2-3:fail")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "retrying in" in done.stdout + done.stderr
    assert durable(tmp_path / "work") == TOTAL_PARTITIONS
    assert delta_writes(str(tmp_path / "out")) == 1
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)


@ON_CONNECT_IN_CI
def test_torn_event_log_tail_is_tolerated(spark, orders_input, expected_daily, tmp_path):
    crash(orders_input, tmp_path, "vertex.finished:2")
    log_dir = tmp_path / "work" / "orders" / "events" / "_delta_log"
    commits = sorted(log_dir.glob("*.json"))
    previous = int(commits[-2].stem)
    path = str(tmp_path / "work" / "orders" / "events")
    frame = read_delta(path, version=previous).to_pandas()
    durable_then = frame[frame.event_type == "ExecutionVertexFinished"].shape[0]
    commits[-1].write_text(commits[-1].read_text()[:40])  # a torn last commit
    result = resubmit(spark, orders_input, tmp_path)
    assert result.ran == TOTAL_PARTITIONS - durable_then
    assert any("unreadable" in p for p in result.problems)
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)


@ON_CONNECT_IN_CI
def test_unreadable_event_log_starts_fresh_and_keeps_the_old_log(
        spark, orders_input, expected_daily, tmp_path):
    crash(orders_input, tmp_path, "vertex.finished:2")
    events = tmp_path / "work" / "orders" / "events"
    for commit in (events / "_delta_log").glob("*"):
        commit.write_text("garbage")
    result = resubmit(spark, orders_input, tmp_path)
    assert result.ran == TOTAL_PARTITIONS
    kept = [p.name for p in (tmp_path / "work" / "orders").iterdir()
            if p.name.startswith("events.unreadable-")]
    assert len(kept) == 1
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)


def test_replaced_input_file_reruns_only_what_read_it(spark, orders_input, tmp_path):
    """A corrupt file replaced by a good one after a crash: the partitions that read it (the
    whole wave sharing their files) and what depends on them run again, on the new rows; the
    rest is reused. A removed file is refused."""
    import dataclasses
    import shutil

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from helpers import defaults_text

    local_input = tmp_path / "input"
    shutil.copytree(orders_input, local_input)
    defaults = tmp_path / "spark-defaults.conf"  # waves of two partitions of enriched
    defaults.write_text(defaults_text()
                        + "spark.ckpt.batch.partitionsPerWave 2\n")
    crash(str(local_input), tmp_path, "vertex.finished:1", SPARK_CKPT_DEFAULTS=str(defaults))
    assert {p for v, p in finished_in_log(str(tmp_path / "work")) if v == "enriched"} == \
        {0, 1, 2, 3}
    victim = sorted((local_input / "orders").glob("*.parquet"))[1]  # split 1 of 4
    good = pq.read_table(victim)
    good = good.set_column(good.schema.get_field_index("amount"), "amount",
                           pc.multiply(good.column("amount"), 2))
    pq.write_table(good, victim)
    waves = dataclasses.replace(SETTINGS, batch_partitions_per_wave=2)
    result = resubmit(spark, str(local_input), tmp_path, settings=waves)
    # split 1 was read by enriched 1, whose wave {0, 1} shares files: both run again
    # payments-to-settled had not run before the crash (it reads only payments)
    assert {v: s.ran for v, s in result.vertices.items()} == {
        "enriched": 2, "payments-to-settled": 4, "settled": 4, "daily": 2}

    settled = assert_daily_is_plain_sparks(spark, local_input, tmp_path / "out")
    assert spark.read.parquet(str(tmp_path / "out" / "settled")).count() == settled.count()

    crash(str(local_input), tmp_path, "vertex.finished:1", job_id="other")
    removed = sorted((local_input / "orders").glob("*.parquet"))[2]
    removed.unlink()
    with pytest.raises(InputChangedError, match=removed.name):
        resubmit(spark, str(local_input), tmp_path, job_id="other")


@pytest.mark.skipif(not os.environ.get("SPARK_CKPT_TEST_REMOTE"),
                    reason="a Spark Connect server's cache outlives its clients; a classic "
                           "driver's dies with its JVM (runs in tests/test_connect.py)")
def test_the_next_client_reads_what_a_killed_client_left_persisted_on_the_server(
        spark, orders_input, expected_daily, tmp_path):
    """With spark.ckpt.batch.serverCache, settled (run whole) is persisted on the server while
    it runs. A client killed as its first partition's file appears leaves it (and the shuffles
    under it) there, and the next client reads it; killed after two of its four partitions
    became durable, the next client reads the other two from it. Killed, then an input file
    replaced: the kept rows were computed from the old file under the same path, and are not
    read."""
    import re
    import shutil


    from helpers import defaults_text

    defaults = tmp_path / "spark-defaults.conf"  # no durable exchange: settled shuffles
    defaults.write_text(defaults_text(exchanges=False) + "spark.ckpt.batch.serverCache true\n"
                        # the cache alone: the killed client's writes are not waited for
                        "spark.ckpt.batch.adoptOperations false\n")
    kept = "settled reads the output a killed client of this server left persisted"
    for case in ("first partition", "two partitions durable", "input replaced"):
        base = tmp_path / case.replace(" ", "-")
        local_input = base / "input"
        shutil.copytree(orders_input, local_input)
        work = str(base / "work")
        if case == "two partitions durable":  # the poller stops at settled's third file
            proc = start_driver(str(local_input), str(base / "out"), work,
                                fault="partition.written:7:pause",
                                SPARK_CKPT_DEFAULTS=str(defaults))
            try:
                assert wait_for(lambda w=work: sum(v == "settled" for v, _ in finished_in_log(w))
                                >= 2, timeout=240), proc.stdout
            finally:
                kill_group(proc)
            durable_before = {p for v, p in finished_in_log(work) if v == "settled"}
            assert len(durable_before) == 2, durable_before
        else:  # killed as settled's first partition's file appears, before it is logged
            crash(str(local_input), base, "partition.written:5",
                  SPARK_CKPT_DEFAULTS=str(defaults))
            assert finished_in_log(work) == {("enriched", p) for p in range(4)}
        if case == "input replaced":  # another size: recovery sees it replaced
            replace_a_payments_file(local_input)
        # the next client: a driver configured as the killed one (a session with other SQL
        # settings, this test's own, plans differently and finds nothing)
        done = run_driver(str(local_input), str(base / "out"), work,
                          SPARK_CKPT_DEFAULTS=str(defaults))
        logged = done.stdout + done.stderr
        assert done.returncode == 0, logged[-3000:]
        ran = re.search(r"settled: 4 partitions, reused (\d), ran (\d)", logged)
        assert ran, logged[-3000:]
        if case != "input replaced":
            assert kept in logged, (case, logged[-3000:])
            assert int(ran.group(2)) == (2 if case == "two partitions durable" else 4)
            assert_outputs_equal(spark, str(base / "out"), expected_daily)
            continue
        assert kept not in logged
        assert int(ran.group(2)) == 4
        assert_daily_is_plain_sparks(spark, local_input, base / "out")


@pytest.mark.skipif(not os.environ.get("SPARK_CKPT_TEST_REMOTE"),
                    reason="a Spark Connect server runs a killed client's writes on; a classic "
                           "driver's jobs die with its JVM (runs in tests/test_connect.py)")
def test_the_next_client_records_what_a_killed_clients_writes_finished_on_the_server(
        spark, orders_input, expected_daily, tmp_path):
    """The server runs a killed client's write operations on to their end. The next client
    waits for them (each unit was recorded, with its operations' ids, before they started)
    and records the partitions their files complete instead of running them: settled killed
    as its first file appears (all four recorded by the next client, none run), killed after
    two of its four partitions were logged (the other two), enriched killed after its first
    wave (a wave recorded whole once its writes ended). Killed, then an input file replaced:
    the writes read the old file, and are interrupted and run again. Killed after every vertex
    was logged, then a logged file of settled lost: its partition runs again, never taken
    from the unit that wrote it (whose write ended, so a missing file could pass for an empty
    partition); and that re-run killed as its file appears: it wrote partition 1 through Spark
    partition 0 (a re-run of a few partitions is laid out by position), and the next client
    takes it from there."""
    import re
    import shutil


    from helpers import defaults_text

    defaults = tmp_path / "spark-defaults.conf"  # no durable exchange: enriched runs in waves
    defaults.write_text(defaults_text(exchanges=False) + "spark.ckpt.batch.concurrentWaves 2\n")
    # every task of enriched and settled takes 2 s (a sleep in the JVM), so the Spark job a
    # client is killed in still runs when it dies (and the next one finds it running or ended)
    slow = {"SPARK_CKPT_DEFAULTS": str(defaults), "ORDERS_REPORT_SLOW": "1"}
    adopted = "recorded without running them again"
    for case in ("settled's first file", "two partitions durable", "enriched's first wave",
                 "input replaced", "a logged file lost", "a re-run killed"):
        base = tmp_path / re.sub(r"\W+", "-", case)
        local_input = base / "input"
        shutil.copytree(orders_input, local_input)
        work = str(base / "work")
        if case == "two partitions durable":  # the poller stops at settled's third file
            proc = start_driver(str(local_input), str(base / "out"), work,
                                fault="partition.written:7:pause", **slow)
            try:
                assert wait_for(lambda w=work: sum(v == "settled" for v, _ in finished_in_log(w))
                                >= 2, timeout=240), proc.stdout
            finally:
                kill_group(proc)
        else:  # killed as settled's first file, or enriched's first wave, is logged
            crash(str(local_input), base,
                  "partition.written:1" if case == "enriched's first wave" else
                  "vertex.finished:3" if case in ("a logged file lost", "a re-run killed")
                  else "partition.written:5", **slow)
        before = finished_in_log(work)
        units = list((base / "work" / "orders" / "units").glob("00001-u*-*.json"))
        assert units, "the killed client recorded no unit"
        if case == "input replaced":  # another size: recovery sees it replaced
            replace_a_payments_file(local_input)
        if case in ("a logged file lost", "a re-run killed"):
            assert len(before) == 4 + 4 + 2  # enriched, settled, daily: all logged
            next((base / "out" / "settled" / "_spark_ckpt_staging" / "orders" / "settled")
                 .glob("a1-*/part-00001-*.parquet")).unlink()
        if case == "a re-run killed":  # as settled 1's file appears, before it is logged
            proc = run_driver(str(local_input), str(base / "out"), work,
                              fault="partition.written:1", **slow)
            assert proc.returncode == KILLED, proc.stdout[-3000:] + proc.stderr[-3000:]
            rerun = json.loads(next((base / "work" / "orders" / "units")
                                    .glob("00002-u*-settled.json")).read_text())
            assert rerun["parts"] == [1] and rerun["positional"] is True, rerun
        done = run_driver(str(local_input), str(base / "out"), work, **slow)
        logged = done.stdout + done.stderr
        assert done.returncode == 0, logged[-3000:]
        ran = {v: (int(r), int(n)) for v, r, n in
               re.findall(r"  (\S+): \d+ partitions, reused (\d+), ran (\d+)", logged)}
        took = {v: int(n) for v, n in re.findall(r"(\S+): (\d+) partition\(s\) written by "
                                                 r"operations a killed client", logged)}
        if case == "a re-run killed":
            assert ran["settled"] == (3, 0) and took == {"settled": 1}, (ran, took,
                                                                        logged[-3000:])
            assert_outputs_equal(spark, str(base / "out"), expected_daily)
            continue
        if case == "a logged file lost":
            assert adopted not in logged and "waiting for the writes" not in logged
            assert ran["settled"] == (3, 1) and ran["daily"] == (0, 2), (ran, logged[-3000:])
            assert_outputs_equal(spark, str(base / "out"), expected_daily)
            continue
        if case == "input replaced":
            assert adopted not in logged and "read other inputs; interrupting" in logged
            assert ran["settled"] == (0, 4) and not took, (ran, logged[-3000:])
            assert_daily_is_plain_sparks(spark, local_input, base / "out")
            continue
        assert_outputs_equal(spark, str(base / "out"), expected_daily)
        if case != "enriched's first wave":  # two waves at once may both have ended and been
            # read by the killed client ("gone": nothing to wait for), a timing, not a fault
            assert adopted in logged, (case, logged[-3000:])
            # found by the ids recorded for them, still running or ended, and waited for
            assert re.search(r"the writes of settled attempt 1 unit \d+: (succeeded|ended)",
                             logged), logged[-3000:]
        settled_before = sum(v == "settled" for v, _ in before)
        if case == "enriched's first wave":
            left = 4 - sum(v == "enriched" for v, _ in before)
            assert took.get("enriched", 0) + ran["enriched"][1] == left, (before, took, ran)
            continue
        # settled: its one write ran on to its end; the next client runs none of it
        assert ran["settled"] == (settled_before, 0), (case, ran, logged[-3000:])
        assert took["settled"] == 4 - settled_before, (case, took)
        assert settled_before == (2 if case == "two partitions durable" else 0)


def test_second_driver_fences_the_first(spark, orders_input, expected_daily, tmp_path):
    reached, release = tmp_path / "paused", tmp_path / "release"
    slow = start_driver(orders_input, str(tmp_path / "out"), str(tmp_path / "work"),
                        fault="vertex.finished:1:pause", SPARK_CKPT_FAULT_PAUSE_S="600",
                        SPARK_CKPT_FAULT_REACHED=str(reached),
                        SPARK_CKPT_FAULT_RELEASE=str(release))
    try:
        assert wait_for(reached.exists, timeout=240)  # attempt 1 stopped after a vertex
        assert durable(tmp_path / "work") >= 4
        result = resubmit(spark, orders_input, tmp_path)  # attempt 2 fences attempt 1
        assert result.attempt == 2 and result.status == "succeeded"
        release.touch()  # the stale driver wakes only now, after attempt 2 committed
        output, _ = slow.communicate(timeout=240)
    finally:
        if slow.poll() is None:
            kill_group(slow)
    assert slow.returncode != 0
    assert "JobFencedError" in output and "fenced off by a newer attempt" in output
    assert delta_writes(str(tmp_path / "out")) == 1
    assert_outputs_equal(spark, str(tmp_path / "out"), expected_daily)
