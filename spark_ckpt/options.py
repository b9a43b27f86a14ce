"""Every ``spark.ckpt.*`` option, declared once: key, type, default and documentation.

Options are read from the Spark conf (``spark-defaults.conf``, ``--conf``, ``spark.conf.set``),
validated once into an immutable :class:`Settings`, and documented by
``python -m spark_ckpt.options`` which generates ``docs/configuration.md``.

:data:`OPTIONS` is the one declaration of each option's default. :class:`Settings` (and
:class:`~spark_ckpt.checkpoint.CheckpointConfig`, the coordinator's part of it) name their
fields and types for type checkers, and take every default from :data:`OPTIONS` through
:func:`defaults_from_options`, which refuses at import a field that names no option, has
another type or declares a default of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from spark_ckpt.errors import ConfigurationError, InternalError

__all__ = ["FROM_OPTIONS", "OPTIONS", "ConfigOption", "Settings", "defaults_from_options",
           "render_markdown"]

T = TypeVar("T")
C = TypeVar("C", bound=type)


@dataclasses.dataclass(frozen=True)
class ConfigOption(Generic[T]):
    """One declared option.

    Attributes:
        key: the full Spark conf key, ``spark.ckpt.…``.
        field: the attribute name on :class:`Settings`.
        type_name: ``int``, ``bool``, ``str`` or ``choice``.
        default: the value used when the key is not set.
        doc: one line for ``docs/configuration.md``.
        choices: allowed values for ``choice`` options.
        minimum: smallest allowed value for ``int`` options.
    """

    key: str
    field: str
    type_name: str
    default: T
    doc: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None

    def parse(self, raw: Any) -> T:
        """Turn a raw conf value (usually a string) into the option's type, or raise."""
        if self.type_name == "int":
            try:
                value = int(str(raw).strip())
            except ValueError:
                raise ConfigurationError(
                    f"{self.key}: expected an integer, found {raw!r}"
                ) from None
            if self.minimum is not None and value < self.minimum:
                raise ConfigurationError(
                    f"{self.key}: expected an integer >= {self.minimum}, found {value}"
                )
            return value  # type: ignore[return-value]
        if self.type_name == "bool":
            text = str(raw).strip().lower()
            if text in ("true", "1", "yes"):
                return True  # type: ignore[return-value]
            if text in ("false", "0", "no"):
                return False  # type: ignore[return-value]
            raise ConfigurationError(f"{self.key}: expected true or false, found {raw!r}")
        if self.type_name == "choice":
            text = str(raw).strip().lower()
            if text not in self.choices:
                raise ConfigurationError(
                    f"{self.key}: expected one of {', '.join(self.choices)}, found {raw!r}"
                )
            return text  # type: ignore[return-value]
        text = str(raw).strip()
        if not text:
            raise ConfigurationError(f"{self.key}: expected a non-empty string, found {raw!r}")
        return text  # type: ignore[return-value]


def _opt(key: str, type_name: str, default: Any, doc: str, **kw: Any) -> ConfigOption[Any]:
    field = key.removeprefix("spark.ckpt.").replace(".", "_")
    snake = "".join("_" + c.lower() if c.isupper() else c for c in field)
    return ConfigOption(key, snake, type_name, default, doc, **kw)


