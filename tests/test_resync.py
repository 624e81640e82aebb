"""Online resync of one table: what the WAL cannot follow is copied again while the rest streams.

Every test changes a live source before, during and after the resync and compares Iceberg with
PostgreSQL row by row; readers during the copy must see the table as it was, never half of it.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.errors import ResyncRequiredError, UnsupportedTypeError
from pg2iceberg_dagster.snapshot import resync

from .conftest import Crash, SourceDb, assert_mirrored, pipeline_running, sync

pytestmark = pytest.mark.usefixtures("spark")


def _rows(pipeline: Any, source: SourceDb, table: str) -> list[dict[str, Any]]:
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.{table}")
    return sorted(iceberg.scan().to_arrow().to_pylist(), key=lambda row: row["id"])


def _items(source: SourceDb, rows: int = 400) -> None:
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, code int, v text)")
    source.execute(f"INSERT INTO public.items SELECT g, g % 7, repeat('x', 200) FROM generate_series(1, {rows}) g")
    source.execute("CREATE TABLE public.other (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.other SELECT g, 'o' FROM generate_series(1, 10) g")


def test_a_type_iceberg_cannot_evolve_into_is_resynced_online_while_other_tables_merge(source: SourceDb) -> None:
    """``ALTER COLUMN ... TYPE text USING ...`` rewrites the table with no WAL: the merge requests a
    resync and stops merging that table (not the others); the copy runs while both tables change;
    readers see the old table until one commit switches it; the changes made meanwhile follow."""
    _items(source)
    pipeline = source.pipeline(source.config(["public.items", "public.other"]))
    pipeline.snapshot()
    source.execute("UPDATE public.items SET v = 'before' WHERE id <= 5")
    sync(pipeline)
    source.execute("ALTER TABLE public.items ALTER COLUMN code TYPE text USING 'c' || code::text")
    # A column added with a constant default after the rewrite and changed since: the copy reads its
    # real values, and no fill of the default may follow the switch.
    source.execute("ALTER TABLE public.items ADD COLUMN flag int DEFAULT 7")
    source.execute("UPDATE public.items SET flag = id WHERE id <= 20")
    source.execute("UPDATE public.items SET v = 'after the alter' WHERE id = 6")
    source.execute("UPDATE public.other SET v = 'merged' WHERE id = 1")
    pipeline.stream(until_caught_up=True)
    results = pipeline.materialize()
    assert "column code changed from int to string" in (results["public.items"].resync_reason or "")
    assert results["public.other"].changes == 1
    assert pipeline.resyncs_pending() == {"public.items": results["public.items"].resync_reason}
    before = _rows(pipeline, source, "items")

    seen_during_copy: list[list[dict[str, Any]]] = []

    def write_and_read(_chunk: Any, _rows_read: int) -> None:
        # The source keeps changing during the copy, and readers keep the old table.
        source.execute(
            "UPDATE public.items SET v = 'during', code = 'new' WHERE id = (SELECT min(id) FROM public.items)"
        )
        source.execute("DELETE FROM public.items WHERE id = (SELECT max(id) FROM public.items)")
        source.execute("INSERT INTO public.other SELECT max(id) + 1, 'during' FROM public.other")
        seen_during_copy.append(_rows(pipeline, source, "items"))

    result = pipeline.resync("public.items", on_chunk=write_and_read)
    assert result.chunks > 1 and seen_during_copy
    assert all(rows == before for rows in seen_during_copy)
    assert any("replace code int -> code string" in change for change in result.schema_changes)
    assert pipeline.resyncs_pending() == {}
    source.execute("INSERT INTO public.items VALUES (1000, 'c1000', 'after the resync')")
    sync(pipeline)
    assert_mirrored(pipeline)
    table = pipeline.catalog.load_table(f"{source.name}_public.items")
    assert str(table.schema().find_field("code").field_type) == "string"
    assert [table.schema().find_column_name(i) for i in table.schema().identifier_field_ids] == ["id"]


@pytest.mark.parametrize("point", ["resync.before_switch", "resync.after_switch"])
def test_a_resync_killed_anywhere_finishes_on_the_next_run(
    source: SourceDb, monkeypatch: pytest.MonkeyPatch, point: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed before the switch, the table stays as it was and merges keep waiting; killed after the
    switch, the next run recognises it from the commit and only finishes the bookkeeping."""
    _items(source, rows=100)
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    source.execute("ALTER TABLE public.items ALTER COLUMN code TYPE numeric(5, 1) USING code * 1.5")
    source.execute("UPDATE public.items SET v = 'after' WHERE id = 1")
    before = _rows(pipeline, source, "items")

    def crash(name: str) -> None:
        if name == point:
            raise Crash

    monkeypatch.setattr(resync, "crash_point", crash)
    with pytest.raises(Crash):
        pipeline.resync("public.items", reason="test")
    monkeypatch.undo()
    assert pipeline.resyncs_pending() == {"public.items": "test"}
    source.execute("UPDATE public.items SET v = 'waiting' WHERE id = 2")
    sync(pipeline)
    if point == "resync.before_switch":
        assert _rows(pipeline, source, "items") == before  # merges wait for the resync
    # The CLI's `resync` alone carries out what is pending.
    config_file = tmp_path / "pg2iceberg.yaml"
    config_file.write_text(yaml.safe_dump(pipeline.config.model_dump(mode="json", exclude_none=True)))
    assert main(["-c", str(config_file), "resync"]) == 0
    copied = "public.items: 0 rows" if point == "resync.after_switch" else "public.items: 100 rows"
    assert copied in capsys.readouterr().out
    assert pipeline.resyncs_pending() == {}
    sync(pipeline)
    assert_mirrored(pipeline)


