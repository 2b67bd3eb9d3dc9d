"""``run_console``: daphne (admin, API, WebSocket) and a ``qcluster`` together; Ctrl-C stops both.

Used by ``make demo`` (with ``--demo``: a third child, ``demo_stream``, keeps demo runs going,
and automatic recovery of silent runs is off unless ``ORCHESTRATOR_RUN_AUTO_RECOVER`` is set,
so the stuck demo run waits for the recovery runbook, and transitions are not logged unless
``ORCHESTRATOR_TRANSITION_LOG_LEVEL`` is set). Each child gets the same environment; if
one exits, the others are stopped and the command exits with its code.

It refuses to serve on an address other than loopback (``--host 0.0.0.0``, ``::``, a LAN
address or a name that resolves to one) while the demo login (``DEMO_USERNAME``, default
``operator``) still has the demo's default password: that login must never face the network.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

DEMO_DEFAULT_PASSWORD = "operator"  # seed_demo's default


def host_is_loopback(host: str) -> bool:
    """Does binding ``host`` keep the server on this machine? A name counts only when every
    address it resolves to is loopback; a name that does not resolve does not count."""
    name = host.strip().strip("[]")
    try:
        addresses = {ipaddress.ip_address(name)}
    except ValueError:
        try:
            addresses = {ipaddress.ip_address(info[4][0].split("%")[0])
                         for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
        except (OSError, UnicodeError, ValueError):
            return False
    for address in addresses:
        mapped = getattr(address, "ipv4_mapped", None)
        if not (mapped or address).is_loopback:
            return False
    return bool(addresses)


def demo_login_with_default_password() -> str | None:
    """The demo login's username while it still has the default password, else None."""
    username = os.environ.get("DEMO_USERNAME", "operator")
    try:
        user = get_user_model().objects.filter(username=username).first()
    except DatabaseError:  # no tables yet: no login to protect
        return None
    if user is not None and user.is_active and user.check_password(DEMO_DEFAULT_PASSWORD):
        return username
    return None


class Command(BaseCommand):
    help = "Serve the console with daphne and run the django-q2 workers, until Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-workers", action="store_true", help="serve only (workers run elsewhere)")
        parser.add_argument("--demo", action="store_true",
                            help="also keep a stream of demo runs going (needs seed_demo first)")

    def handle(self, *args, **options):
        if not host_is_loopback(options["host"]):
            username = demo_login_with_default_password()
            if username is not None:
                raise CommandError(
                    f"refusing to serve on {options['host']}: the demo login {username!r} still has its default "
                    f"password, and anyone who can reach this address could sign in as a superuser. Change it "
                    f"(manage.py changepassword {username}) or serve on 127.0.0.1 (behind a proxy).")
        base = [sys.executable]
        manage = [*base, str(settings.BASE_DIR / "manage.py")]
        if options["demo"]:
            os.environ.setdefault("ORCHESTRATOR_RUN_AUTO_RECOVER", "0")
            # A quiet terminal: the demo makes a few transitions a second (INFO shows each as JSON).
            os.environ.setdefault("ORCHESTRATOR_TRANSITION_LOG_LEVEL", "WARNING")
        daphne = base + ["-m", "daphne", "-b", options["host"], "-p", str(options["port"]),
                         "orchestrator_site.asgi:application"]
        # daphne runs each request in some thread: pool PostgreSQL connections there.
        web_env = {**os.environ, "DB_POOL_MAX_SIZE": os.environ.get("DB_POOL_MAX_SIZE") or "8"}
        children = [("daphne", subprocess.Popen(daphne, cwd=settings.BASE_DIR, env=web_env,
                                                start_new_session=True))]
        if not options["no_workers"]:
            children.append(("qcluster", subprocess.Popen([*manage, "qcluster"], cwd=settings.BASE_DIR,
                                                          start_new_session=True)))
        if options["demo"]:
            children.append(("demo_stream", subprocess.Popen([*manage, "demo_stream"], cwd=settings.BASE_DIR,
                                                             start_new_session=True)))
        stopping = {"flag": False}

        def stop(signum=None, frame=None):
            stopping["flag"] = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        self.stdout.write(self.style.SUCCESS(
            f"Orchestrator Console on http://{options['host']}:{options['port']}/admin/ "
            f"({', '.join(name for name, _ in children)}); Ctrl-C stops it."))
        code = 0
        try:
            while not stopping["flag"]:
                for name, process in children:
                    if process.poll() is not None:
                        self.stderr.write(f"{name} exited with code {process.returncode}; stopping")
                        code = process.returncode or 1
                        stopping["flag"] = True
                time.sleep(0.2)
        finally:
            for name, process in children:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            for name, process in children:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
            self.stdout.write("stopped")
        if code:
            sys.exit(code)