OPTIONS: tuple[ConfigOption[Any], ...] = (
    _opt(
        "spark.ckpt.workDir",
        "str",
        "spark-ckpt-work",
        "Root directory (any URI pyarrow understands) for event logs and durable result "
        "partitions; one sub-directory per job id.",
    ),
    _opt(
        "spark.ckpt.eventLog.flushIntervalMs",
        "int",
        1000,
        "Buffered job events are appended to the Delta event log at least this often.",
        minimum=10,
    ),
    _opt(
        "spark.ckpt.eventLog.flushMaxEvents",
        "int",
        500,
        "A buffer holding this many events is flushed at once, before the interval ends.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.eventLog.compactAtFiles",
        "int",
        100,
        "When the event log holds this many files under 16 MB after an append, the driver "
        "compacts them (a Delta OPTIMIZE, no data change), so appends and recovery's read do "
        "not slow down as a long job's log grows; 0: never.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.eventLog.writeRetries",
        "int",
        5,
        "A failed append to the event log is retried this many times (the events stay "
        "buffered) before the job fails with EventLogError.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.eventLog.retryBackoffMs",
        "int",
        200,
        "Wait before the first retry of a failed event-log append; doubled for each further "
        "retry, at most 10 s.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.batch.partitionsPerWave",
        "int",
        0,
        "Partitions of a vertex without a key run per Spark job (a wave); a wave's partitions "
        "share its files and become durable when it ends. 0 picks partitions / 4 (rounded up), "
        "partitions / 8 for partial aggregates and durable exchanges, whose two first waves are "
        "a quarter and a half of that (a job killed early keeps them); map-side partial "
        "aggregates, durable task by task, run in one job of up to 256 partitions.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.batch.cuts",
        "choice",
        "auto",
        "Where a batch job becomes durable for vertices declared without durable=: auto "
        "(cost-aware: wide intermediates chained, an aggregating consumer's partial aggregates "
        "durable; see BatchJob.explain), all (every such vertex durable), sinks (only vertices "
        "with sinks).",
        choices=("auto", "all", "sinks"),
    ),
    _opt(
        "spark.ckpt.batch.cutMaxPercent",
        "int",
        10,
        "auto cuts: a vertex's output (or its consumer's partial aggregates) is a durable cut "
        "when a sample split's output is at most this percent of its input's size; partials "
        "over it are estimated again per wave of splits, where groups recur across splits "
        "(see BatchJob.explain).",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.batch.exchangeCuts",
        "bool",
        True,
        "auto cuts: the split-by-split inputs of a vertex that joins them by its key are written "
        "per wave bucketed by the key into its partitions (Spark's exchange, made durable), so "
        "the join reads bucket j of each input without a shuffle. Needs a session catalog that "
        "can create bucketed Parquet tables; where it cannot, the inputs are chained.",
    ),
    _opt(
        "spark.ckpt.batch.mapSidePartials",
        "bool",
        True,
        "auto cuts: a wave of partial aggregates runs as Spark's map stage alone, one task per "
        "input split, each task writing its own partial aggregates (Spark's, cut from the "
        "physical plan), durable as the task commits; the consumer merges them once. Classic "
        "sessions, aggregates whose buffer is their result (count, sum, min, max, and what "
        "spark_ckpt splits into them); elsewhere a wave merges its partials bucketed by the "
        "consumer's key.",
    ),
    _opt(
        "spark.ckpt.batch.exchangeMinBytes",
        "int",
        8 << 20,
        "auto cuts: a durable exchange is made only when each of its files (one per wave of "
        "input splits and partition of the joining vertex) would hold at least this many "
        "bytes, estimated from its input's size on disk: smaller files cost more to write, "
        "list and read back than re-running the input does. 0: always.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.batch.serverCache",
        "bool",
        False,
        "Spark Connect only (opt-in: persisting costs a fresh run more than it saves a "
        "recovery on the repository's benchmark, docs/connect.md): a keyed vertex "
        "run whole keeps its output persisted on the server "
        "(DISK_ONLY) while it runs, and unpersists it when it ends. A client killed meanwhile "
        "leaves it, and with it the Spark shuffles that feed it, in the server's cache, which "
        "every session of the server shares: the next client's run of the vertex's missing "
        "partitions reads what the killed one had computed instead of reading and shuffling "
        "its inputs again, when its input files are the same (paths, sizes, modification "
        "times and object versions, as recovery compares them). Jobs whose sources are not "
        "files never persist. A speed-up only (the server may evict it); false: never "
        "persist.",
    ),
    _opt(
        "spark.ckpt.batch.adoptOperations",
        "bool",
        True,
        "Spark Connect only: the server runs a killed client's write operations on to their "
        "end. A driver records each run unit before it submits its writes (the operations' "
        "ids and the lineage of what they read, under the job's units/ directory); the "
        "next attempt waits for the writes a killed attempt left running (reattaching to "
        "them) when they read what it would read, and records the partitions their files "
        "complete instead of running them again. Writes that read anything else are "
        "interrupted. false: interrupt every write an earlier attempt left running.",
    ),
    _opt(
        "spark.ckpt.batch.adoptMaxWaitMs",
        "int",
        30 * 60 * 1000,
        "How long a driver waits in all for the writes an earlier attempt left running "
        "(spark.ckpt.batch.adoptOperations) before it interrupts them and runs what they "
        "had not finished itself (a job killed because a stage hung does not hang again).",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.batch.concurrentWaves",
        "int",
        2,
        "Waves of one vertex that may run at the same time (driver threads submitting jobs).",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.batch.pollIntervalMs",
        "int",
        300,
        "How often the driver looks for the files of partitions finished by running tasks.",
        minimum=10,
    ),
    _opt(
        "spark.ckpt.batch.cleanupOnSuccess",
        "bool",
        True,
        "Delete a job's durable result partitions once its sinks have committed.",
    ),
    _opt(
        "spark.ckpt.batch.onInputChanged",
        "choice",
        "rerun",
        "What a resubmitted batch job does with an input file rewritten since an earlier "
        "attempt recorded it (another size, modification time or object version): rerun (the "
        "splits that read it and everything downstream run again, on its current content) or "
        "fail (refused with InputChangedError naming the file, what was recorded and what was "
        "found; nothing runs). A removed input file is always refused.",
        choices=("rerun", "fail"),
    ),
    _opt(
        "spark.ckpt.stream.maxBatchesInFlight",
        "int",
        2,
        "Batches allocated but not yet finished; the JobGenerator waits while this many are "
        "queued or running (batches run one after another, in order).",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.stream.skipEmptyBatches",
        "bool",
        False,
        "Allocate no batch on a tick that found no new input (Structured Streaming's default); "
        "false keeps the DStream rhythm of one batch per interval, windows counting every tick.",
    ),
    _opt(
        "spark.ckpt.stream.minBatchesToRetain",
        "int",
        100,
        "Allocation, commit and driver-state records, and received blocks, kept for this many "
        "batches behind the last committed one (at least the longest window).",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.stream.stopPollIntervalMs",
        "int",
        1000,
        "A running driver looks this often for a stop request (spark-ckpt stop CKPT_DIR: "
        "finish the running batch, take a final checkpoint, commit, exit) in the checkpoint "
        "directory's control/ folder: one listing of that folder each time.",
        minimum=50,
    ),
    _opt(
        "spark.ckpt.stream.receiverBlockIntervalMs",
        "int",
        200,
        "A receiver writes what it got as one write-ahead-log block this often.",
        minimum=10,
    ),
    _opt(
        "spark.ckpt.stream.fileSource.maxFileAgeMs",
        "int",
        7 * 24 * 3600 * 1000,
        "A file source takes no file older than the newest file it took minus this age, and "
        "forgets the names of such files, so its state stays bounded (Spark's maxFileAge). A "
        "file moved in with an old modification time is ignored with a warning.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.stream.receiverMaxLineBytes",
        "int",
        1 << 20,
        "A socket receiver holds at most this many bytes of a line without a newline; longer "
        "lines are emitted in pieces of at most this size, cut between characters (nothing "
        "is dropped; a warning counts the cut lines).",
        minimum=4,
    ),
    _opt(
        "spark.ckpt.stream.receiverMaxBlockBytes",
        "int",
        8 << 20,
        "A receiver writes a block early once it holds this many bytes of lines, whatever "
        "receiverBlockIntervalMs says.",
        minimum=1024,
    ),
    _opt(
        "spark.ckpt.checkpoint.enabled",
        "choice",
        "auto",
        "Take barrier-aligned checkpoints in streaming pipelines: auto (when the pipeline has "
        "keyed state), true or false. Keyed state needs checkpoints.",
        choices=("auto", "true", "false"),
    ),
    _opt(
        "spark.ckpt.checkpoint.intervalMs",
        "int",
        10000,
        "Time between checkpoint triggers, independent of the batch interval; the barrier "
        "goes at once after the last finished batch (none is waited for). 0: only a final "
        "checkpoint on stop.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.checkpoint.minPauseMs",
        "int",
        0,
        "Least time from the end of one checkpoint to the trigger of the next.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.checkpoint.maxConcurrent",
        "int",
        1,
        "Checkpoints that may be pending at the same time.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.checkpoint.timeoutMs",
        "int",
        600000,
        "A checkpoint not complete this long after its trigger is aborted.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.checkpoint.tolerableFailures",
        "int",
        0,
        "Checkpoints that may fail in a row (timeout, storage error, decline) before the "
        "pipeline fails.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.checkpoint.retained",
        "int",
        3,
        "Completed checkpoints kept (restorable by id); older ones are discarded with the "
        "state files no retained checkpoint shares.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.checkpoint.historyRetained",
        "int",
        100,
        "Statistics records (checkpoints/history/<id>.json) kept for the newest checkpoints, "
        "completed or aborted; older ones are deleted so a long run's history stays bounded.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.checkpoint.mode",
        "choice",
        "exactly_once",
        "exactly_once: outputs commit in two phases when a checkpoint completes; "
        "at_least_once: outputs commit every batch (sooner visible; a replay after restore "
        "writes again unless the sink recognizes the batch).",
        choices=("exactly_once", "at_least_once"),
    ),
    _opt(
        "spark.ckpt.checkpoint.dir",
        "str",
        "",
        "Checkpoint storage (any URI pyarrow understands); empty: <checkpoint directory>/"
        "checkpoints.",
    ),
    _opt(
        "spark.ckpt.checkpoint.restoreFrom",
        "int",
        0,
        "Restore from this retained checkpoint id instead of the latest (0: the latest).",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.state.backend",
        "choice",
        "memory",
        "Where a task keeps its key groups' state: memory (fast, bounded by memoryMaxRows) or "
        "rocksdb (an embedded store on the executor's local disk, for state larger than "
        "memory). Durable state is the same for both.",
        choices=("memory", "rocksdb"),
    ),
    _opt(
        "spark.ckpt.state.parallelism",
        "int",
        0,
        "Tasks of a keyed operator (each owns a key-group range); 0: Spark's default "
        "parallelism. May change between runs (state is redistributed by key group).",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.state.maxParallelism",
        "int",
        128,
        "Key groups of a keyed operator: the most tasks it can ever have; fixed for the life "
        "of a checkpoint directory.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.state.memoryMaxRows",
        "int",
        10000000,
        "Keys one task may hold in the memory backend before it fails with a clear error.",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.state.materializeEvery",
        "int",
        10,
        "A task writes a full snapshot of its range once its chain has this many changelogs "
        "(restores then read one snapshot and a few changelogs).",
        minimum=1,
    ),
    _opt(
        "spark.ckpt.state.smallBatchBytes",
        "int",
        1048576,
        "Keyed aggregation: a batch whose input Spark estimates at most this many bytes, on a "
        "state of at most smallBatchMaxStateRows keys, runs in one Spark stage and one task "
        "that updates every key-group range in turn (no shuffle); 0: always one task per range.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.state.smallBatchMaxStateRows",
        "int",
        100000,
        "The most keys a keyed aggregation may hold for a small batch to run in one task.",
        minimum=0,
    ),
    _opt(
        "spark.ckpt.state.localSpill",
        "bool",
        True,
        "Memory backend: leave each range on the executor's local disk after a task, so the "
        "next task of the range loads it there when it runs in another Python worker of the "
        "same executor; false: such a task rebuilds the range from durable state.",
    ),
    _opt(
        "spark.ckpt.state.localDir",
        "str",
        "",
        "Local directory for the rocksdb backend's working copy; empty: the executor's "
        "SPARK_LOCAL_DIRS or the temporary directory.",
    ),
    _opt(
        "spark.ckpt.state.preferLocations",
        "bool",
        True,
        "Run each key-group range's task on the executor where it last ran (its state "
        "there, in a Python worker or on local disk), as Structured Streaming's state store "
        "coordinator does, through the jar the package ships; needs "
        "spark.locality.wait.process above 0 (Spark's default 3s). False, on Spark Connect "
        "or without the jar: Spark places the tasks, and a range that moves is rebuilt from "
        "durable state.",
    ),
    _opt(
        "spark.ckpt.progress",
        "choice",
        "auto",
        "Show a progress display: always, never, or auto (when stderr is a terminal).",
        choices=("auto", "always", "never"),
    ),
    _opt(
        "spark.ckpt.storage.conditionalWrites",
        "choice",
        "auto",
        "Create-if-absent on S3 (checkpoint metadata, run and attempt numbers, commit markers) "
        "is a conditional PUT; auto falls back to check-then-write with a warning where the "
        "store or client cannot make one, required fails instead. S3 endpoint and credentials "
        "come from spark.hadoop.fs.s3a.* (docs/object-stores.md).",
        choices=("auto", "required"),
    ),
)

