"""The privacy grep of issue 32's Done-when: distinctive marker values written into excluded columns (by
the snapshot's rows and by streamed changes: inserts, a TOAST-sized value, an UPDATE changing only the
excluded column, a column added later by DDL under the exclude list) appear in no staged file, no
Iceberg data, metadata or manifest file, no coordination table and no log line of the pipeline; nor
does the raw value of a hashed column, whose hash (computed here) is in the Iceberg data.

The grep is proven able to fail: a control table with the same columns and changes but nothing
excluded or masked has its markers found, by the same functions, in the staged files, the Iceberg data
files and the Iceberg manifests (whose column bounds hold the values' first characters); the
coordination dump and the logs are shown to hold the table's name. The pipeline runs as its commands
do in production (``snapshot``, ``stream``, ``materialize`` processes, verbose), and their whole output
is the log grepped, with the test process's own log records (every logger, DEBUG) of ``verify``."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import subprocess
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
import yaml
from psycopg import sql

from .conftest import SourceDb, assert_mirrored, sync

KEY_ENV = "PG2ICEBERG_TEST_PRIVACY_KEY"
SECRET = "privacy-test-key"
# Excluded columns' markers (ZQX...) and the control table's (ZQC...): short enough (<= 16 characters
# with the row number) for an Iceberg manifest's string bounds to hold them whole.
EXCLUDED_MARKERS = ["ZQXSSN", "ZQXDIAG", "ZQXLATER"]
RAW_MAIL = "ZQXMAIL"
CONTROL_MARKERS = ["ZQCSSN", "ZQCDIAG", "ZQCLATER", "ZQCMAIL"]


def _create(source: SourceDb, table: str, prefix: str) -> None:
    """A table whose ``ssn``, ``diagnosis`` and ``email`` values start with ``prefix`` markers; every
    5th diagnosis TOAST-sized (incompressible, stored out of line)."""
    columns = "id int PRIMARY KEY, shown text, email text, ssn text, diagnosis text"
    source.execute(f"CREATE TABLE public.{table} ({columns})")
    source.execute(
        f"INSERT INTO public.{table} SELECT g, 'shown' || g, '{prefix}MAIL' || g, '{prefix}SSN' || g, "
        f"'{prefix}DIAG' || g || CASE WHEN g % 5 = 0 THEN (SELECT string_agg(md5(g || '-' || s), '') "
        "FROM generate_series(1, 300) s) ELSE '' END FROM generate_series(1, 40) g"
    )


def _stream_changes(source: SourceDb, table: str, prefix: str) -> None:
    """Streamed changes carrying markers in every way the excluded columns can be written."""
    source.execute(
        f"INSERT INTO public.{table} SELECT g, 'shown' || g, '{prefix}MAIL' || g, '{prefix}SSN' || g, "
        f"'{prefix}DIAG' || g || (SELECT string_agg(md5(g || '+' || s), '') FROM generate_series(1, 300) s) "
        "FROM generate_series(100, 110) g"
    )
    source.execute(f"UPDATE public.{table} SET ssn = '{prefix}SSN' || (id + 1000) WHERE id % 2 = 0")  # only it
    source.execute(f"UPDATE public.{table} SET shown = 'kept toast' || id WHERE id % 5 = 0")  # TOAST unchanged
    source.execute(f"UPDATE public.{table} SET email = '{prefix}MAIL' || (id + 2000) WHERE id % 3 = 0")
    source.execute(f"DELETE FROM public.{table} WHERE id % 7 = 0")
    source.execute(f"ALTER TABLE public.{table} ADD COLUMN later text")
    source.execute(f"UPDATE public.{table} SET later = '{prefix}LATER' || id WHERE id % 4 = 0")
    source.execute(f"INSERT INTO public.{table} VALUES (200, 'new', '{prefix}MAIL200', NULL, NULL, '{prefix}LATER200')")


def _avro_content(data: bytes) -> bytes:
    """An Avro container file's header and its blocks decompressed (Iceberg writes manifests deflated)."""
    position = 4  # the magic bytes

    def long() -> int:
        nonlocal position
        shift = result = 0
        while True:
            byte = data[position]
            position += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return (result >> 1) ^ -(result & 1)

    def raw() -> bytes:
        nonlocal position
        size = long()
        position += size
        return data[position - size : position]

    meta: dict[bytes, bytes] = {}
    while count := long():
        if count < 0:  # a block with its size in bytes
            count, _ = -count, long()
        for _ in range(count):
            name = raw()
            meta[name] = raw()
    position += 16  # the sync marker
    codec = meta.get(b"avro.codec", b"null")
    content = [data[:position]]
    while position < len(data):
        long()  # the block's object count
        block = raw()
        content.append(zlib.decompress(block, -15) if codec == b"deflate" else block)
        position += 16
    return b"".join(content)


