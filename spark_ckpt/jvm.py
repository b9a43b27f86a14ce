"""spark_ckpt's one jar: the RDD that gives a stateful task its key-group range's last location.

Spark gives a Python operator's tasks no locality, so a key-group range's task may run on
another executor than last batch and rebuild its state from the durable chain. The jar
(``jvm/locality``, one Java class, ``io.sparkckpt.locality.PreferredLocationsRDD``) wraps the
stateful stage's input with a preferred location per partition, as Structured Streaming's
state store coordinator does for its state stores (docs/checkpointing.md, "Where state lives").

It ships inside the package (``spark_ckpt/jars/``) and the package loads it itself: on the
``spark.jars`` of a session spark_ckpt builds (:func:`spark_ckpt.session.get_or_create_session`),
added to a running classic session when first needed
(:meth:`spark_ckpt.sparkapi.classic.ClassicSpark.prefer_locations`). Without it (a Spark
Connect session, or a checkout whose jar was not built) stateful tasks run wherever Spark puts
them, logged once.

Built by Maven against pip PySpark's own jars (Maven Central has no Spark 4.3.0)::

    python -m spark_ckpt.jvm build    # jvm/locality -> spark_ckpt/jars/spark-ckpt-locality.jar
    python -m spark_ckpt.jvm path     # the jar's path, or nothing (exit 1) if there is none
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from spark_ckpt.errors import EnvironmentError_

__all__ = ["LOCALITY_CLASS", "build", "jar_path"]

LOCALITY_CLASS = "io.sparkckpt.locality.PreferredLocationsRDD"
JAR_NAME = "spark-ckpt-locality.jar"
_PACKAGE_JAR = Path(__file__).resolve().parent / "jars" / JAR_NAME


def jar_path() -> Path | None:
    """The shipped jar, None when this install has none (``$SPARK_CKPT_LOCALITY_JAR``
    overrides the place)."""
    explicit = os.environ.get("SPARK_CKPT_LOCALITY_JAR")
    path = Path(explicit) if explicit else _PACKAGE_JAR
    return path if path.is_file() else None


def _pom() -> Path:
    pom = Path(__file__).resolve().parent.parent / "jvm" / "locality" / "pom.xml"
    if not pom.is_file():
        raise EnvironmentError_(f"expected the jar's Maven module at {pom} (a source checkout), "
                           "found none")
    return pom


def _pyspark_jars() -> tuple[Path, str, str, str]:
    """pip PySpark's jars directory, its Spark version, Scala binary and full versions."""
    import pyspark

    jars = Path(pyspark.__file__).resolve().parent / "jars"
    cores = sorted(jars.glob("spark-core_*.jar"))
    scalas = sorted(jars.glob("scala-library-*.jar"))
    if not cores or not scalas:
        raise EnvironmentError_(f"expected spark-core_*.jar and scala-library-*.jar in {jars}")
    binary, spark = cores[0].stem.removeprefix("spark-core_").split("-", 1)
    scala = scalas[0].stem.removeprefix("scala-library-")
    return jars, spark, binary, scala


def build(*, target: Path | None = None, quiet: bool = True) -> Path:
    """Compile the jar with Maven against pip PySpark's jars and put it at ``target`` (the
    package's ``jars/`` by default). Maven fetches its plugins from Maven Central the first
    time.

    Raises:
        RuntimeError: no Maven, no source module, or the build failed.
    """
    mvn = shutil.which("mvn")
    if mvn is None:
        raise EnvironmentError_(
            "expected Maven (mvn) on PATH to build the locality jar, found none")
    pom = _pom()
    jars, spark, binary, scala = _pyspark_jars()
    out = target or _PACKAGE_JAR
    with tempfile.TemporaryDirectory(prefix="spark-ckpt-jvm-") as build_dir:
        command = [mvn, *(["-q"] if quiet else []), "-B", "-f", str(pom), "package",
                   f"-Dpyspark.jars={jars}", f"-Dspark.version={spark}",
                   f"-Dscala.binary={binary}", f"-Dscala.version={scala}",
                   f"-DbuildDirectory={build_dir}"
                   ]
        run = subprocess.run(command, capture_output=True, text=True, timeout=900)
        built = Path(build_dir) / JAR_NAME
        if run.returncode != 0 or not built.is_file():
            raise EnvironmentError_(f"building {pom} failed: {(run.stdout + run.stderr)[-3000:]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + f".partial-{os.getpid()}")
        shutil.copyfile(built, partial)
        os.replace(partial, out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["build"]:
        print(build(quiet="-v" not in args))
        return 0
    if args[:1] == ["path"]:
        path = jar_path()
        if path is None:
            return 1
        print(path)
        return 0
    print("usage: python -m spark_ckpt.jvm build [-v] | path", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
