"""Adapter reads: ``deployment_list``, ``deployment_get``, ``order_list``, ``order_get``.

Reads are not commands: nothing is recorded, they go straight to the adapter (seed 000).
"""

from __future__ import annotations

from core.errors import NotFound
from core.models import Project
from jobs.commands.adapters import AdapterNotFound, ExecutionAdapter, adapter_get


def deployment_list(*, project: Project, adapter: ExecutionAdapter | None = None) -> list[dict]:
    return (adapter or adapter_get()).deployment_list(project_id=project.pk)


def deployment_get(*, project: Project, deployment_id: int, adapter: ExecutionAdapter | None = None) -> dict:
    try:
        return (adapter or adapter_get()).deployment_get(project_id=project.pk, deployment_id=deployment_id)
    except AdapterNotFound as exc:
        raise NotFound(str(exc)) from exc


def order_list(*, project: Project, deployment_id: int | None = None,
               adapter: ExecutionAdapter | None = None) -> list[dict]:
    return (adapter or adapter_get()).order_list(project_id=project.pk, deployment_id=deployment_id)


def order_get(*, project: Project, order_id: int, adapter: ExecutionAdapter | None = None) -> dict:
    try:
        return (adapter or adapter_get()).order_get(project_id=project.pk, order_id=order_id)
    except AdapterNotFound as exc:
        raise NotFound(str(exc)) from exc
