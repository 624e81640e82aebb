"""Unit tests for the pgoutput decoder: messages built byte by byte per "Logical Replication Message Formats"."""

from __future__ import annotations

import struct
from datetime import UTC, datetime

import pytest

from pg2iceberg_dagster.source import pgoutput
from pg2iceberg_dagster.source.pgoutput import (
    UNCHANGED,
    Begin,
    Commit,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    Relation,
    RelationColumn,
    Truncate,
    TypeInfo,
    Update,
    decode,
)

# 2000 is a leap year: 366 days from the PostgreSQL epoch to 2001-01-01.
MICROS_TO_2001 = 366 * 86_400 * 1_000_000


def cstr(text: str) -> bytes:
    """A NUL-terminated UTF-8 String field."""
    return text.encode("utf-8") + b"\0"


def tuple_data(*values: object) -> bytes:
    """TupleData: None -> 'n', UNCHANGED -> 'u', str -> 't' with an Int32 length and UTF-8 bytes."""
    out = struct.pack("!h", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif value is UNCHANGED:
            out += b"u"
        else:
            assert isinstance(value, str)
            encoded = value.encode("utf-8")
            out += b"t" + struct.pack("!i", len(encoded)) + encoded
    return out


def relation_message(oid: int, namespace: str, name: str, identity: bytes, columns: list[tuple]) -> bytes:
    """A Relation ('R') message; columns are (flags, name, type oid, typmod)."""
    out = b"R" + struct.pack("!I", oid) + cstr(namespace) + cstr(name) + identity + struct.pack("!h", len(columns))
    for flags, column, type_oid, type_mod in columns:
        out += struct.pack("!B", flags) + cstr(column) + struct.pack("!Ii", type_oid, type_mod)
    return out


def test_begin() -> None:
    """Begin carries the final LSN, the commit timestamp and an unsigned 32-bit xid."""
    data = b"B" + struct.pack("!QqI", 0x1_6B37_48A0, MICROS_TO_2001 + 500, 0xFFFF_FFF0)
    assert decode(data) == Begin(
        final_lsn=0x1_6B37_48A0, commit_ts=datetime(2001, 1, 1, 0, 0, 0, 500, tzinfo=UTC), xid=4294967280
    )


def test_commit() -> None:
    """Commit carries flags, commit LSN, end LSN and the commit timestamp."""
    data = b"C" + struct.pack("!BQQq", 0, 0xABCD_0000_0010, 0xABCD_0000_0040, 1_000_001)
    message = decode(data)
    assert message == Commit(
        flags=0,
        commit_lsn=0xABCD_0000_0010,
        end_lsn=0xABCD_0000_0040,
        commit_ts=datetime(2000, 1, 1, 0, 0, 1, 1, tzinfo=UTC),
    )


def test_timestamp_before_epoch() -> None:
    """Negative microseconds are before 2000-01-01 UTC."""
    assert pgoutput.pg_timestamp(-1_000_000) == datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert pgoutput.pg_timestamp(0) == datetime(2000, 1, 1, tzinfo=UTC)
    assert pgoutput.pg_timestamp(0).utcoffset() is not None


def test_relation() -> None:
    """Relation columns keep the key flag, type oid and typmod (numeric(10,2), varchar(20), -1)."""
    data = relation_message(
        16385,
        "shop",
        "orders",
        b"d",
        [
            (1, "id", 23, -1),
            (0, "amount", 1700, (10 << 16 | 2) + 4),
            (0, "note", 1043, 24),
            (0, "prénom", 25, -1),
        ],
    )
    message = decode(data)
    assert isinstance(message, Relation)
    assert (message.oid, message.namespace, message.name, message.replica_identity) == (16385, "shop", "orders", "d")
    assert message.key == "shop.orders"
    assert message.columns == (
        RelationColumn(is_key=True, name="id", type_oid=23, type_mod=-1),
        RelationColumn(is_key=False, name="amount", type_oid=1700, type_mod=655366),
        RelationColumn(is_key=False, name="note", type_oid=1043, type_mod=24),
        RelationColumn(is_key=False, name="prénom", type_oid=25, type_mod=-1),
    )


def test_relation_empty_namespace_is_pg_catalog() -> None:
    """An empty namespace means pg_catalog; a large oid stays unsigned."""
    message = decode(relation_message(0xFFFF_FF00, "", "t", b"f", [(1, "a", 20, -1), (1, "b", 20, -1)]))
    assert isinstance(message, Relation)
    assert message.namespace == "pg_catalog"
    assert message.key == "pg_catalog.t"
    assert message.oid == 4294967040
    assert message.replica_identity == "f"
    assert [c.is_key for c in message.columns] == [True, True]


def test_relation_without_columns() -> None:
    """A relation with zero columns decodes to an empty column tuple."""
    message = decode(relation_message(7, "public", "empty", b"n", []))
    assert isinstance(message, Relation)
    assert message.columns == ()
    assert message.replica_identity == "n"


def test_type() -> None:
    """Type carries oid, namespace and name."""
    data = b"Y" + struct.pack("!I", 90210) + cstr("public") + cstr("mood")
    assert decode(data) == TypeInfo(oid=90210, namespace="public", name="mood")


def test_insert_with_null_unchanged_and_text() -> None:
    """Insert decodes 'n' to None, 'u' to UNCHANGED and 't' to the UTF-8 text, empty text included."""
    data = b"I" + struct.pack("!I", 16385) + b"N" + tuple_data("42", None, UNCHANGED, "héllo wörld ✓ 日本", "")
    message = decode(data)
    assert message == Insert(relation_oid=16385, new=("42", None, UNCHANGED, "héllo wörld ✓ 日本", ""))
    assert isinstance(message, Insert)
    assert message.new[2] is UNCHANGED
    assert message.new[1] is None
    assert message.new[4] == ""


def test_unchanged_marker() -> None:
    """UNCHANGED is a singleton distinct from None and from any text."""
    assert pgoutput._Unchanged() is UNCHANGED
    assert repr(UNCHANGED) == "UNCHANGED"
    assert UNCHANGED is not None
    assert UNCHANGED != "u"


def test_update_without_old_tuple() -> None:
    """Update with only 'N' has no old tuple."""
    data = b"U" + struct.pack("!I", 5) + b"N" + tuple_data("1", UNCHANGED, "x")
    assert decode(data) == Update(relation_oid=5, old_kind=None, old=None, new=("1", UNCHANGED, "x"))


def test_update_with_key_tuple() -> None:
    """Update with 'K' carries the old key columns (others null) before the new tuple."""
    data = b"U" + struct.pack("!I", 5) + b"K" + tuple_data("1", None, None) + b"N" + tuple_data("2", "b", UNCHANGED)
    assert decode(data) == Update(relation_oid=5, old_kind="K", old=("1", None, None), new=("2", "b", UNCHANGED))


def test_update_with_old_tuple() -> None:
    """Update with 'O' carries the whole old row."""
    data = b"U" + struct.pack("!I", 5) + b"O" + tuple_data("1", "a", "ä") + b"N" + tuple_data("1", "b", UNCHANGED)
    message = decode(data)
    assert isinstance(message, Update)
    assert message.old_kind == "O"
    assert message.old == ("1", "a", "ä")
    assert message.new == ("1", "b", UNCHANGED)


@pytest.mark.parametrize("kind", ["K", "O"])
def test_delete(kind: str) -> None:
    """Delete carries the old tuple of kind 'K' or 'O'."""
    data = b"D" + struct.pack("!I", 77) + kind.encode() + tuple_data("9", None, "zß")
    assert decode(data) == Delete(relation_oid=77, old_kind=kind, old=("9", None, "zß"))


def test_truncate() -> None:
    """Truncate lists the relation oids and the option bits (CASCADE=1, RESTART IDENTITY=2)."""
    data = b"T" + struct.pack("!iB", 3, 3) + struct.pack("!III", 16385, 16390, 0xFFFF_FFFE)
    assert decode(data) == Truncate(options=3, relation_oids=(16385, 16390, 4294967294))


def test_origin() -> None:
    """Origin carries the origin's commit LSN and name."""
    data = b"O" + struct.pack("!Q", 0x10_0000_0000) + cstr("node_ü")
    assert decode(data) == Origin(lsn=0x10_0000_0000, name="node_ü")


@pytest.mark.parametrize("flags", [0, 1])
def test_logical_message(flags: int) -> None:
    """Message carries the transactional flag, LSN, prefix and raw content (not necessarily UTF-8)."""
    content = b"\x00\xffpayload\x80"
    data = b"M" + struct.pack("!BQ", flags, 123456789) + cstr("my.prefix") + struct.pack("!i", len(content)) + content
    assert decode(data) == LogicalMessage(transactional=bool(flags), lsn=123456789, prefix="my.prefix", content=content)


def test_decode_error_is_value_error() -> None:
    """What decode refuses raises DecodeError, which a caller handling ValueError catches too."""
    with pytest.raises(ValueError) as info:
        decode(b"Z\x00\x00\x00\x01")
    assert type(info.value) is DecodeError
    assert str(info.value) == "unknown pgoutput message type 'Z'"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        pytest.param(b"Z\x00\x00\x00\x01", "unknown pgoutput message type", id="unknown-type"),
        pytest.param(b"S" + b"\x00" * 16, "unknown pgoutput message type", id="stream-start-v2"),
        pytest.param(
            b"I" + struct.pack("!I", 1) + b"N" + struct.pack("!h", 1) + b"b" + struct.pack("!i", 4) + b"\x00" * 4,
            "binary",
            id="binary-tuple-value",
        ),
        pytest.param(b"I" + struct.pack("!I", 1) + b"K" + tuple_data("1"), "new tuple", id="insert-without-N"),
        pytest.param(b"U" + struct.pack("!I", 1) + b"X" + tuple_data("1"), "new tuple", id="update-bad-kind"),
        pytest.param(b"D" + struct.pack("!I", 1) + b"N" + tuple_data("1"), "old tuple", id="delete-with-N"),
        pytest.param(
            b"I" + struct.pack("!I", 1) + b"N" + struct.pack("!h", 1) + b"t" + struct.pack("!i", 10) + b"abc",
            "truncated",
            id="text-value-truncated",
        ),
        pytest.param(
            b"M\x01" + struct.pack("!Q", 1) + cstr("p") + struct.pack("!i", 100) + b"short",
            "truncated",
            id="message-content-truncated",
        ),
    ],
)
def test_decode_errors(data: bytes, match: str) -> None:
    """Malformed or unsupported input raises DecodeError with a telling message."""
    with pytest.raises(DecodeError, match=match):
        decode(data)


def test_unterminated_string_raises_decode_error() -> None:
    """A String field without its NUL terminator raises DecodeError, like every other malformed message."""
    with pytest.raises(DecodeError, match="no NUL terminator"):
        decode(b"O" + struct.pack("!Q", 1) + b"no-terminator")


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"B" + struct.pack("!Q", 1), id="begin-truncated"),
        pytest.param(b"C\x00" + struct.pack("!QQ", 1, 2), id="commit-truncated"),
        pytest.param(b"I\x00\x00", id="insert-oid-truncated"),
        pytest.param(b"T" + struct.pack("!iB", 2, 0) + struct.pack("!I", 1), id="truncate-oids-truncated"),
        pytest.param(b"I" + struct.pack("!I", 1) + b"N" + struct.pack("!h", 2) + b"n", id="tuple-columns-truncated"),
    ],
)
def test_truncated_fixed_width_field_raises_decode_error(data: bytes) -> None:
    """A message cut short inside an integer field raises DecodeError (a ValueError)."""
    with pytest.raises(DecodeError, match=r"^message truncated$"):
        decode(data)
