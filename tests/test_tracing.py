"""OpenTelemetry traces as an operator receives them: one switch, one trace from the caller through every stage.

A real tritonserver and a real gateway process, both started with ``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at a small
OTLP/HTTP receiver on a loopback port (triton_embed_gateway.otlp), which decodes what they export.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest
from helpers import running_until_ready, scrape
from test_gateway import post
from triton_embed_gateway.otlp import OtlpReceiver, ReceivedSpan
from triton_embed_gateway.traces import STAGES
from triton_embed_server.embedded import EmbeddedServer, free_port
from triton_embed_server.supervisor import ADMIN_HEADER
from triton_embed_server.tracing import triton_trace_args

from bench.serving import variant_repository

SERVICE = "triton-embed-traced"
SERVER_KIND, CLIENT_KIND = 2, 3  # OTLP's SpanKind
TRITON_STEPS = {"InferRequest", "embed", "tokenizer", "encoder"}


@contextlib.contextmanager
def gateway_process(server, env: dict[str, str], log):
    """The gateway in front of ``server``, as ``make serve`` starts it, with ``env`` added; yields its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "triton_embed_gateway", "--triton", server.grpc_url, "--port", str(port)]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    base = f"http://127.0.0.1:{port}"
    with running_until_ready(process, log, f"{base}/health", "the gateway", timeout_s=30):
        yield base


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(receiver, gateway base URL, server): Triton and the gateway exporting to the receiver; response cache off."""
    tmp = tmp_path_factory.mktemp("traced")
    with OtlpReceiver(save=tmp / "spans.jsonl") as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        repo = variant_repository(tmp / "repo", None)
        with (
            EmbeddedServer(
                model_repository=repo,
                http_port=0,
                grpc_port=0,
                metrics_port=0,
                log_file=tmp / "log",
                extra_args=triton_trace_args(env),
            ) as server,
            gateway_process(server, env, tmp / "gateway.log") as base,
        ):
            yield receiver, base, server


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    """The spans of one request by name (each once), but Triton's ``compute`` spans, one under each step."""
    named = [s for s in spans if s.name != "compute"]
    assert len(named) == len({s.name for s in named}), [s.name for s in named]
    return {s.name: s for s in named}


def carried_to_triton(receiver: OtlpReceiver, send: Callable[[], str], names: set[str]) -> list[ReceivedSpan]:
    """The spans of the first of up to three requests whose trace holds every name of ``names``.

    ``send()`` sends one request and returns its trace id. Triton 2.51's gRPC front end now and then reads a
    caller's ``traceparent`` past its end and starts a trace of its own (docs/troubleshooting.md): the next try is
    another request. A caller whose context never reaches Triton fails all three.
    """
    missed = []
    for _ in range(3):
        trace_id = send()
        try:
            return receiver.wait_for(trace_id, names)
        except AssertionError as exc:
            missed.append(str(exc))
    raise AssertionError(f"no request of three carried its trace to Triton: {missed}")


def test_one_trace_follows_a_request_from_the_caller_through_the_gateway_and_every_triton_step(traced):
    receiver, base, _ = traced
    caller = secrets.token_hex(8)

    def send() -> str:
        trace_id = secrets.token_hex(16)
        status, body, _ = post(
            f"{base}/v1/embeddings",
            {"input": f"followed through every stage {trace_id}"},
            {"traceparent": f"00-{trace_id}-{caller}-01"},
        )
        assert status == 200 and len(body["data"]) == 1
        return trace_id

    spans = by_name(carried_to_triton(receiver, send, {"POST /v1/embeddings", "triton embed", *TRITON_STEPS}))
    trace_id = spans["POST /v1/embeddings"].trace_id
    api, call, infer = spans["POST /v1/embeddings"], spans["triton embed"], spans["InferRequest"]
    assert (api.parent, api.kind) == (caller, SERVER_KIND)  # continues the caller's trace
    assert (call.parent, call.kind) == (api.span_id, CLIENT_KIND)
    assert infer.parent == call.span_id  # Triton's root span is the gateway's call
    assert spans["embed"].parent == infer.span_id
    assert spans["tokenizer"].parent == spans["embed"].span_id and spans["encoder"].parent == spans["embed"].span_id
    computes = [s for s in receiver.trace(trace_id) if s.name == "compute"]  # each step's queue and compute times
    assert sorted(s.parent for s in computes) == sorted([spans["tokenizer"].span_id, spans["encoder"].span_id])
    assert all({"COMPUTE_START", "COMPUTE_END"} <= set(s.events) for s in computes), [s.events for s in computes]
    assert {s.service for s in spans.values()} == {SERVICE}
    assert api.attributes["http.route"] == "/v1/embeddings" and api.attributes["http.response.status_code"] == 200
    assert api.attributes["texts"] == 1 and api.attributes["tokens"] > 2 and api.attributes["model"] == "embed"
    assert call.attributes["texts"] == 1 and call.attributes["triton.model"] == "embed"


