"""Rerankers beside an embedder in one server: cross-encoders of three families exported by `make model` and served
as their own ensembles, each scoring pairs as its sentence-transformers ``CrossEncoder.predict`` does (1e-5 at
fp32), through Triton's gRPC and HTTP APIs, the client library, the CLI and the gateway's TEI and Cohere/Jina routes.

The models are tiny random-weight ones (tests/small_models.py): BERT with the packaged MiniLM tokenizer (token
types), XLM-RoBERTa and ModernBERT with tokenizers of their kind trained here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers import infer, text_tensor
from small_models import RERANKER_ARCHITECTURES, repository_for, small_cross_encoder, small_sentence_transformer
from tritonclient.utils import InferenceServerException

RERANKERS = {"rerank": "bert", "rerank_xlmr": "xlm-roberta", "rerank_modern": "modernbert"}
QUERY = "A man is playing a guitar."
DOCUMENTS = [
    "Someone plays music on a stage.",
    "",
    "Ein Mann spielt Gitarre.",
    "日本語の文章 " * 40,  # past max_seq_length with the query: truncated longest first
    "a",
    "The cheese was left in the sun.",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An embedder (``embed``) and the three rerankers exported into one repository by the exporter (``make model``
    runs the same ``export``; its command line: test_models.py and the refusals below), served by one server; yields
    ``(server, {name: folder})``."""
    from triton_embed_server.embedded import EmbeddedServer

    tmp = tmp_path_factory.mktemp("rerank")
    repo = tmp / "repo"
    folders = {name: small_cross_encoder(tmp / name, architecture=arch) for name, arch in RERANKERS.items()}
    embedder = small_sentence_transformer(tmp / "embed", 32)
    for name, folder in {"embed": embedder, **folders}.items():
        repository_for(folder, repo, name=name)
    with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp / "log") as srv:
        yield srv, folders


@pytest.fixture(scope="module")
def references(served):
    """``{name: (scores, logits)}`` of ``CrossEncoder.predict`` on (QUERY, each of DOCUMENTS)."""
    import torch
    from sentence_transformers import CrossEncoder

    _, folders = served
    out = {}
    for name, folder in folders.items():
        model = CrossEncoder(str(folder), device="cpu")
        pairs = [(QUERY, d) for d in DOCUMENTS]
        out[name] = (model.predict(pairs), model.predict(pairs, activation_fn=torch.nn.Identity()))
    return out


def pair_inputs(query: str, documents: list[str]) -> dict[str, np.ndarray]:
    return {"QUERY": text_tensor([query] * len(documents)), "DOCUMENT": text_tensor(documents)}


def test_every_family_is_tested_here():
    assert set(RERANKERS.values()) == set(RERANKER_ARCHITECTURES)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("name", RERANKERS)
def test_each_family_scores_what_cross_encoder_predict_computes(served, references, name, protocol):
    server, _ = served
    url = server.grpc_url if protocol == "grpc" else server.http_url
    got = infer(url, name, pair_inputs(QUERY, DOCUMENTS), ["SCORE", "LOGIT", "TOKEN_COUNT"], protocol)
    scores, logits = references[name]
    assert got["SCORE"].shape == (len(DOCUMENTS), 1)
    np.testing.assert_allclose(got["SCORE"][:, 0], scores, atol=1e-5)
    np.testing.assert_allclose(got["LOGIT"][:, 0], logits, atol=1e-5)
    assert got["TOKEN_COUNT"][3, 0] == 64 and (got["TOKEN_COUNT"][:, 0] < 64).sum() == len(DOCUMENTS) - 1


