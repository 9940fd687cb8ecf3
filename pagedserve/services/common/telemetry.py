"""OpenTelemetry set-up and trace-context propagation.

Each service calls ``setup_tracing`` once at start. Spans are exported with OTLP when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, printed when ``OTEL_TRACES_EXPORTER=console``, and not
exported otherwise. A request's trace context travels as W3C ``traceparent`` / ``tracestate``
strings: in gRPC metadata, in the Redis record and in the worker's plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def setup_tracing(service_name: str) -> trace.Tracer:
    """Installs a tracer provider for this process and returns a tracer for ``service_name``.

    Reads ``OTEL_EXPORTER_OTLP_ENDPOINT`` and ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``,
    ``none``) when called, not at import.
    """
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter_name == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter_name != "none" and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return trace.get_tracer(service_name)


def shutdown_tracing() -> None:
    """Flushes spans that are still buffered (call at exit)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def inject(span_context: otel_context.Context | None = None) -> dict[str, str]:
    """The trace context (current, or given) as W3C carrier strings."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=span_context)
    return carrier


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """A context whose parent span is the one described by the carrier strings."""
    return _PROPAGATOR.extract(dict(carrier))


def metadata_to_carrier(metadata: object) -> dict[str, str]:
    """gRPC invocation metadata (sequence of key/value pairs) as a carrier dict."""
    return {key: value for key, value in (metadata or ()) if isinstance(value, str)}
