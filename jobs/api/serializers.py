"""Jobs in the API keep seed 003's field names (``jobId``, ``projectId``, ``jobType`` ...)."""

from __future__ import annotations

from rest_framework import serializers

from core.api.serializers import StrictSerializer, json_without_nul
from core.api.tenancy import MAX_ID
from jobs.models import JobState, PriorityClass
from jobs.services import job_as_dict


class JobSerializer(serializers.Serializer):
    """A job as ``jobs.services.job_as_dict`` writes it (API resources and job events)."""

    jobId = serializers.IntegerField()
    projectId = serializers.IntegerField()
    jobType = serializers.CharField()
    state = serializers.ChoiceField(choices=JobState.choices)
    reason = serializers.CharField(allow_blank=True, help_text="reason code of the last transition")
    priority = serializers.ChoiceField(choices=PriorityClass.choices)
    lane = serializers.CharField(allow_blank=True)
    attempts = serializers.IntegerField()
    maxAttempts = serializers.IntegerField()
    createdAt = serializers.DateTimeField(allow_null=True)
    startedAt = serializers.DateTimeField(allow_null=True)
    completedAt = serializers.DateTimeField(allow_null=True)
    error = serializers.CharField(allow_null=True)
    result = serializers.JSONField(allow_null=True)
    sourceSessionId = serializers.CharField(required=False)
    threadId = serializers.CharField(required=False)
    runId = serializers.IntegerField(required=False)

    def to_representation(self, instance):
        return job_as_dict(instance)


class JobEnqueueSerializer(StrictSerializer):
    type = serializers.CharField(max_length=100, help_text="a registered job type clients may enqueue")
    project = serializers.IntegerField(min_value=1, max_value=MAX_ID)
    payload = serializers.DictField(default=dict, validators=[json_without_nul],
                                    help_text="validated by the job type's definition")
    wait_ms = serializers.IntegerField(min_value=0, required=False,
                                       help_text="wait up to this long (capped by ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS) "
                                                 "for the job to finish; 202 when it does not")
    sourceSessionId = serializers.CharField(max_length=200, required=False, allow_blank=True,
                                            help_text="the session the job is for (its events carry it as threadId)")


class JobEnqueuedSerializer(JobSerializer):
    status = serializers.ChoiceField(choices=["queued", "completed", "failed", "cancelled"],
                                     help_text="queued (202), or the final state when the job finished in time")
    dedupe = serializers.ChoiceField(choices=["enqueued", "already_queued", "dropped", "merged"])


class JobCancelSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")


class QueueChangeSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=2000, help_text="why: recorded in the audit trail with your name")


class QueueStateSerializer(serializers.Serializer):
    project = serializers.IntegerField()
    paused = serializers.BooleanField()
    by = serializers.CharField(help_text="who paused it (or resumed it)")
    reason = serializers.CharField()
    since = serializers.DateTimeField(allow_null=True, help_text="when it was paused (a resume: the pause that ended)")
