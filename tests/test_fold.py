"""Unit tests for folding staged changes per primary key, and for the staging codec."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pg2iceberg_dagster.materializer.fold import UPSERT, FoldResult, fold
from pg2iceberg_dagster.source.catalog import PgType, SourceColumn
from pg2iceberg_dagster.staging import codec
from pg2iceberg_dagster.staging.codec import DELETE, INSERT, TRUNCATE, UPDATE, Change, StagedRelation

INT4 = PgType(name="integer", kind="int4", type_mod=-1, base_oid=23, array_oid=1007)
TEXT = PgType(name="text", kind="text", type_mod=-1, base_oid=25, array_oid=1009)
TEXT_ARRAY = PgType(name="text[]", kind="array", type_mod=-1, base_oid=1009, array_oid=0, element=TEXT)

RELATION = StagedRelation(
    table="public.docs",
    columns=(
        SourceColumn("id", INT4, True),
        SourceColumn("name", TEXT, False),
        SourceColumn("big", TEXT, False),
    ),
)
T0 = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)


def change(op: str, lsn: int, data: dict[str, str | None], unchanged: Sequence[str] = (), xid: int = 1000) -> Change:
    """A staged change at ``lsn`` (timestamp derived from the LSN modulo 100000)."""
    return Change(op, lsn, T0 + timedelta(seconds=lsn % 100_000), xid, data, tuple(unchanged))


def fold_one(changes: Sequence[Change], key: Sequence[str] = ("id",)) -> FoldResult:
    """Fold a single staged file of RELATION."""
    return fold([(RELATION, changes)], key)


def test_last_change_wins() -> None:
    """Several updates of one key fold to the last one."""
    result = fold_one(
        [
            change(INSERT, 10, {"id": "1", "name": "a", "big": "x"}),
            change(UPDATE, 20, {"id": "1", "name": "b", "big": "y"}),
            change(UPDATE, 30, {"id": "1", "name": "c", "big": "z"}),
            change(INSERT, 40, {"id": "2", "name": "other", "big": None}),
        ]
    )
    assert set(result.rows) == {("1",), ("2",)}
    row = result.rows[("1",)]
    assert row.op == UPSERT
    assert row.data == {"id": "1", "name": "c", "big": "z"}
    assert row.unchanged == frozenset()
    assert row.relation is RELATION
    assert row.fill_from_key is None
    assert result.rows[("2",)].data == {"id": "2", "name": "other", "big": None}
    assert result.truncated is False
    assert result.changes == 4


def test_insert_then_delete_is_delete() -> None:
    """An insert followed by a delete of the same key folds to the delete."""
    result = fold_one([change(INSERT, 10, {"id": "1", "name": "a", "big": "x"}), change(DELETE, 20, {"id": "1"})])
    assert list(result.rows) == [("1",)]
    assert result.rows[("1",)].op == DELETE
    assert result.rows[("1",)].data == {"id": "1"}


def test_delete_then_insert_is_upsert_with_new_data() -> None:
    """A delete followed by an insert of the same key folds to an upsert of the inserted row."""
    result = fold_one([change(DELETE, 10, {"id": "1"}), change(INSERT, 20, {"id": "1", "name": "new", "big": "B"})])
    row = result.rows[("1",)]
    assert row.op == UPSERT
    assert row.data == {"id": "1", "name": "new", "big": "B"}
    assert row.unchanged == frozenset()
    assert row.fill_from_key is None


def test_unchanged_taken_from_earlier_insert() -> None:
    """An update whose 'big' is unchanged takes 'big' from an insert earlier in the batch."""
    result = fold_one(
        [
            change(INSERT, 10, {"id": "1", "name": "a", "big": "huge value"}),
            change(UPDATE, 20, {"id": "1", "name": "b"}, unchanged=["big"]),
        ]
    )
    row = result.rows[("1",)]
    assert row.op == UPSERT
    assert row.data == {"id": "1", "name": "b", "big": "huge value"}
    assert row.unchanged == frozenset()


def test_unchanged_null_taken_from_earlier_insert() -> None:
    """A NULL 'big' from an earlier insert is carried forward as NULL, not left unchanged."""
    result = fold_one(
        [
            change(INSERT, 10, {"id": "1", "name": "a", "big": None}),
            change(UPDATE, 20, {"id": "1", "name": "b"}, unchanged=["big"]),
        ]
    )
    row = result.rows[("1",)]
    assert row.data == {"id": "1", "name": "b", "big": None}
    assert row.unchanged == frozenset()


def test_unchanged_without_earlier_change_stays_unchanged() -> None:
    """An update with unchanged 'big' and nothing earlier for the key leaves 'big' to the MERGE."""
    result = fold_one(
        [
            change(INSERT, 5, {"id": "2", "name": "z", "big": "other row"}),
            change(UPDATE, 10, {"id": "1", "name": "b"}, unchanged=["big"]),
        ]
    )
    row = result.rows[("1",)]
    assert row.op == UPSERT
    assert row.data == {"id": "1", "name": "b"}
    assert "big" not in row.data
    assert row.unchanged == frozenset({"big"})
    assert row.fill_from_key is None


def test_unchanged_chain_of_updates_stays_unchanged() -> None:
    """Two updates that both leave 'big' unchanged keep it unchanged and take the newest other columns."""
    result = fold_one(
        [
            change(UPDATE, 10, {"id": "1", "name": "a"}, unchanged=["big"]),
            change(UPDATE, 20, {"id": "1", "name": "b"}, unchanged=["big"]),
        ]
    )
    row = result.rows[("1",)]
    assert row.data == {"id": "1", "name": "b"}
    assert row.unchanged == frozenset({"big"})


def test_unchanged_after_delete_is_not_taken_from_delete() -> None:
    """An update after a delete of its key does not take values from the delete's key-only data."""
    result = fold_one(
        [
            change(DELETE, 10, {"id": "1"}),
            change(UPDATE, 20, {"id": "1", "name": "b"}, unchanged=["big"]),
        ]
    )
    row = result.rows[("1",)]
    assert row.op == UPSERT
    assert row.data == {"id": "1", "name": "b"}
    assert row.unchanged == frozenset({"big"})


