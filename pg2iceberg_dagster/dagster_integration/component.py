"""The mirror as a Dagster Component: ``dg scaffold defs pg2iceberg_dagster.dagster_integration.Pg2IcebergComponent
mirror`` writes ``defs/mirror/defs.yaml`` (and a starter pipeline config beside it), which ``dg`` loads
like dagster-sling's or dagster-dlt's components.

.. code-block:: yaml

    type: pg2iceberg_dagster.dagster_integration.Pg2IcebergComponent
    attributes:
      config: pg2iceberg.yaml          # relative to this file; or the pipeline config inline, as a mapping
      name: billing                    # optional: prefixes resource keys, sensors, jobs, pools (default: the folder)
      translation:                     # optional, per asset: {{ table }} (.key, .schema_name, ...), {{ role }}
        group_name: billing
        owners: [team:data-platform]
        tags: {domain: billing}
        key_prefix: billing
    post_processing:                   # Dagster's own, over the built assets
      assets:
        - target: "*"
          attributes: {kinds: [mirror]}
"""

import json
import logging
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, ClassVar

import yaml
from dagster import (
    AssetSpec,
    ComponentLoadContext,
    Definitions,
    ResolutionContext,
    Resolvable,
    Resolver,
    Scaffolder,
    ScaffoldRequest,
    StateBackedComponent,
    scaffold_with,
)
from dagster.components import DefsStateConfig, DefsStateConfigArgs, ResolvedDefsStateConfig
from dagster.components.component_scaffolding import scaffold_component
from dagster.components.utils.translation import TranslationFn, TranslationFnResolver
from pydantic import BaseModel, Field

from pg2iceberg_dagster.config import PipelineConfig, TableConfig

from .definitions import mirror_definitions, pipeline_resource, resolved_config
from .mirror import Mirror
from .translator import Pg2IcebergTranslator, TableAsset

log = logging.getLogger(__name__)

# What `dg scaffold defs` writes beside defs.yaml when no config is named: the smallest pipeline, to edit.
STARTER_CONFIG = {
    "source": {
        "host": "127.0.0.1",
        "port": 5432,
        "dbname": "app",
        "user": "replicator",
        "password_env": "PG2ICEBERG_SOURCE_PASSWORD",
    },
    "tables": ["public.orders"],
    "staging": {"url": "file:///var/lib/pg2iceberg/staging"},
    "iceberg": {"warehouse": "file:///var/lib/pg2iceberg/warehouse"},
}


class Pg2IcebergScaffoldParams(BaseModel):
    """``dg scaffold defs ... --config PATH``: name an existing pipeline config (relative to the new
    defs.yaml) instead of writing a starter ``pg2iceberg.yaml`` beside it."""

    config: str | None = Field(default=None, description="an existing pipeline config, relative to defs.yaml")


class Pg2IcebergScaffolder(Scaffolder[Pg2IcebergScaffoldParams]):
    """Writes defs.yaml naming the pipeline config, and a starter config when none is given."""

    @classmethod
    def get_scaffold_params(cls) -> type[Pg2IcebergScaffoldParams]:
        return Pg2IcebergScaffoldParams

    def scaffold(self, request: ScaffoldRequest[Pg2IcebergScaffoldParams]) -> None:
        config = request.params.config if request.params else None
        if config is None:
            config = "pg2iceberg.yaml"
            starter = request.target_path / config
            if not starter.exists():
                starter.write_text(
                    "# The pipeline this mirror runs; secrets are names of environment variables.\n"
                    + yaml.safe_dump(STARTER_CONFIG, sort_keys=False)
                )
        scaffold_component(request, {"config": config})


def _translation_vars(data: TableAsset) -> dict[str, Any]:
    return {"table": data.table, "role": data.role}


