"""Paths on object stores: converting between Spark's URIs and the file system's paths is
idempotent for every scheme, and a Parquet two-phase commit moves each staged file to its own
name whatever form its staging directory was recorded in.

The object stores are pyarrow file systems rooted in a local directory (one per scheme), so the
commit's moves, markers and listings run for real; only the URI's resolution is redirected."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from spark_ckpt import storage as storage_mod
from spark_ckpt.storage import Storage, join
from spark_ckpt.sinks.per_batch import staged_files
from spark_ckpt.sinks.two_phase import ParquetTwoPhaseSink

ROOTS = {
    "s3": "s3://bucket/out/table",
    "s3a": "s3a://bucket/out/table",
    "abfss": "abfss://container@account.dfs.core.windows.net/out/table",
    "gs": "gs://bucket/out/table",
    "hdfs": "hdfs://namenode:8020/user/etl/out/table",
}


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """Resolve object-store URIs onto local directories, as pyarrow would name their paths
    (bucket or container first)."""
    real = storage_mod._from_uri

    def from_uri(uri: str):
        scheme, _, rest = uri.partition("://")
        if scheme not in ("s3", "gs", "abfss", "hdfs"):  # s3a reaches here as s3, or fails
            return real(uri)
        authority, _, tail = rest.partition("/")
        base = tmp_path / "stores" / scheme
        base.mkdir(parents=True, exist_ok=True)
        fs = pafs.SubTreeFileSystem(str(base), pafs.LocalFileSystem())
        if scheme == "hdfs":  # pyarrow's HDFS paths are the URI's absolute path
            return fs, "/" + tail.rstrip("/")
        return fs, f"{authority.split('@')[0]}/{tail}".rstrip("/")

    monkeypatch.setattr(storage_mod, "_from_uri", from_uri)
    return tmp_path


class _Scope:
    name = "p"
    lineage = "p-0123456789abcdef"
    root = "/unused"
    storage = None


def _roots(tmp_path: Path) -> dict[str, str]:
    local = tmp_path / "local" / "table"
    filed = tmp_path / "filed" / "table"
    return ROOTS | {"local": str(local), "file": f"file:{filed}", "file3": f"file://{filed}3"}


@pytest.mark.parametrize("kind", ["s3", "s3a", "abfss", "gs", "hdfs", "local", "file", "file3"])
def test_spark_path_and_fs_path_are_idempotent(stores, kind):
    uri = _roots(stores)[kind]
    store = Storage(uri)
    path = join(store.root, "_spark_ckpt_staging", "x", "part-0.parquet")
    spark = store.spark_path(path)
    assert store.spark_path(spark) == spark
    assert store.fs_path(spark) == path
    assert store.fs_path(store.fs_path(spark)) == path
    assert store.spark_path(store.fs_path(spark)) == spark
    if kind in ROOTS:  # Spark's own scheme and authority, never pyarrow's
        assert spark.startswith(uri.split("://")[0] + "://" + uri.split("://")[1].split("/")[0])
        assert "://" not in spark.split("://", 1)[1]
        assert spark.startswith(uri.rstrip("/") + "/")  # under the root Spark was given


@pytest.mark.parametrize("kind", ["s3", "s3a", "abfss", "gs", "hdfs", "local", "file", "file3"])
@pytest.mark.parametrize("recorded", ["path", "uri"])
def test_parquet_two_phase_commit_moves_each_file_to_its_name(stores, kind, recorded):
    uri = _roots(stores)[kind]
    sink = ParquetTwoPhaseSink("out", uri, (), _Scope())
    sink.lineage = _Scope.lineage
    store = sink.store
    pieces = []
    for batch in (0, 1):
        directory = sink._staging_dir(batch)
        store.makedirs(directory)
        name = f"part-0000{batch}-abc.c000.snappy.parquet"
        with store.fs.open_output_stream(join(directory, name)) as out:
            pq.write_table(pa.table({"id": [batch, batch + 10]}), out)
        files = staged_files(store, directory, "out")
        assert all(f.path == store.spark_path(f.path) for f in files)
        shown = store.spark_path(directory) if recorded == "uri" else directory
        pieces.append({"batch": batch, "dir": shown, "files": [f.to_json() for f in files]})
    txn = sink.pre_commit(7, pieces)
    assert sorted(dst.rsplit("/", 1)[1] for _src, dst in txn["moves"]) == [
        "part-00000-abc.c000.snappy.parquet", "part-00001-abc.c000.snappy.parquet"]
    sink.commit(7, txn)
    committed = sorted(i.base_name for i in store.list_files(store.root, recursive=False))
    assert committed == ["part-00000-abc.c000.snappy.parquet",
                         "part-00001-abc.c000.snappy.parquet"]
    staging = join(store.root, "_spark_ckpt_staging", sink.lineage)
    assert not [i for i in store.list_files(staging) if i.base_name.endswith(".parquet")]
    assert sink.committed_batch() == 1
    rows = sorted(pq.read_table(join(store.root, n), filesystem=store.fs)["id"].to_pylist()[0]
                  for n in committed)
    assert rows == [0, 1]
