"""Runs (create, list, detail, actions, events), escalations and the event feed.

Views are thin: validate the input, find the object among the caller's organizations, call
the service, serialize. Domain errors become responses in ``core.api.exceptions``.
"""

from __future__ import annotations

from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from core.api.base import ApiView, ApiViewSet
from core.api.events import event_page, events_of_every_organization, events_visible
from core.api.filters import UtcIsoDateTimeFilter
from core.api.pagination import KeysetPagination
from core.api.schema import ERROR_CODES, errors, list_retrieve_schema
from core.api.serializers import EventPageSerializer, EventQuerySerializer
from core.api.tenancy import (
    MAX_ID,
    VisibleIdFilter,
    as_id,
    visible,
    visible_get,
    visible_organizations,
    visible_project,
    visible_projects,
)
from core.errors import PermissionRefused
from core.models import Membership
from runs import services
from runs.api.serializers import (
    AcknowledgeDriftSerializer,
    ActionSerializer,
    ApproveSerializer,
    EscalationSerializer,
    ReasonRequiredSerializer,
    ResolveSerializer,
    ResumeSerializer,
    RetrySerializer,
    RUN_LIST_COLUMNS,
    RunCreateSerializer,
    RunDetailSerializer,
    RunSerializer,
    runs_as_dicts,
)
from runs.api.timeline import TimelinePageSerializer, TimelineQuerySerializer, timeline_page
from runs.models import EscalationTicket, Run
from runs.pipeline.sidecar import sidecar_build
from runs.services import escalations

# The error codes of gated pipelines, described in the schema with the rest.
for _code, _description in {
    "approval_required": (409, "the run waits for an approval: resume it with `gate` and `approval_ref`"),
    "drift_unacknowledged": (409, "the run stopped on drift no operator acknowledged (`dimension`, `recorded`, "
                                  "`live`)"),
    "drift_not_pending": (409, "the run has no unacknowledged drift"),
    "drift_detected": (409, "resuming found drift: the run stays stopped as `stopped_drift:<dimension>`"),
    "pipeline_key_in_use": (409, "a phase's idempotency key is held by another run (`key`, `run`)"),
    "run_busy": (409, "the run changed while it was being checked; try again"),
    "plan_is_contract": (409, "a gated run's plan is its contract: a retry cannot edit it"),
}.items():
    ERROR_CODES.setdefault(_code, _description)


def visible_runs(request):
    return visible(Run.objects.alive(), request)


class RunFilter(filters.FilterSet):
    project = VisibleIdFilter(field_name="project_id", entity="project", queryset=visible_projects)
    status = filters.ChoiceFilter(choices=Run.Status.choices)
    created_after = UtcIsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = UtcIsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = Run
        fields = ["project", "status", "created_after", "created_before"]


def _action_schema(summary: str, *codes: str):
    return extend_schema(summary=summary, request=ActionSerializer,
                         responses={200: RunDetailSerializer, **errors("not_found", "invalid_transition", *codes)})


class RunEventQuerySerializer(serializers.Serializer):
    after = serializers.IntegerField(min_value=0, max_value=MAX_ID, default=0)
    limit = serializers.IntegerField(min_value=1, max_value=500, default=100)


