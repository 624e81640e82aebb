"""Startup validation: every invariant of DESIGN.md rule 1, each refusal saying what to do."""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import psycopg
from psycopg import sql

from .config import PipelineConfig, ReplicationConfig, TableConfig
from .coordination.records import SLOT_LOST_REASON, PipelineMeta, TableState
from .coordination.store import CoordinationStore
from .errors import SlotLostError, StartupCheckError, UnsupportedTypeError
from .failover import failover_warnings
from .iceberg.change_metadata import refuse_metadata_name_clash
from .iceberg.delete_formats import (
    DESCRIBED,
    FORMAT_VERSION,
    WHY_NOT_WRITABLE,
    WRITABLE,
    chosen_format,
    conflicting_modes,
    unable_to_read,
)
from .iceberg.layout import layout_problems
from .iceberg.types import iceberg_schema
from .snapshot.chunks import MIN_CTID_RANGE_VERSION
from .source.catalog import SourceTable, TypeResolver, describe_table, publication_tables, server_version
from .source.connection import connect
from .source.lsn import format_lsn, parse_lsn
from .source.publication_policy import reconcile, refuse_unfilterable, table_entries, try_entries
from .source.replication import failover_wanted

log = logging.getLogger(__name__)

SLOT_RECORD_WAIT_SECONDS = 30.0


@dataclass(frozen=True)
class SlotInfo:
    """The replication slot as ``pg_replication_slots`` shows it (one implementation, read by the
    startup checks, ``status``, the metrics and the Dagster slot asset).

    ``retained_wal_bytes`` is the WAL the slot holds back (from ``restart_lsn`` to the current WAL
    position; None once the slot lost its WAL); ``safe_wal_size_bytes`` (PG13+) how much more WAL can be
    written before the slot is in danger of losing WAL (None when ``max_slot_wal_keep_size`` is -1,
    unlimited); ``max_slot_wal_keep_size_bytes`` that setting (None: unlimited); ``inactive_seconds``
    how long no process has streamed from it (PG17+ ``inactive_since``; None below 17 or while active).

    ``read_at`` (the server's clock) and ``wal_lsn`` (``pg_current_wal_lsn()``) date the reading. The
    WAL budget (``wal_budget.estimate_wal_budget`` compares it with the previous reading) fills the last
    three: the server's WAL write rate and the rate ``safe_wal_size`` shrinks at, in bytes per second,
    and ``seconds_until_lost``, ``safe_wal_size`` over that rate (None while unknown, with
    ``max_slot_wal_keep_size`` unlimited, or when ``safe_wal_size`` does not shrink)."""

    plugin: str
    database: str
    confirmed_flush_lsn: int | None
    wal_status: str | None
    active_pid: int | None
    active: bool = False
    restart_lsn: int | None = None
    retained_wal_bytes: int | None = None
    safe_wal_size_bytes: int | None = None
    max_slot_wal_keep_size_bytes: int | None = None
    inactive_seconds: float | None = None
    read_at: datetime | None = None
    wal_lsn: int | None = None
    # Why the server invalidated the slot: PG17+ ``invalidation_reason`` (wal_removed, rows_removed,
    # wal_level_insufficient, idle_timeout); on PG16, "conflicting with recovery" when ``conflicting``.
    invalidated: str | None = None
    wal_write_bytes_per_second: float | None = None
    safe_wal_shrink_bytes_per_second: float | None = None
    seconds_until_lost: float | None = None
    failover: bool | None = None  # a failover slot (PostgreSQL 17+; None below)

    @property
    def lost(self) -> str | None:
        """Why the slot can no longer deliver every change (its WAL removed, or invalidated by the server
        for another reason), as the refusal and the ``slot_safe`` check say it; None while usable."""
        if self.wal_status == "lost":
            because = f"; invalidation_reason {self.invalidated}" if self.invalidated else ""
            return f"has lost required WAL (wal_status = lost{because})"
        if self.invalidated:
            return f"was invalidated by the server ({self.invalidated})"
        return None

    @property
    def minutes_until_lost(self) -> float | None:
        """``seconds_until_lost`` in minutes."""
        return None if self.seconds_until_lost is None else self.seconds_until_lost / 60

    def wal_budget(self) -> dict[str, float | None]:
        """The WAL budget as ``status`` and the Dagster observation show it: rates in bytes per second
        to 0.1, minutes to 0.01 (None: not known)."""
        return {
            "wal_write_bytes_per_second": _rounded(self.wal_write_bytes_per_second, 1),
            "safe_wal_shrink_bytes_per_second": _rounded(self.safe_wal_shrink_bytes_per_second, 1),
            "minutes_until_lost": _rounded(self.minutes_until_lost, 2),
        }


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class SlotSafety:
    """How safe the slot is: ``level`` ok, warn (act before it loses WAL) or error (it has)."""

    level: Literal["ok", "warn", "error"]
    reason: str


