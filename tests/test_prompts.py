"""A model with sentence-transformers prompts, served: each prompt applied as sentence-transformers applies it.

A tiny random-weight BERT (width 32) with prompts ``query: `` / ``passage: `` and ``query`` as its default, exported
into a copy of the model repository and served by a real tritonserver, with the gateway in front.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from small_models import repository_for, small_sentence_transformer
from test_gateway import gateway_running, post

PROMPTS = {"query": "query: ", "passage": "passage: "}
TEXTS = ["A man is playing a guitar.", "Someone plays music.", "The cat sleeps."]


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    """(served model's reference SentenceTransformer, Triton server, gateway URL)."""
    from sentence_transformers import SentenceTransformer
    from triton_embed_server.embedded import EmbeddedServer

    tmp = tmp_path_factory.mktemp("prompted")
    model = small_sentence_transformer(tmp / "st", 32, prompts=PROMPTS, default_prompt_name="query")
    repo = repository_for(model, tmp / "repo")
    reference = SentenceTransformer(str(model), device="cpu")
    server = EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp / "log")
    with server, gateway_running(server.grpc_url, tmp / "gateway.log") as gateway:
        yield reference, server, gateway


def infer(url: str, texts: list[str], prompt: str | None) -> np.ndarray:
    """EMBEDDING of ``texts`` from the ensemble over gRPC, with ``PROMPT_NAME`` set for every text unless None."""
    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, values in (("TEXT", texts), ("PROMPT_NAME", None if prompt is None else [prompt] * len(texts))):
        if values is not None:
            data = np.array([[v.encode()] for v in values], dtype=np.object_)
            tensors.append(grpcclient.InferInput(name, list(data.shape), "BYTES"))
            tensors[-1].set_data_from_numpy(data)
    try:
        return client.infer("embed", tensors).as_numpy("EMBEDDING")
    finally:
        client.close()


def test_each_prompt_is_applied_as_sentence_transformers_applies_it_and_the_default_without_one(prompted):
    reference, server, _ = prompted
    for prompt, expected in (
        ("passage", reference.encode(TEXTS, prompt_name="passage")),
        ("query", reference.encode(TEXTS, prompt_name="query")),
        (None, reference.encode(TEXTS)),  # the model's default_prompt_name: query
        ("", reference.encode(TEXTS, prompt="")),  # no prompt at all
    ):
        np.testing.assert_allclose(infer(server.grpc_url, TEXTS, prompt), expected, atol=1e-5, err_msg=str(prompt))
    assert not np.allclose(reference.encode(TEXTS, prompt_name="passage"), reference.encode(TEXTS, prompt=""))


def test_the_cache_keeps_prompts_apart(prompted):
    """The same text with and without a prompt, in turns: each answer is its own prompt's."""
    reference, server, _ = prompted
    text = ["cached under several prompts"]
    for prompt in ("passage", "", "passage", None, ""):
        expected = reference.encode(text, prompt=PROMPTS.get(prompt, "") if prompt is not None else None)
        np.testing.assert_allclose(infer(server.grpc_url, text, prompt), expected, atol=1e-5, err_msg=str(prompt))


def test_openai_input_type_picks_the_prompt_and_usage_counts_its_tokens(prompted):
    from openai import OpenAI

    reference, _, gateway = prompted
    client = OpenAI(base_url=f"{gateway}/v1", api_key="unused")
    result = client.embeddings.create(model="m", input=TEXTS, extra_body={"input_type": "passage"})
    served = np.array([d.embedding for d in result.data], dtype=np.float32)
    np.testing.assert_allclose(served, reference.encode(TEXTS, prompt_name="passage"), atol=1e-5)
    prompted_texts = [PROMPTS["passage"] + t for t in TEXTS]
    assert result.usage.prompt_tokens == sum(len(ids) for ids in reference.tokenizer(prompted_texts)["input_ids"])
    shorter = client.embeddings.create(model="m", input=TEXTS, dimensions=8)
    head = reference.encode(TEXTS)[:, :8]
    expected = head / np.linalg.norm(head, axis=1, keepdims=True)
    np.testing.assert_allclose(np.array([d.embedding for d in shorter.data]), expected, atol=1e-5)


def test_tei_prompt_name_and_an_unknown_prompt(prompted):
    reference, _, gateway = prompted
    status, rows, _ = post(f"{gateway}/embed", {"inputs": TEXTS, "prompt_name": "passage"})
    assert status == 200
    np.testing.assert_allclose(np.array(rows), reference.encode(TEXTS, prompt_name="passage"), atol=1e-5)
    status, answer, _ = post(f"{gateway}/v1/embeddings", {"input": TEXTS, "input_type": "document_x"})
    assert status == 400 and answer["error"]["param"] == "input_type", answer
    assert "'document_x'" in answer["error"]["message"] and "'passage'" in answer["error"]["message"], answer
    status, answer, _ = post(f"{gateway}/v1/embeddings", {"input": TEXTS, "dimensions": 33})
    assert status == 400 and "width is 32" in answer["error"]["message"], answer


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_clients_take_the_prompt_and_dimensions(prompted, protocol):
    import asyncio

    from triton_embed import AsyncEmbeddingClient, EmbeddingClient

    reference, server, _ = prompted
    url = server.grpc_url if protocol == "grpc" else server.http_url
    passage = reference.encode(TEXTS, prompt_name="passage")
    head = reference.encode(TEXTS)[:, :8]
    with EmbeddingClient(url=url, protocol=protocol, coalesce=True) as client:
        np.testing.assert_allclose(client.embed(TEXTS, input_type="passage"), passage, atol=1e-5)
        np.testing.assert_allclose(client.embed(TEXTS, input_type=""), reference.encode(TEXTS, prompt=""), atol=1e-5)
        shortened = client.embed(TEXTS, dimensions=8)
        np.testing.assert_allclose(shortened, head / np.linalg.norm(head, axis=1, keepdims=True), atol=1e-5)
        with pytest.raises(ValueError, match="width 32; got 33"):
            client.embed(TEXTS, dimensions=33)
        with pytest.raises(ValueError, match="truncate must be one of"):
            client.embed(TEXTS, truncate="LEFT")

    async def asynchronous():
        async with AsyncEmbeddingClient(url=url, protocol=protocol) as client:
            return await client.embed(TEXTS, input_type="passage", dimensions=32)

    np.testing.assert_allclose(asyncio.run(asynchronous()), passage, atol=1e-5)


def test_the_cli_takes_the_prompt_and_dimensions(prompted):
    import json
    import subprocess
    import sys

    reference, server, _ = prompted
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "triton_embed.cli",
            "embed",
            "--url",
            server.grpc_url,
            "--json",
            "--input-type",
            "passage",
            "--dimensions",
            "8",
            *TEXTS,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    served = np.array([row["embedding"] for row in json.loads(done.stdout)])
    head = reference.encode(TEXTS, prompt_name="passage")[:, :8]
    np.testing.assert_allclose(served, head / np.linalg.norm(head, axis=1, keepdims=True), atol=1e-5)


def test_the_models_route_reports_this_models_width_and_token_limit(prompted):
    import json
    import urllib.request

    _, _, gateway = prompted
    with urllib.request.urlopen(f"{gateway}/v1/models", timeout=10) as response:
        (model,) = json.loads(response.read())["data"]
    assert model["dimension"] == 32 and model["max_tokens"] == 128
