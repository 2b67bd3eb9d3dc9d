"""Outbound HTTP of the ``http_request`` tool and the ``http_ok`` check (runs/http_fetch.py), against
real local servers: the allow-list with ports, addresses that are not public, IP spellings,
redirects, DNS rebinding, user information and the body cap."""

from __future__ import annotations

import http.server
import ipaddress
import socket
import threading
import time
import urllib.parse

import pytest

from runs.pipeline.checks import CheckContext, check_evaluate
from jobs.tools import FatalToolError, RetryableToolError, ToolContext, ToolError, tool_get

REAL_GETADDRINFO = socket.getaddrinfo
REAL_CREATE_CONNECTION = socket.create_connection


class Recorder(http.server.BaseHTTPRequestHandler):
    """``/ok``; ``/redirect?to=URL``; ``/big?n=N`` (with its length); ``/stream`` (endless, no
    length); ``/lying`` (declares a terabyte). Every request is recorded with its Host header."""

    def do_GET(self):
        self.server.requests.append((self.path, self.headers.get("Host")))
        parsed = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        if parsed.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query["to"])
            self.end_headers()
        elif parsed.path == "/big":
            body = b"x" * int(query["n"])
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif parsed.path == "/stream":
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"y" * 65536)
            except OSError:
                pass
        elif parsed.path == "/lying":
            self.send_response(200)
            self.send_header("Content-Length", str(10 ** 12))
            self.end_headers()
            self.wfile.write(b"z" * 100)
        else:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(f"ok from {self.server.server_port}".encode())

    def log_message(self, *args):
        pass


class Server:
    def __init__(self, host="127.0.0.1"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Http(http.server.ThreadingHTTPServer):
            address_family = family

        self.httpd = Http((host, 0), Recorder)
        self.httpd.requests = []
        self.port = self.httpd.server_port
        self.host = host
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def requests(self):
        return self.httpd.requests

    def url(self, path="/ok"):
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    running = Server()
    yield running
    running.close()


@pytest.fixture
def other_server():
    """A second local service, on a port the allow-list does not name."""
    running = Server()
    yield running
    running.close()


@pytest.fixture
def resolver(monkeypatch):
    """Fake DNS for ``*.example`` names: ``answers[name]`` is a list of addresses, or a list of lists
    (one per successive resolution). Every resolution and every dialled address is recorded."""

    state = {"answers": {}, "resolved": [], "dialled": []}

    def getaddrinfo(host, port, *args, **kwargs):
        if isinstance(host, str) and host.endswith(".example"):
            state["resolved"].append(host)
            answer = state["answers"].get(host)
            if answer is None:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            if answer and isinstance(answer[0], list):
                answer = answer[min(len(state["resolved"]) - 1, len(answer) - 1)]
            return [(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                     (address, port, 0, 0) if ":" in address else (address, port)) for address in answer]
        return REAL_GETADDRINFO(host, port, *args, **kwargs)

    def create_connection(address, *args, **kwargs):
        state["dialled"].append(tuple(address[:2]))
        target = state.get("route", {}).get(address[0])
        if target is not None:  # a "public" test address is served by a local server
            return REAL_CREATE_CONNECTION(target, *args, **kwargs)
        return REAL_CREATE_CONNECTION(address, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    return state


def call(url, **args):
    tool = tool_get("http_request")
    return tool.func({"url": url, **args}, ToolContext(idempotency_key="test-key"))


def refused(url, **args) -> ToolError:
    with pytest.raises(ToolError) as caught:
        call(url, **args)
    return caught.value


def http_ok(url):
    return check_evaluate("http_ok", {"url": url}, CheckContext(run=None))


# --- the allow-list ------------------------------------------------------------------------------

def test_nothing_is_allow_listed_by_default(server):
    error = refused(server.url())
    assert (error.code, error.retryable) == ("host_not_allowed", False)
    assert server.requests == []


def test_a_host_port_entry_allows_that_port_only(settings, server, other_server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    assert call(server.url()) == {"status": 200, "body": f"ok from {server.port}"}
    error = refused(other_server.url())
    assert isinstance(error, FatalToolError) and error.code == "host_not_allowed"
    assert other_server.requests == []


def test_a_name_entry_does_not_reach_a_loopback_address_unless_an_ip_entry_names_it(settings, server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"localhost:{server.port}"]
    url = f"http://localhost:{server.port}/ok"
    assert refused(url).code == "address_not_allowed"
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"localhost:{server.port}", f"127.0.0.1:{server.port}"]
    assert call(url)["body"] == f"ok from {server.port}"
    assert server.requests == [("/ok", f"localhost:{server.port}")]


def test_an_ipv6_entry_with_a_port(settings):
    try:
        running = Server("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"[::1]:{running.port}"]
        assert call(running.url())["status"] == 200
        settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"[::1]:{running.port + 1}", "::2"]
        assert refused(running.url()).code == "host_not_allowed"
        assert len(running.requests) == 1
    finally:
        running.close()


@pytest.mark.parametrize("entry", ["2130706433", "0x7f.1", "0177.0.0.1", "127.1", "[nothost]:80", "host:port",
                                   "host:0", "[::1]x"])
def test_a_malformed_or_numeric_allow_list_entry_is_refused_not_guessed(settings, server, entry):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [entry]
    host = entry.split(":")[0] if not entry.startswith("[") else entry
    error = refused(f"http://{host}:{server.port}/ok")
    assert error.code in ("allow_list_invalid", "address_not_allowed", "invalid_url")
    assert server.requests == []


# --- addresses that are not public ---------------------------------------------------------------

@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "224.0.0.1", "240.0.0.1", "255.255.255.255", "0.0.0.0", "::1", "::", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
    "fe80::1", "fc00::1", "ff02::1", "2002:7f00:1::1", "64:ff9b::a9fe:a9fe",
])
def test_an_allowed_name_resolving_to_an_address_that_is_not_public_is_refused(settings, resolver, address):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = ["internal.example"]
    resolver["answers"]["internal.example"] = [address]
    error = refused("http://internal.example/latest/meta-data/")
    assert (error.code, error.retryable) == ("address_not_allowed", False)
    shown = ipaddress.ip_address(address)
    assert str(getattr(shown, "ipv4_mapped", None) or shown) in str(error)  # ::ffff:a.b.c.d is a.b.c.d
    assert resolver["dialled"] == []


