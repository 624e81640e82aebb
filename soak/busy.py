"""A busy table for snapshot crashes: rows that move between CTID chunks while chunks are read.

Updates of an indexed column are never HOT, so each one writes the row's new version on another page,
often one whose chunk was read already; VACUUM after deletes frees early pages for them. Key changes,
deletes and re-inserts of the same key, and updates that leave a TOASTed column out of the WAL make
every way a row can be read twice, or not at all, happen while a snapshot runs.
"""

from __future__ import annotations

import random
from collections import Counter

import psycopg

TABLE = "public.busy"
KEY_SHIFT = 10_000_000  # a changed key moves above every original one
APPLICATION_NAME = "pg2iceberg-busy-writes"  # how the workload's session shows in pg_stat_activity


class BusyTable:
    """Creates ``public.busy`` in the database at ``conninfo`` and writes to it one transaction a step."""

    def __init__(self, conninfo: str, seed: int, rows: int) -> None:
        self.conn = psycopg.connect(conninfo, autocommit=True, application_name=APPLICATION_NAME)
        self.rng = random.Random(seed)
        self.rows = rows
        self.next_id = rows + 1
        self.kinds: Counter[str] = Counter()

    def close(self) -> None:
        self.conn.close()

    def create(self) -> None:
        """The table: every 40th row holds a TOASTed body (stored out of line, uncompressed)."""
        self.conn.execute("CREATE TABLE public.busy (id bigint PRIMARY KEY, n int NOT NULL, note text, body text)")
        self.conn.execute("CREATE INDEX busy_n ON public.busy (n)")
        self.conn.execute("ALTER TABLE public.busy ALTER COLUMN body SET STORAGE EXTERNAL")
        self.conn.execute("ALTER TABLE public.busy SET (autovacuum_enabled = off)")
        self.conn.execute(
            "INSERT INTO public.busy SELECT g, g %% 1000, 'note ' || g, "
            "CASE WHEN g %% 40 = 0 THEN repeat(md5(g::text), 80) ELSE 'small ' || g END "
            "FROM generate_series(1, %s) g",
            (self.rows,),
        )
        self.conn.execute("ANALYZE public.busy")

    def _some_ids(self, count: int) -> list[int]:
        return [self.rng.randint(1, self.next_id) for _ in range(count)]

    def step(self) -> str:
        """One transaction of a random kind; returns the kind."""
        kind = self.rng.choices(
            ["move", "move_toast", "key_change", "delete", "reinsert", "insert", "free_early_pages"],
            weights=[30, 20, 12, 10, 10, 10, 1],
        )[0]
        ids = self._some_ids(self.rng.randint(1, 40))
        if kind == "move":
            self.conn.execute("UPDATE public.busy SET n = n + 1, note = note || '+' WHERE id = ANY(%s)", (ids,))
        elif kind == "move_toast":
            # Rows holding a TOASTed body: the update leaves it out of the WAL ('u' unchanged).
            toasted = [i - i % 40 or 40 for i in ids]
            self.conn.execute("UPDATE public.busy SET n = n + 7 WHERE id = ANY(%s)", (toasted,))
        elif kind == "key_change":
            toasted = [i - i % 40 or 40 for i in ids[:3]]
            self.conn.execute(
                "UPDATE public.busy SET id = id + %s, n = n + 1 WHERE id = ANY(%s) AND id < %s "
                "AND NOT EXISTS (SELECT 1 FROM public.busy b WHERE b.id = busy.id + %s)",
                (KEY_SHIFT, toasted + ids[3:6], KEY_SHIFT, KEY_SHIFT),
            )
        elif kind == "delete":
            self.conn.execute("DELETE FROM public.busy WHERE id = ANY(%s)", (ids,))
        elif kind == "reinsert":
            with self.conn.transaction():
                self.conn.execute("DELETE FROM public.busy WHERE id = ANY(%s)", (ids,))
                self.conn.execute(
                    "INSERT INTO public.busy SELECT g, -g, 'back', repeat('r', 30) FROM unnest(%s::bigint[]) g "
                    "ON CONFLICT (id) DO NOTHING",
                    (ids,),
                )
        elif kind == "insert":
            start = self.next_id
            self.next_id += self.rng.randint(1, 50)
            self.conn.execute(
                "INSERT INTO public.busy SELECT g, g %% 1000, 'new', "
                "CASE WHEN g %% 40 = 0 THEN repeat(md5(g::text), 80) ELSE 'n' END "
                "FROM generate_series(%s::bigint, %s::bigint) g ON CONFLICT (id) DO NOTHING",
                (start, self.next_id - 1),
            )
        else:
            # Empty a run of early pages and vacuum them: moved rows then land in chunks read first.
            first = self.rng.randint(1, max(1, self.rows // 4))
            self.conn.execute("DELETE FROM public.busy WHERE id BETWEEN %s AND %s", (first, first + 100))
            self.conn.execute("VACUUM public.busy")
        self.kinds[kind] += 1
        return kind
