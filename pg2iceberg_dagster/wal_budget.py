"""How long the replication slot can go on before it loses WAL, at the current rate.

``safe_wal_size`` (``pg_replication_slots``, PostgreSQL 13+, when ``max_slot_wal_keep_size`` is set) is
how much more WAL the server can write before the slot is in danger: the next checkpoint after that
removes WAL the slot needs (``wal_status`` unreserved, then lost). It shrinks byte for byte with the
WAL the server writes and grows back as the slot's ``restart_lsn`` moves (the flusher acknowledges).
Two readings of the slot give the rate it shrinks at, and ``seconds_until_lost`` =
``safe_wal_size`` / that rate when the rate is positive; the server's WAL position
``pg_current_wal_lsn()`` in both gives the WAL write rate beside it.

The previous reading is kept in the coordination store (``_pg2iceberg.slot_readings``, one row per
slot), not in a caller's memory or a Dagster sensor cursor: the callers are separate evaluations in
separate processes (each flusher sensor tick, the ``slot_safe`` check run on demand, a one-shot CLI
``status``, the metrics scrapes of the code location or of ``run``), and with one stored reading
they all measure the same rates from whichever reading came last. A sensor cursor would serve only the
sensor (and holds the flushed LSN already); memory would not survive a tick or a ``status`` command.

Readings come at uneven intervals (a scrape every 15 s, a tick every 25 s, a ``status`` now and then),
so each new rate is smoothed exponentially over time: the rate measured over ``dt`` seconds weighs
``1 - exp(-dt / RATE_TIME_CONSTANT_SECONDS)``, so two readings a second apart barely move it and
one after a long pause replaces it. "The current rate" is thus about the last five minutes. The first
pair of readings sets the rates outright. Timestamps are the source server's clock (``now()`` of the
reading), so callers on machines whose clocks differ agree."""

from __future__ import annotations

import dataclasses
import math

from .coordination.records import SlotReading
from .coordination.store import CoordinationStore
from .validation import SlotInfo

RATE_TIME_CONSTANT_SECONDS = 300.0


def _smoothed(rate: float | None, sample: float | None, weight: float) -> float | None:
    """``rate`` moved toward ``sample`` by ``weight``; ``sample`` alone when there is no rate yet, None
    when there is no sample (the series starts again)."""
    if sample is None:
        return None
    if rate is None:
        return sample
    return rate + (sample - rate) * weight


def next_reading(previous: SlotReading | None, slot: SlotInfo) -> SlotReading | None:
    """The reading ``slot`` makes after ``previous``, with the rates smoothed up to it; ``previous``
    unchanged when ``slot`` is not newer (a reading that arrived late); None when ``slot`` is not dated
    (no reading to keep)."""
    if slot.read_at is None or slot.wal_lsn is None:
        return previous
    safe = slot.safe_wal_size_bytes
    if previous is None:
        return SlotReading(slot.read_at, slot.wal_lsn, safe)
    elapsed = (slot.read_at - previous.read_at).total_seconds()
    if elapsed <= 0:
        return previous
    if slot.wal_lsn < previous.wal_lsn:  # another server (restored, or failed over): start again
        return SlotReading(slot.read_at, slot.wal_lsn, safe)
    weight = 1.0 - math.exp(-elapsed / RATE_TIME_CONSTANT_SECONDS)
    written = (slot.wal_lsn - previous.wal_lsn) / elapsed
    shrunk = None
    if safe is not None and previous.safe_wal_size is not None:
        shrunk = (previous.safe_wal_size - safe) / elapsed
    return SlotReading(
        slot.read_at,
        slot.wal_lsn,
        safe,
        _smoothed(previous.wal_write_rate, written, weight),
        _smoothed(previous.safe_wal_shrink_rate, shrunk, weight),
    )


def seconds_until_lost(slot: SlotInfo, shrink_rate: float | None) -> float | None:
    """``safe_wal_size`` / ``shrink_rate`` (0 once it is used up); None with ``max_slot_wal_keep_size``
    unlimited, without ``safe_wal_size``, or when it does not shrink."""
    safe = slot.safe_wal_size_bytes
    if slot.max_slot_wal_keep_size_bytes is None or safe is None or shrink_rate is None or shrink_rate <= 0:
        return None
    return max(0, safe) / shrink_rate


def with_budget(slot: SlotInfo, reading: SlotReading | None) -> SlotInfo:
    """``slot`` with the rates of ``reading`` and the time until it loses WAL at them."""
    if reading is None:
        return slot
    return dataclasses.replace(
        slot,
        wal_write_bytes_per_second=reading.wal_write_rate,
        safe_wal_shrink_bytes_per_second=reading.safe_wal_shrink_rate,
        seconds_until_lost=seconds_until_lost(slot, reading.safe_wal_shrink_rate),
    )


def estimate_wal_budget(store: CoordinationStore, slot_name: str, slot: SlotInfo | None) -> SlotInfo | None:
    """``slot`` (read by ``validation.slot_info`` just now) with its WAL budget measured from the
    reading stored before it, which it then replaces. The schema must have ``slot_readings``
    (migration 10)."""
    if slot is None or slot.read_at is None or slot.wal_lsn is None:
        return slot

    def advance(previous: SlotReading | None) -> SlotReading:
        reading = next_reading(previous, slot)
        assert reading is not None  # slot is dated
        return reading

    return with_budget(slot, store.update_slot_reading(slot_name, advance))
