"""The rocksdb state backend alone (no Spark), one task's key-group range, as the big scenario
of scripts/bench_state.py drives it: load ``--keys`` keys in 8 batches (every key once, each
batch a contiguous block of keys), write each batch's changelog as the task does, then rebuild
a fresh copy from those 8 changelogs (the restore of a range that moved), compact the chain
(a background materialization), snapshot the copy, and update 100,000 keys (half new).

    python scripts/probe_rocksdb_backend.py --keys 1000000 [--code /path/to/other/checkout]

``--code`` runs another checkout's spark_ckpt (before format 2 it has no bulk restore: the
changelogs are applied one after another, as its task did). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--code", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    args = parser.parse_args()
    sys.path.insert(0, args.code)
    import numpy as np
    import pyarrow as pa

    from spark_ckpt.state.backends import RocksAggState
    from spark_ckpt.state.chain import StateFile
    from spark_ckpt.state.keygroups import KeyGroupRange
    from spark_ckpt.state.task import _external, _internal, _newest, _read, _write

    n, batches = args.keys, args.batches
    base = tempfile.mkdtemp(prefix="probe-rocksdb-")
    columns = [("n", "add", pa.int64()), ("total", "add", pa.float64())]
    schema = pa.schema([("_kg", pa.int32()), ("key", pa.int64()), ("n", pa.int64()),
                        ("total", pa.float64())])
    rng = KeyGroupRange.parse("kg00000-00064")

    def batch(lo: int, hi: int) -> pa.Table:
        k = np.arange(lo, hi, dtype=np.int64)
        return pa.table({"_kg": pa.array(((k * 2654435761) % 64).astype(np.int32)), "key": k,
                         "n": np.ones(hi - lo, np.int64), "total": (k % 100000) / 100.0})

    try:
        state = RocksAggState(f"{base}/db", ["key"], [pa.int64()], columns, fresh=True)
        files, applies = [], []
        for b in range(batches):
            table = batch(b * n // batches, (b + 1) * n // batches)
            t0 = time.perf_counter()
            changelog = state.apply(table, token=f"t{b}")
            applies.append(time.perf_counter() - t0)
            uri, size = _write(_external(changelog, schema), f"{base}/chain", f"c{b}.parquet")
            files.append(StateFile(uri, "changelog", b, changelog.num_rows, size, rng.label))
        state.close()
        t0 = time.perf_counter()
        copy = RocksAggState(f"{base}/copy", ["key"], [pa.int64()], columns, fresh=True)
        tables = [_internal(_read(f, rng)) for f in files]
        if hasattr(copy, "restore"):
            copy.restore(tables)
        else:  # before format 2: one changelog after another
            for table in tables:
                copy.apply(table, replace=True)
        copy.set_token("restored")
        copy.close()
        restore_s = time.perf_counter() - t0
        del tables
        t0 = time.perf_counter()
        compacted = _newest([_read(f, rng) for f in files], ["_kg", "key"]).num_rows
        compact_s = time.perf_counter() - t0
        copy = RocksAggState(f"{base}/copy", ["key"], [pa.int64()], columns, fresh=False)
        t0 = time.perf_counter()
        snapshot = copy.snapshot().num_rows
        snapshot_s = time.perf_counter() - t0
        assert snapshot == compacted == copy.rows == n, (snapshot, compacted, copy.rows)
        t0 = time.perf_counter()
        copy.apply(batch(n - 50_000, n + 50_000), token="updated")
        update_s = time.perf_counter() - t0
        copy.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"keys": n, "code": args.code, "apply_s": applies,
                      "load_rows_per_s": n / sum(applies), "restore_s": restore_s,
                      "restore_keys_per_s": n / restore_s, "compact_chain_s": compact_s,
                      "snapshot_from_rocksdb_s": snapshot_s, "update_100k_s": update_s}))


if __name__ == "__main__":
    main()
