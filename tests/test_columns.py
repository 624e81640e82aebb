"""Column selection, masking and row filters (issue 32 parts 1 and 2): Iceberg holds exactly the source's
rows that pass ``where``, with only the mirrored columns and the masked ones masked, through the snapshot
and the stream (updates, deletes, key changes, rows moving into and out of the filter, unchanged TOAST
values, ADD COLUMN). Each test compares Iceberg with the live source row by row, the expectation computed
here from the source (its own HMAC, not the pipeline's), and greps every staged and Iceberg file and the
logs for the raw values of excluded and masked columns."""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from pg2iceberg_dagster import checks
from pg2iceberg_dagster.config import TableConfig
from pg2iceberg_dagster.dagster_integration.assets import _table_schema
from pg2iceberg_dagster.dagster_integration.mirror import Mirror
from pg2iceberg_dagster.dagster_integration.translator import Pg2IcebergTranslator
from pg2iceberg_dagster.errors import ConfigError, StartupCheckError
from pg2iceberg_dagster.source.policy import REDACTED
from pg2iceberg_dagster.source.publication_policy import describe_policy

from .conftest import SourceDb, assert_mirrored, sync

pytestmark = pytest.mark.usefixtures("spark")

KEY = "public.users"
KEY_ENV = "PG2ICEBERG_TEST_MASK_KEY"
SECRET = "test-secret-key"
# Raw values that must reach no staged file, Iceberg file or log line.
RAW = ["SECRETVAL", "RAWMAIL", "RAWPHONE", "RAWNOTE", "RAWBIO", "EXTRAVAL"]

USERS = {
    "name": "public.users",
    "columns": {"exclude": ["secret"]},
    "mask": {"email": "hash", "phone": "redact", "note": "null", "bio": "hash"},
    "mask_key_env": KEY_ENV,
    "where": "tenant = 1",
}


def _create_users(source: SourceDb) -> None:
    source.execute(
        "CREATE TABLE public.users (tenant int, id int, name text, email text, phone text, secret text, note text, "
        "bio text, PRIMARY KEY (tenant, id))"
    )
    # bio: incompressible and large, so it is TOASTed out of line and an UPDATE not touching it sends it
    # as unchanged.
    source.execute(
        "INSERT INTO public.users SELECT g % 3, g, 'n' || g, 'RAWMAIL' || g || '@example.com', 'RAWPHONE' || g, "
        "'SECRETVAL' || g, 'RAWNOTE' || g, CASE WHEN g % 4 = 0 THEN 'RAWBIO' || (SELECT string_agg(md5(random()::text "
        "|| g || s), '') FROM generate_series(1, 300) s) END FROM generate_series(1, 300) g"
    )


def _hash(value: str | None) -> str | None:
    return None if value is None else hmac.new(SECRET.encode(), value.encode(), hashlib.sha256).hexdigest()


def _expected(source: SourceDb, extra: bool = False) -> list[tuple[Any, ...]]:
    """The source's rows as the mirror must hold them, computed here: filtered, projected, masked."""
    rows = source.execute("SELECT tenant, id, name, email, phone, bio FROM public.users WHERE tenant = 1")
    return sorted(
        (tenant, id_, name, _hash(email), None if phone is None else REDACTED, None, _hash(bio))
        for tenant, id_, name, email, phone, bio in rows
    )


def _mirrored(pipeline: Any, source: SourceDb) -> list[tuple[Any, ...]]:
    table = pipeline.catalog.load_table((f"{source.name}_public", "users"))
    assert "secret" not in table.schema().column_names and "extra" not in table.schema().column_names
    rows = table.scan().to_arrow().to_pylist()
    return sorted((r["tenant"], r["id"], r["name"], r["email"], r["phone"], r["note"], r["bio"]) for r in rows)


def _files_holding_raw(root: Path) -> list[str]:
    """Files under ``root`` holding a raw value: Parquet files by their decoded content (they are
    compressed), every file by its bytes too."""
    found = []
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        texts = [path.read_bytes().decode("latin-1")]
        if path.suffix == ".parquet":
            parquet = pq.read_table(path)
            texts.append(str(parquet.to_pylist()) + str(pq.ParquetFile(path).metadata.metadata))
        if any(raw in text for raw in RAW for text in texts):
            found.append(str(path))
    return found


