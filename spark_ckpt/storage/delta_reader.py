"""Read a Delta table into Arrow in the driver, safely for the process's exit.

``DeltaTable.to_pandas()`` / ``to_pyarrow_table()`` scan through a ``PyFileSystem`` whose
handler is implemented by delta-rs in Python-callable code, and pre-buffer reads on Arrow's C++
I/O threads. A read still running on such a thread when the interpreter finalizes calls back
into Python, CPython ends that thread, and the C++ runtime aborts the process: "terminate
called without an active exception", exit code 134, after all the work is done (reproduced in
a fresh virtual environment with deltalake 1.6.6 and pyarrow 26: one run in three of
``python -c "from deltalake import DeltaTable; DeltaTable(p).to_pyarrow_table()"``).

Reading through pyarrow's own file system for the table's URI keeps every I/O thread in C++,
and delta-rs still decides which files (and partition values) make up the version.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from spark_ckpt.storage import Storage, delta_table

__all__ = ["read_delta"]


def read_delta(uri: str, *, columns: Sequence[str] | None = None,
               version: int | None = None) -> pa.Table:
    """The rows of Delta table ``uri`` (at ``version``, default the latest) as Arrow."""

    table = delta_table(uri, version=version)
    storage = Storage(uri)
    filesystem = pafs.SubTreeFileSystem(storage.root, storage.fs)
    dataset = table.to_pyarrow_dataset(filesystem=filesystem)
    return dataset.to_table(columns=list(columns) if columns is not None else None)
