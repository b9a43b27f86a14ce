"""One owner per piece of a running pipeline's state: the scheduler and the template's nodes
never hold the StreamingContext, and readers on other threads get snapshots that do not change
under them while batches run."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest

import spark_ckpt
from spark_ckpt import Settings, StreamingContext, StreamingListener
from spark_ckpt.state import count, sum_
from spark_ckpt.streaming.runtime.operators import OperatorStates
from spark_ckpt.streaming.template.keyed import KeyedStream
from spark_ckpt.streaming.template.stream import Stream

STREAMING = Path(spark_ckpt.__file__).parent / "streaming"


def make_ctx(spark, tmp_path, name="owners"):
    return StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), name,
                            settings=Settings(progress="never"))


def _holds_context(obj) -> list[str]:
    """Attributes of ``obj`` (and of the objects it holds directly) that are a context."""
    found = []
    for name, value in vars(obj).items():
        if isinstance(value, StreamingContext):
            found.append(f"{type(obj).__name__}.{name}")
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            found += [f"{type(obj).__name__}.{name}.{n}" for n, v in vars(value).items()
                      if isinstance(v, StreamingContext)]
    return found


def test_neither_the_scheduler_nor_any_template_node_holds_the_streaming_context(spark,
                                                                                 tmp_path):
    ctx = make_ctx(spark, tmp_path)
    source = ctx.generator_stream("g", rows_per_batch=5, total_rows=15)
    keyed = source.key_by("key")
    agg = keyed.agg("totals", n=count(), total=sum_("value"))
    agg.foreach_batch(lambda df, b: None, name="o")
    ctx.process_available(timeout=180)
    assert ctx.scheduler is not None and len(ctx.recent_progress) == 3
    nodes: list[object] = [ctx.scheduler, keyed, *ctx.graph.streams]
    assert any(isinstance(n, KeyedStream) for n in nodes) and agg in nodes
    assert all(isinstance(n, Stream) for n in ctx.graph.streams)
    assert [f for n in nodes for f in _holds_context(n)] == []
    # and the operator's runtime state is not on the node: it is the scheduler's
    assert not {"live", "metrics", "evolution", "live_files"} & set(vars(agg))
    assert isinstance(ctx.scheduler._operators, OperatorStates)


# the runtime modules a start wires the pipeline with (taken out of the context)
START_MODULES = ("start.py", "run_claim.py", "checkpoint_setup.py", "output_positions.py",
                 "bootstrap.py")


def test_the_scheduler_and_the_template_name_no_context_in_their_source():
    """No module of the template, the scheduler or the start imports the StreamingContext or
    keeps a ``ctx`` attribute or parameter (they get narrow collaborators)."""
    paths = [*sorted((STREAMING / "template").glob("*.py")),
             STREAMING / "runtime" / "scheduler.py", STREAMING / "runtime" / "operators.py",
             *(STREAMING / "runtime" / m for m in START_MODULES)]
    wrong = []
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("ctx", "context") and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                wrong.append(f"{path.name}:{node.lineno}: self.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "spark_ckpt.streaming.context":
                wrong.append(f"{path.name}:{node.lineno}: imports the context")
            if isinstance(node, ast.arg) and node.arg in ("ctx", "context"):
                wrong.append(f"{path.name}:{node.lineno}: takes {node.arg}")
            if isinstance(node, ast.Name) and node.id == "StreamingContext":
                wrong.append(f"{path.name}:{node.lineno}: names StreamingContext")
    assert wrong == []


def test_what_a_start_wires_holds_no_context(spark, tmp_path):
    """The objects the start built (the run claim, the start and what it wired) hold no
    StreamingContext."""
    ctx = make_ctx(spark, tmp_path, name="wired")
    ctx.generator_stream("g", rows_per_batch=5, total_rows=10).key_by("key") \
        .agg("totals", n=count()).foreach_batch(lambda df, b: None, name="o")
    ctx.process_available(timeout=180)
    start = ctx._start
    wired = [ctx._claim, start, ctx.loop, ctx.generator, ctx.tracker, ctx.coordinator]
    assert all(w is not None for w in wired)
    assert [f for w in wired for f in _holds_context(w)] == []


class _Watcher(StreamingListener):
    """Takes snapshots from the loop's thread while the scheduler's thread runs batches."""

    def __init__(self, ctx, agg):
        self.ctx, self.agg, self.taken = ctx, agg, []

    def on_batch_completed(self, progress):
        snapshot = self.agg.snapshot()
        history = self.ctx.recent_progress
        self.taken.append((progress["batch_id"], snapshot, copy.deepcopy(snapshot.handles),
                           dict(snapshot.describe), history, copy.deepcopy(history)))


def test_state_and_progress_readers_get_snapshots_that_do_not_change_while_batches_run(
        spark, tmp_path):
    ctx = make_ctx(spark, tmp_path)
    agg = ctx.generator_stream("g", rows_per_batch=4, total_rows=16).key_by("key") \
        .agg("totals", n=count())
    agg.foreach_batch(lambda df, b: None, name="o")
    watcher = _Watcher(ctx, agg)
    ctx.add_listener(watcher)
    ctx.process_available(timeout=180)
    assert [t[0] for t in watcher.taken] == [0, 1, 2, 3]
    for batch_id, snapshot, handles, describe, history, history_then in watcher.taken:
        assert snapshot.batch_id == batch_id  # published before the batch completed
        assert snapshot.handles == handles and dict(snapshot.describe) == describe
        assert history == history_then and len(history) == batch_id + 1
    first, last = watcher.taken[0][1], agg.snapshot()
    assert last is not first and last.batch_id == 3 and first.batch_id == 0
    assert last.handles != first.handles  # later batches published new snapshots ...
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.handles = ()  # type: ignore[misc]  # ... and none can be changed in place
    with pytest.raises(TypeError):
        first.describe["file_schema"] = "x"  # type: ignore[index]
    # a reader's copy of the history is its own
    mine = ctx.recent_progress
    mine[0]["batch_id"] = 99
    mine.clear()
    assert [p["batch_id"] for p in ctx.recent_progress] == [0, 1, 2, 3]
    assert agg.state_view().count() > 0  # the published snapshot, read from this thread
