"""Whether the source can fail over without losing the slot (PostgreSQL 17+ failover slots).

A promoted standby continues the pipeline's slot only if the slot is a failover slot, a standby syncs
it (``sync_replication_slots = on``, which connects to the primary as the slot sync worker), and the
primary holds logical changes back until that standby has the WAL (``synchronized_standby_slots``
names its physical slot): without the last, the mirror can stage changes the promoted standby never
received. docs/operations.md lists the settings. These are warnings: a source without standbys is a
normal source.
"""

from __future__ import annotations

import psycopg

from .config import PipelineConfig
from .source.replication import MIN_FAILOVER_VERSION

_SETTINGS_HINT = "see docs/operations.md, 'Failover of the source'"


def failover_warnings(conn: psycopg.Connection, config: PipelineConfig, slot_failover: bool | None) -> list[str]:
    """What stands between the source's primary (``conn``) and a failover that loses nothing;
    ``slot_failover`` is the slot's ``failover`` flag (None: no slot yet). Empty below PostgreSQL 17
    and when ``replication.failover_slot`` is false."""
    if conn.info.server_version < MIN_FAILOVER_VERSION or config.replication.failover_slot is False:
        return []
    name = config.replication.slot
    warnings = []
    if slot_failover is False:
        warnings.append(
            f"replication slot {name} is not a failover slot: a promoted standby will not have it, and the "
            f'mirror then needs `pg2iceberg-dagster repair`. Make it one: psql "dbname={conn.info.dbname} '
            f'replication=database" -c "ALTER_REPLICATION_SLOT {name} (FAILOVER true)" while nothing streams from it'
        )
    row = conn.execute(
        "SELECT current_setting('synchronized_standby_slots'), "
        "EXISTS (SELECT FROM pg_stat_activity WHERE application_name LIKE '%%slotsync%%')"
    ).fetchone()
    assert row is not None
    standby_slots = [slot.strip().strip('"') for slot in row[0].split(",") if slot.strip()]
    if not row[1]:
        warnings.append(
            f"no standby syncs replication slots from this primary (no slot sync worker is connected): after a "
            f"failover the promoted standby will not have slot {name}; on the standby set "
            f"sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name, and a dbname in "
            f"primary_conninfo ({_SETTINGS_HINT})"
        )
    if not standby_slots:
        warnings.append(
            "synchronized_standby_slots is empty on the primary: the mirror may receive changes a standby has not, "
            "and after that standby's promotion hold rows the new primary never had (verify finds them, repair "
            f"mends them); set it to the standbys' physical slots ({_SETTINGS_HINT})"
        )
    else:
        active = {
            slot_name
            for (slot_name,) in conn.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' AND active "
                "AND slot_name = ANY(%s)",
                (standby_slots,),
            )
        }
        idle = [slot for slot in standby_slots if slot not in active]
        if idle:
            warnings.append(
                f"synchronized_standby_slots names {', '.join(idle)}, which no standby streams from now: the "
                f"primary holds logical changes back until they catch up, so the mirror waits ({_SETTINGS_HINT})"
            )
    return warnings
