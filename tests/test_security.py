"""The source password goes in through ``password_env`` (and a Dagster ``EnvVar``) and comes out
nowhere: not in output, logs or error texts, not in coordination rows, the Iceberg catalog, Iceberg
metadata, staged files, Dagster's event log and storage, nor the server's own log. The cluster really
requires it (scram-sha-256 lines before the trust lines of pg_hba)."""

from __future__ import annotations

import logging
import secrets
import traceback
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import yaml
from dagster import (
    AssetKey,
    EnvVar,
    SensorResult,
    build_sensor_context,
    instance_for_test,
    materialize,
)
from psycopg import sql

from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import parse_config
from pg2iceberg_dagster.dagster_integration import (
    Mirror,
    Pg2IcebergResource,
    Pg2IcebergTranslator,
    PostgresResource,
    SparkResource,
    build_definitions,
)
from pg2iceberg_dagster.dagster_integration.assets import table_definitions
from pg2iceberg_dagster.embedded import EmbeddedPostgres
from pg2iceberg_dagster.errors import Pg2IcebergError
from pg2iceberg_dagster.iceberg.catalog import open_catalog, snapshot_summaries
from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.staging.codec import decode

ROLE = "mirror_owner"
ENV = "PG2ICEBERG_TEST_SOURCE_PASSWORD"


def _dump_database(cluster: EmbeddedPostgres, dbname: str, schemas: tuple[str, ...]) -> str:
    """Every row of every table in ``schemas`` as JSON text (read as the trusted superuser)."""
    out: list[str] = []
    with psycopg.connect(cluster.conninfo(dbname), autocommit=True) as conn:
        tables = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables WHERE table_schema = ANY(%s)",
            (list(schemas),),
        ).fetchall()
        assert tables, f"nothing to dump in {dbname}"
        for schema, table in tables:
            query = sql.SQL("SELECT row_to_json(t)::text FROM {} t").format(sql.Identifier(schema, table))
            out.extend(f"{schema}.{table}: {row}" for (row,) in conn.execute(query))
    return "\n".join(out)


