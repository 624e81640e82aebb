"""A random, seed-reproducible write workload against a source database.

The generator keeps a model of each table (its columns and the keys that exist) so every statement
is chosen from the seed alone: the same seed issues the same transactions in the same order. It
covers composite keys, TOAST-sized values (left unchanged by later updates), NULL-heavy columns,
every mapped type family, inserts, updates, key changes, deletes, multi-statement and very large
transactions, TRUNCATE, and schema changes (add, widen, drop) at random points. One table has every
feature of docs/columns.md, docs/change_metadata.md and docs/history.md on: excluded columns (one
TOASTed), a hashed column, a row filter that key changes move rows into and out of, soft deletes, change
metadata and a history table; its only schema change is an added column, which its publication's column
list never sends.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from .policy_check import Policy

Generator = Callable[[random.Random], str]
# The environment variable holding the hash key of the feature table's masked column.
MASK_KEY_ENV = "PG2ICEBERG_SOAK_MASK_KEY"


def _text(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + " ,;\"'\\\n\té€😀"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))


def _toast(rng: random.Random) -> str:
    """Random letters, large enough to be stored out of line even after compression."""
    return "".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(3000, 9000)))


def _array(rng: random.Random, element: Generator) -> str:
    items = []
    for _ in range(rng.randint(0, 4)):
        if rng.random() < 0.15:
            items.append("NULL")
        else:
            value = element(rng).replace("\\", "\\\\").replace('"', '\\"')
            items.append(f'"{value}"')
    return "{" + ",".join(items) + "}"


def _timestamp(rng: random.Random) -> dt.datetime:
    return dt.datetime(1990, 1, 1) + dt.timedelta(
        seconds=rng.randint(0, 40 * 365 * 86400), microseconds=rng.randint(0, 999999)
    )


# Values are sent in PostgreSQL's text form and cast by the server, so one path serves every type.
GENERATORS: dict[str, Generator] = {
    "smallint": lambda r: str(r.randint(-32768, 32767)),
    "integer": lambda r: str(r.randint(-(2**31), 2**31 - 1)),
    "bigint": lambda r: str(r.randint(-(2**63), 2**63 - 1)),
    "real": lambda r: repr(round(r.uniform(-1e6, 1e6), 3)),
    "double precision": lambda r: repr(r.uniform(-1e12, 1e12)),
    "numeric(12,2)": lambda r: f"{r.randint(-(10**9), 10**9)}.{r.randint(0, 99):02d}",
    "numeric(20,5)": lambda r: f"{r.randint(-(10**14), 10**14)}.{r.randint(0, 99999):05d}",
    "numeric": lambda r: f"{r.randint(-(10**30), 10**30)}.{r.randint(0, 10**12)}",
    "boolean": lambda r: r.choice(["t", "f"]),
    "text": _text,
    "varchar(40)": lambda r: _text(r)[:40],
    "char(8)": lambda r: _text(r)[:8],
    "bytea": lambda r: "\\x" + r.randbytes(r.randint(0, 32)).hex(),
    "date": lambda r: _timestamp(r).date().isoformat(),
    "timestamp": lambda r: _timestamp(r).isoformat(),
    "timestamptz": lambda r: _timestamp(r).isoformat() + r.choice(["+00", "+05:30", "-08"]),
    "uuid": lambda r: str(uuid.UUID(int=r.getrandbits(128))),
    "jsonb": lambda r: json.dumps({"k": r.randint(0, 9), "s": _text(r), "n": None, "l": [1, r.random()]}),
    "json": lambda r: json.dumps({"z": r.randint(0, 9), "a": _text(r)}),
    "integer[]": lambda r: _array(r, lambda q: str(q.randint(-1000, 1000))),
    "text[]": lambda r: _array(r, _text),
    "time": lambda r: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}.{r.randint(0, 999999)}",
    "interval": lambda r: f"{r.randint(0, 400)} days {r.randint(0, 23)}:{r.randint(0, 59)}:{r.randint(0, 59)}",
    "inet": lambda r: f"10.{r.randint(0, 255)}.{r.randint(0, 255)}.{r.randint(0, 255)}",
}
ADDABLE = list(GENERATORS)
WIDENINGS = {
    "integer": "bigint",
    "smallint": "integer",
    "real": "double precision",
    "numeric(12,2)": "numeric(16,2)",
    "varchar(40)": "text",
}
GENERATORS["numeric(16,2)"] = GENERATORS["numeric(12,2)"]
# Types a column may be changed from into text with a USING expression that changes every value (a
# rewrite no WAL change carries, and a type Iceberg cannot evolve into: an online resync).
RETYPABLE = {"integer", "bigint", "smallint", "numeric(12,2)", "numeric(16,2)", "boolean", "date", "uuid"}


@dataclass
class Column:
    name: str
    type: str
    null_rate: float = 0.1
    toast: bool = False
    # Read by a generated column: PostgreSQL refuses to retype or drop it (it can be renamed).
    pinned: bool = False

    def value(self, rng: random.Random) -> str | None:
        if rng.random() < self.null_rate:
            return None
        return _toast(rng) if self.toast and rng.random() < 0.5 else GENERATORS[self.type](rng)


@dataclass
class TableModel:
    """What the generator knows of one table: its columns and which keys exist."""

    schema: str
    name: str
    key: list[Column]
    columns: list[Column]
    keys: set[tuple[str, ...]] = field(default_factory=set)
    next_id: int = 1
    # GENERATED ALWAYS AS (...) STORED columns as (name, type, expression): never written to.
    generated: list[tuple[str, str, str]] = field(default_factory=list)
    # A table partitioned by LIST on its first key column: its list partitions (name -> value); rows
    # of other values land in its DEFAULT partition.
    partitions: dict[str, int] | None = None
    # The table's config entry beyond its name (columns, mask, where, deletes, change_metadata).
    options: dict[str, Any] = field(default_factory=dict)
    # Columns added since the table entered the publication with a column list: never sent, never written.
    added_since_entry: list[str] = field(default_factory=list)

    @property
    def entry(self) -> dict[str, Any]:
        """The table's entry in the pipeline's config."""
        return {"name": self.qualified, **self.options}

    def policy(self) -> Policy:
        """What the mirror must hold: all columns but the excluded ones and those added since entry."""
        left_out = {*self.options.get("columns", {}).get("exclude", []), *self.added_since_entry}
        mirrored = [c.name for c in self.key + self.columns if c.name not in left_out]
        return Policy(self.schema, self.name, [c.name for c in self.key], mirrored, left_out, self.options)

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def ident(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(self.schema), sql.Identifier(self.name))

    def new_key(self, rng: random.Random) -> tuple[str, ...]:
        self.next_id += rng.randint(1, 3)
        parts = [str(self.next_id)] if len(self.key) == 1 else [str(rng.randint(1, 5)), str(self.next_id)]
        return tuple(parts)


def initial_tables() -> list[TableModel]:
    """The workload's tables: a composite key with TOAST, a type zoo, a wide NULL-heavy table, a
    partitioned table, and a table with column selection, a mask, a row filter, soft deletes and history."""
    return [
        TableModel(
            "public",
            "accounts",
            [Column("region", "smallint", 0), Column("id", "bigint", 0)],
            [
                Column("name", "varchar(40)"),
                Column("balance", "numeric(12,2)", pinned=True),
                Column("active", "boolean"),
                Column("opened", "date"),
                Column("updated", "timestamptz"),
                Column("doc", "text", 0.2, toast=True),
            ],
            generated=[("balance_cents", "numeric(15,0)", "balance * 100")],
        ),
        TableModel(
            "app",
            "Events",
            [Column("id", "bigint", 0)],
            [
                Column("kind", "text", 0.0),
                Column("payload", "jsonb"),
                Column("raw", "bytea"),
                Column("uid", "uuid"),
                Column("tags", "text[]"),
                Column("scores", "integer[]"),
                Column("ratio", "double precision"),
                Column("score", "real"),
                Column("amount", "numeric(20,5)"),
                Column("exact", "numeric"),
                Column("at", "timestamp"),
                Column("clock", "time"),
                Column("span", "interval"),
                Column("addr", "inet"),
                Column("meta", "json"),
                Column("code", "char(8)"),
                Column("n", "integer", pinned=True),
            ],
            generated=[("n_twice", "bigint", "n::bigint * 2 + length(kind)")],
        ),
        TableModel(
            "public",
            "wide",
            [Column("id", "integer", 0)],
            [Column(f"c{i:02d}", ADDABLE[i % len(ADDABLE)], 0.7) for i in range(16)]
            + [Column("blob", "text", 0.5, toast=True, pinned=True)],
            # Reads a TOASTed column: an UPDATE leaving it unchanged makes the flusher read the row.
            generated=[("blob_digest", "text", "md5(coalesce(blob, '')) || ':' || id")],
        ),
        TableModel(
            "public",
            "parted",
            [Column("region", "smallint", 0), Column("id", "bigint", 0)],
            [Column("v", "text", 0.2, toast=True), Column("amount", "numeric(12,2)"), Column("at", "timestamptz")],
            partitions={"parted_r1": 1, "parted_r2": 2, "parted_r3": 3},
        ),
        TableModel(
            "public",
            "members",
            # The filter may use only replica identity columns: key changes move rows into and out of it.
            [Column("tenant", "smallint", 0), Column("id", "bigint", 0)],
            [
                Column("name", "text"),
                Column("email", "text", 0.2),
                Column("secret", "text", 0.3),
                Column("notes", "text", 0.3, toast=True),
                Column("doc", "text", 0.3, toast=True),
                Column("amount", "numeric(12,2)"),
            ],
            options={
                "columns": {"exclude": ["secret", "notes"]},
                "mask": {"email": "hash"},
                "mask_key_env": MASK_KEY_ENV,
                "where": "tenant <= 3",
                "deletes": "soft",
                "change_metadata": True,
                "history": True,
            },
        ),
    ]


class Workload:
    """Issues random transactions on one connection, reproducibly from ``seed``."""

    def __init__(self, conninfo: str, seed: int, initial_rows: int = 300, big_rows: int = 4000) -> None:
        self.rng = random.Random(seed)
        self.conninfo = conninfo
        self.initial_rows = initial_rows
        self.big_rows = big_rows
        self.tables = initial_tables()
        self.kinds: collections.Counter[str] = collections.Counter()
        self._conn: psycopg.Connection | None = None
        self._added = 0
        # Rewriting DDL is not MVCC-safe: a snapshot taken before it would see the table empty.
        self.allow_ddl = True

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None:
            self._conn = psycopg.connect(self.conninfo, autocommit=True)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def table_keys(self) -> list[str]:
        return [table.qualified for table in self.tables]

    def table_entries(self, leaving_out: str | None = None) -> list[dict[str, Any]]:
        """The config's entries of the tables (but ``leaving_out``)."""
        return [table.entry for table in self.tables if table.qualified != leaving_out]

    def table(self, key: str) -> TableModel:
        """The model of the table ``key``."""
        return next(table for table in self.tables if table.qualified == key)

    def setup(self) -> None:
        """Create the tables and fill them with ``initial_rows`` rows each."""
        with self.conn.transaction():
            self.conn.execute("CREATE SCHEMA IF NOT EXISTS app")
            for table in self.tables:
                columns = [
                    sql.SQL("{} {}").format(sql.Identifier(c.name), sql.SQL(c.type)) for c in table.key + table.columns
                ] + [
                    sql.SQL("{} {} GENERATED ALWAYS AS ({}) STORED").format(
                        sql.Identifier(name), sql.SQL(type_), sql.SQL(expression)
                    )
                    for name, type_, expression in table.generated
                ]
                key = sql.SQL(", ").join(sql.Identifier(c.name) for c in table.key)
                partitioning = sql.SQL("")
                if table.partitions is not None:
                    partitioning = sql.SQL(" PARTITION BY LIST ({})").format(sql.Identifier(table.key[0].name))
                self.conn.execute(
                    sql.SQL("CREATE TABLE {} ({}, PRIMARY KEY ({})){}").format(
                        table.ident, sql.SQL(", ").join(columns), key, partitioning
                    )
                )
                for name, value in (table.partitions or {}).items():
                    self._create_partition(table, name, value)
                if table.partitions is not None:
                    self.conn.execute(
                        sql.SQL("CREATE TABLE {} PARTITION OF {} DEFAULT").format(
                            sql.Identifier(table.schema, f"{table.name}_default"), table.ident
                        )
                    )
            for table in self.tables:
                self._insert(table, self.initial_rows)

    def step(self) -> str:
        """Run one random transaction and return its kind."""
        roll = self.rng.random()
        table = self.rng.choice(self.tables)
        if roll < 0.03 and self.allow_ddl:
            if table.partitions is not None and self.rng.random() < 0.5:
                kind = self._partition_change(table)
            else:
                kind = self._schema_change(table)
        elif 0.03 <= roll < 0.045:
            kind = "truncate"
            self.conn.execute(sql.SQL("TRUNCATE {}").format(table.ident))
            table.keys.clear()
        elif roll < 0.07:
            kind = "big_insert"
            with self.conn.transaction():
                self._insert(table, self.rng.randint(self.big_rows // 2, self.big_rows))
        elif roll < 0.35:
            kind = "multi_statement"
            with self.conn.transaction():
                for _ in range(self.rng.randint(2, 6)):
                    self._dml(self.rng.choice(self.tables))
        else:
            kind = self._dml(table)
        self.kinds[kind] += 1
        return kind

    def _dml(self, table: TableModel) -> str:
        roll = self.rng.random()
        if roll < 0.35 or len(table.keys) < 5:
            self._insert(table, self.rng.randint(1, 40))
            return "insert"
        if roll < 0.7:
            self._update(table, change_key=False)
            return "update"
        if roll < 0.8:
            self._update(table, change_key=True)
            return "key_change"
        if roll < 0.85:
            # Several versions of one row in one transaction, and an insert deleted before commit.
            self._update(table, change_key=False, count=1, repeat=3)
            key = self._insert(table, 1)[0]
            self._delete_keys(table, [key])
            return "churn"
        self._delete_keys(table, self._sample(table, self.rng.randint(1, 20)))
        return "delete"

    def _sample(self, table: TableModel, count: int) -> list[tuple[str, ...]]:
        return self.rng.sample(sorted(table.keys), min(count, len(table.keys)))

    def _where_key(self, table: TableModel, key: tuple[str, ...]) -> tuple[sql.Composable, list[str]]:
        condition = sql.SQL(" AND ").join(
            sql.SQL("{} = {}::{}").format(sql.Identifier(c.name), sql.Placeholder(), sql.SQL(c.type)) for c in table.key
        )
        return condition, list(key)

    def _insert(self, table: TableModel, count: int) -> list[tuple[str, ...]]:
        columns = table.key + table.columns
        keys = [table.new_key(self.rng) for _ in range(count)]
        rows = [list(key) + [c.value(self.rng) for c in table.columns] for key in keys]
        statement = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            table.ident,
            sql.SQL(", ").join(sql.Identifier(c.name) for c in columns),
            sql.SQL(", ").join(sql.SQL("{}::{}").format(sql.Placeholder(), sql.SQL(c.type)) for c in columns),
        )
        with self.conn.cursor() as cursor:
            cursor.executemany(statement, rows)
        table.keys.update(keys)
        return keys

    def _update(self, table: TableModel, change_key: bool, count: int | None = None, repeat: int = 1) -> None:
        for key in self._sample(table, count or self.rng.randint(1, 15)):
            for _ in range(repeat):
                # Leaving the TOAST column out of SET is what makes pgoutput send it as unchanged.
                chosen = [c for c in table.columns if self.rng.random() < 0.4] or table.columns[:1]
                assignments = [
                    sql.SQL("{} = {}::{}").format(sql.Identifier(c.name), sql.Placeholder(), sql.SQL(c.type))
                    for c in chosen
                ]
                values: list[str | None] = [c.value(self.rng) for c in chosen]
                new_key = table.new_key(self.rng) if change_key else None
                if new_key is not None:
                    assignments += [
                        sql.SQL("{} = {}::{}").format(sql.Identifier(c.name), sql.Placeholder(), sql.SQL(c.type))
                        for c in table.key
                    ]
                    values += list(new_key)
                condition, key_values = self._where_key(table, key)
                self.conn.execute(
                    sql.SQL("UPDATE {} SET {} WHERE {}").format(
                        table.ident, sql.SQL(", ").join(assignments), condition
                    ),
                    values + key_values,
                )
                if new_key is not None:
                    table.keys.discard(key)
                    table.keys.add(new_key)
                    key = new_key

    def _delete_keys(self, table: TableModel, keys: list[tuple[str, ...]]) -> None:
        for key in keys:
            condition, values = self._where_key(table, key)
            self.conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(table.ident, condition), values)
            table.keys.discard(key)

    def _create_partition(self, table: TableModel, name: str, value: int) -> None:
        self.conn.execute(
            sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES IN ({})").format(
                sql.Identifier(table.schema, name), table.ident, sql.Literal(value)
            )
        )

    def _partition_change(self, table: TableModel) -> str:
        """Rows joining or leaving a partitioned table with no WAL change (but for a new empty partition)."""
        assert table.partitions is not None
        roll = self.rng.random()
        self._added += 1
        if roll < 0.25 or not table.partitions:
            # Empty, for a value no row has: only recorded, never resynced.
            name, value = f"{table.name}_new{self._added}", 100 + self._added
            self._create_partition(table, name, value)
            table.partitions[name] = value
            return "create_partition"
        if roll < 0.5:
            # A table filled first, then attached: its rows arrive with no WAL change.
            name, value = f"{table.name}_att{self._added}", 1000 + self._added
            leaf = sql.Identifier(table.schema, name)
            self.conn.execute(
                sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING GENERATED)").format(leaf, table.ident)
            )
            keys = [(str(value), table.new_key(self.rng)[-1]) for _ in range(self.rng.randint(1, 60))]
            self.conn.execute(
                sql.SQL("INSERT INTO {} ({}, {}) SELECT * FROM unnest(%s::smallint[], %s::bigint[])").format(
                    leaf, sql.Identifier(table.key[0].name), sql.Identifier(table.key[1].name)
                ),
                ([int(k[0]) for k in keys], [int(k[1]) for k in keys]),
            )
            self.conn.execute(
                sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES IN ({})").format(
                    table.ident, leaf, sql.Literal(value)
                )
            )
            table.partitions[name] = value
            table.keys.update(keys)
            return "attach_partition"
        name = self.rng.choice(sorted(table.partitions))
        leaf = sql.Identifier(table.schema, name)
        value = table.partitions[name]
        if roll < 0.7:
            self.conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(table.ident, leaf))
            self.conn.execute(sql.SQL("DROP TABLE {}").format(leaf))
            kind = "detach_partition"
        elif roll < 0.85:
            self.conn.execute(sql.SQL("DROP TABLE {}").format(leaf))
            kind = "drop_partition"
        else:
            self.conn.execute(sql.SQL("TRUNCATE {}").format(leaf))
            table.keys -= {key for key in table.keys if key[0] == str(value)}
            return "truncate_partition"
        del table.partitions[name]
        table.keys -= {key for key in table.keys if key[0] == str(value)}
        return kind

    def _schema_change(self, table: TableModel) -> str:
        if "columns" in table.options:
            # Renaming or dropping a listed column is refused at the next start (docs/columns.md).
            self._added += 1
            column = Column(f"added_{self._added}", "text", 0.3)
            self.conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN {} text").format(table.ident, sql.Identifier(column.name))
            )
            table.columns.append(column)
            table.added_since_entry.append(column.name)
            return "add_unsent_column"
        roll = self.rng.random()
        widenable = [c for c in table.columns if c.type in WIDENINGS and not c.pinned]
        retypable = [c for c in table.columns if c.type in RETYPABLE and not c.pinned]
        droppable = [c for c in table.columns[1:] if not c.pinned]
        if roll < 0.05:
            # Rewrites the table, computing a value for every row with no WAL change: an online resync.
            self._added += 1
            name, key = f"generated_{self._added}", table.key[-1].name
            expression = sql.SQL("{}::bigint * 3").format(sql.Identifier(key))
            self.conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint GENERATED ALWAYS AS ({}) STORED").format(
                    table.ident, sql.Identifier(name), expression
                )
            )
            return "add_generated_column"
        if roll < 0.2 or len(droppable) < 2:
            self._added += 1
            column = Column(f"added_{self._added}", self.rng.choice(ADDABLE), self.rng.choice([0.0, 0.3, 0.9]))
            self.conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(
                    table.ident, sql.Identifier(column.name), sql.SQL(column.type)
                )
            )
            table.columns.append(column)
            return "add_column"
        if roll < 0.4:
            # A constant default: rows older than the ALTER read it without any WAL change.
            self._added += 1
            column = Column(f"added_{self._added}", self.rng.choice(ADDABLE), self.rng.choice([0.0, 0.3]))
            default = GENERATORS[column.type](self.rng)
            self.conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN {} {} DEFAULT {}").format(
                    table.ident, sql.Identifier(column.name), sql.SQL(column.type), sql.Literal(default)
                )
            )
            table.columns.append(column)
            return "add_column_default"
        if roll < 0.55:
            self._added += 1
            column = self.rng.choice([*table.columns, *table.key])
            renamed = f"{column.name.split('__')[0]}__r{self._added}"
            self.conn.execute(
                sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(
                    table.ident, sql.Identifier(column.name), sql.Identifier(renamed)
                )
            )
            column.name = renamed
            return "rename_column"
        if roll < 0.75 and widenable:
            column = self.rng.choice(widenable)
            column.type = WIDENINGS[column.type]
            self.conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
                    table.ident, sql.Identifier(column.name), sql.SQL(column.type)
                )
            )
            return "widen_column"
        if roll < 0.85 and retypable:
            column = self.rng.choice(retypable)
            column.type = "text"
            self.conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE text USING {}::text || '~'").format(
                    table.ident, sql.Identifier(column.name), sql.Identifier(column.name)
                )
            )
            return "retype_column"
        column = self.rng.choice(droppable)
        self.conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(table.ident, sql.Identifier(column.name)))
        table.columns.remove(column)
        return "drop_column"
