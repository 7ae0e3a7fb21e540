"""URL handling of the client (no server needed: the client connects lazily)."""

from __future__ import annotations

import re

import pytest
from triton_embed import EmbeddingClient
from triton_embed.client import normalise_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("127.0.0.1:8001", "127.0.0.1:8001"),
        ("http://127.0.0.1:8000", "127.0.0.1:8000"),
        ("grpc://triton:8001/", "triton:8001"),
        (":8000", "127.0.0.1:8000"),
        ("[::1]:8001", "[::1]:8001"),
    ],
)
def test_normalise_url(url, expected):
    assert normalise_url(url) == expected


@pytest.mark.parametrize("url", ["localhost", "http://", "host:port"])
def test_bad_url_names_the_value(url):
    with pytest.raises(ValueError, match="url must be host:port"):
        normalise_url(url)


def test_environment_gives_url_and_protocol(monkeypatch):
    monkeypatch.setenv("TRITON_EMBED_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("TRITON_EMBED_PROTOCOL", "HTTP")
    client = EmbeddingClient()
    assert (client.url, client.protocol) == ("127.0.0.1:9000", "http")


def test_unknown_protocol_is_rejected():
    with pytest.raises(ValueError, match="protocol must be 'grpc' or 'http'; got 'udp'"):
        EmbeddingClient(protocol="udp")


@pytest.mark.parametrize(
    ("url", "protocol"), [("http://127.0.0.1:8000", "http"), ("grpc://127.0.0.1:8001", "grpc"), (":8001", "grpc")]
)
def test_the_url_scheme_picks_the_protocol(url, protocol):
    # EmbeddingClient(url="http://127.0.0.1:8000") must speak HTTP, not gRPC to the HTTP port ("Socket closed").
    client = EmbeddingClient(url=url)
    assert client.protocol == protocol


def test_the_url_scheme_wins_over_the_environments_protocol(monkeypatch):
    monkeypatch.setenv("TRITON_EMBED_PROTOCOL", "grpc")
    assert EmbeddingClient(url="http://127.0.0.1:8000").protocol == "http"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "http://127.0.0.1:8000", "protocol": "grpc"}, "protocol 'grpc' contradicts the url's scheme"),
        ({"url": "https://triton:8000"}, "url scheme must be http:// or grpc:// (or none); got 'https://triton:8000'"),
    ],
)
def test_a_contradicting_or_unknown_scheme_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EmbeddingClient(**kwargs)


def test_truncate_must_be_a_bool():
    with pytest.raises(ValueError, match=re.escape("truncate must be True, False or None; got 'no'")):
        EmbeddingClient(truncate="no")


def test_environment_protocol_that_contradicts_the_environment_url_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_EMBED_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("TRITON_EMBED_PROTOCOL", "grpc")
    with pytest.raises(ValueError, match=r"\$TRITON_EMBED_PROTOCOL='grpc' contradicts the url's scheme"):
        EmbeddingClient()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"backoff_s": -1}, "backoff_s >= 0"),
        ({"binary": "no"}, "binary must be True or False; got 'no'"),
        ({"headers": "x"}, "headers must be a dict of str to str; got 'x'"),
        ({"headers": {"key": 1}}, "headers must be a dict of str to str"),
    ],
)
def test_bad_settings_are_rejected_when_the_client_is_made(setting, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EmbeddingClient(**setting)


def test_the_callers_headers_dict_is_never_changed():
    headers = {"triton-embed-admin-key": "k"}
    client = EmbeddingClient(protocol="http", headers=headers)
    client.settings.headers["added-by-tritonclient"] = "1"  # what tritonclient's HTTP client does to the dict
    assert headers == {"triton-embed-admin-key": "k"}


@pytest.mark.parametrize(
    ("settings", "bulk", "expected"),
    [
        ({}, False, {}),
        ({}, True, {"latency_budget_ms": 0}),  # a chunk of a split call: never refused
        ({"latency_budget_ms": 50}, True, {"latency_budget_ms": 50}),
        ({"latency_budget_ms": 0, "truncate": False}, False, {"latency_budget_ms": 0, "truncate": False}),
    ],
)
def test_the_request_parameters_are_the_budget_and_truncate_only(settings, bulk, expected):
    kwargs = EmbeddingClient(url=":8001", **settings)._builder.infer_kwargs(bulk)
    assert kwargs.get("parameters", {}) == expected
