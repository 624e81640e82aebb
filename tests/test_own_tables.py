"""The pipeline never mirrors its own tables: with the Iceberg SQL catalog and the coordination state in
the source database (one PostgreSQL, a common setup), a schema entry leaves the catalog's and the
coordination tables out and ``validate`` says so; naming one in ``tables`` is refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import PipelineConfig

from .conftest import SourceDb


def _catalog_in_source(source: SourceDb, tables: list[dict[str, str]] | list[str]) -> PipelineConfig:
    config = source.config(tables)
    catalog = config.iceberg.catalog.model_copy(
        update={"postgres": config.source.model_copy(update={"dbname": source.name})}
    )
    return config.model_copy(update={"iceberg": config.iceberg.model_copy(update={"catalog": catalog})})


def _write(path: Path, config: PipelineConfig) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return path


def test_a_schema_entry_leaves_out_the_catalog_and_coordination_tables(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' FROM generate_series(1, 20) g")
    config = _catalog_in_source(source, [{"schema": "public"}, {"schema": "_pg2iceberg"}])
    pipeline = source.pipeline(config)
    assert set(pipeline.snapshot()) == {"public.orders"}
    # The catalog created its tables in public, the state its schema: a new look at the source leaves them out.
    assert {"public.iceberg_tables", "_pg2iceberg.log_index"} <= {
        row[0] for row in source.execute("SELECT format('%s.%s', schemaname, tablename) FROM pg_tables")
    }
    assert main(["-c", str(_write(tmp_path / "p.yaml", config)), "validate"]) == 0
    out = capsys.readouterr().out
    assert "public.orders: 2 columns" in out
    assert "public.iceberg_tables: left out of its schema entry: an Iceberg SQL catalog's table" in out
    assert "_pg2iceberg.log_index: left out of its schema entry: the pipeline's coordination state" in out
    again = source.pipeline(config)
    assert [table.key for table in again.config.tables] == ["public.orders"]
    assert set(again.validate().tables) == {"public.orders"}


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("public.iceberg_tables", "an Iceberg SQL catalog's table"),
        ("_pg2iceberg.mat_cursor", "the pipeline's coordination state"),
    ],
)
def test_naming_an_own_table_is_refused_with_the_reason(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, reason: str
) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY)")
    source.pipeline(_catalog_in_source(source, ["public.orders"])).snapshot()  # creates both
    path = _write(tmp_path / "p.yaml", _catalog_in_source(source, ["public.orders", name]))
    assert main(["-c", str(path), "validate"]) == 3
    err = capsys.readouterr().err
    assert f"{name} is {reason}" in err and "remove it from tables" in err
