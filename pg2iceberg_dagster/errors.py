"""Errors the engine raises on purpose: each says what is wrong and what to do."""

from __future__ import annotations

# Exit code of a command that ran without error but left some tables not up to date (waiting for their
# snapshot or an online resync): a script must not take it for success, nor for a failure to retry.
NOT_CURRENT_EXIT_CODE = 6


class Pg2IcebergError(Exception):
    """Base class: a refusal with a message meant for the operator."""

    exit_code = 1


class ConfigError(Pg2IcebergError):
    """The configuration file is missing, malformed or names something invalid."""

    exit_code = 2


class StartupCheckError(Pg2IcebergError):
    """An invariant checked before running does not hold (DESIGN.md rule 1)."""

    exit_code = 3


class SlotLostError(StartupCheckError):
    """The pipeline's replication slot is gone or lost WAL it needs: changes since are lost to the
    mirror until a repair (``pg2iceberg-dagster repair``) compares every table with the source."""


class SchemaChangeError(Pg2IcebergError):
    """A source schema change whose effect on existing rows no WAL change carries."""

    exit_code = 3


class ResyncRequiredError(SchemaChangeError):
    """A source change no WAL change carries (a rewrite that changes values, a type Iceberg cannot
    evolve into): the table must be copied again, online (``resync --table``)."""

    def __init__(self, table_key: str, reason: str) -> None:
        super().__init__(
            f"{table_key}: {reason}. Nothing was written. Resync the table online: run `pg2iceberg-dagster "
            f"resync --table {table_key}` (`run` and Dagster do so on their own unless materialize.auto_resync is off)"
        )
        self.table_key = table_key
        self.reason = reason


class SnapshotGoneError(Pg2IcebergError):
    """An exported snapshot can no longer be imported: the session that exported it ended (its holder
    stopped). Reading under it again is impossible; a new snapshot must be taken."""


class UnsupportedTypeError(Pg2IcebergError):
    """A column type has no faithful Iceberg representation."""

    exit_code = 3


class StagingError(Pg2IcebergError):
    """Staged data cannot be written or read: the object store (unreachable, full, denied) or the local
    spill directory of a large transaction (full)."""

    exit_code = 1


class SlotBusyError(Pg2IcebergError):
    """Another process is consuming the replication slot."""

    exit_code = 4


class LeaseBusyError(Pg2IcebergError):
    """Another materializer holds the writer lease for a table."""

    exit_code = 4


class VerifyMismatchError(Pg2IcebergError):
    """PostgreSQL and Iceberg differ."""

    exit_code = 5


class CutError(Pg2IcebergError):
    """A consistent cut cannot be taken (see docs/cuts.md): a table is not mergeable, a name is bad or taken."""
