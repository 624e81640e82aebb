"""A command that ran without error but left a table stale says so in its exit code (6), distinct from
success and from errors, and in its ``--json``; ``materialize --once --resync`` also performs the pending
resyncs, so a scripted catch-up ends with every table current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pg2iceberg_dagster.cli import main
from pg2iceberg_dagster.config import PipelineConfig
from pg2iceberg_dagster.errors import NOT_CURRENT_EXIT_CODE

from .conftest import SourceDb, assert_mirrored

pytestmark = pytest.mark.usefixtures("spark")


def _write(path: Path, config: PipelineConfig) -> str:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return str(path)


def test_materialize_once_with_a_table_waiting_for_its_snapshot_exits_6(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source.execute("CREATE TABLE public.a (id int PRIMARY KEY); CREATE TABLE public.b (id int PRIMARY KEY)")
    source.execute("INSERT INTO public.a VALUES (1); INSERT INTO public.b VALUES (1)")
    assert main(["-c", _write(tmp_path / "a.yaml", source.config(["public.a"])), "snapshot"]) == 0
    both = _write(tmp_path / "both.yaml", source.config(["public.a", "public.b"]))
    source.execute("INSERT INTO public.a VALUES (2); INSERT INTO public.b VALUES (2)")
    assert main(["-c", both, "stream", "--until-caught-up"]) == 0
    capsys.readouterr()
    assert main(["-c", both, "materialize", "--once", "--json"]) == NOT_CURRENT_EXIT_CODE
    results = {result["table"]: result for result in json.loads(capsys.readouterr().out)}
    assert results["public.a"]["current"] and results["public.a"]["changes"] == 1
    assert not results["public.b"]["current"]
    assert "waiting for its snapshot" in results["public.b"]["not_current_because"]
    # Once the snapshot is taken, the same catch-up succeeds.
    assert main(["-c", both, "snapshot"]) == 0
    assert main(["-c", both, "materialize", "--once"]) == 0


def test_materialize_once_resync_performs_the_pending_resync(
    source: SourceDb, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source.execute("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.execute("INSERT INTO public.items SELECT g, 'v' FROM generate_series(1, 10) g")
    config = source.config(["public.items"])
    path = _write(tmp_path / "p.yaml", config)
    assert main(["-c", path, "snapshot"]) == 0
    # A volatile default fills older rows with values no WAL change carries: the merge asks for a resync.
    source.execute("ALTER TABLE public.items ADD COLUMN token text DEFAULT md5(random()::text)")
    source.execute("INSERT INTO public.items (id, v) VALUES (11, 'after')")
    assert main(["-c", path, "stream", "--until-caught-up"]) == 0
    capsys.readouterr()
    assert main(["-c", path, "materialize", "--once"]) == NOT_CURRENT_EXIT_CODE
    assert "public.items: not up to date, waiting for an online resync" in capsys.readouterr().out
    source.execute("UPDATE public.items SET v = 'meanwhile' WHERE id = 3")
    assert main(["-c", path, "stream", "--until-caught-up"]) == 0
    assert main(["-c", path, "materialize", "--once", "--resync"]) == 0
    assert_mirrored(source.pipeline(config))


def test_resync_and_json_without_once_are_refused(source: SourceDb, tmp_path: Path) -> None:
    path = _write(tmp_path / "p.yaml", source.config(["public.whatever"]))
    assert main(["-c", path, "materialize", "--resync"]) == 2
