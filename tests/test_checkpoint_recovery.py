"""Flink's exactly-once check on real drivers killed with SIGKILL, restarted each time.

A source of unique increasing ids per key, keyed state (a sequencer and running totals) and
Delta sinks committed in two phases: whatever the kills, every id shows once, each key's
sequence counts 1, 2, 3... with every row linked to the id before it, and the final state
equals an uninterrupted run's.
"""

from __future__ import annotations

from spark_ckpt.delta_reader import read_delta
import json
import random
import select
import subprocess
import sys
import time

import pandas as pd
import pytest
from helpers import ROOT, child_env, kill_group

from spark_ckpt import read_state

pytestmark = pytest.mark.slow

KEYS = 10
LONG = 6_000  # 30 batches of 200 ids: more than twenty killed drivers get through
SHORT = 1_400  # 7 batches


def command(tmp_path, total: int) -> list[str]:
    return [sys.executable, str(ROOT / "jobs" / "stateful_counts.py"),
            "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
            "--total-rows", str(total), "--keys", str(KEYS), "--available-now"]


def run(tmp_path, total: int, fault: str | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command(tmp_path, total), env=child_env(fault), capture_output=True,
                          text=True, timeout=timeout, start_new_session=True, cwd=ROOT)


def assert_exactly_once(spark, tmp_path, total: int) -> None:
    TOTAL = total  # noqa: N806
    events = read_delta(str(tmp_path / "out" / "events")).to_pandas()
    assert len(events) == TOTAL, f"{len(events)} events for {TOTAL} ids"
    assert sorted(events.id) == list(range(TOTAL)), "an id is missing or shows twice"
    for key, rows in events.groupby("key"):
        rows = rows.sort_values("seq")
        assert rows.seq.tolist() == list(range(1, len(rows) + 1)), f"key {key}: seq has gaps"
        assert rows.id.tolist() == sorted(i for i in range(TOTAL) if i % KEYS == key)
        assert rows.prev_id.iloc[1:].tolist() == rows.id.iloc[:-1].tolist(), \
            f"key {key}: rows not linked in order"
        assert pd.isna(rows.prev_id.iloc[0])
    totals = read_delta(str(tmp_path / "out" / "totals")).to_pandas()
    assert sorted(totals.key) == list(range(KEYS)) and set(totals.n) == {TOTAL // KEYS}
    state = read_state(spark, str(tmp_path / "ckpt"), "totals").toPandas()
    assert sorted(state.key) == list(range(KEYS)) and set(state.n) == {TOTAL // KEYS}
    seq = read_state(spark, str(tmp_path / "ckpt"), "sequencer").toPandas()
    assert len(seq) == KEYS and all(f'"seen":{TOTAL // KEYS}' in s for s in seq.state)


@pytest.mark.timeout(1800)
def test_exactly_once_across_twenty_sigkills_at_random_moments(spark, tmp_path):
    rng = random.Random(20261121)
    kills = 0
    # every other driver runs each batch with one task per key-group range (not the one-task
    # path of small batches): both paths, and a switch between them at every restart
    spread = tmp_path / "spread-defaults.conf"
    spread.write_text((ROOT / "spark-defaults.conf").read_text() +
                      "\nspark.ckpt.state.smallBatchBytes 0\n")
    for attempt in range(24):
        env = child_env(**({"SPARK_CKPT_DEFAULTS": str(spread)} if attempt % 2 else {}))
        proc = subprocess.Popen(command(tmp_path, LONG), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                                cwd=ROOT)
        assert proc.stdout is not None
        # half the kills at a random moment of the driver's life (start-up, restore, replay,
        # a batch, a checkpoint), half shortly after it first reports work
        launched = time.monotonic()
        by_clock = rng.random() < 0.5
        deadline = launched + rng.uniform(2.0, 12.0) if by_clock else None
        finished = False
        while True:
            if deadline is not None:
                ready, _, _ = select.select([proc.stdout], [], [],
                                            max(0.0, deadline - time.monotonic()))
                if not ready:
                    break
            line = proc.stdout.readline()
            if not line or line.startswith("RESULT"):
                finished = True
                break
            if deadline is None and line.startswith(("PROGRESS", "CHECKPOINT")):
                deadline = time.monotonic() + rng.uniform(0.0, 1.2)
            if deadline is not None and time.monotonic() >= deadline:
                break
        if finished:
            proc.wait(timeout=120)
            break
        kill_group(proc)
        kills += 1
        if kills >= 20 and rng.random() < 0.5:
            break
    done = run(tmp_path, LONG)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert kills >= 20, f"only {kills} kills landed before the job finished"
    assert_exactly_once(spark, tmp_path, LONG)
    # both task paths of the aggregation ran (one task for a small batch, one per range)
    progress = [json.loads(line) for line in
                (tmp_path / "ckpt" / "progress" / "progress.jsonl").read_text().splitlines()]
    paths = {p["state"]["totals"].get("single_task") for p in progress
             if p["state"].get("totals", {}).get("tasks_run")}
    assert paths == {True, False}, paths


@pytest.mark.parametrize("fault", [
    "checkpoint.completed:3",  # metadata durable: every sink pre-committed, none committed
    "checkpoint.sink.committed:5",  # one sink committed checkpoint 3, the other not
    "stream.batch.staged:5",  # outputs staged, no barrier yet
])
def test_kill_between_pre_commit_and_commit_then_restart(spark, tmp_path, fault):
    crashed = run(tmp_path, SHORT, fault=fault)
    assert crashed.returncode == -9, crashed.stdout[-2000:] + crashed.stderr[-3000:]
    done = run(tmp_path, SHORT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert_exactly_once(spark, tmp_path, SHORT)