@dataclass(frozen=True)
class StartupReport:
    """What the checks found; the engine's entry points start from it."""

    server_version: int
    system_identifier: str
    tables: dict[str, SourceTable]
    slot: SlotInfo | None
    # Why the pipeline's slot cannot be resumed (gone, or lost WAL), when the checks were asked to let
    # that through for a repair; None when it can.
    slot_lost: str | None = None
    # What does not stop the pipeline but should be fixed (a source that cannot fail over safely).
    warnings: tuple[str, ...] = ()

    @property
    def ctid_chunking(self) -> bool:
        return self.server_version >= MIN_CTID_RANGE_VERSION


def identify_system(config: PipelineConfig) -> str:
    """The source cluster's ``system_identifier`` (IDENTIFY_SYSTEM on a replication connection)."""
    with connect(config.source, replication=True) as conn:
        row = conn.execute("IDENTIFY_SYSTEM").fetchone()
    assert row is not None
    return str(row[0])


def slot_info(conn: psycopg.Connection, slot: str) -> SlotInfo | None:
    """The slot ``slot`` as the server shows it now, None when it does not exist. Reads the row as JSON,
    so columns a server version lacks (``inactive_since`` before 17) are simply absent."""
    row = conn.execute(
        "SELECT to_jsonb(s), pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::float8, now(), "
        "(SELECT setting::bigint * 1024 * 1024 FROM pg_settings WHERE name = 'max_slot_wal_keep_size' "
        "AND unit = 'MB'), pg_current_wal_lsn()::text FROM pg_replication_slots s WHERE s.slot_name = %s",
        (slot,),
    ).fetchone()
    if row is None:
        return None
    fields, retained, now, max_keep, wal_lsn = row
    inactive_since = fields.get("inactive_since")
    inactive = None
    if inactive_since and not fields.get("active"):
        inactive = max(0.0, (now - datetime.fromisoformat(inactive_since)).total_seconds())
    return SlotInfo(
        plugin=fields["plugin"],
        database=fields["database"],
        confirmed_flush_lsn=parse_lsn(fields["confirmed_flush_lsn"]) if fields.get("confirmed_flush_lsn") else None,
        wal_status=fields.get("wal_status"),
        active_pid=fields.get("active_pid"),
        active=bool(fields.get("active")),
        restart_lsn=parse_lsn(fields["restart_lsn"]) if fields.get("restart_lsn") else None,
        retained_wal_bytes=int(retained) if retained is not None else None,
        safe_wal_size_bytes=fields.get("safe_wal_size"),
        max_slot_wal_keep_size_bytes=int(max_keep) if max_keep is not None and max_keep >= 0 else None,
        inactive_seconds=inactive,
        invalidated=_invalidation(fields),
        read_at=now,
        wal_lsn=parse_lsn(wal_lsn),
        failover=fields.get("failover"),
    )


