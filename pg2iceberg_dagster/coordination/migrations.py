"""Versioned migrations of the ``_pg2iceberg`` coordination schema.

Each entry is applied once, in order, inside one transaction under an advisory lock, and recorded in
``_pg2iceberg.schema_migrations``. Never edit an applied migration: append a new one.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from ..errors import StartupCheckError

SCHEMA = "_pg2iceberg"

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE _pg2iceberg.pipeline_meta (
            id boolean PRIMARY KEY DEFAULT true CHECK (id),
            system_identifier text NOT NULL,
            slot_name text NOT NULL,
            publication text NOT NULL,
            consistent_point pg_lsn,
            slot_created_at timestamptz,
            created_at timestamptz NOT NULL DEFAULT now()
        );
        CREATE TABLE _pg2iceberg.flushed_lsn (
            id boolean PRIMARY KEY DEFAULT true CHECK (id),
            lsn pg_lsn NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT now()
        );
        CREATE TABLE _pg2iceberg.tables (
            table_name text PRIMARY KEY,
            pg_oid oid NOT NULL,
            iceberg_table text NOT NULL,
            snapshot_complete boolean NOT NULL DEFAULT false,
            snapshot_lsn pg_lsn,
            snapshot_started_at timestamptz NOT NULL DEFAULT now(),
            snapshot_completed_at timestamptz
        );
        CREATE TABLE _pg2iceberg.snapshot_progress (
            table_name text NOT NULL REFERENCES _pg2iceberg.tables ON DELETE CASCADE,
            chunk_index integer NOT NULL,
            start_page bigint NOT NULL,
            end_page bigint,
            status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done')),
            read_mode text CHECK (read_mode IN ('exported_snapshot', 'repeatable_read')),
            rows_written bigint,
            iceberg_snapshot_id bigint,
            completed_at timestamptz,
            PRIMARY KEY (table_name, chunk_index)
        );
        CREATE TABLE _pg2iceberg.log_seq (
            table_name text PRIMARY KEY,
            next_offset bigint NOT NULL DEFAULT 0
        );
        CREATE TABLE _pg2iceberg.log_index (
            table_name text NOT NULL,
            start_offset bigint NOT NULL,
            end_offset bigint NOT NULL,
            path text NOT NULL,
            first_lsn pg_lsn NOT NULL,
            flushable_lsn pg_lsn NOT NULL,
            row_count bigint NOT NULL,
            byte_size bigint NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (table_name, start_offset),
            CHECK (end_offset > start_offset)
        );
        CREATE TABLE _pg2iceberg.mat_cursor (
            group_name text NOT NULL,
            table_name text NOT NULL,
            next_offset bigint NOT NULL DEFAULT 0,
            last_lsn pg_lsn,
            iceberg_snapshot_id bigint,
            updated_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (group_name, table_name)
        );
        CREATE TABLE _pg2iceberg.consumer (
            group_name text NOT NULL,
            table_name text NOT NULL,
            worker_id text NOT NULL,
            acquired_at timestamptz NOT NULL DEFAULT now(),
            heartbeat_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (group_name, table_name)
        );
        """,
    ),
    (
        2,
        """
        -- The name of the slot's exported snapshot while a holder process keeps it importable
        -- (chunk runs in other processes read under it). Not a credential.
        ALTER TABLE _pg2iceberg.pipeline_meta ADD COLUMN exported_snapshot text;
        """,
    ),
    (
        3,
        """
        -- Set when some chunk was read without the exported snapshot: WAL changes before this LSN may
        -- find their row missing from Iceberg, so the materializer takes their unchanged (TOAST)
        -- columns from the source instead of the target row.
        ALTER TABLE _pg2iceberg.tables ADD COLUMN source_fill_until_lsn pg_lsn;
        """,
    ),
    (
        4,
        """
        -- Snapshot epochs: every exported snapshot chunks were read under. Epoch 0 is the slot's own
        -- (at its consistent point); a later one is taken when that export was lost. ``snapshot`` is
        -- the pg_snapshot text (xmin:xmax:xip), so the materializer can skip the transactions a table
        -- read in that epoch already holds; none of them has a change at or after ``lsn_bound``.
        CREATE TABLE _pg2iceberg.snapshot_epochs (
            epoch integer PRIMARY KEY CHECK (epoch >= 0),
            snapshot text NOT NULL,
            lsn_bound pg_lsn NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now()
        );
        ALTER TABLE _pg2iceberg.pipeline_meta ADD COLUMN exported_epoch integer;
        -- The epoch a table's Iceberg rows were read in: every chunk of a table is read in one epoch,
        -- so the table is one consistent read (a chunk from another epoch restarts the table).
        ALTER TABLE _pg2iceberg.tables ADD COLUMN snapshot_epoch integer
            REFERENCES _pg2iceberg.snapshot_epochs (epoch);
        ALTER TABLE _pg2iceberg.tables DROP COLUMN source_fill_until_lsn;
        ALTER TABLE _pg2iceberg.snapshot_progress DROP COLUMN read_mode;
        -- A table mid-snapshot from before epochs has none: nothing proves its chunks were read at
        -- one moment, so its snapshot starts again.
        ALTER TABLE _pg2iceberg.snapshot_progress ADD COLUMN epoch integer;
        """,
    ),
    (
        5,
        """
        -- An online resync of one table: requested (why, in ``resync_reason``; merges of the table wait
        -- meanwhile), then copied in ``resync_epoch`` and switched in one Iceberg commit.
        ALTER TABLE _pg2iceberg.tables ADD COLUMN resync_reason text;
        ALTER TABLE _pg2iceberg.tables ADD COLUMN resync_epoch integer
            REFERENCES _pg2iceberg.snapshot_epochs (epoch);
        """,
    ),
    (
        6,
        """
        -- A partitioned table's chunks are page ranges of one leaf partition each.
        ALTER TABLE _pg2iceberg.snapshot_progress ADD COLUMN leaf_schema text;
        ALTER TABLE _pg2iceberg.snapshot_progress ADD COLUMN leaf_name text;
        """,
    ),
    (
        7,
        """
        -- When maintenance last finished a pass over the table's Iceberg files (maintenance/).
        ALTER TABLE _pg2iceberg.tables ADD COLUMN maintained_at timestamptz;
        """,
    ),
    (
        8,
        """
        -- Staging layout 2 gives each table a folder of its own (staging/store.py table_location); a
        -- table registered under layout 1 may have files left in its old folder, which cleanup sweeps
        -- once, then moves it to 2. Tables registered from now on start at 2.
        ALTER TABLE _pg2iceberg.tables ADD COLUMN staging_layout smallint NOT NULL DEFAULT 1;
        ALTER TABLE _pg2iceberg.tables ALTER COLUMN staging_layout SET DEFAULT 2;
        """,
    ),
    (
        9,
        """
        -- The earliest source commit time of a staged file's changes: lag in seconds counts from it
        -- (CoordinationStore.lags); NULL for files staged before, which count from created_at.
        ALTER TABLE _pg2iceberg.log_index ADD COLUMN first_commit_at timestamptz;
        """,
    ),
    (
        10,
        """
        -- The last reading of the replication slot and the WAL rates smoothed up to it (wal_budget.py):
        -- every process that looks at the slot (flusher ticks, the slot check, status, metrics scrapes)
        -- measures the rates from the previous one, whoever took it. read_at is the source's clock.
        CREATE TABLE _pg2iceberg.slot_readings (
            slot_name text PRIMARY KEY,
            read_at timestamptz NOT NULL,
            wal_lsn pg_lsn NOT NULL,
            safe_wal_size bigint,
            wal_write_rate float8,
            safe_wal_shrink_rate float8
        );
        """,
    ),
]


