"""Every architecture the exporter serves, each exact and device-portable.

A tiny random-weight model of each family in ``small_models.ARCHITECTURES`` (BERT, DistilBERT, RoBERTa, XLM-RoBERTa,
MPNet, ModernBERT, Qwen3 with last-token pooling), with a tokenizer of the family's kind, is exported by
``make model``'s exporter under the family's name into one model repository, served by one real tritonserver. What a
user checks: the module holds no device constant and runs with weights on ``meta``; it runs in torch 2.5.0 (Triton
24.10's libtorch); the ensemble's answers equal ``SentenceTransformer.encode(..., normalize_embeddings=True)`` for
short, multilingual and over-long texts, in one request and one by one; ``TRUNCATE`` START keeps a long text's tail as a
left-truncating tokenizer does and NONE refuses it naming the limit; each prompt of the family's instruction models
is applied as sentence-transformers applies it; ModernBERT's long context is served to its full ``max_seq_length``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from helpers import infer, text_tensor
from small_models import ARCHITECTURES, repository_for, small_sentence_transformer
from test_libtorch_compat import in_libtorch_24_10
from triton_embed_protocol import step_names
from triton_embed_server import model_config
from triton_embed_server.encoder_module import device_problems

WORDS = "the quick brown fox jumps over a lazy dog while people watch from the river bank "
TEXTS = [
    "",
    "a",
    " padded  with   spaces ",
    "A man is playing a guitar.",
    "Ünïcödé テキスト 文本 😀",
    WORDS * 3,
    WORDS * 8,
]
E5_PROMPTS = {"query": "query: ", "passage": "passage: "}
QWEN3_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
    "document": "",
}
SETUP: dict[str, dict] = {
    "xlm-roberta": {"prompts": E5_PROMPTS},  # multilingual-e5's prompts
    "qwen3": {"prompts": QWEN3_PROMPTS, "max_seq_length": 512},  # Qwen3-Embedding's
    "modernbert": {"max_seq_length": 1024},  # past BERT's 512 positions: buckets up to 1,024
}
"""Per architecture: what its small model carries beyond the defaults (128 tokens, no prompts)."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    """Each family's sentence-transformers folder, and one model repository serving them all, each as the model
    named after its family (``make model NAME=<family>``)."""
    tmp = tmp_path_factory.mktemp("families")
    models = {}
    for architecture in ARCHITECTURES:
        folder = tmp / architecture
        models[architecture] = small_sentence_transformer(
            folder, 32, architecture=architecture, **SETUP.get(architecture, {})
        )
        repository_for(models[architecture], tmp / "repo", name=architecture)
    return models, tmp / "repo"


@pytest.fixture(scope="module")
def served(exported, tmp_path_factory):
    """One tritonserver on the repository of every family (models beside each other, as ``make serve`` serves them)."""
    from triton_embed_server.embedded import EmbeddedServer

    log = tmp_path_factory.mktemp("families-log") / "tritonserver.log"
    with EmbeddedServer(model_repository=exported[1], http_port=0, grpc_port=0, metrics_port=0, log_file=log) as srv:
        yield srv


def encoder_folder(repo: Path, architecture: str) -> Path:
    """The family's encoder step in ``repo`` (``triton_embed_protocol.step_names``)."""
    return repo / step_names(architecture)[1]


def embed(url: str, model: str, texts: list[str], **per_text: str) -> np.ndarray:
    """EMBEDDING of ``texts`` from the ensemble ``model``, with each of ``per_text`` (``PROMPT_NAME``, ``TRUNCATE``)
    set alike."""
    inputs = {"TEXT": text_tensor(texts)} | {name: text_tensor([v] * len(texts)) for name, v in per_text.items()}
    return infer(url, model, inputs, ["EMBEDDING"])["EMBEDDING"]


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_the_family_exports_portable_and_serves_what_sentence_transformers_computes(exported, served, architecture):
    from sentence_transformers import SentenceTransformer

    model, encoder = exported[0][architecture], encoder_folder(exported[1], architecture)
    manifest = json.loads((encoder / "1" / "export.json").read_text())
    assert manifest["model_type"] == ARCHITECTURES[architecture].model_type
    assert device_problems(torch.jit.load(str(encoder / "1" / "model.pt"))) == []
    reference = SentenceTransformer(str(model), device="cpu")
    limit = reference.max_seq_length
    long_text = WORDS * (limit // 4)
    assert len(reference.tokenizer(long_text)["input_ids"]) > limit  # truncation is exercised
    texts = [*TEXTS, long_text]
    expected = reference.encode(texts, normalize_embeddings=True)
    reference.tokenizer.truncation_side = "left"
    expected_tail = reference.encode([long_text], normalize_embeddings=True)
    prompts = SETUP.get(architecture, {}).get("prompts", {})

    url = served.grpc_url
    together = embed(url, architecture, texts)
    one_by_one = np.concatenate([embed(url, architecture, [text]) for text in texts])
    tail = embed(url, architecture, [long_text], TRUNCATE="START")
    with pytest.raises(grpcclient.InferenceServerException, match=f"the limit is {limit}"):
        embed(url, architecture, [long_text], TRUNCATE="NONE")
    by_prompt = {name: embed(url, architecture, TEXTS, PROMPT_NAME=name) for name in prompts}
    assert together.shape == (len(texts), 32)
    np.testing.assert_allclose(together, expected, atol=1e-5)
    np.testing.assert_allclose(one_by_one, expected, atol=1e-5)
    np.testing.assert_allclose(tail, expected_tail, atol=1e-5)
    assert not np.allclose(tail, expected[-1:], atol=1e-3)  # the tail is not the head
    reference.tokenizer.truncation_side = "right"
    for name, got in by_prompt.items():
        np.testing.assert_allclose(got, reference.encode(TEXTS, prompt_name=name), atol=1e-5, err_msg=name)


def test_a_long_context_model_gets_buckets_up_to_its_limit(exported):
    """ModernBERT at 1,024 tokens: `make model` writes CPU buckets up to 1,024 and the tokenizer's limit with them."""
    repo = exported[1]
    _, lengths = model_config.buckets(model_config.read(encoder_folder(repo, "modernbert") / "config.pbtxt"))
    assert lengths[-3:] == [512, 768, 1024] and lengths == sorted(lengths)
    tokenizer = model_config.read(repo / step_names("modernbert")[0] / "config.pbtxt")
    assert model_config.parameter(tokenizer, "MAX_SEQ_LENGTH") == "1024"


RUN_ALL = """
import json, sys, torch
ids, mask = (torch.tensor(x, dtype=torch.int64) for x in json.loads(sys.stdin.read()))
out = {}
for path in sys.argv[1:]:
    with torch.no_grad():
        out[path] = torch.jit.load(path, map_location="cpu").eval()(ids, mask).tolist()
print(json.dumps({"torch": torch.__version__, "embeddings": out}))
"""


def test_every_family_runs_in_the_libtorch_of_triton_24_10(exported):
    paths = [str(encoder_folder(exported[1], a) / "1" / "model.pt") for a in ARCHITECTURES]
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 100, size=(3, 40)).astype(np.int64)  # within every tiny vocabulary
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    result = in_libtorch_24_10(RUN_ALL, *paths, ids=ids, mask=mask)
    for path in paths:
        with torch.no_grad():
            ours = torch.jit.load(path).eval()(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        diff = float(np.abs(np.asarray(result["embeddings"][path], dtype=np.float32) - ours).max())
        assert diff < 1e-5, f"{path}: torch {result['torch']} differs from torch {torch.__version__} by {diff:.3g}"
