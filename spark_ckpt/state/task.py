"""The stateful task: runs in a Python worker, one per key-group range and batch (a small
batch of a keyed aggregation: one task updates every range in turn, see ``single_task``).

For its range the task (1) takes the state from the worker's cache when the cached version
token is the one the driver expects, or else rebuilds it from the durable chain; (2) applies the
batch (merges aggregate partials, or calls the processor per key and fires due timers);
(3) *synchronous part*: fixes the new version (a token; RocksDB writes the batch's changes and
the token in one atomic write batch); (4) *asynchronous part* (relative to the checkpoint): writes
the changelog of the batch as Parquet and, every ``materialize_every`` batches, a full snapshot;
(5) returns one metadata row: the new state handle and its measurements. The driver records the
handle only when the Spark job succeeded, so a retried or abandoned attempt leaves at most
unreferenced files.

Everything here is shipped to executors by Spark's closure serializer and imports only
pyarrow, numpy, pandas and this package's state modules.

Time: ``time.perf_counter`` directly, not a :class:`~spark_ckpt.clock.Clock`: the task runs in
a Python worker, where no clock is injected, and only measures its own work for its metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from spark_ckpt.faults import fault_point
from spark_ckpt.state.aggregates import from_internal, to_internal
from spark_ckpt.state.chain import StateFile, StateHandle
from spark_ckpt.state.keygroups import KG_COLUMN, PID_COLUMN, KeyGroupRange

__all__ = ["CHANNEL_COLUMN", "MARKER_COLUMN", "SPLIT_COLUMN", "agg_task", "meta_schema"]

CHANNEL_COLUMN = "_ch"
# the source partition an input row was read from, where watermarks are kept per partition
SPLIT_COLUMN = "__ckpt_split"
MARKER_COLUMN = "_marker"
def meta_schema() -> Any:
    """The schema of a stateful task's result rows, ``pid INT, meta STRING``, as a StructType
    built without the JVM (a DDL string is parsed by a round trip to it on every
    ``mapInArrow``)."""
    from pyspark.sql.types import IntegerType, StringType, StructField, StructType

    return StructType([StructField("pid", IntegerType()), StructField("meta", StringType())])

class _Materialization:
    """A snapshot being written by a thread of this worker from the chain ``covered``."""

    def __init__(self, covered: tuple[StateFile, ...], work: Callable[[], StateFile]) -> None:
        self.covered = covered
        self.result: StateFile | None = None
        self.error: str | None = None
        self.ms = 0
        self._work = work
        self.thread = threading.Thread(target=self._run, name="spark-ckpt-materialize",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.result = self._work()
        except Exception as exc:  # noqa: BLE001 - reported by the task that finds it
            self.error = f"{type(exc).__name__}: {exc}"
        self.ms = int((time.perf_counter() - t0) * 1000)


# (pipeline id, operator, range, schema id) -> the snapshot a thread of this worker writes
_MATERIALIZING: dict[tuple[str, ...], _Materialization] = {}
# (pipeline id, operator, range, schema id) -> backend, per Python worker process, and the
# batch whose task left it there
_CACHE: dict[tuple[str, ...], Any] = {}
_CACHED_AT: dict[tuple[str, ...], int] = {}


def _evict_stale(params: dict[str, Any], plans: dict[int, dict[str, Any]]) -> int:
    """Drop this worker's cached ranges of the operator that can never be used again: one
    left by an earlier batch at a version the driver's plans for this batch do not name
    (another worker, often on another host, has run it since, or its batch failed), a range
    a rescale removed, or one cached under other state variables. A range is reused only at
    the plan's token, so these would only hold memory: on three hosts, each worker ended up
    holding nearly every range (tests/test_netns_cluster.py). A range this batch's own tasks
    left (in this task, or an earlier task of this worker) is kept: its token is newer than
    the plans, and the next batch's plans name it. Returns how many went."""
    current = {str(plan["range"]): plan.get("token") for plan in plans.values()}
    owner = (params["pipeline_id"], params["operator"])
    schema = params.get("schema_id", "")
    batch = int(params["batch"])
    stale = [key for key, state in _CACHE.items() if key[:2] == owner and
             _CACHED_AT.get(key, -1) < batch and (
                 key[3:] != (schema,) or not current.get(key[2]) or
                 current[key[2]] != getattr(state, "token", None))]
    for key in stale:
        _CACHED_AT.pop(key, None)
        with contextlib.suppress(Exception):  # closing a dropped copy never fails a task
            _CACHE.pop(key).close()
    return len(stale)


