"""Operating a pipeline from outside its driver, from what its checkpoint directory holds (no
Spark needed): ``spark-ckpt status``, ``restore``, ``cleanup`` and ``plan --pipeline``.

* **status**: the newest run, how it ended (``runs/ended/<run>.json``, written by a driver that
  stopped or failed; a SIGKILLed driver writes nothing, so "no end recorded" means running or
  killed, and the age of its last batch tells which is likelier), its last batch's progress,
  the latest checkpoint, stop and restore requests waiting.
* **restore**: ``control/restore.json`` asks the next start to restore a retained checkpoint by
  id (as ``restore_checkpoint=`` or ``spark.ckpt.checkpoint.restoreFrom`` would; those win when
  given). The start that takes it abandons the newer checkpoints, then deletes the request.
  A start killed in between takes it again: restoring the same id twice is the same restore.
* **cleanup**: files in the checkpoint directory that nothing will read again: state files no
  retained checkpoint references, a killed run's processor output and abandoned checkpoints'
  directories (with ``abandoned=True``), stop requests of ended runs. A file written after the
  newest run started is never a candidate (a running driver's state that no checkpoint
  references *yet*), and the deletion re-checks that no run started since the listing.

Each opens the directory as every tool does (streaming/runtime/pipeline_dir.py): a path where
nothing
is, a directory that is not a pipeline's checkpoint directory and one whose records do not read
as a start reads them are refused (:class:`~spark_ckpt.errors.DirectoryError`), the file named.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from typing import Any

from spark_ckpt.errors import FormatVersionError
from spark_ckpt.formats import load_record
from spark_ckpt.storage import Storage, join
from spark_ckpt.streaming.runtime.pipeline_dir import (
    PipelineDir,
    open_pipeline_dir,
)
from spark_ckpt.streaming.runtime.restore_requests import read_restore_request, restore_request_path
from spark_ckpt.streaming.runtime.runs import run_numbers

__all__ = ["Cleanup", "apply_cleanup", "cleanup_candidates", "pipeline_plan", "pipeline_status",
           "progress_records"]

log = logging.getLogger(__name__)


# -- status ------------------------------------------------------------------------------------
def _read_json(storage: Storage, path: str) -> dict[str, Any] | None:
    try:
        return json.loads(storage.read_bytes(path))
    except (OSError, ValueError):
        return None


def progress_records(storage: Storage, root: str) -> list[dict[str, Any]]:
    """Every batch progress record kept (rotated files oldest first, or per-batch files),
    one per batch id: the last run of a batch that ran again."""
    directory = join(root, "progress")
    if not storage.exists(directory):
        return []
    records: dict[int, dict[str, Any]] = {}
    names = sorted((i for i in storage.list_files(directory, recursive=False)),
                   key=lambda i: i.base_name)
    rotated = sorted((i for i in names if i.base_name.startswith("progress.jsonl")),
                     key=lambda i: -int(i.base_name.rsplit(".", 1)[-1])
                     if i.base_name[-1].isdigit() else 0)
    for info in rotated + [i for i in names if i.base_name.startswith("progress-")]:
        for line in storage.read_bytes(info.path).decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn line of a killed driver
            if isinstance(record, dict) and "batch_id" in record:
                records[int(record["batch_id"])] = record  # a rerun batch: its last run
    return [records[b] for b in sorted(records)]


def last_progress(storage: Storage, root: str) -> dict[str, Any] | None:
    """The newest batch progress record (progress.jsonl's last line, or the newest
    progress-<batch>.json where the storage cannot append)."""
    directory = join(root, "progress")
    if not storage.exists(directory):
        return None
    path = join(directory, "progress.jsonl")
    if storage.exists(path):
        lines = storage.read_bytes(path).decode(errors="replace").splitlines()
        for line in reversed(lines):
            try:
                return json.loads(line)
            except ValueError:
                continue  # a torn last line (a killed driver): the one before
    files = sorted(i.path for i in storage.list_files(directory, recursive=False)
                   if i.base_name.startswith("progress-") and i.base_name.endswith(".json"))
    return _read_json(storage, files[-1]) if files else None


def _stop_requests(storage: Storage, root: str) -> list[dict[str, Any]]:
    directory = join(root, "control")
    if not storage.exists(directory):
        return []
    names = {i.base_name for i in storage.list_files(directory, recursive=False)}
    out = []
    for name in sorted(names):
        if name.startswith("stop-") and name.endswith(".request.json"):
            request_id = name[len("stop-"):-len(".request.json")]
            answered = f"stop-{request_id}.answer.json" in names
            path = join(directory, name)
            try:  # a request the driver cannot read is ignored by it: listed, for no run
                record = load_record(storage.read_bytes(path), "stop-request", (1,), where=path)
            except (OSError, FormatVersionError) as exc:
                log.warning("stop request %s cannot be read (a driver ignores it): %s", path,
                            exc)
                record = {}
            out.append({"request_id": request_id, "run": record.get("run"),
                        "requested_ms": record.get("requested_ms"), "answered": answered})
    return out


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] \
        + "Z"


def _progress_ms(progress: dict[str, Any]) -> int | None:
    stamp = progress.get("timestamp")
    if not stamp:
        return None
    try:
        return int(dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
                   * 1000)
    except ValueError:
        return None


def pipeline_status(checkpoint_dir: str, *, checkpoint_storage: str | None = None,
                    now_ms: int) -> dict[str, Any]:
    """What the checkpoint directory says of its pipeline now (see the module)."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.ops.validate import checkpoint_dirs

    pipeline = open_pipeline_dir(checkpoint_dir, checkpoint_storage)
    storage, root, meta = pipeline.storage, pipeline.root, pipeline.metadata
    runs = pipeline.runs()
    run = runs[-1] if runs else None
    run_record = pipeline.run_record(run) if run else None
    ended = pipeline.run_end(run) if run else None
    progress = last_progress(storage, root)
    last_ms = _progress_ms(progress) if progress else None
    interval_ms = int(float(meta.get("batch_interval_s") or 0) * 1000)
    if run is None:
        state = "never started"
    elif ended is not None:
        state = ended["status"]  # stopped / failed
    else:
        quiet_ms = None if last_ms is None else now_ms - last_ms
        started_ms = (run_record or {}).get("started_ms")
        recent = max(60_000, 3 * interval_ms)
        if quiet_ms is not None and quiet_ms <= recent and \
                (started_ms is None or last_ms >= started_ms):
            state = "running"
        else:
            state = "running or killed (no end recorded, no batch recently)"
    checkpoints = CheckpointStorage(pipeline.checkpoints_uri)
    dirs = checkpoint_dirs(checkpoints.uri)
    completed = [c for c, s in dirs.items() if s == "completed"]
    stats = {int(s["checkpoint_id"]): s for s in checkpoints.history()}
    latest = completed[-1] if completed else None
    latest_stats = stats.get(latest, {}) if latest is not None else {}
    return {
        "pipeline": meta.get("name"), "pipeline_id": meta.get("pipeline_id"),
        "checkpoint_dir": checkpoint_dir, "state": state, "run": run,
        "run_started": _iso((run_record or {}).get("started_ms")),
        "ended": None if ended is None else {
            "status": ended["status"], "at": _iso(ended["ended_ms"]),
            "message": ended["message"], "final_checkpoint": ended["final_checkpoint"]},
        "last_batch": None if progress is None else {
            "batch_id": progress.get("batch_id"), "at": progress.get("timestamp"),
            "seconds_ago": None if last_ms is None else round((now_ms - last_ms) / 1000, 1),
            "input_rows": progress.get("num_input_rows"),
            "rows_per_second": progress.get("processed_rows_per_second"),
            "total_ms": (progress.get("durations_ms") or {}).get("total")},
        "latest_checkpoint": None if latest is None else {
            "checkpoint_id": latest, "barrier_batch": latest_stats.get("barrier_batch"),
            "duration_ms": latest_stats.get("duration_ms"),
            "full_bytes": latest_stats.get("full_bytes")},
        "checkpoints": {"completed": len(completed),
                        "abandoned": sum(1 for s in dirs.values() if s == "abandoned"),
                        "incomplete": sum(1 for s in dirs.values() if s == "incomplete")},
        "stop_requests_waiting": [r for r in _stop_requests(storage, root) if not r["answered"]],
        "restore_requested": _restore_requested(pipeline),
        "sources": sorted(meta.get("sources", {})),
        "outputs": sorted(meta.get("outputs", {})),
        "operators": meta.get("operators", {}),
    }


