"""Malformed rows reach the dead-letter table once per (source, batch), whatever order the
batches' sources are parsed in."""

from __future__ import annotations

import os

import pytest

from spark_ckpt import StreamingContext
from spark_ckpt.storage.delta_reader import read_delta
from spark_ckpt.options import Settings

BASE_S = 1_767_225_600


@pytest.mark.slow
def test_two_windows_over_one_source_write_every_malformed_line_once(spark, tmp_path):
    """A window of length 1 every 2 batches, declared first, parses batch 1 before a window of
    length 2 every 2 batches parses batch 0: batch 1's dead letters are committed before
    batch 0's are asked for. A version counting batches said batch 0's were written; they
    were not, and its malformed lines were neither kept nor processed."""
    landing = tmp_path / "landing"
    landing.mkdir()
    bad: set[str] = set()
    for f in range(4):
        lines = [f"{f * 10 + i},name{i},{i}.5" for i in range(5)]
        broken = [f"{f * 10 + 5},oops{f},not-a-number", f"{f * 10 + 6},short{f}"]
        bad.update(broken)
        path = landing / f"f{f}.csv"
        path.write_text("\n".join(lines + broken) + "\n")
        os.utime(path, (BASE_S + f, BASE_S + f))
    ctx = StreamingContext(spark, 0.05, str(tmp_path / "ckpt"), "twowindows",
                           settings=Settings(progress="never"))
    src = ctx.file_stream("csv", str(landing), "csv", schema="id INT, name STRING, score DOUBLE",
                          max_files_per_batch=1)
    short: list[int] = []
    long: list[int] = []
    src.window(1, 2).foreach_batch(lambda df, b: short.extend(r.id for r in df.collect()),
                                   name="short")
    src.window(2, 2).foreach_batch(lambda df, b: long.extend(r.id for r in df.collect()),
                                   name="long")
    ctx.process_available(timeout=300)
    assert sorted(long) == sorted(f * 10 + i for f in range(4) for i in range(5))
    dead = read_delta(str(tmp_path / "ckpt" / "deadletter")).to_pandas()
    assert sorted(dead.record.str.strip()) == sorted(bad)  # each malformed line once
    assert sorted(dead.batch_id) == [0, 0, 1, 1, 2, 2, 3, 3]
