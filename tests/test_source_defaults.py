"""A source database whose defaults are not PostgreSQL's: another encoding than UTF-8 (its text
arrives in Iceberg as the same characters, through the snapshot and through the WAL; a SQL_ASCII
database, whose text has no known encoding, is refused before anything is written), and output
settings such as ``bytea_output = escape`` that change the text form the WAL carries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
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


@pytest.mark.usefixtures("spark")
def test_database_output_settings_do_not_change_the_values(source: SourceDb) -> None:
    """``ALTER DATABASE ... SET`` of the settings that shape text output (bytea as escape, SQL dates
    day first, SQL-standard intervals, another time zone, fewer float digits), as legacy applications
    do: snapshot and WAL give Iceberg the values psycopg reads from the source. With the database's
    escape bytea, arrays of bytea were mangled in Iceberg before (``{A}`` became ``A}``)."""
    for setting, value in [
        ("bytea_output", "escape"),
        ("DateStyle", "SQL, DMY"),
        ("IntervalStyle", "sql_standard"),
        ("TimeZone", "America/New_York"),
        ("extra_float_digits", "0"),
    ]:
        source.execute(f"ALTER DATABASE {source.name} SET {setting} = '{value}'")
    source.execute(
        "CREATE TABLE public.blobs (id int PRIMARY KEY, data bytea, parts bytea[], d date, ts timestamptz, "
        "f8 double precision, iv interval)"
    )
    row = (
        "({}, '\\x00ff5c41'::bytea, ARRAY['\\x41'::bytea, '\\x5c00', NULL], '2021-12-31', "
        "'2020-03-04 05:06:07.5+02', 0.1, '1 day 02:03:04')"
    )
    source.execute(f"INSERT INTO public.blobs VALUES {row.format(1)}, {row.format(2)}")
    pipeline = source.pipeline(source.config(["public.blobs"]))
    pipeline.snapshot()
    source.execute(f"INSERT INTO public.blobs VALUES {row.format(3)}")
    source.execute("UPDATE public.blobs SET data = '\\x7f'::bytea, parts = ARRAY['\\x41'::bytea] WHERE id = 1")
    sync(pipeline)

    # Read back in binary, which no output setting shapes (psycopg's text parser itself misreads an
    # escaped bytea array and refuses SQL dates).
    with psycopg.connect(source.conninfo) as conn:
        assert conn.execute("SHOW bytea_output").fetchone() == ("escape",)
        cursor = conn.cursor(binary=True)
        expected = cursor.execute("SELECT id, data, parts, d, ts, f8 FROM public.blobs ORDER BY id").fetchall()
    assert expected[0][2] == [b"A"] and expected[1][2] == [b"A", b"\\\x00", None]
    table = pipeline.catalog.load_table(f"{source.name}_public.blobs")
    rows = sorted(table.scan().to_arrow().to_pylist(), key=lambda row: row["id"])
    got = [(r["id"], r["data"], r["parts"], r["d"], r["ts"], r["f8"]) for r in rows]
    assert got == [tuple(row) for row in expected]
    assert_mirrored(pipeline)