def _restore_requested(pipeline: PipelineDir) -> int | None:
    with pipeline.reading(restore_request_path(pipeline.root),
                          "withdraw it with `spark-ckpt restore "
                          f"{pipeline.checkpoint_dir} --cancel`; a start refuses it too"):
        return read_restore_request(pipeline.storage, pipeline.root)


def pipeline_plan(checkpoint_dir: str, *, checkpoint_storage: str | None = None,
                  ) -> dict[str, Any]:
    """The pipeline as its checkpoint directory records it: sources (kind, schema), stateful
    operators (kind, keys, parallelism, state schema at the latest checkpoint) and outputs."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.ops.validate import checkpoint_dirs

    pipeline = open_pipeline_dir(checkpoint_dir, checkpoint_storage)
    meta = pipeline.metadata
    checkpoints = CheckpointStorage(pipeline.checkpoints_uri)
    completed = [c for c, s in checkpoint_dirs(checkpoints.uri).items() if s == "completed"]
    latest = checkpoints.read_metadata(completed[-1]) if completed else {}
    operators = {}
    for name, info in meta.get("operators", {}).items():
        at = (latest.get("operators") or {}).get(name) or {}
        handles = at.get("handles") or {}
        schema = at.get("state_schema") or at.get("file_schema")
        operators[name] = {
            "kind": info.get("kind"), "keys": info.get("keys"),
            "parallelism": at.get("parallelism") or (len(handles) or None),
            "max_parallelism": at.get("max_parallelism"),
            "state_rows": sum(int(h.get("rows", 0)) for h in handles.values()),
            "state_schema": _ddl(schema) if schema else None,
            "aggregations": at.get("aggs"),
        }
    return {"pipeline": meta.get("name"), "pipeline_id": meta.get("pipeline_id"),
            "batch_interval_s": meta.get("batch_interval_s"),
            "sources": {n: {"describe": d, "schema": _ddl(meta.get("schemas", {}).get(n))}
                        for n, d in meta.get("sources", {}).items()},
            "operators": operators, "outputs": meta.get("outputs", {}),
            "latest_checkpoint": completed[-1] if completed else None}


def _ddl(raw: str | None) -> str | None:
    """A Spark StructType's JSON as ``name TYPE, ...``."""
    if not raw:
        return None
    try:
        from pyspark.sql.types import StructType

        schema = StructType.fromJson(json.loads(raw))
    except (ValueError, KeyError, TypeError):
        return raw
    return ", ".join(f"{f.name} {f.dataType.simpleString().upper()}" for f in schema.fields)


