"""The Dagster integration as a team installs it: a project made by ``create-dagster`` in a temporary
directory, this checkout installed in the venv that runs the tests, mirrors of two source databases
scaffolded with ``dg scaffold defs`` beside a team's own automation sensor; ``dg check defs`` passes and
``dg list defs`` shows both mirrors' assets, sensors, jobs and resources, a schema entry's tables read
into the component's state. Also, without ``dg``: two mirrors merge into one code location, a translator
subclass renames keys with the graph intact, loading definitions writes nothing, and importing the
engine does not import Dagster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import AssetKey, AssetsDefinition, Definitions

from pg2iceberg_dagster.config import TableConfig, parse_config
from pg2iceberg_dagster.dagster_integration import ROLES, Pg2IcebergTranslator, build_definitions

from .conftest import SourceDb

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
COMPONENT = "pg2iceberg_dagster.dagster_integration.Pg2IcebergComponent"


def _config(dbname: str, tables: list[Any]) -> dict[str, Any]:
    return {
        "source": {"host": "127.0.0.1", "dbname": dbname, "user": "replicator", "password_env": "PGPASSWORD"},
        "tables": tables,
        "replication": {"slot": f"{dbname}_slot", "publication": f"{dbname}_pub"},
    }


def test_two_mirrors_load_side_by_side() -> None:
    """Two source databases with the same table names: every name Dagster needs unique is the
    mirror's own (resource keys, sensors, jobs, pools, ops, partitions); the keys by a translator."""

    class Prefixed(Pg2IcebergTranslator):
        def get_asset_spec(self, table: TableConfig, role: str) -> Any:
            spec = super().get_asset_spec(table, role)
            return spec.replace_attributes(key=spec.key.with_prefix(self.config.source.dbname))

    app = build_definitions(_config("app", ["public.orders"]), name="app")
    billing = build_definitions(_config("billing", ["public.orders"]), name="billing", translator_cls=Prefixed)
    defs = Definitions.merge(app, billing)
    Definitions.validate_loadable(defs)
    assert set(defs.resources or {}) == {"app", "app_spark", "billing", "billing_spark"}
    sensors = {sensor.name for sensor in defs.sensors or []}
    for name in ("flusher", "snapshot_planner", "merge", "resync", "maintenance", "repair"):
        assert {f"app_{name}", f"billing_{name}"} <= sensors
    assert {job.name for job in defs.jobs or []} == {
        f"{mirror}_{job}"
        for mirror in ("app", "billing")
        for job in ("merge", "resync", "maintenance", "cut", "repair")
    }
    specs = {spec.key: spec for spec in defs.resolve_all_asset_specs()}
    live = specs[AssetKey(["billing", "iceberg", "public", "orders"])]
    assert {dep.asset_key for dep in live.deps} == {
        AssetKey(["billing", "iceberg", "public", "orders_snapshot"]),
        AssetKey(["billing", "staged_log", "public", "orders_staged_log"]),
    }, "the deps follow the translator's keys"
    assert AssetKey(["iceberg", "public", "orders"]) in specs
    assert {spec.group_name for spec in specs.values()} == {"app_public", "billing_public"}, "a group per mirror"
    assert all(spec.tags.get("pg2iceberg") == "" for spec in specs.values()), "the tag a team's selection excludes"
    snapshots = [defs.resolve_assets_def(key) for key in specs if key.path[-1] == "orders_snapshot"]
    partitions = {assets.partitions_def.name for assets in snapshots}  # type: ignore[union-attr]
    assert partitions == {"app_ctid_chunks__public__orders", "billing_ctid_chunks__public__orders"}
    pools = {assets.node_def.pool for assets in defs.assets or [] if isinstance(assets, AssetsDefinition)}
    assert {"app_snapshot", "app_merge", "billing_snapshot", "billing_merge"} <= pools