@pytest.mark.usefixtures("spark")
def test_source_password_appears_nowhere(
    make_cluster: Callable[..., EmbeddedPostgres],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    password = f"Pw-{secrets.token_urlsafe(24)}"
    wrong = f"Wrong-{secrets.token_urlsafe(24)}"
    cluster = make_cluster(
        conf=["log_statement = 'all'", "log_connections = on"],
        hba=[
            f"host all {ROLE} 127.0.0.1/32 scram-sha-256",
            f"host replication {ROLE} 127.0.0.1/32 scram-sha-256",
        ],
    )
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION PASSWORD {}").format(sql.Identifier(ROLE), password))
        conn.execute(sql.SQL("CREATE DATABASE app OWNER {}").format(sql.Identifier(ROLE)))
        conn.execute(sql.SQL("CREATE DATABASE catalog OWNER {}").format(sql.Identifier(ROLE)))
    as_role = f"host=127.0.0.1 port={cluster.port} user={ROLE} dbname=app"
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(as_role, connect_timeout=5).close()  # the password is really required
    with psycopg.connect(f"{as_role} password={password}", autocommit=True) as conn:
        conn.execute("CREATE TABLE public.accounts (id int PRIMARY KEY, owner text, balance numeric(12, 2))")
        conn.execute("INSERT INTO public.accounts SELECT g, 'o' || g, g * 1.5 FROM generate_series(1, 40) g")
    # Logging the DDL above put the password in the server log; only what the pipeline does counts.
    cluster.log_file.write_text("")

    connection = {"host": "127.0.0.1", "port": cluster.port, "user": ROLE, "password_env": ENV}
    config = parse_config(
        {
            "source": {**connection, "dbname": "app"},
            "tables": [{"name": "public.accounts"}],
            "replication": {"slot": "secure_slot", "publication": "secure_pub", "status_interval_seconds": 1},
            "staging": {"url": f"file://{tmp_path}/staging"},
            "iceberg": {
                # Its own catalog name: the shared Spark session already bound `pg2iceberg` elsewhere.
                "catalog": {"name": "secure_catalog", "postgres": {**connection, "dbname": "catalog"}},
                "warehouse": f"file://{tmp_path}/warehouse",
            },
            "snapshot": {"chunk_pages": 1, "parallelism": 2},
            "flush": {"interval_seconds": 0.5},
        }
    )
    config_path = tmp_path / "pg2iceberg.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    bad_path = tmp_path / "bad.yaml"
    bad = config.model_dump(mode="json", exclude_none=True)
    bad["tables"] = [{"name": "public.accounts"}, {"name": "public.missing"}]
    bad_path.write_text(yaml.safe_dump(bad))
    monkeypatch.setenv(ENV, password)
    caplog.set_level(logging.DEBUG)  # every library's DEBUG log too (py4j's echoes each command to the JVM)

    def cli(*argv: str, path: Path = config_path) -> int:
        return main(["-v", "-c", str(path), *argv])

    assert cli("validate") == 0
    assert cli("snapshot") == 0
    with psycopg.connect(f"{as_role} password={password}", autocommit=True) as conn:
        conn.execute("UPDATE public.accounts SET balance = balance + 1 WHERE id <= 5")
        conn.execute("DELETE FROM public.accounts WHERE id = 6")
        conn.execute("INSERT INTO public.accounts VALUES (100, 'new', 0)")
    assert cli("stream", "--until-caught-up") == 0
    assert cli("materialize", "--once") == 0
    assert cli("verify") == 0
    assert cli("status") == 0 and cli("status", "--json") == 0
    assert cli("validate", path=bad_path) == 3  # a deliberate failure
    monkeypatch.setenv(ENV, wrong)
    assert cli("status") == 1  # a wrong password fails with the server's reason, not the password
    monkeypatch.setenv(ENV, password)

    # One Dagster materialization of the live table, the source password given as an EnvVar.
    with psycopg.connect(f"{as_role} password={password}", autocommit=True) as conn:
        conn.execute("UPDATE public.accounts SET owner = 'dagster' WHERE id = 7")
    assert cli("stream", "--until-caught-up") == 0
    source = PostgresResource(host="127.0.0.1", port=cluster.port, dbname="app", user=ROLE, password=EnvVar(ENV))
    pg2iceberg = Pg2IcebergResource(config_path=str(config_path), source=source)
    _, assets = table_definitions(Mirror(Pg2IcebergTranslator(config)))
    live = next(a for a in assets if AssetKey(["iceberg", "public", "accounts"]) in a.keys)
    with instance_for_test() as instance:
        result = materialize(
            [live],
            instance=instance,
            resources={"pg2iceberg": pg2iceberg, "pg2iceberg_spark": SparkResource(pg2iceberg=pg2iceberg)},
        )
        assert result.success
        metadata = result.asset_materializations_for_node(live.node_def.name)[0].metadata
        assert metadata["dagster/row_count"].value == 40
        dagster_events = "\n".join(repr(event) for event in instance.all_logs(result.run_id))
        dagster_events += repr(instance.get_run_by_id(result.run_id)) + repr(metadata)
        dagster_files = {
            f"dagster:{path}": path.read_bytes() for path in Path(instance.root_directory).rglob("*") if path.is_file()
        }
    captured = capfd.readouterr()
    assert "public.missing does not exist" in captured.err
    assert "password authentication failed" in captured.err
    assert "pg=40 iceberg=40" in captured.out

    # The same failures in-process: their exception texts and tracebacks.
    errors: list[str] = []
    for failing, secret in ((bad, password), (config.model_dump(mode="json", exclude_none=True), wrong)):
        monkeypatch.setenv(ENV, secret)
        with pytest.raises(Pg2IcebergError) as info, Pipeline(parse_config(failing)) as pipeline:
            pipeline.validate()
        errors.append("".join(traceback.format_exception(info.value)) + repr(info.value))
    monkeypatch.setenv(ENV, password)

    produced: dict[str, str | bytes] = {
        "stdout": captured.out,
        "stderr": captured.err,
        "logs": caplog.text + "\n".join(str(r.__dict__) for r in caplog.records),
        "exceptions": "\n".join(errors),
        "coordination rows": _dump_database(cluster, "app", ("_pg2iceberg",)),
        "catalog rows": _dump_database(cluster, "catalog", ("public",)),
        "server log": cluster.log_file.read_text(),
        "config file": config_path.read_text(),
        "dagster events": dagster_events,
        **dagster_files,
    }
    for directory in ("warehouse", "staging"):
        files = [path for path in (tmp_path / directory).rglob("*") if path.is_file()]
        assert files, f"nothing written under {directory}"
        for path in files:
            produced[str(path)] = path.read_bytes()
    table = open_catalog(config).load_table("public.accounts")
    produced["snapshot summaries"] = repr(snapshot_summaries(table)) + repr(table.properties)
    with Pipeline(config) as pipeline:
        entries = pipeline.store.log_entries("public.accounts", 0)
    assert entries
    staged = [decode((tmp_path / "staging" / entry.path).read_bytes()) for entry in entries]
    produced["staged changes"] = repr(staged)  # decoded too: Parquet pages may be compressed

    assert ROLE in produced["server log"] and "connection authorized" in produced["server log"]
    for secret in (password, wrong):
        leaks = [
            where
            for where, content in produced.items()
            if (secret.encode() in content if isinstance(content, bytes) else secret in content)
        ]
        loggers = sorted({r.name for r in caplog.records if secret in r.getMessage() or secret in str(r.__dict__)})
        assert leaks == [], f"the password leaked into {leaks} (loggers: {loggers})"


@pytest.mark.usefixtures("spark")
def test_dagster_password_reaches_the_holder_process_and_the_sensors(
    make_cluster: Callable[..., EmbeddedPostgres], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The YAML's password variable is unset; only the Dagster resource has the password (an EnvVar).
    A chunk run, the snapshot holder process it starts, the flusher sensor and the merge sensor
    must all connect with it: none may fall back to re-reading the YAML."""
    password = f"Pw-{secrets.token_urlsafe(24)}"
    cluster = make_cluster(
        hba=[f"host all {ROLE} 127.0.0.1/32 scram-sha-256", f"host replication {ROLE} 127.0.0.1/32 scram-sha-256"]
    )
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION PASSWORD {}").format(sql.Identifier(ROLE), password))
        conn.execute(sql.SQL("CREATE DATABASE app OWNER {}").format(sql.Identifier(ROLE)))
    as_role = f"host=127.0.0.1 port={cluster.port} user={ROLE} dbname=app password={password}"
    with psycopg.connect(as_role, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.accounts (id int PRIMARY KEY, owner text)")
        conn.execute("INSERT INTO public.accounts SELECT g, 'o' || g FROM generate_series(1, 300) g")
    yaml_variable, dagster_variable = "PG2ICEBERG_TEST_YAML_PASSWORD", "PG2ICEBERG_TEST_DAGSTER_PASSWORD"
    monkeypatch.delenv(yaml_variable, raising=False)
    monkeypatch.setenv(dagster_variable, password)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    config_path = tmp_path / "pg2iceberg.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "source": {"host": "127.0.0.1", "port": cluster.port, "user": ROLE, "dbname": "app",
                           "password_env": yaml_variable},
                "tables": [{"name": "public.accounts"}],
                "replication": {"slot": "override_slot", "publication": "override_pub"},
                "staging": {"url": f"file://{tmp_path}/staging"},
                "iceberg": {"catalog": {"name": "override_catalog"}, "warehouse": f"file://{tmp_path}/warehouse"},
                "flush": {"interval_seconds": 0.5},
            }
        )
    )  # fmt: skip
    source = PostgresResource(
        host="127.0.0.1", port=cluster.port, dbname="app", user=ROLE, password=EnvVar(dagster_variable)
    )
    pg2iceberg = Pg2IcebergResource(config_path=str(config_path), source=source)
    defs = build_definitions(config_path, pg2iceberg)
    snapshot = defs.resolve_assets_def(AssetKey(["iceberg", "public", "accounts_snapshot"]))
    live = AssetKey(["iceberg", "public", "accounts"])
    resources = {"pg2iceberg": pg2iceberg, "pg2iceberg_spark": SparkResource(pg2iceberg=pg2iceberg)}
    with instance_for_test() as instance:
        with build_sensor_context(instance=instance, resources=resources) as context:
            planned = defs.resolve_sensor_def("pg2iceberg_snapshot_planner")(context)
        for request in planned.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        keys = snapshot.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        for key in keys:  # the first run starts the holder process, which creates the slot
            assert materialize([snapshot], partition_key=key, instance=instance).success
        with psycopg.connect(as_role, autocommit=True) as conn:
            conn.execute("UPDATE public.accounts SET owner = 'changed' WHERE id <= 10")
        with build_sensor_context(instance=instance, resources=resources) as context:
            flushed = defs.resolve_sensor_def("pg2iceberg_flusher")(context)
        assert isinstance(flushed, SensorResult) and flushed.asset_events
        with build_sensor_context(instance=instance, resources=resources) as context:
            merge = defs.resolve_sensor_def("pg2iceberg_merge")(context)
        assert isinstance(merge, SensorResult), "the merge sensor saw the lag"
        assert [request.asset_selection for request in merge.run_requests] == [[live]]
    with pg2iceberg.process_config_and_initialize_cm() as resource, Pipeline(resource.load_config()) as pipeline:
        pipeline.materialize()
        (diff,) = pipeline.verify()
        assert diff.ok and diff.pg_rows == 300
