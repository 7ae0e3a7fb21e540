"""OpenTelemetry's standard variables as Triton's --trace-config flags, and the errors a bad one gets."""

from __future__ import annotations

import pytest
from triton_embed_gateway.tracing import overload_rule, tracing_enabled
from triton_embed_server.tracing import TraceConfigError, triton_trace_args


def test_the_endpoint_alone_turns_every_request_traced_to_its_v1_traces():
    assert triton_trace_args({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}) == (
        "--trace-config=mode=opentelemetry",
        "--trace-config=opentelemetry,url=collector:4318/v1/traces",
        "--trace-config=level=TIMESTAMPS",
        "--trace-config=rate=1",
        "--trace-config=opentelemetry,resource=service.name=triton-embed",
    )


def test_the_traces_endpoint_the_service_name_the_resource_and_a_ratio_sampler_are_followed():
    args = triton_trace_args(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://ignored:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4318/custom/traces",
            "OTEL_SERVICE_NAME": "embeddings",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod, service.name=overridden",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.01",
        }
    )
    assert "--trace-config=opentelemetry,url=jaeger:4318/custom/traces" in args
    assert "--trace-config=rate=100" in args
    assert "--trace-config=opentelemetry,resource=deployment.environment=prod" in args
    assert "--trace-config=opentelemetry,resource=service.name=embeddings" in args  # OTEL_SERVICE_NAME wins


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318"},
            "OTEL_EXPORTER_OTLP_ENDPOINT must be an http:// URL",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "got 'collector:4318'"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf or http/json (Triton exports OTLP over HTTP); "
            "got 'grpc'",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_RESOURCE_ATTRIBUTES": "team"},
            "OTEL_RESOURCE_ATTRIBUTES entries must be key=value; got 'team'",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_TRACES_SAMPLER": "traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "2",
            },
            "OTEL_TRACES_SAMPLER_ARG must be a ratio in (0, 1]; got '2'",
        ),
    ],
)
def test_a_variable_triton_cannot_follow_is_named_with_what_works_and_the_value(environ, message):
    with pytest.raises(TraceConfigError) as caught:
        triton_trace_args(environ)
    assert message in str(caught.value)


def test_the_gateway_follows_the_same_switch():
    assert not tracing_enabled({})
    assert tracing_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "TRUE"})


@pytest.mark.parametrize(
    ("message", "rule"),
    [
        ("in ensemble 'embed', overloaded[door]: 32 texts are in flight and this request has 1 text", "MAX_IN_FLIGHT"),
        ("overloaded[flood]: 20 texts are in flight and this request has 1 text", "FLOOD_LATENCY_MS"),
        ("overloaded[bulk_queue]: 2048 bulk texts are waiting and this request has 64", "BULK_QUEUE"),
        ("overloaded[budget]: the request waited 181 ms in the encoder's queue", "latency_budget_ms"),
        ("overloaded: 32 texts are in flight", None),  # no reason code: not one of the encoder's refusals
        ("overloaded[nonsense]: 32 texts are in flight", None),
        ("input 'TEXT' row 0 has 70000 bytes; the limit is 65536 bytes", None),
    ],
)
def test_a_refusal_names_its_rule(message, rule):
    assert overload_rule(message) == rule
