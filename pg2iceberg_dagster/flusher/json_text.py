"""Column values in PostgreSQL text form as the insides of JSON strings, escaped only where needed;
shared by the bulk decoder (.batch) and the generated columns (.generated)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

# Characters JSON requires escaped in a string; rows holding one are escaped by json.dumps.
_NEEDS_ESCAPE = r'[\x00-\x1f"\\]'
# Types whose text form never holds one of them (digits, signs, dates, hex...): not searched.
PLAIN_TEXT_KINDS = frozenset(
    {
        *("int2", "int4", "int8", "oid", "float4", "float8", "numeric", "money", "bool"),
        *("date", "time", "timetz", "timestamp", "timestamptz", "interval"),
        *("uuid", "inet", "cidr", "macaddr", "macaddr8", "bit", "varbit", "pg_lsn"),
    }
)


def json_string_bodies(texts: pa.Array) -> pa.Array:
    """``texts`` as the insides of JSON strings: the few values holding a character JSON requires
    escaped (found by one kernel call) are escaped by json.dumps, the others are kept as they are."""
    escape = pc.match_substring_regex(texts, _NEEDS_ESCAPE)
    if not pc.any(escape).as_py():
        return texts
    wrong = pc.take(texts, pc.indices_nonzero(escape)).to_pylist()
    fixed = pa.array([json.dumps(v, ensure_ascii=False)[1:-1] for v in wrong], pa.string())
    return pc.replace_with_mask(texts, escape, fixed)
