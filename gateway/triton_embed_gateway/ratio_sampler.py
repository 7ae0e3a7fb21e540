"""The gateway's root sampler: a trace-id ratio whose ratio ``triton_embed_gateway.sampling`` sets while it runs.

Its own module so that the OpenTelemetry SDK is imported only when tracing is on (``Tracing.from_environment``).
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes


class AdaptiveRatio(Sampler):
    """A trace-id ratio sampler whose ratio the controller sets while it runs (wrap it in ``ParentBased``)."""

    def __init__(self, ratio: float = 1.0) -> None:
        """Start at ``ratio`` (0..1)."""
        self._inner = TraceIdRatioBased(ratio)

    @property
    def ratio(self) -> float:
        """The share of new traces sampled, 0..1."""
        return float(self._inner.rate)

    def set(self, ratio: float) -> None:
        """Sample ``ratio`` (0..1) of new traces from now on."""
        self._inner = TraceIdRatioBased(ratio)

    def should_sample(  # noqa: PLR0917 - the SDK's Sampler signature
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        """Sample by the trace id against the current ratio (``TraceIdRatioBased``)."""
        return self._inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        """``AdaptiveRatio{ratio}``."""
        return f"AdaptiveRatio{{{self.ratio}}}"
