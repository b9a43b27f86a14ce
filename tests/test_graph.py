import pytest

from spark_ckpt.errors import JobDefinitionError
from spark_ckpt.execution.job_graph import Edge, JobGraph, JobVertex, SinkSpec


class _Replayable:
    replayable = True

    def describe(self):
        return {"kind": "files"}


def diamond() -> JobGraph:
    """src(4) -hash-> a(4) -forward-> b(4) -hash-> c(2) [sink]; d(4) is dead code."""
    g = JobGraph("j")
    g.add(JobVertex("src", 4, source=_Replayable()))
    g.add(JobVertex("a", 4, inputs=(Edge("src", "hash", ("k",)),), fn=lambda d: d))
    g.add(JobVertex("b", 4, inputs=(Edge("a", "forward"),), fn=lambda d: d))
    g.add(JobVertex("c", 2, inputs=(Edge("b", "hash", ("k",)),), fn=lambda d: d,
                    sinks=[SinkSpec("out", "delta", "/tmp/x")]))
    g.add(JobVertex("d", 4, inputs=(Edge("a", "forward"),), fn=lambda d: d))
    g.validate()
    return g


def all_parts(g, vid):
    return {(vid, p) for p in range(g.vertices[vid].parallelism)}


def test_nothing_finished_runs_every_live_partition_but_never_dead_code():
    g = diamond()
    plan = g.restart_set(set())
    assert plan == {"src": [0, 1, 2, 3], "a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1]}
    assert "d" not in plan


def test_finished_upstream_is_not_rerun():
    g = diamond()
    finished = all_parts(g, "src") | all_parts(g, "a") | {("b", 0), ("b", 1)}
    assert g.restart_set(finished) == {"b": [2, 3], "c": [0, 1]}


def test_forward_edge_needs_only_its_own_partition():
    g = diamond()
    finished = all_parts(g, "src") | {("a", 0), ("a", 1), ("a", 3)} | {("b", 0), ("b", 1),
                                                                       ("b", 3)}
    assert g.restart_set(finished) == {"a": [2], "b": [2], "c": [0, 1]}


def test_hash_edge_needs_every_producer_partition():
    g = diamond()
    finished = {("src", 0), ("src", 1)}  # src 2, 3 unfinished; a needs all of src
    assert g.restart_set(finished)["src"] == [2, 3]


def test_finished_sink_partitions_need_nothing():
    g = diamond()
    finished = {("c", 0), ("c", 1)}
    assert g.restart_set(finished) == {}


def test_downstream_closure_follows_edge_kinds():
    g = diamond()
    assert g.downstream_closure([("b", 1)]) == {("c", 0), ("c", 1)}
    closure = g.downstream_closure([("a", 2)])
    assert ("b", 2) in closure and ("b", 1) not in closure and ("d", 2) in closure
    assert {("c", 0), ("c", 1)} <= closure


def test_sources_and_non_durable_vertices_are_read_in_place():
    g = diamond()
    assert g.is_virtual("src")  # Spark reads it again wherever it is needed
    assert not g.is_virtual("a")
    g2 = JobGraph("j2")
    g2.add(JobVertex("src", 2, source=_Replayable(),
                     sinks=[SinkSpec("copy", "parquet", "/tmp/c")]))
    g2.add(JobVertex("a", 2, inputs=(Edge("src", "forward"),), fn=lambda d: d, durable=False))
    g2.add(JobVertex("b", 2, inputs=(Edge("a", "forward"),), fn=lambda d: d,
                     sinks=[SinkSpec("o", "parquet", "/tmp/o")]))
    g2.validate()
    assert not g2.is_virtual("src")  # a source with a sink runs, to stage the sink's files
    assert g2.is_virtual("a") and not g2.is_virtual("b")
    virtual = {("a", 0), ("a", 1)}
    # a never runs itself, but what it reads is needed: src (it has a sink) and b run
    assert g2.restart_set(set(), virtual) == {"src": [0, 1], "b": [0, 1]}
    assert g2.restart_set({("src", 0), ("src", 1)}, virtual) == {"b": [0, 1]}


def test_restart_walks_through_a_non_durable_vertex_to_a_lost_durable_partition():
    """durable a -> durable=False v -> sink s: losing a/1 re-runs a/1 (and s), not v."""
    g = JobGraph("j")
    g.add(JobVertex("src", 2, source=_Replayable()))
    g.add(JobVertex("a", 2, inputs=(Edge("src", "forward"),), fn=lambda d: d, key=("k",)))
    g.add(JobVertex("v", 2, inputs=(Edge("a", "forward"),), fn=lambda d: d, durable=False))
    g.add(JobVertex("s", 2, inputs=(Edge("v", "forward"),), fn=lambda d: d,
                    sinks=[SinkSpec("o", "parquet", "/tmp/o")]))
    g.validate()
    virtual = {(vid, p) for vid in ("src", "v") for p in (0, 1)}
    assert g.restart_set({("a", 0)}, virtual) == {"a": [1], "s": [0, 1]}
    assert g.restart_set({("a", 0), ("a", 1), ("s", 0)}, virtual) == {"s": [1]}


def test_a_non_durable_vertex_with_a_sink_is_refused():
    g = JobGraph("j")
    g.add(JobVertex("src", 2, source=_Replayable()))
    g.add(JobVertex("a", 2, inputs=(Edge("src", "forward"),), fn=lambda d: d, durable=False,
                    sinks=[SinkSpec("o", "parquet", "/tmp/o")]))
    with pytest.raises(JobDefinitionError, match="durable=False"):
        g.validate()


@pytest.mark.parametrize("make, message", [
    (lambda g: g.add(JobVertex("x", 1, inputs=(Edge("nope", "forward"),))), "not a vertex"),
    (lambda g: g.add(JobVertex("src", 1)), "defined twice"),
    (lambda g: g.add(JobVertex("y", 0)), "parallelism must be >= 1"),
    (lambda g: g.add(JobVertex("z", 3, inputs=(Edge("src", "forward"),))), "equal parallelism"),
    (lambda g: g.add(JobVertex("w", 2, inputs=(Edge("src", "hash"),))), "names no columns"),
    (lambda g: g.add(JobVertex("_x", 1)), "vertex id"),
])
def test_malformed_graphs_are_refused_with_a_clear_message(make, message):
    g = JobGraph("j")
    g.add(JobVertex("src", 2, source=_Replayable()))
    with pytest.raises(JobDefinitionError, match=message):
        make(g)


def test_graph_without_sink_is_refused():
    g = JobGraph("j")
    g.add(JobVertex("src", 2, source=_Replayable()))
    with pytest.raises(JobDefinitionError, match="no sink"):
        g.validate()


def test_fingerprint_changes_with_parallelism_and_version():
    a = JobVertex("v", 2, fn=len, version="1")
    assert a.fingerprint() == JobVertex("v", 2, fn=len, version="1").fingerprint()
    assert a.fingerprint() != JobVertex("v", 3, fn=len, version="1").fingerprint()
    assert a.fingerprint() != JobVertex("v", 2, fn=len, version="2").fingerprint()


def test_function_identity_ignores_module_but_sees_the_body():
    from spark_ckpt.execution.job_graph import _function_identity

    def f(df):
        return df.where("x > 1")

    same = _function_identity(f)
    f.__module__ = "__main__"
    assert _function_identity(f) == same

    def f(df):  # same name, other body
        return df.where("x > 2")

    assert _function_identity(f) != same


FINGERPRINT_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from spark_ckpt.execution.job_graph import JobVertex
REGION = "eu"
fn = lambda df: df if REGION in {"eu", "us", "apac", "latam", "mena"} else df.limit(0)
def g(df):
    return df.where(df.x.isin(*sorted(frozenset({"a", "b", "c", "d"}))))
print(JobVertex("v", 2, fn=fn).fingerprint(), JobVertex("w", 2, fn=g).fingerprint())
"""


def test_fingerprints_are_equal_in_processes_with_different_hash_seeds():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    seen = set()
    for seed in ("0", "1", "2", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", FINGERPRINT_SCRIPT, root], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
        seen.add(out)
    assert len(seen) == 1, seen
