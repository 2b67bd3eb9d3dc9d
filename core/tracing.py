"""OpenTelemetry traces, off unless the standard ``OTEL_*`` variables turn them on.

On when ``OTEL_TRACES_EXPORTER`` names an exporter (not ``none``) and ``OTEL_SDK_DISABLED`` is
not ``true``; decided once per process. Off, every hook below returns at its first line and
the OpenTelemetry SDK is never imported.

On, ``tracing_start`` (called once per process from ``CoreConfig.ready``) installs a tracer
provider (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), the exporters named by
``OTEL_TRACES_EXPORTER`` (``console``: one JSON document per span on stdout, or appended to
``ORCHESTRATOR_OTEL_CONSOLE_FILE``; ``otlp``: when ``opentelemetry-exporter-otlp`` is
installed) and the Django, psycopg and Redis instrumentation. One trace then runs from an
API request through ``job enqueue`` (the job row keeps the W3C ``traceparent`` of that span),
the worker's ``job <type>`` span (its child, however much later and in whichever process it
runs), to the ``run step`` spans and the jobs those enqueue in turn.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

logger = logging.getLogger("orchestrator.tracing")

TRACER_NAME = "orchestrator"
ATTRIBUTE_PREFIX = "orchestrator."


def _enabled_by_environment() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    return bool(exporters) and exporters != "none"


WANTED = _enabled_by_environment()  # decided once per process
ENABLED = False  # the hooks' switch: on once ``tracing_start`` has set tracing up
_tracer = None
_started = False


def _attributes(values: dict[str, Any]) -> dict[str, Any]:
    """``orchestrator.<name>`` attributes; None values are left out (OpenTelemetry has no null)."""
    return {f"{ATTRIBUTE_PREFIX}{key}": value for key, value in values.items() if value is not None}


# --- hooks (each returns at once when tracing is off) ------------------------------------------

def traced(name: str, *, attributes: Callable[..., dict] | None = None,
           result_attributes: Callable[[Any], dict] | None = None):
    """Run the decorated function in a span ``name``; ``attributes(*args, **kwargs)`` and
    ``result_attributes(result)`` give its ``orchestrator.*`` attributes."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if not ENABLED:
                return function(*args, **kwargs)
            start = _attributes(attributes(*args, **kwargs)) if attributes is not None else None
            with _tracer.start_as_current_span(name, attributes=start) as span:
                result = function(*args, **kwargs)
                if result_attributes is not None:
                    span.set_attributes(_attributes(result_attributes(result)))
                return result

        return wrapper

    return decorate


def traced_job(function):
    """Run a claimed job (the decorated function's first argument) in a span that continues the
    trace its ``traceparent`` carries, as a child of the span that enqueued it."""

    @functools.wraps(function)
    def wrapper(job, *args, **kwargs):
        if not ENABLED:
            return function(job, *args, **kwargs)
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        parent = extract({"traceparent": job.traceparent}) if job.traceparent else None
        step = job.payload.get("step") if isinstance(job.payload, dict) else None
        attributes = _attributes({"job_id": job.pk, "job_type": job.type, "run_id": job.run_id,
                                  "attempt": job.attempts, "organization_id": job.organization_id,
                                  "project_id": job.project_id,
                                  "step_id": step if isinstance(step, int) and not isinstance(step, bool) else None})
        with _tracer.start_as_current_span(f"job {job.type}", context=parent, kind=SpanKind.CONSUMER,
                                           attributes=attributes) as span:
            outcome = function(job, *args, **kwargs)
            span.set_attribute(f"{ATTRIBUTE_PREFIX}outcome", str(outcome))
            return outcome

    return wrapper


def tracing_span(name: str, **attributes):
    """A context manager: a child span of the current one with ``orchestrator.*`` attributes
    (a shared no-op when tracing is off)."""
    if not ENABLED:
        return _NOOP
    return _tracer.start_as_current_span(name, attributes=_attributes(attributes))


def tracing_traceparent() -> str:
    """The W3C ``traceparent`` of the current span ("" when off or outside a span)."""
    if not ENABLED:
        return ""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent", "")


def tracing_trace_id() -> str:
    """The current trace id, 32 hex digits ("" when off or outside a span)."""
    if not ENABLED:
        return ""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else ""


class _NoSpan:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NOOP = _NoSpan()


# --- set-up ------------------------------------------------------------------------------------

def _exporters() -> list:
    """The span processors of ``OTEL_TRACES_EXPORTER`` (comma-separated)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    processors = []
    for name in (part.strip().lower() for part in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")):
        if name in ("", "none"):
            continue
        if name == "console":
            path = os.environ.get("ORCHESTRATOR_OTEL_CONSOLE_FILE", "")
            out = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (kept for the process's life)
            exporter = ConsoleSpanExporter(out=out) if out else ConsoleSpanExporter()
            processors.append(SimpleSpanProcessor(exporter))
        elif name == "otlp":
            exporter = _otlp_exporter()
            if exporter is not None:
                processors.append(BatchSpanProcessor(exporter))
        else:
            logger.warning("OTEL_TRACES_EXPORTER: unknown exporter %r ignored (console, otlp or none)", name)
    return processors


def _otlp_exporter():
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                              os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")).strip().lower()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        logger.warning("OTEL_TRACES_EXPORTER=otlp needs opentelemetry-exporter-otlp; no spans are exported")
        return None
    return OTLPSpanExporter()


def tracing_start(*, provider=None) -> bool:
    """Set tracing up for this process (once): the tracer provider, its exporters and the
    instrumentation. ``provider``: use this one (tests), and switch tracing on. Returns whether
    tracing is on."""
    global ENABLED, _tracer, _started
    if provider is None and (not WANTED or _started):
        return ENABLED
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    if provider is None:
        provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get(
            "OTEL_SERVICE_NAME", "orchestrator-console")}))
        for processor in _exporters():
            provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
    _instrument(provider)
    _tracer = provider.get_tracer(TRACER_NAME)
    ENABLED = _started = True
    return True


def _instrument(provider) -> None:
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    DjangoInstrumentor().instrument(tracer_provider=provider)
    PsycopgInstrumentor().instrument(tracer_provider=provider, skip_dep_check=True)
    RedisInstrumentor().instrument(tracer_provider=provider)


def tracing_stop() -> None:
    """Undo ``tracing_start`` (tests): the instrumentation is removed and the hooks are off."""
    global ENABLED, _tracer, _started
    if not _started:
        return
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    for instrumentor in (DjangoInstrumentor(), PsycopgInstrumentor(), RedisInstrumentor()):
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
    ENABLED = _started = False
    _tracer = None
