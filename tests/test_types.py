"""Unit tests for PostgreSQL text values -> Python values as the materializer loads them."""

from __future__ import annotations

from pg2iceberg_dagster.iceberg.types import text_loaders
from pg2iceberg_dagster.source.catalog import PgType, SourceColumn

FLOAT4 = PgType(name="real", kind="float4", type_mod=-1, base_oid=700, array_oid=1021)
FLOAT8 = PgType(name="double precision", kind="float8", type_mod=-1, base_oid=701, array_oid=1022)


def test_real_loads_as_its_single_precision_value() -> None:
    """Found by the soak (seed 15): after `ALTER COLUMN ... TYPE double precision` PostgreSQL holds
    248413.109375 (the exact real), so a real staged before the change must not become 248413.11."""
    (load_real,) = text_loaders([SourceColumn("r", FLOAT4, False)], "clamp")
    (load_double,) = text_loaders([SourceColumn("d", FLOAT8, False)], "clamp")
    assert load_real(b"248413.11") == 248413.109375
    assert load_real(b"NaN") != load_real(b"NaN") and load_real(b"-Infinity") == float("-inf")
    assert load_double(b"248413.11") == 248413.11
