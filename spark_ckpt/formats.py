"""Versioned JSON records: everything spark_ckpt persists carries ``format_version``.

One reader per version; an unknown version is rejected with a message naming both. Pickle is
never read back from storage.
"""

from __future__ import annotations

import json
from typing import Any

from spark_ckpt.errors import FormatVersionError

__all__ = ["dump_record", "load_record"]


def dump_record(kind: str, version: int, body: dict[str, Any]) -> bytes:
    """Serialize ``body`` as a ``kind`` record of format ``version``."""
    record = {"kind": kind, "format_version": version, **body}
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def load_record(data: bytes | str, kind: str, supported: tuple[int, ...]) -> dict[str, Any]:
    """Parse a record, checking its kind and that its version is one of ``supported``."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatVersionError(f"expected a JSON {kind} record, found unparseable data") from exc
    if not isinstance(record, dict) or record.get("kind") != kind:
        found = record.get("kind") if isinstance(record, dict) else type(record).__name__
        raise FormatVersionError(f"expected a {kind} record, found {found!r}")
    version = record.get("format_version")
    if version not in supported:
        raise FormatVersionError(
            f"{kind} record has format_version {version!r}; this release reads "
            f"{', '.join(map(str, supported))}. Upgrade spark_ckpt to read it."
        )
    return record
