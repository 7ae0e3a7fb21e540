"""URL handling of the client (no server needed: the client connects lazily)."""

from __future__ import annotations

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