def _invalidation(fields: dict[str, Any]) -> str | None:
    """Why the server invalidated the slot, from its ``pg_replication_slots`` row: PG17+ names the reason;
    PG16 only says ``conflicting`` (a logical slot invalidated for conflicting with recovery); older
    versions say neither (``wal_status`` lost is their only sign)."""
    if reason := fields.get("invalidation_reason"):
        return str(reason)
    if fields.get("conflicting"):
        return "conflicting = true: it conflicted with recovery"
    return None


def slot_safety(slot: SlotInfo | None, settings: ReplicationConfig) -> SlotSafety:
    """Whether the slot can still deliver every change, and for how long.

    error: the slot is gone, or lost WAL (``wal_status`` lost): the mirror must be snapshotted again.
    warn: ``wal_status`` unreserved (past ``max_slot_wal_keep_size``: the next checkpoint may remove its
    WAL); or ``safe_wal_size`` below ``slot_warn_safe_wal_fraction`` of ``max_slot_wal_keep_size``; or
    no process streamed from it for ``slot_inactive_warn_seconds`` (PG17+, which records since when);
    or, checked right after unreserved, at the rate ``safe_wal_size`` shrinks now it reaches 0 within
    ``slot_warn_minutes_until_lost`` (``slot.seconds_until_lost``, filled by
    ``wal_budget.estimate_wal_budget``; a slot not read through it has no estimate and skips this rule).
    A slot that is merely inactive between the Dagster flusher's ticks is normal."""
    name = settings.slot
    if slot is None:
        return SlotSafety("error", f"replication slot {name} does not exist")
    if lost := slot.lost:
        return SlotSafety(
            "error",
            f"replication slot {name} {lost}: `pg2iceberg-dagster repair` writes into each Iceberg table only its "
            "differences from the source under a new slot",
        )
    if slot.wal_status == "unreserved":
        return SlotSafety(
            "warn",
            f"replication slot {name} retains more WAL than max_slot_wal_keep_size (wal_status unreserved): "
            "the next checkpoint may remove WAL it needs; let the flusher catch up",
        )
    keep = slot.max_slot_wal_keep_size_bytes
    horizon = settings.slot_warn_minutes_until_lost * 60
    if horizon and slot.seconds_until_lost is not None and slot.seconds_until_lost < horizon:
        return SlotSafety("warn", _wal_budget_warning(slot, name))
    if (
        keep
        and slot.safe_wal_size_bytes is not None
        and slot.safe_wal_size_bytes < settings.slot_warn_safe_wal_fraction * keep
    ):
        return SlotSafety(
            "warn",
            f"replication slot {name} can retain only {slot.safe_wal_size_bytes} more bytes of WAL "
            f"(under {settings.slot_warn_safe_wal_fraction:.0%} of max_slot_wal_keep_size {keep}): the flusher lags",
        )
    if slot.inactive_seconds is not None and slot.inactive_seconds >= settings.slot_inactive_warn_seconds:
        return SlotSafety(
            "warn",
            f"nothing has streamed from replication slot {name} for {slot.inactive_seconds:.0f} s: "
            "is the flusher running?",
        )
    return SlotSafety("ok", f"replication slot {name} is {slot.wal_status or 'reserved'}")


def _megabytes(count: float) -> str:
    return f"{count / (1024 * 1024):.1f} MB"


def _wal_budget_warning(slot: SlotInfo, name: str) -> str:
    """What the WAL budget rule of :func:`slot_safety` says: how soon, at what rate, and what to do."""
    minutes = slot.minutes_until_lost or 0.0
    about = f"{minutes:.1f}" if minutes < 10 else f"{minutes:.0f}"
    shrink = slot.safe_wal_shrink_bytes_per_second or 0.0
    written = slot.wal_write_bytes_per_second
    keep = slot.max_slot_wal_keep_size_bytes
    return (
        f"at the current rate of {shrink / (1024 * 1024):.2f} MB/s the replication slot {name} loses WAL in "
        f"about {about} minutes (safe_wal_size {_megabytes(slot.safe_wal_size_bytes or 0)} left"
        + (f", the server writes {written / (1024 * 1024):.2f} MB/s of WAL" if written is not None else "")
        + "); start the flusher or let it catch up (`pg2iceberg-dagster stream`, `run`, or the Dagster flusher "
        f"sensor), or raise max_slot_wal_keep_size (now {_megabytes(keep or 0)}: ALTER SYSTEM SET "
        "max_slot_wal_keep_size = ...; SELECT pg_reload_conf()); once lost, the mirror needs "
        "`pg2iceberg-dagster repair`"
    )


