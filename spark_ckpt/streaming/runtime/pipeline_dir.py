"""A pipeline's checkpoint directory, as a start reads it and as the tools open it.

What a start writes there (streaming/runtime/start.py, run_claim.py)::

    metadata.json        pipeline-metadata: name, id, sources, schemas, outputs, operators
    runs/<n>.json        pipeline-run: each driver's claim (runs/ended/<n>.json: how it ended)
    allocations/, commits/, driver/   per-batch records (streaming/runtime/metalog.py)
    progress/, control/, state/, fence/, checkpoints/ (unless spark.ckpt.checkpoint.dir)

:func:`read_pipeline_metadata` is the one reader of ``metadata.json``: a start's
(``StreamingContext``) and the tools' alike, with the versioned, field-by-field checks of
:mod:`spark_ckpt.formats`. :func:`open_pipeline_dir` is the tools' way in (``spark-ckpt``,
``spark_ckpt.shell``, ``read_state``, the report): it refuses, with a
:class:`~spark_ckpt.errors.DirectoryError` that says what was expected, what was found and
what to do, a path where nothing is (*missing*), a directory that is not a pipeline's
checkpoint directory (*foreign*: no ``metadata.json`` and nothing a pipeline writes) and one
whose records do not read as a start reads them (*damaged*: the file is named). No Spark is
needed; nothing is changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from spark_ckpt.errors import DirectoryError, FormatVersionError
from spark_ckpt.formats import load_record
from spark_ckpt.storage import Storage, join
from spark_ckpt.streaming.runtime.runs import run_numbers

__all__ = ["METADATA", "METADATA_VERSION", "PipelineDir", "checkpoints_place", "damaged",
           "checkpoints_uri", "entries", "open_pipeline_dir", "read_pipeline_metadata",
           "read_run_record"]

METADATA = "metadata.json"
METADATA_VERSION = 1
RUN_VERSION = 1
EXPECTED = "a pipeline's checkpoint directory"


def read_pipeline_metadata(storage: Storage, root: str) -> dict[str, Any] | None:
    """``root``'s ``metadata.json`` checked field by field (None: there is none). Raises
    :class:`~spark_ckpt.errors.FormatVersionError` (a
    :class:`~spark_ckpt.errors.RecordError` naming the file for a field) when it does not
    read."""
    path = join(root, METADATA)
    if not storage.exists(path):
        return None
    return load_record(storage.read_bytes(path), "pipeline-metadata", (METADATA_VERSION,),
                       where=storage.spark_path(path))


def read_run_record(storage: Storage, root: str, run: int) -> dict[str, Any]:
    """Run ``run``'s claim, ``runs/<run>.json``, checked field by field."""
    path = join(root, "runs", f"{run:08d}.json")
    return load_record(storage.read_bytes(path), "pipeline-run", (RUN_VERSION,),
                       where=storage.spark_path(path))


def damaged(expected: str, directory: str, path: str, exc: BaseException, todo: str,
            *aliases: str) -> DirectoryError:
    """The refusal of ``directory`` because ``path`` in it (also named ``aliases``: the file
    system's path of a URI) does not read (``exc``)."""
    found = str(exc)
    for name in (path, *aliases):
        found = found.removeprefix(f"{name}: ")
    found = found.split("; correct the field or restore the file", 1)[0]
    return DirectoryError(f"expected {expected} at {directory} whose records read as a start "
                          f"reads them, found {path} damaged: {found}; {todo} (nothing was "
                          "changed)", kind="damaged", path=path)


def entries(storage: Storage, path: str) -> list[Any]:
    """What ``path`` holds (files and directories, not recursive), by name."""
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(path, allow_not_found=True, recursive=False)
    return sorted(storage.fs.get_file_info(selector), key=lambda i: i.base_name)


def _names(infos: list[Any], limit: int = 6) -> str:
    import pyarrow.fs as pafs

    shown = [i.base_name + ("/" if i.type == pafs.FileType.Directory else "")
             for i in infos[:limit]]
    return ", ".join(shown) + (f" and {len(infos) - limit} more" if len(infos) > limit else "")


