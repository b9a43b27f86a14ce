"""Names that become path segments, Delta app ids or file names: one rule, one message.

Job ids, run keys, pipeline names and the names of vertices, sources, outputs and stateful
operators all end up in paths (``<work>/<job>/``, ``receivedData/<source>/``,
``state/<operator>/``) and in the ids that guard exactly-once commits. A name with ``/``,
``..``, a backslash or a control character could write outside its directory or collide
with another; so a name is letters and digits (any script), ``.``, ``_`` and ``-``, starts
with a letter or digit, and is at most 128 characters.
"""

from __future__ import annotations

from spark_ckpt.errors import JobDefinitionError

__all__ = ["check_name"]

MAX_LENGTH = 128


def check_name(what: str, value: object) -> str:
    """Return ``value`` if it is a valid name, else raise naming ``what`` and what is wrong."""
    if not isinstance(value, str) or not value:
        raise JobDefinitionError(f"{what}: expected a non-empty name, found {value!r}")
    bad = sorted({c for c in value if not (c.isalnum() or c in "._-")})
    if bad or not value[0].isalnum() or len(value) > MAX_LENGTH:
        problem = (f"characters {bad!r} are not allowed" if bad else
                   "it must start with a letter or digit" if not value[0].isalnum() else
                   f"it is longer than {MAX_LENGTH} characters")
        raise JobDefinitionError(
            f"{what}: expected letters, digits, '.', '_' and '-' starting with a letter or "
            f"digit (it becomes part of paths and commit ids), found {value!r}: {problem}"
        )
    return value
