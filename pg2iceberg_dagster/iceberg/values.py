"""Values PostgreSQL stores that Iceberg (or Spark) cannot hold, and the one rule that maps them.

``values.out_of_range`` in the config chooses the rule, ``clamp`` (the default) or ``null``:

===========================================  ===========================  ==============
PostgreSQL value                             ``clamp``                    ``null``
===========================================  ===========================  ==============
date ``-infinity``, BC dates                 0001-01-01                   NULL
date ``infinity``, years after 9999          9999-12-31                   NULL
timestamp[tz] ``-infinity``, BC              0001-01-01 00:00:00[+00]     NULL
timestamp[tz] ``infinity``, after 9999       9999-12-31 23:59:59.999999   NULL
numeric(p, s) ``NaN``                        NULL                         NULL
a multi-dimensional value in a column        its elements in row-major    NULL
declared with one dimension (or none)        order, as one list
===========================================  ===========================  ==============

It applies to array elements as to plain values. Everything else is exact: years 1 to 9999 (before
1582 too), float ``NaN``/``±Infinity``, unconstrained numeric (a string: ``NaN``, ``Infinity`` kept).
PostgreSQL refuses ``±Infinity`` in numeric(p, s), so no decimal needs clamping. A column declared
with more than one dimension (``int[][]``) is not a list at all but a string holding PostgreSQL's
text form (``iceberg/types.py``); array lower bounds other than 1 are dropped (a list has none).

The rule comes in the forms each path needs, all from the definitions here: on one text value (the
WAL's text loaders and ``verify``), on an Arrow array of texts (the vectorized merge, the snapshot's
numerics), as SQL around a column (the snapshot's binary dates and timestamps, which the ADBC driver
would otherwise wrap around silently), and on the flattened lists the ADBC driver decodes. Texts are
in the form the pipeline's sessions produce (``DateStyle ISO``, ``TimeZone UTC``): a value before
year 1 ends in `` BC``, one after 9999 has a five-digit year.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from ..config import OutOfRange
from ..errors import UnsupportedTypeError


@dataclass(frozen=True)
class _Range:
    """What Iceberg and Spark hold of a date or timestamp type, in PostgreSQL's text form."""

    low: str
    high: str


_RANGES = {
    "date": _Range("0001-01-01", "9999-12-31"),
    "timestamp": _Range("0001-01-01 00:00:00", "9999-12-31 23:59:59.999999"),
    "timestamptz": _Range("0001-01-01 00:00:00+00", "9999-12-31 23:59:59.999999+00"),
}
_BELOW = r"^-infinity$| BC$"
_ABOVE = r"^infinity$|^[0-9]{5}"
_BELOW_RE = re.compile(_BELOW)
_ABOVE_RE = re.compile(_ABOVE)
NUMERIC_NAN = "NaN"

# Kinds whose values the rule may change: dates and timestamps, and numeric(p, s) (the caller knows
# the numeric is a decimal: an unconstrained one is a string and exact).
RULED_KINDS = frozenset({*_RANGES, "numeric"})
TIME_KINDS = frozenset(_RANGES)


def conform_text(kind: str, text: str, rule: OutOfRange) -> str | None:
    """One value's text form as the rule stores it: itself, a bound, or None (NULL)."""
    if kind == "numeric":
        return None if text == NUMERIC_NAN else text
    bounds = _RANGES.get(kind)
    if bounds is None:
        return text
    if _BELOW_RE.search(text):
        return bounds.low if rule == "clamp" else None
    if _ABOVE_RE.search(text):
        return bounds.high if rule == "clamp" else None
    return text


def conform_texts(kind: str, texts: pa.Array, rule: OutOfRange) -> pa.Array:
    """:func:`conform_text` over an Arrow array of texts, vectorized (a list array: over its elements)."""
    if pa.types.is_list(texts.type) or pa.types.is_large_list(texts.type):
        elements = conform_texts(kind, texts.values, rule)
        offsets = texts.offsets
        return type(texts).from_arrays(offsets, elements, type=texts.type, mask=texts.is_null())
    if kind == "numeric":
        return pc.if_else(pc.equal(texts, NUMERIC_NAN), pa.scalar(None, texts.type), texts)
    bounds = _RANGES.get(kind)
    if bounds is None:
        return texts
    low, high = (bounds.low, bounds.high) if rule == "clamp" else (None, None)
    below = pc.match_substring_regex(texts, _BELOW)
    above = pc.match_substring_regex(texts, _ABOVE)
    return pc.if_else(below, pa.scalar(low, texts.type), pc.if_else(above, pa.scalar(high, texts.type), texts))


def conform_sql(kind: str, value: sql.Composable, rule: OutOfRange) -> sql.Composable:
    """SQL giving ``value`` (a date or timestamp of ``kind``) as the rule stores it; ``-infinity`` sorts
    below every date, ``infinity`` above."""
    bounds = _RANGES[kind]
    low, high = (sql.Literal(bounds.low), sql.Literal(bounds.high)) if rule == "clamp" else (sql.NULL, sql.NULL)
    type_name = sql.Identifier("pg_catalog", kind)
    return sql.SQL(
        "CASE WHEN {value} < {low_bound}::{type} THEN {low}::{type} "
        "WHEN {value} > {high_bound}::{type} THEN {high}::{type} ELSE {value} END"
    ).format(
        value=value,
        type=type_name,
        low_bound=sql.Literal(bounds.low),
        high_bound=sql.Literal(bounds.high),
        low=low,
        high=high,
    )


def conform_dimensions(value: list[Any], rule: OutOfRange) -> list[Any] | None:
    """A loaded array value for a one-dimensional list: a nested (multi-dimensional) one flattened in
    row-major order under ``clamp``, None under ``null``."""
    if not value or not isinstance(value[0], list):
        return value
    return list(_row_major(value)) if rule == "clamp" else None


def _row_major(value: list[Any]) -> Iterator[Any]:
    # PostgreSQL arrays are rectangular: a level holds only sub-arrays or only elements.
    for item in value:
        if isinstance(item, list):
            yield from _row_major(item)
        else:
            yield item


def conform_flattened(values: pa.Array, dimensions: pa.Array, rule: OutOfRange) -> pa.Array:
    """Lists the ADBC driver decoded (it flattens a multi-dimensional value in row-major order) as the
    rule stores them, given each value's number of dimensions."""
    if rule == "clamp":
        return values
    multi = pc.fill_null(pc.greater(dimensions, 1), False)
    if not pc.any(multi).as_py():
        return values
    return pc.if_else(multi, pa.scalar(None, values.type), values)


def null_key_rows(rows: pa.Table, key: Sequence[str]) -> pa.Array:
    """Which rows have a key column the rule made NULL (numeric NaN; a date or timestamp out of range
    under ``values.out_of_range: null``): Iceberg key columns hold no NULL."""
    return functools.reduce(pc.or_, [pc.is_null(rows.column(name)) for name in key])


def null_key_refusal(table_key: str, key: Sequence[str], rows: int) -> UnsupportedTypeError:
    """The error for ``rows`` rows whose key :func:`null_key_rows` found NULL."""
    return UnsupportedTypeError(
        f"{table_key}: {rows} row(s) hold a primary key ({', '.join(key)}) value Iceberg cannot hold (numeric NaN, "
        "or a date or timestamp out of range under values.out_of_range: null), which would leave them without a "
        "key; change those keys at the source, or set tables[].primary_key to other columns (a first snapshot "
        "reads the source as of the slot's creation: start it over with `cleanup --all --yes`; merges and "
        "resyncs see the change)"
    )