def _fs(uri: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    from spark_ckpt.storage import resolve
    from spark_ckpt.storage.faulty import (
        wrap,  # faulty storage in tests; the file system itself else
    )

    if "://" not in uri and not uri.startswith("file:"):
        return wrap(pafs.LocalFileSystem()), uri
    fs, path = resolve(uri)
    return wrap(fs), path


STATE_FORMAT = b"1"  # Parquet key-value metadata spark_ckpt.state of every state file


def _read(file: StateFile, target: KeyGroupRange, fmt: bytes = STATE_FORMAT) -> pa.Table:
    import pyarrow.parquet as pq

    from spark_ckpt.errors import FormatVersionError

    fs, path = _fs(file.path)
    table = pq.read_table(path, filesystem=fs)
    version = (table.schema.metadata or {}).get(b"spark_ckpt.state")
    if version != fmt:
        raise FormatVersionError(
            f"state file {file.path}: expected spark_ckpt.state format "
            f"{fmt.decode()}, found {version.decode() if version else 'none'}; "
            "upgrade spark_ckpt to read it"
        )
    if KeyGroupRange.parse(file.range) != target:
        kg = table.column(KG_COLUMN)
        mask = pc.and_(pc.greater_equal(kg, target.start), pc.less(kg, target.end))
        table = table.filter(mask)
    return table


def _write(table: pa.Table, directory: str, name: str, *, internal: bool = True,
           fmt: bytes = STATE_FORMAT) -> tuple[str, int]:
    """Write a Parquet file; state files favour speed (lz4, no dictionary), sink files size."""
    import pyarrow.parquet as pq

    fs, path = _fs(directory)
    fs.create_dir(path, recursive=True)
    full = f"{path.rstrip('/')}/{name}"
    if internal:
        table = table.replace_schema_metadata({b"spark_ckpt.state": fmt})
        pq.write_table(table, full, filesystem=fs, compression="lz4", use_dictionary=False)
    else:
        pq.write_table(table, full, filesystem=fs, compression="snappy")
    size = fs.get_file_info(full).size
    uri = full if "://" not in directory else directory.rstrip("/") + "/" + name
    return uri, int(size)


def _internal(table: pa.Table) -> pa.Table:
    return pa.Table.from_arrays([to_internal(c) for c in table.columns], names=table.column_names)


def _external(table: pa.Table, schema: pa.Schema) -> pa.Table:
    return pa.Table.from_arrays([from_internal(table.column(f.name).combine_chunks(), f.type)
                                 for f in schema], schema=schema)


def _dead(pid: str) -> bool:
    """Whether ``pid`` (a file name's suffix) names a process of this host that no longer
    runs: its leftovers can go. Anything else (not a number, alive, ours, not ours to signal)
    is kept."""
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


#: a spilled delta's parent version (Arrow schema metadata)
SPILL_PARENT = b"spark_ckpt.spill.parent"
SPILL_MAX_DELTAS = 32
SPILL_REWRITE_FACTOR = 1.0  # deltas up to this many times the full spill's rows


def _read_ipc(path: str) -> pa.Table:
    with pa.memory_map(path) as source:
        return pa.ipc.open_file(source).read_all()


def _write_ipc(table: pa.Table, path: str) -> None:
    """An Arrow file written whole or not at all (a temporary file renamed)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, path)


def _local_dir(params: dict[str, Any]) -> str:
    base = params.get("local_dir") or os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0] \
        or tempfile.gettempdir()
    # the schema's id: a copy left by a run with other state variables is never taken
    return os.path.join(base, "spark_ckpt_state", params["pipeline_id"], params["operator"],
                        *([params["schema_id"]] if params.get("schema_id") else []))


def _consume(batches: Iterator[pa.RecordBatch]) -> tuple[pa.Table | None, int, int]:
    """Read the task's input; alignment = time from the first input's last record (its barrier)
    to the last input's."""
    parts: list[pa.RecordBatch] = []
    last_seen: dict[int, float] = {}
    for rb in batches:
        parts.append(rb)
        if CHANNEL_COLUMN in rb.schema.names and rb.num_rows:
            for ch in set(rb.column(CHANNEL_COLUMN).to_pylist()):
                last_seen[ch] = time.perf_counter()
    table = pa.Table.from_batches(parts) if parts else None
    align = int((max(last_seen.values()) - min(last_seen.values())) * 1000) \
        if len(last_seen) > 1 else 0
    return table, align, len(last_seen)


class _Run:
    """Shared bookkeeping of one task attempt."""

    def __init__(self, params: dict[str, Any], plans: dict[int, dict[str, Any]],
                 pid: int | None = None) -> None:
        from pyspark import TaskContext

        from spark_ckpt.storage import s3

        s3.install(params.get("s3"))  # the driver's S3 settings: a worker cannot read Spark's
        self.params = params
        if pid is None:
            context = TaskContext.get()
            assert context is not None  # run in a Spark task
            pid = context.partitionId()
        self.pid = pid
        self.plans = plans
        self.plan = plans[self.pid]
        self.range = KeyGroupRange.parse(self.plan["range"])
        self.chain = [StateFile.from_json(f) for f in self.plan["files"]]
        self.key = (params["pipeline_id"], params["operator"], self.plan["range"],
                    params.get("schema_id", ""))
        self.batch = int(params["batch"])
        self.token = uuid.uuid4().hex
        self.dir = f"{params['state_dir'].rstrip('/')}/{self.range.label}"
        self.metrics: dict[str, Any] = {"restored": False, "restore_ms": 0, "cache": None}
        self.started = time.perf_counter()

    def cached(self) -> Any | None:
        self.metrics["evicted"] = _evict_stale(self.params, self.plans)
        state = _CACHE.pop(self.key, None)
        _CACHED_AT.pop(self.key, None)
        if state is not None and state.token == self.plan["token"] and self.plan["token"]:
            self.metrics["cache"] = "process"
            return state
        if state is not None:
            state.close()
        return None

    def spill_path(self, token: str) -> str:
        return os.path.join(_local_dir(self.params), f"{self.range.label}-{token}.arrow")

    def delta_path(self, token: str) -> str:
        return os.path.join(_local_dir(self.params), f"{self.range.label}-{token}.delta.arrow")

    def load_spill(self, make: Any) -> Any | None:
        """The memory backend's range as another worker of this executor left it: a full
        spill at the plan's version, or one at an earlier version and the deltas since (each
        delta names the version it follows)."""
        token = self.plan["token"]
        if not self.params.get("local_spill", True) or not token:
            return None
        deltas: list[pa.Table] = []
        version = token
        try:
            for _ in range(SPILL_MAX_DELTAS + 1):
                if os.path.exists(self.spill_path(version)):
                    base = _read_ipc(self.spill_path(version))
                    break
                delta = _read_ipc(self.delta_path(version))  # OSError: no spill of it
                parent = (delta.schema.metadata or {}).get(SPILL_PARENT)
                if parent is None:
                    return None
                deltas.append(delta.replace_schema_metadata(None))
                version = parent.decode()
            else:
                return None
        except (OSError, pa.ArrowInvalid):  # none, or another worker removed it meanwhile
            return None
        state = make()
        deltas.reverse()
        if hasattr(state, "apply"):  # an aggregation: a delta's rows replace its keys'
            state.load(base)
            for delta in deltas:
                state.apply(delta, replace=True)
        else:  # a processor's store: later rows win, empty rows delete
            state.load([base, *deltas])
        state.token = token
        state.spilled = (token, len(deltas), sum(d.num_rows for d in deltas), base.num_rows)
        self.metrics["cache"] = "local"
        return state

    def spill(self, state: Any, changelog: pa.Table | None = None) -> None:
        """Leave the range on local disk for whichever worker runs it next (memory backend).

        When the state's spilled form is at the version this batch started from, only the
        batch's changelog is written (a delta naming that version); the whole range is
        written again when the deltas since the last full spill would hold more rows than it
        (``SPILL_REWRITE_FACTOR``) or number ``SPILL_MAX_DELTAS``."""
        directory = _local_dir(self.params)
        os.makedirs(directory, exist_ok=True)
        parent = self.plan["token"]
        spilled = getattr(state, "spilled", None)
        if changelog is not None and parent and spilled is not None and \
                spilled[0] == parent and spilled[1] < SPILL_MAX_DELTAS and \
                spilled[2] + changelog.num_rows <= SPILL_REWRITE_FACTOR * spilled[3] and \
                (os.path.exists(self.spill_path(parent)) or
                 os.path.exists(self.delta_path(parent))):
            path = self.delta_path(state.token)
            _write_ipc(changelog.replace_schema_metadata({SPILL_PARENT: parent.encode()}), path)
            state.spilled = (state.token, spilled[1] + 1, spilled[2] + changelog.num_rows,
                             spilled[3])
            return
        table = state.snapshot()
        path = self.spill_path(state.token)
        _write_ipc(table, path)
        state.spilled = (state.token, 0, 0, table.num_rows)
        for name in os.listdir(directory):  # older versions of this range
            if not name.startswith(self.range.label + "-") or path.endswith(name):
                continue
            if ".tmp-" in name and not _dead(name.rsplit(".tmp-", 1)[1]):
                continue  # another worker writing it now
            with contextlib.suppress(OSError):  # a directory (a RocksDB copy) is not unlinked
                os.unlink(os.path.join(directory, name))

    def _adopt_materialized(self, files: list[StateFile]) -> list[StateFile]:
        """``files`` with a snapshot this worker's thread finished in place of the files it
        covers (when they still begin the chain)."""
        job = _MATERIALIZING.get(self.key)
        if job is None or job.thread.is_alive():
            return files
        del _MATERIALIZING[self.key]
        n = len(job.covered)
        if job.error is not None:
            self.metrics["materialize_error"] = job.error
            return files
        if job.result is None or tuple(files[:n]) != job.covered:
            return files  # another chain since (a retried batch, a restore): not this one's
        self.metrics["materialized"] = {"batch": job.result.batch, "rows": job.result.rows,
                                        "bytes": job.result.bytes, "ms": job.ms}
        return [job.result, *files[n:]]

    def _materialize_later(self, files: list[StateFile],
                           compact: Callable[[list[StateFile]], pa.Table], fmt: bytes) -> None:
        if self.key in _MATERIALIZING:  # one at a time per range (adopted or dropped first)
            return
        directory, label = self.dir, self.range.label
        name = f"b{files[-1].batch:012d}-snapshot-{self.token}.parquet"
        batch = files[-1].batch

        def work() -> StateFile:
            table = compact(list(files))
            fault_point("state.materialize.compacted")
            uri, size = _write(table, directory, name, fmt=fmt)
            return StateFile(uri, "snapshot", batch, table.num_rows, size, label)

        _MATERIALIZING[self.key] = _Materialization(tuple(files), work)

    def rocks_path(self) -> str:
        return os.path.join(_local_dir(self.params), self.range.label)

    def open_rocks(self, make: Any) -> Any:
        """The executor's RocksDB copy of the range if it is at the expected version (another
        worker, or an earlier run, left it); else a fresh one to rebuild from the chain."""
        path = self.rocks_path()
        token = self.plan["token"]
        parent, base = os.path.split(path)
        for name in os.listdir(parent) if os.path.isdir(parent) else []:
            # private copies (below) of workers that died: nothing will open them again
            if name.startswith(base + "-") and _dead(name[len(base) + 1:]):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        try:
            state = make(path, fresh=False)
        except Exception:  # noqa: BLE001 - locked by a zombie attempt: a private copy
            return make(f"{path}-{os.getpid()}", fresh=True), False
        if token and state.token == token:
            self.metrics["cache"] = "local"
            return state, True
        state.close()
        return make(path, fresh=True), False

    def check_input(self, table: pa.Table | None) -> None:
        """Spark routed the task only rows of its own key groups (or state would be wrong)."""
        if table is None or not table.num_rows or KG_COLUMN not in table.column_names:
            return
        kg = table.column(KG_COLUMN)
        if MARKER_COLUMN in table.column_names:
            kg = kg.filter(pc.invert(table.column(MARKER_COLUMN)))
        low, high = pc.min(kg).as_py(), pc.max(kg).as_py()
        if low is not None and (low < self.range.start or high >= self.range.end):
            from spark_ckpt.errors import InternalError

            raise InternalError(
                f"operator {self.params['operator']} task {self.pid}: expected key groups "
                f"{self.range.start}..{self.range.end - 1}, found {low}..{high}; no state was "
                "changed"
            )

    def finish(self, state: Any, changelog: pa.Table | None, snapshot: Any,
               file_schema: pa.Schema, extra: dict[str, Any],
               fmt: bytes = STATE_FORMAT,
               compact: Callable[[list[StateFile]], pa.Table] | None = None,
               ) -> Iterator[pa.RecordBatch]:
        """Write the changelog (and a snapshot when due), return the metadata row.

        With ``compact`` (the rows of a chain, a key's newest row each, in the file schema),
        a due snapshot is materialized off the batch's path: a thread of this worker compacts
        the chain as it stands after this batch into a snapshot file, and a later task of the
        range in this worker puts it in place of the files it covers once it is written
        whole. Until then the chain only grows; a snapshot whose writer died is never named
        (an orphan, deleted by the next driver's clean-up)."""
        t0 = time.perf_counter()
        files = list(self.chain)
        written = 0
        changelog_file = None
        if changelog is not None and changelog.num_rows:
            uri, size = _write(_external(changelog, file_schema), self.dir,
                               f"b{self.batch:012d}-changelog-{self.token}.parquet", fmt=fmt)
            changelog_file = StateFile(uri, "changelog", self.batch, changelog.num_rows, size,
                                       self.range.label)
            files.append(changelog_file)
            written += size
        changelogs = sum(1 for f in files if f.kind == "changelog")
        mixed = any(f.range != self.range.label for f in files)
        # after a state schema change, no restored file outlives the first batch (a restore
        # from the next checkpoint must not need the old schema, or the rename mapping)
        rewrite = bool(self.params.get("rewrite")) and bool(self.chain)
        due = changelogs >= int(self.params["materialize_every"])
        if compact is not None and not mixed and not rewrite:
            files = self._adopt_materialized(files)
            if sum(1 for f in files if f.kind == "changelog") >= \
                    int(self.params["materialize_every"]):
                self._materialize_later(files, compact, fmt)
            due = False
        if mixed or rewrite or due:
            table = snapshot()
            uri, size = _write(_external(table, file_schema), self.dir,
                               f"b{self.batch:012d}-snapshot-{self.token}.parquet", fmt=fmt)
            files = [StateFile(uri, "snapshot", self.batch, table.num_rows, size,
                               self.range.label)]
            written += size
        async_ms = int((time.perf_counter() - t0) * 1000)
        rows = state.rows
        token = self.token if (changelog_file or files != self.chain) else self.plan["token"]
        if state.token != token:  # nothing changed: keep the version the driver knows (or
            state.token = token   # only the files did: the copy is at the new version)
            if hasattr(state, "set_token") and token:
                state.set_token(token)
        handle = StateHandle(self.range.label, token, tuple(files), rows)
        _CACHE[self.key] = state
        _CACHED_AT[self.key] = self.batch
        if getattr(state, "backend", "") == "rocksdb":
            state.close()
            _CACHE.pop(self.key, None)
            _CACHED_AT.pop(self.key, None)
            if getattr(state, "path", None) and state.path != self.rocks_path():
                # a private copy (the executor's was locked): never opened again
                shutil.rmtree(state.path, ignore_errors=True)
        elif getattr(state, "load", None) is not None and state.token and \
                self.params.get("local_spill", True) and \
                not os.path.exists(self.spill_path(state.token)) and \
                not os.path.exists(self.delta_path(state.token)):  # unchanged: spilled already
            t1 = time.perf_counter()
            self.spill(state, changelog)
            self.metrics["spill_ms"] = int((time.perf_counter() - t1) * 1000)
        meta = {
            "handle": handle.to_json(),
            "changelog": changelog_file.to_json() if changelog_file else None,
            "written_bytes": written,
            "async_ms": async_ms,
            "total_ms": int((time.perf_counter() - self.started) * 1000),
            # the Python daemon (one per executor) is the worker's parent
            "executor": f"{os.uname().nodename}:{os.getppid()}",
            "worker": os.getpid(),
            **self.metrics, **extra,
        }
        yield pa.RecordBatch.from_pydict({"pid": pa.array([self.pid], pa.int32()),
                                          "meta": pa.array([json.dumps(meta)], pa.string())})


def agg_task(params: dict[str, Any], plans: dict[int, dict[str, Any]]) -> Any:
    """The mapInArrow function of a keyed aggregation (input: partials per key group, key)."""
    key_names = list(params["keys"])
    file_schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(params["file_schema"])))
    columns = [(name, kind, to_internal(pa.nulls(0, file_schema.field(name).type)).type)
               for name, kind in params["columns"]]
    key_types = [to_internal(pa.nulls(0, file_schema.field(k).type)).type for k in key_names]
    sources = dict(params.get("state_sources") or {})  # renamed outputs' columns: new -> old

    def restored(f: StateFile, target: KeyGroupRange) -> pa.Table:
        """A restored file's rows with the declared columns (see state/evolution.py)."""
        from spark_ckpt.state.evolution import evolve_table

        return evolve_table(_read(f, target), file_schema, sources,
                            f"state file {f.path}", [KG_COLUMN, *key_names])

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        table, align, channels = _consume(batches)
        if not params.get("single_task"):
            yield from one_range(None, table, align, channels)
            return
        # a small batch in one task: every range in turn, as its own task would
        for pid in sorted(plans):
            part = None if table is None else \
                table.filter(pc.equal(table.column(PID_COLUMN), pa.scalar(pid, pa.int32())))
            yield from one_range(int(pid), part, align, channels)

    def one_range(pid: int | None, table: pa.Table | None, align: int,
                  channels: int) -> Iterator[pa.RecordBatch]:
        from spark_ckpt.state.backends import MemoryAggState, RocksAggState

        task = _Run(params, plans, pid)
        task.check_input(table)

        def memory() -> MemoryAggState:
            return MemoryAggState(key_names, key_types, columns,
                                  max_rows=int(params["memory_max_rows"]))

        state = task.cached()
        if state is None and params["backend"] == "memory":
            t0 = time.perf_counter()
            state = task.load_spill(memory)
            task.metrics["local_load_ms"] = int((time.perf_counter() - t0) * 1000)
        if state is None and params["backend"] == "rocksdb":
            state, ready = task.open_rocks(
                lambda path, fresh: RocksAggState(path, key_names, key_types, columns,
                                                  fresh=fresh))
            if not ready:
                t0 = time.perf_counter()
                state.restore([_internal(restored(f, task.range)) for f in task.chain])
                state.set_token(task.plan["token"] or "")
                task.metrics.update(restored=bool(task.chain),
                                    restore_ms=int((time.perf_counter() - t0) * 1000))
        if state is None:
            t0 = time.perf_counter()
            state = memory()
            for i, f in enumerate(task.chain):
                rows = _internal(restored(f, task.range))
                if i == 0:
                    state.load(rows)
                else:
                    state.apply(rows, replace=True)
            state.token = task.plan["token"]
            task.metrics.update(restored=bool(task.chain),
                                restore_ms=int((time.perf_counter() - t0) * 1000))
        t0 = time.perf_counter()
        changelog = None
        if table is not None and table.num_rows:
            # one input at a time: a key has one partial per input channel
            parts = [table] if CHANNEL_COLUMN not in table.column_names else [
                table.filter(pc.equal(table.column(CHANNEL_COLUMN), ch))
                for ch in sorted(set(table.column(CHANNEL_COLUMN).to_pylist()))]
            state.token = None  # mutating: the cached version is no longer any token
            changes = []
            for i, part in enumerate(parts):
                data = _internal(part.select(file_schema.names))
                if isinstance(state, RocksAggState):
                    last = i == len(parts) - 1
                    # an earlier input's changes without the token: no version (see below)
                    changes.append(state.apply(data, token=task.token if last else ""))
                else:
                    changes.append(state.apply(data))
            state.token = task.token
            changelog = changes[0] if len(changes) == 1 else _newest(changes, key_names)
        apply_ms = int((time.perf_counter() - t0) * 1000)
        chained = _write_chained(params, task, changelog, file_schema)
        def compact(files: list[StateFile]) -> pa.Table:
            """A chain's rows, each key's newest, read back from durable storage."""
            return _newest([restored(f, task.range) for f in files], [KG_COLUMN, *key_names])

        yield from task.finish(state, changelog, state.snapshot, file_schema,
                               {"sinks": chained,
                                "input_rows": table.num_rows if table is not None else 0,
                                "changed": changelog.num_rows if changelog is not None else 0,
                                "apply_ms": apply_ms, "sync_ms": 0, "alignment_ms": align,
                                "channels": channels},
                               compact=compact if params["backend"] == "rocksdb" else None)

    return run


