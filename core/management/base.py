"""What every runbook command shares: domain errors become ``CommandError``, never a traceback."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from core.errors import DomainError


def describe_error(exc: DomainError) -> str:
    errors = getattr(exc, "errors", None) or {}
    details = "; ".join(f"{field}: {', '.join(messages)}" for field, messages in errors.items())
    return f"{exc.code}: {exc.detail}" + (f" ({details})" if details else "")


class RunbookCommand(BaseCommand):
    """A command that calls services and reports domain errors as ``CommandError``."""

    def execute(self, *args, **options):
        try:
            return super().execute(*args, **options)
        except DomainError as exc:
            raise CommandError(describe_error(exc)) from exc

    @staticmethod
    def resolve_actor(username: str | None):
        if not username:
            return None
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"user {username!r} does not exist")
        return user
