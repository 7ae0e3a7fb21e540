"""Bad input gets clear errors on HTTP and gRPC, and the server keeps serving; admin APIs are locked."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import reference_embed
from helpers import post_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton_embed import EmbeddingClient, InvalidInputError
from tritonclient.utils import InferenceServerException

MODULES = {"grpc": grpcclient, "http": httpclient}


def send(server, protocol: str, array: np.ndarray, *, dtype: str = "BYTES", name: str = "TEXT", params=None):
    """One raw request to the ensemble; returns the EMBEDDING array or raises InferenceServerException."""
    module = MODULES[protocol]
    url = server.grpc_url if protocol == "grpc" else server.http_url
    client = module.InferenceServerClient(url)
    try:
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array, **({"binary_data": True} if protocol == "http" else {}))
        return client.infer("embed", [tensor], parameters=params).as_numpy("EMBEDDING")
    finally:
        client.close()


def texts(*items: bytes) -> np.ndarray:
    return np.array([[t] for t in items], dtype=np.object_)


TAG = secrets.token_hex(4)
"""In the texts that must be new to the server's response cache: new in every session."""


def token_count(reference, text: str) -> int:
    """Tokens of ``text`` untruncated, [CLS] and [SEP] included, by the reference model's tokenizer."""
    return len(reference.tokenizer(text, truncation=False)["input_ids"])


