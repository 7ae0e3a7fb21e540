"""Any BERT-like sentence-transformers model exports and serves exactly: pooling kinds, Normalize or not, widths
other than 384, max_seq_length up to 512. Tiny random-weight models stand in for real ones (only all-MiniLM-L6-v2 is
packaged); the served vectors must equal in-process ``SentenceTransformer.encode(..., normalize_embeddings=True)``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import infer, text_tensor
from small_models import repository_for, small_sentence_transformer

WORDS = "the quick brown fox jumps over a lazy dog while people watch from the river bank "
TEXTS = ["", "a", "A man is playing a guitar.", WORDS * 3, WORDS * 40, "Ünïcödé テキスト 文本 😀", WORDS * 8]
KINDS = {  # served model name: (pooling, normalize, max_seq_length, dim)
    "cls_unnormalized_768": ("cls", False, 512, 768),
    "lasttoken_48": ("lasttoken", True, 512, 48),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Each kind's sentence-transformers folder, exported into one repository under its name; one server on it."""
    from triton_embed_server.embedded import EmbeddedServer

    tmp = tmp_path_factory.mktemp("kinds")
    folders = {}
    for name, (pooling, normalize, max_seq_length, dim) in KINDS.items():
        folders[name] = small_sentence_transformer(
            tmp / name, dim, pooling=pooling, normalize=normalize, max_seq_length=max_seq_length
        )
        repository_for(folders[name], tmp / "repo", name=name)
    server = EmbeddedServer(
        model_repository=tmp / "repo", http_port=0, grpc_port=0, metrics_port=0, log_file=tmp / "log"
    )
    with server:
        yield server, folders


@pytest.mark.parametrize("name", list(KINDS))
def test_the_model_serves_what_sentence_transformers_computes(served, name):
    from sentence_transformers import SentenceTransformer

    server, folders = served
    _, _, max_seq_length, dim = KINDS[name]
    reference = SentenceTransformer(str(folders[name]), device="cpu")
    assert len(reference.tokenizer(TEXTS[4])["input_ids"]) > max_seq_length  # truncation is exercised
    expected = reference.encode(TEXTS, normalize_embeddings=True)

    def embed(texts: list[str]) -> np.ndarray:
        return infer(server.grpc_url, name, {"TEXT": text_tensor(texts)}, ["EMBEDDING"])["EMBEDDING"]

    served_rows = embed(TEXTS)
    one_by_one = np.concatenate([embed([text]) for text in TEXTS])
    assert served_rows.shape == (len(TEXTS), dim)
    np.testing.assert_allclose(served_rows, expected, atol=1e-5)
    np.testing.assert_allclose(one_by_one, expected, atol=1e-5)
