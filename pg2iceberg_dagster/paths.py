"""One path segment for a name that may hold anything: a table's staging folder, an Iceberg table's
folder in the warehouse."""

from __future__ import annotations

import hashlib
import re

# What a segment keeps of a name as it is: none of these characters is special to S3 keys, URLs or
# Hadoop paths, and there is no ``/``.
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# Hex digits of sha256(name) that make a segment the name's own: the readable part alone can meet
# another name's (``a b`` and ``a_b``), the digest cannot in practice (64 bits).
DIGEST_HEX = 16


def digest_segment(name: str) -> str:
    """``<readable part of name>-<digest>``: one path segment that no other name's can equal, and that
    neither holds a ``/`` nor is ``.`` or ``..``, so it cannot contain, sit in or leave another folder."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:DIGEST_HEX]
    return f"{_UNSAFE.sub('_', name)[:80]}-{digest}"


def path_segment(name: str) -> str:
    """``name`` itself when it is plain (letters, digits, ``_``, and ``.``/``-`` after the first
    character), else :func:`digest_segment`. A plain name cannot meet a digested one unless it copies
    another name's digest."""
    return name if _PLAIN.fullmatch(name) else digest_segment(name)
