"""``run_console``: serves daphne and the workers, stops them together (no real processes:
children, signals and sleep are faked)."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError


def run_command(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def run_json(name: str, *args: str) -> dict:
    return json.loads(run_command(name, *args))


class FakeChild:
    """A child process that exits with ``code`` after ``polls`` polls (never, when ``polls`` is None)."""

    def __init__(self, args: list[str], polls: int | None, code: int) -> None:
        self.args, self.pid, self.returncode, self.signals = args, 0, None, []
        self._polls_left, self._code = polls, code

    def poll(self):
        if self.returncode is None and self._polls_left is not None:
            self._polls_left -= 1
            if self._polls_left < 0:
                self.returncode = self._code
        return self.returncode

    def send_signal(self, signum) -> None:
        self.signals.append(signum)
        self.returncode = -signum

    def wait(self, timeout=None):
        return self.returncode


@pytest.fixture
def console(monkeypatch):
    import signal as real_signal
    import subprocess as real_subprocess
    import time as real_time
    from types import SimpleNamespace

    from console.management.commands import run_console

    state = {"children": {}, "exits": {}, "handlers": {}, "on_sleep": lambda: None}

    def popen(args, **kwargs):
        name = next((n for n in ("qcluster", "demo_stream") if n in args), "daphne")
        polls, code = state["exits"].get(name, (None, 0))
        state["children"][name] = FakeChild(args, polls, code)
        return state["children"][name]

    monkeypatch.setattr(run_console, "subprocess", SimpleNamespace(
        Popen=popen, TimeoutExpired=real_subprocess.TimeoutExpired))
    monkeypatch.setattr(run_console, "signal", SimpleNamespace(
        signal=lambda signum, handler: state["handlers"].__setitem__(signum, handler),
        SIGINT=real_signal.SIGINT, SIGTERM=real_signal.SIGTERM, SIGKILL=real_signal.SIGKILL))
    monkeypatch.setattr(run_console, "time", SimpleNamespace(
        sleep=lambda seconds: state["on_sleep"](), monotonic=real_time.monotonic))
    monkeypatch.setattr(run_console.os, "killpg", lambda pid, signum: pytest.fail("nothing should need SIGKILL"))
    return state


@pytest.mark.django_db
def test_run_console_stops_both_children_on_ctrl_c(console):
    import signal

    console["on_sleep"] = lambda: console["handlers"][signal.SIGINT](signal.SIGINT, None)
    out = StringIO()
    call_command("run_console", "--host", "0.0.0.0", "--port", "9000", stdout=out, stderr=StringIO())

    daphne, cluster = console["children"]["daphne"], console["children"]["qcluster"]
    assert daphne.args[1:] == ["-m", "daphne", "-b", "0.0.0.0", "-p", "9000", "orchestrator_site.asgi:application"]
    assert cluster.args[-1] == "qcluster"
    assert daphne.signals == cluster.signals == [signal.SIGTERM]
    assert "http://0.0.0.0:9000/admin/ (daphne, qcluster)" in out.getvalue()
    assert "demo_stream" not in console["children"]
    assert out.getvalue().rstrip().endswith("stopped")


def test_run_console_demo_adds_the_demo_stream_and_leaves_silent_runs_to_operators(console, monkeypatch):
    import os
    import signal

    monkeypatch.delenv("ORCHESTRATOR_RUN_AUTO_RECOVER", raising=False)
    monkeypatch.delenv("ORCHESTRATOR_TRANSITION_LOG_LEVEL", raising=False)
    console["on_sleep"] = lambda: console["handlers"][signal.SIGTERM](signal.SIGTERM, None)
    out = StringIO()
    call_command("run_console", "--demo", stdout=out, stderr=StringIO())

    stream = console["children"]["demo_stream"]
    assert stream.args[-1] == "demo_stream" and stream.signals == [signal.SIGTERM]
    assert "(daphne, qcluster, demo_stream)" in out.getvalue()
    assert os.environ["ORCHESTRATOR_RUN_AUTO_RECOVER"] == "0"  # inherited by every child
    assert os.environ["ORCHESTRATOR_TRANSITION_LOG_LEVEL"] == "WARNING"


def test_run_console_exits_with_the_code_of_a_child_that_died(console):
    import signal

    console["exits"]["daphne"] = (2, 3)  # daphne dies on its third poll with exit code 3
    out, err = StringIO(), StringIO()
    with pytest.raises(SystemExit) as raised:
        call_command("run_console", stdout=out, stderr=err)

    assert raised.value.code == 3
    assert "daphne exited with code 3; stopping" in err.getvalue()
    assert console["children"]["qcluster"].signals == [signal.SIGTERM]  # the survivor is stopped
    assert console["children"]["daphne"].signals == []


@pytest.mark.django_db
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "192.168.1.20", "10.0.0.5", "no-such-host.invalid"])
def test_run_console_refuses_a_network_address_while_the_demo_login_has_its_default_password(console, host):
    run_json("seed_demo")  # operator / operator
    with pytest.raises(CommandError, match="demo login 'operator' still has its default password"):
        call_command("run_console", "--host", host, stdout=StringIO(), stderr=StringIO())
    assert console["children"] == {}  # nothing started


@pytest.mark.django_db
@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_run_console_serves_the_demo_login_on_loopback(console, host):
    import signal

    run_json("seed_demo")
    console["on_sleep"] = lambda: console["handlers"][signal.SIGTERM](signal.SIGTERM, None)
    call_command("run_console", "--host", host, stdout=StringIO(), stderr=StringIO())
    assert "daphne" in console["children"]


@pytest.mark.django_db
def test_run_console_serves_the_network_once_the_demo_password_is_changed(console, monkeypatch):
    import signal

    monkeypatch.setenv("DEMO_USERNAME", "demo-admin")
    run_json("seed_demo", "--username", "demo-admin", "--password", "operator")
    with pytest.raises(CommandError, match="'demo-admin'"):
        call_command("run_console", "--host", "0.0.0.0", stdout=StringIO(), stderr=StringIO())
    user = get_user_model().objects.get(username="demo-admin")
    user.set_password("a long unguessable passphrase")
    user.save()
    console["on_sleep"] = lambda: console["handlers"][signal.SIGTERM](signal.SIGTERM, None)
    call_command("run_console", "--host", "0.0.0.0", stdout=StringIO(), stderr=StringIO())
    assert "daphne" in console["children"]


def test_run_console_without_workers_serves_only(console):
    import signal

    console["on_sleep"] = lambda: console["handlers"][signal.SIGTERM](signal.SIGTERM, None)
    out = StringIO()
    call_command("run_console", "--no-workers", stdout=out, stderr=StringIO())
    assert list(console["children"]) == ["daphne"]
    assert "/admin/ (daphne); Ctrl-C" in out.getvalue()