def _file_texts(path: Path) -> list[str]:
    """A file's bytes, and its decoded content where it is compressed (Parquet pages, Avro blocks)."""
    data = path.read_bytes()
    texts = [data.decode("latin-1")]
    if path.suffix == ".parquet":
        parquet = pq.read_table(path)
        texts.append(str(parquet.to_pylist()) + str(pq.ParquetFile(path).metadata.metadata))
    elif path.suffix == ".avro":
        texts.append(_avro_content(data).decode("latin-1"))
    return texts


def _found(texts: Iterable[str], markers: list[str]) -> set[str]:
    """Which markers occur in ``texts`` (as text, or in hex as a bytea's text form shows it)."""
    joined = "\n".join(texts)
    return {marker for marker in markers if marker in joined or marker.encode().hex() in joined}


def _files(root: Path, suffixes: set[str] | None = None) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file() and (suffixes is None or path.suffix in suffixes)]


def _in_files(paths: list[Path], markers: list[str]) -> set[str]:
    return _found((text for path in paths for text in _file_texts(path)), markers)


def _coordination_dump(source: SourceDb) -> str:
    """Every row of every coordination table, as text."""
    with psycopg.connect(source.conninfo, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = '_pg2iceberg' ORDER BY tablename"
        ).fetchall()
        assert len(tables) > 5, tables
        lines = []
        for (table,) in tables:
            query = sql.SQL("SELECT {}::text FROM {} t").format(
                sql.Identifier("t"), sql.Identifier("_pg2iceberg", table)
            )
            lines += [f"{table}: {row}" for (row,) in conn.execute(query).fetchall()]
    return "\n".join(lines)


def _command(config: Path, log: Path, *args: str) -> None:
    """Run a ``pg2iceberg-dagster`` command (verbose) in its own process, its output appended to ``log``."""
    with log.open("ab") as output:
        command = [sys.executable, "-m", "pg2iceberg_dagster.cli", "-c", str(config), "-v", *args]
        code = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=os.environ, timeout=600).returncode
    assert code == 0, log.read_text()[-3000:]


