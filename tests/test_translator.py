"""Pg2IcebergTranslator without IO: asset keys, groups, partitions names and descriptions per table,
from a parsed config alone (no server, no Dagster instance), and names kept unique across tables so
the code location built from them loads."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import AssetKey, DagsterInvalidDefinitionError, Definitions

from pg2iceberg_dagster.config import PipelineConfig, TableConfig, parse_config
from pg2iceberg_dagster.dagster_integration import Mirror, Pg2IcebergResource, Pg2IcebergTranslator, mirror_definitions
from pg2iceberg_dagster.errors import ConfigError

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
    assert t.group_name(table) == "pg2iceberg_public"
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
    assert t.group_name(table) == "pg2iceberg_sales", "grouped by source schema, not namespace"


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
    assert t.group_name(table) == f"pg2iceberg_{schema_part}"
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


def test_groups_follow_the_mirror_and_the_source_schema() -> None:
    """A group per mirror and schema: two mirrors (or teams) of one deployment never share ``public``."""
    t = translator(["public.a", "public.b", "sales.a"])
    assert [t.group_name(table) for table in t.config.tables] == ["pg2iceberg_public"] * 2 + ["pg2iceberg_sales"]
    billing = Mirror(t, "billing")
    assert [billing.spec(table, "iceberg").group_name for table in t.config.tables] == [
        "billing_public",
        "billing_public",
        "billing_sales",
    ]
    assert t.mirror_name == "pg2iceberg", "the mirror has its own copy; the translator given is unchanged"


def test_translator_is_frozen_and_overridable() -> None:
    class Flat(Pg2IcebergTranslator):
        def group_name(self, table: TableConfig) -> str:
            return "mirror"

    config = translator(["public.orders"]).config
    flat = Flat(config)
    assert flat.group_name(only(config)) == "mirror"
    assert Mirror(flat, "billing").spec(only(config), "iceberg").group_name == "mirror", "the override decides"
    assert flat.source_key(only(config)) == AssetKey(["pg", "public", "orders_source"])
    with pytest.raises(AttributeError):
        flat.config = config  # type: ignore[misc]


def suffix(table_key: str, length: int = 6) -> str:
    return hashlib.sha1(table_key.encode()).hexdigest()[:length]


def safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


class Plain(Pg2IcebergTranslator):
    """The names before collisions were resolved: every table sanitised on its own."""

    def source_key(self, table: TableConfig) -> AssetKey:
        return AssetKey(["pg", safe(table.schema_name), f"{safe(table.table_name)}_source"])

    def staged_log_key(self, table: TableConfig) -> AssetKey:
        return AssetKey(["staged_log", safe(table.schema_name), f"{safe(table.table_name)}_staged_log"])

    def iceberg_key(self, table: TableConfig) -> AssetKey:
        namespace, name = self.config.iceberg_identifier(table)
        return AssetKey(["iceberg", safe(namespace), safe(name)])

    def partitions_name(self, table: TableConfig) -> str:
        return f"ctid_chunks__{safe(table.schema_name)}__{safe(table.table_name)}"


def names(t: Pg2IcebergTranslator) -> list[str]:
    """Every asset key, op name (the key's parts joined by ``__``) and partitions name of the tables of ``t``."""
    found = [t.partitions_name(table) for table in t.config.tables]
    for table in t.config.tables:
        found += [name for key in keys(t, table) for name in (key.to_user_string(), key.to_python_identifier())]
    return found


def definitions(t: Pg2IcebergTranslator, tmp_path: Path) -> Definitions:
    """The code location ``build_definitions`` makes of ``t``'s config, checked loadable as Dagster
    loads it (no server, no instance, no database: nothing is run)."""
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(t.config.model_dump(mode="json", exclude_none=True)))
    defs = mirror_definitions(Mirror(t), Pg2IcebergResource(config_path=str(path)))
    Definitions.validate_loadable(defs)
    return defs


