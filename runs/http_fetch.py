"""Outbound HTTP: the one guarded fetch behind the ``http_request`` tool and the ``http_ok`` check.

What it guarantees (README, "Outbound HTTP"):

- only ``http`` and ``https``; no userinfo (``http://allowed@evil/``); the host is a DNS name or a
  canonical IP literal (decimal, octal, hex and shortened IPv4 forms such as ``2130706433`` or
  ``0x7f.1`` are refused, whatever the allow-list says);
- the URL's host and port match ``ORCHESTRATOR_HTTP_ALLOWED_HOSTS`` (``host``: any port,
  ``host:port``, ``[v6]:port``);
- the name is resolved once per request and the connection is dialled to an address of that
  answer (the Host header and TLS SNI and certificate check keep the name), so a resolver that
  answers differently a second time (DNS rebinding) cannot move the connection;
- an address that is not public (loopback, private, link-local, shared, multicast, reserved,
  documentation, IPv4 inside IPv6 such as ``::ffff:127.0.0.1``) is dialled only when an IP-literal
  entry of the allow-list names it (with its port when the entry has one); ``0.0.0.0`` and ``::``
  never;
- redirects of GET and HEAD are followed at most ``ORCHESTRATOR_HTTP_MAX_REDIRECTS`` times, each
  ``Location`` checked again by every rule above; other methods get the 3xx answer itself;
- at most ``ORCHESTRATOR_HTTP_MAX_RESPONSE_BYTES`` of a body are read (a larger body, or a larger
  ``Content-Length``, is ``response_too_large``); the whole exchange keeps to one deadline.

Every failure is a ``FetchError`` with a machine code and whether retrying may help.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import string
import time
import urllib.parse
from dataclasses import dataclass, field

from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_MAX_REDIRECTS = 3
DEFAULT_MAX_RESPONSE_BYTES = 256 * 1024
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
REDIRECTING_METHODS = frozenset({"GET", "HEAD"})
READ_CHUNK_BYTES = 64 * 1024

# Codes of a destination the rules refuse (never worth retrying); the others are network failures.
REFUSAL_CODES = frozenset({"invalid_url", "scheme_not_allowed", "userinfo_not_allowed", "host_not_allowed",
                           "address_not_allowed", "redirect_not_allowed", "too_many_redirects",
                           "allow_list_invalid"})
NAT64_NETWORKS = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


class FetchError(Exception):
    """A refused or failed fetch: ``code`` names it, ``retryable`` says whether a retry may help."""

    def __init__(self, message: str, *, code: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


@dataclass(frozen=True)
class AllowEntry:
    """One entry of the allow-list: a host name or an IP address, with a port or any port."""

    host: str
    port: int | None
    address: IPAddress | None


@dataclass(frozen=True)
class Target:
    """A URL that passed the URL rules: where to connect and what to ask."""

    url: str
    scheme: str
    host: str
    port: int
    address: IPAddress | None
    request_path: str


@dataclass
class FetchResult:
    status: int
    body: bytes
    url: str
    redirects: int
    headers: dict[str, str] = field(default_factory=dict)


# --- addresses ---------------------------------------------------------------------------------

def _unmapped(address: IPAddress) -> IPAddress:
    """``::ffff:a.b.c.d`` is the IPv4 address ``a.b.c.d`` (that is where a dual-stack socket goes)."""
    if address.version == 6 and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def address_is_public(address: IPAddress) -> bool:
    """Whether ``address`` is a public unicast address (an IPv4 address carried inside IPv6 by
    6to4 or NAT64 is judged by the IPv4 address)."""
    address = _unmapped(address)
    if address.version == 6:
        embedded = address.sixtofour
        if embedded is None and any(address in network for network in NAT64_NETWORKS):
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None and not address_is_public(embedded):
            return False
        if address.is_site_local:
            return False
    return address.is_global and not (address.is_private or address.is_loopback or address.is_link_local
                                      or address.is_multicast or address.is_reserved or address.is_unspecified)


def _canonical_address(host: str) -> IPAddress | None:
    """The IP address ``host`` spells in canonical form (dotted quad, or IPv6), else None."""
    try:
        return _unmapped(ipaddress.ip_address(host))
    except ValueError:
        return None


def _looks_numeric(host: str) -> bool:
    """A host whose last label is a number is an IPv4 address to resolvers (``2130706433``,
    ``0x7f.1``, ``0177.0.0.1``, ``127.1``), never a DNS name."""
    last = host.rsplit(".", 1)[-1]
    if last.isdigit():
        return True
    return last[:2] == "0x" and all(char in string.hexdigits for char in last[2:])


# --- the allow-list ------------------------------------------------------------------------------

def _allow_entry_parse(raw: str) -> AllowEntry:
    invalid = FetchError(f"ORCHESTRATOR_HTTP_ALLOWED_HOSTS: {raw!r} is not host, host:port, an IP address "
                         "or [IPv6]:port", code="allow_list_invalid")
    text = raw.strip().lower()
    port_text = None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise invalid
        port_text = rest[1:] if rest else None
        if _canonical_address(host) is None or ":" not in host:
            raise invalid
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host = text  # a name, an IPv4 address or a bare IPv6 address (any port)
    try:
        host = host.rstrip(".").encode("idna").decode("ascii")
    except UnicodeError:
        raise invalid from None
    port = None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise invalid
        port = int(port_text)
    address = _canonical_address(host)
    if not host or (address is None and (_looks_numeric(host) or ":" in host)):
        raise invalid
    return AllowEntry(host=str(address) if address is not None else host, port=port, address=address)


def allow_list() -> list[AllowEntry]:
    """``ORCHESTRATOR_HTTP_ALLOWED_HOSTS``, parsed (a malformed entry is ``allow_list_invalid``)."""
    return [_allow_entry_parse(str(raw)) for raw in getattr(settings, "ORCHESTRATOR_HTTP_ALLOWED_HOSTS", []) or []]


# --- the URL rules ---------------------------------------------------------------------------------

def target_parse(url: str) -> Target:
    """The URL's scheme, host, port and path, or a ``FetchError`` when a URL rule refuses it."""
    if not isinstance(url, str) or not url or any(ord(char) <= 32 or ord(char) == 127 or char == "\\"
                                                  for char in url):
        raise FetchError(f"{url!r} is not a URL", code="invalid_url")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise FetchError(f"{url!r} is not a URL: {exc}", code="invalid_url") from exc
    if port == 0:
        raise FetchError(f"{url!r} names port 0", code="invalid_url")
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise FetchError(f"scheme {scheme or '(none)'!r} of {url!r} is not http or https", code="scheme_not_allowed")
    if "@" in parts.netloc:
        raise FetchError(f"{url!r} carries user information (user@host), which is refused",
                         code="userinfo_not_allowed")
    host = (parts.hostname or "").rstrip(".")
    if not host or "%" in host:
        raise FetchError(f"{url!r} names no valid host", code="invalid_url")
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError as exc:
        raise FetchError(f"{url!r} names no valid host", code="invalid_url") from exc
    address = _canonical_address(host)
    if address is None and (_looks_numeric(host) or ":" in host):
        raise FetchError(f"{host!r} is not a canonical IP address (dotted quad or IPv6)",
                         code="address_not_allowed")
    if address is not None:
        host = str(address)
    request_path = parts.path or "/"
    if parts.query:
        request_path += "?" + parts.query
    return Target(url=url, scheme=scheme, host=host, port=port or (443 if scheme == "https" else 80),
                  address=address, request_path=request_path)