def _check_server(conn: psycopg.Connection) -> None:
    if conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:  # type: ignore[index]
        raise StartupCheckError(
            f"the source server {conn.info.host}:{conn.info.port} is a standby (in recovery, a read replica): "
            "the snapshot a replication slot exports cannot be taken during recovery; point source at the primary"
        )
    wal_level = conn.execute("SHOW wal_level").fetchone()[0]  # type: ignore[index]
    if wal_level != "logical":
        raise StartupCheckError(
            f"wal_level is {wal_level!r} on the source; set wal_level = logical in postgresql.conf and restart"
        )
    privileged = conn.execute("SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    if not privileged or not privileged[0]:
        user = conn.execute("SELECT current_user").fetchone()[0]  # type: ignore[index]
        raise StartupCheckError(f"role {user} lacks the REPLICATION privilege; run ALTER ROLE {user} REPLICATION")
    encoding = conn.execute("SHOW server_encoding").fetchone()[0]  # type: ignore[index]
    if encoding == "SQL_ASCII":
        # PostgreSQL converts any other encoding to UTF-8 for us; SQL_ASCII text is bytes of no known
        # encoding, so a value that is not UTF-8 could only be mangled, or stop the flusher.
        raise StartupCheckError(
            "the source database's encoding is SQL_ASCII: its text has no declared encoding, so it cannot be "
            "converted to the UTF-8 Iceberg strings hold; move the data to a UTF8 database (pg_dump, then "
            "restore into one created WITH ENCODING 'UTF8') and mirror that"
        )


def _cleanup_tables(keys: list[str]) -> str:
    """The cleanup command that resets ``keys`` so they are snapshotted again."""
    return "`pg2iceberg-dagster cleanup " + " ".join(f"--table {shlex.quote(key)}" for key in keys) + "`"


def ensure_publication(
    conn: psycopg.Connection, config: PipelineConfig, tables: list[SourceTable], mirrored: frozenset[str] = frozenset()
) -> None:
    """The publication must exist (created when allowed), publish all operations and cover every table.

    ``mirrored`` names the tables that already have pipeline state: one of them missing from the
    publication has lost changes, so re-adding it is not enough.
    """
    name = config.replication.publication
    refuse_unfilterable(tables, conn.info.server_version)
    wanted = try_entries(conn, tables)  # refuses, with the server's reason, a filter it would not take
    row = conn.execute(
        "SELECT pubviaroot, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication "
        "WHERE pubname = %s",
        (name,),
    ).fetchone()
    if row is None:
        if mirrored:
            # Recreating it would hide the gap: changes made while it did not exist were never streamed.
            raise StartupCheckError(
                f"publication {name} is gone but the pipeline already mirrors {', '.join(sorted(mirrored))}; "
                "changes made without it never reach the mirror. Run `pg2iceberg-dagster cleanup --all --yes` "
                "and snapshot again"
            )
        if not config.replication.create_publication:
            raise StartupCheckError(
                f"publication {name} does not exist; create it FOR TABLE the configured tables, "
                "or set replication.create_publication: true"
            )
        try:
            # A partitioned parent's changes are sent as its own (not its leaves'): one Iceberg table.
            conn.execute(
                sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish_via_partition_root = true)").format(
                    sql.Identifier(name), table_entries(tables, conn.info.server_version)
                )
            )
            return
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
            # Another process of this pipeline (a snapshot holder, a chunk run) created it just now:
            # DuplicateObject once its CREATE committed, UniqueViolation while it was still in flight.
            return ensure_publication(conn, config, tables, mirrored)
    partitioned = [t.key for t in tables if t.partitioned]
    if partitioned and not row[0]:
        raise StartupCheckError(
            f"publication {name} sends the changes of {', '.join(partitioned)} as their partitions' (one table "
            f"each), not as the partitioned table's; run ALTER PUBLICATION {name} SET (publish_via_partition_root "
            "= true)"
        )
    if not all(row[2:]):
        raise StartupCheckError(
            f"publication {name} does not publish insert, update, delete and truncate; "
            f"run ALTER PUBLICATION {name} SET (publish = 'insert, update, delete, truncate')"
        )
    reconcile(conn, name, tables, wanted, mirrored, config.replication.create_publication)
    covered = publication_tables(conn, name)
    missing = [t.key for t in tables if t.key not in covered]
    dropped = [key for key in missing if key in mirrored]
    if dropped:
        # pgoutput decides membership as of each change: what was written while the table was out of
        # the publication is never streamed, even after it is added back.
        names = ", ".join(dropped)
        raise StartupCheckError(
            f"publication {name} no longer covers {names}, which the pipeline already mirrors; changes made "
            f"while it was out of the publication never reach the mirror. Run ALTER PUBLICATION {name} ADD "
            f"TABLE {names}, then {_cleanup_tables(dropped)} and `snapshot` again"
        )
    if missing and config.replication.create_publication:
        # A table added to the config: the pipeline owns the publication, so it adds the table. Its
        # changes stream from here on, and its snapshot (taken after this) covers everything before.
        conn.execute(
            sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                sql.Identifier(name), table_entries((t for t in tables if t.key in missing), conn.info.server_version)
            )
        )
    elif missing:
        raise StartupCheckError(
            f"publication {name} does not cover {', '.join(missing)}; "
            f"run ALTER PUBLICATION {name} ADD TABLE {', '.join(missing)}"
        )


