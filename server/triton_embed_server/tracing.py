"""OpenTelemetry's standard variables as ``tritonserver --trace-config`` flags: one switch turns Triton's traces on.

``OTEL_EXPORTER_OTLP_ENDPOINT=http://host:4318`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, the full URL) makes
Triton export OpenTelemetry spans over OTLP/HTTP (``InferRequest`` -> ``embed`` -> ``tokenizer`` / ``encoder`` ->
``compute``, with Triton's timestamps as events); ``OTEL_SERVICE_NAME`` (default ``triton-embed``) and
``OTEL_RESOURCE_ATTRIBUTES`` become its resource; ``OTEL_TRACES_SAMPLER`` ``traceidratio`` or
``parentbased_traceidratio`` with ``OTEL_TRACES_SAMPLER_ARG`` p sets Triton's 1-in-N ``rate`` to round(1/p) (a
request that carries a W3C ``traceparent`` is traced whatever the rate). Unset, no flag is added and nothing is
traced. The gateway reads the same variables (``triton_embed_gateway.tracing``).

Stdlib only, Python >= 3.10: run as a script (``python3 tracing.py``) it prints the flags, one per line, for the
compose deployment's entrypoint (docker/triton-entrypoint.sh).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from urllib.parse import urlsplit

ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
DEFAULT_SERVICE_NAME = "triton-embed"


class TraceConfigError(ValueError):
    """An OpenTelemetry variable Triton cannot follow; the message names the variable, what works and the value."""


def enabled(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for traces (an OTLP endpoint is set and ``OTEL_SDK_DISABLED`` is not true)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(environ.get(TRACES_ENDPOINT, "").strip() or environ.get(ENDPOINT, "").strip())


def traces_url(environ: Mapping[str, str]) -> str:
    """Where spans go: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``.

    Raises:
        TraceConfigError: the URL is not ``http://host:port...`` (Triton's exporter speaks OTLP over plain HTTP), or
            ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` asks for something other than
            ``http/protobuf`` or ``http/json``.
    """
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(name, "").strip()
        if protocol and protocol not in ("http/protobuf", "http/json"):
            raise TraceConfigError(
                f"{name} must be http/protobuf or http/json (Triton exports OTLP over HTTP); got {protocol!r}"
            )
    name = TRACES_ENDPOINT if environ.get(TRACES_ENDPOINT, "").strip() else ENDPOINT
    given = environ.get(name, "").strip()
    url = given if name == TRACES_ENDPOINT else given.rstrip("/") + "/v1/traces"
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise TraceConfigError(
            f"{name} must be an http:// URL with a host, such as http://127.0.0.1:4318 (Triton's OTLP exporter "
            f"has no TLS); got {given!r}"
        )
    return url


def resource(environ: Mapping[str, str]) -> dict[str, str]:
    """The resource attributes: ``OTEL_RESOURCE_ATTRIBUTES`` (``key=value,...``) and ``service.name``.

    ``service.name`` is ``OTEL_SERVICE_NAME``, else the attributes' own, else ``triton-embed``.

    Raises:
        TraceConfigError: an entry of ``OTEL_RESOURCE_ATTRIBUTES`` is not ``key=value``.
    """
    attributes: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","))):
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise TraceConfigError(f"OTEL_RESOURCE_ATTRIBUTES entries must be key=value; got {entry!r}")
        attributes[key.strip()] = value.strip()
    service = environ.get("OTEL_SERVICE_NAME", "").strip() or attributes.get("service.name") or DEFAULT_SERVICE_NAME
    attributes["service.name"] = service
    return attributes


def triton_rate(environ: Mapping[str, str]) -> int:
    """Triton's ``rate`` (1 request in N): round(1/p) for a ratio sampler with ``OTEL_TRACES_SAMPLER_ARG`` p, else 1.

    Raises:
        TraceConfigError: the sampler's argument is not a number in (0, 1].
    """
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip()
    if sampler not in ("traceidratio", "parentbased_traceidratio"):
        return 1
    given = environ.get("OTEL_TRACES_SAMPLER_ARG", "1").strip() or "1"
    try:
        ratio = float(given)
    except ValueError:
        ratio = -1.0
    if not 0 < ratio <= 1:
        raise TraceConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a ratio in (0, 1]; got {given!r}")
    return max(1, round(1 / ratio))


def triton_trace_args(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The ``--trace-config`` flags that ``environ``'s OpenTelemetry variables ask for; none when tracing is off.

    Raises:
        TraceConfigError: a variable Triton cannot follow (:func:`traces_url`, :func:`resource`,
            :func:`triton_rate`).
    """
    if not enabled(environ):
        return ()
    url = traces_url(environ)
    parts = urlsplit(url)
    args = [
        "--trace-config=mode=opentelemetry",
        f"--trace-config=opentelemetry,url={parts.netloc}{parts.path or '/v1/traces'}",
        "--trace-config=level=TIMESTAMPS",
        f"--trace-config=rate={triton_rate(environ)}",
    ]
    args += [f"--trace-config=opentelemetry,resource={key}={value}" for key, value in resource(environ).items()]
    return tuple(args)


if __name__ == "__main__":
    try:
        print("\n".join(triton_trace_args(os.environ)))
    except TraceConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