def _translated(translator: Pg2IcebergTranslator, translation: TranslationFn[TableAsset]) -> Pg2IcebergTranslator:
    """``translator`` with ``translation`` applied to every spec it returns (deps included: they are
    asked of the same method)."""

    class Translated(type(translator)):  # type: ignore[misc]
        def get_asset_spec(self, table: TableConfig, role: str) -> AssetSpec:
            return translation(super().get_asset_spec(table, role), TableAsset(table, role))

    return Translated(**{attribute.name: getattr(translator, attribute.name) for attribute in fields(translator)})


def _resolve_config(context: ResolutionContext, value: Any) -> str | dict[str, Any]:
    """The pipeline config: a path made absolute against the defs.yaml's folder, or the inline mapping."""
    value = context.resolve_value(value)
    if isinstance(value, str):
        folder = ComponentLoadContext.from_resolution_context(context).path
        return str((folder / value).resolve())
    return dict(value)


def _default_name(path: Path) -> str:
    """The mirror's name from its defs folder (``defs/billing_mirror`` -> ``billing_mirror``)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", path.name)
    return name if name[:1].isalpha() or name[:1] == "_" else f"_{name}"


@scaffold_with(Pg2IcebergScaffolder)
@dataclass
class Pg2IcebergComponent(StateBackedComponent, Resolvable):
    """Mirrors PostgreSQL tables into Apache Iceberg (one pipeline config, one source database).

    Per table: a source, a staged log, a CTID-chunk partitioned snapshot and the live Iceberg table
    (merged by Spark, with checks); plus the flusher, planner, merge, resync, maintenance and repair
    sensors and jobs.

    Loading connects to nothing. The tables a ``{schema: ...}`` entry selects are the component's
    state, read from the source by ``dg utils refresh-defs-state`` (and by ``dg dev``/``dagster dev``
    at start); without state, only the tables the config names are in the graph.

    Subclass and set ``translator_cls`` to a :class:`Pg2IcebergTranslator` subclass to decide the
    specs in Python; ``translation`` does it in YAML."""

    config: Annotated[str | dict[str, Any], Resolver(_resolve_config, model_field_type=str | dict[str, Any])]
    name: str | None = None
    translation: (
        Annotated[TranslationFn[TableAsset], TranslationFnResolver(template_vars_for_translation_fn=_translation_vars)]
        | None
    ) = None
    defs_state: ResolvedDefsStateConfig = field(default_factory=DefsStateConfigArgs.local_filesystem)

    translator_cls: ClassVar[type[Pg2IcebergTranslator]] = Pg2IcebergTranslator

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline config as written (no connection: a schema entry's tables are not read)."""
        return pipeline_resource(self.config).load_config()

    @property
    def defs_state_config(self) -> DefsStateConfig:
        # One pipeline per source and slot: its state's key outlives paths and folder names.
        config = self.pipeline_config()
        source = config.source
        key = f"Pg2IcebergComponent[{source.host}:{source.port}/{source.dbname}/{config.replication.slot}]"
        return DefsStateConfig.from_args(self.defs_state, default_key=key)

    def write_state_to_path(self, state_path: Path) -> None:
        """The tables of the pipeline now, a schema entry's as the source has them (``schema``,
        ``table`` pairs as JSON). Connects only for a config with a schema entry."""
        tables = resolved_config(self.config).tables
        state_path.write_text(json.dumps([[table.schema_name, table.table_name] for table in tables]))

    def build_defs_from_state(self, context: ComponentLoadContext, state_path: Path | None) -> Definitions:
        config = self.pipeline_config()
        if config.schemas and state_path is not None:
            config = config.with_selected_tables(tuple(name) for name in json.loads(state_path.read_text()))
        elif config.schemas:
            log.warning(
                "%s: no state yet, so the tables of its schema entries are not in the graph: "
                "run `dg utils refresh-defs-state`",
                context.path,
            )
        translator = self.translator_cls(config)
        if self.translation is not None:
            translator = _translated(translator, self.translation)
        mirror = Mirror(translator, self.name or _default_name(context.path))
        return mirror_definitions(mirror, pipeline_resource(self.config))
