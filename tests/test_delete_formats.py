"""The delete format chosen for a table's readers, the startup check that refuses what a declared
reader cannot read, and an existing table switched to a new format: no Spark, no PostgreSQL
(tests/test_independent_readers.py reads the formats with each engine)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from pg2iceberg_dagster.config import PipelineConfig, parse_config
from pg2iceberg_dagster.errors import ConfigError, StartupCheckError
from pg2iceberg_dagster.iceberg.catalog import align_delete_formats
from pg2iceberg_dagster.iceberg.delete_formats import chosen_format, format_properties
from pg2iceberg_dagster.tables import MirroredTables
from pg2iceberg_dagster.validation import check_delete_formats

from .conftest import SourceDb

MINIMAL: dict[str, Any] = {"source": {"dbname": "app"}, "tables": [{"name": "public.orders"}]}


def config(iceberg: dict[str, Any] | None = None, **table: Any) -> PipelineConfig:
    """MINIMAL with ``iceberg`` settings and the ``public.orders`` entry's own ``table`` settings."""
    data = copy.deepcopy(MINIMAL)
    data["tables"][0].update(table)
    if iceberg is not None:
        data["iceberg"] = iceberg
    return parse_config(data)


def refusal(pipeline: PipelineConfig) -> str:
    """The message of the startup check's refusal of ``pipeline``."""
    with pytest.raises(StartupCheckError) as info:
        check_delete_formats(pipeline)
    return str(info.value)


@pytest.mark.parametrize(
    ("readers", "expected"),
    [
        ([], "merge-on-read"),
        (["spark", "pyiceberg", "duckdb", "daft", "trino", "athena", "snowflake"], "merge-on-read"),
        (["duckdb", "databricks"], "copy-on-write"),
    ],
)
def test_the_format_is_chosen_for_the_readers(readers: list[str], expected: str) -> None:
    """The cheapest format every reader reads and this project writes (deletion vectors: not yet)."""
    assert chosen_format(readers) == expected
    pipeline = config({"readers": readers} if readers else {})
    assert pipeline.delete_format_of(pipeline.tables[0]) == (expected if readers else None)
    check_delete_formats(pipeline)


def test_a_table_overrides_the_pipeline() -> None:
    """A table's own format or readers win over the pipeline's; nothing declared keeps table_properties."""
    assert config().delete_format_of(config().tables[0]) is None
    both = config({"delete_format": "merge-on-read"}, delete_format="copy-on-write")
    assert both.delete_format_of(both.tables[0]) == "copy-on-write"
    readers = config({"delete_format": "merge-on-read"}, readers=["databricks"])
    assert readers.delete_format_of(readers.tables[0]) == "copy-on-write"
    assert readers.readers_of(readers.tables[0]) == ["databricks"]


def test_unknown_readers_and_formats_are_config_errors() -> None:
    with pytest.raises(ConfigError) as info:
        config({"readers": ["spark", "excel"]})
    message = str(info.value)
    assert "iceberg.readers.1" in message and "'excel' is not a reader" in message and "delete_format" in message
    with pytest.raises(ConfigError) as info:
        config(delete_format="equality-deletes")
    message = str(info.value)
    assert "tables.0.delete_format" in message and "'copy-on-write', 'merge-on-read' or 'deletion-vectors'" in message


def test_a_reader_that_cannot_read_the_format_is_refused() -> None:
    """Databricks reads no v2 position deletes: named with the table, the format and the fix."""
    message = refusal(config({"readers": ["duckdb", "databricks"]}, delete_format="merge-on-read"))
    assert "table public.orders: databricks cannot read merge-on-read (Iceberg v2 position delete files)" in message
    assert "set tables.0.delete_format: copy-on-write, or take databricks out of its readers" in message
    check_delete_formats(config({"readers": ["duckdb", "databricks"]}, delete_format="copy-on-write"))


def test_deletion_vectors_are_refused_with_the_reason() -> None:
    """pyiceberg 0.12 cannot write a v3 table (see test_pyiceberg_still_cannot_write_a_v3_table)."""
    message = refusal(config({"delete_format": "deletion-vectors", "readers": ["databricks"]}))
    assert "table public.orders: deletion-vectors needs an Iceberg format-version 3 table" in message
    assert "apache/iceberg-python#1551" in message and "set tables.0.delete_format: copy-on-write" in message
    message = refusal(config({"table_properties": {"format-version": "3"}}))
    assert "iceberg.table_properties.format-version: 3 is refused" in message