def check_startup(config: PipelineConfig, store: CoordinationStore, slot_lost_ok: bool = False) -> StartupReport:
    """Run every startup check; raise StartupCheckError on the first breach (naming every refused table).

    A slot the pipeline created that is gone or lost WAL raises :class:`SlotLostError`, unless
    ``slot_lost_ok`` (a repair is about to replace it): then the report says why in ``slot_lost``.
    """
    check_delete_formats(config)
    with connect(config.source) as conn:
        version = server_version(conn)
        # Before the replication connection: a role without REPLICATION gets the check's advice, not
        # the walsender's refusal to connect; and before the coordination schema is written (a standby
        # would refuse that as a read-only transaction).
        _check_server(conn)
        failover_wanted(config.replication.failover_slot, version)  # refuses failover_slot: true below 17
        store.migrate()
        meta = store.pipeline_meta()
        system_identifier = identify_system(config)
        _check_same_cluster(meta, system_identifier)
        states = store.table_states()
        tables = _describe_tables(conn, config, states)
        _check_not_recreated(states, tables)
        ensure_publication(conn, config, list(tables.values()), frozenset(states.keys() & tables.keys()))
        slot = slot_info(conn, config.replication.slot)
        database = conn.info.dbname
        warnings = tuple(failover_warnings(conn, config, slot.failover if slot else None))

    _check_slot_name(meta, config)
    slot_recorded = _wait_for_slot_record(config, store, meta, slot)
    lost = _slot_lost(slot, slot_recorded) or _slot_half_replaced(store, states, slot) or _slot_ahead(store, slot)
    if lost and not slot_lost_ok:
        raise SlotLostError(slot_lost_advice(config, lost))
    if not slot_recorded:
        _check_no_chunks_without_slot(store, states)
    if slot is not None and not lost:
        _check_slot(config, slot, slot_recorded, database)
    store.stamp_pipeline(system_identifier, config.replication.slot, config.replication.publication)
    for warning in warnings:
        log.warning("%s", warning)
    return StartupReport(
        server_version=version,
        system_identifier=system_identifier,
        tables=tables,
        slot=slot,
        slot_lost=lost,
        warnings=warnings,
    )


