"""In ``run``, a flush being written goes ahead of the next table's merge (flusher.priority), but a
long flush holds merges back no longer than its bound."""

from __future__ import annotations

import threading

from pg2iceberg_dagster.flusher.priority import FlushFirst


def _merge_starts(gate: FlushFirst, events: list[str]) -> threading.Thread:
    """A merge lane about to start a table: it waits on ``gate``, then records its start."""

    def lane() -> None:
        gate.wait()
        events.append("merge started")

    thread = threading.Thread(target=lane)
    thread.start()
    return thread


def test_a_merge_waits_for_the_flush_being_written() -> None:
    gate = FlushFirst(max_wait=60)
    events: list[str] = []
    _merge_starts(gate, events).join()
    assert events == ["merge started"], "no flush: the merge starts at once"
    events.clear()
    with gate.flushing():
        lane = _merge_starts(gate, events)
        lane.join(0.5)
        assert lane.is_alive(), "the merge waits while the flush is written"
        events.append("flush written")
    lane.join()
    assert events == ["flush written", "merge started"]


def test_a_long_flush_holds_merges_back_no_longer_than_its_bound() -> None:
    gate = FlushFirst(max_wait=0.2)
    events: list[str] = []
    with gate.flushing():
        _merge_starts(gate, events).join(30)
        events.append("flush written")
        _merge_starts(gate, events).join(30)  # the flush began over max_wait ago: no wait at all
    assert events == ["merge started", "flush written", "merge started"]