def test_a_default_whose_older_values_no_record_keeps_is_resynced_or_refused(source: SourceDb) -> None:
    """A volatile default fills older rows with values no WAL change carries. With
    ``materialize.auto_resync`` off the merge refuses, naming the column and the command, and writes
    nothing; on (the default) it requests the resync that makes the table exact."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'v' FROM generate_series(1, 10) g")
    refusing = source.pipeline(source.config(["public.items"], materialize={"auto_resync": False}))
    refusing.snapshot()
    source.execute("ALTER TABLE public.items ADD COLUMN token text DEFAULT md5(random()::text)")
    source.execute("INSERT INTO public.items (id, v) VALUES (11, 'after')")
    refusing.stream(until_caught_up=True)
    with pytest.raises(
        ResyncRequiredError, match=r"public\.items: column token was added with a default.*resync --table"
    ):
        refusing.materialize()
    assert "token" not in refusing.catalog.load_table(f"{source.name}_public.items").schema().column_names
    assert refusing.store.mat_cursor("default", "public.items") == 0

    pipeline = source.pipeline(source.config(["public.items"]))
    result = pipeline.materialize()["public.items"]
    assert result.resync_reason and "token" in result.resync_reason and result.changes == 0
    pipeline.resync("public.items")
    sync(pipeline)
    assert_mirrored(pipeline)


def test_run_resyncs_on_its_own_and_keeps_merging_the_other_tables(source: SourceDb) -> None:
    """``run`` notices the request its merge made, resyncs the table in the background and goes on."""
    _items(source, rows=50)
    pipeline = source.pipeline(source.config(["public.items", "public.other"], materialize={"interval_seconds": 0.5}))
    pipeline.snapshot()
    with pipeline_running(pipeline) as errors:
        source.execute("ALTER TABLE public.items ALTER COLUMN code TYPE text USING 'c' || code::text")
        source.execute("UPDATE public.items SET v = 'after' WHERE id < 10")
        source.execute("UPDATE public.other SET v = 'after' WHERE id < 5")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not errors:
            with source.pipeline(pipeline.config) as probe, contextlib.suppress(UnsupportedTypeError):
                # (verify cannot compare a column whose type the resync has not changed yet)
                if not probe.resyncs_pending() and all(diff.ok for diff in probe.verify()):
                    break
            time.sleep(1)
    assert not errors
    assert_mirrored(pipeline)


def test_a_widening_by_rewrite_is_resynced_and_one_without_is_followed(source: SourceDb) -> None:
    """``TYPE bigint USING n * 2`` keeps a type Iceberg widens to, but its rewrite changed every value
    with no WAL change: seen with a new relfilenode, it is resynced. A widening PostgreSQL does
    without a rewrite (numeric precision up) is followed in place."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, n int, price numeric(8, 2))")
    source.execute("INSERT INTO public.items SELECT g, g, g / 4.0 FROM generate_series(1, 50) g")
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    source.execute("ALTER TABLE public.items ALTER COLUMN price TYPE numeric(12, 2)")
    source.execute("UPDATE public.items SET price = 1234567890.12 WHERE id = 1")
    sync(pipeline)
    assert pipeline.resyncs_pending() == {}
    assert_mirrored(pipeline)
    source.execute("ALTER TABLE public.items ALTER COLUMN n TYPE bigint USING n * 2")
    source.execute("UPDATE public.items SET price = 1 WHERE id = 2")
    sync(pipeline)
    assert "column n changed type with a rewrite" in pipeline.resyncs_pending()["public.items"]
    pipeline.resync("public.items")
    sync(pipeline)
    assert_mirrored(pipeline)