def _host_allowed(target: Target, entries: list[AllowEntry]) -> bool:
    for entry in entries:
        if entry.port is not None and entry.port != target.port:
            continue
        if target.address is not None and entry.address == target.address:
            return True
        if target.address is None and entry.address is None and entry.host == target.host:
            return True
    return False


def _address_allowed(address: IPAddress, port: int, entries: list[AllowEntry]) -> bool:
    address = _unmapped(address)
    if address.is_unspecified:
        return False
    if address_is_public(address):
        return True
    return any(entry.address == address and entry.port in (None, port) for entry in entries)


def _resolve(target: Target) -> list[IPAddress]:
    """The target's addresses, from one resolution (an IP literal is its own)."""
    if target.address is not None:
        return [target.address]
    try:
        answers = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchError(f"cannot resolve {target.host!r}: {exc}", code="resolution_failed", retryable=True) from exc
    addresses: list[IPAddress] = []
    for family, _type, _proto, _name, sockaddr in answers:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        try:
            address = _unmapped(ipaddress.ip_address(sockaddr[0]))
        except ValueError:
            continue
        if address not in addresses:
            addresses.append(address)
    return addresses


def destination_check(url: str, entries: list[AllowEntry]) -> tuple[Target, list[IPAddress]]:
    """Apply every rule to ``url``: the target and the addresses (resolved once) it may be dialled at."""
    target = target_parse(url)
    if not _host_allowed(target, entries):
        raise FetchError(f"host {target.host!r} (port {target.port}) is not in ORCHESTRATOR_HTTP_ALLOWED_HOSTS",
                         code="host_not_allowed")
    resolved = _resolve(target)
    addresses = [address for address in resolved if _address_allowed(address, target.port, entries)]
    if not addresses:
        shown = ", ".join(str(address) for address in resolved) or "no address"
        raise FetchError(f"{target.host!r} resolves to {shown}: not a public address, and no IP entry of "
                         f"ORCHESTRATOR_HTTP_ALLOWED_HOSTS names it with port {target.port}",
                         code="address_not_allowed")
    return target, addresses


