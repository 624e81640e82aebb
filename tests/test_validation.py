"""Every startup check refuses with a message that says what is wrong."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from pg2iceberg_dagster.config import parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.errors import Pg2IcebergError, SlotBusyError, StartupCheckError, UnsupportedTypeError
from pg2iceberg_dagster.source.replication import ReplicationStream

from .conftest import SourceDb


def _table(source: SourceDb, ddl: str = "CREATE TABLE public.t (id int PRIMARY KEY, v text)") -> None:
    source.execute(ddl)


def _refuses(source: SourceDb, config, match: str, error=StartupCheckError) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        source.pipeline(config).validate()


def test_missing_table_no_key_and_unsupported_type(source: SourceDb) -> None:
    _refuses(source, source.config(["public.nope"]), "public.nope does not exist")
    _table(source, "CREATE TABLE public.nokey (a int, b text)")
    _refuses(source, source.config(["public.nokey"]), "has no primary key")
    _refuses(source, source.config([{"name": "public.nokey", "primary_key": ["a"]}]), "REPLICA IDENTITY FULL")
    _table(source, "CREATE TABLE public.wide (id int PRIMARY KEY, n numeric(50, 2))")
    _refuses(source, source.config(["public.wide"]), "numeric\\(50,2\\).*does not fit", UnsupportedTypeError)


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
    source.execute("SELECT pg_drop_replication_slot(%s)", (config.replication.slot,))
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