# -- cleanup ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Cleanup:
    """What ``cleanup`` would delete: (path, bytes, why) per file; directories of abandoned
    checkpoints separately."""

    files: list[tuple[str, int, str]]
    directories: list[tuple[str, str]]
    newest_run: int | None
    kept_files: int
    checkpoints_uri: str

    @property
    def bytes(self) -> int:
        return sum(size for _, size, _ in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"files": [{"path": p, "bytes": b, "why": w} for p, b, w in self.files],
                "directories": [{"path": p, "why": w} for p, w in self.directories],
                "bytes": self.bytes, "newest_run": self.newest_run,
                "kept_files": self.kept_files}


def cleanup_candidates(checkpoint_dir: str, *, checkpoint_storage: str | None = None,
                       abandoned: bool = False) -> Cleanup:
    """Files of ``checkpoint_dir`` nothing will read again (see the module); changes nothing."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.errors import CheckpointError
    from spark_ckpt.ops.validate import checkpoint_dirs

    pipeline = open_pipeline_dir(checkpoint_dir, checkpoint_storage)
    storage, root = pipeline.storage, pipeline.root
    runs = pipeline.runs()
    newest = runs[-1] if runs else None
    # a file written after the newest run claimed the directory may be its live state: never
    # a candidate. By the storage's own clock (the run marker's modification time), not a
    # driver's, which may be ahead of it
    since = storage.fs.get_file_info(join(root, "runs", f"{newest:08d}.json")).mtime \
        if newest else None
    if newest and since is None:
        raise CheckpointError(
            f"the storage of {checkpoint_dir} gives no modification time for run {newest}'s "
            "marker: cleanup cannot tell a running pipeline's new files from leftovers, so it "
            "lists nothing")
    checkpoints = CheckpointStorage(pipeline.checkpoints_uri)
    dirs = checkpoint_dirs(checkpoints.uri)
    referenced: set[str] = set()
    for cid, status in dirs.items():
        # an abandoned checkpoint is kept for inspection, its state files with it, unless
        # it goes too (--abandoned)
        if status == "incomplete" or (status == "abandoned" and abandoned):
            continue
        try:
            meta = checkpoints.read_metadata(cid, abandoned=status == "abandoned")
        except CheckpointError as exc:
            raise CheckpointError(
                f"checkpoint {cid} in {checkpoints.uri} cannot be read ({exc}); cleanup needs "
                "every completed checkpoint to know which files it references: run "
                "`spark-ckpt validate` and fix or remove it first") from exc
        for op in (meta.get("operators") or {}).values():
            for handle in (op.get("handles") or {}).values():
                referenced.update(f["path"].rsplit("/", 1)[-1] for f in handle.get("files", ()))
    files: list[tuple[str, int, str]] = []
    kept = 0
    if not any(status == "completed" for status in dirs.values()) and \
            storage.exists(join(root, "state")) and \
            any(True for _ in storage.list_files(join(root, "state"), recursive=True)):
        raise CheckpointError(
            f"no completed checkpoint in {checkpoints.uri}, but {checkpoint_dir} holds state "
            "files: if the pipeline keeps its checkpoints elsewhere (spark.ckpt.checkpoint.dir),"
            " pass --storage; cleanup lists nothing it cannot prove unreferenced")
    def old(info: Any) -> bool:
        if since is None:
            return True
        return info.mtime is not None and info.mtime < since

    state_dir = join(root, "state")
    if storage.exists(state_dir):
        for info in storage.list_files(state_dir, recursive=True):
            parts = info.path[len(state_dir):].strip("/").split("/")
            if "output" in parts[1:2] and old(info):
                files.append((info.path, int(info.size or 0),
                              "processor output of a run that ended (its batch was replayed "
                              "or committed)"))
            elif info.base_name not in referenced and info.base_name.endswith(".parquet") \
                    and old(info):
                files.append((info.path, int(info.size or 0),
                              "state file no completed checkpoint references"))
            else:
                kept += 1
    ended = {r for r in runs if pipeline.run_end(r) is not None}
    for request in _stop_requests(storage, root):
        run = request.get("run")
        # an earlier or ended run's: a client polling for the running run's answer keeps it
        if isinstance(run, int) and (run < (newest or 0) or run in ended):
            for suffix in ("request", "answer"):
                path = join(root, "control", f"stop-{request['request_id']}.{suffix}.json")
                if storage.exists(path):
                    files.append((path, 0, "stop request of an earlier or ended run"))
    directories = []
    if abandoned:
        for cid, status in dirs.items():
            if status == "abandoned":
                directories.append((checkpoints.directory(cid),
                                    "abandoned checkpoint (a restore by id chose an older one)"))
    return Cleanup(files, directories, newest, kept, checkpoints.uri)


def apply_cleanup(checkpoint_dir: str, plan: Cleanup) -> int:
    """Delete what ``plan`` lists, unless a run started since it was made (then nothing is
    deleted: its files could be that run's). Returns the number of paths deleted."""
    from spark_ckpt.errors import CheckpointError

    storage = Storage(checkpoint_dir)
    runs = run_numbers(storage, storage.root)
    if (runs[-1] if runs else None) != plan.newest_run:
        raise CheckpointError(
            f"run {runs[-1]} of the pipeline started after the files were listed (run "
            f"{plan.newest_run} was the newest); nothing was deleted: run cleanup again")
    deleted = 0
    for path, _size, _why in plan.files:
        try:
            storage.fs.delete_file(path)
            deleted += 1
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cleanup: could not delete %s: %s", path, exc)
    checkpoints = Storage(plan.checkpoints_uri)
    for path, _why in plan.directories:
        checkpoints.delete_dir(path)
        deleted += 1
    return deleted