def test_a_public_address_among_the_answers_is_the_only_one_dialled(settings, resolver, server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = ["mixed.example"]
    resolver["answers"]["mixed.example"] = ["127.0.0.1", "93.184.216.34"]
    resolver["route"] = {"93.184.216.34": ("127.0.0.1", server.port)}
    assert call(f"http://mixed.example:{server.port}/ok")["status"] == 200
    assert resolver["dialled"] == [("93.184.216.34", server.port)]


@pytest.mark.parametrize("host", ["2130706433", "0x7f.1", "0x7f000001", "0177.0.0.1", "127.1", "017700000001"])
def test_decimal_octal_hex_and_short_ipv4_spellings_are_refused(settings, server, host):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]  # loopback itself named
    error = refused(f"http://{host}:{server.port}/ok")
    assert (error.code, error.retryable) == ("address_not_allowed", False)
    assert "canonical" in str(error)
    assert server.requests == []
    assert any("canonical IP address" in message
               for message in tool_get("http_request").validate({"url": f"http://{host}/"}))


@pytest.mark.parametrize("host, entry", [("0.0.0.0", "0.0.0.0"), ("[::]", "::")])
def test_the_unspecified_address_is_never_dialled_even_when_named(settings, server, host, entry):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [entry, f"127.0.0.1:{server.port}"]
    assert refused(f"http://{host}:{server.port}/ok").code == "address_not_allowed"
    assert server.requests == []


def test_an_ipv4_mapped_literal_is_judged_as_the_ipv4_address(settings, server, resolver):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    assert call(f"http://[::ffff:127.0.0.1]:{server.port}/ok")["status"] == 200
    assert resolver["dialled"] == [("127.0.0.1", server.port)]
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = ["example.org"]
    assert refused(f"http://[::ffff:127.0.0.1]:{server.port}/ok").code == "host_not_allowed"
    assert len(server.requests) == 1


# --- user information and schemes -----------------------------------------------------------------

@pytest.mark.parametrize("template", ["http://allowed@127.0.0.1:{port}/ok", "http://u:p@127.0.0.1:{port}/ok",
                                      "http://127.0.0.1:{port}@evil.example/ok"])
def test_user_information_in_the_url_is_refused(settings, server, resolver, template):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = ["127.0.0.1", "evil.example"]
    error = refused(template.format(port=server.port))
    assert (error.code, error.retryable) == ("userinfo_not_allowed", False)
    assert server.requests == [] and resolver["resolved"] == []


def test_only_http_and_https(settings):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = ["127.0.0.1"]
    for url in ("file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://127.0.0.1:6379/_INFO"):
        assert refused(url).code == "scheme_not_allowed"
    for url in ("http://127.0.0.1:0/", "http://127.0.0.1:65536/", "http://127.0.0.1\\@evil.example/", "http://[::1/"):
        assert refused(url).code == "invalid_url"


# --- DNS rebinding ------------------------------------------------------------------------------

def test_the_name_is_resolved_once_and_the_connection_goes_to_that_address(settings, resolver, server):
    """A resolver that answers a public address first and loopback afterwards (DNS rebinding)."""
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = ["rebind.example"]
    resolver["answers"]["rebind.example"] = [["93.184.216.34"], ["127.0.0.1"]]
    resolver["route"] = {"93.184.216.34": ("127.0.0.1", server.port)}
    result = call(f"http://rebind.example:{server.port}/ok")
    assert result["status"] == 200
    assert resolver["resolved"] == ["rebind.example"]
    assert resolver["dialled"] == [("93.184.216.34", server.port)]
    assert server.requests == [("/ok", f"rebind.example:{server.port}")]  # the Host header keeps the name


