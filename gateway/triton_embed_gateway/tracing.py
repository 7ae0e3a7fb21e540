"""The gateway's OpenTelemetry traces: a server span per API request, a client span per Triton request.

On when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, as Triton's traces are
(``triton_embed_server.tracing``); the OpenTelemetry SDK reads its standard variables itself: the exporter's
endpoint and headers, ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (``service.name`` defaults to
``triton-embed``), the sampler (``OTEL_TRACES_SAMPLER``) and the batch processor's delays. Spans go over OTLP/HTTP
(protobuf). With ``OTEL_TRACES_SAMPLER`` unset, the share of requests traced follows load
(``triton_embed_gateway.sampling``).

The server span continues the caller's W3C ``traceparent``; the client span's context goes to Triton in the gRPC
metadata only when the span is sampled, since Triton traces every request that carries one. One trace then shows
caller -> gateway -> ``embed`` -> ``tokenizer`` -> ``encoder``. Off, nothing is made and nothing is sent.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from triton_embed_protocol import REFUSAL_REASONS, refusal_reason

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider

    from triton_embed_gateway.ratio_sampler import AdaptiveRatio

ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
DEFAULT_SERVICE_NAME = "triton-embed"


def overload_rule(message: str) -> str | None:
    """The knob a refusal's reason code names (``triton_embed_protocol.REFUSAL_REASONS``); None for another message.

    One of ``MAX_IN_FLIGHT``, ``FLOOD_LATENCY_MS``, ``BULK_QUEUE``, ``latency_budget_ms``.
    """
    reason = refusal_reason(message)
    return None if reason is None else REFUSAL_REASONS[reason]


def tracing_enabled(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for traces: an OTLP endpoint set and ``OTEL_SDK_DISABLED`` not true."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINTS)


class Tracing:
    """The gateway's tracer; :meth:`off` makes one that records nothing and costs nothing."""

    def __init__(self, provider: TracerProvider | None = None, sampler: AdaptiveRatio | None = None) -> None:
        """Trace with ``provider`` (an SDK ``TracerProvider``; None: off).

        ``sampler``: its root sampler, when it follows load (None: a fixed sampler).
        """
        self._provider = provider
        self.sampler = sampler
        self._tracer = provider.get_tracer("triton_embed_gateway") if provider is not None else None

    @classmethod
    def off(cls) -> Tracing:
        """No traces."""
        return cls(None)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Tracing:
        """Traces to the OTLP endpoint of OpenTelemetry's variables (``os.environ``), or :meth:`off` without one."""
        environ = os.environ if environ is None else environ
        if not tracing_enabled(environ):
            return cls.off()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased

        from triton_embed_gateway.ratio_sampler import AdaptiveRatio
        from triton_embed_gateway.sampling import adaptive

        resource = Resource.create({})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
        sampler = AdaptiveRatio() if adaptive(environ) else None  # OTEL_TRACES_SAMPLER set: the SDK's own
        provider = TracerProvider(resource=resource, sampler=ParentBased(sampler) if sampler else None)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider, sampler)

    @property
    def on(self) -> bool:
        """Whether spans are made."""
        return self._tracer is not None

    @contextlib.contextmanager
    def request(self, route: str, method: str, headers: Mapping[str, str]) -> Iterator[None]:
        """The server span of one API request (``METHOD route``), a child of the caller's ``traceparent`` if any.

        Code inside sets its attributes on ``trace.get_current_span()`` (:func:`annotate`).
        """
        if self._tracer is None:
            yield
            return
        attributes = {"http.route": route, "http.request.method": method}
        with self._tracer.start_as_current_span(
            f"{method} {route}", context=propagate.extract(headers), kind=SpanKind.SERVER, attributes=attributes
        ):
            yield

    @contextlib.contextmanager
    def triton_call(self, model: str, texts: int) -> Iterator[dict[str, str]]:
        """The client span of one Triton request; yields the gRPC metadata to send with it.

        The metadata holds the span's ``traceparent`` when the span is sampled, else nothing.
        """
        if self._tracer is None:
            yield {}
            return
        attributes: dict[str, str | int] = {
            "rpc.system": "grpc",
            "rpc.method": "ModelInfer",
            "triton.model": model,
            "texts": texts,
        }
        with self._tracer.start_as_current_span(f"triton {model}", kind=SpanKind.CLIENT, attributes=attributes) as span:
            carrier: dict[str, str] = {}
            if span.get_span_context().trace_flags.sampled:
                propagate.inject(carrier)
            yield carrier

    def shutdown(self) -> None:
        """Export the spans still queued and stop (the gateway's shutdown)."""
        if self._provider is not None:
            self._provider.shutdown()


def annotate(**attributes: str | int | float) -> None:
    """Set ``attributes`` on the current span (a no-op without one)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


def record_status(status: int, message: str | None = None) -> None:
    """The current server span's HTTP status; on an error its message, and the overload rule a refusal names."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("http.response.status_code", status)
    if status >= 400 and message:
        span.set_attribute("error.message", message)
        if rule := overload_rule(message):
            span.set_attribute("overload.rule", rule)
            span.set_attribute("overload.message", message)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, message))
