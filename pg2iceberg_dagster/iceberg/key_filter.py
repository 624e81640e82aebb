"""Rows picked by primary key, as a pyiceberg filter (a repair's and a small merge's deletes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyiceberg.expressions import And, BooleanExpression, EqualTo, In, Or


def key_filter(columns: Sequence[str], keys: Sequence[tuple]) -> BooleanExpression:
    """The rows whose key (``columns``) is one of ``keys``: ``In`` for a one-column key, else a
    balanced tree of ORs (a chain as deep as the keys would overflow the expression visitors)."""
    # Their __init__ take (term, literal(s)); the pydantic models' signatures say otherwise.
    equal: Any = EqualTo
    one_of: Any = In
    if len(columns) == 1:
        return one_of(columns[0], [key[0] for key in keys])

    def one(key: tuple) -> BooleanExpression:
        terms = [equal(column, value) for column, value in zip(columns, key, strict=True)]
        return terms[0] if len(terms) == 1 else And(*terms)

    def any_of(part: Sequence[tuple]) -> BooleanExpression:
        if len(part) == 1:
            return one(part[0])
        middle = len(part) // 2
        return Or(any_of(part[:middle]), any_of(part[middle:]))

    return any_of(keys)
