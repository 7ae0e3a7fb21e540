"""`make serve`'s banner shows loopback URLs; a wider bind (HOST=0.0.0.0) must be said in it."""

from __future__ import annotations

from triton_embed_server.__main__ import _exposure_note


def test_a_wider_bind_is_named_in_the_banner_and_loopback_is_not():
    assert _exposure_note("127.0.0.1") == ""
    note = _exposure_note("0.0.0.0")  # noqa: S104 - the value a user passes
    assert note.startswith("Bound to 0.0.0.0: inference") and "IPv6 included" in note and "Threat model" in note
    assert "IPv6" not in _exposure_note("192.0.2.7")  # one address: gRPC binds that one only


def test_the_banner_names_the_rerank_routes_only_when_a_reranker_is_served():
    from triton_embed_server.__main__ import Gateway

    embed_only = Gateway("127.0.0.1:8001", "127.0.0.1", 8080, ["embed"]).banner()
    assert "/v1/embeddings" in embed_only and "rerank" not in embed_only
    both = Gateway("127.0.0.1:8001", "127.0.0.1", 8080, ["embed", "rerank"], rerankers=("rerank",)).banner()
    assert (
        "/v1/embeddings" in both
        and "http://127.0.0.1:8080/v1/rerank   (TEI: http://127.0.0.1:8080/rerank; rerank)" in both
    )
