"""The staging codec: row changes of one table <-> a Parquet file with the fixed staging schema.

The six columns are exactly the staged log's schema (``_op``, ``_lsn``, ``_ts``, ``_xid``,
``_unchanged_cols``, ``_data``). ``_op`` is I, U or D, plus T for a TRUNCATE of the table.
``_data`` is a JSON object of the row's columns in PostgreSQL text form (null for SQL NULL);
unchanged TOASTed columns are left out of it and named in ``_unchanged_cols``. The relation's
columns and resolved types at the time of the change ride along in the file's key-value metadata,
so the materializer can evolve the Iceberg schema without asking the source.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..source.catalog import SourceColumn

TIMESTAMP = pa.timestamp("us", tz="UTC")
STAGING_SCHEMA = pa.schema(
    [
        ("_op", pa.string()),
        ("_lsn", pa.int64()),
        ("_ts", TIMESTAMP),
        ("_xid", pa.int64()),
        ("_unchanged_cols", pa.string()),
        ("_data", pa.string()),
    ]
)
RELATION_METADATA_KEY = b"pg2iceberg.relation"
# The commit (end) LSN of each transaction with changes in the file, by xid (files staged before it: none).
COMMIT_LSNS_METADATA_KEY = b"pg2iceberg.commit-lsns"
ARROW_SCHEMA_KEY = b"ARROW:schema"  # where pyarrow keeps the Arrow schema it wrote, beside ours

INSERT, UPDATE, DELETE, TRUNCATE = "I", "U", "D", "T"
# Not a staged column: the merge adds it to the changes it reads (materializer.merge.staged_changes): the
# commit LSN of the change's transaction (see COMMIT_LSNS_METADATA_KEY).
COMMIT_LSN_COLUMN = "_pg2iceberg_commit_lsn"


@dataclass(frozen=True, slots=True)
class Change:
    """One row change (or a TRUNCATE) as staged."""

    op: str
    lsn: int
    ts: datetime
    xid: int
    data: dict[str, str | None]
    unchanged: tuple[str, ...] = ()
    commit_lsn: int = 0  # see COMMIT_LSN_COLUMN (0: not known)


@dataclass(frozen=True)
class StagedRelation:
    """The table a staged file belongs to and its columns when the changes happened."""

    table: str
    columns: tuple[SourceColumn, ...]
    # The table's relfilenode when the flusher read this relation (see source.catalog.file_node).
    file_node: int | None = None
    # Key columns the table's replica identity did not carry then (its deletes lack them).
    unkeyed: tuple[str, ...] = ()
    # The primary key's columns then (empty in files staged before it was recorded).
    key: tuple[str, ...] = ()

    def to_json(self) -> str:
        return self._json

    @functools.cached_property
    def _json(self) -> str:
        # Once per relation, not per staged file: a flush over many tables writes a file for each.
        data: dict[str, Any] = {"table": self.table, "columns": [c.to_json() for c in self.columns]}
        if self.file_node is not None:
            data["file_node"] = self.file_node
        if self.unkeyed:
            data["unkeyed"] = list(self.unkeyed)
        if self.key:
            data["key"] = list(self.key)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> StagedRelation:
        data = json.loads(text)
        columns = tuple(SourceColumn.from_json(c) for c in data["columns"])
        return cls(
            table=data["table"],
            columns=columns,
            file_node=data.get("file_node"),
            unkeyed=tuple(data.get("unkeyed", ())),
            key=tuple(data.get("key", ())),
        )


def join_names(names: Sequence[str]) -> str:
    """Comma-separated column names, CSV-quoted where a name holds a comma or a quote."""
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(names)
    return out.getvalue()


def split_names(text: str) -> tuple[str, ...]:
    """The names :func:`join_names` joined."""
    return tuple(next(csv.reader([text])))


def encode(relation: StagedRelation, changes: Sequence[Change]) -> bytes:
    """Serialize changes (in log order) to Parquet bytes."""
    return encode_columns(
        relation,
        pa.array([c.op for c in changes], pa.string()),
        pa.array([c.lsn for c in changes], pa.int64()),
        pa.array([c.ts for c in changes], TIMESTAMP),
        pa.array([c.xid for c in changes], pa.int64()),
        pa.array([join_names(c.unchanged) if c.unchanged else None for c in changes], pa.string()),
        pa.array([json.dumps(c.data, separators=(",", ":")) for c in changes], pa.string()),
    )


def encode_columns(
    relation: StagedRelation,
    op: pa.Array,
    lsn: pa.Array,
    ts: pa.Array,
    xid: pa.Array,
    unchanged: pa.Array,
    data: pa.Array,
    commit_lsns: tuple[pa.Array, pa.Array] | None = None,
) -> bytes:
    """The six staging columns (Arrow arrays of one length, in log order) -> Parquet bytes.

    ``ts`` may also be int64 microseconds since the Unix epoch; ``unchanged`` holds the CSV-joined names
    (null when none) and ``data`` the JSON objects, as :func:`encode` builds them; ``commit_lsns`` the
    xids of the transactions (each once) and their commit LSNs.
    """
    metadata = {RELATION_METADATA_KEY: relation.to_json().encode()}
    if commit_lsns is not None and len(commit_lsns[0]):
        metadata[COMMIT_LSNS_METADATA_KEY] = commit_lsns_json(*commit_lsns)
    table = pa.Table.from_arrays(
        [op, lsn, ts if ts.type == TIMESTAMP else ts.cast(TIMESTAMP), xid, unchanged, data],
        schema=STAGING_SCHEMA,
    )
    sink = io.BytesIO()
    # Dictionaries and statistics only where they pay: a row's JSON and LSN are (nearly) unique, and
    # building a dictionary for them, then dropping it, cost a quarter of the write. The integers climb
    # (LSN, commit time) or repeat (a transaction's xid): stored as deltas, they take a fraction of the
    # space of dictionaries or plain values, for less CPU (TPC-B: 0.82 -> 0.57 us and 18.9 -> 13.3
    # bytes a change beside the metadata, docs/performance-history.md).
    with pq.ParquetWriter(
        sink,
        STAGING_SCHEMA,
        compression="zstd",
        use_dictionary=["_op", "_unchanged_cols"],
        column_encoding=dict.fromkeys(("_lsn", "_ts", "_xid"), "DELTA_BINARY_PACKED"),
        write_statistics=["_op", "_lsn", "_ts", "_xid"],
    ) as writer:
        writer.write_table(table)
        # In the file's key-value metadata only: as the Arrow schema's metadata it would be stored twice,
        # the second time base64-encoded inside the serialized schema (a file of small transactions names
        # thousands of commit LSNs: 40% of its bytes, a third of its encoding and half its decoding).
        writer.add_key_value_metadata(metadata)
    return sink.getvalue()


def commit_lsns_json(xids: pa.Array, lsns: pa.Array) -> bytes:
    """``{"xid": lsn, ...}`` as ``json.dumps`` writes it, of these pairs (int64 arrays, each xid once),
    built by Arrow: a staged file of small transactions names tens of thousands."""
    pairs = pc.binary_join_element_wise('"', xids.cast(pa.string()), '": ', lsns.cast(pa.string()), "")
    listed = pa.ListArray.from_arrays(pa.array([0, len(pairs)], pa.int32()), pairs)
    return b"{" + pc.binary_join(listed, ", ")[0].as_py().encode() + b"}"


def read_staged(data: bytes) -> tuple[StagedRelation, pa.Table]:
    """A staged file as (relation, its six staging columns) without building a Python object per row;
    the table's schema metadata is the file's key-value metadata (where :func:`encode_columns` writes it;
    files staged before also hold it in their Arrow schema)."""
    file = pq.ParquetFile(io.BytesIO(data))
    metadata = {key: value for key, value in (file.metadata.metadata or {}).items() if key != ARROW_SCHEMA_KEY}
    table = file.read().replace_schema_metadata(metadata)
    if RELATION_METADATA_KEY not in metadata or table.schema.remove_metadata() != STAGING_SCHEMA:
        raise ValueError("not a pg2iceberg staged file (schema or relation metadata missing)")
    return StagedRelation.from_json(metadata[RELATION_METADATA_KEY]), table


def commit_lsns_of(table: pa.Table, fallback: int) -> pa.Array:
    """Per change of a staged file (as :func:`read_staged` returns it), its transaction's commit LSN;
    ``fallback`` where the file does not record it (staged before it was)."""
    recorded = (table.schema.metadata or {}).get(COMMIT_LSNS_METADATA_KEY, b"{}")
    xids, lsns = _commit_lsn_pairs(recorded)
    if not len(xids):
        return pa.repeat(pa.scalar(fallback, pa.int64()), table.num_rows)
    found = pc.take(lsns, pc.index_in(table.column("_xid"), value_set=xids))
    return pc.fill_null(found, fallback).combine_chunks()


def _commit_lsn_pairs(recorded: bytes) -> tuple[pa.Array, pa.Array]:
    """The xids and commit LSNs of a file's commit-LSN map (int64 arrays). Taken apart by Arrow where it
    is laid out as :func:`commit_lsns_json` and ``json.dumps`` write it (``{"xid": lsn, ...}``): a
    merge reads thousands of pairs a file, and parsing them into a dict cost more than reading the
    file's rows. Any other layout goes through ``json.loads``."""
    if len(recorded) > 2 and recorded[:2] == b'{"' and recorded[-1:] == b"}":
        pairs = pc.split_pattern(pa.array([recorded[2:-1].decode()]), ', "')[0].values
        parts = pc.split_pattern(pairs, '": ')
        if pc.all(pc.equal(pc.list_value_length(parts), 2)).as_py():
            with contextlib.suppress(pa.ArrowInvalid):
                xids = pc.cast(pc.list_element(parts, 0), pa.int64())
                return xids, pc.cast(pc.list_element(parts, 1), pa.int64())
    mapping = json.loads(recorded)
    return pa.array([int(xid) for xid in mapping], pa.int64()), pa.array(list(mapping.values()), pa.int64())


def changes_of(table: pa.Table) -> list[Change]:
    """The staging columns (as :func:`read_staged` returns them) -> changes in log order."""
    columns = table.to_pydict()
    commit_lsns = columns.get(COMMIT_LSN_COLUMN, [0] * table.num_rows)
    return [
        Change(
            op=op,
            lsn=lsn,
            ts=ts,
            xid=xid,
            data=json.loads(payload),
            unchanged=split_names(unchanged) if unchanged else (),
            commit_lsn=commit_lsn,
        )
        for op, lsn, ts, xid, unchanged, payload, commit_lsn in zip(
            columns["_op"],
            columns["_lsn"],
            columns["_ts"],
            columns["_xid"],
            columns["_unchanged_cols"],
            columns["_data"],
            commit_lsns,
            strict=True,
        )
    ]


def decode(data: bytes) -> tuple[StagedRelation, list[Change]]:
    """Parquet bytes -> (relation, changes in log order)."""
    relation, table = read_staged(data)
    return relation, changes_of(table)