def test_a_retype_between_two_merges_and_a_narrowing_are_resynced(source: SourceDb) -> None:
    """A column added, filled and retyped with ``USING`` before the next merge: Iceberg never had its
    first type, the batch holds both. And ``double precision -> real`` rounds every value in a rewrite
    no WAL change carries: the narrower type would hold them in Iceberg, but the values are gone. Both
    are resynced, and the table's type is then the source's."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v double precision)")
    source.execute("INSERT INTO public.items SELECT g, g / 3.0 FROM generate_series(1, 50) g")
    pipeline = source.pipeline(source.config(["public.items"]))
    pipeline.snapshot()
    source.execute("ALTER TABLE public.items ADD COLUMN flag boolean")
    source.execute("UPDATE public.items SET flag = id % 2 = 0 WHERE id <= 10")
    source.execute("ALTER TABLE public.items ALTER COLUMN flag TYPE text USING flag::text || '~'")
    source.execute("UPDATE public.items SET v = -1 WHERE id = 11")
    pipeline.stream(until_caught_up=True)
    result = pipeline.materialize()["public.items"]
    assert "column flag changed from boolean to string" in (result.resync_reason or "")
    pipeline.resync("public.items")
    sync(pipeline)
    assert_mirrored(pipeline)

    source.execute("ALTER TABLE public.items ALTER COLUMN v TYPE real")
    source.execute("UPDATE public.items SET flag = 'changed' WHERE id = 12")
    sync(pipeline)
    assert "column v changed type with a rewrite" in pipeline.resyncs_pending()["public.items"]
    pipeline.resync("public.items")
    sync(pipeline)
    assert_mirrored(pipeline)
    iceberg = pipeline.catalog.load_table(f"{source.name}_public.items")
    assert str(iceberg.schema().find_field("v").field_type) == "float"


def test_a_replica_identity_without_the_key_set_while_mirroring_resyncs_once_it_carries_it(source: SourceDb) -> None:
    """``REPLICA IDENTITY USING INDEX`` on an index without the primary key, set after startup: deletes
    then carry the index's columns only. The merge requests a resync instead of failing on them (the
    other table still merges), the resync refuses while the identity lacks the key, and once it is
    back to DEFAULT the resync makes the table equal to the source."""
    source.execute("CREATE TABLE public.acct (id int PRIMARY KEY, email text NOT NULL, v text)")
    source.execute("CREATE UNIQUE INDEX acct_email ON public.acct (email)")
    source.execute("INSERT INTO public.acct SELECT g, 'e' || g, 'v' FROM generate_series(1, 20) g")
    source.execute("CREATE TABLE public.other (id int PRIMARY KEY, v text)")
    pipeline = source.pipeline(source.config(["public.acct", "public.other"]))
    pipeline.snapshot()
    source.execute("ALTER TABLE public.acct REPLICA IDENTITY USING INDEX acct_email")
    source.execute("DELETE FROM public.acct WHERE id = 3")
    source.execute("UPDATE public.acct SET id = 100 WHERE id = 5")
    source.execute("INSERT INTO public.other VALUES (1, 'merged')")
    pipeline.stream(until_caught_up=True)
    results = pipeline.materialize()
    assert "does not carry the key column(s) id" in (results["public.acct"].resync_reason or "")
    assert results["public.other"].changes == 1
    with pytest.raises(Exception, match="REPLICA IDENTITY USING INDEX acct_email does not carry the key"):
        pipeline.resync("public.acct")
    source.execute("ALTER TABLE public.acct REPLICA IDENTITY DEFAULT")
    source.execute("DELETE FROM public.acct WHERE id = 7")
    pipeline.resync("public.acct")
    source.execute("UPDATE public.acct SET v = 'after' WHERE id = 8")
    sync(pipeline)
    assert pipeline.resyncs_pending() == {}
    assert [row["id"] for row in _rows(pipeline, source, "acct")] == [
        id_ for (id_,) in source.execute("SELECT id FROM public.acct ORDER BY id")
    ]
    assert_mirrored(pipeline)


def test_verify_says_a_table_waits_for_its_resync(source: SourceDb, capsys: pytest.CaptureFixture[str]) -> None:
    """A key widened with a rewrite (int -> bigint) and a value only bigint holds: the merge asks for a
    resync, and verify then says the table waits for it (it failed on the value before, as the Iceberg
    schema is still the old one); after the resync, verify finds the table equal."""
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'v' FROM generate_series(1, 20) g")
    config = source.config(["public.items"])
    path = source.workdir / f"{source.name}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    source.execute("ALTER TABLE public.items ALTER COLUMN id TYPE bigint")
    source.execute("INSERT INTO public.items VALUES (5000000000, 'big')")
    assert main(["-c", str(path), "verify", "--catch-up"]) == 5
    out = capsys.readouterr().out
    assert "public.items: NOT COMPARED: it waits for an online resync (column id changed type" in out
    assert "resync --table public.items" in out
    pipeline.resync("public.items")
    sync(pipeline)
    assert main(["-c", str(path), "verify"]) == 0


def test_a_primary_key_changed_at_the_source_is_resynced_onto_the_new_key(source: SourceDb) -> None:
    """``DROP CONSTRAINT ..._pkey, ADD PRIMARY KEY (code)``: deletes then carry code, not the id the
    Iceberg table is keyed on (a merge dropped them before, as keys it could not hold). The merge asks
    for a resync, which rebuilds the table keyed on code; later changes by the new key follow."""
    source.execute("CREATE TABLE public.acct (id int PRIMARY KEY, code text NOT NULL, v text)")
    source.execute("INSERT INTO public.acct SELECT g, 'c' || g, 'v' FROM generate_series(1, 20) g")
    pipeline = source.pipeline(source.config(["public.acct"]))
    pipeline.snapshot()
    source.execute("ALTER TABLE public.acct DROP CONSTRAINT acct_pkey, ADD PRIMARY KEY (code)")
    source.execute("DELETE FROM public.acct WHERE id = 2")
    source.execute("UPDATE public.acct SET code = 'moved' WHERE id = 3")
    restarted = source.pipeline(source.config(["public.acct"]))  # a process started after the change
    restarted.stream(until_caught_up=True)
    reason = restarted.materialize()["public.acct"].resync_reason or ""
    assert "primary key changed at the source from (id) to (code)" in reason
    restarted.resync("public.acct")
    source.execute("DELETE FROM public.acct WHERE code = 'c4'")
    source.execute("UPDATE public.acct SET code = 'again', v = 'w' WHERE code = 'moved'")
    sync(restarted)
    table = restarted.catalog.load_table(f"{source.name}_public.acct")
    assert [table.schema().find_field(i).name for i in table.schema().identifier_field_ids] == ["code"]
    rows = sorted((r["code"], r["id"], r["v"]) for r in table.scan().to_arrow().to_pylist())
    assert rows == sorted(tuple(row) for row in source.execute("SELECT code, id, v FROM public.acct"))
    assert_mirrored(restarted)
