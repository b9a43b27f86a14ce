"""Sources of a batch job: where partition *i* of a source vertex gets its rows.

* :class:`FileSource` reads files exactly as ``spark.read.format(f).options(...).load(path)``
  does: Spark's own reader, every option the user passes, Spark's rules for which files a
  directory holds (hidden ``_``/``.`` names skipped, ``pathGlobFilter``, partition directories
  as columns). Its files are cut into ``parallelism`` contiguous splits in a stable order; the
  split assignment, what identified each file (size, modification time, object version:
  batch.file_identity) and the schema are the vertex coordinator's state, recorded in
  ``JobVertexInitialized`` so a recovered attempt reads exactly the files the first one read,
  with the same schema, even when new files arrived since, and knows which were rewritten.
  Re-running split *i* reads only its files, still with Spark's reader.
* :class:`DataFrameSource` wraps any DataFrame a user can build (JDBC, tables, ``range``). Its
  rows are split by ``pmod(hash(split_by), parallelism)``; re-running any of its partitions reads
  the whole DataFrame once (Spark cannot read a hash bucket of an arbitrary plan alone).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from spark_ckpt.errors import InputChangedError, JobDefinitionError, SourceError
from spark_ckpt.sources.file_identity import FileIdentity, identify
from spark_ckpt.sparkapi import empty_frame
from spark_ckpt.storage import Storage, stat_any

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    from pyspark.sql import DataFrame, DataFrameReader, SparkSession
    from pyspark.sql.types import StructType

__all__ = ["DataFrameSource", "FileSource", "Split", "decode_files", "decode_splits",
           "encode_splits", "normalize_path"]

log = logging.getLogger(__name__)

FileFormat = Literal["parquet", "csv", "json", "text", "orc"]

Split = list[tuple[str, int]]  # (path, size) of each file


def normalize_path(path: str) -> str:
    """One spelling per file: Spark's ``file:/x`` URIs and local ``/x`` paths compare equal."""
    path = urllib.parse.unquote(path)
    if path.startswith("file:"):
        path = "/" + path[len("file:"):].lstrip("/")
    return path


def _hidden(name: str) -> bool:
    """Spark's InMemoryFileIndex rule for names it never reads."""
    return ((name.startswith("_") and "=" not in name) or name.startswith(".")
            or name.endswith("._COPYING_"))