_BY_KEY = {o.key: o for o in OPTIONS}
_BY_FIELD = {o.field: o for o in OPTIONS}
_ANNOTATION = {"int": "int", "bool": "bool", "str": "str", "choice": "str"}

#: The default of a field of :class:`Settings` or ``CheckpointConfig``: its option's, read from
#: :data:`OPTIONS` by :func:`defaults_from_options` (typed ``Any`` so that type checkers accept
#: it for any field and know the field has a default).
FROM_OPTIONS: Any = object()


def defaults_from_options(prefix: str = "", *, every: bool = False) -> Callable[[C], C]:
    """A class decorator, placed under ``@dataclasses.dataclass``: each field declared
    ``name: type = FROM_OPTIONS`` gets the default of the option whose :class:`Settings` field
    is ``prefix + name``, from :data:`OPTIONS`, before the dataclass is made.

    Args:
        prefix: what the options' field names start with and the class's fields leave out
            (``"checkpoint_"``: ``interval_ms`` is ``spark.ckpt.checkpoint.intervalMs``).
        every: the fields must be every option of :data:`OPTIONS`, in its order.

    Raises:
        InternalError: at import, when a field names no option, is annotated with another
            type, declares a default of its own, or (``every``) an option has no field.
    """

    def apply(cls: C) -> C:
        declared: dict[str, Any] = dict(cls.__dict__.get("__annotations__", {}))
        for name, annotation in declared.items():
            option = _BY_FIELD.get(prefix + name)
            where = f"{cls.__name__}.{name}"
            if option is None:
                raise InternalError(f"{where}: expected an option with field {prefix + name} "
                                    "in OPTIONS, found none")
            written = annotation if isinstance(annotation, str) else annotation.__name__
            if written != _ANNOTATION[option.type_name]:
                raise InternalError(f"{where}: expected the type {_ANNOTATION[option.type_name]}"
                                    f" of {option.key}, found {written}")
            if cls.__dict__.get(name) is not FROM_OPTIONS:
                raise InternalError(f"{where}: expected = FROM_OPTIONS (the default is "
                                    f"{option.key}'s), found {cls.__dict__.get(name)!r}")
            setattr(cls, name, option.default)
        if every and [prefix + n for n in declared] != [o.field for o in OPTIONS]:
            raise InternalError(f"{cls.__name__}: expected a field for every option in the "
                                f"order of OPTIONS, found {list(declared)}")
        return cls

    return apply


