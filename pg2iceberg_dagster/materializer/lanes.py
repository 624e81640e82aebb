"""Work on several items at once, each worker thread on a lane of its own (its own connections).

Merging many small tables is mostly waiting for Spark's per-statement overhead (planning, job
scheduling, the Iceberg commit), which other merges can fill: four tables at a time on one
``local[2]`` session took about half the time per table of one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

from ..config import PipelineConfig
from ..coordination.store import CoordinationStore
from ..source.connection import KeptConnection
from ..threads import per_thread

Item = TypeVar("Item")
Lane = TypeVar("Lane")
Result = TypeVar("Result")


@dataclass
class LaneConnections:
    """The connections of one lane: its own to the state database, and one kept to the source."""

    store: CoordinationStore
    source: KeptConnection

    @classmethod
    def open(cls, config: PipelineConfig) -> LaneConnections:
        return cls(CoordinationStore(config.state_connection), KeptConnection(config.source))

    def close(self) -> None:
        self.source.close()
        self.store.close()


def on_lanes(
    items: list[Item],
    count: int,
    open_lane: Callable[[], Lane],
    close_lane: Callable[[Lane], None],
    work: Callable[[Lane, Item], Result],
) -> Iterator[tuple[Item, Result | Exception]]:
    """``work(lane, item)`` for every item, at most ``count`` at once, in ``items``' order of start;
    yields each item with its result, or the exception it raised, as it completes. Returns only once
    every started item has ended and every lane is closed (also when the caller stops early: items not
    started yet are then dropped)."""
    with per_thread(open_lane, close_lane) as lanes, ThreadPoolExecutor(count, thread_name_prefix="lane") as pool:
        pending: dict[Future[Result], Item] = {pool.submit(_on_lane, lanes, work, item): item for item in items}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in [f for f in pending if f in done]:
                    item = pending.pop(future)
                    error = future.exception()
                    if error is not None and not isinstance(error, Exception):
                        raise error  # KeyboardInterrupt, SystemExit: not a table's failure
                    yield item, (error if error is not None else future.result())
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True)


def _on_lane(lanes: Callable[[], Lane], work: Callable[[Lane, Item], Result], item: Item) -> Result:
    return work(lanes(), item)
