"""A checkpoint directory restored from an older copy while its sinks kept their commits.

The scenario a new user tries (issue 31): run days 1-3 and stop; copy the checkpoint directory;
run days 4-10 and stop; replace the directory with the copy; add days 11-15 and run again.
The sinks already hold batches the copy never allocated, so the copy's next batches would be
taken as "already committed" and skipped. Every run must give the complete output once, or a
refusal that names the sink: never a silent skip. Restoring the newer copy, as the refusal
advises, then gives every day once.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest
from deltalake import DeltaTable

from spark_ckpt import CheckpointError, SinkAheadError, StreamingContext
from spark_ckpt.storage.delta_reader import read_delta
from spark_ckpt.formats import dump_record
from spark_ckpt.options import Settings
from spark_ckpt.state import count

BASE_S = 1_767_225_600  # file times: day d's file is d minutes after this


def _settings(**kw) -> Settings:
    return Settings(**{"progress": "never", "checkpoint_interval_ms": 1,
                       "state_parallelism": 2, "state_max_parallelism": 8, **kw})


def flights(day: int) -> pd.DataFrame:
    n = 20 + 3 * day
    return pd.DataFrame({"flight_id": [day * 1000 + i for i in range(n)],
                         "day": [day] * n,
                         "carrier": [["AA", "DL", "UA", "WN"][i % 4] for i in range(n)]})


def add_days(landing: Path, days: range) -> None:
    landing.mkdir(exist_ok=True)
    for day in days:
        path = landing / f"day-{day:02d}.parquet"
        flights(day).to_parquet(path, index=False)
        os.utime(path, (BASE_S + 60 * day, BASE_S + 60 * day))


def all_flights(days: range) -> pd.DataFrame:
    return pd.concat([flights(d) for d in days], ignore_index=True)


def replace_dir(target: Path, copy: Path) -> None:
    shutil.rmtree(target)
    shutil.copytree(copy, target)


SINKS = ["delta", "parquet", "delta_merge_2pc", "parquet_2pc"]


def run(spark, tmp_path: Path, sink: str, max_files: int | None) -> list[dict]:
    settings = _settings(checkpoint_enabled="true") if sink.endswith("_2pc") else _settings()
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "flights", settings=settings)
    src = ctx.file_stream("days", str(tmp_path / "landing"), "parquet",
                          max_files_per_batch=max_files)
    out = str(tmp_path / "out")
    if sink != "delta_merge_2pc":
        write = src.write_delta if sink.startswith("delta") else src.write_parquet
        write(out, name="out")
    else:  # keyed state: counts per carrier merged into the table at each checkpoint
        src.key_by("carrier").agg(name="per_carrier", n=count()).write_delta(
            out, name="out", merge_keys=["carrier"])
    return ctx.process_available(timeout=300)


def output(spark, tmp_path: Path, sink: str) -> pd.DataFrame:
    out = str(tmp_path / "out")
    if sink.startswith("delta"):
        return read_delta(out).to_pandas()
    return spark.read.parquet(out).toPandas()


def check_complete(spark, tmp_path: Path, sink: str, days: range) -> None:
    got = output(spark, tmp_path, sink)
    want = all_flights(days)
    if sink == "delta_merge_2pc":
        counts = want.groupby("carrier").size()
        assert dict(zip(got.carrier, got.n, strict=True)) == counts.to_dict()
        return
    assert len(got) == len(want)
    assert sorted(got.flight_id) == sorted(want.flight_id)  # each flight once


@pytest.mark.slow
@pytest.mark.parametrize("max_files", [None, 1], ids=["unlimited", "one-file"])
@pytest.mark.parametrize("sink", SINKS)
def test_a_restored_older_copy_is_refused_naming_the_sink_then_a_newer_copy_runs(
        spark, tmp_path, sink, max_files):
    landing = tmp_path / "landing"
    ckpt = tmp_path / "ckpt"
    add_days(landing, range(1, 4))
    run(spark, tmp_path, sink, max_files)
    shutil.copytree(ckpt, tmp_path / "copy-day3")
    add_days(landing, range(4, 11))
    run(spark, tmp_path, sink, max_files)
    check_complete(spark, tmp_path, sink, range(1, 11))
    shutil.copytree(ckpt, tmp_path / "copy-day10")

    replace_dir(ckpt, tmp_path / "copy-day3")  # as if the directory had been lost
    add_days(landing, range(11, 16))
    with pytest.raises(SinkAheadError) as refused:
        run(spark, tmp_path, sink, max_files)
    message = str(refused.value)
    assert "output out (" in message and "restore a newer copy" in message.lower()
    assert "knows (batches through" in message
    check_complete(spark, tmp_path, sink, range(1, 11))  # nothing ran

    replace_dir(ckpt, tmp_path / "copy-day10")  # what the refusal advises
    run(spark, tmp_path, sink, max_files)
    check_complete(spark, tmp_path, sink, range(1, 16))


@pytest.mark.slow
def test_lost_allocations_are_refused_not_restarted_at_batch_zero(spark, tmp_path):
    """A directory that kept its metadata but lost its records would start at batch 0 with
    the sink at batch 2: refused, naming the sink and the batches."""
    add_days(tmp_path / "landing", range(1, 4))
    run(spark, tmp_path, "delta", 1)
    for records in ("allocations", "commits", "driver"):
        shutil.rmtree(tmp_path / "ckpt" / records)
    add_days(tmp_path / "landing", range(4, 6))
    with pytest.raises(SinkAheadError, match=r"knows \(no batch\).*through 2"):
        run(spark, tmp_path, "delta", 1)
    check_complete(spark, tmp_path, "delta", range(1, 4))


@pytest.mark.slow
def test_a_two_phase_sink_far_ahead_of_a_restored_store_commits_new_rows_past_its_ids(
        spark, tmp_path):
    """The checkpoint store alone restored from an older copy (kept elsewhere, say): its
    sink has committed ids more than 16 past the store's highest. New checkpoints are
    numbered past the sink's ids, so the new rows are committed, not taken as done."""
    ckpt = tmp_path / "ckpt"
    add_days(tmp_path / "landing", range(1, 4))
    run(spark, tmp_path, "delta_2pc", 1)
    shutil.copytree(ckpt / "checkpoints", tmp_path / "store-copy")
    for first in (4, 7, 10):  # three more runs: each numbers its checkpoints 16 further on
        add_days(tmp_path / "landing", range(first, first + 3))
        run(spark, tmp_path, "delta_2pc", 1)
    app = [a for a in _app_ids(tmp_path / "out") if a.endswith("-2pc/out")]
    assert len(app) == 1
    old_version = DeltaTable(str(tmp_path / "out")).transaction_version(app[0])
    store_highest = max(int(p.name[4:]) for p in (tmp_path / "store-copy").glob("chk-*"))
    assert old_version > store_highest + 16

    replace_dir(ckpt / "checkpoints", tmp_path / "store-copy")
    add_days(tmp_path / "landing", range(13, 16))
    run(spark, tmp_path, "delta_2pc", 1)
    check_complete(spark, tmp_path, "delta", range(1, 16))
    assert DeltaTable(str(tmp_path / "out")).transaction_version(app[0]) > old_version


