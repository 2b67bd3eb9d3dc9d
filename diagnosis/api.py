"""/api/v1/ diagnosis: ask for a suggested next action on a run (wait-or-202), read it back, and
read the explanations of a run's failed step attempts.

``POST runs/{id}/suggest/?wait=<seconds>`` enqueues a ``suggest_action`` job (single flight
per run: asking again while it runs answers the same job) and waits up to ``wait`` seconds
(capped by ``ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS``) for it: ``200`` with the suggestion when it
finished in time, else ``202`` with the job and a ``Location`` to poll (the job, whose
``result`` carries the suggestion once done). Another organization's run is a ``404``.
"""

from __future__ import annotations

from django.conf import settings
from django.urls import re_path, reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from core.api.actors import ActorNames
from core.api.base import ID_PATTERN, ApiView
from core.api.schema import errors
from core.api.serializers import StrictSerializer
from core.api.tenancy import visible_get
from diagnosis.models import Explanation, Suggestion
from diagnosis.services import explanation_as_dict, suggestion_as_dict, suggestion_request, suggestion_response
from jobs.api.serializers import JobSerializer
from jobs.api.views import job_wait
from jobs.models import Job
from runs.models import Run

EXPLANATIONS_LISTED = 200
WAIT_MAX_S = 3600


class SuggestQuerySerializer(serializers.Serializer):
    wait = serializers.FloatField(min_value=0, max_value=WAIT_MAX_S, required=False, default=0,
                                  help_text="seconds to wait for the suggestion (capped by "
                                            "ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS); 202 when it is not ready by then")


class SuggestionSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    run = serializers.IntegerField()
    job = serializers.IntegerField(allow_null=True)
    status = serializers.CharField(help_text=f"one of {', '.join(Suggestion.Status.values)}")
    action = serializers.CharField(allow_blank=True, help_text="retry, recover, approve_gate, refund, escalate, "
                                                               "resume, start, topup, acknowledge, wait or none")
    text = serializers.CharField(allow_blank=True, help_text="e.g. \"retry: retryable error drill_retryable, "
                                                             "2 attempt(s) left, 38 credits available\"")
    facts = serializers.JSONField(help_text="what the suggestion was computed from")
    requested_by = serializers.CharField(allow_null=True)
    requested_at = serializers.DateTimeField()
    completed_at = serializers.DateTimeField(allow_null=True)
    run_status_at_request = serializers.CharField()
    run_status = serializers.CharField()
    stale = serializers.BooleanField(help_text="the run changed after the suggestion was asked for")


class SuggestResponseSerializer(serializers.Serializer):
    status = serializers.CharField(help_text="queued (202), or the job's final state when it finished in time "
                                             "(completed, failed or cancelled)")
    dedupe = serializers.ChoiceField(choices=["enqueued", "already_queued"],
                                     help_text="already_queued: a suggestion for this run was already being made")
    job = JobSerializer()
    suggestion = SuggestionSerializer()


class SuggestionLatestSerializer(serializers.Serializer):
    suggestion = SuggestionSerializer(allow_null=True)


class ExplanationSerializer(serializers.Serializer):
    id = serializers.CharField(help_text="stable id: explanation-<run>-<step>-<attempt>")
    run = serializers.IntegerField()
    step = serializers.IntegerField()
    step_attempt = serializers.IntegerField()
    attempt = serializers.IntegerField()
    error_code = serializers.CharField(allow_blank=True)
    status = serializers.CharField(help_text=f"one of {', '.join(Explanation.Status.values)}")
    text = serializers.CharField(allow_blank=True)
    job = serializers.IntegerField(allow_null=True)
    created_at = serializers.DateTimeField(allow_null=True)
    updated_at = serializers.DateTimeField(allow_null=True)
    explained_at = serializers.DateTimeField(allow_null=True)
    facts = serializers.JSONField()


class ExplanationListSerializer(serializers.Serializer):
    results = ExplanationSerializer(many=True)


def _visible_run(request, run_id) -> Run:
    return visible_get(Run.objects.alive().select_related("project"), request, run_id, entity="run")


class RunSuggestView(ApiView):
    """A run's suggested next action: ask (POST, wait-or-202) or read the latest (GET)."""

    def idempotency_organization_id(self, request) -> int | None:
        return _visible_run(request, self.kwargs["run_id"]).organization_id

    def idempotency_atomic(self, request) -> bool:
        # A request that waits for a worker must commit its job first (and not hold a transaction).
        query = SuggestQuerySerializer(data=request.query_params)
        return not (query.is_valid() and query.validated_data["wait"] > 0)

    @extend_schema(description=("The latest suggestion for the run (what to do next, and why), or null when none was "
                                "asked for."),
                   summary="The run's latest suggested next action (null when none was asked for)",
                   responses={200: SuggestionLatestSerializer, **errors("not_found")})
    def get(self, request, run_id):
        run = _visible_run(request, run_id)
        suggestion = Suggestion.objects.select_related("requested_by").filter(run=run).order_by("-id").first()
        body = {"suggestion": suggestion_as_dict(suggestion, run=run) if suggestion else None}
        return Response(ActorNames.for_request(request).relabel(body, organization_id=run.organization_id))

    @extend_schema(
        description=("Asks for a suggested next action for the run (one at a time per run: a second request joins the"
                     " first). With `?wait=`, answers the suggestion when it is ready in time, else 202."),
        summary="Ask for a suggested next action (single flight per run); with ?wait=, the suggestion if "
                "ready in time (200), else 202 and a Location to poll",
        request=None, parameters=[SuggestQuerySerializer,
                                  OpenApiParameter("Location", OpenApiTypes.STR, OpenApiParameter.HEADER,
                                                   response=[202], description="the job to poll")],
        responses={200: SuggestResponseSerializer, 202: SuggestResponseSerializer,
                   **errors("not_found", "queue_full", "queue_disabled")})
    def post(self, request, run_id):
        StrictSerializer(data=request.data or {}).is_valid(raise_exception=True)  # it takes no body fields
        query = SuggestQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        run = _visible_run(request, run_id)
        requested = suggestion_request(run_id=run.pk, actor=request.user)
        wait_s = min(query.validated_data["wait"], settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS / 1000)
        job = job_wait(requested.job.pk, wait_s) if wait_s > 0 else Job.objects.get(pk=requested.job.pk)
        body = ActorNames.for_request(request).relabel(suggestion_response(requested, job),
                                                       organization_id=run.organization_id)
        if job.is_terminal:
            return Response(body)
        return Response(body, status=status.HTTP_202_ACCEPTED,
                        headers={"Location": reverse("job-detail", args=[job.pk])})


class RunExplanationsView(ApiView):
    """The explanations of a run's failed step attempts, oldest first, under their stable ids."""

    @extend_schema(description=("Explanations of the run's failed step attempts: why each failed and whether a retry "
                                "can help."),
                   summary="Explanations of the run's failed step attempts (explaining, final or summary)",
                   responses={200: ExplanationListSerializer, **errors("not_found")})
    def get(self, request, run_id):
        run = _visible_run(request, run_id)
        explanations = Explanation.objects.filter(run=run).select_related("job").order_by("-id")[:EXPLANATIONS_LISTED]
        return Response({"results": [explanation_as_dict(item) for item in reversed(explanations)]})


urlpatterns = [
    re_path(rf"^runs/(?P<run_id>{ID_PATTERN})/suggest/$", RunSuggestView.as_view(), name="run-suggest"),
    re_path(rf"^runs/(?P<run_id>{ID_PATTERN})/explanations/$", RunExplanationsView.as_view(),
            name="run-explanations"),
]
