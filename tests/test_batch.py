"""The flusher's bulk decoder stages exactly what decoding each message on its own would stage."""

from __future__ import annotations

import io
import json
import random
import struct
from datetime import UTC, datetime, timedelta

import pyarrow.parquet as pq
import pytest

from pg2iceberg_dagster.config import FlushConfig, StagingConfig
from pg2iceberg_dagster.flusher.batch import (
    RelationInfo,
    encode_segment,
    row_changes,
    truncate_marker,
    xlog_data,
)
from pg2iceberg_dagster.flusher.window import RelationLog, StagedWriter
from pg2iceberg_dagster.source import pgoutput
from pg2iceberg_dagster.source.catalog import PgType, SourceColumn, SourceTable
from pg2iceberg_dagster.source.pgoutput import UNCHANGED, DecodeError
from pg2iceberg_dagster.source.replication import XLOG_HEADER, ReplicationStream, xlog_data_start
from pg2iceberg_dagster.staging import codec
from pg2iceberg_dagster.staging.codec import TRUNCATE, Change, StagedRelation
from pg2iceberg_dagster.staging.store import ObjectStore, table_location

from .conftest import SourceDb
from .test_pgoutput import tuple_data

INT4 = PgType(name="integer", kind="int4", type_mod=-1, base_oid=23, array_oid=1007)
TEXT = PgType(name="text", kind="text", type_mod=-1, base_oid=25, array_oid=1009)
NAMES = ("id", "name", 'we"ird,col', "big")
COLUMNS = tuple(SourceColumn(n, INT4 if n == "id" else TEXT, n == "id") for n in NAMES)
TABLE = SourceTable("public.t", "public", "t", 1, COLUMNS, ("id",), "d")
INFO = RelationInfo(TABLE, StagedRelation("public.t", COLUMNS), {n: i for i, n in enumerate(NAMES)})
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TRUNCATE_PAYLOAD = truncate_marker(0, 1)[25:]  # what the flusher keeps for a TRUNCATE of relation 1
TEXTS = ["", "plain", "ünïcødé ✓", 'quo"te', "back\\slash", "tab\there", "nl\n", "\x01ctl", "{a,b}", "x" * 300]


def _value(rng: random.Random, toast: bool = True) -> object:
    roll = rng.random()
    if roll < 0.15:
        return None
    if toast and roll < 0.25:
        return UNCHANGED
    return rng.choice(TEXTS)


def _message(rng: random.Random) -> bytes:
    """A random Insert, Update (with or without an old tuple, the key changed or not) or Delete."""
    key = str(rng.randrange(5))
    new = (key, *(_value(rng) for _ in NAMES[1:]))
    oid = struct.pack("!I", 1)
    kind = rng.choice("IUUUDDKO")
    if kind == "I":
        return b"I" + oid + b"N" + tuple_data(*new)
    if kind == "U":
        return b"U" + oid + b"N" + tuple_data(*new)
    if kind == "D":
        old = rng.choice([(key, None, None, None), (key, *(_value(rng, toast=False) for _ in NAMES[1:]))])
        return b"D" + oid + rng.choice([b"K", b"O"]) + tuple_data(*old)
    old_key = rng.choice([key, str(rng.randrange(5))])
    if kind == "K":
        return b"U" + oid + b"K" + tuple_data(old_key, None, None, None) + b"N" + tuple_data(*new)
    old = (old_key, *(_value(rng, toast=False) for _ in NAMES[1:]))
    return b"U" + oid + b"O" + tuple_data(*old) + b"N" + tuple_data(*new)


def _expected(messages: list[bytes], lsns: list[int], ts: list[int], xids: list[int]) -> list[Change]:
    out = []
    for message, lsn, micros, xid in zip(messages, lsns, ts, xids, strict=True):
        when = EPOCH + timedelta(microseconds=micros)
        if message == TRUNCATE_PAYLOAD:
            out.append(Change(TRUNCATE, lsn, when, xid, {}))
            continue
        for _, op, data, unchanged in row_changes(INFO, pgoutput.decode(message)):
            out.append(Change(op, lsn, when, xid, data, unchanged))
    return out


# Both decoders on every input (the flusher takes whichever is cheaper for a file, see bulk_is_cheaper).
PATHS = pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "row-by-row"])


@PATHS
@pytest.mark.parametrize("seed", range(8))
def test_bulk_decoding_equals_row_by_row(seed: int, bulk: bool) -> None:
    """Random mixes of every row message kind, NULLs, unchanged TOAST values, escapes and truncates."""
    rng = random.Random(seed)
    messages = [TRUNCATE_PAYLOAD if rng.random() < 0.03 else _message(rng) for _ in range(rng.choice([1, 7, 400]))]
    lsns = sorted(rng.randrange(1, 2**40) for _ in messages)
    ts = [1_700_000_000_000_000 + i for i in range(len(messages))]
    xids = [rng.randrange(2**32) for _ in messages]
    encoded = encode_segment(INFO, lsns, messages, ts, xids, bulk)
    relation, staged = codec.decode(encoded.data)
    assert relation == INFO.relation
    assert staged == _expected(messages, lsns, ts, xids)
    assert encoded.rows == len(staged)
    assert (encoded.first_lsn, encoded.last_lsn) == (lsns[0], lsns[-1])


