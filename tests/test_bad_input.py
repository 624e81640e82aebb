"""Bad input and a hostile environment: each is refused with a message that says what is wrong, and
nothing is written (no slot, publication, coordination rows, Iceberg table or staged file; or, once
the pipeline runs, nothing registered and the slot not acknowledged). After the cause is fixed a
restart loses nothing: Iceberg equals PostgreSQL."""

from __future__ import annotations

import contextlib
import errno
import gc
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from moto.server import ThreadedMotoServer

from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import PipelineConfig, parse_config
from pg2iceberg_dagster.embedded import EmbeddedPostgres, free_port
from pg2iceberg_dagster.errors import Pg2IcebergError, StagingError
from pg2iceberg_dagster.staging.store import ObjectStore

from .conftest import SourceDb, assert_mirrored, config_on, footprint, written_anything
from .test_s3_staging import BUCKET, create_bucket


def _write_config(config: PipelineConfig | dict[str, Any], directory: Path) -> str:
    data = config if isinstance(config, dict) else config.model_dump(mode="json", exclude_none=True)
    path = directory / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _cli(capsys: pytest.CaptureFixture[str], config_path: str, *command: str) -> tuple[int, str]:
    """Run the CLI in-process; (exit code, stderr)."""
    capsys.readouterr()
    code = main(["-c", config_path, *command])
    return code, capsys.readouterr().err


# startup refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ddl", "table", "message"),
    [
        ("", "public.nope", r"table public\.nope does not exist in the source database"),
        ("CREATE TABLE public.nokey (a int, b text)", "public.nokey", r"public\.nokey has no primary key; declare"),
        (
            "CREATE TABLE public.wide (id int PRIMARY KEY, n numeric(50, 2))",
            "public.wide",
            r"public\.wide: column n: numeric\(50,2\) does not fit Iceberg decimal.*alter the column",
        ),
        (
            "CREATE TABLE public.negative (id int PRIMARY KEY, n numeric(6, -2))",
            "public.negative",
            r"public\.negative: column n: numeric\(6,-2\) does not fit Iceberg decimal",
        ),
        (
            'CREATE TABLE public.gen (p int, "Total" int GENERATED ALWAYS AS (p * 2) STORED PRIMARY KEY)',
            "public.gen",
            r"public\.gen: primary key column\(s\) Total are GENERATED .* does not send generated columns, "
            r"so a DELETE would not say which row went",
        ),
    ],
    ids=["unknown_table", "no_primary_key", "numeric_50_2", "negative_scale", "generated_key"],
)
def test_bad_tables_are_refused_before_anything_is_written(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str], ddl: str, table: str, message: str
) -> None:
    if ddl:
        source.execute(ddl)
    source.execute("CREATE TABLE public.fine (id int PRIMARY KEY)")
    config = source.config(["public.fine", table])
    path = _write_config(config, tmp_path)
    for command in (["validate"], ["snapshot"], ["stream", "--until-caught-up"], ["verify"]):
        code, err = _cli(capsys, path, *command)
        assert code == 3, (command, err)
        assert err.startswith("error: ") and len(err.splitlines()) == 1, err
        with pytest.raises(Pg2IcebergError, match=message):
            source.pipeline(config).validate()
    assert written_anything(config) == []


