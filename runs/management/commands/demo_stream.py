"""``demo_stream [--interval S] [--max-active N] [--once]``: keep the demo console alive.

Every ``--interval`` seconds one beat of ``runs.demo.demo_tick``: most runs complete, some fail
retryably, one waits at an approval gate, one is stuck for the recovery runbook; then
``runs.demo.demo_showcase``: a re-plan that heals, a run waiting in a paused queue, a bulk retry
of the failed runs. Stops cleanly on Ctrl-C or SIGTERM. Needs ``seed_demo`` first.
"""

from __future__ import annotations

import signal
import threading

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections

from core.errors import DomainError
from core.models import Organization
from runs.demo import DEMO_ORGANIZATION, demo_showcase, demo_tick


class Command(BaseCommand):
    help = "Keep a small stream of demo runs going (the living demo); needs seed_demo first."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=3.0, help="seconds between beats (default 3)")
        parser.add_argument("--max-active", type=int, default=4, help="ordinary demo runs in flight at most")
        parser.add_argument("--once", action="store_true", help="one beat, then exit")
        parser.add_argument("--username", default="operator", help="the demo operator recorded as the actor")

    def handle(self, *args, **options):
        if options["interval"] <= 0 or options["max_active"] <= 0:
            raise CommandError("--interval and --max-active must be greater than zero")
        organization = Organization.objects.filter(name=DEMO_ORGANIZATION).first()
        if organization is None:
            raise CommandError(f"no organization named {DEMO_ORGANIZATION!r}: run `manage.py seed_demo` first")
        actor = get_user_model().objects.filter(username=options["username"]).first()
        stop = threading.Event()
        if not options["once"]:
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: stop.set())
        while not stop.is_set():
            close_old_connections()
            try:
                beat = demo_tick(organization=organization, actor=actor, max_active=options["max_active"])
                beat.did += demo_showcase(organization=organization, actor=actor).did
                for line in beat.did:
                    self.stdout.write(f"demo: {line}")
            except DomainError as exc:  # e.g. the queue is full: try again on the next beat
                self.stderr.write(f"demo: skipped a beat ({exc.code}: {exc})")
            if options["once"]:
                break
            stop.wait(options["interval"])
        self.stdout.write("demo stream stopped")