class _RuntimeConf(Protocol):
    """A SparkSession's ``spark.conf`` (classic or Connect): read one key."""

    def get(self, key: str, default: Any = ..., /) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
@defaults_from_options(every=True)
class Settings:
    """Validated, immutable ``spark.ckpt.*`` settings. Build with :meth:`from_conf`, or with
    keywords (``Settings(progress="never")``). One field per option of :data:`OPTIONS`, in its
    order, named by :attr:`ConfigOption.field`; every default is the option's."""

    work_dir: str = FROM_OPTIONS
    event_log_flush_interval_ms: int = FROM_OPTIONS
    event_log_flush_max_events: int = FROM_OPTIONS
    event_log_compact_at_files: int = FROM_OPTIONS
    event_log_write_retries: int = FROM_OPTIONS
    event_log_retry_backoff_ms: int = FROM_OPTIONS
    batch_partitions_per_wave: int = FROM_OPTIONS
    batch_cuts: str = FROM_OPTIONS
    batch_cut_max_percent: int = FROM_OPTIONS
    batch_exchange_cuts: bool = FROM_OPTIONS
    batch_map_side_partials: bool = FROM_OPTIONS
    batch_exchange_min_bytes: int = FROM_OPTIONS
    batch_server_cache: bool = FROM_OPTIONS
    batch_adopt_operations: bool = FROM_OPTIONS
    batch_adopt_max_wait_ms: int = FROM_OPTIONS
    batch_concurrent_waves: int = FROM_OPTIONS
    batch_poll_interval_ms: int = FROM_OPTIONS
    batch_cleanup_on_success: bool = FROM_OPTIONS
    batch_on_input_changed: str = FROM_OPTIONS
    stream_max_batches_in_flight: int = FROM_OPTIONS
    stream_skip_empty_batches: bool = FROM_OPTIONS
    stream_min_batches_to_retain: int = FROM_OPTIONS
    stream_stop_poll_interval_ms: int = FROM_OPTIONS
    stream_receiver_block_interval_ms: int = FROM_OPTIONS
    stream_file_source_max_file_age_ms: int = FROM_OPTIONS
    stream_receiver_max_line_bytes: int = FROM_OPTIONS
    stream_receiver_max_block_bytes: int = FROM_OPTIONS
    checkpoint_enabled: str = FROM_OPTIONS
    checkpoint_interval_ms: int = FROM_OPTIONS
    checkpoint_min_pause_ms: int = FROM_OPTIONS
    checkpoint_max_concurrent: int = FROM_OPTIONS
    checkpoint_timeout_ms: int = FROM_OPTIONS
    checkpoint_tolerable_failures: int = FROM_OPTIONS
    checkpoint_retained: int = FROM_OPTIONS
    checkpoint_history_retained: int = FROM_OPTIONS
    checkpoint_mode: str = FROM_OPTIONS
    checkpoint_dir: str = FROM_OPTIONS
    checkpoint_restore_from: int = FROM_OPTIONS
    state_backend: str = FROM_OPTIONS
    state_parallelism: int = FROM_OPTIONS
    state_max_parallelism: int = FROM_OPTIONS
    state_memory_max_rows: int = FROM_OPTIONS
    state_materialize_every: int = FROM_OPTIONS
    state_small_batch_bytes: int = FROM_OPTIONS
    state_small_batch_max_state_rows: int = FROM_OPTIONS
    state_local_spill: bool = FROM_OPTIONS
    state_local_dir: str = FROM_OPTIONS
    state_prefer_locations: bool = FROM_OPTIONS
    progress: str = FROM_OPTIONS
    storage_conditional_writes: str = FROM_OPTIONS

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any] | Callable[[str], Any] | _RuntimeConf | None
                  = None, **overrides: Any) -> Settings:
        """Read every declared key from ``conf`` and apply keyword ``overrides``.

        Args:
            conf: a mapping of key to raw value, a ``get(key)`` callable returning None when
                unset, or a SparkSession's ``spark.conf`` (anything with ``get``).
            overrides: field names of :class:`Settings` with already-typed values.

        Raises:
            ConfigurationError: an unknown ``spark.ckpt.`` key in a mapping, or a bad value.
        """
        values: dict[str, Any] = {}
        if isinstance(conf, Mapping):
            for key in conf:
                if key.startswith("spark.ckpt.") and key not in _BY_KEY:
                    raise ConfigurationError(
                        f"unknown option {key}: expected one of the declared spark.ckpt.* "
                        f"keys{_closest(key)} (see docs/configuration.md)"
                    )
            getter: Callable[[str], Any] = conf.get
        elif conf is None:
            getter = lambda _k: None  # noqa: E731
        elif hasattr(conf, "get"):
            runtime = conf
            every = _listing(runtime)
            _warn_unknown([k for k in every or {}
                           if isinstance(k, str) and k.startswith("spark.ckpt.")])
            from spark_ckpt.session import is_connect

            if every is not None and is_connect(runtime):
                getter = every.get  # one round trip to the server, not one per option
            else:
                def getter(key: str) -> Any:
                    return runtime.get(key, None)
        else:
            getter = conf
        for option in OPTIONS:
            raw = getter(option.key)
            if raw is not None:
                values[option.field] = option.parse(raw)
        fields = {f.name for f in dataclasses.fields(cls)}
        for name, value in overrides.items():
            if name not in fields:
                raise ConfigurationError(f"unknown setting {name!r}; known: {sorted(fields)}")
            values[name] = value
        return cls(**values)