# Tables whose plainly sanitised names collide: each such config made Dagster refuse the code location.
COLLIDING = {
    "space-vs-underscore": ['public."a b"', "public.a_b"],
    "dollar-vs-underscore": ["public.a$b", "public.a_b"],  # '$' is valid in an unquoted name
    "dot-vs-underscore": ['"x.y".t', "x_y.t"],
    "snapshot-suffix": ["public.orders", "public.orders_snapshot"],  # orders' snapshot key is the other's live key
    "double-underscore": ["a__b.c", "a.b__c"],  # partitions and op names join parts with '__'
    "three-ways": ['public."a b"', "public.a$b", "public.a_b"],
}
# Tables whose names stay distinct once sanitised: they keep the plain names.
DISTINCT = {
    "case-and-schema": ["public.orders", 'public."Orders"', "sales.orders", "public.order"],
    "schema-vs-table": ['"a b".c', "a.b_c"],
    "hostile-alone": ['"My Schema"."Order ""Items"""', "public.cost$", '"v1.2"."events.log"', "public.orders"],
}


@pytest.mark.parametrize("tables", [*COLLIDING.values(), *DISTINCT.values()], ids=[*COLLIDING, *DISTINCT])
def test_names_are_unique_across_tables_and_the_definitions_load(tables: list[str], tmp_path: Path) -> None:
    t = translator(tables)
    found = names(t)
    assert len(found) == len(set(found)), sorted({name for name in found if found.count(name) > 1})
    for table in t.config.tables:
        for part in [p for key in keys(t, table) for p in key.path] + [t.partitions_name(table)]:
            assert DAGSTER_NAME.match(part), part
    defs = definitions(t, tmp_path)
    assert {spec.key for spec in defs.resolve_all_asset_specs()} == {
        key for table in t.config.tables for key in keys(t, table)
    } | {AssetKey(["pg2iceberg", "replication_slot"])}  # the mirror's slot (see slot.py)


@pytest.mark.parametrize("tables", COLLIDING.values(), ids=COLLIDING)
def test_plain_names_collide_and_dagster_refuses_them(tables: list[str], tmp_path: Path) -> None:
    """The cases above are real: sanitised one table at a time, their names meet and Dagster refuses
    the code location."""
    plain = Plain(translator(tables).config)
    found = names(plain)
    assert len(found) > len(set(found))
    with pytest.raises(DagsterInvalidDefinitionError):
        definitions(plain, tmp_path)


@pytest.mark.parametrize("tables", DISTINCT.values(), ids=DISTINCT)
def test_tables_that_do_not_collide_keep_their_plain_names(tables: list[str]) -> None:
    t = translator(tables)
    plain = Plain(t.config)
    for table in t.config.tables:
        assert keys(t, table) == keys(plain, table), table.key
        assert t.partitions_name(table) == plain.partitions_name(table)


def test_a_table_named_as_its_keys_read_keeps_them() -> None:
    """Sanitising changed the names of public."a b" and public.a$b, not those of public.a_b: they give way."""
    t = translator(['public."a b"', "public.a$b", "public.a_b", "public.orders"])
    by_key = {table.key: table for table in t.config.tables}
    assert t.source_key(by_key["public.a_b"]) == AssetKey(["pg", "public", "a_b_source"])
    assert t.iceberg_key(by_key["public.a_b"]) == AssetKey(["iceberg", "public", "a_b"])
    assert t.partitions_name(by_key["public.a_b"]) == "ctid_chunks__public__a_b"
    for key in ("public.a b", "public.a$b"):
        part = f"a_b_{suffix(key)}"
        assert keys(t, by_key[key]) == [
            AssetKey(["pg", "public", f"{part}_source"]),
            AssetKey(["staged_log", "public", f"{part}_staged_log"]),
            AssetKey(["iceberg", "public", f"{part}_snapshot"]),
            AssetKey(["iceberg", "public", part]),
        ]
        assert t.partitions_name(by_key[key]) == f"ctid_chunks__public__{part}"
        assert t.group_name(by_key[key]) == "pg2iceberg_public"
        assert t.iceberg_table_name(by_key[key]) == f"pg2iceberg.public.{by_key[key].table_name}", "the real name"
    assert keys(t, by_key["public.orders"])[3] == AssetKey(["iceberg", "public", "orders"])