def test_excluded_masked_and_filtered_rows_mirror_exactly_and_raw_values_stay_out(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Snapshot, then updates, deletes, key changes, rows moved into and out of the filter, unchanged
    TOAST values of a masked column and a column added later: Iceberg equals the filtered, projected,
    masked source row by row, verify agrees, and no raw value is in any staged or Iceberg file or log."""
    caplog.set_level(logging.DEBUG, logger="pg2iceberg_dagster")
    monkeypatch.setenv(KEY_ENV, SECRET)
    _create_users(source)
    pipeline = source.pipeline(source.config([USERS]))
    report = pipeline.validate()
    said = {line for table in report.tables.values() for line in describe_policy(table, report.server_version)}
    assert any("left out by the server" in line and "secret" in line for line in said), said
    assert any("masked by the client" in line and "email (hash)" in line for line in said), said
    assert any("only where tenant = 1, filtered by the server" in line for line in said), said
    pipeline.snapshot()
    assert _mirrored(pipeline, source) == _expected(source)
    published = source.execute(
        "SELECT attnames, rowfilter FROM pg_publication_tables WHERE pubname = %s", (f"pub_{source.name}",)
    )
    assert published == [(["tenant", "id", "name", "email", "phone", "note", "bio"], "(tenant = 1)")]

    source.execute("INSERT INTO public.users VALUES (1, 1000, 'new', 'RAWMAIL-new', NULL, 'SECRETVAL-new', 'x', NULL)")
    source.execute("INSERT INTO public.users VALUES (2, 1001, 'other tenant', 'RAWMAIL-2', 'p', 'SECRETVAL', 'x', 'y')")
    source.execute("UPDATE public.users SET email = 'RAWMAIL-changed' || id WHERE tenant = 1 AND id % 5 = 0")
    source.execute("UPDATE public.users SET name = 'toast kept' WHERE tenant = 1 AND bio IS NOT NULL")  # bio unchanged
    source.execute("UPDATE public.users SET tenant = 1 WHERE tenant = 2 AND id % 7 = 0")  # moved into the filter
    source.execute("UPDATE public.users SET tenant = 0 WHERE tenant = 1 AND id % 11 = 0")  # moved out of it
    source.execute("UPDATE public.users SET id = id + 5000 WHERE tenant = 1 AND id % 13 = 0")  # key change
    source.execute("DELETE FROM public.users WHERE id % 17 = 0")
    source.execute("ALTER TABLE public.users ADD COLUMN extra text")  # not in the publication's column list
    source.execute("UPDATE public.users SET extra = 'EXTRAVAL' || id WHERE id % 3 = 0")
    sync(pipeline)
    assert _mirrored(pipeline, source) == _expected(source)
    assert_mirrored(pipeline)  # verify compares with the same projection, masks and filter

    # A restart reads the publication's column list: the added column stays out, nothing is refused.
    restarted = source.pipeline(source.config([USERS]))
    restarted.validate()
    source.execute("UPDATE public.users SET extra = 'EXTRAVAL', email = 'RAWMAIL-again' WHERE tenant = 1 AND id < 30")
    sync(restarted)
    assert _mirrored(restarted, source) == _expected(source)
    assert_mirrored(restarted)

    # Dagster: the live table's column schema has no excluded column and marks the masked ones.
    config = source.config([USERS])
    schema = _table_schema(Mirror(Pg2IcebergTranslator(config)), config.tables[0], restarted.iceberg_summary(KEY))
    described = {column.name: column.description or "" for column in schema.columns}
    assert list(described) == ["tenant", "id", "name", "email", "phone", "note", "bio"]
    assert described["email"].startswith("masked (hash") and described["note"].startswith("masked (null")
    assert described["tenant"] == "primary key" and described["name"] == ""

    workdir = source.workdir
    warehouse = [p for p in (workdir / "warehouse").iterdir() if p.name.startswith(source.name)]
    assert warehouse
    assert _files_holding_raw(workdir / "staging" / source.name) == []
    for path in warehouse:
        assert _files_holding_raw(path) == []
    assert not [raw for raw in RAW if raw in caplog.text]
    assert SECRET not in caplog.text and SECRET not in repr(report)


def test_an_include_list_mirrors_only_its_columns_and_a_column_added_later_is_never_written(
    source: SourceDb,
) -> None:
    """``include``: the snapshot selects only those columns and the stream stages only them; a column
    added later (not in the list) is never written, and a changed include list is refused for a
    mirrored table with the recovery command."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text, price int, cost int)")
    source.execute("INSERT INTO public.items SELECT g, 'item' || g, g, g * 2 FROM generate_series(1, 50) g")
    entry = {"name": "public.items", "columns": {"include": ["id", "name"]}}
    pipeline = source.pipeline(source.config([entry]))
    pipeline.snapshot()
    source.execute("ALTER TABLE public.items ADD COLUMN margin int")
    source.execute("UPDATE public.items SET name = 'renamed' || id, margin = 7, price = 0 WHERE id % 2 = 0")
    source.execute("DELETE FROM public.items WHERE id % 5 = 0")
    sync(pipeline)
    table = pipeline.catalog.load_table((f"{source.name}_public", "items"))
    assert table.schema().column_names == ["id", "name"]
    mirrored = sorted((r["id"], r["name"]) for r in table.scan().to_arrow().to_pylist())
    assert mirrored == sorted(source.execute("SELECT id, name FROM public.items"))
    assert_mirrored(pipeline)

    wider = {"name": "public.items", "columns": {"include": ["id", "name", "price"]}}
    with pytest.raises(StartupCheckError, match=r"another column list.*DROP TABLE public.items.*cleanup --table"):
        source.pipeline(source.config([wider])).validate()
    renamed = {"name": "public.items", "columns": {"include": ["id", "title"]}}
    with pytest.raises(StartupCheckError, match=r"columns.include names title, which the table does not have"):
        source.pipeline(source.config([renamed])).validate()


