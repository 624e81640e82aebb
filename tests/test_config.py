"""Unit tests for configuration parsing, validation errors and secret handling."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from pg2iceberg_dagster.config import PostgresConnection, load_config, parse_config
from pg2iceberg_dagster.errors import ConfigError
from pg2iceberg_dagster.staging.store import table_location
from pg2iceberg_dagster.tables import MirroredTables

SECRET = "s3cr3t-Pa55w0rd-xyzzy"
MINIMAL: dict[str, Any] = {"source": {"dbname": "app"}, "tables": [{"name": "public.orders"}]}


def config_with(**overrides: Any) -> dict[str, Any]:
    """A deep copy of MINIMAL with top-level keys replaced."""
    data = copy.deepcopy(MINIMAL)
    data.update(overrides)
    return data


def config_error(data: Any) -> str:
    """The message of the ConfigError that parsing ``data`` raises."""
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def test_minimal_config_defaults() -> None:
    """A minimal config validates and fills in the documented defaults."""
    config = parse_config(copy.deepcopy(MINIMAL))
    assert config.snapshot.chunk_pages == 2048
    assert config.snapshot.parallelism == 3
    assert config.source.host == "127.0.0.1"
    assert config.source.port == 5432
    assert config.source.user == "postgres"
    assert config.source.password_env is None
    assert config.replication.slot == "pg2iceberg_slot"
    assert config.staging.url == "file:///tmp/pg2iceberg/staging"
    assert config.iceberg.catalog.type == "sql"
    assert config.values.out_of_range == "clamp"
    assert config.state_connection is config.source
    assert config.catalog_connection is config.source
    table = config.tables[0]
    assert (table.schema_name, table.table_name, table.key) == ("public", "orders", "public.orders")
    assert MirroredTables(config)["public.orders"].config is table
    assert config.iceberg_identifier(table) == ("public", "orders")


def test_quoted_table_name_and_overrides() -> None:
    """Quoted identifiers are unquoted in the key; explicit values override defaults."""
    config = parse_config(
        config_with(
            tables=[{"name": '"My Schema"."Order$s"', "primary_key": ["id"], "iceberg_name": "orders"}],
            snapshot={"chunk_pages": 16},
            staging={"url": "s3://bucket/prefix/"},
            iceberg={"namespace": "mirror_{schema}"},
        )
    )
    table = config.tables[0]
    assert table.key == "My Schema.Order$s"
    assert table.primary_key == ["id"]
    assert config.snapshot.chunk_pages == 16
    assert config.staging.url == "s3://bucket/prefix"
    assert config.iceberg_identifier(table) == ("mirror_My Schema", "orders")
    # Resolved once: the key, the Iceberg identifier and the staging folder, found by key or config name.
    tables = MirroredTables(config)
    mirrored = tables["My Schema.Order$s"]
    assert (mirrored.schema_name, mirrored.table_name) == ("My Schema", "Order$s")
    assert mirrored.iceberg == ("mirror_My Schema", "orders")
    assert mirrored.staging == table_location("My Schema.Order$s") and "/" not in mirrored.staging
    assert tables.named('"My Schema"."Order$s"') is mirrored
    assert "public.other" not in tables
    with pytest.raises(ConfigError, match=r"public\.other is not in the configuration"):
        tables["public.other"]


def test_table_properties_are_laid_over_the_defaults() -> None:
    """Setting one table property keeps the others' defaults (format version 2, small dictionary pages,
    old metadata files deleted at commit, position deletes scoped to partitions)."""
    defaults = {
        "format-version": "2",
        "write.parquet.dict-size-bytes": "65536",
        "write.metadata.delete-after-commit.enabled": "true",
        "write.delete.granularity": "partition",
    }
    assert parse_config(copy.deepcopy(MINIMAL)).iceberg.table_properties == defaults
    config = parse_config(config_with(iceberg={"table_properties": {"write.parquet.compression-codec": "snappy"}}))
    assert config.iceberg.table_properties == {**defaults, "write.parquet.compression-codec": "snappy"}


def test_unknown_field_names_dotted_path() -> None:
    """A misspelled field is reported with its dotted path as an unknown field."""
    message = config_error(config_with(source={"dbname": "app", "hots": "db.example"}))
    assert "source.hots: unknown field" in message
    assert "invalid configuration in <config>" in message


def test_unknown_top_level_field() -> None:
    """An unknown top-level section is reported by name."""
    assert "snapshots: unknown field" in config_error(config_with(snapshots={"chunk_pages": 1}))


def test_bad_table_name_names_index() -> None:
    """A table name that is not schema.table is reported at tables.<index>.name."""
    message = config_error(config_with(tables=[{"name": "public.ok"}, {"name": "orders"}]))
    assert "tables.1.name: expected 'schema.table'" in message
    assert "'orders'" in message
    assert "tables.0" not in message
    message = config_error(config_with(tables=[{"name": "orders"}]))
    assert "tables.0.name: expected 'schema.table', got 'orders'" in message


def test_a_table_may_be_just_its_name_and_a_key_one_column() -> None:
    """``tables: [public.orders]`` and ``primary_key: id``, as people write them first, mean what they say;
    anything else in ``tables`` is still refused by index."""
    config = parse_config(config_with(tables=["public.orders", {"name": "public.events", "primary_key": "id"}]))
    assert [(t.key, t.primary_key) for t in config.tables] == [("public.orders", None), ("public.events", ["id"])]
    assert "tables.1: Input should be a valid dictionary" in config_error(config_with(tables=["public.a", 5]))
    assert "tables.0.name: expected 'schema.table'" in config_error(config_with(tables=["orders"]))


def test_duplicate_tables_rejected() -> None:
    """The same table listed twice (even once quoted) is rejected."""
    message = config_error(config_with(tables=[{"name": "public.orders"}, {"name": '"public".orders'}]))
    assert "tables: listed more than once: public.orders" in message


def test_empty_tables_rejected() -> None:
    """An empty table list is rejected."""
    assert "tables: list at least one table" in config_error(config_with(tables=[]))


def test_missing_required_fields() -> None:
    """Missing source.dbname and tables are reported."""
    message = config_error({"source": {}})
    assert "source.dbname: Field required" in message
    assert "tables: Field required" in message


def test_bad_staging_url_scheme() -> None:
    """A staging url that is neither file:// nor s3:// is rejected at staging.url."""
    message = config_error(config_with(staging={"url": "http://bucket/prefix"}))
    assert "staging.url: must start with file:// or s3://" in message