@dataclasses.dataclass(eq=False)
class FileSource:
    path: str
    format: FileFormat = "parquet"
    options: dict[str, str] = dataclasses.field(default_factory=dict)
    schema: StructType | str | None = None
    replayable = True

    def describe(self) -> dict[str, Any]:
        schema = self.schema if isinstance(self.schema, str | None) else self.schema.json()
        return {"kind": "files", "path": self.path, "format": self.format,
                "options": dict(sorted(self.options.items())), "schema": schema}

    # -- listing ---------------------------------------------------------------------------
    def _listed(self, *, missing_ok: bool = False) -> tuple[Storage, list[pafs.FileInfo]]:
        """The files Spark's reader would read, as storage lists them (no Spark needed)."""
        store = Storage(self.path)
        if not store.exists(store.root):
            if missing_ok:
                return store, []
            raise JobDefinitionError(f"file source {self.path}: expected a file or directory, "
                                     "found nothing at that path")
        info = store.fs.get_file_info(store.root)
        if info.type.name == "File":
            return store, [info]
        glob = self._option("pathGlobFilter")
        files = []
        for i in store.list_files(store.root):
            parts = [p for p in i.path[len(store.root):].split("/") if p]
            if any(_hidden(p) for p in parts):
                continue
            if glob and not fnmatch.fnmatchcase(parts[-1], glob):
                continue
            files.append(i)
        return store, files

    def list_files(self) -> list[tuple[str, int]]:
        """The files Spark's reader would read, sorted, with their sizes (no Spark needed).

        The run checks this list against Spark's own ``inputFiles()`` before reading.
        """
        store, infos = self._listed()
        return sorted((store.spark_path(i.path), i.size) for i in infos)

    def identify(self, *, only: set[str] | None = None, versions: bool = True,
                 missing_ok: bool = False) -> dict[str, FileIdentity]:
        """The files Spark's reader would read (those of ``only``, if given) by path, with
        what identifies their content now (batch.file_identity); ``versions``: ask an object
        store for each object's version."""
        store, infos = self._listed(missing_ok=missing_ok)
        named = [(store.spark_path(i.path), i) for i in infos]
        if only is not None:
            named = [(p, i) for p, i in named if p in only]
        found = identify(store.fs, [i for _, i in named], versions=versions)
        return {p: f for (p, _), f in zip(named, found, strict=True)}

    def _option(self, name: str) -> str | None:
        for key, value in self.options.items():
            if key.lower() == name.lower():
                return str(value)
        return None

    def is_directory(self) -> bool:
        store = Storage(self.path)
        return store.fs.get_file_info(store.root).type.name == "Directory"

    def discover(self, parallelism: int | None,
                 files: dict[str, FileIdentity] | None = None) -> list[Split]:
        """Cut the input files (listed now, or ``files`` as :meth:`identify` found them) in a
        stable order into contiguous splits."""
        listed = self.list_files() if files is None else \
            sorted((p, f.size) for p, f in files.items())
        if not listed:
            raise JobDefinitionError(
                f"file source {self.path}: expected {self.format} files, found none (Spark "
                "skips names starting with '_' or '.')"
            )
        count = min(parallelism or len(listed), len(listed))
        return [listed[i * len(listed) // count:(i + 1) * len(listed) // count]
                for i in range(count)]

    # -- reading with Spark ----------------------------------------------------------------
    def reader(self, spark: SparkSession) -> DataFrameReader:
        reader = spark.read.format(self.format).options(**self.options)
        if self.schema is not None:
            reader = reader.schema(self.schema)
        return reader

    def resolve(self, spark: SparkSession, vertex_id: str,
                splits: list[Split]) -> StructType:
        """Read the whole source as ``spark.read`` does; check it reads the files of
        ``splits`` and no other; return its schema (inferred by Spark if not given)."""
        df = self.reader(spark).load(self.path)
        spark_files = sorted(normalize_path(f) for f in df.inputFiles())
        ours = sorted(normalize_path(p) for split in splits for p, _ in split)
        if spark_files != ours:
            extra = sorted(set(spark_files) - set(ours))[:3]
            missing = sorted(set(ours) - set(spark_files))[:3]
            raise InputChangedError(
                f"source vertex {vertex_id}: expected Spark to read the {len(ours)} files the "
                f"job recorded under {self.path}, found {len(spark_files)} (not recorded: "
                f"{extra or 'none'}; recorded but not read: {missing or 'none'}). New or "
                "removed input files: run with fresh=True or a new run key to read them."
            )
        if self.format == "parquet" and self.schema is None and \
                not merge_schema(spark, self.options):
            from pyspark.sql.types import StructType

            files = [(p, size) for split in splits for p, size in split]
            sensitive = case_sensitive(spark)
            base = self._option("basePath")  # partition directories start below it
            store = Storage(base if base is not None else self.path)
            root = normalize_path(store.spark_path(store.root)).rstrip("/") + "/"
            partitions = {_fold(seg.split("=", 1)[0], sensitive) for p, _ in files
                          for seg in normalize_path(p).removeprefix(root).split("/")[:-1]
                          if "=" in seg and normalize_path(p).startswith(root)}
            data = StructType([f for f in df.schema.fields
                               if _fold(f.name, sensitive) not in partitions])
            check_parquet_schemas(f"source vertex {vertex_id}", Storage(self.path), files,
                                  data, "inferred by Spark from one file",
                                  case_sensitive=sensitive)
        return df.schema

    def read(self, spark: SparkSession, schema: StructType, files: list[str]) -> DataFrame:
        """The rows of ``files`` exactly as the whole source's read gives them. A file listed
        by this run but gone now fails clearly (with ``ignoreMissingFiles``, Spark's answer:
        it is skipped), where Spark's own read of explicit paths would fail on any of them."""
        missing = [f for f, size in zip(files, stat_any(files), strict=True) if size is None]
        if missing:
            if not ignore_missing_files(spark, self.options):
                raise InputChangedError(
                    f"file source {self.path}: input file {missing[0]} was listed by this run "
                    f"but is missing now ({len(missing)} missing file(s)); nothing was read "
                    "from the source's splits that hold them. Restore the file, or set "
                    "spark.sql.files.ignoreMissingFiles=true to skip missing files as Spark does"
                )
            log.warning("File source %s: skipping %d missing input file(s) (e.g. %s): "
                        "spark.sql.files.ignoreMissingFiles=true", self.path, len(missing),
                        missing[0])
            files = [f for f in files if f not in set(missing)]
            if not files:
                return empty_frame(spark, schema)
        reader = spark.read.format(self.format).options(**self.options).schema(schema)
        if self.is_directory() and self._option("basePath") is None:
            reader = reader.option("basePath", self.path)  # keep partition columns
        return reader.load(files)

    def changed_splits(self, vertex_id: str, splits: list[Split],
                       files: dict[str, FileIdentity], *, refuse: bool = False) -> set[int]:
        """Before re-reading recorded splits: the splits whose files were rewritten since
        ``files`` recorded them (another size, modification time or object version), their
        entries in ``splits`` and ``files`` updated in place to what was found. A record
        lacking a field (written before event format 2) takes it from an unchanged file.

        Raises:
            InputChangedError: a recorded file is missing (it cannot be read again), or one
                was rewritten and ``refuse`` (spark.ckpt.batch.onInputChanged=fail).
        """
        recorded = [(j, k, path, files.get(path) or FileIdentity(size))
                    for j, split in enumerate(splits) for k, (path, size) in enumerate(split)]
        # an object store is asked for versions only where a record holds one, or lacks a
        # time (a record to complete): an unversioned store is not asked on every resubmission
        versions = any(r.version is not None or r.mtime_ns is None for *_, r in recorded)
        found = self.identify(only={path for _, _, path, _ in recorded}, versions=versions,
                              missing_ok=True)
        rewritten = []
        for j, k, path, was in recorded:
            now = found.get(path)
            if now is None:
                raise InputChangedError(
                    f"source vertex {vertex_id}: input file {path} was {was.size} bytes when "
                    f"the job first read it, found missing. The job's input changed; run it "
                    f"again with fresh=True or a new run key to start over."
                )
            what = was.changes(now)
            if what:
                rewritten.append((j, k, path, was, now, what))
            else:
                files[path] = was.completed(now)
        if rewritten and refuse:
            _, _, path, was, now, what = rewritten[0]
            raise InputChangedError(
                f"source vertex {vertex_id}: input file {path} was rewritten since an earlier "
                f"attempt recorded it ({' and '.join(what)} changed): recorded {was.describe()}; "
                f"found {now.describe()} ({len(rewritten)} rewritten file(s) in this source). "
                "Nothing ran: spark.ckpt.batch.onInputChanged=fail refuses to recover from "
                "changed input. Restore the file, set spark.ckpt.batch.onInputChanged=rerun to "
                "run again what read it and everything downstream, or start over with "
                "fresh=True or a new run key."
            )
        changed: set[int] = set()
        for j, k, path, was, now, what in rewritten:
            log.warning("Source vertex %s: input file %s was rewritten since it was recorded "
                        "(%s changed: recorded %s; found %s); split %d runs again", vertex_id,
                        path, " and ".join(what), was.describe(), now.describe(), j)
            splits[j][k] = (path, now.size)
            files[path] = now
            changed.add(j)
        return changed


@dataclasses.dataclass(eq=False)
class DataFrameSource:
    build: Callable[[SparkSession], DataFrame]
    split_by: tuple[str, ...] = ()
    label: str = ""
    replayable = False

    def describe(self) -> dict[str, Any]:
        return {"kind": "dataframe", "label": self.label, "split_by": list(self.split_by)}


def _conf_or_option(spark: SparkSession | None, options: dict[str, str], option: str,
                    conf: str) -> bool:
    """Spark's rule for a reader flag: the option (any case of its name), else the session's
    conf (false without a session)."""
    for key, value in options.items():
        if key.lower() == option.lower():
            return str(value).lower() == "true"
    return spark is not None and str(spark.conf.get(conf, "false")).lower() == "true"


def ignore_missing_files(spark: SparkSession | None, options: dict[str, str]) -> bool:
    """Spark's rule: the ``ignoreMissingFiles`` option, else spark.sql.files.ignoreMissingFiles."""
    return _conf_or_option(spark, options, "ignoreMissingFiles",
                           "spark.sql.files.ignoreMissingFiles")


def merge_schema(spark: SparkSession | None, options: dict[str, str]) -> bool:
    """Spark's rule: the ``mergeSchema`` option, else spark.sql.parquet.mergeSchema."""
    return _conf_or_option(spark, options, "mergeSchema", "spark.sql.parquet.mergeSchema")


def case_sensitive(spark: SparkSession | None) -> bool:
    """spark.sql.caseSensitive (false by default: a file's column matches in either case)."""
    if spark is None:
        return False
    return str(spark.conf.get("spark.sql.caseSensitive", "false")).lower() == "true"


def _fold(name: str, sensitive: bool) -> str:
    return name if sensitive else name.lower()


# Conversions Spark's Parquet reader makes without loss (type widening); any other difference
# between a file's column and the schema fails when Spark reads the file.
_WIDER = {("byte", "short"), ("byte", "integer"), ("byte", "long"), ("short", "integer"),
          ("short", "long"), ("integer", "long"), ("float", "double"), ("byte", "double"),
          ("short", "double"), ("integer", "double"), ("date", "timestamp_ntz")}


def _type_drift(a: Any, b: Any, *, lenient: bool, sensitive: bool) -> bool:
    """Whether Spark cannot read a file's type ``a`` as ``b``. Nullability is not compared at
    any depth (Spark reads every file column as nullable); struct fields match by name as
    top-level columns do, with the same ``lenient`` rule for added and missing fields."""
    from pyspark.sql.types import ArrayType, DecimalType, MapType, StructType

    if isinstance(a, StructType) and isinstance(b, StructType):
        return _struct_drift(a, b, lenient=lenient, sensitive=sensitive) is not None
    if isinstance(a, ArrayType) and isinstance(b, ArrayType):
        return _type_drift(a.elementType, b.elementType, lenient=lenient, sensitive=sensitive)
    if isinstance(a, MapType) and isinstance(b, MapType):
        return _type_drift(a.keyType, b.keyType, lenient=lenient, sensitive=sensitive) or \
            _type_drift(a.valueType, b.valueType, lenient=lenient, sensitive=sensitive)
    if a == b or (a.typeName(), b.typeName()) in _WIDER:
        return False
    return not (isinstance(a, DecimalType) and isinstance(b, DecimalType) and b.scale >= a.scale
                and b.precision - b.scale >= a.precision - a.scale)


def _struct_drift(found: StructType, expected: StructType, *, lenient: bool, sensitive: bool,
                  unknown: frozenset[str] = frozenset()) -> str | None:
    have: dict[str, Any] = {}
    for f in found.fields:
        have.setdefault(_fold(f.name, sensitive), f)
    skip = {_fold(n, sensitive) for n in unknown}
    for field in expected.fields:
        key = _fold(field.name, sensitive)
        if key in skip:  # a type this check cannot convert: Spark decides
            continue
        got = have.get(key)
        if got is None:
            if not lenient or not field.nullable:
                return f"column {field.name} is missing (renamed or removed?)"
            continue
        if _type_drift(got.dataType, field.dataType, lenient=lenient, sensitive=sensitive):
            return (f"column {field.name} is {got.dataType.simpleString()}, expected "
                    f"{field.dataType.simpleString()}")
    if not lenient:
        names = {_fold(n, sensitive) for n in expected.names}
        added = [n for n in [*found.names, *sorted(unknown)] if _fold(n, sensitive) not in names]
        if added:
            return f"column(s) {added} added"
    return None


def parquet_drift(found: StructType, expected: StructType, *, lenient: bool,
                  case_sensitive: bool = False, unknown: frozenset[str] = frozenset()
                  ) -> str | None:
    """How a Parquet file's schema differs from ``expected`` in a way that matters, or None.
    ``lenient`` (a declared schema, or mergeSchema): columns added to the file are ignored and
    nullable columns missing from it read as null, as Spark reads them; otherwise either is
    drift. A changed type is drift unless Spark widens it losslessly; nullability is never
    drift. Names match in either case unless ``case_sensitive`` (spark.sql.caseSensitive).
    ``unknown``: the file's columns whose types this check cannot convert (left to Spark)."""
    return _struct_drift(found, expected, lenient=lenient, sensitive=case_sensitive,
                         unknown=unknown)


def _int96_as_timestamp(typ: Any, physical: Any) -> Any:
    """``typ`` (an Arrow type of a footer column) with the leaves stored as INT96 (pyarrow reads
    them as timestamps without a zone) made UTC timestamps, Spark's TIMESTAMP for INT96.
    ``physical`` iterates the Parquet leaf columns' physical types in order."""
    import pyarrow as pa

    if pa.types.is_struct(typ):
        fields = [typ.field(i) for i in range(typ.num_fields)]
        new = [f.with_type(_int96_as_timestamp(f.type, physical)) for f in fields]
        return pa.struct(new) if new != fields else typ
    if pa.types.is_map(typ):
        key = typ.key_field.with_type(_int96_as_timestamp(typ.key_type, physical))
        item = typ.item_field.with_type(_int96_as_timestamp(typ.item_type, physical))
        return pa.map_(key, item) if (key, item) != (typ.key_field, typ.item_field) else typ
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or \
            pa.types.is_fixed_size_list(typ):
        value = typ.value_field.with_type(_int96_as_timestamp(typ.value_type, physical))
        if value == typ.value_field:
            return typ
        if pa.types.is_fixed_size_list(typ):
            return pa.list_(value, typ.list_size)
        return pa.large_list(value) if pa.types.is_large_list(typ) else pa.list_(value)
    if next(physical, None) == "INT96" and pa.types.is_timestamp(typ) and typ.tz is None:
        return pa.timestamp(typ.unit, tz="UTC")
    return typ


def footer_schema(meta: Any) -> tuple[StructType, frozenset[str]]:
    """The Spark schema of a Parquet file's footer (``pyarrow.parquet.FileMetaData``) as Spark
    reads the file: INT96 timestamps as TIMESTAMP; and the names of the columns whose types
    do not convert here (unsigned integers, ...), which only Spark can judge."""
    import pyarrow as pa
    from pyspark.sql.types import StructType

    from spark_ckpt.arrowtypes import to_spark

    schema = meta.schema
    physical = iter([schema.column(i).physical_type for i in range(len(schema))])
    fields, unknown = [], set()
    for field in schema.to_arrow_schema():
        field = field.with_type(_int96_as_timestamp(field.type, physical))
        try:
            fields.extend(to_spark(pa.schema([field])).fields)
        except Exception:  # noqa: BLE001 - any type pyspark cannot map
            unknown.add(field.name)
    return StructType(fields), frozenset(unknown)


def check_parquet_schemas(what: str, store: Storage, files: list[tuple[str, int]],
                          expected: StructType, origin: str, *, lenient: bool = False,
                          case_sensitive: bool = False) -> None:
    """Read each file's footer; a file whose schema drifted from ``expected`` is refused with a
    SourceError naming it, the expected schema and the found one. Empty (0-byte) files are
    skipped, as Spark skips them."""
    import pyarrow.parquet as pq

    for path, size in files:
        if size == 0:
            continue
        try:
            found, unknown = footer_schema(pq.read_metadata(store.fs_path(path),
                                                            filesystem=store.fs))
        except Exception as exc:
            raise SourceError(f"{what}: expected a Parquet file, cannot read {path}: {exc}") \
                from exc
        drift = parquet_drift(found, expected, lenient=lenient, case_sensitive=case_sensitive,
                              unknown=unknown)
        if drift:
            raise SourceError(
                f"{what}: {path} does not match the schema ({drift}): expected "
                f"{expected.simpleString()} ({origin}), found {found.simpleString()}. Nothing "
                "was read from it: move the file out (or fix it), or say how to read it: "
                "schema= (missing columns read as null, extra ones are ignored) or the option "
                "mergeSchema=true"
            )


def encode_splits(splits: list[Split], files: dict[str, FileIdentity]) -> list[list[list[Any]]]:
    """A file source's splits as ``JobVertexInitialized`` records them (event format 2):
    ``[path, size, mtime_ns, version]`` for each file of each split, None where unknown."""
    out = []
    for split in splits:
        entries = []
        for path, size in split:
            found = files.get(path) or FileIdentity(size)
            entries.append([path, size, found.mtime_ns, found.version])
        out.append(entries)
    return out


def decode_splits(data: Any) -> list[Split]:
    """The (path, size) of each file of each recorded split."""
    return [[(str(f[0]), int(f[1])) for f in s] for s in data]


def decode_files(data: Any) -> dict[str, FileIdentity]:
    """What identified each recorded file when it was recorded (see :func:`encode_splits`)."""
    files = {}
    for split in data:
        for path, size, mtime_ns, version in split:
            files[str(path)] = FileIdentity(
                int(size), None if mtime_ns is None else int(mtime_ns),
                None if version is None else str(version))
    return files
