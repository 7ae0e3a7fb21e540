"""The embeddings HTTP API as its users call it: the official openai SDK, TEI-shaped requests, curl-like bad input.

A real gateway process in front of the session's real tritonserver, on free loopback ports.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, reference_embed
from helpers import doc_examples, running_until_ready, serve_command

TEXTS = [
    "A man is playing a guitar.",
    "Someone plays music on a stringed instrument.",
    "The cat sleeps on the warm windowsill.",
]


@contextlib.contextmanager
def gateway_running(triton_url: str, log: Path, *extra: str, program: tuple[str, ...] = ("-m", "triton_embed_gateway")):
    """``python -m triton_embed_gateway`` (or ``program``) on a free port; yields its base URL; stopped on exit."""
    from triton_embed_server.embedded import free_port

    port = free_port()
    command = [sys.executable, *program, "--triton", triton_url, "--port", str(port), *extra]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    with running_until_ready(process, log, f"{base}/health", "the gateway", timeout_s=30):
        yield base


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    with gateway_running(server.grpc_url, tmp_path_factory.mktemp("gateway") / "gateway.log") as base:
        yield base


def post(url: str, body: bytes | dict, headers: dict[str, str] | None = None) -> tuple[int, dict, Message]:
    """POST JSON; returns (status, parsed body, headers) for success and error answers alike."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def tokens_of(reference, texts: list[str]) -> int:
    """Tokens the model sees for ``texts`` (special tokens included, truncated at max_seq_length)."""
    encoded = reference.tokenizer(texts, truncation=True, max_length=reference.max_seq_length)
    return sum(len(ids) for ids in encoded["input_ids"])


def test_openai_sdk_gets_the_reference_vectors_and_real_token_counts(gateway, reference, sts_dev):
    from openai import OpenAI

    client = OpenAI(base_url=f"{gateway}/v1", api_key="unused")
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[0])
    assert len(one.data) == 1 and one.data[0].index == 0 and one.model == "embed"
    assert cosines(np.array([one.data[0].embedding]), reference_embed(reference, TEXTS[:1]))[0] >= 0.9999

    texts = [pair.a for pair in sts_dev[:100]]  # two Triton requests (64 + 36), reassembled in order
    many = client.embeddings.create(model="embed", input=texts)
    assert [d.index for d in many.data] == list(range(100))
    served = np.array([d.embedding for d in many.data], dtype=np.float32)
    assert cosines(served, reference_embed(reference, texts)).min() >= 0.9999
    assert many.usage.prompt_tokens == many.usage.total_tokens == tokens_of(reference, texts)


def test_base64_is_little_endian_float32_of_the_same_vectors_and_smaller(gateway):
    from openai import OpenAI

    client = OpenAI(base_url=f"{gateway}/v1", api_key="unused")
    floats = client.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    _, raw, _ = post(f"{gateway}/v1/embeddings", {"model": "embed", "input": TEXTS, "encoding_format": "base64"})
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    np.testing.assert_array_equal(decoded, np.array([d.embedding for d in floats.data], dtype=np.float32))
    _, as_floats, _ = post(f"{gateway}/v1/embeddings", {"model": "embed", "input": TEXTS})
    assert len(json.dumps(raw)) * 2 < len(json.dumps(as_floats))


def test_tei_embed_route_answers_rows_of_floats(gateway, reference):
    status, rows, _ = post(f"{gateway}/embed", {"inputs": TEXTS, "truncate": True})
    assert status == 200
    assert cosines(np.array(rows, dtype=np.float32), reference_embed(reference, TEXTS)).min() >= 0.9999
    status, rows, _ = post(f"{gateway}/embed", {"inputs": TEXTS[1]})
    assert status == 200 and len(rows) == 1 and len(rows[0]) == 384


def test_models_health_and_ready(gateway):
    with urllib.request.urlopen(f"{gateway}/v1/models", timeout=10) as response:
        (model,) = json.loads(response.read())["data"]
    assert model["id"] == "embed" and model["dimension"] == 384 and model["max_batch_size"] == 64
    assert model["max_tokens"] == 256 and model["precision"] == "fp32"  # make test exports the reference at fp32
    for path in ("/health", "/ready"):
        with urllib.request.urlopen(f"{gateway}{path}", timeout=10) as response:
            assert response.status == 200


