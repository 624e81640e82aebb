"""When a snapshot chunk partition should be read: the snapshot assets' automation condition. (The
live tables' merges are launched by the merge sensor, ``sensors/merge.py``, as runs of a named job.)"""

from __future__ import annotations

from dagster import AutomationCondition


def snapshot_condition() -> AutomationCondition:
    """Take each planned chunk once: missing, not running, and not failed (a failed chunk waits for a retry)."""
    return (
        AutomationCondition.missing() & ~AutomationCondition.in_progress() & ~AutomationCondition.execution_failed()
    ).with_label("chunk not taken yet")
