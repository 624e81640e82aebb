"""The staged log on an S3-compatible endpoint (moto server on 127.0.0.1): the flusher uploads and
registers there, the files decode to exactly the source's changes, and cleanup deletes them there."""

from __future__ import annotations

from collections.abc import Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

from pg2iceberg_dagster.embedded import free_port
from pg2iceberg_dagster.staging.codec import decode
from pg2iceberg_dagster.staging.store import ObjectStore, table_location

from .conftest import SourceDb

BUCKET = "pg2iceberg-staging"


def create_bucket(endpoint: str) -> None:
    """Create the staging bucket on the moto server at ``endpoint``."""
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
    ).create_bucket(Bucket=BUCKET)


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    monkeypatch.setenv("TEST_S3_KEY", "testing")
    monkeypatch.setenv("TEST_S3_SECRET", "testing-secret")
    endpoint = f"http://127.0.0.1:{port}"
    create_bucket(endpoint)
    try:
        yield endpoint
    finally:
        server.stop()


def test_flusher_stages_to_s3_and_cleanup_deletes_there(source: SourceDb, s3_endpoint: str) -> None:
    source.execute("CREATE TABLE public.orders (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.orders SELECT g, 'v' || g FROM generate_series(1, 10) g")
    staging = {
        "url": f"s3://{BUCKET}/{source.name}",
        "s3": {"endpoint": s3_endpoint, "access_key_id_env": "TEST_S3_KEY", "secret_access_key_env": "TEST_S3_SECRET"},
    }
    pipeline = source.pipeline(source.config(["public.orders"], staging=staging))
    pipeline.snapshot()
    source.execute("UPDATE public.orders SET v = 'changed' WHERE id = 3")
    source.execute("DELETE FROM public.orders WHERE id = 4")
    source.execute("INSERT INTO public.orders VALUES (11, 'new')")
    stats = pipeline.stream(until_caught_up=True)
    assert stats.rows_by_table == {"public.orders": 3}

    store = ObjectStore(pipeline.config.staging)
    entries = pipeline.store.log_entries("public.orders", 0)
    changes = [change for entry in entries for change in decode(store.get(entry.path))[1]]
    assert [(c.op, c.data) for c in changes] == [
        ("U", {"id": "3", "v": "changed"}),
        ("D", {"id": "4"}),
        ("I", {"id": "11", "v": "new"}),
    ]
    listed = store.files_in(table_location("public.orders"))
    assert sorted(listed) == sorted(entry.path for entry in entries)

    # Once every group has applied the log, cleanup removes the files from the bucket.
    pipeline.store.advance_mat_cursor(
        "default", "public.orders", entries[-1].end_offset, entries[-1].flushable_lsn, None
    )
    assert pipeline.collect_garbage().files_deleted == len(entries)
    assert store.files_in(table_location("public.orders")) == []


def test_dagster_staging_resource_supplies_s3_credentials(source: SourceDb, s3_endpoint: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """dagster-aws's S3Resource (secrets via EnvVar) points the staged-log store at the bucket."""
    import yaml
    from dagster import EnvVar
    from dagster_aws.s3 import S3Resource

    from pg2iceberg_dagster.dagster_integration import Pg2IcebergResource

    config = source.config(["public.orders"], staging={"url": f"s3://{BUCKET}/{source.name}-dagster"})
    path = tmp_path / "pg2iceberg.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    resource = Pg2IcebergResource(
        config_path=str(path),
        staging_s3=S3Resource(
            endpoint_url=s3_endpoint,
            region_name="us-east-1",
            aws_access_key_id=EnvVar("TEST_S3_KEY"),
            aws_secret_access_key=EnvVar("TEST_S3_SECRET"),
        ),
    )
    with resource.process_config_and_initialize_cm() as initialized:  # resolves the EnvVars
        resolved = initialized.load_config()
    assert "testing-secret" not in repr(resolved)
    store = ObjectStore(resolved.staging)
    store.put("probe/file.bin", b"staged")
    assert store.get("probe/file.bin") == b"staged"
    assert store.list("probe/") == ["probe/file.bin"]


def test_a_flush_over_many_tables_uploads_every_file_to_s3(source: SourceDb, s3_endpoint: str) -> None:
    """One transaction over a dozen tables: the flush uploads their files at once (in parallel on
    S3), and every registered file holds exactly its table's change."""
    names = [f"t{i}" for i in range(12)]
    for name in names:
        source.execute(f"CREATE TABLE public.{name} (id int PRIMARY KEY, v text)")
    staging = {
        "url": f"s3://{BUCKET}/{source.name}",
        "s3": {"endpoint": s3_endpoint, "access_key_id_env": "TEST_S3_KEY", "secret_access_key_env": "TEST_S3_SECRET"},
    }
    pipeline = source.pipeline(source.config([f"public.{name}" for name in names], staging=staging))
    pipeline.snapshot()
    source.execute("; ".join(f"INSERT INTO public.{name} VALUES (1, '{name}')" for name in names))
    stats = pipeline.stream(until_caught_up=True)
    assert stats.rows_by_table == {f"public.{name}": 1 for name in names}
    store = ObjectStore(pipeline.config.staging)
    for name in names:
        (entry,) = pipeline.store.log_entries(f"public.{name}", 0)
        assert [(c.op, c.data) for c in decode(store.get(entry.path))[1]] == [("I", {"id": "1", "v": name})]
        assert store.files_in(table_location(f"public.{name}")) == [entry.path]