LONG = "word " * 400  # 402 tokens with [CLS] and [SEP]; the limit is 256


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("/v1/embeddings", {"model": "m"}, "input", ["'input' is required"]),
        ("/v1/embeddings", {"input": []}, "input", ["at least 1", "empty list"]),
        ("/v1/embeddings", {"input": ["a"] * 2049}, "input", ["2049", "limit is 2048"]),
        ("/v1/embeddings", {"input": [[101, 2023]]}, "input[0]", ["token arrays"]),
        ("/v1/embeddings", {"input": 5}, "input", ["string or a list", "int"]),
        ("/v1/embeddings", {"input": ["a", "b" * 70000]}, "input[1]", ["70000 bytes", "65536"]),
        ("/v1/embeddings", {"input": ["a", LONG], "truncate": "NONE"}, "input[1]", ["402 tokens", "limit is 256"]),
        ("/v1/embeddings", {"input": "a", "truncate": "LEFT"}, "truncate", ["'LEFT'", "START"]),
        ("/v1/embeddings", {"input": "a", "input_type": "passage"}, "input_type", ["'passage'", "'document'"]),
        ("/v1/embeddings", {"input": "a", "input_type": 3}, "input_type", ["non-empty string", "3"]),
        ("/v1/embeddings", {"input": "a", "dimensions": 385}, "dimensions", ["385", "width is 384"]),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format", ["'int8'", "base64"]),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions", ["from 1", "0"]),
        ("/v1/embeddings", b'{"input": ["a",', "body", ["not valid JSON"]),
        ("/v1/embeddings", b'{"input": ["ab\xff"]}', "body", ["not valid UTF-8", "byte 0xff at offset 14"]),
        ("/v1/embeddings", {"input": "a", "latency_budget_ms": -5}, "latency_budget_ms", ["0 to 3600000", "-5"]),
        ("/embed", {"inputs": ["a"], "latency_budget_ms": "fast"}, "latency_budget_ms", ["0 to 3600000", "'fast'"]),
        ("/embed", {"inputs": ["a"], "normalize": False}, "normalize", ["must be true", "False"]),
        ("/embed", {"inputs": ["a"], "truncate": "yes"}, "truncate", ["true or false", "'yes'"]),
        ("/embed", {"inputs": ["a"], "truncation_direction": "Up"}, "truncation_direction", ["'Up'", "Left"]),
    ],
)
def test_bad_input_gets_400_naming_the_field_the_limit_and_the_value(gateway, route, body, param, words):
    status, answer, _ = post(f"{gateway}{route}", body)
    assert status == 400, answer
    if route == "/embed":  # text-embeddings-inference's shape: the message is the error, the field named in it
        assert answer["error_type"] == "validation" and param in answer["error"], answer
        message = answer["error"]
    else:
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param, answer
        message = answer["error"]["message"]
    for word in words:
        assert word in message, answer
    status, _, _ = post(f"{gateway}/v1/embeddings", {"input": TEXTS[0]})
    assert status == 200  # still serving


def test_a_body_over_the_payload_limit_gets_413(server, tmp_path):
    with gateway_running(server.grpc_url, tmp_path / "gateway.log", "--payload-limit", "1000") as base:
        status, answer, _ = post(f"{base}/v1/embeddings", {"input": ["x" * 2000]})
        assert status == 413 and "the limit is 1000 bytes" in answer["error"]["message"], answer
        assert post(f"{base}/v1/embeddings", {"input": "short"})[0] == 200


def test_the_api_key_guards_the_embedding_routes_only(server, tmp_path):
    from openai import AuthenticationError, OpenAI

    with gateway_running(server.grpc_url, tmp_path / "gateway.log", "--api-key", "s3cret") as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, answer, _ = post(f"{base}/v1/embeddings", {"input": "a"}, headers)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key", (headers, answer)
            assert post(f"{base}/embed", {"inputs": "a"}, headers)[0] == 401
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).embeddings.create(model="m", input="a")
        good = OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0).embeddings.create(model="m", input="a")
        assert len(good.data[0].embedding) == 384
        with urllib.request.urlopen(f"{base}/ready", timeout=10) as response:  # probes need no key
            assert response.status == 200


