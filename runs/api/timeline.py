"""A run's timeline: one item per step try, in start order, read page by page.

``GET /api/v1/runs/{id}/timeline/`` and the run page's Gantt chart (the admin reads the same
pages through ``timeline_page``) show every try of every step — across the run's attempts and
re-plans, a retried step once per try — with its agent, task, timing, credits and error code.

A big run is read in pages of ``limit`` tries (500 by default, at most 2,000) in ``(started_at,
id)`` order; ``next`` carries an opaque keyset cursor, so a deep page costs what the first one
does. ``count`` is the run's number of tries.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Callable

from django.utils import timezone
from django.utils.dateparse import parse_datetime
from rest_framework import serializers

from runs.models import Run, Step, StepAttempt
from runs.selectors import run_step_tries, run_step_try_count

TIMELINE_DEFAULT_LIMIT = 500
TIMELINE_MAX_LIMIT = 2000
_DATETIME = serializers.DateTimeField(read_only=True)


def timeline_cursor_encode(started_at: datetime, pk: int) -> str:
    raw = f"{started_at.isoformat()}|{pk}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def timeline_cursor_decode(cursor: str) -> tuple[datetime, int]:
    """``(started_at, id)`` of the last try already read; ``ValueError`` when it is not a cursor."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, _, pk = raw.rpartition("|")
        started_at = parse_datetime(stamp)
        number = int(pk)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError("not a timeline cursor") from exc
    if started_at is None or timezone.is_naive(started_at) or not 1 <= number < 2**63:
        raise ValueError("not a timeline cursor")
    return started_at, number


class TimelineQuerySerializer(serializers.Serializer):
    """The timeline's query parameters (any other parameter is ignored)."""

    limit = serializers.IntegerField(min_value=1, max_value=TIMELINE_MAX_LIMIT, default=TIMELINE_DEFAULT_LIMIT,
                                     help_text=f"tries per page (at most {TIMELINE_MAX_LIMIT})")
    cursor = serializers.CharField(required=False, max_length=200,
                                   help_text="from `next` of the previous page: the tries after it")

    def validate_cursor(self, value: str) -> tuple[datetime, int]:
        try:
            return timeline_cursor_decode(value)
        except ValueError:
            raise serializers.ValidationError("not a cursor of this timeline (take `next` of a page)") from None


class TimelineNamedSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()


class TimelineStepSerializer(TimelineNamedSerializer):
    kind = serializers.ChoiceField(choices=Step.Kind.choices)
    tool = serializers.CharField(allow_blank=True)


class TimelineItemSerializer(serializers.Serializer):
    """One try of one step."""

    id = serializers.IntegerField(help_text="the step attempt's id")
    agent = TimelineNamedSerializer()
    task = TimelineNamedSerializer()
    step = TimelineStepSerializer()
    attempt = serializers.IntegerField(help_text="the run attempt the try belongs to")
    try_number = serializers.IntegerField(help_text="the step's try (1, 2, … across its retries)")
    status = serializers.ChoiceField(choices=StepAttempt.Outcome.choices)
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    duration_ms = serializers.IntegerField(allow_null=True, help_text="null while the try runs")
    credits = serializers.IntegerField(help_text="credits charged for the try")
    retryable = serializers.BooleanField(allow_null=True)
    error_code = serializers.CharField(allow_blank=True)

    def get_fields(self):
        # ``try`` is a Python keyword: declared as ``try_number``, named ``try`` in its place.
        return {"try" if name == "try_number" else name: field for name, field in super().get_fields().items()}


class TimelineCreditsSerializer(serializers.Serializer):
    limit = serializers.IntegerField(help_text="credits reserved for each attempt")
    reserved = serializers.IntegerField()
    charged = serializers.IntegerField()
    refunded = serializers.IntegerField()


class TimelinePageSerializer(serializers.Serializer):
    run = serializers.IntegerField()
    status = serializers.ChoiceField(choices=Run.Status.choices, help_text="the run's status now")
    status_reason = serializers.CharField(allow_blank=True)
    attempt_number = serializers.IntegerField(help_text="the run's current attempt")
    credits = TimelineCreditsSerializer(help_text="the run's credits now")
    count = serializers.IntegerField(help_text="the run's tries, all pages")
    next = serializers.CharField(allow_null=True, help_text="the URL of the next page (null: the last page)")
    generated_at = serializers.DateTimeField(help_text="now, for drawing tries still running")
    items = TimelineItemSerializer(many=True)


def timeline_item(attempt: StepAttempt) -> dict:
    step = attempt.step
    task = step.task
    agent = task.agent
    duration = (int((attempt.finished_at - attempt.started_at).total_seconds() * 1000)
                if attempt.finished_at else None)
    return {"id": attempt.pk, "agent": {"id": agent.pk, "name": agent.name},
            "task": {"id": task.pk, "name": task.name},
            "step": {"id": step.pk, "name": step.name, "kind": step.kind, "tool": step.tool},
            "attempt": agent.attempt_number, "try": attempt.number, "status": attempt.outcome,
            "started_at": _DATETIME.to_representation(attempt.started_at),
            "finished_at": _DATETIME.to_representation(attempt.finished_at) if attempt.finished_at else None,
            "duration_ms": duration, "credits": attempt.cost, "retryable": attempt.retryable,
            "error_code": attempt.error_code}


def timeline_page(run: Run, *, limit: int = TIMELINE_DEFAULT_LIMIT, after: tuple[datetime, int] | None = None,
                  next_url: Callable[[str], str]) -> dict:
    """One page of the run's timeline (two queries: the tries and their count); ``next_url(cursor)``
    makes the link to the following page."""
    tries = run_step_tries(run, after=after, limit=limit + 1)
    more = len(tries) > limit
    tries = tries[:limit]
    cursor = timeline_cursor_encode(tries[-1].started_at, tries[-1].pk) if more else None
    return {"run": run.pk, "status": run.status, "status_reason": run.status_reason,
            "attempt_number": run.attempt_number,
            "credits": {"limit": run.credit_limit, "reserved": run.credits_reserved, "charged": run.credits_charged,
                        "refunded": run.credits_refunded},
            "count": run_step_try_count(run), "next": next_url(cursor) if cursor else None,
            "generated_at": _DATETIME.to_representation(timezone.now()),
            "items": [timeline_item(attempt) for attempt in tries]}