def test_the_check_resolves_once_too(settings, resolver, server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = ["rebind.example"]
    resolver["answers"]["rebind.example"] = [["93.184.216.34"], ["127.0.0.1"]]
    resolver["route"] = {"93.184.216.34": ("127.0.0.1", server.port)}
    result = http_ok(f"http://rebind.example:{server.port}/ok")
    assert result.passed and result.details["status"] == 200
    assert (resolver["resolved"], resolver["dialled"]) == (["rebind.example"], [("93.184.216.34", server.port)])


# --- redirects ----------------------------------------------------------------------------------

def test_a_redirect_to_a_port_off_the_allow_list_is_refused(settings, server, other_server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    error = refused(server.url(f"/redirect?to={other_server.url('/secret')}"))
    assert (error.code, error.retryable) == ("redirect_not_allowed", False)
    assert "host_not_allowed" not in str(error) and str(other_server.port) in str(error)
    assert other_server.requests == []


def test_a_redirect_to_a_host_off_the_allow_list_is_refused_before_resolving_it(settings, server, resolver):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    error = refused(server.url("/redirect?to=http://evil.example/steal"))
    assert (error.code, error.retryable) == ("redirect_not_allowed", False)
    assert resolver["resolved"] == []


def test_a_redirect_to_an_allowed_name_that_resolves_to_loopback_is_refused(settings, server, resolver):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}", "api.example"]
    resolver["answers"]["api.example"] = ["169.254.169.254"]
    error = refused(server.url("/redirect?to=http://api.example/latest/meta-data/"))
    assert error.code == "redirect_not_allowed" and "169.254.169.254" in str(error)
    assert resolver["dialled"] == [("127.0.0.1", server.port)]


def test_a_redirect_to_a_file_url_is_refused(settings, server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    error = refused(server.url("/redirect?to=file:///etc/passwd"))
    assert (error.code, error.retryable) == ("redirect_not_allowed", False)
    assert "scheme 'file'" in str(error)


def test_redirects_within_the_allow_list_are_followed_up_to_the_cap(settings, server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    settings.ORCHESTRATOR_HTTP_MAX_REDIRECTS = 2
    once = server.url("/redirect?to=/ok")
    twice = server.url("/redirect?to=" + urllib.parse.quote(once, safe=""))
    thrice = server.url("/redirect?to=" + urllib.parse.quote(twice, safe=""))
    assert call(twice)["body"] == f"ok from {server.port}"
    server.requests.clear()
    assert refused(thrice).code == "too_many_redirects"
    assert len(server.requests) == 3  # the third redirect is not followed
    settings.ORCHESTRATOR_HTTP_MAX_REDIRECTS = 0
    assert refused(once).code == "redirect_not_allowed"


def test_the_check_refuses_a_redirect_off_the_allow_list(settings, server, other_server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    result = http_ok(server.url(f"/redirect?to={other_server.url('/')}"))
    assert result.invariants == {"host_allowed": False, "answered_2xx": False}
    assert result.details["code"] == "redirect_not_allowed"
    assert other_server.requests == []


# --- the body cap --------------------------------------------------------------------------------

def test_the_body_is_capped_by_the_setting(settings, server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    settings.ORCHESTRATOR_HTTP_MAX_RESPONSE_BYTES = 1000
    assert len(call(server.url("/big?n=1000"))["body"]) == 1000
    error = refused(server.url("/big?n=5000"))
    assert (error.code, error.retryable) == ("response_too_large", False)


def test_an_endless_body_or_a_huge_declared_length_stops_at_the_cap(settings, server):
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    settings.ORCHESTRATOR_HTTP_MAX_RESPONSE_BYTES = 4096
    started = time.monotonic()
    assert refused(server.url("/stream")).code == "response_too_large"
    assert refused(server.url("/lying")).code == "response_too_large"
    assert time.monotonic() - started < 5


# --- retry classes --------------------------------------------------------------------------------

def test_network_failures_are_retryable_and_refusals_are_not(settings, resolver):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{closed_port}", "gone.example"]
    error = refused(f"http://127.0.0.1:{closed_port}/")
    assert isinstance(error, RetryableToolError) and error.code == "connection_error"
    error = refused("http://gone.example/")
    assert isinstance(error, RetryableToolError) and error.code == "resolution_failed"


# --- through a run ------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_run_step_redirected_off_the_allow_list_fails_once_with_the_code(settings, monkeypatch, project, server):
    from runs import services
    from runs.models import Run, StepAttempt
    from tests.conftest import make_plan
    from tests.drive import drain_jobs

    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = ["127.0.0.1"]
    plan = make_plan(tool="http_request", args={"url": server.url("/redirect?to=file:///etc/passwd")},
                     failure_mode="retry")
    run = services.run_create(project=project, name="ssrf", plan=plan)
    services.run_start(run_id=run.pk)
    drain_jobs(until=lambda: Run.objects.get(pk=run.pk).status == Run.Status.FAILED)
    attempts = list(StepAttempt.objects.filter(run=run).values_list("error_code", "retryable"))
    assert attempts == [("redirect_not_allowed", False)]  # fatal: not retried
    assert len(server.requests) == 1