def migrate(conn: psycopg.Connection) -> list[int]:
    """Apply pending migrations; returns the versions applied now. A role that may not create or change
    the coordination schema is refused with the grant it needs."""
    try:
        return _migrate(conn)
    except psycopg.errors.ReadOnlySqlTransaction:
        raise StartupCheckError(
            f"database {conn.info.dbname} on {conn.info.host}:{conn.info.port} is read-only (a standby?): the "
            f"coordination tables (schema {SCHEMA}) need a writable database; point state: at one"
        ) from None
    except psycopg.errors.InsufficientPrivilege as exc:
        user, dbname = (sql.Identifier(name).as_string(conn) for name in (conn.info.user, conn.info.dbname))
        raise StartupCheckError(
            f"role {user} may not create or change the coordination tables (schema {SCHEMA}) in database "
            f"{dbname}: {exc.diag.message_primary}. Run GRANT CREATE ON DATABASE {dbname} TO {user} (or, if "
            f"{SCHEMA} exists, make {user} its owner), or keep them in another database with the config's `state:` "
            "section"
        ) from None


def _migrate(conn: psycopg.Connection) -> list[int]:
    applied_now: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('_pg2iceberg.migrations'))")
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {SCHEMA}.schema_migrations "
            "(version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {version for (version,) in conn.execute(f"SELECT version FROM {SCHEMA}.schema_migrations")}
        for version, statements in MIGRATIONS:
            if version in done:
                continue
            conn.execute(statements)
            conn.execute(f"INSERT INTO {SCHEMA}.schema_migrations (version) VALUES (%s)", (version,))
            applied_now.append(version)
    return applied_now