def test_a_request_without_a_traceparent_starts_a_trace_that_still_reaches_triton(traced):
    receiver, base, _ = traced
    seen: set[str] = set()

    def send() -> str:
        marker = secrets.token_hex(8)
        status, _, _ = post(f"{base}/embed", {"inputs": [f"a TEI request {marker}", f"and another {marker}"]})
        assert status == 200
        api = receiver.first(
            lambda s: s.name == "POST /embed" and s.attributes.get("texts") == 2 and s.trace_id not in seen
        )
        seen.add(api.trace_id)
        return api.trace_id

    spans = by_name(carried_to_triton(receiver, send, {"POST /embed", "triton embed", *TRITON_STEPS}))
    assert spans["POST /embed"].parent == "" and spans["InferRequest"].parent == spans["triton embed"].span_id


def test_a_refused_request_names_the_overload_rule_on_its_span(traced):
    receiver, base, _ = traced
    trace_id = secrets.token_hex(16)
    request = {"input": f"too short a budget {trace_id}", "latency_budget_ms": 0.001}
    status, body, _ = post(
        f"{base}/v1/embeddings", request, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    )
    assert status == 503, body
    api = by_name(receiver.wait_for(trace_id, {"POST /v1/embeddings"}))["POST /v1/embeddings"]
    assert api.attributes["http.response.status_code"] == 503
    assert api.attributes["overload.rule"] == "latency_budget_ms"
    assert "over the 0.001 ms latency budget" in api.attributes["overload.message"]


def test_without_the_variables_nothing_is_traced():
    assert triton_trace_args({}) == ()
    disabled = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}
    assert triton_trace_args(disabled) == ()


def test_the_client_library_carries_the_callers_span_to_triton(traced):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON
    from triton_embed import EmbeddingClient

    receiver, _, server = traced
    tracer = TracerProvider(sampler=ALWAYS_ON).get_tracer("a caller")  # the caller's own; nothing of it is exported
    callers: dict[str, str] = {}

    def send() -> str:
        with tracer.start_as_current_span("indexing job") as span, EmbeddingClient(url=server.grpc_url) as client:
            client.embed([f"carried by the client {span.get_span_context().span_id}"])
            context = span.get_span_context()
        callers[f"{context.trace_id:032x}"] = f"{context.span_id:016x}"
        return f"{context.trace_id:032x}"

    spans = by_name(carried_to_triton(receiver, send, TRITON_STEPS))
    assert spans["InferRequest"].parent == callers[spans["InferRequest"].trace_id]


