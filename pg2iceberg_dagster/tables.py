"""Each mirrored table's identity, resolved once from the config and passed down as a value: its source
names, its coordination key, its Iceberg identifier and its staging folder. No room re-derives them
from the config and a ``schema.table`` string (splitting at a dot misreads a name that holds one)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .config import PipelineConfig, TableConfig
from .errors import ConfigError
from .staging.store import table_location


@dataclass(frozen=True)
class MirroredTable:
    """One configured table, its names resolved."""

    config: TableConfig
    schema_name: str
    table_name: str
    # (namespace, name) of its Iceberg mirror: always a tuple, so a dot in a name never nests a namespace.
    iceberg: tuple[str, str]
    # Its folder under the staging root, which no other table's folder can equal, contain or escape.
    staging: str
    # (namespace, name) of its history table (docs/history.md); None when it has none.
    history: tuple[str, str] | None = None

    @property
    def key(self) -> str:
        """The canonical unquoted ``schema.table``: the table's key in the coordination tables."""
        return f"{self.schema_name}.{self.table_name}"

    @classmethod
    def of(cls, pipeline: PipelineConfig, table: TableConfig) -> MirroredTable:
        """``table`` of ``pipeline`` with its names resolved."""
        return cls(
            config=table,
            schema_name=table.schema_name,
            table_name=table.table_name,
            iceberg=pipeline.iceberg_identifier(table),
            staging=table_location(table.key),
            history=pipeline.history_identifier(table),
        )


class MirroredTables(Mapping[str, MirroredTable]):
    """The configured tables by key, in config order; an unknown key is a :class:`ConfigError`."""

    def __init__(self, config: PipelineConfig) -> None:
        # Tables a schema entry selected joined the config after its validation: checked again here.
        shared = config.shared_mirror()
        if shared:
            raise ConfigError(shared)
        self._tables = {table.key: MirroredTable.of(config, table) for table in config.tables}

    def __getitem__(self, key: str) -> MirroredTable:
        try:
            return self._tables[key]
        except KeyError:
            raise ConfigError(f"table {key} is not in the configuration") from None

    def __contains__(self, key: object) -> bool:
        return key in self._tables

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    def named(self, name: str) -> MirroredTable:
        """The table a user named on the command line: its key (``schema.table``) or its config name
        (SQL quoting, ``"My Schema"."t"``)."""
        if name in self._tables:
            return self._tables[name]
        for table in self._tables.values():
            if table.config.name == name:
                return table
        raise ConfigError(f"table {name} is not in the configuration")
