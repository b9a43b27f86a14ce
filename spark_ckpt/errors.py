"""The one error tree of spark_ckpt.

Every error names what was expected, what was found and, where there is one, what to do.
Expected races (late acknowledgements, duplicate manifests) are returned outcomes, not errors.
Every ``raise`` in the package raises a class of this tree (tests/test_errors.py checks it,
with its short list of deliberate exceptions: Python protocols and injected storage faults),
and one condition raises one class. Each class also derives from the built-in error that
fits it (in brackets), so ``except ValueError`` and ``except RuntimeError`` keep working::

    SparkCkptError
    ├── ConfigurationError [ValueError]
    ├── EnvironmentError_ [RuntimeError]
    ├── JobDefinitionError [ValueError]
    ├── InternalError [ValueError]
    ├── IllegalStateTransition [RuntimeError]
    ├── FormatVersionError [ValueError]
    │   └── RecordError
    ├── EventLogError [RuntimeError]
    │   └── EventLogUnreadable
    ├── JobFencedError [RuntimeError]
    ├── StorageGuaranteeError [RuntimeError]
    ├── CommitError [RuntimeError]
    ├── InputChangedError [RuntimeError]
    ├── TaskExecutionError [RuntimeError]
    ├── SourceError [RuntimeError]
    ├── PipelineFailedError [RuntimeError]
    ├── StateTooLargeError [RuntimeError]
    ├── CheckpointError [RuntimeError]
    │   ├── DirectoryError (an EventLogError too)
    │   ├── StateSchemaError
    │   └── SinkAheadError
    ├── UserFunctionError [RuntimeError]
    └── NotSplittable
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CommitError",
    "ConfigurationError",
    "DirectoryError",
    "EnvironmentError_",
    "EventLogError",
    "EventLogUnreadable",
    "FormatVersionError",
    "IllegalStateTransition",
    "InputChangedError",
    "InternalError",
    "JobDefinitionError",
    "JobFencedError",
    "NotSplittable",
    "PipelineFailedError",
    "RecordError",
    "SinkAheadError",
    "SourceError",
    "SparkCkptError",
    "StateSchemaError",
    "StateTooLargeError",
    "StorageGuaranteeError",
    "TaskExecutionError",
    "UserFunctionError",
]


class SparkCkptError(Exception):
    """Base class of every error raised by spark_ckpt."""


class ConfigurationError(SparkCkptError, ValueError):
    """A ``spark.ckpt.*`` option (or a ``SPARK_CKPT_*`` environment variable, a defaults file)
    has a value of the wrong type or outside its range, or names no declared option."""


class EnvironmentError_(SparkCkptError, RuntimeError):
    """The machine cannot run Spark as configured (Java missing or too old, bad JAVA_HOME)."""


class JobDefinitionError(SparkCkptError, ValueError):
    """A job or pipeline is declared or called wrongly: unknown vertex, cycle, mismatched
    parallelism, bad key, a bad argument, a method called when it cannot be."""


class InternalError(SparkCkptError, ValueError):
    """An invariant of spark_ckpt itself does not hold: a component was handed what its
    contract rules out (rows of another task's key groups, a key twice in one state update,
    an attempt registered twice, an object of a kind it does not know). A bug, in spark_ckpt
    or in how Spark routed rows; nothing was changed. Please report it."""


class IllegalStateTransition(SparkCkptError, RuntimeError):
    """A lifecycle state machine was asked for a transition its table does not allow."""

    def __init__(self, what: str, current: object, target: object) -> None:
        super().__init__(f"{what}: illegal transition {current} -> {target}")
        self.current = current
        self.target = target


class FormatVersionError(SparkCkptError, ValueError):
    """A persisted record has a format version this release cannot read."""


class RecordError(FormatVersionError):
    """A persisted record parses and has a known version, but a field is missing, has the
    wrong type, an impossible value or a path that leaves its directory (a hand edit or a
    bug): the message names the file, the field, what was expected and what was found.
    Nothing is run from such a record."""


class EventLogError(SparkCkptError, RuntimeError):
    """The job event log could not be written, or could not be loaded at all (reading
    tolerates damaged files and torn tail commits instead)."""


class EventLogUnreadable(EventLogError):
    """No version of the event log could be loaded: every commit is torn. A batch job sets
    such a log aside and starts fresh; the tools report it."""


class JobFencedError(SparkCkptError, RuntimeError):
    """Another driver started an attempt of the same job; this driver must not commit."""


class StorageGuaranteeError(SparkCkptError, RuntimeError):
    """A store cannot give a guarantee the configuration requires: create-if-absent without a
    conditional write, with ``spark.ckpt.storage.conditionalWrites=required``."""


class CommitError(SparkCkptError, RuntimeError):
    """A sink could not commit its staged output."""


class InputChangedError(SparkCkptError, RuntimeError):
    """A source file recorded by an earlier attempt changed or vanished before recovery."""


class TaskExecutionError(SparkCkptError, RuntimeError):
    """A Spark job that ran part of a vertex failed."""


class SourceError(SparkCkptError, RuntimeError):
    """A source cannot be read as declared: a malformed file, a file whose schema drifted, a
    non-append change to a Delta table. Nothing is allocated (streaming) or read (batch) from
    it until it is fixed."""


class PipelineFailedError(SparkCkptError, RuntimeError):
    """A streaming batch failed; the pipeline stopped and the batch reruns on restart."""


class StateTooLargeError(SparkCkptError, RuntimeError):
    """Keyed state outgrew the in-memory backend's limit for one task."""