def test_the_stage_table_blames_the_stage_where_the_slowest_request_spent_its_time(traced, tmp_path):
    receiver, base, _ = traced
    marker = secrets.token_hex(8)
    for i in range(30):
        assert post(f"{base}/v1/embeddings", {"input": f"short {marker} {i}"})[0] == 200

    def send_slow() -> str:
        trace_id = secrets.token_hex(16)
        slow = [f"{trace_id} {i} " + "a long sentence for the encoder to chew on " * 25 for i in range(64)]
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        assert post(f"{base}/v1/embeddings", {"input": slow}, headers)[0] == 200
        return trace_id

    carried_to_triton(receiver, send_slow, TRITON_STEPS)  # Triton's exporter sends in batches, in order
    spans = tmp_path / "spans.jsonl"
    spans.write_bytes(receiver.save_path.read_bytes())  # the run so far, as a collector's file exporter writes it
    done = subprocess.run(
        [sys.executable, "-m", "triton_embed_gateway.traces", "--json", str(spans)],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(done.stdout)
    assert data["requests"] >= 31
    assert set(data["all"]) == set(STAGES)
    assert data["blame"] == "encoder compute", data["slowest"]
    shares = sum(row["share"] for row in data["all"].values())
    assert 0.99 < shares < 1.01  # the stages add up to the end-to-end time
    assert data["end_to_end"]["p99_ms"] >= data["all"]["encoder compute"]["p99_ms"]
    table = subprocess.run(
        [sys.executable, "-m", "triton_embed_gateway.traces", str(spans)], capture_output=True, text=True, check=True
    ).stdout
    assert "| encoder compute |" in table and "to blame at p99: encoder compute" in table


ADMIN_KEY = "sampling-test-key"


def triton_trace_rate(server) -> int:
    """Triton's current ``trace_rate``, read through its admin-locked trace settings API."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/trace/setting", headers={ADMIN_HEADER: ADMIN_KEY})
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(json.loads(response.read())["trace_rate"])


def sampling(base: str) -> tuple[float, dict[str, float]]:
    """The gateway's share traced, and its changes by state."""
    page = scrape(f"{base}/metrics")
    changes = {
        k.split('"')[1]: v for k, v in page.items() if k.startswith("triton_embed_gateway_trace_sampling_changes_total")
    }
    return page["triton_embed_gateway_trace_sampling_ratio"], changes


def load(base: str, groups: list[tuple[int, list[str]]], seconds: float) -> int:
    """For each (callers, texts) of ``groups``, that many callers each posting ``texts`` (a new marker each time) for
    ``seconds``; returns the answers."""
    stop, answered, failed = time.monotonic() + seconds, [], []

    def run(k: int, texts: list[str]) -> None:
        n = 0
        while time.monotonic() < stop:
            status, body, _ = post(f"{base}/v1/embeddings", {"input": [f"{k} {n} {t}" for t in texts]})
            if status != 200:
                failed.append(body)
            n += 1
        answered.append(n)

    callers = [(k, texts) for count, texts in groups for k in range(count)]
    workers = [threading.Thread(target=run, args=caller) for caller in callers]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failed, failed[:3]
    return sum(answered)


def test_the_sampling_follows_load_down_at_a_high_rate_up_when_p95_crosses_the_threshold(tmp_path):
    # Decisions every 0.5 s; 0.5 traces/s budget; p95 over 400 ms is slow: 4 callers of one short text are far under
    # it, and 8 callers of 16 long texts beside them far over it on any CPU, at a rate still over the budget. The
    # short callers run through both phases: a pause between them would be a quiet interval of its own. BULK_TEXTS 8
    # sends the 16-text requests to the bulk lane, which queues them, on any machine: the door measured at start-up
    # would otherwise decide whether 16 texts are bulk, and refuse them past its limit.
    knobs = {
        "TRITON_EMBED_TRACE_INTERVAL_S": "0.5",
        "TRITON_EMBED_TRACE_BUDGET": "0.5",
        "TRITON_EMBED_TRACE_SLOW_MS": "400",
        "TRITON_EMBED_ADMIN_KEY": ADMIN_KEY,
    }
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, **knobs}
        repo = variant_repository(tmp_path / "repo", None, knobs={("encoder", "BULK_TEXTS"): "8"})
        with (
            EmbeddedServer(
                model_repository=repo,
                http_port=0,
                grpc_port=0,
                metrics_port=0,
                admin_key=ADMIN_KEY,
                log_file=tmp_path / "log",
                extra_args=triton_trace_args(env),
            ) as server,
            gateway_process(server, env, tmp_path / "gateway.log") as base,
        ):
            assert sampling(base)[0] == 1.0 and triton_trace_rate(server) == 1  # quiet: every request
            answered: list[int] = []
            short = threading.Thread(target=lambda: answered.append(load(base, [(4, ["a short sentence"])], 9)))
            short.start()
            time.sleep(4)
            share, changes = sampling(base)
            assert share < 0.5 and changes.get("load", 0) >= 1, (share, changes)  # over 1 request/s: a share of them
            assert triton_trace_rate(server) == round(1 / share)
            load(base, [(8, ["a long sentence to keep the encoder busy " * 25] * 16)], seconds=5)
            short.join()
            assert answered and answered[0] >= 20, answered
            share, changes = sampling(base)
            assert share >= 0.5 and changes.get("slow", 0) >= 1, (share, changes)  # raised while p95 is high
            assert triton_trace_rate(server) <= 2
            time.sleep(1.5)  # no request: every request again
            assert sampling(base)[0] == 1.0 and triton_trace_rate(server) == 1
    log = (tmp_path / "gateway.log").read_text()
    assert "trace sampling 1 -> " in log and "slow" in log, log