def _view(changelog: pa.Table, keys: list[str], outputs: list[list[str]]) -> pa.Table:
    """The update stream's rows (keys and outputs), as AggSpec.view computes them in Spark."""
    columns = [changelog.column(k) for k in keys]
    for name, func in outputs:
        if func == "mean":
            total = pc.cast(changelog.column(f"{name}__sum"), pa.float64())
            n = changelog.column(f"{name}__count")
            columns.append(pc.if_else(pc.greater(n, 0), pc.divide(total, pc.cast(n, pa.float64())),
                                      pa.scalar(None, pa.float64())))
        else:
            columns.append(changelog.column(name))
    return pa.Table.from_arrays(columns, names=[*keys, *[o[0] for o in outputs]])


def _write_chained(params: dict[str, Any], task: _Run, changelog: pa.Table | None,
                   file_schema: pa.Schema) -> dict[str, list[dict[str, Any]]]:
    """Sinks chained to this operator: write their staged files here (no Spark job)."""
    sinks = params.get("sinks") or []
    if not sinks or changelog is None or not changelog.num_rows:
        return {}
    view = _view(_external(changelog, file_schema), list(params["keys"]), params["view"])
    out: dict[str, list[dict[str, Any]]] = {}
    for sink in sinks:
        schema = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(sink["schema"])))
        uri, size = _write(view.cast(schema), sink["dir"],
                           f"part-{task.pid:05d}-{task.token}.parquet", internal=False)
        out[sink["name"]] = [{"path": uri, "size": size, "rows": view.num_rows}]
    return out