def test_a_table_with_history_has_its_history_asset_downstream_of_its_live_table() -> None:
    """``history: true`` adds a fifth asset, the history table, downstream of the live table, written by
    the same merge step (the merge job selects it with the live table); a table without history has none."""
    defs = build_definitions(_config("app", [{"name": "public.orders", "history": True}, "public.items"]), name="app")
    Definitions.validate_loadable(defs)
    specs = {spec.key: spec for spec in defs.resolve_all_asset_specs()}
    live, history = AssetKey(["iceberg", "public", "orders"]), AssetKey(["iceberg", "public", "orders_history"])
    assert {dep.asset_key for dep in specs[history].deps} == {live}
    assert "Iceberg table pg2iceberg.public.orders_history" in (specs[history].description or "")
    assert AssetKey(["iceberg", "public", "items_history"]) not in specs
    merge = defs.resolve_assets_def(live)
    assert merge is defs.resolve_assets_def(history), "one merge step writes both"
    assert {live, history} <= set(defs.resolve_job_def("app_merge").asset_layer.selected_asset_keys)


def test_get_asset_spec_returns_whole_specs() -> None:
    t = Pg2IcebergTranslator(parse_config(_config("app", ["public.orders"])))
    (table,) = t.config.tables
    specs = {role: t.get_asset_spec(table, role) for role in ROLES}
    assert (
        specs["source"].kinds == {"postgres"} and specs["source"].metadata["dagster/table_name"] == "app.public.orders"
    )
    assert {dep.asset_key for dep in specs["iceberg"].deps} == {specs["snapshot"].key, specs["staged_log"].key}
    assert specs["iceberg"].group_name == "pg2iceberg_public"
    assert "Iceberg table" in (specs["iceberg"].description or "")


def _env() -> dict[str, str]:
    """The test venv first on PATH, as a team's activated venv; no version check against PyPI."""
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": sys.prefix,
        "DAGSTER_DG_UPDATE_CHECK_ENABLED": "0",
        "PYTHONPATH": "src",  # the team project is not installed: its package is found in src/
    }


def _field(listed: dict[str, Any], name: str, older_name: str) -> Any:
    """A field of ``dg list defs --json``: dg 1.13 names it ``name``, 1.12 ``older_name``."""
    return listed[name] if name in listed else listed[older_name]


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(
        [str(BIN / args[0]), *args[1:]], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}\n{done.stderr}"
    return done.stdout


TEAM_DEFS = """\
import dagster as dg


@dg.asset(automation_condition=dg.AutomationCondition.on_cron("0 * * * *"))
def team_report() -> None: ...


# The team's own automation sensor over everything but the mirrors (their sensors cover their assets).
team_automation = dg.AutomationConditionSensorDefinition(
    "team_automation",
    target=dg.AssetSelection.all() - dg.AssetSelection.tag("pg2iceberg", ""),
    default_status=dg.DefaultSensorStatus.RUNNING,
)
"""

BILLING_TRANSLATION = """\
  translation:
    key_prefix: billing
    group_name: "billing_{{ table.schema_name }}"
    owners: [team:billing]
    tags: {domain: billing}

post_processing:
  assets:
    - target: "*"
      attributes:
        kinds: [pg2iceberg]
"""


OFFLINE_STATE = """\
  defs_state:
    management_type: LOCAL_FILESYSTEM
    refresh_if_dev: false
"""