def check_delete_formats(config: PipelineConfig) -> None:
    """Refuse, before anything is written, a table whose delete format one of its declared readers
    cannot read, a format this project cannot write, or ``write.*.mode`` table properties that
    contradict a declared format (docs/readers.md)."""
    problems: list[str] = []
    if config.iceberg.table_properties.get(FORMAT_VERSION, "2") not in ("1", "2"):
        problems.append(
            f"iceberg.table_properties.{FORMAT_VERSION}: {config.iceberg.table_properties[FORMAT_VERSION]} is "
            f"refused: {WHY_NOT_WRITABLE['deletion-vectors']}; remove it (the tables are format-version 2)"
        )
    for index, table in enumerate(config.tables):
        problems.extend(_delete_format_problems(config, index, table))
    if problems:
        raise StartupCheckError("delete formats:\n  " + "\n  ".join(problems))


def _delete_format_problems(config: PipelineConfig, index: int, table: TableConfig) -> list[str]:
    """What is wrong with ``table``'s declared delete format (``tables.<index>`` in the config)."""
    delete_format = config.delete_format_of(table)
    if delete_format is None:
        return []
    readers = config.readers_of(table)
    # What to set instead: the format chosen for its readers, which every one of them reads.
    fix = f"set tables.{index}.delete_format: {chosen_format(readers)}"
    if delete_format not in WRITABLE:
        return [f"table {table.key}: {WHY_NOT_WRITABLE[delete_format]}; {fix} (or iceberg.delete_format)"]
    problems = [
        f"table {table.key}: {reader} cannot read {DESCRIBED[delete_format]} (docs/readers.md); "
        f"{fix}, or take {reader} out of its readers"
        for reader in unable_to_read(delete_format, readers)
    ]
    conflicts = conflicting_modes(config.iceberg.table_properties, delete_format)
    if conflicts:
        listed = ", ".join(f"{key}: {value}" for key, value in conflicts.items())
        problems.append(
            f"table {table.key}: iceberg.table_properties sets {listed}, against its delete format "
            f"{delete_format}; remove the write.*.mode entries from iceberg.table_properties"
        )
    return problems


def _slot_lost(slot: SlotInfo | None, slot_recorded: bool) -> str | None:
    """Why the slot the pipeline created cannot be resumed: gone, or its WAL removed; else None."""
    if slot is None and slot_recorded:
        return "is gone but the pipeline created it"
    if slot is not None and slot_recorded:
        return slot.lost
    return None


def _slot_half_replaced(store: CoordinationStore, states: dict[str, TableState], slot: SlotInfo | None) -> str | None:
    """A repair of a lost slot died between creating the new slot and recording it: the slot exists,
    ahead of the recorded ``flushed_lsn``, while tables wait for that repair. It is replaced again."""
    if slot is None or slot.confirmed_flush_lsn is None or slot.active_pid is not None:
        return None
    if not any(state.resync_reason == SLOT_LOST_REASON for state in states.values()):
        return None
    flushed = store.flushed_lsn()
    if flushed is not None and slot.confirmed_flush_lsn > flushed:
        return "was being replaced by a repair that stopped before recording it"
    return None


