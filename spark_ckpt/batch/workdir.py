"""A batch job work directory (``spark.ckpt.workDir``) as the tools open it.

Each job has its directory there, ``<work dir>/<job id>/``: its event log ``events/`` (a Delta
table), its attempts' claims ``attempts/``, its results ``results/`` (batch/runner.py). A work
directory may also hold pipelines' checkpoint directories.

:func:`open_work_dir` and :func:`open_job` are the tools' way in (``spark-ckpt``,
``spark_ckpt.shell``, the report). They refuse, with a
:class:`~spark_ckpt.errors.DirectoryError` saying what was expected, what was found and what to
do: a path where nothing is (*missing*); something that is not a work directory (*foreign*: a
file, a pipeline's checkpoint directory, one job's own directory, a directory holding neither
jobs nor pipelines); a job with no event log there (*missing*); an event log that does not load
as recovery loads it (*damaged*: the log is named). An empty directory is a work directory no
job ran in yet. No Spark is needed; nothing is changed (the tools read without the repair a
resubmission makes).
"""

from __future__ import annotations

from typing import Any

from spark_ckpt.batch.runner import job_paths
from spark_ckpt.errors import DirectoryError, EventLogError
from spark_ckpt.eventlog.reader import EventLogUnreadable, LogReadResult, read_events
from spark_ckpt.options import OPTIONS
from spark_ckpt.storage import Storage, join

__all__ = ["job_dirs", "open_job", "open_work_dir"]

_KEY = next(o.key for o in OPTIONS if o.field == "work_dir")
EXPECTED = "a batch job work directory"
TODO = f"pass the work directory the jobs ran with ({_KEY}; spark-ckpt --work-dir)"


def _is_job_dir(storage: Storage, path: str) -> bool:
    """A job's directory: its event log, or an attempt's claim (a driver killed before the
    first event)."""
    return storage.exists(join(path, "events", "_delta_log")) or any(
        i.base_name[:5].isdigit() and i.base_name.endswith(".json")
        for i in storage.list_files(join(path, "attempts"), recursive=False))


def _is_pipeline_dir(storage: Storage, path: str) -> bool:
    """A pipeline's checkpoint directory (streaming/runtime/pipeline_dir.py): its metadata.json or
    its runs' claims."""
    return storage.exists(join(path, "metadata.json")) or \
        storage.exists(join(path, "runs"))


def _entries(storage: Storage, path: str) -> list[Any]:
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(path, allow_not_found=True, recursive=False)
    return sorted(storage.fs.get_file_info(selector), key=lambda i: i.base_name)


def job_dirs(storage: Storage) -> list[str]:
    """The ids of the jobs whose directories ``storage``'s root holds."""
    import pyarrow.fs as pafs

    return [i.base_name for i in _entries(storage, storage.root)
            if i.type == pafs.FileType.Directory and "." not in i.base_name
            and _is_job_dir(storage, i.path)]


def open_work_dir(work_dir: str) -> Storage:
    """The work directory ``work_dir``, or a refusal (see the module)."""
    import pyarrow.fs as pafs

    storage = Storage(work_dir)
    kind = storage.fs.get_file_info(storage.root).type
    if kind == pafs.FileType.NotFound:
        raise DirectoryError(f"expected {EXPECTED} at {work_dir}, found nothing at that path; "
                             f"{TODO}", kind="missing", path=work_dir)
    if kind != pafs.FileType.Directory:
        raise DirectoryError(f"expected {EXPECTED} at {work_dir}, found a file; {TODO}",
                             kind="foreign", path=work_dir)
    root = storage.root
    found = None
    if _is_pipeline_dir(storage, root):
        found = (f"a pipeline's checkpoint directory (metadata.json, runs/); read it with "
                 f"`spark-ckpt status {work_dir}` or `spark-ckpt checkpoints list {work_dir}`")
    elif _is_job_dir(storage, root):
        parent, _, job = work_dir.rstrip("/").rpartition("/")
        found = (f"the directory of job {job} itself; pass its parent: --job {job} "
                 f"--work-dir {parent or '.'}")
    else:
        infos = [i for i in _entries(storage, root) if not i.base_name.startswith(".")]
        ours = [i for i in infos if i.type == pafs.FileType.Directory and (
            _is_job_dir(storage, i.path) or _is_pipeline_dir(storage, i.path))]
        if infos and not ours:
            shown = ", ".join(i.base_name for i in infos[:6]) + \
                (f" and {len(infos) - 6} more" if len(infos) > 6 else "")
            found = f"no job's directory (<job>/events/): it holds {shown}; {TODO}"
    if found is not None:
        raise DirectoryError(f"expected {EXPECTED} at {work_dir} (a directory per job, with "
                             f"its event log), found {found}", kind="foreign", path=work_dir)
    return storage


def open_job(work_dir: str, job_id: str) -> LogReadResult:
    """Job ``job_id``'s events under ``work_dir`` as recovery reads them (torn tail commits
    and unreadable event files are skipped and listed in ``problems``), or a refusal (see the
    module)."""
    storage = open_work_dir(work_dir)
    path = job_paths(storage, job_id)["events"]
    if not storage.exists(join(path, "_delta_log")):
        jobs = job_dirs(storage)
        raise DirectoryError(
            f"no event log for job {job_id!r} under {storage.uri} (expected {path}); jobs "
            f"there: {', '.join(jobs) if jobs else 'none'}; check the job id and the work "
            "directory", kind="missing", path=path)
    try:
        return read_events(storage, path)
    except (EventLogUnreadable, EventLogError) as exc:
        todo = ("a resubmission sets it aside and runs the job from its start"
                if isinstance(exc, EventLogUnreadable) else
                "fix the storage or upgrade spark_ckpt; a resubmission refuses it too")
        raise DirectoryError(
            f"expected the event log of job {job_id!r} at {storage.spark_path(path)} to load "
            f"as recovery loads it, found it damaged: {exc}; {todo} (nothing was changed)",
            kind="damaged", path=storage.spark_path(path)) from exc