def test_values_out_of_range_takes_only_the_documented_rules() -> None:
    """``values.out_of_range`` is clamp or null; anything else names the field and the choices."""
    assert parse_config(config_with(values={"out_of_range": "null"})).values.out_of_range == "null"
    message = config_error(config_with(values={"out_of_range": "saturate"}))
    assert "values.out_of_range: Input should be 'clamp' or 'null'" in message
    assert "values.policy: unknown field" in config_error(config_with(values={"policy": "clamp"}))


def test_other_field_errors() -> None:
    """Range and pattern violations name their fields."""
    message = config_error(
        config_with(
            source={"dbname": "app", "port": 0},
            snapshot={"chunk_pages": 0},
            replication={"slot": "Bad-Slot"},
            iceberg={"namespace": "{scheme}"},
        )
    )
    assert "source.port:" in message
    assert "snapshot.chunk_pages:" in message
    assert "replication.slot:" in message
    assert "iceberg.namespace: may only use the placeholder {schema}" in message


def test_flush_min_interval_defaults_and_bounds() -> None:
    """``flush.min_interval_seconds``: 1 s by default, 0 allowed (flush whenever the merger waits),
    negative refused with the field named; above ``interval_seconds`` it is accepted (it then changes nothing)."""
    assert parse_config(copy.deepcopy(MINIMAL)).flush.min_interval_seconds == 1.0
    assert parse_config(config_with(flush={"min_interval_seconds": 0})).flush.min_interval_seconds == 0
    flush = parse_config(config_with(flush={"interval_seconds": 0.5, "min_interval_seconds": 2})).flush
    assert (flush.interval_seconds, flush.min_interval_seconds) == (0.5, 2)
    message = config_error(config_with(flush={"min_interval_seconds": -1}))
    assert "flush.min_interval_seconds: Input should be greater than or equal to 0" in message
    assert "flush.min_interval_seconds:" in config_error(config_with(flush={"min_interval_seconds": "soon"}))


def test_top_level_not_a_mapping() -> None:
    """A YAML list or scalar at the top level is rejected."""
    assert "expected a mapping" in config_error(["source"])
    assert "expected a mapping" in config_error(None)