def _slot_ahead(store: CoordinationStore, slot: SlotInfo | None) -> str | None:
    """The slot confirms more than the pipeline recorded staging: the changes in between will never be
    streamed again. The flusher records before it acknowledges, so this is not its doing: a promoted
    standby whose synced slot came from the old primary while the pipeline's last coordination
    commits (kept in the source database) had not reached it, or someone advanced the slot. Read
    after the slot, so a flusher streaming meanwhile cannot make it look ahead."""
    flushed = store.flushed_lsn()
    if slot is None or slot.confirmed_flush_lsn is None or flushed is None or slot.confirmed_flush_lsn <= flushed:
        return None
    return (
        f"is ahead of what the pipeline staged (confirmed_flush_lsn {format_lsn(slot.confirmed_flush_lsn)}, recorded "
        f"flushed_lsn {format_lsn(flushed)}): after a failover, the promoted standby had the old primary's slot "
        "position but not the pipeline's last coordination commits; otherwise it was advanced outside pg2iceberg"
    )


def slot_lost_advice(config: PipelineConfig, lost: str) -> str:
    """The refusal for a lost slot: what happened and the command that repairs it."""
    if config.replication.on_slot_lost == "repair":
        how = "`run` and `stream` repair it on their own (replication.on_slot_lost: repair), or run it now"
    else:
        how = "replication.on_slot_lost is refuse, so `run` and `stream` do not do it on their own"
    return (
        f"replication slot {config.replication.slot} {lost}: changes made since the pipeline last read it are lost to "
        f"the mirror. Run `pg2iceberg-dagster repair`: it creates a new slot and writes into each Iceberg table only "
        f"its differences from the source ({how}); or `pg2iceberg-dagster cleanup --all --yes` and snapshot again"
    )


def _check_same_cluster(meta: PipelineMeta | None, system_identifier: str) -> None:
    """The coordination state, if any, belongs to the cluster the config points at."""
    if meta is not None and meta.system_identifier != system_identifier:
        raise StartupCheckError(
            f"the source cluster changed: coordination state belongs to system_identifier "
            f"{meta.system_identifier}, the server is {system_identifier}; point the config at the original "
            "cluster, or run `pg2iceberg-dagster cleanup --all` to start over"
        )


def _describe_tables(
    conn: psycopg.Connection, config: PipelineConfig, states: dict[str, TableState]
) -> dict[str, SourceTable]:
    """Each configured table's columns and key, by key; refuses a table with a type Iceberg cannot hold,
    or a ``partition_by``/``sort_by`` its columns cannot take, or a mirrored one renamed at the source."""
    resolver = TypeResolver(conn)
    tables: dict[str, SourceTable] = {}
    refusals: list[StartupCheckError | UnsupportedTypeError] = []  # every table's, so that one run names them all
    names = _names_now(conn, [state.pg_oid for state in states.values()])
    for configured in config.tables:
        try:
            state = states.get(configured.key)
            if state is not None:
                _refuse_renamed(configured, state.pg_oid, names.get(state.pg_oid))
            table = describe_table(conn, configured, resolver, config.replication.publication)
            try:
                iceberg_schema(table.columns, table.primary_key)  # refuses unrepresentable types now
            except UnsupportedTypeError as exc:
                raise UnsupportedTypeError(f"{table.key}: {exc}") from None  # which table, among many
            refuse_metadata_name_clash(table.key, table.columns, config.added_column_names(configured))
            problems = layout_problems(configured, table.columns)
            if problems:
                raise StartupCheckError(f"{table.key}: " + "; ".join(problems))
        except (StartupCheckError, UnsupportedTypeError) as exc:
            refusals.append(exc)
            continue
        tables[table.key] = table
    if len(refusals) == 1:
        raise refusals[0]
    if refusals:
        raise StartupCheckError(f"{len(refusals)} tables refused:\n" + "\n".join(f"  - {exc}" for exc in refusals))
    return tables


def _names_now(conn: psycopg.Connection, oids: list[int]) -> dict[int, tuple[str, str, str]]:
    """Schema, name and quoted ``schema.name`` of the relations with these oids now (one query)."""
    rows = conn.execute(
        "SELECT c.oid, n.nspname, c.relname, format('%%I.%%I', n.nspname, c.relname) FROM pg_catalog.pg_class c "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = ANY(%s::oid[])",
        (oids,),
    ).fetchall()
    return {int(oid): (schema_name, name, quoted) for oid, schema_name, name, quoted in rows}