def test_write_modes_against_the_declared_format_are_refused() -> None:
    mor = {f"write.{kind}.mode": "merge-on-read" for kind in ("merge", "update", "delete")}
    message = refusal(config({"table_properties": mor}, delete_format="copy-on-write"))
    assert "iceberg.table_properties sets write.merge.mode: merge-on-read" in message
    assert "remove the write.*.mode entries" in message
    check_delete_formats(config({"table_properties": mor}))  # nothing declared: the properties decide


def test_pyiceberg_still_cannot_write_a_v3_table(tmp_path: Path) -> None:
    """Why deletion-vectors is refused. Once pyiceberg writes v3 metadata this fails: offer the format
    (WRITABLE in iceberg/delete_formats.py) and add its column to tests/test_independent_readers.py."""
    catalog = SqlCatalog("v3", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}")
    catalog.create_namespace("ns")
    schema = pa.schema([pa.field("id", pa.int64())])
    with pytest.raises(NotImplementedError, match="Writing V3 is not yet supported"):
        catalog.create_table("ns.t", schema=schema, properties={"format-version": "3"})


def test_an_existing_table_takes_the_new_format_for_later_writes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A merge-on-read table whose readers now include Databricks gets copy-on-write write modes in
    one commit, and the log says its delete files stay until ``maintain``; a second pass commits nothing."""
    catalog = SqlCatalog("pg2iceberg", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}")
    catalog.create_namespace("public")
    schema = pa.schema([pa.field("id", pa.int64())])
    table = catalog.create_table("public.orders", schema=schema, properties=format_properties("merge-on-read"))
    pipeline = config({"readers": ["spark", "databricks"]})
    tables = MirroredTables(pipeline)
    with caplog.at_level(logging.WARNING):
        align_delete_formats(catalog, pipeline, [tables["public.orders"]])
    aligned = catalog.load_table("public.orders")
    assert {key: aligned.properties[key] for key in ("write.merge.mode", "write.update.mode", "write.delete.mode")} == {
        "write.merge.mode": "copy-on-write",
        "write.update.mode": "copy-on-write",
        "write.delete.mode": "copy-on-write",
    }
    assert len(aligned.metadata.metadata_log) == len(table.metadata.metadata_log) + 1
    assert "table public.orders: merges write copy-on-write (no delete files) from now on" in caplog.text
    assert "(was merge-on-read (Iceberg v2 position delete files))" in caplog.text
    assert "`pg2iceberg-dagster maintain --table public.orders`" in caplog.text
    align_delete_formats(catalog, pipeline, [tables["public.orders"]])
    assert catalog.load_table("public.orders").metadata_location == aligned.metadata_location


def test_startup_refuses_before_writing_and_a_format_change_reaches_the_table(source: SourceDb) -> None:
    """Through ``Pipeline.validate`` on a real source: a refused combination writes nothing (no
    coordination schema, no slot); a snapshotted merge-on-read table whose readers then include
    Databricks takes copy-on-write at the next startup."""
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, note text)")
    source.execute("INSERT INTO public.orders SELECT g, 'n' || g FROM generate_series(1, 50) g")
    iceberg = source.config(["public.orders"]).iceberg.model_dump(mode="json", exclude_none=True)
    entry = {"name": "public.orders", "delete_format": "merge-on-read"}
    refused = source.pipeline(source.config([entry], iceberg={**iceberg, "readers": ["databricks"]}))
    with pytest.raises(StartupCheckError, match="databricks cannot read merge-on-read"):
        refused.validate()
    assert source.execute("SELECT count(*) FROM pg_namespace WHERE nspname = '_pg2iceberg'") == [(0,)]
    assert source.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()") == [(0,)]

    first = source.pipeline(source.config(["public.orders"], iceberg={**iceberg, "delete_format": "merge-on-read"}))
    first.snapshot()
    table = first.catalog.load_table(first.tables["public.orders"].iceberg)
    assert table.properties["write.merge.mode"] == "merge-on-read" and table.scan().to_arrow().num_rows == 50
    first.close()
    second = source.pipeline(source.config(["public.orders"], iceberg={**iceberg, "readers": ["databricks"]}))
    second.validate()
    table = second.catalog.load_table(second.tables["public.orders"].iceberg)
    assert [table.properties[f"write.{kind}.mode"] for kind in ("merge", "update", "delete")] == ["copy-on-write"] * 3