_warned: set[str] = set()


def _closest(key: str) -> str:
    import difflib

    match = difflib.get_close_matches(key, list(_BY_KEY), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def _listing(conf: Any) -> dict[Any, Any] | None:
    """Every key set in a session's runtime conf (one call), if it can list them."""
    try:
        listed = conf.getAll  # PySpark 4: a property holding every set key
        return dict(listed() if callable(listed) else listed)
    except Exception:  # noqa: BLE001 - an older or foreign conf object: nothing to check
        return None


def _warn_unknown(keys: list[str]) -> None:
    """Warn once per process about each unknown ``spark.ckpt.*`` key (a typo is silently
    ignored by Spark, so this is the only place it can be noticed)."""
    import logging

    for key in keys:
        if key not in _BY_KEY and key not in _warned:
            _warned.add(key)
            logging.getLogger(__name__).warning(
                "Unknown option %s is ignored: expected a declared spark.ckpt.* key%s",
                key, _closest(key))


def render_markdown() -> str:
    """The body of ``docs/configuration.md``, generated from :data:`OPTIONS`."""
    lines = [
        "# Configuration",
        "",
        "Generated by `python -m spark_ckpt.options > docs/configuration.md`; do not edit.",
        "",
        "Every option is a Spark conf key: set it in `spark-defaults.conf`, with",
        "`spark-submit --conf`, or with `spark.conf.set` in a notebook before the job runs.",
        "",
        "| key | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for o in OPTIONS:
        type_name = "one of " + ", ".join(o.choices) if o.type_name == "choice" else o.type_name
        default = str(o.default).lower() if isinstance(o.default, bool) else o.default
        lines.append(f"| `{o.key}` | {type_name} | `{default}` | {o.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