def test_malformed_config_is_refused_before_connecting(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = source.config(["public.t"]).model_dump(mode="json", exclude_none=True)
    data["tables"] = [{"name": "orders"}]
    data["snapshot"]["chunk_pages"] = 0
    code, err = _cli(capsys, _write_config(data, tmp_path), "snapshot")
    assert code == 2
    assert "tables.0.name: expected 'schema.table', got 'orders'" in err and "snapshot.chunk_pages:" in err
    (tmp_path / "broken.yaml").write_text("source: [unclosed\n")
    code, err = _cli(capsys, str(tmp_path / "broken.yaml"), "snapshot")
    assert code == 2 and "is not valid YAML" in err
    # Not even the coordination schema: the config was refused before any connection.
    assert source.execute("SELECT 1 FROM pg_namespace WHERE nspname = '_pg2iceberg'") == []


def test_missing_replication_privilege_is_refused_with_advice(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    role = f"plain_{source.name}"
    source.execute(f"CREATE ROLE {role} LOGIN")
    try:
        source.execute(f"GRANT CREATE ON DATABASE {source.name} TO {role}")
        data = source.config(["public.t"]).model_dump(mode="json", exclude_none=True)
        data["source"]["user"] = role
        config = parse_config(data)
        code, err = _cli(capsys, _write_config(data, tmp_path), "snapshot")
        assert code == 3, err
        assert f"role {role} lacks the REPLICATION privilege; run ALTER ROLE {role} REPLICATION" in err
        assert written_anything(config) == []
    finally:
        source.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


def test_wal_level_replica_is_refused(
    source: SourceDb, make_cluster: Callable[..., EmbeddedPostgres], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = make_cluster(conf=["wal_level = replica"])
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    config = config_on(source, cluster, ["public.t"])
    code, err = _cli(capsys, _write_config(config, tmp_path), "snapshot")
    assert code == 3
    assert "wal_level is 'replica' on the source; set wal_level = logical in postgresql.conf and restart" in err
    assert written_anything(config) == []


def test_unreachable_postgres_is_refused(source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = source.config(["public.t"]).model_dump(mode="json", exclude_none=True)
    port = free_port()
    data["source"]["port"] = port
    code, err = _cli(capsys, _write_config(data, tmp_path), "snapshot")
    assert code == 1
    assert f"error: cannot connect to postgresql://postgres@127.0.0.1:{port}/{source.name}" in err
    assert "Connection refused" in err or "connection failed" in err
    config = parse_config(data)
    assert not Path(config.staging.url.removeprefix("file://")).exists()
    assert written_anything(source.config(["public.t"])) == []  # the real server saw nothing either


# the object store ---------------------------------------------------------------------------------


def _orders(source: SourceDb) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' || g FROM generate_series(1, 50) g")


CHANGE_MESSAGES = 36  # what _changes writes, as pgoutput row messages


def _changes(source: SourceDb) -> int:
    """Write some changes of every kind; returns how many staged changes they make (a key change is two).

    Commits are synchronous (the test cluster's default is not) so that the WAL holding them is
    flushed: logical decoding, and so the slot checks below, only see flushed WAL.
    """
    for statement in (
        "UPDATE public.orders SET v = 'changed' WHERE id <= 10",
        "DELETE FROM public.orders WHERE id > 45",
        "INSERT INTO public.orders SELECT g, 'new' FROM generate_series(100, 119) g",
        "UPDATE public.orders SET id = id + 1000 WHERE id = 20",  # staged as delete + update
    ):
        source.execute(f"SET synchronous_commit = on; {statement}")
    return 10 + 5 + 20 + 2


def _undelivered_row_messages(source: SourceDb, config: PipelineConfig) -> int:
    """Row changes (pgoutput I/U/D messages) the slot would still deliver to the next ``stream``."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return source.execute(
                "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
                "'publication_names', %s) WHERE get_byte(data, 0) IN (73, 85, 68)",
                (config.replication.slot, config.replication.publication),
            )[0][0]
        except psycopg.errors.ObjectInUse:  # the failed stream's walsender is still exiting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def assert_nothing_registered(
    source: SourceDb, config: PipelineConfig, before: dict[str, Any], undelivered: int, staged: bool = True
) -> None:
    """A failed flush registered nothing (no log_index, log_seq or staged file) and acknowledged nothing
    it had not registered: the slot still delivers every change of the failed transactions.

    ``flushed_lsn`` itself may move, to a keepalive position that no committed change precedes (the
    quiet-publication ack); what matters is that no change before it was dropped.
    """
    after = footprint(config, staged=staged)
    moving = {"slot", "_pg2iceberg.flushed_lsn"}
    assert {k: v for k, v in after.items() if k not in moving} == {k: v for k, v in before.items() if k not in moving}
    assert _undelivered_row_messages(source, config) == undelivered
    acked_past_flushed = source.execute(
        "SELECT s.confirmed_flush_lsn > f.lsn FROM pg_replication_slots s, _pg2iceberg.flushed_lsn f "
        "WHERE s.slot_name = %s",
        (config.replication.slot,),
    )
    assert acked_past_flushed == [(False,)], "the slot was acknowledged past the recorded flushed_lsn"


@pytest.mark.usefixtures("spark")
def test_unreachable_object_store_registers_nothing_and_loses_nothing(
    source: SourceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TEST_S3_KEY", "testing")
    monkeypatch.setenv("TEST_S3_SECRET", "testing-secret")
    port = free_port()  # nothing listens here until the "store comes back"
    endpoint = f"http://127.0.0.1:{port}"
    _orders(source)
    staging = {
        "url": f"s3://{BUCKET}/{source.name}",
        "s3": {"endpoint": endpoint, "access_key_id_env": "TEST_S3_KEY", "secret_access_key_env": "TEST_S3_SECRET"},
    }
    config = source.config(["public.orders"], staging=staging)
    pipeline = source.pipeline(config)
    pipeline.snapshot()
    expected = _changes(source)
    before = footprint(config, staged=False)

    with pytest.raises(
        StagingError,
        match=rf"cannot write staged file public_orders-[0-9a-f]{{16}}/\S+\.parquet in s3://{BUCKET}/{source.name} "
        rf"\(S3 endpoint "
        rf"{endpoint}\): .*127\.0\.0\.1:{port}.*Nothing after flushed_lsn \S+ was registered or acknowledged",
    ):
        pipeline.stream(until_caught_up=True)
    assert_nothing_registered(source, config, before, CHANGE_MESSAGES, staged=False)
    code, err = _cli(capsys, _write_config(config, tmp_path), "stream", "--until-caught-up")
    assert code == 1 and f"(S3 endpoint {endpoint})" in err and "testing-secret" not in err
    assert_nothing_registered(source, config, before, CHANGE_MESSAGES, staged=False)

    # The store comes back: a restart stages every change exactly once.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        create_bucket(endpoint)
        stats = source.pipeline(config).stream(until_caught_up=True)
        assert stats.rows_by_table == {"public.orders": expected}
        # Spark here has no S3 filesystem (no hadoop-aws jar): merge from a local copy of the bucket.
        bucket, local = ObjectStore(config.staging), tmp_path / "staging-copy"
        for key in bucket.list():
            (local / key).parent.mkdir(parents=True, exist_ok=True)
            (local / key).write_bytes(bucket.get(key))
    finally:
        server.stop()
    merged = source.pipeline(source.config(["public.orders"], staging={"url": f"file://{local}"}))
    assert merged.materialize()["public.orders"].changes == expected
    assert_mirrored(merged)


@contextlib.contextmanager
def full_filesystem(directory: Path, size: str = "1m") -> Iterator[Callable[[], None]]:
    """A small tmpfs at ``directory``, filled up; yields a function that frees the space again."""
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); a full disk needs a small filesystem")
    try:
        filler = directory / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as handle:
            while True:
                handle.write(b"\0" * 4096)
                handle.flush()
        yield filler.unlink
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.usefixtures("spark")
def test_full_disk_while_staging_registers_nothing_and_converges(source: SourceDb, tmp_path: Path) -> None:
    _orders(source)
    disk = tmp_path / "disk"
    with full_filesystem(disk) as free_space:
        config = source.config(["public.orders"], staging={"url": f"file://{disk}/staging"})
        pipeline = source.pipeline(config)
        pipeline.snapshot()
        expected = _changes(source)
        before = footprint(config)
        with pytest.raises(
            StagingError,
            match=rf"cannot write staged file public_orders-[0-9a-f]{{16}}/\S+ in file://{disk}/staging: "
            r".*No space left on device"
            r".*Nothing after flushed_lsn \S+ was registered or acknowledged",
        ):
            pipeline.stream(until_caught_up=True)
        assert_nothing_registered(source, config, before, CHANGE_MESSAGES)  # and no partial file left

        free_space()
        restarted = source.pipeline(config)
        assert restarted.stream(until_caught_up=True).rows_by_table == {"public.orders": expected}
        assert restarted.materialize()["public.orders"].changes == expected
        assert_mirrored(restarted)


@pytest.mark.usefixtures("spark")
def test_full_disk_while_spilling_registers_nothing_and_converges(source: SourceDb, tmp_path: Path) -> None:
    """A transaction larger than flush.txn_memory_bytes spills to flush.spill_dir, which is full.

    It has more rows than the flusher takes from the stream at once, so it cannot commit before the
    bound is checked: it spills whatever the timing.
    """
    _orders(source)
    disk = tmp_path / "disk"
    with full_filesystem(disk, size="4m") as free_space:
        config = source.config(
            ["public.orders"], flush={"interval_seconds": 0.5, "txn_memory_bytes": 1024, "spill_dir": str(disk)}
        )
        pipeline = source.pipeline(config)
        pipeline.snapshot()
        source.execute(
            "SET synchronous_commit = on; INSERT INTO public.orders SELECT g, 'x' FROM generate_series(1000, 20999) g"
        )
        before = footprint(config)
        with pytest.raises(
            Pg2IcebergError,
            match=rf"cannot spill a large transaction to {disk} \(No space left on device\); free space there or "
            r"point flush\.spill_dir at a larger disk\. Nothing after flushed_lsn \S+ was registered or acknowledged",
        ):
            pipeline.stream(until_caught_up=True)
        assert_nothing_registered(source, config, before, 20000)
        gc.collect()  # the failed flusher's spill file is still open until its frames are collected

        free_space()
        restarted = source.pipeline(config)
        assert restarted.stream(until_caught_up=True).rows_by_table == {"public.orders": 20000}
        restarted.materialize()
        assert_mirrored(restarted)


def test_errno_of_a_full_disk_is_enospc(tmp_path: Path) -> None:
    """The fixture really fills the filesystem (guards the two tests above against a silent no-op)."""
    with full_filesystem(tmp_path / "disk"), pytest.raises(OSError) as info:
        (tmp_path / "disk" / "more").write_bytes(b"x" * 8192)
    assert info.value.errno == errno.ENOSPC


def test_stream_before_any_snapshot_says_to_take_it(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stream` (or `verify --catch-up`) before the first snapshot: the slot does not exist yet. A refusal
    with exit 3 naming the command to run first (a RuntimeError traceback before)."""
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    path = _write_config(source.config(["public.t"]), tmp_path)
    for command in (["stream", "--until-caught-up"], ["verify", "--catch-up"]):
        code, err = _cli(capsys, path, *command)
        assert code == 3, err
        assert "nothing to stream yet: the replication slot is created by the first snapshot" in err
        assert "Traceback" not in err