@pytest.mark.parametrize("case", ["snapshot-suffix", "double-underscore"])
def test_clean_names_that_collide_all_carry_the_suffix(case: str) -> None:
    t = translator(COLLIDING[case])
    for table in t.config.tables:
        assert t.iceberg_key(table).path[-1] == f"{safe(table.table_name)}_{suffix(table.key)}"
        assert t.partitions_name(table).endswith(f"__{safe(table.table_name)}_{suffix(table.key)}")


@pytest.mark.parametrize("tables", COLLIDING.values(), ids=COLLIDING)
def test_names_do_not_depend_on_the_order_of_the_tables(tables: list[str]) -> None:
    forward, backward = translator(tables), translator(tables[::-1])

    def by_table(t: Pg2IcebergTranslator) -> dict[str, Any]:
        return {table.key: (keys(t, table), t.partitions_name(table)) for table in t.config.tables}

    assert by_table(forward) == by_table(backward)


def test_the_iceberg_side_and_namespaces_carry_the_suffix_too() -> None:
    t = translator(
        [{"name": "public.a", "iceberg_name": "x-y"}, {"name": "public.b", "iceberg_name": "x_y"}],
        iceberg={"namespace": "raw.{schema}"},
    )
    a, b = t.config.tables
    assert t.iceberg_key(a) == AssetKey(["iceberg", "raw_public", f"x_y_{suffix('public.a')}"])
    assert t.iceberg_key(b) == AssetKey(["iceberg", "raw_public", "x_y"])
    assert t.source_key(a) == AssetKey(["pg", "public", f"a_{suffix('public.a')}_source"]), "one suffix per table"
    assert t.source_key(b) == AssetKey(["pg", "public", "b_source"])


def test_suffixes_that_meet_grow_longer() -> None:
    """Two names whose sha1 share their first 6 hex digits (found by search) get 8."""
    first, second = 'public."t x x x-x x-x x x x-x$x"', 'public."t x x x-x-x-x x-x x x x"'
    t = translator([first, second])
    one, two = t.config.tables
    assert suffix(one.key) == suffix(two.key)
    assert t.iceberg_key(one).path[-1] == f"{safe(one.table_name)}_{suffix(one.key, 8)}"
    assert t.iceberg_key(two).path[-1] == f"{safe(two.table_name)}_{suffix(two.key, 8)}"
    found = names(t)
    assert len(found) == len(set(found))


def test_two_tables_into_one_iceberg_table_are_refused() -> None:
    """Not a naming collision to suffix away: both would MERGE into the same Iceberg table. The config
    itself is refused (the CLI as much as Dagster), naming the tables and the Iceberg table."""
    with pytest.raises(
        ConfigError, match=r"table public\.a and table public\.b would all be written into the Iceberg table public\.b"
    ):
        translator([{"name": "public.a", "iceberg_name": "b"}, "public.b"])
    with pytest.raises(ConfigError, match=r"lake\.t"):
        translator(["a.t", "b.t"], iceberg={"namespace": "lake"})


def test_run_tags_name_each_table_with_a_valid_distinct_tag_key() -> None:
    """A merge run carries one tag per table: Dagster's tag keys take only [A-Za-z0-9_.-] (63 at most
    after the namespace), so a hostile table name is made safe and suffixed, never shared."""
    from dagster._utils.tags import is_valid_tag_key

    from pg2iceberg_dagster.dagster_integration import table_run_tag

    keys = ["public.orders", 'public."a b"', "public.a_b", "public.a$b", "sales.Ünïcode", "public." + "x" * 80]
    tags = [table_run_tag(key) for key in keys]
    assert tags[0] == "pg2iceberg/table.public.orders" and tags[2] == "pg2iceberg/table.public.a_b"
    assert all(is_valid_tag_key(tag) for tag in tags), tags
    assert len(set(tags)) == len(keys)
    mirror = Mirror(translator(["public.orders"]), "billing")
    assert mirror.run_tags(["public.orders"]) == {
        "pg2iceberg/mirror": "billing",
        "pg2iceberg/tables": "public.orders",
        "pg2iceberg/table.public.orders": "true",
    }