def _app_ids(table: Path) -> list[str]:
    ids = []
    for commit in sorted((table / "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            if '"txn"' in line:
                ids.append(json.loads(line)["txn"]["appId"])
    return sorted(set(ids))


# -- restarts that must not be refused -------------------------------------------------------
def _run_with(spark, tmp_path: Path, enabled: str, *, restore: int | None = None,
              fresh_dir: str | None = None) -> list[dict]:
    ckpt = str(tmp_path / (fresh_dir or "ckpt"))
    ctx = StreamingContext(spark, 0.05, ckpt, "flights",
                           settings=_settings(checkpoint_enabled=enabled,
                                              checkpoint_interval_ms=3_600_000))
    ctx.file_stream("days", str(tmp_path / "landing"), "parquet", max_files_per_batch=1) \
        .write_delta(str(tmp_path / "out"), name="out")
    return ctx.process_available(timeout=300, restore_checkpoint=restore)


@pytest.mark.slow
def test_checkpoints_switched_on_and_off_between_runs_give_every_row_once(spark, tmp_path):
    landing = tmp_path / "landing"
    add_days(landing, range(1, 3))
    _run_with(spark, tmp_path, "false")  # per batch
    add_days(landing, range(3, 5))
    _run_with(spark, tmp_path, "true")  # two-phase, a final checkpoint commits
    add_days(landing, range(5, 7))
    _run_with(spark, tmp_path, "false")
    add_days(landing, range(7, 9))
    _run_with(spark, tmp_path, "auto")  # no keyed state: per batch
    check_complete(spark, tmp_path, "delta", range(1, 9))


@pytest.mark.slow
def test_checkpoints_switched_off_with_staged_batches_is_refused_then_committed(
        spark, tmp_path, monkeypatch):
    """A run with checkpoints fails after staging two batches no checkpoint committed: a
    start without checkpoints would take them as done (their rows would never appear). It is
    refused naming them; a start with checkpoints commits them, and then switching off runs."""
    from spark_ckpt import PipelineFailedError, faults

    landing = tmp_path / "landing"
    add_days(landing, range(1, 4))
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("SPARK_CKPT_FAULT", "stream.batch.committed:2:fail")
    with pytest.raises(PipelineFailedError):
        _run_with(spark, tmp_path, "true")
    monkeypatch.delenv("SPARK_CKPT_FAULT")
    assert len(output(spark, tmp_path, "delta")) == 0  # staged, nothing visible
    with pytest.raises(CheckpointError, match=r"batches 0\.\.1 staged .* two-phase commit"):
        _run_with(spark, tmp_path, "false")
    _run_with(spark, tmp_path, "true")
    check_complete(spark, tmp_path, "delta", range(1, 4))
    add_days(landing, range(4, 6))
    _run_with(spark, tmp_path, "false")
    check_complete(spark, tmp_path, "delta", range(1, 6))


@pytest.mark.slow
def test_a_restore_by_id_after_the_sink_moved_on_is_not_refused(spark, tmp_path):
    landing = tmp_path / "landing"
    add_days(landing, range(1, 4))
    _run_with(spark, tmp_path, "true")
    first = max(int(p.name[4:]) for p in (tmp_path / "ckpt" / "checkpoints").glob("chk-*"))
    add_days(landing, range(4, 7))
    _run_with(spark, tmp_path, "true")
    add_days(landing, range(7, 9))
    _run_with(spark, tmp_path, "true", restore=first)  # replays days 4-6: the sink skips them
    check_complete(spark, tmp_path, "delta", range(1, 9))


@pytest.mark.slow
def test_a_fresh_directory_on_an_existing_table_is_not_refused(spark, tmp_path):
    add_days(tmp_path / "landing", range(1, 3))
    _run_with(spark, tmp_path, "false")
    _run_with(spark, tmp_path, "false", fresh_dir="ckpt-new")  # a new lineage: appends again
    assert len(output(spark, tmp_path, "delta")) == 2 * len(all_flights(range(1, 3)))


def test_a_two_phase_sink_that_cannot_tell_its_batch_is_refused_past_the_store():
    from spark_ckpt.sinks.positions import SinkPosition, refuse_if_ahead

    blind = {"out": SinkPosition("out", "delta sink at /t", None, 40)}
    with pytest.raises(SinkAheadError, match="committed checkpoint 40, and its log no longer"):
        refuse_if_ahead("p", "/ckpt", blind, known_batch=5, known_checkpoint=3)
    refuse_if_ahead("p", "/ckpt", blind, known_batch=5, known_checkpoint=40)  # the store knows


def test_tools_on_a_copy_read_its_own_checkpoints_while_the_original_exists(tmp_path):
    """A record from before relocatable directories names the original's checkpoints/ by
    absolute path: the copy's tools must not clean up or restore by the original's."""
    from spark_ckpt.streaming.runtime.pipeline_dir import checkpoints_uri

    for d in ("orig", "copy"):
        (tmp_path / d / "checkpoints").mkdir(parents=True)
    meta = tmp_path / "copy" / "metadata.json"

    def record(checkpoints: str) -> None:
        meta.write_bytes(dump_record("pipeline-metadata", 1, {
            "name": "p", "sources": {}, "checkpoints": checkpoints}))

    record(str(tmp_path / "orig" / "checkpoints"))
    assert checkpoints_uri(str(tmp_path / "copy")) == str(tmp_path / "copy" / "checkpoints")
    record("checkpoints")
    assert checkpoints_uri(str(tmp_path / "copy")) == str(tmp_path / "copy" / "checkpoints")
    record(str(tmp_path / "kept-elsewhere"))  # spark.ckpt.checkpoint.dir: its own place
    assert checkpoints_uri(str(tmp_path / "copy")) == str(tmp_path / "kept-elsewhere")
