"""The SparkSession spark_ckpt runs on: the active one in notebooks, else one from defaults.

The library never creates a second session. Under ``spark-submit`` it takes the session
spark-submit configured. Run as a plain ``python`` script it builds one from a
``spark-defaults.conf`` (the argument, ``$SPARK_CKPT_DEFAULTS``, or ``./spark-defaults.conf``),
with the quiet log4j2 configuration from ``conf/`` beside that file when there is one. With
``SPARK_REMOTE`` (or ``spark.remote`` in ``conf``) set it connects to that Spark Connect server
instead; the server keeps its own configuration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from spark_ckpt.errors import ConfigurationError
from spark_ckpt.javacheck import check_java

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["get_or_create_session", "is_connect", "read_defaults", "session_conf"]

log = logging.getLogger(__name__)

# Used when no defaults file is found, so `python job.py` works from any directory.
EMBEDDED_DEFAULTS: dict[str, str] = {
    "spark.master": "local[*]",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}


# What a Spark Connect client may set on its session (the rest belongs to the server).
SESSION_PREFIXES = ("spark.ckpt.", "spark.sql.")
STATIC_SQL = frozenset({"spark.sql.warehouse.dir", "spark.sql.catalogImplementation",
                        "spark.sql.extensions", "spark.sql.catalog.spark_catalog"})


def is_connect(obj: object) -> bool:
    """True for a Spark Connect session, DataFrame or runtime conf (their classes live in
    ``pyspark.sql.connect``)."""
    return type(obj).__module__.startswith("pyspark.sql.connect")


def read_defaults(path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse a ``spark-defaults.conf``: ``key value`` per line, ``#`` comments."""
    conf: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2:
            raise ConfigurationError(
                f"{path}:{number}: expected 'key value', found {line!r}"
            )
        conf[parts[0]] = parts[1].strip()
    return conf


def _find_defaults(explicit: str | os.PathLike[str] | None) -> Path | None:
    for candidate in (explicit, os.environ.get("SPARK_CKPT_DEFAULTS"), "spark-defaults.conf"):
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    if explicit:
        raise ConfigurationError(f"defaults file {explicit} does not exist")
    return None


def get_or_create_session(
    app_name: str = "spark_ckpt",
    *,
    defaults: str | os.PathLike[str] | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """Return the active SparkSession, or build one from the defaults file plus ``conf``."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:  # a notebook's or shell's session, classic or Spark Connect
        return active
    remote = (conf or {}).get("spark.remote") or os.environ.get("SPARK_REMOTE")
    if remote:
        # A Spark Connect client: the server has its own master, memory and UI; of the
        # defaults file only the session's own settings apply (spark.ckpt.*, spark.sql.*).
        path = _find_defaults(defaults)
        settings = {k: v for k, v in (read_defaults(path) if path else {}).items()
                    if k.startswith(SESSION_PREFIXES) and k not in STATIC_SQL}
        settings.update((k, v) for k, v in (conf or {}).items() if k != "spark.remote")
        builder = SparkSession.builder.remote(remote)
        for key, value in settings.items():
            builder = builder.config(key, value)
        log.info("Connecting to Spark Connect at %s (defaults: %s)", remote, path or "none")
        return builder.getOrCreate()
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        # Launched by spark-submit (or a notebook kernel with a gateway): it configured the
        # JVM already; defaults here would override its --master and --properties-file.
        builder = SparkSession.builder.appName(app_name)
        for key, value in (conf or {}).items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    check_java()
    # Python workers must run this interpreter, or they cannot import pyarrow and spark_ckpt.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    settings = dict(EMBEDDED_DEFAULTS)
    path = _find_defaults(defaults)
    if path is not None:
        settings.update(read_defaults(path))
        log4j = path.parent / "conf" / "log4j2.properties"
        if log4j.is_file() and "spark.driver.extraJavaOptions" not in settings:
            settings["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile=file:{log4j}"
    settings.update(conf or {})
    _add_locality_jar(settings)
    builder = SparkSession.builder.appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    log.info("Starting SparkSession %s (defaults: %s)", app_name, path or "embedded")
    return builder.getOrCreate()


def _add_locality_jar(settings: dict[str, str]) -> None:
    """spark_ckpt's jar (spark_ckpt.jvm) on the new session's ``spark.jars``: the driver's
    class path and every executor's, for stateful tasks' preferred locations."""
    from spark_ckpt.jvm import jar_path

    jar = jar_path()
    if jar is None:
        return
    jars = [j for j in settings.get("spark.jars", "").split(",") if j.strip()]
    if not any(j.strip().endswith(jar.name) for j in jars):
        settings["spark.jars"] = ",".join([*jars, str(jar)])


@contextlib.contextmanager
def session_conf(spark: SparkSession, key: str, value: str, *,
                 enough: Callable[[str], bool] = lambda before: False,
                 required: bool = True) -> Iterator[None]:
    """``key`` set to ``value`` in ``spark``'s session for the block, then as it was (unset
    if it was); left alone when its value already does (``enough``). Not ``required``: a
    session that refuses the key (a server may) keeps its own, logged, and a failed restore
    is logged too."""
    try:
        before = spark.conf.get(key, None)
        changed = before is None or not (before == value or enough(before))
        if changed:
            spark.conf.set(key, value)
    except Exception as exc:
        if required:
            raise
        log.info("Keeping the session's %s (%s)", key, exc)
        changed = False
    try:
        yield
    finally:
        if changed:
            try:
                if before is None:
                    spark.conf.unset(key)
                else:
                    spark.conf.set(key, before)
            except Exception as exc:
                if required:
                    raise
                log.warning("Could not restore the session's %s: %s", key, exc)