@list_retrieve_schema(
    RunSerializer,
    list_summary="Runs of the caller's organizations",
    list_description=("Runs of the caller's organizations, newest first; filter by `project`, `status` and creation "
                      "time."),
    retrieve_summary="A run: status, attempt, credits, counts, last error",
    retrieve_description=("One run: its status and reason, attempt, reserved, charged and refunded credits, counts of "
                          "agents, tasks and steps by status, and its last error."),
    item_serializer=RunDetailSerializer,
    destroy=extend_schema(description=("Deletes a run still in `created` (nothing was reserved or executed); any "
                                       "other status answers 409 `invalid_transition`."),
                          summary="Delete a run that was never started",
                          responses={204: None, **errors("not_found", "invalid_transition")}),
)
class RunViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ApiViewSet):
    queryset = Run.objects.alive().order_by("-id")
    pagination_class = KeysetPagination
    serializer_class = RunSerializer
    filterset_class = RunFilter
    entity = "run"

    def get_queryset(self):
        queryset = super().get_queryset()
        return queryset.defer("plan") if self.action in ("list", "timeline") else queryset  # plans can be large

    def get_serializer_class(self):
        return RunDetailSerializer if self.action == "retrieve" else RunSerializer

    def list(self, request, *args, **kwargs):
        # A page of runs is read as plain rows: building 50 model instances costs more than the query.
        rows = self.paginate_queryset(self.filter_queryset(self.get_queryset()).values(*RUN_LIST_COLUMNS))
        return self.get_paginated_response(runs_as_dicts(rows))

    def _detail(self, run: Run, http_status: int = status.HTTP_200_OK) -> Response:
        return Response(RunDetailSerializer(run).data, status=http_status)

    @extend_schema(description=("Validates the plan (agents → tasks → steps of registered tools), estimates its cost "
                                "and creates the run in `created`; `POST .../start/` reserves its credits and starts "
                                "it."),
                   summary="Create a run (status created)", request=RunCreateSerializer,
                   responses={201: RunDetailSerializer, **errors("validation_error", "insufficient_credits",
                                                                  "not_found")})
    def create(self, request):
        serializer = RunCreateSerializer(data=request.data)
        valid = serializer.is_valid()
        project_id = as_id(request.data.get("project")) if isinstance(request.data, dict) else None
        project = self.project_visible(request, project_id) if project_id else None  # 404 before field errors
        if not valid:
            raise ValidationError(serializer.errors)
        data = serializer.validated_data
        run = services.run_create(project=project, name=data["name"], plan=data["plan"], priority=data["priority"],
                                  failure_mode=data["failure_mode"], max_attempts=data["max_attempts"],
                                  credit_limit=data.get("credit_limit"), actor=request.user, reason=data["reason"],
                                  mode=data["mode"])
        return self._detail(run, status.HTTP_201_CREATED)

    def destroy(self, request, pk=None):
        services.run_delete(run_id=self.get_object().pk, actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    def _act(self, request, service) -> Response:
        serializer = ActionSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        run = service(run_id=self.get_object().pk, actor=request.user, reason=serializer.validated_data["reason"])
        return self._detail(run)  # the service's own copy, saved under the row lock

    @_action_schema("Start: created → pending (reserves credits)", "insufficient_credits", "queue_full",
                    "pipeline_key_in_use")
    @action(detail=True, methods=["post"])
    def start(self, request, pk=None):
        """created → pending: reserves the run's credit limit from its organization and queues its first work. Not
        enough available credits answers 402 `insufficient_credits`."""
        return self._act(request, services.run_start)

    @_action_schema("Cancel: refunds every credit not charged")
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancels a created, pending, running or paused run: live agents end and every credit not charged is
        refunded."""
        return self._act(request, services.run_cancel)

    @_action_schema("Pause a running run")
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        """running → paused: no new step starts; steps already executing finish. `POST .../resume/` continues it."""
        return self._act(request, services.run_pause)

    @extend_schema(description=("Resumes a paused run: paused → resuming → running. A gated run's pins and its last "
                                "passed gate are checked again first; a run awaiting an approval needs the `gate` and"
                                " an unused `approval_ref`."),
                   summary="Resume a paused run (seed 002 §7: a gated run's pins and last passed gate are "
                           "checked again; a run awaiting approval needs `gate` and `approval_ref`)",
                   request=ResumeSerializer,
                   responses={200: RunDetailSerializer,
                              **errors("not_found", "invalid_transition", "approval_required", "approval_reused",
                                       "approval_not_pending", "drift_unacknowledged", "drift_detected", "run_busy",
                                       "queue_full")})
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        serializer = ResumeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        if data["approval_ref"]:  # resuming with a reference approves the gate the run waits for
            _require_authority(request, self.get_object(), "runs.approve_gate", "approving a gate")
        result = services.pipeline_resume(run_id=self.get_object().pk, actor=request.user, reason=data["reason"],
                                       gate=data["gate"] or None, approval_ref=data["approval_ref"] or None)
        if result.outcome == "stopped_drift":
            first = result.drift[0]
            raise services.DriftDetected(f"run {result.run.pk} did not resume: {result.detail} (recorded "
                                      f"{first['recorded']!r}, live {first['live']!r}); acknowledge the drift first",
                                      status_reason=result.detail, drift=result.drift)
        return self._detail(Run.objects.get(pk=result.run.pk))

    @extend_schema(description=("A gated run stopped because a pinned value changed: acknowledging takes the live "
                                "value as the new pin, so the run can be resumed."),
                   summary="Acknowledge the drift a run stopped on (the live value becomes the pin)",
                   request=AcknowledgeDriftSerializer,
                   responses={200: RunDetailSerializer,
                              **errors("not_found", "drift_not_pending")})
    @action(detail=True, methods=["post"], url_path="acknowledge-drift")
    def acknowledge_drift(self, request, pk=None):
        serializer = AcknowledgeDriftSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        _require_authority(request, self.get_object(), "runs.acknowledge_drift", "acknowledging drift")
        services.drift_acknowledge(run_id=self.get_object().pk, actor=request.user, reason=data["reason"],
                                dimension=data["dimension"] or None)
        return self._detail(Run.objects.get(pk=self.get_object().pk))

    @extend_schema(description=("Ends a paused or failed run as cancelled (`voided:<reason>`): its pipeline phase "
                                "keys are released and every credit not charged is refunded."),
                   summary="Void a stopped run (paused or failed): cancelled as voided:<reason>, its phase keys "
                           "released, unused credits refunded",
                   request=ReasonRequiredSerializer,
                   responses={200: RunDetailSerializer, **errors("not_found", "permission_denied",
                                                                  "invalid_transition")})
    @action(detail=True, methods=["post"])
    def void(self, request, pk=None):
        _require_authority(request, self.get_object(), "runs.void_run", "voiding a run")
        serializer = ReasonRequiredSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        run = services.run_void(run_id=self.get_object().pk, actor=request.user,
                                reason=serializer.validated_data["reason"])
        return self._detail(run)

    @extend_schema(description=("The run's sidecar document: its pipeline phases, gates, pins and caps with their "
                                "current state (`schema_version` 1)."),
                   summary="The run's sidecar (seed 002 §5, schema_version 1)",
                   responses={200: {"type": "object", "description": "see runs/sidecar.schema.json"},
                              **errors("not_found")})
    @action(detail=True, methods=["get"], pagination_class=None, filterset_class=None)
    def sidecar(self, request, pk=None):
        return Response(sidecar_build(self.get_object()))

    @extend_schema(summary="Retry a failed run (a new attempt and reservation), optionally with an edited plan",
                   request=RetrySerializer,
                   responses={200: RunDetailSerializer, **errors("not_found", "invalid_transition", "validation_error",
                                                                 "plan_is_contract", "insufficient_credits",
                                                                 "queue_full")})
    @action(detail=True, methods=["post"])
    def retry(self, request, pk=None):
        """failed → retrying → pending: a new attempt with a new reservation, while attempts are left. With `plan`,
        the new attempt runs that plan (validated like a new run's; the audit record keeps the plan before and
        after); a gated run's plan is its contract: editing it answers 409 `plan_is_contract`."""
        serializer = RetrySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        run = services.run_retry(run_id=self.get_object().pk, actor=request.user, reason=data["reason"],
                                 plan=data.get("plan"))
        return self._detail(run)

    @extend_schema(description=("Approves the gate a paused run waits for with an approval reference (used once); the"
                                " run then resumes."),
                   summary="Approve a gate the run is waiting for", request=ApproveSerializer,
                   responses={200: RunDetailSerializer,
                              **errors("not_found", "invalid_transition", "approval_reused", "approval_not_pending",
                                       "queue_full")})
    @action(detail=True, methods=["post"])
    def approve(self, request, pk=None):
        serializer = ApproveSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        run = self.get_object()
        _require_authority(request, run, "runs.approve_gate", "approving a gate")
        data = serializer.validated_data
        services.approval_grant(run_id=run.pk, gate=data["gate"], approval_ref=data["approval_ref"], actor=request.user,
                             reason=data["reason"])
        return self._detail(Run.objects.get(pk=run.pk))

    @extend_schema(description=("The run's events with an id greater than `after`, in id order (at most `limit`): the"
                                " same rows the WebSocket stream sends, for catching up."),
                   summary="The run's events after an id", parameters=[RunEventQuerySerializer],
                   responses={200: EventPageSerializer, **errors("validation_error", "not_found")})
    @action(detail=True, methods=["get"], pagination_class=None, filterset_class=None)
    def events(self, request, pk=None):
        query = RunEventQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        run = self.get_object()
        return Response(event_page(request, events_visible(request).filter(run_id=run.pk),
                                   **query.validated_data))

    @extend_schema(description=("One item per step try — every try of every step, across the run's attempts and "
                                "re-plans (a retried step once per try) — with its agent, task, step, run attempt, "
                                "try number, status, start and finish, duration, credits charged and error code, "
                                "ordered by start then id. A big run is read in pages of `limit` tries (500 by "
                                "default, at most 2,000): `next` links to the following page (a keyset cursor) and "
                                "is null on the last one; `count` is the run's number of tries."),
                   summary="The run's timeline: one item per step try, in start order",
                   parameters=[TimelineQuerySerializer],
                   responses={200: TimelinePageSerializer, **errors("validation_error", "not_found")})
    @action(detail=True, methods=["get"], pagination_class=None, filterset_class=None)
    def timeline(self, request, pk=None):
        query = TimelineQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        run = self.get_object()
        base = request.build_absolute_uri(request.path)
        limit = query.validated_data["limit"]
        return Response(timeline_page(run, limit=limit, after=query.validated_data.get("cursor"),
                                      next_url=lambda cursor: f"{base}?limit={limit}&cursor={cursor}"))


def _require_authority(request, target: Run | EscalationTicket, permission: str, what: str) -> None:
    """A sovereign decision (approve a gate, accept drift, void a run, acknowledge or resolve an
    escalation) is not any member's: it needs the owner role of ``target``'s organization, or
    ``permission`` (the one the admin's runbook asks for; the console's Operators have it)."""
    user = request.user
    if user.has_perm(permission) or Membership.objects.filter(
            user=user, organization_id=target.organization_id, role=Membership.Role.OWNER).exists():
        return
    raise PermissionRefused(f"{what} needs the organization's owner role or the {permission!r} permission",
                            permission=permission)


class EscalationFilter(filters.FilterSet):
    status = filters.ChoiceFilter(choices=EscalationTicket.Status.choices)
    run = VisibleIdFilter(field_name="run_id", entity="run", queryset=visible_runs)

    class Meta:
        model = EscalationTicket
        fields = ["status", "run"]


def _escalation_action(body, summary: str, description: str):
    """A POST on one escalation ticket that moves it on, with its schema: ``body`` in, the ticket out."""
    schema = extend_schema(description=description, summary=summary, request=body,
                           responses={200: EscalationSerializer, **errors("not_found", "permission_denied",
                                                                          "invalid_transition")})
    return lambda method: schema(action(detail=True, methods=["post"])(method))


@list_retrieve_schema(
    EscalationSerializer,
    list_summary="Escalation tickets of the caller's organizations",
    list_description=("Escalation tickets (runs handed to a human) of the caller's organizations; filter by "
                      "`status`, `run`."),
    retrieve_summary="An escalation ticket",
    retrieve_description=("One escalation ticket: its run, trigger, severity, detail and who acknowledged or resolved "
                          "it."),
)
class EscalationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ApiViewSet):
    queryset = EscalationTicket.objects.select_related("acknowledged_by", "resolved_by").order_by("-id")
    serializer_class = EscalationSerializer
    filterset_class = EscalationFilter
    entity = "escalation"

    def _move(self, request, service, body, doing: str):
        """An operator moves the ticket on (the owner or ``runs.manage_escalation``), with a reason."""
        _require_authority(request, self.get_object(), "runs.manage_escalation", doing)
        serializer = body(data=request.data)
        serializer.is_valid(raise_exception=True)
        ticket = service(ticket_id=self.get_object().pk, actor=request.user, reason=serializer.validated_data["reason"])
        return Response(EscalationSerializer(ticket, context={"request": request}).data)

    @_escalation_action(ActionSerializer, "Acknowledge: open → acknowledged (the owner or runs.manage_escalation)",
                        "Marks an open escalation as being looked at (audited with the reason); needs the "
                        "organization's owner or runs.manage_escalation.")
    def acknowledge(self, request, pk=None):
        return self._move(request, escalations.escalation_acknowledge, ActionSerializer, "acknowledging an escalation")

    @_escalation_action(ResolveSerializer, "Resolve with a resolution note (the owner or runs.manage_escalation)",
                        "Closes an escalation with a resolution note (audited); a new escalation of the same "
                        "trigger may then open. Needs the organization's owner or runs.manage_escalation.")
    def resolve(self, request, pk=None):
        return self._move(request, escalations.escalation_resolve, ResolveSerializer, "resolving an escalation")


class EventListView(ApiView):
    """The event log (outbox) for reconciliation: ``?after=<id>`` in id order, cursor paginated."""

    @extend_schema(description=("Events of the caller's organizations with an id greater than `after`, in id order: "
                                "the reconciliation feed of the WebSocket stream (`/ws/events/`)."),
                   summary="Events after an id, in id order (cursor by id)", parameters=[EventQuerySerializer],
                   responses={200: EventPageSerializer, **errors("validation_error", "not_found")})
    def get(self, request):
        query = EventQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        data = dict(query.validated_data)
        queryset = events_visible(request)
        staff_view = events_of_every_organization(request.user)
        for name, finder in (("organization", lambda pk: visible_get(visible_organizations(request), request, pk,
                                                                       entity="organization", field="id")),
                             ("project", lambda pk: visible_project(request, pk)),
                             ("run", lambda pk: visible_get(Run.objects.all(), request, pk, entity="run"))):
            value = data.pop(name, None)
            if value is None:
                continue
            if not staff_view:
                finder(value)  # another organization's id: 404, like a missing one
            queryset = queryset.filter(**{f"{name}_id": value})
        return Response(event_page(request, queryset, **data))