def test_a_pair_is_one_row_of_each_and_a_bad_request_leaves_the_others_served(served, references):
    server, _ = served
    inputs = {"QUERY": text_tensor([QUERY] * 2), "DOCUMENT": text_tensor(["one", "two", "three"])}
    with pytest.raises(InferenceServerException) as info:
        infer(server.grpc_url, "rerank", inputs, ["SCORE"])
    assert "input 'QUERY' batch size does not match other inputs" in str(info.value)  # Triton's own check
    over = {**pair_inputs(QUERY, DOCUMENTS[3:4]), "TRUNCATE": text_tensor(["NONE"])}
    with pytest.raises(InferenceServerException) as info:
        infer(server.grpc_url, "rerank", over, ["SCORE"])
    whole = re.search(r"\(a document\) with its query has (\d+) tokens; the limit is 64", str(info.value))
    assert whole and int(whole.group(1)) > 64 and "truncation is off" in str(info.value), str(info.value)
    got = infer(server.grpc_url, "rerank", pair_inputs(QUERY, DOCUMENTS), ["SCORE"])["SCORE"][:, 0]
    np.testing.assert_allclose(got, references["rerank"][0], atol=1e-5)
    # the embedder beside them still embeds
    assert infer(server.grpc_url, "embed", {"TEXT": text_tensor(["x"])}, ["EMBEDDING"])["EMBEDDING"].shape == (1, 32)


@pytest.fixture(scope="module")
def gateway(served, tmp_path_factory):
    """The gateway on the served repository (``--repository``, as compose starts it), 8 documents per request."""
    from test_gateway import gateway_running

    server, _ = served
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with gateway_running(
        server.grpc_url, log, "--repository", str(server.config.model_repository), "--max-inputs", "8"
    ) as base:
        yield base


def test_teis_rerank_route_answers_as_tei_sorted_by_score(gateway, references):
    from test_gateway import post

    scores, logits = references["rerank"]  # the first reranker of the repository
    status, body, _ = post(f"{gateway}/rerank", {"query": QUERY, "texts": DOCUMENTS, "return_text": True})
    assert status == 200, body
    assert [row["index"] for row in body] == list(np.argsort(-scores, kind="stable"))
    for row in body:
        assert row["text"] == DOCUMENTS[row["index"]]
        np.testing.assert_allclose(row["score"], scores[row["index"]], atol=1e-5)
    status, raw, _ = post(f"{gateway}/rerank", {"query": QUERY, "texts": DOCUMENTS, "raw_scores": True})
    assert status == 200 and "text" not in raw[0]
    np.testing.assert_allclose([logits[r["index"]] for r in raw], [r["score"] for r in raw], atol=1e-5)


def test_cohere_sdk_reranks_through_the_gateway_by_model_name(gateway, references):
    import cohere

    client = cohere.ClientV2(api_key="unused", base_url=gateway)
    for name in ("rerank_xlmr", "rerank_modern"):
        answer = client.rerank(model=name, query=QUERY, documents=DOCUMENTS, top_n=3)
        scores = references[name][0]
        assert [r.index for r in answer.results] == list(np.argsort(-scores, kind="stable")[:3])
        np.testing.assert_allclose([r.relevance_score for r in answer.results], np.sort(scores)[::-1][:3], atol=1e-5)
    v1 = cohere.Client(api_key="unused", base_url=gateway).rerank(
        model="rerank", query=QUERY, documents=DOCUMENTS, return_documents=True
    )
    assert len(v1.results) == len(DOCUMENTS) and v1.results[0].document.text == DOCUMENTS[v1.results[0].index]


def test_a_cache_hit_without_every_output_is_scored_by_the_steps_through_the_door(gateway, served):
    """A direct caller asked the ensemble for SCORE alone; the cache answers the gateway's same request with SCORE
    alone, and the gateway scores the pairs by the two steps: through the door (the encoder counts the tokenizer's
    texts out of flight, as for the ensemble), with the scores CrossEncoder.predict computes."""
    import time

    from sentence_transformers import CrossEncoder
    from test_gateway import post
    from triton_embed_protocol.overload import InFlight, InFlightRecord

    server, folders = served
    documents = [f"a guitar lesson {time.time_ns()}", f"a cheese board {time.time_ns()}"]  # never sent before
    inputs = {**pair_inputs(QUERY, documents), "TRUNCATE": text_tensor(["END"] * 2)}  # the gateway's cache key
    infer(server.grpc_url, "rerank", inputs, ["SCORE"])
    (door,) = [path for path in InFlight.files(server.pid) if path.name.endswith("-rerank.in-flight")]
    answered, hits = InFlightRecord.parse(door.read_bytes()).answered, ensemble_cache_hits(server.grpc_url, "rerank")
    status, body, _ = post(f"{gateway}/rerank", {"query": QUERY, "texts": documents})
    assert status == 200, body
    assert ensemble_cache_hits(server.grpc_url, "rerank") == hits + 1  # the cache answered, without TOKEN_COUNT
    assert InFlightRecord.parse(door.read_bytes()).answered == answered + 2  # both pairs counted in and out
    scores = CrossEncoder(str(folders["rerank"]), device="cpu").predict([(QUERY, d) for d in documents])
    np.testing.assert_allclose([scores[row["index"]] for row in body], [row["score"] for row in body], atol=1e-5)