def test_new_value_not_masked_by_earlier_unchanged() -> None:
    """A later update that carries 'big' must not leave 'big' unchanged because an earlier update did."""
    result = fold_one(
        [
            change(UPDATE, 10, {"id": "1", "name": "a"}, unchanged=["big"]),
            change(UPDATE, 20, {"id": "1", "big": "NEW"}, unchanged=["name"]),
        ]
    )
    row = result.rows[("1",)]
    assert row.data == {"id": "1", "name": "a", "big": "NEW"}
    assert row.unchanged == frozenset()


def test_truncate_discards_earlier_rows() -> None:
    """TRUNCATE drops everything folded before it and marks the result truncated."""
    result = fold_one(
        [
            change(INSERT, 10, {"id": "1", "name": "a", "big": "x"}),
            change(DELETE, 20, {"id": "2"}),
            change(TRUNCATE, 30, {}),
        ]
    )
    assert result.truncated is True
    assert result.rows == {}
    assert result.changes == 3


def test_changes_after_truncate_survive() -> None:
    """Changes after a TRUNCATE are kept; unchanged columns are not filled from rows before it."""
    result = fold_one(
        [
            change(INSERT, 10, {"id": "1", "name": "a", "big": "before"}),
            change(TRUNCATE, 20, {}),
            change(INSERT, 30, {"id": "3", "name": "c", "big": "after"}),
            change(UPDATE, 40, {"id": "1", "name": "b"}, unchanged=["big"]),
        ]
    )
    assert result.truncated is True
    assert set(result.rows) == {("1",), ("3",)}
    assert result.rows[("3",)].data == {"id": "3", "name": "c", "big": "after"}
    assert result.rows[("1",)].data == {"id": "1", "name": "b"}
    assert result.rows[("1",)].unchanged == frozenset({"big"})
    assert result.changes == 4


def test_composite_primary_key() -> None:
    """Rows are keyed by the tuple of all primary-key columns, in primary-key order."""
    relation = StagedRelation(
        table="public.members",
        columns=(SourceColumn("tenant", INT4, True), SourceColumn("id", INT4, True), SourceColumn("name", TEXT, False)),
    )
    changes = [
        change(INSERT, 10, {"tenant": "1", "id": "1", "name": "a"}),
        change(INSERT, 20, {"tenant": "2", "id": "1", "name": "b"}),
        change(UPDATE, 30, {"tenant": "1", "id": "1", "name": "a2"}),
        change(DELETE, 40, {"tenant": "2", "id": "1"}),
        change(INSERT, 50, {"tenant": "1", "id": "2", "name": "c"}),
    ]
    result = fold([(relation, changes)], ["tenant", "id"])
    assert set(result.rows) == {("1", "1"), ("2", "1"), ("1", "2")}
    assert result.rows[("1", "1")].data["name"] == "a2"
    assert result.rows[("2", "1")].op == DELETE
    assert result.rows[("1", "2")].op == UPSERT
    swapped = fold([(relation, changes)], ["id", "tenant"])
    assert ("2", "1") in swapped.rows
    assert swapped.rows[("2", "1")].data["name"] == "c"


