"""``Idempotency-Key`` on every POST (DESIGN §2.3, seed 001 §4.1 and §8.5).

A key is stored per (organization, caller, key, endpoint) with the request's hash and, once
the request is done, its response, for ``ORCHESTRATOR_IDEMPOTENCY_TTL_S`` (24 h):

* the first request inserts the row ``in_flight`` and **commits** it before it runs, so a
  concurrent duplicate sees it and answers ``409 idempotency_key_in_use``;
* the request then runs in a transaction that also stores its response (status, content
  type, body byte for byte): the effect and the stored answer commit together, so a crash
  between the two cannot happen and a retry never repeats the effect;
* the same key with the same body answers the stored status and body again (with
  ``Idempotent-Replayed: true``); with another body ``422 idempotency_key_reused``;
* responses that say "try again" (429, 5xx) are not stored: the row is released and the
  next request with the key runs afresh;
* a row left in flight by a request that crashed is taken over after
  ``ORCHESTRATOR_IDEMPOTENCY_IN_FLIGHT_TIMEOUT_S``; an expired row counts as absent.

The caller is the authenticated user (its API token and its session are one caller). Keys are
the caller's own, as in Stripe's API: another user of the organization sending the same key
has its own request processed and never receives this caller's stored answer (nor its 409 or
422).

No library does this right for DRF (the known one runs concurrent duplicates twice), so it
is ours. ``IdempotentViewMixin`` applies it to every POST of a view.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import parse_qsl

from django.conf import settings
from django.db import IntegrityError, transaction
from django.http import HttpResponse
from django.http.request import RawPostDataException
from django.utils import timezone

from core.errors import IdempotencyKeyInUse, IdempotencyKeyReused, ValidationFailed
from core.models import IdempotencyRecord

logger = logging.getLogger("orchestrator.api")

HEADER = "Idempotency-Key"
REPLAY_HEADER = "Idempotent-Replayed"
KEY_MAX_LENGTH = 255


@dataclass(frozen=True)
class Claim:
    """This request owns the in-flight row ``record_id`` (while its ``token`` is the row's)."""

    record_id: int
    token: str


@dataclass(frozen=True)
class StoredResponse:
    status: int
    content_type: str
    body: bytes

    def as_http_response(self) -> HttpResponse:
        response = HttpResponse(self.body, status=self.status, content_type=self.content_type or None)
        response[REPLAY_HEADER] = "true"
        return response


def idempotency_key_of(request) -> str | None:
    """The request's key, None without one; ``400 validation_error`` when it is malformed."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not key or len(key) > KEY_MAX_LENGTH or not key.isascii() or not key.isprintable():
        raise ValidationFailed("invalid Idempotency-Key header", errors={
            HEADER: [f"1 to {KEY_MAX_LENGTH} printable ASCII characters"]})
    return key


def request_hash(*, method: str, query_string: str, body: bytes) -> str:
    """sha256 of the method, the sorted query and the body (canonical JSON when it parses)."""
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False).encode("utf-8")
    except Exception:  # not JSON (or too deep to re-encode): the raw bytes
        canonical = body
    digest = hashlib.sha256()
    digest.update(method.upper().encode())
    digest.update(b"\n")
    digest.update(json.dumps(sorted(parse_qsl(query_string, keep_blank_values=True))).encode("utf-8"))
    digest.update(b"\n")
    digest.update(canonical)
    return digest.hexdigest()


def idempotency_claim(*, organization_id: int, user_id: int, key: str, endpoint: str,
                      digest: str) -> Claim | StoredResponse:
    """Own the caller's key (insert, or take over an expired or abandoned row) or answer from its row.

    Raises ``IdempotencyKeyReused`` (another body) or ``IdempotencyKeyInUse`` (in flight).
    The insert commits at once: it must not run inside a transaction.
    """
    ttl = timedelta(seconds=settings.ORCHESTRATOR_IDEMPOTENCY_TTL_S)
    in_flight_timeout = timedelta(seconds=settings.ORCHESTRATOR_IDEMPOTENCY_IN_FLIGHT_TIMEOUT_S)
    for _ in range(5):
        now = timezone.now()
        token = uuid.uuid4().hex
        fresh = {"request_hash": digest, "status": IdempotencyRecord.Status.IN_FLIGHT, "lock_token": token,
                 "locked_at": now, "created_at": now, "expires_at": now + ttl, "completed_at": None,
                 "response_status": None, "response_content_type": "", "response_body": None}
        # Read first: a replay or a duplicate in flight then never takes a write lock.
        record = IdempotencyRecord.objects.filter(organization_id=organization_id, user_id=user_id, key=key,
                                                  endpoint=endpoint).first()
        if record is None:
            try:
                with transaction.atomic(durable=True):
                    record = IdempotencyRecord.objects.create(organization_id=organization_id, user_id=user_id,
                                                              key=key, endpoint=endpoint, **fresh)
                return Claim(record.pk, token)
            except IntegrityError:  # a concurrent request inserted it first: read it again
                continue
        if record.expires_at <= now:
            # Expired: as if absent. The conditional update lets one request win the row.
            if IdempotencyRecord.objects.filter(pk=record.pk, expires_at__lte=now).update(**fresh):
                return Claim(record.pk, token)
            continue
        if record.request_hash != digest:
            raise IdempotencyKeyReused(
                f"Idempotency-Key {key!r} was used on {endpoint} with another request body; "
                f"use a new key for a new request", key=key)
        if record.status == IdempotencyRecord.Status.DONE:
            return StoredResponse(record.response_status, record.response_content_type,
                                  bytes(record.response_body or b""))
        if record.locked_at <= now - in_flight_timeout:
            # The request that owned it crashed (or is far past the timeout): take it over.
            if IdempotencyRecord.objects.filter(pk=record.pk, status=IdempotencyRecord.Status.IN_FLIGHT,
                                                lock_token=record.lock_token).update(lock_token=token,
                                                                                     locked_at=now):
                logger.warning("idempotency key %r on %s: took over an abandoned in-flight request",
                               key, endpoint)
                return Claim(record.pk, token)
            continue
        raise IdempotencyKeyInUse(
            f"a request with Idempotency-Key {key!r} on {endpoint} is still in flight; retry later",
            key=key)
    raise IdempotencyKeyInUse(f"Idempotency-Key {key!r} on {endpoint} is contended; retry later", key=key)


def idempotency_store(claim: Claim, *, status: int, content_type: str, body: bytes) -> bool:
    """Store the response of an owned key (in the caller's transaction). False: not owned."""
    return bool(IdempotencyRecord.objects.filter(pk=claim.record_id, lock_token=claim.token).update(
        status=IdempotencyRecord.Status.DONE, response_status=status, response_content_type=content_type,
        response_body=body, completed_at=timezone.now()))


def idempotency_stored(claim: Claim) -> bool:
    return IdempotencyRecord.objects.filter(pk=claim.record_id, lock_token=claim.token,
                                            status=IdempotencyRecord.Status.DONE).exists()


def idempotency_release(claim: Claim) -> None:
    """Forget an owned in-flight key: the next request with it runs afresh."""
    IdempotencyRecord.objects.filter(pk=claim.record_id, lock_token=claim.token,
                                     status=IdempotencyRecord.Status.IN_FLIGHT).delete()


def idempotency_prune(*, now=None) -> int:
    """Delete expired rows; returns how many."""
    deleted, _ = IdempotencyRecord.objects.filter(expires_at__lte=now or timezone.now()).delete()
    return deleted


def response_is_stored(status: int) -> bool:
    """Final answers are replayed; "try again" answers (429, 5xx) are not."""
    return status < 500 and status != 429


class _LostClaim(Exception):
    pass


class _Replay(Exception):
    def __init__(self, response: HttpResponse):
        self.response = response


class IdempotentViewMixin:
    """Applies ``Idempotency-Key`` to every POST of a DRF view.

    A view tells which organization a request acts for with ``idempotency_organization_id``
    (None: the key is not applied, e.g. the body is too broken to name one; such a request
    fails validation anyway). ``idempotency_atomic`` may return False for a handler that must
    commit before it returns (a handler that waits for a worker).
    """

    def idempotency_organization_id(self, request) -> int | None:
        raise NotImplementedError

    def idempotency_atomic(self, request) -> bool:
        return True

    def dispatch(self, request, *args, **kwargs):
        # DRF's APIView.dispatch, with the key claimed between the checks and the handler.
        self.args = args
        self.kwargs = kwargs
        request = self.initialize_request(request, *args, **kwargs)
        self.request = request
        self.headers = self.default_response_headers
        try:
            self.initial(request, *args, **kwargs)
            if request.method.lower() in self.http_method_names:
                handler = getattr(self, request.method.lower(), self.http_method_not_allowed)
            else:
                handler = self.http_method_not_allowed
            claim = self._idempotency_begin(request) if request.method == "POST" else None
            if claim is None:
                response = handler(request, *args, **kwargs)
            else:
                response = self._run_claimed(claim, handler, request, *args, **kwargs)
        except _Replay as replay:
            response = replay.response
        except Exception as exc:
            response = self.handle_exception(exc)
        self.response = self.finalize_response(request, response, *args, **kwargs)
        return self.response

    def _idempotency_begin(self, request) -> Claim | None:
        key = idempotency_key_of(request)
        if key is None:
            return None
        raw = request._request
        try:
            body = raw.body  # before DRF parses the stream, which it does not keep
        except RawPostDataException:  # a form body already read (CSRF check): DRF answers 415
            return None
        digest = request_hash(method=request.method, query_string=raw.META.get("QUERY_STRING", ""), body=body)
        user_id = getattr(request.user, "pk", None)
        if user_id is None:  # no caller to own the key (the endpoints that take POSTs require one)
            return None
        organization_id = self.idempotency_organization_id(request)
        if organization_id is None:
            return None
        outcome = idempotency_claim(organization_id=organization_id, user_id=user_id, key=key,
                                    endpoint=raw.path[:255], digest=digest)
        if isinstance(outcome, StoredResponse):
            raise _Replay(outcome.as_http_response())
        return outcome

    def _run_claimed(self, claim: Claim, handler, request, *args, **kwargs):
        body_done = False
        atomic = self.idempotency_atomic(request)
        try:
            with transaction.atomic() if atomic else nullcontext():
                try:
                    response = handler(request, *args, **kwargs)
                except Exception as exc:
                    response = self.handle_exception(exc)  # re-raises what is not an API error
                response = self.finalize_response(request, response, *args, **kwargs)
                if hasattr(response, "render"):
                    response.render()
                stored = response_is_stored(response.status_code)
                if stored and not idempotency_store(claim, status=response.status_code,
                                                    content_type=response.get("Content-Type", ""),
                                                    body=bytes(response.content)):
                    # Ran past the in-flight timeout and another request took the key over: that
                    # one owns the effect. Undo ours (when it is in this transaction) and say so.
                    if atomic:
                        raise _LostClaim()
                    logger.warning("idempotency key on %s was taken over while its request ran",
                                   request._request.path)
                body_done = True
        except _LostClaim:
            raise IdempotencyKeyInUse("this request ran past the in-flight timeout and another request with "
                                      "the same Idempotency-Key took over; nothing was changed") from None
        except BaseException:
            # An exception after the body finished came from the commit or an after-commit
            # callback: when the answer was committed, it stands (the callback is logged).
            if body_done and stored and idempotency_stored(claim):
                logger.exception("after-commit callback failed for %s; the stored response stands",
                                 request._request.path)
                return response
            idempotency_release(claim)
            raise
        if not stored:
            idempotency_release(claim)
        return response
