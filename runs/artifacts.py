"""Artifacts of runs: their storage, reading (which extends the expiry) and expiry.

A read pushes the artifact's expiry forward under its row lock before it opens the file (seed 001
§8.4), and the retention prune expires under the same lock, so the prune never deletes a file
under a reader; an artifact already deleted is ``ArtifactGone`` (``410 artifact_expired``).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.files.storage import storages
from django.db import transaction
from django.utils import timezone

from core.errors import NotFound
from runs.errors import ArtifactGone
from runs.models import Artifact

ARTIFACT_STORAGE = "artifacts"


def artifact_storage():
    return storages[ARTIFACT_STORAGE]


def artifact_open(*, artifact_id: int, now=None):
    """Open an artifact's file for reading, first pushing its expiry to at least
    ``ORCHESTRATOR_ARTIFACT_ACCESS_EXTENSION_S`` from now (seed 001 §8.4).

    The expiry is moved under the artifact's row lock, which the prune takes too before it
    deletes: a read either extends the expiry before the prune looks (and the file stays) or
    finds the artifact already deleted (``ArtifactGone``). Returns ``(artifact, file)``.
    """
    now = now or timezone.now()
    with transaction.atomic():
        artifact = Artifact.objects.select_for_update().filter(pk=artifact_id).first()
        if artifact is None:
            raise NotFound(f"artifact {artifact_id} does not exist")
        if artifact.deleted_at is not None:
            raise ArtifactGone(f"artifact {artifact_id} expired and was deleted at {artifact.deleted_at.isoformat()}",
                               deleted_at=artifact.deleted_at.isoformat())
        floor = now + timedelta(seconds=settings.ORCHESTRATOR_ARTIFACT_ACCESS_EXTENSION_S)
        if artifact.expires_at is not None and artifact.expires_at < floor:
            artifact.expires_at = floor
            artifact.save(update_fields=["expires_at"])
    try:
        handle = artifact_storage().open(artifact.storage_key, "rb")
    except (FileNotFoundError, OSError) as exc:
        raise NotFound(f"the file of artifact {artifact_id} is missing from storage") from exc
    return artifact, handle


def artifact_expire(*, artifact_id: int, now=None) -> bool:
    """Delete an expired artifact's file and mark it deleted; False when it is not (or no
    longer) expired, e.g. because a read extended it meanwhile."""
    now = now or timezone.now()
    with transaction.atomic():
        artifact = (Artifact.objects.select_for_update()
                    .filter(pk=artifact_id, deleted_at__isnull=True, expires_at__lte=now).first())
        if artifact is None:
            return False
        # File first: if the delete fails the row stays as it was and the next prune retries;
        # a file already gone is not an error.
        artifact_storage().delete(artifact.storage_key)
        artifact.deleted_at = now
        artifact.save(update_fields=["deleted_at"])
        return True