def test_changes_counts_every_change_across_batches() -> None:
    """``changes`` counts every change (truncates included) and relations are listed once each."""
    other = StagedRelation(table="public.docs", columns=(*RELATION.columns, SourceColumn("extra", TEXT, False)))
    result = fold(
        [
            (RELATION, [change(INSERT, 1, {"id": "1", "name": "a", "big": "x"}), change(TRUNCATE, 2, {})]),
            (RELATION, [change(UPDATE, 3, {"id": "1", "name": "b", "big": "y"})]),
            (other, [change(UPDATE, 4, {"id": "1", "name": "c", "big": "z", "extra": "e"})]),
            (other, []),
        ],
        ["id"],
    )
    assert result.changes == 4
    assert result.relations == [RELATION, other]
    assert result.rows[("1",)].relation == other
    assert result.rows[("1",)].data["extra"] == "e"


def test_key_change_fills_from_old_key_in_batch() -> None:
    """A key-changing update (DELETE old + UPDATE new at one LSN) takes unchanged values from the old key's row."""
    result = fold_one(
        [
            change(INSERT, 10, {"id": "1", "name": "a", "big": "B"}),
            change(DELETE, 20, {"id": "1"}),
            change(UPDATE, 20, {"id": "2", "name": "a"}, unchanged=["big"]),
        ]
    )
    assert result.rows[("1",)].op == DELETE
    moved = result.rows[("2",)]
    assert moved.data == {"id": "2", "name": "a", "big": "B"}
    assert moved.unchanged == frozenset()
    assert moved.fill_from_key is None


def test_key_change_without_earlier_row_fills_from_old_key() -> None:
    """A key-changing update with nothing earlier in the batch leaves 'big' to be filled from the old key."""
    result = fold_one(
        [
            change(DELETE, 20, {"id": "1"}),
            change(UPDATE, 20, {"id": "2", "name": "a"}, unchanged=["big"]),
        ]
    )
    moved = result.rows[("2",)]
    assert moved.unchanged == frozenset({"big"})
    assert moved.fill_from_key == ("1",)


def test_update_after_key_change_keeps_filling_from_old_key() -> None:
    """A moved row updated again, TOAST still untouched: the column still comes from the old key's row.

    Found by the soak (seed 10): the second update dropped the link and the column became NULL.
    """
    result = fold_one(
        [
            change(DELETE, 10, {"id": "1", "name": None, "big": None}),
            change(UPDATE, 10, {"id": "2", "name": "moved"}, unchanged=["big"]),
            change(UPDATE, 20, {"id": "2", "name": "again"}, unchanged=["big"]),
        ]
    )
    row = result.rows[("2",)]
    assert row.data["name"] == "again"
    assert row.unchanged == frozenset({"big"})
    assert row.fill_from_key == ("1",)


def test_codec_round_trip() -> None:
    """encode/decode preserve the relation, order, ops, LSNs, xids, timestamps, unchanged and NULLs."""
    relation = StagedRelation(table="public.docs", columns=(*RELATION.columns, SourceColumn("tags", TEXT_ARRAY, False)))
    changes = [
        change(INSERT, 300, {"id": "3", "name": "ünïcødé ✓", "big": None, "tags": "{a,b}"}, xid=7),
        change(UPDATE, 100, {"id": "3", "name": "b"}, unchanged=["big", "tags"], xid=2**40),
        change(DELETE, 200, {"id": "3"}, xid=8),
        change(TRUNCATE, 250, {}, xid=8),
        change(INSERT, 2**62, {"id": "4", "name": "", "big": '{"json": "quoted \\"text\\""}', "tags": None}),
    ]
    decoded_relation, decoded = codec.decode(codec.encode(relation, changes))
    assert decoded_relation == relation
    assert decoded_relation.columns[3].type.element == TEXT
    assert decoded == changes
    assert [c.op for c in decoded] == [INSERT, UPDATE, DELETE, TRUNCATE, INSERT]
    assert [c.lsn for c in decoded] == [300, 100, 200, 250, 2**62]
    assert decoded[1].unchanged == ("big", "tags")
    assert decoded[0].unchanged == ()
    assert decoded[0].data["big"] is None
    assert "big" in decoded[0].data
    assert decoded[0].ts == T0 + timedelta(seconds=300)
    assert decoded[0].ts.utcoffset() == timedelta(0)


def test_codec_round_trip_empty() -> None:
    """An empty change list round-trips."""
    relation, changes = codec.decode(codec.encode(RELATION, []))
    assert relation == RELATION
    assert changes == []


def test_codec_unchanged_column_name_with_comma() -> None:
    """An unchanged column whose name contains a comma round-trips as one name."""
    relation = StagedRelation(
        table="public.t", columns=(SourceColumn("id", INT4, True), SourceColumn("a,b", TEXT, False))
    )
    _, decoded = codec.decode(codec.encode(relation, [change(UPDATE, 1, {"id": "1"}, unchanged=["a,b"])]))
    assert decoded[0].unchanged == ("a,b",)