def test_excluded_values_and_raw_masked_values_appear_in_no_file_table_or_log(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, the pipeline's and its libraries'
    monkeypatch.setenv(KEY_ENV, SECRET)
    _create(source, "patients", "ZQX")
    _create(source, "control", "ZQC")
    entry = {
        "name": "public.patients",
        "columns": {"exclude": ["ssn", "diagnosis"]},
        "mask": {"email": "hash"},
        "mask_key_env": KEY_ENV,
    }
    config = source.config([entry, "public.control"])
    path, log = tmp_path / "pg2iceberg.yaml", tmp_path / "pipeline.log"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    _command(path, log, "snapshot")
    _stream_changes(source, "patients", "ZQX")
    _stream_changes(source, "control", "ZQC")
    _command(path, log, "stream", "--until-caught-up")
    source.execute("UPDATE public.patients SET ssn = 'ZQXSSN-again', later = 'ZQXLATER-again' WHERE id < 10")
    source.execute("UPDATE public.control SET ssn = 'ZQCSSN-again', later = 'ZQCLATER-again' WHERE id < 10")
    _command(path, log, "stream", "--until-caught-up")  # a restart streams the same way
    _command(path, log, "materialize", "--once")
    restarted = source.pipeline(config)
    assert_mirrored(restarted)
    logs = log.read_text() + caplog.text

    patients = restarted.catalog.load_table((f"{source.name}_public", "patients"))
    assert patients.schema().column_names == ["id", "shown", "email"]
    rows = patients.scan().to_arrow().to_pylist()
    assert len(rows) == source.execute("SELECT count(*) FROM public.patients")[0][0] > 40
    (mail,) = source.execute("SELECT email FROM public.patients WHERE id = 1")[0]
    hashed = hmac.new(SECRET.encode(), mail.encode(), hashlib.sha256).hexdigest()

    staged = _files(source.workdir / "staging" / source.name)
    warehouse = [p for p in (source.workdir / "warehouse").iterdir() if p.name.startswith(source.name)]
    iceberg = [path for root in warehouse for path in _files(root)]
    data = [path for path in iceberg if path.suffix == ".parquet"]
    manifests = [path for path in iceberg if path.suffix == ".avro"]
    assert staged and data and manifests and any(path.suffix == ".json" for path in iceberg)

    # The control: the same grep finds the markers of columns that are mirrored as they are.
    assert _in_files(staged, CONTROL_MARKERS) == set(CONTROL_MARKERS)
    assert _in_files(data, CONTROL_MARKERS) == set(CONTROL_MARKERS)
    assert _in_files([p for p in manifests if "control" in str(p)], CONTROL_MARKERS) >= {"ZQCSSN", "ZQCMAIL"}
    dump = _coordination_dump(source)
    assert "public.patients" in dump and "public.patients" in logs

    secret_markers = [*EXCLUDED_MARKERS, RAW_MAIL]
    assert _in_files(staged, secret_markers) == set()
    assert _in_files(iceberg, secret_markers) == set()
    assert _found([dump], secret_markers) == set()
    assert _found([logs], [*secret_markers, SECRET]) == set()
    assert hashed in "\n".join(text for path in data if "patients" in str(path) for text in _file_texts(path))


def test_a_hashed_column_after_an_excluded_one_stays_hashed_when_a_rename_precedes_the_flusher(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch, spark: Any
) -> None:
    """Changes read after a RENAME carry the older names, so the flusher places their columns by
    position; under a column list the message lacks the excluded column, and counting it put the raw
    value of ``email`` (hashed) into ``plain``, the column before it, in staged files and Iceberg."""
    monkeypatch.setenv(KEY_ENV, SECRET)
    source.execute("CREATE TABLE public.people (id int PRIMARY KEY, ssn text, plain text, email text)")
    source.execute(
        "INSERT INTO public.people SELECT g, 'ZQXSSN' || g, 'p' || g, 'ZQXMAIL' || g FROM generate_series(1, 9) g"
    )
    entry = {
        "name": "public.people",
        "columns": {"exclude": ["ssn"]},
        "mask": {"email": "hash"},
        "mask_key_env": KEY_ENV,
    }
    pipeline = source.pipeline(source.config([entry]))
    pipeline.snapshot()
    source.execute("UPDATE public.people SET email = 'ZQXMAIL-new' || id, plain = 'q' || id")
    source.execute("ALTER TABLE public.people RENAME COLUMN plain TO plain2")
    source.execute("UPDATE public.people SET plain2 = 'r' WHERE id = 1")  # the rename reaches Iceberg with it
    sync(pipeline)
    table = pipeline.catalog.load_table((f"{source.name}_public", "people"))
    rows = sorted((r["id"], r["plain2"], r["email"]) for r in table.scan().to_arrow().to_pylist())
    expected = [
        (i, p, hmac.new(SECRET.encode(), e.encode(), hashlib.sha256).hexdigest())
        for i, p, e in source.execute("SELECT id, plain2, email FROM public.people ORDER BY id")
    ]
    assert rows == expected
    assert _in_files(_files(source.workdir / "staging" / source.name), [*EXCLUDED_MARKERS, RAW_MAIL]) == set()
