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