# (name, request kwargs for send(), substrings the error must contain: the field, the limit, the value)
BAD_INPUTS = [
    ("too_many_texts", {"array": texts(*[b"a"] * 65)}, ["batch-size must be <= 64"]),
    ("text_too_long", {"array": texts(b"x" * 70_000)}, ["'TEXT' row 0 has 70000 bytes", "limit is 65536 bytes"]),
    ("nul_byte", {"array": texts(b"ok", b"abc\x00def")}, ["'TEXT' row 1 holds a NUL byte at offset 3"]),
    ("not_utf8", {"array": texts(b"\xc3\x28")}, ["'TEXT' row 0 is not valid UTF-8", "0xc3"]),
    ("zero_texts", {"array": np.zeros((0, 1), dtype=np.object_)}, ["'TEXT'", "got 0"]),
    ("wrong_dtype", {"array": np.zeros((1, 1), dtype=np.int64), "dtype": "INT64"}, ["'TEXT'", "INT64", "BYTES"]),
    ("wrong_shape", {"array": np.array([b"flat"], dtype=np.object_)}, ["'TEXT'", "Expected [-1,1], got [1]"]),
    ("two_texts_per_row", {"array": np.array([[b"a", b"b"]], dtype=np.object_)}, ["'TEXT'", "got [1,2]"]),
    ("wrong_name", {"array": texts(b"a"), "name": "TXT"}, ["unexpected inference input 'TXT'"]),
    (
        "over_max_seq_length_without_truncation",
        # new to the server (TAG): a truncated answer to it in the response cache would be served instead
        {"array": texts(f"refused {TAG} ".encode() + b"word " * 400), "params": {"truncate": False}},
        ["'TEXT' row 0 has {tokens} tokens; the limit is 256 (the model's max_seq_length)", "truncation is off"],
    ),
    (
        "over_max_seq_length_read_from_its_head",  # over 4,096 characters: only its head is tokenized
        {"array": texts(f"refused from its head {TAG} ".encode() + b"word " * 2000), "params": {"truncate": False}},
        ["'TEXT' row 0 has at least ", " tokens; the limit is 256", "truncation is off"],
    ),
    (
        "truncate_not_a_bool",
        {"array": texts(b"truncate must be a bool"), "params": {"truncate": "x"}},
        ["request parameter 'truncate' must be true or false", "got 'x'"],
    ),
]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize(("name", "request_kwargs", "expected"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(
    server, reference, protocol, name, request_kwargs, expected
):
    pid = server.pid
    with pytest.raises(InferenceServerException) as info:
        send(server, protocol, **request_kwargs)
    message = info.value.message()
    for template in expected:
        part = template
        if "{tokens}" in template:
            part = template.format(tokens=token_count(reference, request_kwargs["array"][0, 0].decode()))
        assert part in message, f"{name}: {part!r} not in {message!r}"
    assert str(info.value.status()) in ("StatusCode.INVALID_ARGUMENT", "400")
    assert send(server, protocol, texts(b"a good request right after")).shape == (1, 384)
    assert server.pid == pid and server.is_alive()


def test_long_texts_are_truncated_by_default_and_on_request(server, reference):
    long = "word " * 400
    expected = reference_embed(reference, [long])
    np.testing.assert_allclose(send(server, "grpc", texts(long.encode())), expected, atol=1e-5)
    truncated = send(server, "http", texts(long.encode()), params={"truncate": True})
    np.testing.assert_allclose(truncated, expected, atol=1e-5)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_clients_truncate_option_reaches_the_server(server, reference, protocol):
    long = f"client {protocol} {TAG} " + "token " * 400  # new to the server: the cache cannot answer it
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with (
        EmbeddingClient(url=url, protocol=protocol, truncate=False) as strict,
        pytest.raises(InvalidInputError, match=f"row 0 has {token_count(reference, long)} tokens; the limit is 256"),
    ):
        strict.embed([long])
    with EmbeddingClient(url=url, protocol=protocol, truncate=True) as cutting:
        np.testing.assert_allclose(cutting.embed([long]), reference_embed(reference, [long]), atol=1e-5)


def test_the_response_cache_answers_a_cached_text_whatever_the_request_parameters(server, reference):
    # Triton 2.51 caches on the texts alone (docs/architecture.md, "Response cache"): once a long text has
    # been served truncated, truncate=false for it is answered from the cache, not refused.
    long = f"cached once {TAG} " + "word " * 400
    send(server, "grpc", texts(long.encode()))
    cached = send(server, "grpc", texts(long.encode()), params={"truncate": False})
    np.testing.assert_allclose(cached, reference_embed(reference, [long]), atol=1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(
        st.one_of(st.text(max_size=200), st.binary(max_size=200)),
        min_size=1,
        max_size=6,
    ),
    protocol=st.sampled_from(["grpc", "http"]),
)
def test_random_unicode_and_bytes_give_embeddings_or_clear_errors(server, reference, rows, protocol):
    items = [r.encode("utf-8", "surrogatepass") if isinstance(r, str) else r for r in rows]
    try:
        served = send(server, protocol, texts(*items))
    except InferenceServerException as exc:
        assert str(exc.status()) in ("StatusCode.INVALID_ARGUMENT", "400"), exc.message()
        assert "'TEXT' row" in exc.message()
        bad = []
        for item in items:
            try:
                item.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(item)
        assert bad or any(b"\x00" in item for item in items), f"rejected valid input: {exc.message()}"
        return
    decoded = [item.decode("utf-8") for item in items]  # accepted: every row was valid UTF-8 without NUL
    assert not any("\x00" in t for t in decoded)
    np.testing.assert_allclose(served, reference_embed(reference, decoded), atol=1e-5)


def http_admin(server, path: str, headers: dict | None = None) -> int:
    return post_status(f"http://{server.http_url}{path}", headers)


def test_admin_apis_need_the_header_and_inference_does_not(server):
    assert http_admin(server, "/v2/repository/index") == 403
    assert http_admin(server, "/v2/logging") == 403
    assert http_admin(server, "/v2/repository/index", server.admin_headers("http")) == 200
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            grpc.get_model_repository_index()
        assert grpc.get_model_repository_index(headers=server.admin_headers("grpc")) is not None
        assert grpc.is_server_ready() and grpc.get_inference_statistics("embed") is not None
    finally:
        grpc.close()
    with EmbeddingClient(url=server.http_url, protocol="http") as client:
        assert client.embed(["inference needs no header"]).shape == (1, 384)
        assert client.health().model_ready


ADMIN_CALLS = {  # Triton's restricted API groups other than the model repository (above): a read and a write each
    "trace": [lambda c, **kw: c.get_trace_settings(**kw), lambda c, **kw: c.update_trace_settings(settings={}, **kw)],
    "logging": [lambda c, **kw: c.get_log_settings(**kw), lambda c, **kw: c.update_log_settings(settings={}, **kw)],
    "system shared memory": [
        lambda c, **kw: c.get_system_shared_memory_status(**kw),
        lambda c, **kw: c.register_system_shared_memory("locked-out", "/locked-out", 64, **kw),
    ],
    "CUDA shared memory": [
        lambda c, **kw: c.get_cuda_shared_memory_status(**kw),
        lambda c, **kw: c.unregister_cuda_shared_memory(**kw),
    ],
}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("group", list(ADMIN_CALLS))
def test_trace_logging_and_shared_memory_apis_need_the_admin_header(server, protocol, group):
    """docs/operations.md, "Threat model and the admin lock": trace and logging settings and system/CUDA shared-memory
    registration are refused without the admin header or with a wrong key (HTTP 403; gRPC UNAVAILABLE with a
    message naming the header), on both protocols; with the key they answer."""
    module = MODULES[protocol]
    url = server.grpc_url if protocol == "grpc" else server.http_url
    header = next(iter(server.admin_headers(protocol)))
    client = module.InferenceServerClient(url)
    try:
        for call in ADMIN_CALLS[group]:
            for headers in (None, {header: "not-the-key"}):
                with pytest.raises(InferenceServerException) as refused:
                    call(client, headers=headers)
                assert str(refused.value.status()) in ("403", "StatusCode.UNAVAILABLE"), refused.value
                assert "is restricted, expecting header" in refused.value.message()
                assert header in refused.value.message()
        read = ADMIN_CALLS[group][0]
        assert read(client, headers=server.admin_headers(protocol)) is not None
    finally:
        client.close()


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    """The shipped repository (artifacts linked, response cache on as shipped) with the tokenizer's
    ``TRUNCATION: "error"``, as docs/configuration.md sets it where over-long texts must be errors."""
    from triton_embed_server.embedded import EmbeddedServer

    from bench.serving import variant_repository

    tmp = tmp_path_factory.mktemp("strict")
    repo = variant_repository(tmp / "repo", cache=True, knobs={("tokenizer", "TRUNCATION"): "error"})
    with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp / "log") as srv:
        yield srv


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_truncation_error_in_the_config_refuses_over_long_texts_every_time(strict_server, reference, protocol):
    """With ``TRUNCATION: "error"`` a text over 256 tokens is INVALID_ARG naming its tokens and the limit, and, the
    refusal never being cached, so is the same text asked again; texts within the limit are served as ever."""
    url = strict_server.grpc_url if protocol == "grpc" else strict_server.http_url
    long = f"strict {protocol} {secrets.token_hex(4)} " + "word " * 400
    with EmbeddingClient(url=url, protocol=protocol, retries=0) as client:
        for _ in range(2):
            with pytest.raises(InvalidInputError, match=f"row 0 has {token_count(reference, long)} tokens; the limit"):
                client.embed([long])
        short = ["a text within the limit", "word " * 200]  # 202 tokens
        np.testing.assert_allclose(client.embed(short), reference_embed(reference, short), atol=1e-5)


def test_the_request_parameter_truncate_overrides_truncation_error(strict_server, reference):
    """The request parameter wins over the config: ``truncate=True`` cuts an over-long text as sentence-transformers
    cuts it, even where the config says "error"."""
    long = f"cut on request {secrets.token_hex(4)} " + "word " * 400
    with EmbeddingClient(url=strict_server.grpc_url, truncate=True) as client:
        np.testing.assert_allclose(client.embed([long]), reference_embed(reference, [long]), atol=1e-5)
