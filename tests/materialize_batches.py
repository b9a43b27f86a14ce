"""One batch of a rocksdb range as agg_task runs it, for tests/test_state_materialize.py (in
the test process and in a worker process it kills)."""

from __future__ import annotations

import json

import pyarrow as pa

from spark_ckpt.state.backends import RocksAggState
from spark_ckpt.state.task import _newest, _read, _Run

COLUMNS = [("n", "add", pa.int64())]
SCHEMA = pa.schema([("_kg", pa.int32()), ("k", pa.int64()), ("n", pa.int64())])
RANGE = "kg00000-00064"


def one_batch(base, handle, batch, keys):
    params = {"pipeline_id": "p", "operator": "op", "batch": batch, "local_dir": f"{base}/local",
              "state_dir": f"{base}/durable", "local_spill": False, "materialize_every": 3}
    plan = {"range": RANGE, "token": handle["token"] if handle else None,
            "files": handle["files"] if handle else []}
    run = _Run(params, {0: plan}, pid=0)

    def make(path, fresh):
        return RocksAggState(path, ["k"], [pa.int64()], COLUMNS, fresh=fresh)

    state, ready = run.open_rocks(make)
    if not ready:
        state.restore([_read(f, run.range) for f in run.chain])
        state.set_token(plan["token"] or "")
    changelog = state.apply(pa.table({"_kg": pa.array([k % 64 for k in keys], pa.int32()),
                                      "k": pa.array(keys, pa.int64()),
                                      "n": pa.array([1] * len(keys), pa.int64())}),
                            token=run.token)

    def compact(files):
        return _newest([_read(f, run.range) for f in files], ["_kg", "k"])

    out = list(run.finish(state, changelog, state.snapshot, SCHEMA, {}, compact=compact))
    return json.loads(out[0].column("meta")[0].as_py())
