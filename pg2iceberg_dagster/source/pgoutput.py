"""Decoder for the pgoutput logical replication protocol (version 1, text tuple data).

Message layouts follow the PostgreSQL documentation, "Logical Replication Message Formats".
Tuple values decode to ``None`` (SQL NULL), :data:`UNCHANGED` (an unchanged TOASTed value the
server did not send) or the value's text representation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

PG_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)


class _Unchanged:
    """Marker for an unchanged TOASTed column ('u' in TupleData)."""

    _instance: _Unchanged | None = None

    def __new__(cls) -> _Unchanged:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()
TupleValue = str | None | _Unchanged
Tuple = tuple[TupleValue, ...]


def pg_timestamp(micros: int) -> datetime:
    """Microseconds since 2000-01-01 UTC -> aware datetime."""
    return PG_EPOCH + timedelta(microseconds=micros)


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_ts: datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: datetime


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class RelationColumn:
    is_key: bool
    name: str
    type_oid: int
    type_mod: int


@dataclass(frozen=True, slots=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[RelationColumn, ...]

    @property
    def key(self) -> str:
        """``schema.table`` as used in the configuration."""
        return f"{self.namespace}.{self.name}"


@dataclass(frozen=True, slots=True)
class TypeInfo:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    relation_oid: int
    new: Tuple


@dataclass(frozen=True, slots=True)
class Update:
    relation_oid: int
    old_kind: str | None  # 'K' key columns only, 'O' whole old row, None when not sent
    old: Tuple | None
    new: Tuple


@dataclass(frozen=True, slots=True)
class Delete:
    relation_oid: int
    old_kind: str
    old: Tuple


@dataclass(frozen=True, slots=True)
class Truncate:
    options: int
    relation_oids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = Begin | Commit | Origin | Relation | TypeInfo | Insert | Update | Delete | Truncate | LogicalMessage


class DecodeError(ValueError):
    """The bytes are not a pgoutput message this decoder understands."""


_U8 = struct.Struct("!B")
_I16 = struct.Struct("!h")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_U64 = struct.Struct("!Q")
# Fixed parts of the two messages every transaction carries, read without building message objects
# on the flusher's hot path: Begin (final LSN, commit time, xid) and Commit (flags, commit LSN, end LSN, time).
BEGIN_FIELDS: Final = struct.Struct("!QqI")
COMMIT_FIELDS: Final = struct.Struct("!BQQq")
RELATION_OID: Final = _U32  # what Insert, Update and Delete carry right after their tag
# Microseconds from 1970-01-01 to 2000-01-01 (PostgreSQL's epoch), to store commit times as Unix time.
UNIX_TO_PG_EPOCH_MICROS: Final = 946_684_800_000_000


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, fmt: struct.Struct) -> int:
        try:
            (value,) = fmt.unpack_from(self.data, self.pos)
        except struct.error:
            raise DecodeError("message truncated") from None
        self.pos += fmt.size
        return value

    def u8(self) -> int:
        return self._take(_U8)

    def i16(self) -> int:
        return self._take(_I16)

    def i32(self) -> int:
        return self._take(_I32)

    def u32(self) -> int:
        return self._take(_U32)

    def i64(self) -> int:
        return self._take(_I64)

    def u64(self) -> int:
        return self._take(_U64)

    def byte_char(self) -> str:
        return chr(self.u8())

    def cstring(self) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise DecodeError("message truncated: a string field has no NUL terminator")
        try:
            value = self.data[self.pos : end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError(f"a string field is not valid utf-8: {exc.reason}") from None
        self.pos = end + 1
        return value

    def raw(self, length: int) -> bytes:
        value = self.data[self.pos : self.pos + length]
        if len(value) != length:
            raise DecodeError("message truncated")
        self.pos += length
        return bytes(value)

    def tuple_data(self) -> Tuple:
        # The hot loop of row-by-row decoding: locals instead of attribute lookups and method calls.
        data, pos = self.data, self.pos
        try:
            (count,) = _I16.unpack_from(data, pos)
            pos += 2
            values: list[TupleValue] = []
            append = values.append
            for _ in range(count):
                kind = data[pos]
                if kind == 116:  # 't': Int32 length, then the text
                    (length,) = _I32.unpack_from(data, pos + 1)
                    end = pos + 5 + length
                    if end > len(data):
                        raise DecodeError("message truncated")
                    append(data[pos + 5 : end].decode("utf-8"))
                    pos = end
                elif kind == 110:  # 'n'
                    append(None)
                    pos += 1
                elif kind == 117:  # 'u'
                    append(UNCHANGED)
                    pos += 1
                else:
                    raise DecodeError(f"unsupported tuple value kind {chr(kind)!r} (binary mode is not used)")
        except (struct.error, IndexError):
            raise DecodeError("message truncated") from None
        self.pos = pos
        return tuple(values)


def begin_fields(data: bytes | memoryview, offset: int = 0) -> tuple[int, int, int]:
    """(final LSN, commit time in microseconds since the Unix epoch, xid) of the Begin message at
    ``offset`` of ``data``, without building a :class:`Begin` (the flusher reads one per transaction)."""
    try:
        final_lsn, micros, xid = BEGIN_FIELDS.unpack_from(data, offset + 1)
    except struct.error:
        raise DecodeError("message truncated") from None
    return final_lsn, micros + UNIX_TO_PG_EPOCH_MICROS, xid


def commit_end_lsn(data: bytes | memoryview, offset: int = 0) -> int:
    """The end LSN of the Commit message at ``offset`` of ``data``: what a consumer acknowledges once the
    transaction is safe."""
    try:
        return COMMIT_FIELDS.unpack_from(data, offset + 1)[2]
    except struct.error:
        raise DecodeError("message truncated") from None


def decode(data: bytes) -> Message:
    """Decode one pgoutput message (the payload of an XLogData 'w' message)."""
    reader = _Reader(data)
    tag = reader.byte_char()
    if tag == "B":
        return Begin(final_lsn=reader.u64(), commit_ts=pg_timestamp(reader.i64()), xid=reader.u32())
    if tag == "C":
        return Commit(
            flags=reader.u8(),
            commit_lsn=reader.u64(),
            end_lsn=reader.u64(),
            commit_ts=pg_timestamp(reader.i64()),
        )
    if tag == "I":
        oid = reader.u32()
        if reader.byte_char() != "N":
            raise DecodeError("Insert without a new tuple")
        return Insert(relation_oid=oid, new=reader.tuple_data())
    if tag == "U":
        oid = reader.u32()
        kind = reader.byte_char()
        old_kind, old = None, None
        if kind in ("K", "O"):
            old_kind, old = kind, reader.tuple_data()
            kind = reader.byte_char()
        if kind != "N":
            raise DecodeError("Update without a new tuple")
        return Update(relation_oid=oid, old_kind=old_kind, old=old, new=reader.tuple_data())
    if tag == "D":
        oid = reader.u32()
        kind = reader.byte_char()
        if kind not in ("K", "O"):
            raise DecodeError("Delete without an old tuple")
        return Delete(relation_oid=oid, old_kind=kind, old=reader.tuple_data())
    if tag == "R":
        oid = reader.u32()
        namespace = reader.cstring() or "pg_catalog"
        name = reader.cstring()
        identity = reader.byte_char()
        columns = tuple(
            RelationColumn(
                is_key=bool(reader.u8() & 1),
                name=reader.cstring(),
                type_oid=reader.u32(),
                type_mod=reader.i32(),
            )
            for _ in range(reader.i16())
        )
        return Relation(oid=oid, namespace=namespace, name=name, replica_identity=identity, columns=columns)
    if tag == "T":
        count = reader.i32()
        options = reader.u8()
        return Truncate(options=options, relation_oids=tuple(reader.u32() for _ in range(count)))
    if tag == "Y":
        return TypeInfo(oid=reader.u32(), namespace=reader.cstring(), name=reader.cstring())
    if tag == "O":
        return Origin(lsn=reader.u64(), name=reader.cstring())
    if tag == "M":
        transactional = bool(reader.u8())
        lsn = reader.u64()
        prefix = reader.cstring()
        return LogicalMessage(transactional=transactional, lsn=lsn, prefix=prefix, content=reader.raw(reader.i32()))
    raise DecodeError(f"unknown pgoutput message type {tag!r}")