def test_bad_policies_are_refused_before_anything_is_written(source: SourceDb, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filter the server refuses, a filter on columns outside the replica identity (every UPDATE of
    the application would then fail), a left-out key, an unset mask key: refused with the reason, and
    no publication or slot is left behind."""
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY, tenant int, v text)")
    monkeypatch.delenv(KEY_ENV, raising=False)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"where": "tenant IN (SELECT 1)"}, StartupCheckError, r"refuses its publication entry.*"),
        ({"where": "no_such_column = 1"}, StartupCheckError, r"no_such_column"),
        ({"where": "tenant = 1"}, StartupCheckError, r"replica identity"),
        ({"columns": {"exclude": ["id"]}}, StartupCheckError, r"leaves out id, a primary key"),
        ({"mask": {"id": "redact"}}, StartupCheckError, r"mask names the primary key column\(s\) id"),
        ({"mask": {"v": "hash"}, "mask_key_env": KEY_ENV}, ConfigError, rf"{KEY_ENV} is not set"),
    ]
    for extra, error, message in cases:
        pipeline = source.pipeline(source.config([{"name": "public.t", **extra}]))
        with pytest.raises(error, match=message):
            pipeline.validate()
    assert source.execute("SELECT count(*) FROM pg_publication") == [(0,)]
    assert source.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()") == [(0,)]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"columns": {"include": ["a"], "exclude": ["b"]}}, "either include or exclude"),
        ({"columns": {}}, "either include or exclude"),
        ({"columns": {"include": []}}, "at least one column"),
        ({"mask": {"a": "scramble"}}, "mask.a"),
        ({"mask": {"a": "hash"}}, "needs mask_key_env"),
        ({"columns": {"exclude": ["a"]}, "mask": {"a": "null"}}, "column a is not mirrored"),
        ({"primary_key": ["a"], "mask": {"a": "null"}}, "in primary_key"),
        ({"where": ""}, "where"),
    ],
)
def test_bad_column_and_row_settings_name_the_field(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TableConfig.model_validate({"name": "public.t", **entry})


def test_a_partitioned_source_filtered_and_masked_mirrors_exactly_and_verify_sees_a_stray_row(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partitioned table with a filter on its partition column, a redacted and an excluded column:
    the leaves' chunks and the parent's stream mirror only the filtered rows; verify compares with the
    same filter, and a row outside it put into Iceberg behind the pipeline's back is a difference."""
    source.execute(
        "CREATE TABLE public.events (id int, region text, v text, secret text, PRIMARY KEY (id, region)) "
        "PARTITION BY LIST (region)"
    )
    source.execute("CREATE TABLE public.events_eu PARTITION OF public.events FOR VALUES IN ('eu')")
    source.execute("CREATE TABLE public.events_other PARTITION OF public.events DEFAULT")
    source.execute(
        "INSERT INTO public.events SELECT g, (ARRAY['eu', 'us'])[g % 2 + 1], 'RAWV' || g, 'SECRETVAL' || g "
        "FROM generate_series(1, 400) g"
    )
    entry = {
        "name": "public.events",
        "columns": {"exclude": ["secret"]},
        "mask": {"v": "redact"},
        "where": "region = 'eu'",
    }
    pipeline = source.pipeline(source.config([entry]))
    pipeline.snapshot()
    source.execute("UPDATE public.events SET region = 'eu' WHERE id % 5 = 0 AND region = 'us'")  # into the filter
    source.execute("UPDATE public.events SET region = 'us' WHERE id % 7 = 0 AND region = 'eu'")  # out of it
    source.execute("UPDATE public.events SET v = NULL WHERE id % 9 = 0")
    source.execute("DELETE FROM public.events WHERE id % 11 = 0")
    sync(pipeline)
    table = pipeline.catalog.load_table((f"{source.name}_public", "events"))
    mirrored = sorted((r["id"], r["region"], r["v"]) for r in table.scan().to_arrow().to_pylist())
    expected = source.execute(
        "SELECT id, region, CASE WHEN v IS NOT NULL THEN %s END FROM public.events WHERE region = 'eu'", (REDACTED,)
    )
    assert mirrored == sorted(expected) and len(mirrored) > 150
    assert_mirrored(pipeline)
    ((_, checked),) = pipeline.check_tables(["public.events"])  # Dagster's matches_source and schema checks
    assert not isinstance(checked, Exception) and checked.content.passed and not checked.schema_problems

    monkeypatch.setattr(checks, "IN_FLIGHT_WAIT_SECONDS", 0.5)  # no flusher runs to wait for
    stray = table.scan(limit=1).to_arrow()
    table.append(stray.set_column(stray.schema.get_field_index("region"), "region", [["us"]]).cast(stray.schema))
    (diff,) = pipeline.verify()
    assert not diff.ok and diff.only_in_iceberg == 1 and diff.differences == 1
    ((_, checked),) = pipeline.check_tables(["public.events"])
    # Not passed: the stray row is the one difference (inconclusive rather than failed here, as no flusher
    # runs to show that no change in flight explains it).
    assert not isinstance(checked, Exception) and not checked.content.passed
    assert checked.content.diff is not None and checked.content.diff.only_in_iceberg == 1


def test_a_masked_column_renamed_while_streaming_stays_masked_and_the_next_start_asks_for_its_new_name(
    source: SourceDb,
) -> None:
    """The flusher keeps masking a renamed column (masks follow its attnum) and the merge renames the
    Iceberg column; the next start refuses the old name in ``mask`` with the fix, and the new one mirrors."""
    source.execute("CREATE TABLE public.people (id int PRIMARY KEY, phone text)")
    source.execute("INSERT INTO public.people SELECT g, 'RAWPHONE' || g FROM generate_series(1, 20) g")
    pipeline = source.pipeline(source.config([{"name": "public.people", "mask": {"phone": "redact"}}]))
    pipeline.snapshot()
    source.execute("ALTER TABLE public.people RENAME COLUMN phone TO mobile")
    source.execute("UPDATE public.people SET mobile = 'RAWPHONE-new' || id WHERE id % 2 = 0")
    source.execute("INSERT INTO public.people VALUES (100, 'RAWPHONE-100'), (101, NULL)")
    sync(pipeline)
    table = pipeline.catalog.load_table((f"{source.name}_public", "people"))
    rows = sorted((r["id"], r["mobile"]) for r in table.scan().to_arrow().to_pylist())
    assert rows == sorted(
        (i, None if v is None else REDACTED) for i, v in source.execute("SELECT * FROM public.people")
    )
    assert _files_holding_raw(source.workdir / "staging" / source.name) == []

    with pytest.raises(StartupCheckError, match=r"mask names phone, which the table does not have \(renamed"):
        source.pipeline(source.config([{"name": "public.people", "mask": {"phone": "redact"}}])).validate()
    assert_mirrored(source.pipeline(source.config([{"name": "public.people", "mask": {"mobile": "redact"}}])))


def test_a_publication_made_by_the_tables_owner_is_taken_by_a_role_that_may_not_try_it(source: SourceDb) -> None:
    """A replication role that does not own the table cannot try its entry (it may not create a
    publication for it, nor plan an UPDATE): the owner's publication is taken when its column list is
    the configured one and it has a filter, and refused when it sends the table whole."""
    role = f"{source.name}_reader"
    for statement in [
        "CREATE TABLE public.t (id int, tenant int, v text, secret text, PRIMARY KEY (id, tenant))",
        f"CREATE ROLE {role} LOGIN REPLICATION",
        f"GRANT SELECT ON public.t TO {role}",
        f"GRANT CREATE ON DATABASE {source.name} TO {role}",
        f"CREATE PUBLICATION pub_{source.name} FOR TABLE public.t (id, tenant, v) WHERE (tenant = 1) "
        "WITH (publish_via_partition_root = true)",
    ]:
        source.execute(statement)
    entry = {"name": "public.t", "columns": {"exclude": ["secret"]}, "where": "tenant = 1"}
    connection = {"host": "127.0.0.1", "port": source.pg.port, "dbname": source.name, "user": role}
    replication = {"slot": f"slot_{source.name}", "publication": f"pub_{source.name}", "create_publication": False}
    config = source.config([entry], source=connection, replication=replication)
    report = source.pipeline(config).validate()
    assert [c.name for c in report.tables["public.t"].columns] == ["id", "tenant", "v"]
    source.execute(f"ALTER PUBLICATION pub_{source.name} SET TABLE public.t")
    with pytest.raises(StartupCheckError, match=r"sends public.t with another column list or row filter"):
        source.pipeline(config).validate()