class CheckpointError(SparkCkptError, RuntimeError):
    """A checkpoint could not be taken or restored: storage failures past the tolerable limit,
    no restorable checkpoint, a checkpoint that does not belong to this pipeline."""


class DirectoryError(CheckpointError, EventLogError):
    """A tool (``spark-ckpt``, ``spark_ckpt.shell``, :func:`~spark_ckpt.read_state`) was
    pointed at a directory that is not what it reads, and refuses it before it reads on or
    changes anything. ``kind`` says how:

    * ``"missing"``: nothing at that path (or, in a work directory, no event log of the job);
    * ``"foreign"``: something is there, but not a pipeline's checkpoint directory (its
      ``metadata.json``) or not a batch job work directory (jobs' ``<job>/events`` logs);
    * ``"damaged"``: a record in it does not parse or fails the checks a start applies to it.

    The message names the directory or the file, what was expected, what was found and what
    to do; ``path`` is that directory or file. A :class:`CheckpointError` (a pipeline's
    directory) and an :class:`EventLogError` (a job's) both, as the tools raised before."""

    KINDS = ("missing", "foreign", "damaged")

    def __init__(self, message: str, *, kind: str, path: str) -> None:
        if kind not in self.KINDS:  # pragma: no cover - a bug here
            raise InternalError(f"expected one of {self.KINDS}, found {kind!r}")
        super().__init__(message)
        self.kind = kind
        self.path = path

    def __reduce__(self) -> tuple:  # keyword-only arguments: pickled as made
        return (_directory_error, (str(self), self.kind, self.path))


def _directory_error(message: str, kind: str, path: str) -> DirectoryError:
    return DirectoryError(message, kind=kind, path=path)


class StateSchemaError(CheckpointError):
    """A stateful operator's declared state cannot be read from its checkpoint (a changed key
    or max parallelism, a narrowed or changed type, a changed aggregation, a rename that does
    not fit): refused at start, before any batch runs; the message names the operator, both
    schemas and what to do."""


class SinkAheadError(CheckpointError):
    """A sink holds output of batches its pipeline's checkpoint directory does not know (the
    directory was restored from an older copy, or lost its records): running on would take new
    input for batches the sink already shows and skip it. Refused at start, before any batch
    runs; the message names the sink, both positions and what to do."""


class UserFunctionError(SparkCkptError, RuntimeError):
    """A user's function (a keyed processor's ``process`` or ``on_timer``) raised inside a
    Spark task. The message names the operator, the partition and key-group range, the key,
    and carries the user's exception and traceback once."""

    MARK = "[spark_ckpt user function error]"
    END = "[end of spark_ckpt user function error]"

    @classmethod
    def from_task_failure(cls, exc: BaseException) -> UserFunctionError | None:
        """The user error a failed Spark job carries in its message, if it carries one."""
        text = str(exc)
        start = text.find(cls.MARK)
        if start < 0:
            return None
        end = text.find(cls.END, start)
        body = text[start + len(cls.MARK):end if end > 0 else None].strip()
        return cls(body)


class NotSplittable(SparkCkptError):
    """A batch vertex's aggregation has no partial form here (the message says why): a planning
    outcome, caught inside batch planning, which then keeps the vertex whole."""
