"""The ``partition_by`` and ``sort_by`` expressions of a table's config, parsed.

Syntax only: the config imports this module, so it knows nothing of Iceberg or of the source (whether
a column exists and a transform fits its type is checked at startup, ``iceberg/layout.py``).

``partition_by`` items: a bare column (identity), ``identity(c)``, ``year(c)``, ``month(c)``,
``day(c)``, ``hour(c)``, ``bucket(N, c)`` and ``truncate(W, c)`` (Iceberg's ``bucket[N](c)`` and
``truncate[W](c)`` too). ``sort_by`` items: ``c [asc|desc] [nulls first|nulls last]``. A column is
written as in the table's ``name``: unquoted, or in double quotes (a quote inside doubled).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_COLUMN = r'[A-Za-z_][A-Za-z0-9_$]*|"(?:[^"]|"")+"'
_PARTITION = re.compile(
    rf"^\s*(?:(?P<transform>[A-Za-z]+)\s*(?:\[\s*(?P<bracketed>\d+)\s*\])?\s*\(\s*(?:(?P<parameter>\d+)\s*,\s*)?"
    rf"(?P<column>{_COLUMN})\s*\)|(?P<bare>{_COLUMN}))\s*$"
)
_SORT = re.compile(
    rf"^\s*(?P<column>{_COLUMN})(?:\s+(?P<direction>asc|desc))?(?:\s+nulls\s+(?P<nulls>first|last))?\s*$",
    re.IGNORECASE,
)
# Transforms without and with a parameter (the number of buckets, the truncation width).
PLAIN_TRANSFORMS = ("identity", "year", "month", "day", "hour")
PARAMETER_TRANSFORMS = ("bucket", "truncate")
MAX_PARAMETER = 2**31 - 1  # Iceberg stores both as an int


def quote_column(name: str) -> str:
    """``name`` as an expression writes it: bare when it is a plain identifier, else double-quoted."""
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_$]*", name) else '"' + name.replace('"', '""') + '"'


def _unquote(column: str) -> str:
    return column[1:-1].replace('""', '"') if column.startswith('"') else column


@dataclass(frozen=True)
class PartitionTerm:
    """One ``partition_by`` item: ``transform`` of ``column`` (``parameter``: buckets or width)."""

    transform: str
    column: str
    parameter: int | None = None

    def __str__(self) -> str:
        column = quote_column(self.column)
        if self.parameter is not None:
            return f"{self.transform}({self.parameter}, {column})"
        return column if self.transform == "identity" else f"{self.transform}({column})"


@dataclass(frozen=True)
class SortTerm:
    """One ``sort_by`` item. Nulls come first ascending and last descending unless said otherwise
    (the default of Iceberg and Spark)."""

    column: str
    descending: bool = False
    nulls_first: bool | None = None

    @property
    def nulls_go_first(self) -> bool:
        return not self.descending if self.nulls_first is None else self.nulls_first

    def __str__(self) -> str:
        direction = "desc" if self.descending else "asc"
        return f"{quote_column(self.column)} {direction} nulls {'first' if self.nulls_go_first else 'last'}"


def parse_partition_term(text: str) -> PartitionTerm:
    """Parse one ``partition_by`` item; ValueError says what is wrong with it."""
    match = _PARTITION.match(text)
    if match is None:
        raise ValueError(
            f"expected a column, transform(column) (identity, year, month, day, hour), bucket(N, column) or "
            f"truncate(W, column), got {text!r}"
        )
    if match["bare"] is not None:
        return PartitionTerm("identity", _unquote(match["bare"]))
    transform = match["transform"].lower()
    column = _unquote(match["column"])
    if match["bracketed"] is not None and match["parameter"] is not None:
        raise ValueError(f"give {transform}'s number once, as {transform}(N, column), got {text!r}")
    number = match["bracketed"] or match["parameter"]
    if transform in PLAIN_TRANSFORMS:
        if number is not None:
            raise ValueError(f"{transform} takes no number: {transform}({quote_column(column)}), got {text!r}")
        return PartitionTerm(transform, column)
    if transform not in PARAMETER_TRANSFORMS:
        raise ValueError(
            f"unknown transform {match['transform']!r} in {text!r}: use identity, year, month, day, hour, "
            "bucket(N, column) or truncate(W, column)"
        )
    what = "a number of buckets" if transform == "bucket" else "a width"
    if number is None:
        raise ValueError(f"{transform} needs {what}: {transform}(N, {quote_column(column)}), got {text!r}")
    if not 1 <= int(number) <= MAX_PARAMETER:
        raise ValueError(f"{transform} needs {what} from 1 to {MAX_PARAMETER}, got {text!r}")
    return PartitionTerm(transform, column, int(number))


def parse_sort_term(text: str) -> SortTerm:
    """Parse one ``sort_by`` item; ValueError says what is wrong with it."""
    match = _SORT.match(text)
    if match is None:
        raise ValueError(f"expected 'column [asc|desc] [nulls first|nulls last]', got {text!r}")
    nulls = match["nulls"]
    return SortTerm(
        _unquote(match["column"]),
        descending=(match["direction"] or "asc").lower() == "desc",
        nulls_first=None if nulls is None else nulls.lower() == "first",
    )


def repeated_columns(columns: list[str]) -> list[str]:
    """The columns named more than once, in order of first repetition."""
    seen: set[str] = set()
    repeated: list[str] = []
    for column in columns:
        if column in seen and column not in repeated:
            repeated.append(column)
        seen.add(column)
    return repeated
