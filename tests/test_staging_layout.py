"""Each table's staged files live in a folder of its own that no other table's folder can equal, contain
or sit in, and that cannot leave the staging root, whatever the table's name holds: cleanup of one table
never deletes another's unmerged files, and nothing is written outside the staging root. Files staged
under the first layout (a folder named by the raw ``schema.table``) are still merged and swept."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from pg2iceberg_dagster.pipeline import Pipeline
from pg2iceberg_dagster.staging.codec import decode
from pg2iceberg_dagster.staging.store import ObjectStore, table_location

from .conftest import SourceDb, assert_mirrored, sync
from .test_s3_staging import BUCKET, s3_endpoint  # noqa: F401 (the fixture)

# Characters S3 keys, URLs and Hadoop paths treat specially, in one table name.
SPECIAL = "we ird+%2F?#&=;:,$@\\{}^~|`[]<>*!'\"é"


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _files_outside(root: Path, staging: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file() and staging not in path.parents]


def _staging_dir(pipeline: Pipeline) -> Path:
    return Path(pipeline.config.staging.url.removeprefix("file://"))


def _staging_url(tmp_path: Path) -> dict[str, str]:
    # Two levels below tmp_path, so a path that climbs out of the staging root stays where the test sees it.
    return {"url": f"file://{tmp_path}/inner/staging"}


def _nested_tables_staged(source: SourceDb) -> Pipeline:
    """``public.a`` and ``public."a/b"`` snapshotted, then rows inserted into both and staged."""
    source.execute('CREATE TABLE public.a (id int PRIMARY KEY, v text); CREATE TABLE public."a/b" (id int PRIMARY KEY)')
    source.execute("INSERT INTO public.a VALUES (1, 'one'); INSERT INTO public.\"a/b\" VALUES (1)")
    pipeline = source.pipeline(source.config(["public.a", 'public."a/b"']))
    pipeline.snapshot()
    source.execute("INSERT INTO public.a SELECT g, 'v' || g FROM generate_series(2, 50) g")
    source.execute('INSERT INTO public."a/b" SELECT generate_series(2, 134)')
    pipeline.stream(until_caught_up=True)
    return pipeline


@pytest.mark.usefixtures("spark")
def test_cleanup_of_a_table_keeps_the_unmerged_files_of_a_table_named_inside_it(source: SourceDb) -> None:
    """``public.a`` and ``public."a/b"``: the first one's cleanup used to list ``public.a/`` recursively
    and delete ``public.a/b/``'s unmerged files, which the slot had already been acknowledged past."""
    pipeline = _nested_tables_staged(source)
    pipeline.materialize(["public.a"])
    pipeline.collect_garbage()
    pipeline.materialize()
    assert_mirrored(pipeline)
    assert table_location("public.a") != table_location("public.a/b")


@pytest.mark.usefixtures("spark")
def test_a_name_with_dot_dot_segments_stages_inside_the_staging_root(source: SourceDb, tmp_path: Path) -> None:
    """A table anyone with CREATE can name ``../../../x`` used to place its staged files above the root."""
    source.execute('CREATE TABLE public."../../../escaped" (id int PRIMARY KEY, v text)')
    pipeline = source.pipeline(source.config(['public."../../../escaped"'], staging=_staging_url(tmp_path)))
    pipeline.snapshot()
    source.execute("INSERT INTO public.\"../../../escaped\" SELECT g, 'v' FROM generate_series(1, 20) g")
    sync(pipeline)
    pipeline.collect_garbage()
    source.execute("UPDATE public.\"../../../escaped\" SET v = 'w' WHERE id < 5")
    sync(pipeline)
    assert_mirrored(pipeline)
    staging = _staging_dir(pipeline)
    assert list(staging.iterdir()), "the staged files are under the staging root"
    assert _files_outside(tmp_path, staging) == []