@PATHS
def test_a_truncate_among_a_few_rows_keeps_its_place(bulk: bool) -> None:
    """A TRUNCATE marker between rows of a small file is staged where it happened, by either path."""
    insert = [b"I" + struct.pack("!I", 1) + b"N" + tuple_data(str(i), "a", None, "b") for i in range(3)]
    messages = [insert[0], TRUNCATE_PAYLOAD, insert[1], insert[2]]
    lsns, ts, xids = [10, 20, 30, 40], [0, 1, 2, 3], [5, 6, 7, 7]
    _, staged = codec.decode(encode_segment(INFO, lsns, messages, ts, xids, bulk).data)
    assert [change.op for change in staged] == [codec.INSERT, TRUNCATE, codec.INSERT, codec.INSERT]
    assert staged == _expected(messages, lsns, ts, xids)


def test_only_simple_rows_take_the_bulk_path_and_keep_json_valid() -> None:
    """Inserts of awkward text: the ``_data`` of the bulk path is valid JSON with the exact strings."""
    messages = [
        b"I" + struct.pack("!I", 1) + b"N" + tuple_data(str(i), text, None, text) for i, text in enumerate(TEXTS)
    ]
    count = len(TEXTS)
    encoded = encode_segment(INFO, list(range(1, count + 1)), messages, [0] * count, [1] * count, bulk=True)
    _, staged = codec.decode(encoded.data)
    assert [c.data for c in staged] == [
        {"id": str(i), "name": text, 'we"ird,col': None, "big": text} for i, text in enumerate(TEXTS)
    ]
    assert all(json.loads(json.dumps(c.data)) == c.data for c in staged)


@pytest.mark.parametrize(
    ("message", "error", "match"),
    [
        # Not a DecodeError (yet): row_changes' strict zip of column names and values refuses it.
        pytest.param(
            b"I" + struct.pack("!I", 1) + b"N" + tuple_data("1", "a"),
            ValueError,
            r"^zip\(\) argument 2 is shorter than argument 1$",
            id="wrong-column-count",
        ),
        pytest.param(
            b"I" + struct.pack("!I", 1) + b"N" + struct.pack("!h", 4) + b"t" + struct.pack("!i", 9) + b"1",
            DecodeError,
            r"^message truncated$",
            id="truncated",
        ),
        pytest.param(
            b"I" + struct.pack("!I", 1) + b"N" + struct.pack("!h", 4) + b"b",
            DecodeError,
            r"^unsupported tuple value kind 'b' \(binary mode is not used\)$",
            id="binary",
        ),
    ],
)
@PATHS
def test_malformed_messages_raise(message: bytes, error: type[Exception], match: str, bulk: bool) -> None:
    """What the row-by-row decoder refuses, the bulk path refuses too (nothing is staged)."""
    with pytest.raises(error, match=match):
        encode_segment(INFO, [1], [message], [0], [1], bulk)


@PATHS
def test_invalid_utf8_is_refused(bulk: bool) -> None:
    """Text values must be UTF-8, as the row-by-row decoder requires."""
    message = b"I" + struct.pack("!I", 1) + b"N" + tuple_data("1", "a", None, "b").replace(b"b", b"\xff")
    # Arrow's check in bulk ("Invalid UTF8 payload"), or the codec's row by row ("'utf-8' codec can't decode").
    with pytest.raises(ValueError, match=r"(?i)utf-?8"):
        encode_segment(INFO, [1], [message], [0], [1], bulk)


def _insert(oid: int, key: int, text: str) -> bytes:
    return b"I" + struct.pack("!I", oid) + b"N" + tuple_data(str(key), text, None, None)


