"""Day-2 upkeep of the mirror's Iceberg tables and staged log: compaction, snapshot expiry, orphan
files, applied staged files. ``Maintainer`` runs a pass; ``health`` measures what it looks at."""

from .health import TableHealth, compaction_due, measured_health, summary_health
from .maintainer import Maintainer, MaintenanceResult

__all__ = ["Maintainer", "MaintenanceResult", "TableHealth", "compaction_due", "measured_health", "summary_health"]