def ensemble_cache_hits(grpc_url: str, model: str) -> int:
    """Response-cache hits of the ensemble ``model`` so far, from Triton's statistics API."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
        return int(stats.get("cache_hit", {}).get("count", 0))
    finally:
        client.close()


def test_rerank_errors_name_the_field_the_limit_and_the_value(gateway):
    from test_gateway import post

    cases = [
        (
            {"model": "rerank", "query": QUERY, "documents": ["d"] * 9},
            400,
            "documents",
            "holds 9 texts; the limit is 8",
        ),
        ({"model": "rerank", "documents": ["d"]}, 400, "query", "'query' is required"),
        (
            {"model": "rerank", "query": QUERY, "documents": ["ok", "x" * 70_000]},
            400,
            "documents[1]",
            "has 70000 bytes; the limit is 65536 bytes",
        ),
        (
            {"model": "rerank", "query": QUERY, "documents": [DOCUMENTS[3]], "truncate": "NONE"},
            400,
            "documents[0]",
            "'documents[0]' with its query has",
        ),
        ({"model": "embed", "query": QUERY, "documents": ["d"]}, 400, "model", "is an embedder; send it to"),
        (
            {"model": "bge-reranker", "query": QUERY, "documents": ["d"]},
            404,
            "model",
            "the served rerankers are rerank, rerank_modern, rerank_xlmr",
        ),
        ({"model": "rerank", "query": QUERY, "documents": ["d"], "top_n": 0}, 400, "top_n", "got 0"),
    ]
    for body, status, param, words in cases:
        got, answer, _ = post(f"{gateway}/v1/rerank", body)
        assert (got, answer["error"]["param"]) == (status, param), answer
        assert words in answer["error"]["message"], answer
    got, answer, _ = post(f"{gateway}/v1/embeddings", {"model": "rerank", "input": "x"})
    assert got == 400 and answer["error"]["code"] == "wrong_model_kind" and "/v1/rerank" in answer["error"]["message"]
    # the embedder is still the TEI /embed route's and listed beside the rerankers
    got, vectors, _ = post(f"{gateway}/embed", {"inputs": "x"})
    assert got == 200 and len(vectors[0]) == 32
    with urllib.request.urlopen(f"{gateway}/v1/models", timeout=10) as response:  # noqa: S310 - our gateway
        kinds = {m["id"]: m["type"] for m in json.loads(response.read())["data"]}
    assert kinds == {"embed": "embedder", **dict.fromkeys(RERANKERS, "reranker")}


def test_the_client_library_and_the_cli_rerank(served, references):
    import asyncio

    from test_cli import CLI
    from triton_embed import AsyncEmbeddingClient, EmbeddingClient, InvalidInputError

    server, _ = served
    scores = references["rerank_xlmr"][0]
    order = list(np.argsort(-scores, kind="stable"))
    with EmbeddingClient(url=server.http_url, protocol="http", model="rerank_xlmr") as client:
        ranked = client.rerank(QUERY, DOCUMENTS)
        assert [r.index for r in ranked] == order and ranked[0].document == DOCUMENTS[order[0]]
        np.testing.assert_allclose([r.score for r in ranked], scores[order], atol=1e-5)
        many = client.rerank(QUERY, DOCUMENTS * 12, top_n=2)  # 72 pairs: two requests of at most 64
        assert [r.index % len(DOCUMENTS) for r in many] == [order[0]] * 2

    async def async_top() -> list:
        async with AsyncEmbeddingClient(url=server.grpc_url, model="rerank_xlmr") as client:
            return await client.rerank(QUERY, DOCUMENTS, top_n=1)

    assert [r.index for r in asyncio.run(async_top())] == order[:1]
    # the wrong kind of model says so, before anything is sent
    with EmbeddingClient(url=server.grpc_url, model="rerank_xlmr") as client, pytest.raises(InvalidInputError) as info:
        client.embed(["x"])
    assert "model 'rerank_xlmr' is a reranker, not an embedder: call rerank()" in str(info.value)
    with EmbeddingClient(url=server.grpc_url, model="embed") as client, pytest.raises(InvalidInputError) as info:
        client.rerank(QUERY, ["x"])
    assert "model 'embed' is an embedder, not a reranker" in str(info.value)
    done = subprocess.run(
        [*CLI, "--url", server.grpc_url, "--model", "rerank_xlmr", "rerank", "--json", QUERY, *DOCUMENTS[:3]],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(done.stdout)
    assert [r["index"] for r in rows] == list(np.argsort(-scores[:3], kind="stable"))
    np.testing.assert_allclose([r["score"] for r in rows], np.sort(scores[:3])[::-1], atol=1e-5)


def test_the_docs_rerank_examples_work_as_written(gateway, served):
    """docs/http-api.md's rerank curls and Cohere snippet, against this gateway instead of :8080."""
    from helpers import doc_examples
    from sentence_transformers import CrossEncoder

    page = Path(__file__).resolve().parents[1] / "docs" / "http-api.md"
    curls = [
        line
        for block in doc_examples(page, "bash")
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("curl -s http://127.0.0.1:8080") and "/rerank" in line
    ]
    assert len(curls) == 2
    for line in curls:
        done = subprocess.run(
            ["bash", "-c", line.replace("http://127.0.0.1:8080", gateway)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        answer = json.loads(done.stdout)
        assert done.returncode == 0 and "error" not in answer and len(answer) >= 2, (line, done.stdout)
    (snippet,) = [b for b in doc_examples(page, "python") if "cohere.ClientV2(" in b]
    scope: dict = {}
    exec(snippet.replace("http://127.0.0.1:8080", gateway), scope)  # noqa: S102 - our own docs
    scores = CrossEncoder(str(served[1]["rerank"]), device="cpu").predict(
        [("A man is playing a guitar.", d) for d in scope["documents"]]
    )
    ((index, score),) = scope["best"]
    assert index == int(np.argmax(scores)) and abs(score - float(scores.max())) < 1e-5


def test_make_model_names_what_it_cannot_serve_as_a_reranker_in_one_line(tmp_path):
    """An LLM-based reranker (a causal LM scoring with yes/no token logits) and a classifier of two labels."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification
    from triton_embed_server.export import default_model_path

    llm = tmp_path / "qwen3-reranker"
    llm.mkdir()
    (llm / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    two = tmp_path / "two-labels"
    BertForSequenceClassification(
        BertConfig(
            vocab_size=30522,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=2,
        )
    ).save_pretrained(two)
    AutoTokenizer.from_pretrained(str(default_model_path())).save_pretrained(two)
    for folder, words in (
        (llm, "an LLM-based reranker that scores with yes/no token logits is not served"),
        (two, "a reranker has one label (one score per pair); this model has 2"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "triton_embed_server.export",
                "--repository",
                str(tmp_path / "repo"),
                "--model",
                str(folder),
                "--name",
                "rerank",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode != 0 and words in done.stderr, done.stderr[-600:]
        assert len([line for line in done.stderr.splitlines() if words[:30] in line]) == 1


def test_make_loadtest_reranks_beside_embedding_under_the_same_gate(served, tmp_path):
    """``make loadtest NAME=embed RERANK=rerank``: Locust's users rerank 8 texts against one beside their embeds."""
    from test_loadtest import locust

    server, _ = served
    (tmp_path / "run").mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"{d} {i}" for i in range(40) for d in ("a man plays", "cheese in the sun")) + "\n")
    done, report, _ = locust(
        server,
        tmp_path / "run",
        "GrpcUser",
        "--model",
        "embed",
        "--rerank-model",
        "rerank",
        "--corpus",
        str(corpus),
        "--sla-ms",
        "1000",
        seconds=15,
    )
    assert done.returncode == 0 and report is not None, done.stderr[-2000:]
    stats = {row["name"]: row for row in json.loads((tmp_path / "run" / "locust.json").read_text())}
    assert stats["rerank rerank x8"]["num_requests"] > 0 and stats["rerank rerank x8"]["num_failures"] == 0
    assert stats["embed x1"]["num_requests"] > stats["rerank rerank x8"]["num_requests"]
