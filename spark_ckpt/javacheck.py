"""Fail early, and clearly, when the JVM Spark needs is missing or too old."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from spark_ckpt.errors import EnvironmentError_

__all__ = ["MIN_JAVA", "check_java", "parse_java_version"]

MIN_JAVA = 17


def parse_java_version(text: str) -> int | None:
    """The major version in ``java -version`` output (``1.8.0_392`` is 8, ``17.0.15`` is 17)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not match:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2):
        major = int(match.group(2))
    return major


def check_java(env: dict[str, str] | None = None) -> str:
    """Return the java executable Spark will use, or raise naming what was found.

    Spark's launcher uses ``$JAVA_HOME/bin/java`` when ``JAVA_HOME`` is set, else ``java`` on
    ``PATH``; this checks the same one.
    """
    env = dict(os.environ if env is None else env)
    java_home = env.get("JAVA_HOME")
    if java_home:
        java = os.path.join(java_home, "bin", "java")
        if not os.access(java, os.X_OK):
            raise EnvironmentError_(
                f"JAVA_HOME is {java_home!r} but {java} is not an executable; expected a Java "
                f"{MIN_JAVA}+ installation there. Fix JAVA_HOME or unset it to use java on PATH."
            )
    else:
        found = shutil.which("java", path=env.get("PATH"))
        if not found:
            raise EnvironmentError_(
                f"no java on PATH and JAVA_HOME is not set; Spark needs Java {MIN_JAVA}+ "
                "(on Debian: apt-get install openjdk-17-jre-headless)."
            )
        java = found
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EnvironmentError_(f"could not run {java} -version: {exc}") from exc
    version = parse_java_version(proc.stderr + proc.stdout)
    if version is None:
        raise EnvironmentError_(
            f"{java} -version printed no version; expected Java {MIN_JAVA}+, "
            f"found: {(proc.stderr or proc.stdout).strip()[:200]!r}"
        )
    if version < MIN_JAVA:
        raise EnvironmentError_(
            f"{java} is Java {version}; Spark 4 needs Java {MIN_JAVA} or newer. Point JAVA_HOME "
            f"at a Java {MIN_JAVA}+ installation."
        )
    return java
