"""Pg2IcebergTranslator without IO: asset keys, groups, partitions names and descriptions per table,
from a parsed config alone (no server, no Dagster instance)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from dagster import AssetKey

from assets.translator import Pg2IcebergTranslator
from pg2iceberg_dagster.config import PipelineConfig, TableConfig, parse_config

# What Dagster accepts as a name (asset key parts become op and asset names, groups and partitions too).
DAGSTER_NAME = re.compile(r"^[A-Za-z0-9_]+$")
ROLES = ("source", "staged_log", "snapshot", "iceberg")


def translator(tables: list[Any], **overrides: Any) -> Pg2IcebergTranslator:
    specs = [t if isinstance(t, dict) else {"name": t} for t in tables]
    return Pg2IcebergTranslator(parse_config({"source": {"dbname": "app"}, "tables": specs, **overrides}))


def keys(t: Pg2IcebergTranslator, table: TableConfig) -> list[AssetKey]:
    """The four asset keys of a table: source, staged log, snapshot, live Iceberg table."""
    return [t.source_key(table), t.staged_log_key(table), t.snapshot_key(table), t.iceberg_key(table)]


def only(config: PipelineConfig) -> TableConfig:
    (table,) = config.tables
    return table


def test_plain_table() -> None:
    t = translator(["public.orders"])
    table = only(t.config)
    assert keys(t, table) == [
        AssetKey(["pg", "public", "orders_source"]),
        AssetKey(["staged_log", "public", "orders_staged_log"]),
        AssetKey(["iceberg", "public", "orders_snapshot"]),
        AssetKey(["iceberg", "public", "orders"]),
    ]
    assert t.group_name(table) == "public"
    assert t.partitions_name(table) == "ctid_chunks__public__orders"
    assert t.iceberg_table_name(table) == "pg2iceberg.public.orders"


def test_namespace_template_catalog_name_and_iceberg_name() -> None:
    t = translator(
        [{"name": "sales.orders", "iceberg_name": "orders_v2"}],
        iceberg={"namespace": "raw_{schema}", "catalog": {"name": "lake"}},
    )
    table = only(t.config)
    assert t.iceberg_key(table) == AssetKey(["iceberg", "raw_sales", "orders_v2"])
    assert t.snapshot_key(table) == AssetKey(["iceberg", "raw_sales", "orders_v2_snapshot"])
    assert t.source_key(table) == AssetKey(["pg", "sales", "orders_source"]), "the source keeps the PostgreSQL name"
    assert t.staged_log_key(table) == AssetKey(["staged_log", "sales", "orders_staged_log"])
    assert t.iceberg_table_name(table) == "lake.raw_sales.orders_v2"
    assert t.group_name(table) == "sales", "grouped by source schema, not namespace"


@pytest.mark.parametrize(
    ("name", "schema_part", "table_part"),
    [
        ('"My Schema"."Order ""Items"""', "My_Schema", "Order__Items_"),
        ('"a.b"."c d"', "a_b", "c_d"),
        ('"x-y"."it\'s"', "x_y", "it_s"),
        ("public.cost$", "public", "cost_"),
        ('"Schéma"."tâble"', "Sch_ma", "t_ble"),
    ],
)
def test_hostile_names_are_sanitised(name: str, schema_part: str, table_part: str) -> None:
    t = translator([name], iceberg={"namespace": "ns.{schema}"})
    table = only(t.config)
    assert t.source_key(table) == AssetKey(["pg", schema_part, f"{table_part}_source"])
    assert t.staged_log_key(table) == AssetKey(["staged_log", schema_part, f"{table_part}_staged_log"])
    assert t.iceberg_key(table) == AssetKey(["iceberg", f"ns_{schema_part}", table_part])
    assert t.snapshot_key(table) == AssetKey(["iceberg", f"ns_{schema_part}", f"{table_part}_snapshot"])
    assert t.group_name(table) == schema_part
    assert t.partitions_name(table) == f"ctid_chunks__{schema_part}__{table_part}"
    for part in [p for key in keys(t, table) for p in key.path] + [t.group_name(table), t.partitions_name(table)]:
        assert DAGSTER_NAME.match(part), part
    # The catalog name is not sanitised: it is the real Iceberg identifier, for people and Spark.
    assert t.iceberg_table_name(table) == f"pg2iceberg.ns.{table.schema_name}.{table.table_name}"


def test_descriptions_name_the_table() -> None:
    t = translator(['"My Schema"."Order ""Items"""'], replication={"slot": "my_slot"})
    table = only(t.config)
    descriptions = {role: t.description(table, role) for role in ROLES}
    for role, text in descriptions.items():
        assert table.key in text, role
    assert "my_slot" in descriptions["source"]
    assert "_pg2iceberg.log_index" in descriptions["staged_log"]
    for role in ("snapshot", "iceberg"):
        assert t.iceberg_table_name(table) in descriptions[role], role
    assert len(set(descriptions.values())) == len(ROLES)
    with pytest.raises(KeyError):
        t.description(table, "unknown")


def test_groups_follow_the_source_schema() -> None:
    t = translator(["public.a", "public.b", "sales.a"])
    assert [t.group_name(table) for table in t.config.tables] == ["public", "public", "sales"]


def test_translator_is_frozen_and_overridable() -> None:
    class Flat(Pg2IcebergTranslator):
        def group_name(self, table: TableConfig) -> str:
            return "mirror"

    config = translator(["public.orders"]).config
    flat = Flat(config)
    assert flat.group_name(only(config)) == "mirror"
    assert flat.source_key(only(config)) == AssetKey(["pg", "public", "orders_source"])
    with pytest.raises(AttributeError):
        flat.config = config  # type: ignore[misc]


def names(t: Pg2IcebergTranslator) -> list[str]:
    """Every asset key and partitions name the tables of ``t`` get."""
    found = [key.to_user_string() for table in t.config.tables for key in keys(t, table)]
    return found + [t.partitions_name(table) for table in t.config.tables]


def collides(tables: list[str], case: str, reason: str) -> Any:
    """A case whose names collide today: a strict xfail, so a fix in the translator shows."""
    return pytest.param(tables, id=case, marks=pytest.mark.xfail(strict=True, reason=f"finding: {reason}"))


@pytest.mark.parametrize(
    "tables",
    [
        pytest.param(["public.orders", 'public."Orders"', "sales.orders", "public.order"], id="case-and-schema"),
        pytest.param(['"a b".c', "a.b_c"], id="schema-vs-table"),
        collides(['public."a b"', "public.a_b"], "space-vs-underscore", "both sanitise to a_b"),
        collides(["public.a$b", "public.a_b"], "dollar-vs-underscore", "'$' (valid unquoted) sanitises to '_'"),
        collides(['"x.y".t', "x_y.t"], "dot-vs-underscore", "a dot in a schema sanitises to '_'"),
        collides(
            ["public.orders", "public.orders_snapshot"],
            "snapshot-suffix",
            "the snapshot key of orders is the live key of orders_snapshot",
        ),
        collides(["a__b.c", "a.b__c"], "double-underscore", "partitions names join parts with '__'"),
    ],
)
def test_names_are_unique_across_tables(tables: list[str]) -> None:
    found = names(translator(tables))
    assert len(found) == len(set(found)), sorted({name for name in found if found.count(name) > 1})