@pytest.mark.timeout(600)
def test_a_dagster_project_adds_two_mirrors_with_dg(source: SourceDb, tmp_path: Path) -> None:
    source.execute("CREATE SCHEMA billing")
    source.execute(
        "CREATE TABLE billing.orders (id int PRIMARY KEY); CREATE TABLE billing.invoices (id int PRIMARY KEY)"
    )
    _run(["create-dagster", "project", "teamproj", "--no-uv-sync"], tmp_path)
    project = tmp_path / "teamproj"
    defs_dir = project / "src" / "teamproj" / "defs"
    assert COMPONENT in _run(["dg", "list", "components", "--json"], project)

    # The first mirror with the starter config the scaffolder writes; the second names its own: every
    # table of the schema billing of another database (read into the component's state by dg).
    _run(["dg", "scaffold", "defs", COMPONENT, "mirror"], project)
    assert yaml.safe_load((defs_dir / "mirror" / "defs.yaml").read_text()) == {
        "type": COMPONENT,
        "attributes": {"config": "pg2iceberg.yaml"},
    }
    assert (defs_dir / "mirror" / "pg2iceberg.yaml").exists()
    _run(["dg", "scaffold", "defs", COMPONENT, "billing", "--config", "billing.yaml"], project)
    billing_config = source.config([{"schema": "billing"}], iceberg={"namespace": "{schema}"})
    (defs_dir / "billing" / "billing.yaml").write_text(yaml.safe_dump(billing_config.model_dump(mode="json")))
    with (defs_dir / "billing" / "defs.yaml").open("a") as defs_yaml:
        defs_yaml.write(BILLING_TRANSLATION)
    # A third whose source is unreachable: with no state and no refresh, it loads its named tables
    # without connecting.
    _run(["dg", "scaffold", "defs", COMPONENT, "offline"], project)
    offline = _config("offline", ["public.named", {"schema": "public"}])
    offline["source"]["port"] = 1
    (defs_dir / "offline" / "pg2iceberg.yaml").write_text(yaml.safe_dump(offline))
    with (defs_dir / "offline" / "defs.yaml").open("a") as defs_yaml:
        defs_yaml.write(OFFLINE_STATE)
    (defs_dir / "team").mkdir()
    (defs_dir / "team" / "defs.py").write_text(TEAM_DEFS)

    assert "All definitions loaded successfully" in _run(["dg", "check", "defs"], project)
    listed = json.loads(_run(["dg", "list", "defs", "--json"], project))
    assets = {_field(asset, "asset_key", "key"): asset for asset in listed["assets"]}
    for key in ("pg/public/orders_source", "staged_log/public/orders_staged_log", "iceberg/public/orders"):
        assert key in assets
    for table in ("orders", "invoices"):
        for key in (f"pg/billing/{table}_source", f"staged_log/billing/{table}_staged_log", f"iceberg/billing/{table}"):
            assert f"billing/{key}" in assets
    assert "pg/public/named_source" in assets
    assert len(assets) == 4 * (1 + 2 + 1) + 3 + 1, (
        "four per table (mirror, billing's two, offline), a slot per mirror and the team's"
    )
    billing = assets["billing/iceberg/billing/orders"]
    assert _field(billing, "group_name", "group") == "billing_billing"
    assert "billing" in json.dumps(billing["owners"])
    assert billing["kinds"] == ["pg2iceberg"], "post_processing applies"
    assert set(_field(billing, "dependency_keys", "deps")) == {
        "billing/iceberg/billing/orders_snapshot",
        "billing/staged_log/billing/orders_staged_log",
    }
    sensors = {sensor["name"] for sensor in listed["sensors"]}
    assert {"mirror_flusher", "billing_flusher", "mirror_merge", "billing_merge"} <= sensors
    assert "team_automation" in sensors
    assert {job["name"] for job in listed["jobs"]} == {
        f"{mirror}_{job}"
        for mirror in ("mirror", "billing", "offline")
        for job in ("merge", "resync", "maintenance", "cut", "repair")
    }
    resources = {resource["name"] for resource in listed["resources"]}
    assert resources == {
        f"{mirror}{suffix}" for mirror in ("mirror", "billing", "offline") for suffix in ("", "_spark")
    }
    assert len(listed["asset_checks"]) == 4 * 4 + 3  # four checks per live table, slot_safe per mirror


def _written() -> list[tuple[str, float]]:
    """The repository's top-level entries and the quickstart's config, with their modification times."""
    paths = [*REPO.iterdir(), REPO / ".pg2iceberg" / "pg2iceberg.yaml"]
    return sorted((path.name, path.stat().st_mtime) for path in paths if path.exists())


def test_loading_the_repository_location_writes_nothing() -> None:
    """Without PG2ICEBERG_CONFIG the repository's definitions.py shows a graph and writes no file."""
    before = _written()
    env = {key: value for key, value in os.environ.items() if key != "PG2ICEBERG_CONFIG"}
    probe = "import definitions; print(len(list(definitions.defs.resolve_all_asset_specs())))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env={**env, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0
    assert _written() == before


def test_the_engine_does_not_import_dagster() -> None:
    probe = (
        "import sys, pg2iceberg_dagster, pg2iceberg_dagster.pipeline, pg2iceberg_dagster.cli;"
        "print(sorted(m for m in sys.modules if m == 'dagster' or m.startswith(('dagster.', 'dagster_'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
