"""Hostile names and paths: a name that would become a path segment outside its directory is
refused clearly; odd characters in user paths work."""

from __future__ import annotations

import json

import pytest

from spark_ckpt import BatchJob, JobDefinitionError, Settings, StreamingContext
from spark_ckpt.names import check_name


@pytest.mark.parametrize("name", ["orders", "orders-daily", "v2.1", "a_b", "2026-11-23",
                                  "zählung", "訂單"])
def test_plain_names_are_accepted(name):
    assert check_name("name", name) == name


@pytest.mark.parametrize("name", [
    "", "..", "../escape", "a/b", "a\\b", "a\x00b", " a", "a b", ".hidden", "_x", "a#b",
    "50%", "job@key", "x" * 129,
])
def test_names_that_could_leave_their_directory_are_refused(name):
    with pytest.raises(JobDefinitionError, match="source name: expected") as info:
        check_name("source name", name)
    assert f"found {name!r}" in str(info.value)


def test_a_streaming_source_named_to_escape_the_checkpoint_is_refused(spark, tmp_path):
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "p",
                           settings=Settings(progress="never"))
    with pytest.raises(JobDefinitionError, match=r"source name: expected .*'\.\./up'"):
        ctx.queue_stream("../up", "id BIGINT")
    with pytest.raises(JobDefinitionError, match="output name"):
        ctx.generator_stream("g", rows_per_batch=1).foreach_batch(lambda df, b: None,
                                                                   name="../out")
    with pytest.raises(JobDefinitionError, match="pipeline name"):
        StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "a b")


def test_batch_ids_and_vertex_names_are_checked(spark, tmp_path):
    with pytest.raises(JobDefinitionError, match="job id"):
        BatchJob("..", spark=spark, work_dir=str(tmp_path))
    with pytest.raises(JobDefinitionError, match="run key"):
        BatchJob("daily", run_key="2026/11/23")
    job = BatchJob("j", spark=spark, work_dir=str(tmp_path))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text(json.dumps({"id": 1}) + "\n")
    with pytest.raises(JobDefinitionError, match="vertex id"):
        job.read_files("../src", str(tmp_path / "in"), format="json", schema="id BIGINT")


def test_a_pipeline_on_paths_with_spaces_and_non_ascii_characters(spark, tmp_path):
    base = tmp_path / "landing zone ü"
    base.mkdir()
    (base / "part 1.json").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(5)))
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "check point é"), "odd",
                           settings=Settings(progress="never"))
    got: list[int] = []
    ctx.file_stream("f", str(base), "json", schema="id BIGINT").foreach_batch(
        lambda df, b: got.extend(r.id for r in df.collect()), name="o")
    ctx.process_available(timeout=120)
    assert sorted(got) == list(range(5))