# --- connecting to the address resolved -------------------------------------------------------------

class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to a fixed address; ``host`` is only what the Host header names."""

    def __init__(self, host: str, port: int, *, address: IPAddress, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.pinned_address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((str(self.pinned_address), self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    """HTTPS to a fixed address, with SNI and the certificate checked against the URL's host."""

    default_port = http.client.HTTPS_PORT

    def connect(self) -> None:
        super().connect()
        self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchError("the request took longer than its timeout", code="timeout", retryable=True)
    return left


def _network_error(exc: BaseException, url: str) -> FetchError:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return FetchError(f"TLS certificate of {url} refused: {exc}", code="tls_error")
    if isinstance(exc, TimeoutError):
        return FetchError(f"{url} did not answer in time", code="timeout", retryable=True)
    if isinstance(exc, OSError):
        return FetchError(f"cannot reach {url}: {exc}", code="connection_error", retryable=True)
    return FetchError(f"malformed answer from {url}: {type(exc).__name__}: {exc}", code="bad_response")


def _connect(target: Target, addresses: list[IPAddress], deadline: float) -> _PinnedHTTPConnection:
    connection_class = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    last_error: BaseException | None = None
    for address in addresses:
        connection = connection_class(target.host, target.port, address=address, timeout=_remaining(deadline))
        try:
            connection.connect()
            return connection
        except ssl.SSLCertVerificationError as exc:
            connection.close()
            raise _network_error(exc, target.url) from exc
        except OSError as exc:
            connection.close()
            last_error = exc
    raise _network_error(last_error or OSError("no address"), target.url)


def _read_capped(response: http.client.HTTPResponse, sock: socket.socket, cap: int, url: str,
                 deadline: float) -> bytes:
    declared = (response.getheader("Content-Length") or "").strip()
    if declared.isdigit() and int(declared) > cap:
        raise FetchError(f"response of {url} declares {declared} bytes, over the cap of {cap} bytes",
                         code="response_too_large")
    chunks: list[bytes] = []
    total = 0
    while True:
        sock.settimeout(_remaining(deadline))
        chunk = response.read1(min(READ_CHUNK_BYTES, cap + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > cap:
            raise FetchError(f"response of {url} is larger than the cap of {cap} bytes", code="response_too_large")


def _redirect_refused(exc: FetchError, location: str) -> FetchError:
    if exc.code not in REFUSAL_CODES:
        return exc
    return FetchError(f"redirect to {location!r} refused: {exc}", code="redirect_not_allowed")


def http_fetch(url: str, *, method: str = "GET", headers: dict[str, str] | None = None, timeout: float = 10.0,
               read_body: bool = True) -> FetchResult:
    """Fetch ``url`` under the rules of this module (see its docstring). The body (of an answer
    below 400, when ``read_body``) is read up to the cap; ``timeout`` bounds the whole exchange."""
    entries = allow_list()
    max_redirects = int(getattr(settings, "ORCHESTRATOR_HTTP_MAX_REDIRECTS", DEFAULT_MAX_REDIRECTS))
    cap = int(getattr(settings, "ORCHESTRATOR_HTTP_MAX_RESPONSE_BYTES", DEFAULT_MAX_RESPONSE_BYTES))
    deadline = time.monotonic() + timeout
    current = url
    redirects = 0
    while True:
        try:
            target, addresses = destination_check(current, entries)
        except FetchError as exc:
            raise (_redirect_refused(exc, current) if redirects else exc) from None
        connection = _connect(target, addresses, deadline)
        sock = connection.sock  # the response takes it over from the connection once it has headers
        try:
            try:
                connection.request(method, target.request_path, headers=dict(headers or {}))
                sock.settimeout(_remaining(deadline))
                response = connection.getresponse()
                location = response.getheader("Location")
                if response.status in REDIRECT_STATUSES and method in REDIRECTING_METHODS and location:
                    if redirects >= max_redirects:
                        if max_redirects <= 0:
                            raise FetchError(f"{target.url} redirects to {location!r}; redirects are off "
                                             "(ORCHESTRATOR_HTTP_MAX_REDIRECTS=0)", code="redirect_not_allowed")
                        raise FetchError(f"more than {max_redirects} redirects from {url}", code="too_many_redirects")
                    current = urllib.parse.urljoin(target.url, location)
                    redirects += 1
                    continue
                body = b""
                if read_body and response.status < 400 and method != "HEAD":
                    body = _read_capped(response, sock, cap, target.url, deadline)
                return FetchResult(status=response.status, body=body, url=target.url, redirects=redirects,
                                   headers={key.lower(): value for key, value in response.getheaders()})
            except (OSError, http.client.HTTPException) as exc:
                raise _network_error(exc, target.url) from exc
        finally:
            connection.close()
            sock.close()