def test_load_config_valid_file(tmp_path: Path) -> None:
    """load_config reads and validates a YAML file."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        "source:\n  dbname: app\n  password_env: PG_PASS\ntables:\n  - name: public.orders\n"
        "snapshot:\n  chunk_pages: 64\n",
        encoding="utf-8",
    )
    config = load_config(path)
    assert config.source.password_env == "PG_PASS"
    assert config.snapshot.chunk_pages == 64
    assert [t.key for t in config.tables] == ["public.orders"]


def test_load_config_invalid_yaml(tmp_path: Path) -> None:
    """Invalid YAML is a ConfigError naming the file."""
    path = tmp_path / "broken.yaml"
    path.write_text("source: [unclosed\ntables: {\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="is not valid YAML") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_load_config_missing_file(tmp_path: Path) -> None:
    """A missing file is a ConfigError naming the file."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_load_config_reports_file_in_field_errors(tmp_path: Path) -> None:
    """Field errors from a file name the file and the field."""
    path = tmp_path / "bad.yaml"
    path.write_text("source:\n  dbname: app\n  hots: x\ntables:\n  - name: public.orders\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"invalid configuration in {path}" in str(info.value)
    assert "source.hots: unknown field" in str(info.value)


def test_conninfo_takes_password_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """conninfo() reads the password from the variable named by password_env; describe() omits it."""
    monkeypatch.setenv("PG2ICEBERG_TEST_PASSWORD", SECRET)
    connection = PostgresConnection(
        dbname="app", host="db.example", port=6543, user="repl", password_env="PG2ICEBERG_TEST_PASSWORD"
    )
    conninfo = connection.conninfo()
    assert f"password={SECRET}" in conninfo
    assert "host=db.example" in conninfo
    assert "port=6543" in conninfo
    assert "user=repl" in conninfo
    assert "dbname=app" in conninfo
    assert "replication=database" in connection.conninfo(replication="database")
    assert connection.describe() == "postgresql://repl@db.example:6543/app"
    assert SECRET not in connection.describe()
    assert SECRET not in repr(connection)


def test_conninfo_reads_env_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The password is read when conninfo() is called, not when the config is parsed."""
    connection = PostgresConnection(dbname="app", password_env="PG2ICEBERG_TEST_PASSWORD")
    monkeypatch.setenv("PG2ICEBERG_TEST_PASSWORD", "first")
    assert "password=first" in connection.conninfo()
    monkeypatch.setenv("PG2ICEBERG_TEST_PASSWORD", "second")
    assert "password=second" in connection.conninfo()


def test_conninfo_without_password_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without password_env no password is put in the connection string."""
    monkeypatch.setenv("PGPASSWORD", SECRET)
    conninfo = PostgresConnection(dbname="app").conninfo()
    assert "password" not in conninfo
    assert "dbname=app" in conninfo


def test_missing_env_var_is_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A password_env naming an unset variable raises ConfigError naming the variable, not any secret."""
    monkeypatch.delenv("PG2ICEBERG_UNSET_PASSWORD", raising=False)
    monkeypatch.setenv("PG2ICEBERG_TEST_PASSWORD", SECRET)
    connection = PostgresConnection(dbname="app", password_env="PG2ICEBERG_UNSET_PASSWORD")
    with pytest.raises(ConfigError) as info:
        connection.conninfo()
    message = str(info.value)
    assert "PG2ICEBERG_UNSET_PASSWORD" in message
    assert "is not set" in message
    assert SECRET not in message


def test_programmatic_password_is_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """A password set programmatically wins over password_env and never shows in repr or dumps."""
    monkeypatch.setenv("PG2ICEBERG_TEST_PASSWORD", "from-env")
    connection = PostgresConnection(dbname="app", password=SecretStr(SECRET), password_env="PG2ICEBERG_TEST_PASSWORD")
    assert f"password={SECRET}" in connection.conninfo()
    assert SECRET not in repr(connection)
    assert SECRET not in str(connection)
    assert SECRET not in str(connection.model_dump())
    assert SECRET not in connection.model_dump_json()


def test_password_not_in_repr_of_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The resolved password does not appear in repr(config), only the variable's name."""
    monkeypatch.setenv("PG2ICEBERG_TEST_PASSWORD", SECRET)
    config = parse_config(config_with(source={"dbname": "app", "password_env": "PG2ICEBERG_TEST_PASSWORD"}))
    assert SECRET in config.source.conninfo()
    assert "PG2ICEBERG_TEST_PASSWORD" in repr(config)
    assert SECRET not in repr(config)
    assert SECRET not in str(config)


def test_password_not_in_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad config that names password_env reports the bad field without the password."""
    monkeypatch.setenv("PG2ICEBERG_TEST_PASSWORD", SECRET)
    data = config_with(
        source={"dbname": "app", "password_env": "PG2ICEBERG_TEST_PASSWORD", "hots": "x", "port": "not-a-port"},
        state={"dbname": "state", "password_env": "PG2ICEBERG_TEST_PASSWORD", "sslmode": 5},
    )
    message = config_error(data)
    assert "source.hots: unknown field" in message
    assert "source.port:" in message
    assert "state.sslmode:" in message
    assert SECRET not in message


def test_secret_value_in_wrong_field_not_echoed() -> None:
    """A secret pasted into a typed field is not echoed back in the error."""
    message = config_error(config_with(source={"dbname": "app", "port": SECRET, "password": ["nested", SECRET]}))
    assert "source.port:" in message
    assert "source.password:" in message
    assert SECRET not in message


def test_a_schema_entry_selects_a_schema() -> None:
    """A ``tables`` entry with ``schema`` selects a schema's tables by globs; it may stand alone."""
    config = parse_config(config_with(tables=[{"schema": "billing", "exclude": ["tmp_*"]}, {"name": "public.orders"}]))
    assert [(s.schema_name, s.include, s.exclude) for s in config.schemas] == [("billing", ["*"], ["tmp_*"])]
    assert [t.key for t in config.tables] == ["public.orders"]
    assert parse_config(config_with(tables=[{"schema": "billing"}])).tables == []
    assert "schemas.0.includes" in config_error(config_with(tables=[{"schema": "billing", "includes": ["a*"]}]))


def test_the_documented_configuration_is_the_example_file_and_loads() -> None:
    """docs/configuration.md shows ``examples/pg2iceberg.yaml``: what a user copies must be what CI loads."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = page.split("# Configuration", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    example = (root / "examples" / "pg2iceberg.yaml").read_text(encoding="utf-8")
    assert example.split("\n", 1)[1] == block  # after the example's header comment
    config = load_config(root / "examples" / "pg2iceberg.yaml")
    assert config.checks.compare_max_rows == 200_000


def test_on_slot_lost_policy() -> None:
    """replication.on_slot_lost: repair by default, refuse when asked, anything else named as the bad field."""
    assert parse_config(MINIMAL).replication.on_slot_lost == "repair"
    assert parse_config(config_with(replication={"on_slot_lost": "refuse"})).replication.on_slot_lost == "refuse"
    assert "replication.on_slot_lost" in config_error(config_with(replication={"on_slot_lost": "resnapshot"}))


def test_several_hosts_for_a_failover() -> None:
    """A source listing its primary and standbys: one port for all or one per host, and libpq's
    target_session_attrs, in every connection string; a mismatch or a bad port names the field."""
    source = {"dbname": "app", "host": "pg-a, pg-b", "port": "5432,5433", "target_session_attrs": "read-write"}
    connection = parse_config(config_with(source=source)).source
    assert connection.endpoints() == [("pg-a", 5432), ("pg-b", 5433)]
    assert "target_session_attrs=read-write" in connection.conninfo()
    assert connection.describe() == "postgresql://postgres@pg-a:5432,pg-b:5433/app"
    one_port = parse_config(config_with(source={"dbname": "app", "host": "pg-a,pg-b", "port": 6543})).source
    assert one_port.endpoints() == [("pg-a", 6543), ("pg-b", 6543)]
    assert "one port, or one per host" in config_error(config_with(source={**source, "port": "1,2,3"}))
    assert "source.port: expected a port number" in config_error(config_with(source={**source, "port": "5432,x"}))
    assert "source.target_session_attrs" in config_error(config_with(source={**source, "target_session_attrs": "rw"}))


def test_failover_slot_setting() -> None:
    """replication.failover_slot: auto by default (a failover slot on PostgreSQL 17+), or true/false."""
    assert parse_config(MINIMAL).replication.failover_slot == "auto"
    assert parse_config(config_with(replication={"failover_slot": False})).replication.failover_slot is False
    assert "replication.failover_slot" in config_error(config_with(replication={"failover_slot": "sometimes"}))


def test_cuts_config_defaults_and_bad_values_name_the_field() -> None:
    config = parse_config(config_with(cuts={"interval_minutes": 15, "groups": {"sales": ["public.orders"]}}))
    assert config.cuts.keep == 24 and config.cuts.max_age_hours is None
    assert config.cuts.groups == {"sales": ["public.orders"]}
    assert parse_config(config_with(cuts={"interval_minutes": 360})).cuts.interval_minutes == 360
    message = config_error(config_with(cuts={"interval_minutes": 7}))
    assert "cuts.interval_minutes" in message and "divisor of 60" in message
    assert "cuts.interval_minutes" in config_error(config_with(cuts={"interval_minutes": 90}))
    assert "cuts.keep" in config_error(config_with(cuts={"keep": 0}))
    message = config_error(config_with(cuts={"groups": {"sales": ["orders"]}}))
    assert "cuts.groups" in message and "'orders' is not schema.table" in message
    assert "lists no table" in config_error(config_with(cuts={"groups": {"empty": []}}))
