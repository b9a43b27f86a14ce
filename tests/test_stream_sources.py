"""Streaming file sources on hostile input: missing directories, odd file names, empty
files, schema drift, files that vanish, compared with what plain Spark reads."""

from __future__ import annotations

import pytest

from spark_ckpt import PipelineFailedError, Settings, SourceError, StreamingContext


def make_ctx(spark, tmp_path, name="src", **settings):
    return StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), name,
                            settings=Settings(progress="never", **settings))


def test_a_missing_source_directory_says_the_path_does_not_exist(spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)
    missing = tmp_path / "no-such-landing"
    ctx.file_stream("orders", str(missing), "json", schema="id BIGINT").foreach_batch(
        lambda df, b: None, name="o")
    with pytest.raises(PipelineFailedError, match=r"allocating batch 0 failed.*"
                       r"no-such-landing, found that the path does not exist") as info:
        ctx.process_available(timeout=120)
    assert isinstance(info.value.__cause__, SourceError)


def test_an_empty_directory_is_not_an_error(spark, tmp_path):
    (tmp_path / "landing").mkdir()
    ctx = make_ctx(spark, tmp_path)
    ctx.file_stream("orders", str(tmp_path / "landing"), "json", schema="id BIGINT") \
        .foreach_batch(lambda df, b: None, name="o")
    assert ctx.process_available(timeout=120) == []


def _drop_json(landing, name, ids, mtime_s):
    import json
    import os

    landing.mkdir(exist_ok=True)
    path = landing / name
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in ids))
    os.utime(path, (mtime_s, mtime_s))


def test_files_older_than_the_age_window_are_ignored_and_forgotten(spark, tmp_path, caplog):
    import logging

    import pyarrow.parquet as pq

    landing = tmp_path / "landing"
    base = 1_700_000_000
    for n in range(12):  # one file every 100 s
        _drop_json(landing, f"f{n:02d}.json", range(n * 10, n * 10 + 10), base + 100 * n)
    got: list[int] = []

    def build():
        ctx = make_ctx(spark, tmp_path, stream_min_batches_to_retain=2,
                       stream_file_source_max_file_age_ms=350_000)
        ctx.file_stream("f", str(landing), "json", schema="id BIGINT",
                        max_files_per_batch=1).foreach_batch(
            lambda df, b: got.extend(r.id for r in df.collect()), name="o")
        return ctx

    assert len(build().process_available(timeout=180)) == 12
    assert sorted(got) == list(range(120))
    snapshot = next((tmp_path / "ckpt" / "sources" / "f").glob("seen-*.parquet"))
    kept = pq.read_table(snapshot).column("mtime_ns").to_pylist()
    assert kept and min(kept) >= (base + 1100 - 350) * 10**9  # only the window's files
    # a late file (older than the newest taken minus the window) is ignored, not read
    _drop_json(landing, "late.json", [999], base + 500)
    _drop_json(landing, "new.json", [1000], base + 1200)
    got.clear()
    with caplog.at_level(logging.WARNING, logger="spark_ckpt.sources.source"):
        progress = build().process_available(timeout=180)
    assert got == [1000] and [p["num_input_rows"] for p in progress] == [1]
    assert "ignoring" in caplog.text and "late.json" in caplog.text