@pytest.mark.usefixtures("spark")
def test_a_name_with_characters_special_to_s3_keys_and_urls_is_merged(source: SourceDb, tmp_path: Path) -> None:
    """Staged files and merge batches of such a table are read back by Spark through their URL."""
    quoted = f"public.{_quoted(SPECIAL)}"
    source.execute(f"CREATE TABLE {quoted} (id int PRIMARY KEY, v text)")
    pipeline = source.pipeline(source.config([quoted], staging=_staging_url(tmp_path)))
    pipeline.snapshot()
    source.execute(f"INSERT INTO {quoted} SELECT g, 'v' FROM generate_series(1, 30) g")
    sync(pipeline)
    source.execute(f"UPDATE {quoted} SET v = 'changed' WHERE id % 3 = 0; DELETE FROM {quoted} WHERE id % 5 = 0")
    sync(pipeline)
    pipeline.collect_garbage()
    assert_mirrored(pipeline)
    (folder,) = (path.name for path in _staging_dir(pipeline).iterdir() if not path.name.startswith("_"))
    assert folder == table_location(f"public.{SPECIAL}")
    assert _files_outside(tmp_path, _staging_dir(pipeline)) == []


def test_s3_keys_of_a_name_with_special_characters_are_listed_exactly(
    source: SourceDb,
    s3_endpoint: str,  # noqa: F811 (the fixture)
) -> None:
    """On S3 the staged files of ``public.a`` and of a special-character name sharing its prefix are
    uploaded, listed and garbage-collected each in its own folder."""
    special = f"a/{SPECIAL}"
    quoted = f"public.{_quoted(special)}"
    source.execute(f"CREATE TABLE public.a (id int PRIMARY KEY); CREATE TABLE {quoted} (id int PRIMARY KEY)")
    staging = {
        "url": f"s3://{BUCKET}/{source.name}",
        "s3": {"endpoint": s3_endpoint, "access_key_id_env": "TEST_S3_KEY", "secret_access_key_env": "TEST_S3_SECRET"},
    }
    keys = ["public.a", f"public.{special}"]
    pipeline = source.pipeline(source.config(["public.a", quoted], staging=staging))
    pipeline.snapshot()
    source.execute(f"INSERT INTO public.a VALUES (1); INSERT INTO {quoted} VALUES (2)")
    pipeline.stream(until_caught_up=True)
    store = ObjectStore(pipeline.config.staging)
    entries = {key: pipeline.store.log_entries(key, 0) for key in keys}
    for key, (entry,) in entries.items():
        assert store.files_in(table_location(key)) == [entry.path]
        assert len(decode(store.get(entry.path))[1]) == 1
    # public.a applied everything: its cleanup deletes its file and leaves the other table's.
    (applied,) = entries["public.a"]
    pipeline.store.advance_mat_cursor("default", "public.a", applied.end_offset, applied.flushable_lsn, None)
    assert pipeline.collect_garbage().files_deleted == 1
    assert store.list() == [entries[f"public.{special}"][0].path]


@pytest.fixture
def legacy_layout(source: SourceDb) -> Iterator[Pipeline]:
    """Two tables whose staged files lie where the first layout put them (``<schema>.<table>/``), as a
    pipeline upgraded with unmerged changes finds them, and an unregistered upload in the old folder."""
    pipeline = _nested_tables_staged(source)
    root = _staging_dir(pipeline)
    with pipeline.store.conn.transaction():
        for key in ("public.a", "public.a/b"):
            for entry in pipeline.store.log_entries(key, 0):
                old = f"{key}/{entry.path.rsplit('/', 1)[1]}"
                (root / old).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(root / entry.path, root / old)
                pipeline.store.conn.execute(
                    "UPDATE _pg2iceberg.log_index SET path = %s WHERE path = %s", (old, entry.path)
                )
        pipeline.store.conn.execute("UPDATE _pg2iceberg.tables SET staging_layout = 1")
    (root / "public.a" / "0000000000000001-abandoned0000.parquet").write_bytes(b"an upload never registered")
    yield pipeline


@pytest.mark.usefixtures("spark")
def test_files_staged_under_the_first_layout_are_merged_and_swept(legacy_layout: Pipeline) -> None:
    pipeline = legacy_layout
    root = _staging_dir(pipeline)
    # Cleanup before any merge: only the unregistered upload goes; public."a/b"'s files stay.
    assert pipeline.collect_garbage().files_deleted == 1
    assert not (root / "public.a" / "0000000000000001-abandoned0000.parquet").exists()
    assert list((root / "public.a" / "b").iterdir())
    sync(pipeline)
    assert_mirrored(pipeline)
    pipeline.collect_garbage()
    assert [path for path in root.rglob("*") if path.is_file()] == []
    assert pipeline.store.conn.execute(
        "SELECT count(*) FROM _pg2iceberg.tables WHERE staging_layout < 2"
    ).fetchone() == (0,)
