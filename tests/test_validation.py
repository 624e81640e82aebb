"""Every startup check refuses with a message that says what is wrong."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from pg2iceberg_dagster.config import parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.errors import Pg2IcebergError, SlotBusyError, StartupCheckError, UnsupportedTypeError
from pg2iceberg_dagster.source.replication import ReplicationStream

from .conftest import SourceDb, assert_mirrored, footprint, written_anything


def _table(source: SourceDb, ddl: str = "CREATE TABLE public.t (id int PRIMARY KEY, v text)") -> None:
    source.execute(ddl)


def _refuses(source: SourceDb, config, match: str, error=StartupCheckError) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        source.pipeline(config).validate()


def test_missing_table_no_key_and_unsupported_type(source: SourceDb) -> None:
    _refuses(source, source.config(["public.nope"]), "public.nope does not exist")
    _table(source, 'CREATE TABLE public."Mixed" (id int PRIMARY KEY)')
    _table(source, "CREATE TABLE public.lower (id int PRIMARY KEY)")
    _refuses(source, source.config(["public.mixed"]), r"case included: did you mean public\.Mixed\?")
    _refuses(source, source.config(["public.LOWER"]), r"case included: did you mean public\.lower\?")
    _table(source, "CREATE TABLE public.nokey (a int, b text)")
    _refuses(source, source.config(["public.nokey"]), "has no primary key")
    _refuses(source, source.config([{"name": "public.nokey", "primary_key": ["a"]}]), "REPLICA IDENTITY FULL")
    _table(source, "CREATE TABLE public.wide (id int PRIMARY KEY, n numeric(50, 2))")
    _refuses(source, source.config(["public.wide"]), "numeric\\(50,2\\).*does not fit", UnsupportedTypeError)
    # Keys Iceberg cannot take as identifier fields (a schema error deep in pyiceberg before).
    _table(source, "CREATE TABLE public.float_key (id double precision PRIMARY KEY)")
    _table(source, "CREATE TABLE public.array_key (id int[] PRIMARY KEY)")
    for name, iceberg in [("public.float_key", "double"), ("public.array_key", "list<int>")]:
        _refuses(source, source.config([name]), rf"key column id maps to Iceberg {iceberg}.*", UnsupportedTypeError)
    # Every refused table at once, not one per attempt.
    _refuses(
        source,
        source.config(["public.nope", "public.mixed", "public.nokey", "public.wide", "public.lower"]),
        r"(?s)^4 tables refused:\n  - table public\.nope does not exist.*\n  - table public\.mixed does not exist.*"
        r"\n  - public\.nokey has no primary key.*\n  - public\.wide: .*numeric\(50,2\)",
    )


def test_publication_checks(source: SourceDb) -> None:
    _table(source)
    _table(source, "CREATE TABLE public.u (id int PRIMARY KEY)")
    config = source.config(
        ["public.t", "public.u"],
        replication={"publication": "p_manual", "slot": f"s_{source.name}", "create_publication": False},
    )
    _refuses(source, config, "publication p_manual does not exist")
    source.execute("CREATE PUBLICATION p_manual FOR TABLE public.t")
    _refuses(source, config, "does not cover public.u")


def test_missing_replication_privilege(source: SourceDb) -> None:
    _table(source)
    source.execute("CREATE ROLE plain_user LOGIN")
    source.execute("GRANT ALL ON SCHEMA public TO plain_user")
    config = source.config(["public.t"])
    data = config.model_dump()
    data["source"]["user"] = "plain_user"
    data["state"] = {**config.source.model_dump()}
    # The check's advice, not the walsender's refusal ("must be superuser or replication role ..."), which
    # the replication connection would give if the check came after it.
    with pytest.raises(
        StartupCheckError,
        match=r"^role plain_user lacks the REPLICATION privilege; run ALTER ROLE plain_user REPLICATION$",
    ):
        source.pipeline(parse_config(data)).validate()
    source.execute("DROP OWNED BY plain_user; DROP ROLE plain_user")


def test_identity_and_slot_invariants(source: SourceDb) -> None:
    _table(source)
    source.execute("INSERT INTO public.t VALUES (1, 'a')")
    config = source.config(["public.t"])
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    # Another consumer holds the slot: a clear refusal, not a crash loop.
    with (
        ReplicationStream(
            config.source, config.replication.slot, config.replication.publication, pipeline.store.flushed_lsn() or 0
        ),
        pytest.raises(SlotBusyError, match="in use by another process"),
    ):
        pipeline.stream(max_seconds=1)
    # The slot was advanced outside pg2iceberg.
    source.execute("SET synchronous_commit = on; INSERT INTO public.t VALUES (2, 'b')")
    source.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_insert_lsn())", (config.replication.slot,))
    _refuses(source, config, "advanced outside pg2iceberg")
    # The slot is gone although the pipeline created it.
    source.drop_slot(config.replication.slot)
    _refuses(source, config, "is gone but the pipeline created it")
    # DROP + recreate of a table.
    source.execute("DROP TABLE public.t; CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    _refuses(source, config, "dropped and recreated")
    # A different cluster behind the same coordination state.
    source.execute("UPDATE _pg2iceberg.pipeline_meta SET system_identifier = '42'")
    _refuses(source, config, "the source cluster changed")


def test_foreign_slot_is_not_adopted(source: SourceDb) -> None:
    _table(source)
    config = source.config(["public.t"])
    source.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (config.replication.slot,))
    _refuses(source, config, "was not created by this pipeline")


def test_wal_level_and_unreachable_server(tmp_path: Path, source: SourceDb) -> None:
    cluster = EmbeddedPostgres(tmp_path / "replica_level", free_port())
    cluster.init()
    with open(cluster.data_dir / "postgresql.conf", "a") as conf:
        conf.write("wal_level = replica\n")
    cluster.start()
    try:
        with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
        data = source.config(["public.t"]).model_dump()
        data["source"].update(port=cluster.port, dbname="postgres")
        data["state"] = None
        _refuses(source, parse_config(data), "wal_level is 'replica'")
    finally:
        cluster.stop()
    data["source"]["port"] = free_port()
    with pytest.raises(Pg2IcebergError, match=r"cannot connect to postgresql://postgres@127\.0\.0\.1"):
        source.pipeline(parse_config(data)).validate()


def test_unlogged_tables_are_refused_by_name(source: SourceDb) -> None:
    """Logical replication carries no change of an UNLOGGED table (or partition): refused up front."""
    _table(source, "CREATE UNLOGGED TABLE public.scratch (id int PRIMARY KEY, v text)")
    _refuses(source, source.config(["public.scratch"]), r"public\.scratch is UNLOGGED.*SET LOGGED")
    _table(source, "CREATE TABLE public.parted (id int PRIMARY KEY) PARTITION BY RANGE (id)")
    _table(source, "CREATE TABLE public.parted_1 PARTITION OF public.parted FOR VALUES FROM (0) TO (10)")
    _table(source, "CREATE UNLOGGED TABLE public.parted_2 PARTITION OF public.parted FOR VALUES FROM (10) TO (20)")
    _refuses(source, source.config(["public.parted"]), r"partition public\.parted_2 is UNLOGGED")


@pytest.mark.usefixtures("spark")
def test_a_configured_key_must_be_one_postgres_enforces(source: SourceDb) -> None:
    """``primary_key`` on a table without a declared key: its columns must be NOT NULL and unique by a
    unique index of PostgreSQL's own (rows sharing a key would become one in Iceberg, and deleting one
    would delete both there). Once they are, the table mirrors exactly, updates and deletes included."""
    _table(source, "CREATE TABLE public.events (a int, b int, v text)")
    source.execute("ALTER TABLE public.events REPLICA IDENTITY FULL")
    source.execute("INSERT INTO public.events SELECT g % 50, g, 'v' || g FROM generate_series(1, 200) g")
    keyed_on_a = source.config([{"name": "public.events", "primary_key": ["a"]}])
    keyed_on_a_b = source.config([{"name": "public.events", "primary_key": ["a", "b"]}])
    _refuses(source, keyed_on_a, r'primary_key column\(s\) a may be NULL.*ALTER COLUMN "a" SET NOT NULL')
    source.execute("ALTER TABLE public.events ALTER COLUMN a SET NOT NULL, ALTER COLUMN b SET NOT NULL")
    _refuses(source, keyed_on_a, r"primary_key \['a'\] is not unique in the source.*CREATE UNIQUE INDEX")
    # Unique only where b > 0, or only together with b: neither makes a unique on its own.
    source.execute("CREATE UNIQUE INDEX events_a_positive ON public.events (a, b) WHERE b > 0")
    _refuses(source, keyed_on_a_b, r"is not unique in the source")
    source.execute("CREATE UNIQUE INDEX events_a_b ON public.events (a, b)")
    _refuses(source, keyed_on_a, r"is not unique in the source")

    pipeline = source.pipeline(keyed_on_a_b)
    pipeline.validate()
    pipeline.snapshot()
    source.execute("DELETE FROM public.events WHERE a = 1 AND b = 51")  # another row keeps a = 1
    source.execute("UPDATE public.events SET v = 'changed' WHERE a = 1")
    source.execute("INSERT INTO public.events VALUES (1, 1000, 'new')")
    pipeline.stream(until_caught_up=True)
    pipeline.materialize()
    assert_mirrored(pipeline)
    rows = pipeline.catalog.load_table(f"{source.name}_public.events").scan().to_arrow().to_pylist()
    assert sorted((r["b"], r["v"]) for r in rows if r["a"] == 1) == [
        (1, "changed"),
        (101, "changed"),
        (151, "changed"),
        (1000, "new"),
    ]


@pytest.mark.usefixtures("spark")
def test_a_replica_identity_index_must_carry_the_key(source: SourceDb) -> None:
    """``REPLICA IDENTITY USING INDEX``: a DELETE carries that index's columns only. Without the key
    among them a delete could not be matched to its Iceberg row: refused with the fix. With the key
    among them, deletes and key changes mirror exactly."""
    _table(source, "CREATE TABLE public.acct (id int PRIMARY KEY, email text NOT NULL, v text)")
    source.execute("CREATE UNIQUE INDEX acct_email ON public.acct (email)")
    source.execute("CREATE UNIQUE INDEX acct_email_id ON public.acct (email, id)")
    source.execute("INSERT INTO public.acct SELECT g, 'e' || g, 'v' FROM generate_series(1, 30) g")
    source.execute("ALTER TABLE public.acct REPLICA IDENTITY USING INDEX acct_email")
    config = source.config(["public.acct"])
    _refuses(
        source,
        config,
        r"REPLICA IDENTITY USING INDEX acct_email does not carry the key column\(s\) id.*REPLICA IDENTITY DEFAULT",
    )
    assert written_anything(config) == []
    source.execute("ALTER TABLE public.acct REPLICA IDENTITY USING INDEX acct_email_id")
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    source.execute("DELETE FROM public.acct WHERE id = 3")
    source.execute("UPDATE public.acct SET id = 100 WHERE id = 5")
    source.execute("UPDATE public.acct SET email = 'moved', v = 'w' WHERE id = 6")
    pipeline.stream(until_caught_up=True)
    pipeline.materialize()
    assert_mirrored(pipeline)


@pytest.mark.usefixtures("spark")
def test_a_least_privilege_role_is_told_each_grant_it_lacks(source: SourceDb) -> None:
    """A replication role that owns nothing, with the publication made by the DBA: without CREATE on the
    database (for the coordination schema), SELECT on a table, or past the table's row-level security,
    each is refused with what to run, nothing written; granted all, it mirrors the tables exactly."""
    role = f"rep_{source.name}"
    _table(source, "CREATE TABLE public.orders (id bigint PRIMARY KEY, v text)")
    _table(source, "CREATE TABLE public.secret (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' FROM generate_series(1, 300) g")
    source.execute("INSERT INTO public.secret VALUES (1, 's')")
    source.execute(f"CREATE ROLE {role} LOGIN REPLICATION")
    source.execute(f"GRANT SELECT ON public.orders TO {role}")
    source.execute(f"CREATE PUBLICATION pub_{source.name} FOR TABLE public.orders, public.secret")
    config = source.config(["public.orders", "public.secret"])
    data = config.model_dump()
    data["source"]["user"] = role
    data["replication"]["create_publication"] = False
    config = parse_config(data)
    before = footprint(config)  # the DBA's publication
    _refuses(source, config, rf'role "{role}" may not create .*GRANT CREATE ON DATABASE "{source.name}" TO "{role}"')
    assert footprint(config) == before
    source.execute(f"GRANT CREATE ON DATABASE {source.name} TO {role}")
    _refuses(source, config, rf'public\.secret: role "{role}" may not read public\.secret; run GRANT SELECT')
    assert not footprint(config)["slot"]
    source.execute(f"GRANT SELECT ON public.secret TO {role}")
    # Row-level security would hide rows from the snapshot (and verify) without an error.
    source.execute("ALTER TABLE public.secret ENABLE ROW LEVEL SECURITY")
    source.execute(f"CREATE POLICY none_for_you ON public.secret FOR SELECT TO {role} USING (false)")
    _refuses(source, config, rf'row-level security applies to role "{role}" on public\.secret.*BYPASSRLS')
    source.execute(f"ALTER ROLE {role} BYPASSRLS")
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    source.execute("UPDATE public.orders SET v = 'w' WHERE id <= 10")
    source.execute("DELETE FROM public.secret")
    pipeline.stream(until_caught_up=True)
    pipeline.materialize()
    assert_mirrored(pipeline)