def _newest(tables: list[pa.Table], keys: list[str]) -> pa.Table:
    """The rows of several changelogs (of one batch, or a chain), the last row of each key
    only."""
    if len(tables) == 1:
        return tables[0]
    rows = pa.concat_tables(tables)
    rows = rows.append_column("__seq", pa.array(range(rows.num_rows), pa.int64()))
    last = rows.group_by(keys).aggregate([("__seq", "max")])
    return rows.take(last.column("__seq_max")).drop_columns(["__seq"])


@contextlib.contextmanager
def _user_call(params: dict[str, Any], task: _Run, method: str,
               key: Any) -> Iterator[None]:
    """Run a user callback; if it raises, fail the task once with the operator, partition,
    key-group range and key (or a callable giving the key being processed), and the user's
    traceback, between markers the driver finds."""
    from spark_ckpt.errors import UserFunctionError

    try:
        yield
    except Exception as exc:  # noqa: BLE001 - user code; re-raised with its traceback
        if callable(key):
            key = key()
        trace = "".join(traceback.format_exception(exc)).rstrip()
        raise UserFunctionError(
            f"{UserFunctionError.MARK}\noperator {params['operator']}, partition {task.pid} "
            f"(key groups {task.range.label}): {method}() raised on key {key!r}: "
            f"{type(exc).__name__}: {exc}\n{trace}\n{UserFunctionError.END}"
        ) from None
