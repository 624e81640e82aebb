"""A source database in another encoding than UTF-8: its text arrives in Iceberg as the same
characters, through the snapshot and through the WAL; a SQL_ASCII database, whose text has no known
encoding, is refused before anything is written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.errors import StartupCheckError

from .conftest import SourceDb, assert_mirrored, sync, written_anything

COLUMNS = 'id, name, note, code, tags, doc::text, mood::text, "größe"'


@pytest.fixture
def latin1(pg: EmbeddedPostgres, workdir: Path) -> Iterator[SourceDb]:
    db = SourceDb(pg, workdir, encoding="LATIN1")
    try:
        yield db
    finally:
        db.close()


@pytest.mark.usefixtures("spark")
def test_latin1_text_replicates_as_the_same_characters(latin1: SourceDb) -> None:
    """Snapshot, then inserts, updates and deletes through WAL -> staged log -> Spark MERGE: every row in
    Iceberg equals the row psycopg reads from the source (in its own LATIN1 client encoding)."""
    assert latin1.execute("SHOW server_encoding") == [("LATIN1",)]
    latin1.execute("CREATE TYPE public.stimmung AS ENUM ('fröhlich', 'müde')")
    latin1.execute(
        "CREATE TABLE public.people (id int PRIMARY KEY, name text, note varchar(20), code char(6), tags text[], "
        'doc jsonb, mood public.stimmung, "größe" int)'
    )
    latin1.execute(
        "INSERT INTO public.people VALUES (1, 'José Müller', 'ßæø½', 'Ñü', '{Zoë,\"a, b\",Ångström}', "
        "'{\"straße\": \"über\"}', 'fröhlich', 180), (2, 'plain', 'x', 'y', '{}', '[]', 'müde', NULL)"
    )
    pipeline = latin1.pipeline(latin1.config(["public.people"]))
    pipeline.snapshot()
    latin1.execute(
        "INSERT INTO public.people VALUES (3, 'Ærø ¿qué?', '«¡olé!»', 'ÿ', '{ç}', '{\"é\": [\"à\"]}', 'müde', 7)"
    )
    latin1.execute("UPDATE public.people SET note = 'ñandú', tags = '{Größe}' WHERE id = 2")
    latin1.execute("UPDATE public.people SET name = 'Søren', \"größe\" = 181 WHERE id = 1")
    latin1.execute("INSERT INTO public.people VALUES (4, 'gone é', NULL, NULL, NULL, NULL, NULL, NULL)")
    latin1.execute("DELETE FROM public.people WHERE id = 4")
    sync(pipeline)

    expected = [tuple(row) for row in latin1.execute(f"SELECT {COLUMNS} FROM public.people ORDER BY id")]
    table = pipeline.catalog.load_table(f"{latin1.name}_public.people")
    rows = sorted(table.scan().to_arrow().to_pylist(), key=lambda row: row["id"])
    names = ["id", "name", "note", "code", "tags", "doc", "mood", "größe"]
    assert [tuple(row[name] for name in names) for row in rows] == expected
    assert expected[0][1] == "Søren" and expected[2][2] == "«¡olé!»"  # the source holds what was written
    assert_mirrored(pipeline)


def test_sql_ascii_database_is_refused(pg: EmbeddedPostgres, workdir: Path) -> None:
    db = SourceDb(pg, workdir, encoding="SQL_ASCII")
    try:
        db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
        config = db.config(["public.t"])
        with pytest.raises(StartupCheckError, match=r"encoding is SQL_ASCII.*UTF8 database"):
            db.pipeline(config).validate()
        assert written_anything(config) == []
    finally:
        db.close()