def _refuse_renamed(configured: TableConfig, oid: int, now: tuple[str, str, str] | None) -> None:
    """The table mirrored under this name now has another (ALTER TABLE ... RENAME TO, or SET SCHEMA);
    ``now`` is what :func:`_names_now` found for its oid (None: gone, which _check_not_recreated tells)."""
    if now is None or now[:2] == (configured.schema_name, configured.table_name):
        return
    raise StartupCheckError(
        f"{configured.key} was renamed to {now[2]} at the source (the same table, oid {oid}; changes made since "
        f"were staged as {configured.key}'s). Rename it back (ALTER TABLE {now[2]} RENAME TO ...), or mirror it "
        f"under its new name: name it so in the config, then run {_cleanup_tables([configured.key])} and snapshot"
    )


def _check_not_recreated(states: dict[str, TableState], tables: dict[str, SourceTable]) -> None:
    """No mirrored table was dropped and created again since its snapshot (its ``pg_class.oid`` moved)."""
    for key, state in states.items():
        if key in tables and state.pg_oid != tables[key].oid:
            raise StartupCheckError(
                f"{key} was dropped and recreated (pg_class.oid {state.pg_oid} -> {tables[key].oid}); "
                f"its mirror is stale: run `pg2iceberg-dagster cleanup --table {key}` to snapshot it again"
            )


def _check_slot_name(meta: PipelineMeta | None, config: PipelineConfig) -> None:
    """The config names the slot the coordination state was created with."""
    if meta is not None and meta.slot_name != config.replication.slot:
        raise StartupCheckError(
            f"coordination state was created with slot {meta.slot_name}, the config names "
            f"{config.replication.slot}; restore the slot name, or, for another pipeline on the same source, keep "
            "its coordination state apart (the config's `state:` section, another database); `cleanup --all` "
            f"would drop the pipeline of slot {meta.slot_name}: its slot, state and Iceberg tables"
        )


def _wait_for_slot_record(
    config: PipelineConfig, store: CoordinationStore, meta: PipelineMeta | None, slot: SlotInfo | None
) -> bool:
    """Whether the pipeline recorded creating its slot. While a live snapshot holder is between creating
    the slot and recording it, waits for the record (up to ``SLOT_RECORD_WAIT_SECONDS``)."""
    slot_recorded = meta is not None and meta.consistent_point is not None
    deadline = time.monotonic() + SLOT_RECORD_WAIT_SECONDS
    while slot is not None and not slot_recorded and store.holder_alive(config.replication.slot):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
        meta = store.pipeline_meta()
        slot_recorded = meta is not None and meta.consistent_point is not None
    return slot_recorded


def _check_no_chunks_without_slot(store: CoordinationStore, states: dict[str, TableState]) -> None:
    """With no recorded slot, no snapshot chunk may have been read: nothing replays the changes made
    after its read."""
    read = [key for key in states if any(chunk.done for chunk in store.chunks(key))]
    if read:
        raise StartupCheckError(
            f"snapshot chunks of {', '.join(read)} were read without a replication slot, so changes made since "
            f"are lost to the mirror; run {_cleanup_tables(read)} (or `cleanup --all --yes`) and snapshot again"
        )


def _check_slot(config: PipelineConfig, slot: SlotInfo, slot_recorded: bool, database: str) -> None:
    """The existing slot is the pipeline's own and decodes pgoutput on the source database."""
    if not slot_recorded:
        raise StartupCheckError(
            f"replication slot {config.replication.slot} exists but was not created by this pipeline; "
            "drop it (SELECT pg_drop_replication_slot(...)) or configure another slot name"
        )
    if slot.plugin != "pgoutput" or slot.database != database:
        raise StartupCheckError(
            f"replication slot {config.replication.slot} uses plugin {slot.plugin} on database {slot.database}; "
            f"expected pgoutput on {database}"
        )