def test_writer_spills_splits_and_keeps_each_tables_order(tmp_path: object) -> None:
    """A transaction past txn_memory_bytes spills; files stay under max_rows, in log order per table;
    a Relation message mid-transaction starts files of the new shape; unconfigured tables are dropped;
    a discarded transaction leaves nothing."""
    wide = (*COLUMNS, SourceColumn("extra", TEXT, False))
    wide_info = RelationInfo(TABLE, StagedRelation("public.t", wide), {c.name: i for i, c in enumerate(wide)})
    store = ObjectStore(StagingConfig(url=f"file://{tmp_path}/staging"))
    relations = RelationLog()
    flush = FlushConfig(max_rows=7, txn_memory_bytes=1024, spill_dir=str(tmp_path))
    writer = StagedWriter(store, flush, relations, {"public.t": table_location("public.t")})  # type: ignore[arg-type]
    relations.describe(1, writer.next_seq, INFO)
    relations.describe(2, writer.next_seq, None)  # published, not configured
    lsn = iter(range(100, 10_000))
    expected: list[tuple[int, str]] = []
    for key in range(3):
        writer.add(xlog_data(next(lsn), _insert(2, key, "ignored")))
        at = next(lsn)
        writer.add(xlog_data(at, _insert(1, key, "small")))
        expected.append((at, "small"))
    writer.commit(1_000, 1)
    writer.add(xlog_data(next(lsn), _insert(1, 99, "discarded")))
    writer.discard()
    for key in range(40):
        if key == 20:
            relations.describe(1, writer.next_seq, wide_info)
        at = next(lsn)
        values = (str(key), "x" * 100, None, None) + ((None,) if key >= 20 else ())
        writer.add(xlog_data(at, b"I" + struct.pack("!I", 1) + b"N" + tuple_data(*values)))
        expected.append((at, "x" * 100))
    writer.commit(2_000, 2)
    files = writer.finish()
    assert all(f.row_count <= 7 for f in files)
    staged = [(f, *codec.decode(store.get(f.path))) for f in files]
    assert [(c.lsn, c.data["name"]) for _, _, changes in staged for c in changes] == expected
    assert [len(relation.columns) for _, relation, _ in staged] == [4, 4, 4, 4, 5, 5, 5, 5]
    assert {c.xid for _, _, changes in staged for c in changes} == {1, 2}
    assert all(f.first_lsn == changes[0].lsn and f.flushable_lsn == changes[-1].lsn for f, _, changes in staged)


def test_staged_files_record_each_transactions_commit_lsn(tmp_path: object) -> None:
    """Each staged file names every transaction of its rows once, in the order they came, with its
    commit LSN, written as json.dumps writes that object; transactions with no row of the table are
    not named, and a window of many small transactions stages them all."""
    other = SourceTable("public.u", "public", "u", 2, COLUMNS, ("id",), "d")
    other_info = RelationInfo(other, StagedRelation("public.u", COLUMNS), {c.name: i for i, c in enumerate(COLUMNS)})
    store = ObjectStore(StagingConfig(url=f"file://{tmp_path}/staging"))
    relations = RelationLog()
    locations = {"public.t": table_location("public.t"), "public.u": table_location("public.u")}
    writer = StagedWriter(store, FlushConfig(), relations, locations)
    relations.describe(1, writer.next_seq, INFO)
    relations.describe(2, writer.next_seq, other_info)
    lsn = iter(range(100, 100_000))
    expected: dict[int, dict[str, int]] = {1: {}, 2: {}}
    for xid in range(5_000_000_000, 5_000_000_300):
        oids = [1, 2] if xid % 3 == 0 else [2] if xid % 3 == 1 else [1, 1]
        for oid in oids:
            writer.add(xlog_data(next(lsn), _insert(oid, next(lsn), "v")))
            expected[oid][str(xid)] = 7_000 + xid
        writer.commit(1_000 + xid, xid, 7_000 + xid)
    writer.commit(9_999, 1, 9_999)  # no rows: named nowhere
    files = writer.finish()
    assert len(files) == 2
    for staged in files:
        metadata = pq.ParquetFile(io.BytesIO(store.get(staged.path))).metadata.metadata
        oid = 1 if staged.table_name == "public.t" else 2
        assert metadata[codec.COMMIT_LSNS_METADATA_KEY] == json.dumps(expected[oid]).encode()


def test_read_batch_returns_every_message_whole_and_in_order(source: SourceDb) -> None:
    """Batches of the stream, read a few at a time, hold every WAL data message whole, in log order:
    each insert decodes to its row, the rows in the order they were written."""
    source.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    source.execute("CREATE PUBLICATION p FOR TABLE public.t")
    slot = f"batches_{source.name}"
    source.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    for start in range(1, 3001, 100):
        source.execute(
            "INSERT INTO public.t SELECT g, repeat(g::text, g %% 7) FROM generate_series(%s::int, %s::int) g",
            (start, start + 99),
        )
    messages: list[bytes] = []
    config = source.config(["public.t"])
    with ReplicationStream(config.source, slot, "p", 0) as stream:
        while len(messages) < 3000 + 2 * 30:
            batch = stream.read_batch(5.0, limit=50)
            assert batch, "the stream went quiet before every change arrived"
            messages += batch
    inserts = [pgoutput.decode(m[XLOG_HEADER:]) for m in messages if m[XLOG_HEADER] == ord("I")]
    assert [tuple(i.new) for i in inserts if isinstance(i, pgoutput.Insert)] == [
        (str(g), str(g) * (g % 7)) for g in range(1, 3001)
    ]
    starts = [xlog_data_start(m) for m in messages if m[XLOG_HEADER] == ord("I")]
    assert starts == sorted(starts)
