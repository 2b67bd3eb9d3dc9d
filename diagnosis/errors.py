"""The diagnosis app's domain errors."""

from __future__ import annotations

from jobs.errors import QueueFull


class ExplainBacklogFull(QueueFull):
    """Explanations are best effort: they may take a quarter of a project's queue, never the run's share."""
