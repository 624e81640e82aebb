"""The mirror's replication slot in Dagster: an observable asset ``[<mirror>, "replication_slot"]``
whose observations (one per flusher tick) carry what ``pg_replication_slots`` shows, and its check
``slot_safe``, which warns before the slot can lose WAL and errors once it has. Both read the engine's
one implementation (``Pipeline.slot``: ``validation.slot_info`` with ``wal_budget.estimate_wal_budget``,
and ``validation.slot_safety``, as the CLI ``status``)."""

from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetKey,
    AssetObservation,
    AssetSpec,
    asset_check,
)

from pg2iceberg_dagster.config import ReplicationConfig
from pg2iceberg_dagster.pipeline import SlotInfo, SlotSafety, format_lsn, slot_safety

from .mirror import MIRROR_TAG, Mirror

SLOT_SAFE = "slot_safe"
_SEVERITY = {"warn": AssetCheckSeverity.WARN, "error": AssetCheckSeverity.ERROR, "ok": AssetCheckSeverity.WARN}


def slot_key(mirror: Mirror) -> AssetKey:
    """The key of the mirror's replication slot asset."""
    return AssetKey([mirror.name, "replication_slot"])


def slot_spec(mirror: Mirror) -> AssetSpec:
    """The slot as an external asset, in the group of the mirror's source tables when they share one."""
    groups = {mirror.spec(table, "source").group_name for table in mirror.tables}
    config = mirror.config
    return AssetSpec(
        key=slot_key(mirror),
        group_name=groups.pop() if len(groups) == 1 else None,
        kinds={"postgres"},
        tags={MIRROR_TAG: ""},
        description=(
            f"Replication slot {config.replication.slot} on {config.source.dbname}: the WAL the mirror has not "
            "staged yet is retained for it. Observed at every flusher tick (wal_status, active, retained WAL, "
            f"safe_wal_size, LSNs, WAL write rate and minutes until it loses WAL at that rate); the {SLOT_SAFE} "
            "check warns before it can lose WAL."
        ),
    )


def slot_metadata(slot: SlotInfo) -> dict[str, Any]:
    """What an observation of the slot carries: numbers where numeric (the UI plots them), LSNs also as
    text, and its WAL budget (wal_budget.py: the WAL write rate, how fast safe_wal_size shrinks, and
    the minutes until the slot loses WAL at that rate). A value that is not known is left out
    (safe_wal_size and minutes_until_lost without max_slot_wal_keep_size, retained WAL once lost, the
    rates before a second reading, minutes_until_lost while safe_wal_size does not shrink)."""
    values: dict[str, Any] = {
        "wal_status": slot.wal_status or "",
        "active": int(slot.active),
        "retained_wal_bytes": slot.retained_wal_bytes,
        "safe_wal_size_bytes": slot.safe_wal_size_bytes,
        "max_slot_wal_keep_size_bytes": slot.max_slot_wal_keep_size_bytes,
        "inactive_seconds": slot.inactive_seconds,
        **slot.wal_budget(),
        "confirmed_flush_lsn": format_lsn(slot.confirmed_flush_lsn) if slot.confirmed_flush_lsn is not None else None,
        "confirmed_flush_lsn_bytes": slot.confirmed_flush_lsn,
        "restart_lsn": format_lsn(slot.restart_lsn) if slot.restart_lsn is not None else None,
        "restart_lsn_bytes": slot.restart_lsn,
    }
    return {name: value for name, value in values.items() if value is not None}


def slot_observation(mirror: Mirror, slot: SlotInfo) -> AssetObservation:
    """One observation of the mirror's slot."""
    return AssetObservation(asset_key=slot_key(mirror), metadata=slot_metadata(slot))


def _check_metadata(slot: SlotInfo | None, settings: ReplicationConfig) -> dict[str, Any]:
    return {
        **(slot_metadata(slot) if slot else {}),
        "slot_warn_safe_wal_fraction": settings.slot_warn_safe_wal_fraction,
        "slot_inactive_warn_seconds": settings.slot_inactive_warn_seconds,
        "slot_warn_minutes_until_lost": settings.slot_warn_minutes_until_lost,
    }


def slot_check_evaluation(mirror: Mirror, slot: SlotInfo | None) -> AssetCheckEvaluation:
    """The ``slot_safe`` check as a flusher tick reports it."""
    settings = mirror.config.replication
    safety = slot_safety(slot, settings)
    return AssetCheckEvaluation(
        asset_key=slot_key(mirror),
        check_name=SLOT_SAFE,
        passed=safety.level == "ok",
        severity=_SEVERITY[safety.level],
        description=safety.reason,
        metadata=_check_metadata(slot, settings),
    )


def slot_check(mirror: Mirror) -> AssetChecksDefinition:
    """``slot_safe``, also executable on demand (it reads the slot now); the flusher reports it every tick."""

    @asset_check(
        asset=slot_key(mirror),
        name=SLOT_SAFE,
        description="The replication slot keeps the WAL the mirror needs: WARN when it is close to losing "
        "some (wal_status unreserved, losing WAL within slot_warn_minutes_until_lost at the current rate, "
        "safe_wal_size low, not streamed from for long), ERROR once lost.",
        required_resource_keys={mirror.resource_key},
    )
    def _slot_safe(context: AssetCheckExecutionContext) -> AssetCheckResult:
        with mirror.pipeline_resource(context).pipeline() as pipeline:
            slot = pipeline.slot()
        safety: SlotSafety = slot_safety(slot, mirror.config.replication)
        return AssetCheckResult(
            passed=safety.level == "ok",
            severity=_SEVERITY[safety.level],
            description=safety.reason,
            metadata=_check_metadata(slot, mirror.config.replication),
        )

    return _slot_safe
