"""Files a run produced."""

from __future__ import annotations

from django.db import models

from runs.models.run import Run


class Artifact(models.Model):
    """A file a run produced. Expires ``ORCHESTRATOR_ARTIFACT_TTL_DAYS`` after the run completes."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="artifacts")
    name = models.CharField(max_length=255)
    storage_key = models.CharField(max_length=512, unique=True)
    size_bytes = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "name"]
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="artifact_unique_name_per_run")]

    def __str__(self) -> str:
        return f"{self.name} of run {self.run_id}"
