"""The ``ExecutionAdapter`` protocol and the reference ``DatabaseAdapter``.

Provider APIs live behind an adapter only; the command layer never talks to a provider. An
adapter's write operations must be idempotent by the idempotency key they receive: the
command layer calls them again with the same key when a worker died between recording a
command and storing its result.

``ORCHESTRATOR_EXECUTION_ADAPTER`` (a dotted path to a class or factory, read at call time)
chooses the adapter; the default is the ``DatabaseAdapter``, whose deployments and orders
are rows an operator sees in the admin.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Callable, Protocol, runtime_checkable

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from core.timefmt import isoformat_or_none
from jobs.models import AdapterCall, Deployment, Order

DEFAULT_ADAPTER = "jobs.commands.adapters.DatabaseAdapter"


class AdapterError(Exception):
    """A provider refused or failed an operation. ``retryable`` says whether trying again may help."""

    code = "adapter_error"
    retryable = False

    def __init__(self, message: str, *, code: str | None = None, retryable: bool | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable


class AdapterNotFound(AdapterError):
    code = "not_found"


class AdapterRejected(AdapterError):
    code = "rejected"


@runtime_checkable
class ExecutionAdapter(Protocol):
    """What the command layer needs from a provider. Results are JSON-able dicts.

    Writes (``create_deployment``, ``stop_deployment``, ``place_order``, ``cancel_order``) are
    idempotent by ``idempotency_key``; reads raise ``AdapterNotFound`` for an unknown id.
    """

    name: str

    def ping(self) -> bool: ...

    def create_deployment(self, *, project_id: int, idempotency_key: str, name: str, spec: dict) -> dict: ...

    def stop_deployment(self, *, project_id: int, idempotency_key: str, deployment_id: int) -> dict: ...

    def place_order(self, *, project_id: int, idempotency_key: str, symbol: str, side: str, quantity: str,
                    price: str | None, deployment_id: int | None) -> dict: ...

    def cancel_order(self, *, project_id: int, idempotency_key: str, order_id: int) -> dict: ...

    def deployment_list(self, *, project_id: int) -> list[dict]: ...

    def deployment_get(self, *, project_id: int, deployment_id: int) -> dict: ...

    def order_list(self, *, project_id: int, deployment_id: int | None = None) -> list[dict]: ...

    def order_get(self, *, project_id: int, order_id: int) -> dict: ...


def adapter_get() -> ExecutionAdapter:
    """The configured adapter (``ORCHESTRATOR_EXECUTION_ADAPTER``), built per call."""
    path = getattr(settings, "ORCHESTRATOR_EXECUTION_ADAPTER", "") or DEFAULT_ADAPTER
    return import_string(path)()


def _number(value: Decimal | None) -> str | None:
    return None if value is None else format(Decimal(value).normalize(), "f")



def deployment_as_dict(deployment: Deployment) -> dict[str, Any]:
    return {"id": deployment.pk, "projectId": deployment.project_id, "name": deployment.name,
            "spec": deployment.spec, "status": deployment.status, "createdAt": isoformat_or_none(deployment.created_at),
            "stoppedAt": isoformat_or_none(deployment.stopped_at)}


def order_as_dict(order: Order) -> dict[str, Any]:
    return {"id": order.pk, "projectId": order.project_id, "deploymentId": order.deployment_id,
            "symbol": order.symbol, "side": order.side, "quantity": _number(order.quantity),
            "price": _number(order.price), "status": order.status, "createdAt": isoformat_or_none(order.created_at),
            "cancelledAt": isoformat_or_none(order.cancelled_at)}


class DatabaseAdapter:
    """A provider made of database rows: creates and places are get-or-create by key.

    Each write commits its effect together with an ``AdapterCall`` row, so a test or an
    operator can count calls: a replayed call adds a row, never a second deployment or order.
    """

    name = "database"

    def ping(self) -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            return cursor.fetchone()[0] == 1

    def _write(self, *, project_id: int, operation: str, idempotency_key: str,
               effect: Callable[[], tuple[dict, str]]) -> dict:
        try:
            with transaction.atomic():
                result, outcome = effect()
                AdapterCall.objects.create(project_id=project_id, adapter=self.name, operation=operation,
                                           idempotency_key=idempotency_key, outcome=outcome)
                return result
        except AdapterError as exc:
            with transaction.atomic():
                AdapterCall.objects.create(project_id=project_id, adapter=self.name, operation=operation,
                                           idempotency_key=idempotency_key, outcome=exc.code)
            raise

    def _end(self, model, project_id: int, pk: int, *, status: str, at: str, as_dict, outcome: str):
        """Move a deployment or an order to its final ``status`` (stamping ``at``), once: a second
        call finds it there and answers ``existing``."""
        obj = self._locked(model, project_id, pk)
        if obj.status == status:
            return as_dict(obj), "existing"
        obj.status = status
        setattr(obj, at, timezone.now())
        obj.save(update_fields=["status", at, "updated_at"])
        return as_dict(obj), outcome

    def create_deployment(self, *, project_id: int, idempotency_key: str, name: str, spec: dict) -> dict:
        def effect():
            deployment, created = Deployment.objects.get_or_create(
                project_id=project_id, idempotency_key=idempotency_key, defaults={"name": name, "spec": spec})
            return deployment_as_dict(deployment), "created" if created else "existing"

        return self._write(project_id=project_id, operation="create_deployment", idempotency_key=idempotency_key,
                           effect=effect)

    def stop_deployment(self, *, project_id: int, idempotency_key: str, deployment_id: int) -> dict:
        def effect():
            return self._end(Deployment, project_id, deployment_id, status=Deployment.Status.STOPPED,
                             at="stopped_at", as_dict=deployment_as_dict, outcome="stopped")

        return self._write(project_id=project_id, operation="stop_deployment", idempotency_key=idempotency_key,
                           effect=effect)

    def place_order(self, *, project_id: int, idempotency_key: str, symbol: str, side: str, quantity: str,
                    price: str | None = None, deployment_id: int | None = None) -> dict:
        def effect():
            existing = Order.objects.filter(project_id=project_id, idempotency_key=idempotency_key).first()
            if existing is not None:
                return order_as_dict(existing), "existing"
            if deployment_id is not None:
                deployment = self._locked(Deployment, project_id, deployment_id)
                if deployment.status != Deployment.Status.ACTIVE:
                    raise AdapterRejected(f"deployment {deployment_id} is {deployment.status}")
            order, created = Order.objects.get_or_create(
                project_id=project_id, idempotency_key=idempotency_key,
                defaults={"symbol": symbol, "side": side, "quantity": Decimal(quantity),
                          "price": Decimal(price) if price is not None else None, "deployment_id": deployment_id})
            return order_as_dict(order), "created" if created else "existing"

        return self._write(project_id=project_id, operation="place_order", idempotency_key=idempotency_key,
                           effect=effect)

    def cancel_order(self, *, project_id: int, idempotency_key: str, order_id: int) -> dict:
        def effect():
            return self._end(Order, project_id, order_id, status=Order.Status.CANCELLED, at="cancelled_at",
                             as_dict=order_as_dict, outcome="cancelled")

        return self._write(project_id=project_id, operation="cancel_order", idempotency_key=idempotency_key,
                           effect=effect)

    def deployment_list(self, *, project_id: int) -> list[dict]:
        return [deployment_as_dict(d) for d in Deployment.objects.filter(project_id=project_id).order_by("id")]

    def deployment_get(self, *, project_id: int, deployment_id: int) -> dict:
        return deployment_as_dict(self._get(Deployment, project_id, deployment_id))

    def order_list(self, *, project_id: int, deployment_id: int | None = None) -> list[dict]:
        orders = Order.objects.filter(project_id=project_id).order_by("id")
        if deployment_id is not None:
            orders = orders.filter(deployment_id=deployment_id)
        return [order_as_dict(o) for o in orders]

    def order_get(self, *, project_id: int, order_id: int) -> dict:
        return order_as_dict(self._get(Order, project_id, order_id))

    @staticmethod
    def _locked(model, project_id: int, pk: int):
        row = model.objects.select_for_update().filter(project_id=project_id, pk=pk).first()
        if row is None:
            raise AdapterNotFound(f"{model._meta.model_name} {pk} does not exist in project {project_id}")
        return row

    @staticmethod
    def _get(model, project_id: int, pk: Any):
        row = model.objects.filter(project_id=project_id, pk=pk).first() if isinstance(pk, int) else None
        if row is None:
            raise AdapterNotFound(f"{model._meta.model_name} {pk} does not exist in project {project_id}")
        return row
