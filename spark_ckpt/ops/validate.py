"""Validate what a restart or a resubmission would rely on, changing nothing.

* A pipeline's checkpoint storage: every checkpoint directory is *completed* (its
  ``_metadata.json`` present: restorable), *abandoned* (a restore by id chose an older one; its
  metadata renamed ``_metadata.abandoned.json``) or *incomplete* (a crash or an abort before the
  metadata was written). A completed checkpoint is intact when its metadata reads (known format
  version, its own id) and every state file it references exists with the recorded size.
* A batch job's event log: it must replay, and every file of every finished partition must
  exist with the recorded size (what recovery checks before reusing a partition), except the
  files of sinks whose commit began (they may have moved into the table).

Both return a report whose ``ok`` says whether a restore (the newest completed checkpoint) or a
resubmission (every finished partition) finds what it was promised.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spark_ckpt.storage import Storage, join, stat_any

__all__ = ["CheckpointReport", "JobReport", "checkpoint_dirs", "validate_checkpoints",
           "validate_job"]


@dataclasses.dataclass
class CheckpointReport:
    checkpoint_id: int
    status: str  # completed, abandoned, incomplete
    problems: list[str] = dataclasses.field(default_factory=list)
    state_files: int = 0
    state_bytes: int = 0

    @property
    def restorable(self) -> bool:
        return self.status == "completed" and not self.problems

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"restorable": self.restorable}


def checkpoint_dirs(root_uri: str) -> dict[int, str]:
    """Each ``chk-<id>`` directory's status: completed, abandoned or incomplete."""
    import pyarrow.fs as pafs

    store = Storage(root_uri)
    out: dict[int, str] = {}
    selector = pafs.FileSelector(store.root, allow_not_found=True, recursive=False)
    for info in store.fs.get_file_info(selector):
        name = info.base_name
        if not (name.startswith("chk-") and name[4:].isdigit()):
            continue
        directory = join(store.root, name)
        if store.exists(join(directory, "_metadata.json")):
            out[int(name[4:])] = "completed"
        elif store.exists(join(directory, "_metadata.abandoned.json")):
            out[int(name[4:])] = "abandoned"
        else:
            out[int(name[4:])] = "incomplete"
    return dict(sorted(out.items()))


def validate_checkpoints(root_uri: str) -> list[CheckpointReport]:
    """Each checkpoint in the checkpoint storage ``root_uri`` and what is wrong with it (a
    pipeline's directory is opened first by its callers: streaming/runtime/pipeline_dir.py)."""
    from spark_ckpt.checkpoint.checkpoint_storage import CheckpointStorage
    from spark_ckpt.errors import CheckpointError

    storage = CheckpointStorage(root_uri)
    reports = []
    for cid, status in checkpoint_dirs(root_uri).items():
        report = CheckpointReport(cid, status)
        reports.append(report)
        if status != "completed":
            continue
        try:
            meta = storage.read_metadata(cid)
        except CheckpointError as exc:
            report.problems.append(f"metadata unreadable: {exc}")
            continue
        files = [(f["path"], int(f["bytes"]))
                 for entry in meta.get("operators", {}).values()
                 for handle in entry.get("handles", {}).values()
                 for f in handle.get("files", ())]
        report.state_files = len(files)
        report.state_bytes = sum(size for _, size in files)
        for (path, size), found in zip(files, stat_any(p for p, _ in files), strict=True):
            if found is None:
                report.problems.append(f"state file missing: {path}")
            elif found != size:
                report.problems.append(f"state file {path}: expected {size} bytes, "
                                       f"found {found}")
    return reports


@dataclasses.dataclass
class JobReport:
    job_id: str
    completed: bool = False  # its sinks committed: a resubmission needs none of its files
    events: int = 0
    finished_partitions: int = 0
    files_checked: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    lost: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"ok": self.ok,
                                           "lost": [list(k) for k in self.lost]}


def validate_job(work_dir: str, job_id: str) -> JobReport:
    """What a resubmission of ``job_id`` finds. A ``work_dir`` that is missing or is not a
    work directory is refused (:class:`~spark_ckpt.errors.DirectoryError`); a job with no
    event log, or one that does not load, is a problem of the report."""
    from spark_ckpt.batch.runner import job_paths
    from spark_ckpt.batch.workdir import open_work_dir
    from spark_ckpt.errors import EventLogError
    from spark_ckpt.eventlog.reader import EventLogUnreadable, read_events
    from spark_ckpt.eventlog.replay import replay

    storage = open_work_dir(work_dir)
    paths = job_paths(storage, job_id)
    report = JobReport(job_id)
    if not storage.exists(paths["events"]):
        report.problems.append(f"no event log at {paths['events']}")
        return report
    try:
        read = read_events(storage, paths["events"])
    except (EventLogUnreadable, EventLogError) as exc:
        report.problems.append(f"event log unreadable: {exc}")
        return report
    report.problems.extend(f"event log: {p}" for p in read.problems)
    history = replay(read.events)
    report.events = history.events
    report.finished_partitions = len(history.finished)
    report.completed = history.completed
    if history.completed:
        return report
    committing = set(history.sink_started) | set(history.sink_committed)
    checks = [(key, out.path, out.size) for key, fp in sorted(history.finished.items())
              for out in fp.outputs if not (out.kind == "sink" and out.target in committing)]
    report.files_checked = len(checks)
    lost: dict[tuple[str, int], None] = {}
    for (key, path, size), found in zip(checks, stat_any(p for _, p, _ in checks), strict=True):
        if found != size:
            report.problems.append(
                f"partition {key[0]}/{key[1]}: {path} "
                + ("missing" if found is None else f"is {found} bytes, expected {size}"))
            lost[key] = None
    report.lost = list(lost)
    return report