def test_triton_unreachable_is_503_with_retry_after(tmp_path):
    from triton_embed_server.embedded import free_port

    with gateway_running(f"127.0.0.1:{free_port()}", tmp_path / "gateway.log") as base:
        for status, answer, headers in (
            post(f"{base}/v1/embeddings", {"input": "a"}),
            _get(f"{base}/ready"),
        ):
            assert status == 503 and headers.get("Retry-After") == "1", (status, answer, headers)
            assert answer["error"]["type"] == "server_error"


def _get(url: str) -> tuple[int, dict, Message]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def test_usage_counts_tokens_of_a_text_the_cache_holds_without_them(gateway, server, reference):
    """Triton's response cache answers with the outputs of the request that filled it (EMBEDDING only here)."""
    import tritonclient.grpc as grpcclient

    text = f"a text first embedded by a client that asks for EMBEDDING only {time.time_ns()}"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    data = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    data.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
    client.infer("embed", [data], outputs=[grpcclient.InferRequestedOutput("EMBEDDING")])
    client.close()
    status, answer, _ = post(f"{gateway}/v1/embeddings", {"input": [text]})
    assert status == 200 and answer["usage"]["prompt_tokens"] == tokens_of(reference, [text]), answer


def test_requests_are_counted_on_the_metrics_page(gateway):
    def count() -> float:
        with urllib.request.urlopen(f"{gateway}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        key = 'triton_embed_gateway_request_total{code="200",route="/v1/embeddings"}'
        return sum(float(line.split()[-1]) for line in lines if line.startswith(key))

    before = count()
    for _ in range(3):
        assert post(f"{gateway}/v1/embeddings", {"input": "counted"})[0] == 200
    assert count() == before + 3


def test_serve_starts_the_gateway_beside_tritonserver_and_stops_it(tmp_path):
    """`make serve` (serve --gateway-port): the banner names the OpenAI route, it answers, Ctrl-C stops both."""
    import signal

    from triton_embed_server.embedded import free_port

    http, grpc, metrics, port = (str(free_port()) for _ in range(4))
    log = tmp_path / "serve.log"
    command = serve_command(http, grpc, metrics, "--gateway-port", port)
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops it." not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert f"OpenAI  http://127.0.0.1:{port}/v1/embeddings" in log.read_text()
        status, answer, _ = post(f"http://127.0.0.1:{port}/v1/embeddings", {"input": TEXTS[0]})
        assert status == 200 and len(answer["data"][0]["embedding"]) == 384
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, log.read_text()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_docs_examples_work_as_written(gateway, reference):
    """docs/http-api.md's curl and openai examples, and the README's, against this gateway instead of :8080."""
    pages = [REPO_ROOT / "docs" / "http-api.md", REPO_ROOT / "README.md"]
    curls = [
        line
        for page in pages
        for block in doc_examples(page, "bash")
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("curl -s http://127.0.0.1:8080") and "/rerank" not in line  # tests/test_rerank.py's
    ]
    assert len(curls) >= 3
    for line in curls:
        done = subprocess.run(
            ["bash", "-c", line.replace("http://127.0.0.1:8080", gateway)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        answer = json.loads(done.stdout)
        assert done.returncode == 0 and "error" not in answer, (line, done.stdout, done.stderr)
    snippets = [b for page in pages for b in doc_examples(page, "python") if "OpenAI(" in b or "OpenAIEmbeddings(" in b]
    assert len(snippets) >= 3
    for snippet in snippets:
        scope: dict = {}
        exec(snippet.replace("http://127.0.0.1:8080", gateway), scope)  # noqa: S102 - our own docs
        served = np.array(scope["vectors"], dtype=np.float32)
        texts = ["A man is playing a guitar.", "Someone plays music."][: len(served)]
        assert cosines(served, reference_embed(reference, texts)).min() >= 0.9999


def test_truncation_modes_are_served_right_in_any_order_despite_the_cache(gateway, reference):
    """END cuts the end as sentence-transformers does, START the start, NONE refuses; the same long text in turns."""
    text = "first words then " + "many middle words " * 100 + "and the very last words"
    end = reference_embed(reference, [text])
    reference.tokenizer.truncation_side = "left"
    try:
        start = reference_embed(reference, [text])
    finally:
        reference.tokenizer.truncation_side = "right"
    assert cosines(end, start)[0] < 0.9999
    for mode in ("START", "END", "NONE", "START", "END"):
        status, answer, _ = post(f"{gateway}/v1/embeddings", {"input": [text], "truncate": mode})
        if mode == "NONE":
            assert status == 400 and "truncation is off" in answer["error"]["message"], answer
            continue
        assert status == 200, answer
        served = np.array([answer["data"][0]["embedding"]], dtype=np.float32)
        assert cosines(served, start if mode == "START" else end)[0] >= 0.9999, mode
        assert answer["usage"]["prompt_tokens"] == 256
    status, rows, _ = post(f"{gateway}/embed", {"inputs": [text], "truncation_direction": "Left"})
    assert status == 200 and cosines(np.array(rows, dtype=np.float32), start)[0] >= 0.9999


def test_dimensions_keeps_the_first_components_renormalised(gateway, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{gateway}/v1", api_key="unused")
    result = client.embeddings.create(model="embed", input=TEXTS, dimensions=128)
    served = np.array([d.embedding for d in result.data], dtype=np.float32)
    head = reference_embed(reference, TEXTS)[:, :128]
    assert served.shape == (3, 128)
    assert cosines(served, head).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)


def test_the_cli_runs_the_gateway_alone_against_a_triton_url(server, tmp_path):
    """`triton-embed gateway --triton HOST:PORT`, as a user runs it beside any Triton."""
    program = ("-m", "triton_embed.cli", "gateway")
    with gateway_running(server.grpc_url, tmp_path / "gateway.log", program=program) as base:
        status, answer, _ = post(f"{base}/v1/embeddings", {"input": "from the CLI's gateway"})
        assert status == 200 and len(answer["data"][0]["embedding"]) == 384


def test_langchain_openai_embeddings_get_the_reference_vectors(gateway, reference):
    """LangChain's OpenAIEmbeddings pointed at the gateway (no tiktoken length check: it would download a BPE)."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model="all-MiniLM-L6-v2", base_url=f"{gateway}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    documents = np.array(embeddings.embed_documents(TEXTS), dtype=np.float32)
    query = np.array([embeddings.embed_query(TEXTS[0])], dtype=np.float32)
    assert cosines(documents, reference_embed(reference, TEXTS)).min() >= 0.9999
    assert cosines(query, reference_embed(reference, TEXTS[:1]))[0] >= 0.9999
    shortened = OpenAIEmbeddings(
        model="m", base_url=f"{gateway}/v1", api_key="unused", check_embedding_ctx_length=False, dimensions=64
    )
    assert len(shortened.embed_query(TEXTS[0])) == 64


def test_overload_from_triton_is_503_with_retry_after(tmp_path):
    """An encoder whose latency budget every request overruns refuses as overloaded; the gateway says 503, retry."""
    from triton_embed_server.embedded import EmbeddedServer

    from bench.serving import variant_repository

    knobs = {("encoder", "LATENCY_BUDGET_MS"): "0.000001", ("encoder", "REFUSAL_HOLD_MS"): "0"}
    repo = variant_repository(tmp_path / "repo", knobs=knobs, cache=True)
    server = EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log")
    with server, gateway_running(server.grpc_url, tmp_path / "gateway.log") as base:
        status, answer, headers = post(f"{base}/v1/embeddings", {"input": "refused as overloaded"})
        assert status == 503 and headers.get("Retry-After") == "1", (status, answer)
        assert answer["error"]["code"] == "overloaded_budget" and "LATENCY_BUDGET_MS" in answer["error"]["message"]
        status, _, _ = post(f"{base}/v1/embeddings", {"input": ["a"] * 100})  # split lists are never refused
        assert status == 200


@pytest.mark.parametrize(("route", "field"), [("/v1/embeddings", "input"), ("/embed", "inputs")])
def test_a_latency_budget_in_the_body_reaches_the_service(gateway, route, field):
    """The body's latency_budget_ms is the request parameter: one the encoder's queue overruns is refused, 503."""
    body = {field: f"too short a budget {route}", "latency_budget_ms": 0.001}
    status, answer, headers = post(f"{gateway}{route}", body)
    assert status == 503 and headers.get("Retry-After") == "1", (status, answer)
    if route == "/embed":  # text-embeddings-inference's shape
        assert answer["error_type"] == "overloaded", answer
        message = answer["error"]
    else:
        message = answer["error"]["message"]
    assert message.startswith("overloaded[budget]: ") and "over the 0.001 ms latency budget" in message, answer
    status, _, _ = post(f"{gateway}{route}", {field: f"never refused {route}", "latency_budget_ms": 0})
    assert status == 200