def _written_by_a_pipeline(storage: Storage, root: str) -> list[str]:
    """The entries of ``root`` only a spark_ckpt pipeline writes (its run claims and per-batch
    records, named by number): a directory holding them lost its metadata.json."""
    found = []
    if run_numbers(storage, root):
        found.append("runs/")
    for log in ("allocations", "commits"):
        if any(i.base_name[:12].isdigit() and i.base_name.endswith(".json")
               for i in storage.list_files(join(root, log), recursive=False)):
            found.append(f"{log}/")
    return found


@dataclasses.dataclass(frozen=True)
class PipelineDir:
    """A pipeline's checkpoint directory the tools opened: its checked ``metadata.json``
    (``{}`` for a bare directory of checkpoints, see :func:`open_pipeline_dir`) and where its
    checkpoints are."""

    checkpoint_dir: str  # as given
    storage: Storage
    metadata: dict[str, Any]
    checkpoints_uri: str

    @property
    def root(self) -> str:
        return self.storage.root

    @property
    def name(self) -> str | None:
        return self.metadata.get("name")

    @contextlib.contextmanager
    def reading(self, path: str, todo: str = "restore it from a copy of the directory"
                ) -> Iterator[None]:
        """Inside: a record of ``path`` that does not read refuses the directory as damaged,
        naming the file."""
        try:
            yield
        except FormatVersionError as exc:
            raise damaged(EXPECTED, self.checkpoint_dir, self.storage.spark_path(path), exc,
                          todo, path) from exc

    def runs(self) -> list[int]:
        return run_numbers(self.storage, self.root)

    def run_record(self, run: int) -> dict[str, Any]:
        """Run ``run``'s claim (``runs/<run>.json``), as its start wrote it."""
        with self.reading(join(self.root, "runs", f"{run:08d}.json")):
            return read_run_record(self.storage, self.root, run)

    def run_end(self, run: int) -> dict[str, Any] | None:
        """How run ``run`` ended (None: running, or killed before it could say)."""
        from spark_ckpt.streaming.runtime.stop_control import read_run_end

        with self.reading(join(self.root, "runs", "ended", f"{run:08d}.json")):
            return read_run_end(self.storage, self.root, run)


def checkpoints_place(checkpoint_dir: str, storage: Storage, meta: dict[str, Any],
                      override: str | None = None) -> str:
    """Where the pipeline on ``checkpoint_dir`` keeps its checkpoints: ``override``, else what
    its metadata.json records (spark.ckpt.checkpoint.dir), else ``<dir>/checkpoints``.

    A release before relocatable directories recorded the default place by absolute path, so
    a copy's record names the original's ``checkpoints/``: a recorded ``.../checkpoints`` of
    another directory, when this directory has its own, is taken as this one's (reading the
    original's would have the tools clean up or restore by the wrong checkpoints)."""
    if override:
        return override
    own = join(checkpoint_dir, "checkpoints")
    recorded = str(meta.get("checkpoints") or own)
    if "://" not in recorded and not recorded.startswith(("/", "file:")):
        return join(checkpoint_dir, recorded)  # inside the directory (written relative)
    if recorded.rstrip("/") == own.rstrip("/"):
        return recorded
    if recorded.rstrip("/").endswith("/checkpoints") and \
            storage.exists(join(storage.root, "checkpoints")):
        return own
    return recorded


def _foreign(checkpoint_dir: str, storage: Storage, infos: list[Any]) -> DirectoryError:
    import pyarrow.fs as pafs

    dirs = [i for i in infos if i.type == pafs.FileType.Directory]
    pipelines = [i for i in dirs if storage.exists(join(i.path, METADATA))]
    jobs = [i for i in dirs if storage.exists(join(i.path, "events", "_delta_log"))]
    if storage.exists(join(storage.root, "events", "_delta_log")):
        what = "a batch job's directory (its event log, events/)"
        parent, _, job = checkpoint_dir.rstrip("/").rpartition("/")
        todo = ("a job is read by its id and work directory: spark-ckpt status --job "
                f"{job} --work-dir {parent or '.'}")
    elif any(i.base_name.startswith("chk-") and i.base_name[4:].isdigit() for i in dirs):
        what = "a checkpoint storage (chk-<id>/ directories)"
        todo = ("pass the pipeline's checkpoint directory, with --storage "
                f"{checkpoint_dir} if its checkpoints are kept apart "
                "(spark.ckpt.checkpoint.dir)")
    elif pipelines:
        what = f"pipelines' checkpoint directories inside it ({_names(pipelines)})"
        todo = "pass one of them"
    elif jobs:
        what = f"a batch job work directory (jobs {_names(jobs)})"
        todo = "read its jobs with --job JOB --work-dir " + checkpoint_dir
    else:
        what = f"it holds {_names(infos)}" if infos else "the directory is empty"
        todo = "pass the checkpoint directory the pipeline's StreamingContext was given"
    return DirectoryError(f"expected {EXPECTED} at {checkpoint_dir} (with {METADATA}), found "
                          f"none: {what}; {todo}", kind="foreign", path=checkpoint_dir)