def test_staged_file_schema() -> None:
    """The staged Parquet file has exactly the six staging columns, in order, with their types."""
    data = codec.encode(RELATION, [change(INSERT, 1, {"id": "1", "name": "a", "big": "x"})])
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.names == ["_op", "_lsn", "_ts", "_xid", "_unchanged_cols", "_data"]
    assert table.schema.remove_metadata() == pa.schema(
        [
            ("_op", pa.string()),
            ("_lsn", pa.int64()),
            ("_ts", pa.timestamp("us", tz="UTC")),
            ("_xid", pa.int64()),
            ("_unchanged_cols", pa.string()),
            ("_data", pa.string()),
        ]
    )
    # The relation rides in the file's key-value metadata, once: not again inside the Arrow schema.
    metadata = pq.ParquetFile(io.BytesIO(data)).metadata.metadata
    assert codec.RELATION_METADATA_KEY in metadata
    assert not table.schema.metadata or codec.RELATION_METADATA_KEY not in table.schema.metadata
    assert table.column("_op").to_pylist() == ["I"]
    assert table.column("_unchanged_cols").to_pylist() == [None]


def test_files_staged_before_the_metadata_moved_still_decode() -> None:
    """Files staged by earlier versions hold the relation and commit LSNs in their Arrow schema's
    metadata too: they decode to the same relation and changes."""
    changes = [
        change(INSERT, 1, {"id": "1", "name": "a", "big": "x"}),
        change(UPDATE, 2, {"id": "1", "name": None}, unchanged=["big"]),
        change(DELETE, 3, {"id": "1"}),
    ]
    data = codec.encode(RELATION, changes)
    relation, table = codec.read_staged(data)
    assert table.schema.metadata is not None and codec.RELATION_METADATA_KEY in table.schema.metadata
    earlier = _parquet(table)  # pq.write_table keeps the schema's metadata in the Arrow schema as well
    assert codec.RELATION_METADATA_KEY in pq.read_table(io.BytesIO(earlier)).schema.metadata
    assert codec.decode(earlier) == codec.decode(data) == (relation, codec.changes_of(table))
    assert len(data) < len(earlier)


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_decode_rejects_other_parquet() -> None:
    """A Parquet file with another schema is not a staged file."""
    other = pa.table({"id": [1, 2], "name": ["a", "b"]})
    with pytest.raises(ValueError, match="not a pg2iceberg staged file"):
        codec.decode(_parquet(other))


def test_decode_rejects_missing_relation_metadata() -> None:
    """The staging schema without the relation metadata is not a staged file."""
    empty = pa.Table.from_pylist([], schema=codec.STAGING_SCHEMA)
    with pytest.raises(ValueError, match="not a pg2iceberg staged file"):
        codec.decode(_parquet(empty))


def test_decode_rejects_wrong_column_type() -> None:
    """Relation metadata with a schema whose types differ (e.g. _lsn as string) is rejected."""
    schema = pa.schema(
        [(name, pa.string()) for name in codec.STAGING_SCHEMA.names],
        metadata={codec.RELATION_METADATA_KEY: RELATION.to_json().encode()},
    )
    with pytest.raises(ValueError, match="not a pg2iceberg staged file"):
        codec.decode(_parquet(pa.Table.from_pylist([], schema=schema)))


@pytest.mark.parametrize(
    "separators", [(", ", ": "), (",", ":"), (",\n ", ": ")], ids=["as written", "compact", "other"]
)
def test_commit_lsns_are_found_per_change_whatever_the_maps_layout(separators: tuple[str, str]) -> None:
    """Each change takes its transaction's commit LSN from the file's map, a transaction the map does
    not name the fallback; the map as the codec writes it (taken apart by Arrow) and laid out otherwise
    (through json) read alike."""
    recorded = {"5000000001": 900, "7": 1200, "42": 77}
    text = json.dumps(recorded, separators=separators).encode()
    if separators == (", ", ": "):
        xids = pa.array([int(xid) for xid in recorded], pa.int64())
        assert text == codec.commit_lsns_json(xids, pa.array(list(recorded.values()), pa.int64()))
    schema = pa.schema([("_xid", pa.int64())], metadata={codec.COMMIT_LSNS_METADATA_KEY: text})
    table = pa.Table.from_pydict({"_xid": [7, 7, 5000000001, 3, 42]}, schema=schema)
    assert codec.commit_lsns_of(table, fallback=1).to_pylist() == [1200, 1200, 900, 1, 77]