def open_pipeline_dir(checkpoint_dir: str, checkpoint_storage: str | None = None, *,
                      bare_checkpoints: bool = False) -> PipelineDir:
    """Open the pipeline's checkpoint directory ``checkpoint_dir`` for reading, or refuse it
    (see the module). ``checkpoint_storage``: spark.ckpt.checkpoint.dir, where the pipeline
    keeps its checkpoints apart. ``bare_checkpoints``: also take a directory that holds only a
    ``checkpoints/`` directory (``read_state`` of a pipeline that keeps them apart)."""
    import pyarrow.fs as pafs

    storage = Storage(checkpoint_dir)
    kind = storage.fs.get_file_info(storage.root).type
    if kind == pafs.FileType.NotFound:
        raise DirectoryError(
            f"expected {EXPECTED} at {checkpoint_dir}, found nothing at that path; pass the "
            "checkpoint directory the pipeline's StreamingContext was given",
            kind="missing", path=checkpoint_dir)
    if kind != pafs.FileType.Directory:
        raise DirectoryError(
            f"expected {EXPECTED} at {checkpoint_dir}, found none: it is a file; pass the "
            "checkpoint directory the pipeline's StreamingContext was given",
            kind="foreign", path=checkpoint_dir)
    path = join(storage.root, METADATA)
    try:
        meta = read_pipeline_metadata(storage, storage.root)
    except FormatVersionError as exc:
        raise damaged(EXPECTED, checkpoint_dir, storage.spark_path(path), exc,
                      "restore it from a copy of the directory; a start refuses it too") \
            from exc
    if meta is None:
        written = _written_by_a_pipeline(storage, storage.root)
        if written:
            raise DirectoryError(
                f"expected {EXPECTED} at {checkpoint_dir} whose records read as a start reads "
                f"them, found {storage.spark_path(path)} missing, though the directory holds "
                f"{', '.join(written)}, which a pipeline wrote; restore {METADATA} from a copy "
                "of the directory (a start would take it for a new pipeline; nothing was "
                "changed)", kind="damaged", path=storage.spark_path(path))
        if not (bare_checkpoints and storage.exists(join(storage.root, "checkpoints"))):
            raise _foreign(checkpoint_dir, storage, entries(storage, storage.root))
        meta = {}
    return PipelineDir(checkpoint_dir, storage, meta,
                       checkpoints_place(checkpoint_dir, storage, meta, checkpoint_storage))


def checkpoints_uri(checkpoint_dir: str, override: str | None = None) -> str:
    """Where the pipeline on ``checkpoint_dir`` keeps its checkpoints: ``override``, else what
    its metadata.json records (spark.ckpt.checkpoint.dir), else ``<dir>/checkpoints``; also
    that when the recorded place is gone (a copy of a directory since deleted). A
    metadata.json that does not read as a start reads it is refused
    (:class:`~spark_ckpt.errors.DirectoryError`); a directory without one is taken as it is
    (to refuse it, :func:`~spark_ckpt.streaming.runtime.pipeline_dir.open_pipeline_dir`)."""
    if override:
        return override
    storage = Storage(checkpoint_dir)
    try:
        meta = read_pipeline_metadata(storage, storage.root) or {}
    except FormatVersionError as exc:
        raise damaged(EXPECTED, checkpoint_dir,
                      storage.spark_path(join(storage.root, "metadata.json")), exc,
                      "restore it from a copy of the directory; a start refuses it too") \
            from exc
    return checkpoints_place(checkpoint_dir, storage, meta)
