"""Any BERT-like sentence-transformers model exports and serves exactly: pooling kinds, Normalize or not, widths
other than 384, max_seq_length up to 512. Tiny random-weight models stand in for real ones (only all-MiniLM-L6-v2 is
packaged); the served vectors must equal in-process ``SentenceTransformer.encode(..., normalize_embeddings=True)``.
"""

from __future__ import annotations

import numpy as np
import pytest
from small_models import repository_for, small_sentence_transformer
from test_prompts import infer

WORDS = "the quick brown fox jumps over a lazy dog while people watch from the river bank "
TEXTS = ["", "a", "A man is playing a guitar.", WORDS * 3, WORDS * 40, "Ünïcödé テキスト 文本 😀", WORDS * 8]


@pytest.mark.parametrize(
    ("pooling", "normalize", "max_seq_length", "dim"),
    [("cls", False, 512, 768), ("lasttoken", True, 512, 48)],
    ids=["cls-unnormalized-512-768", "lasttoken-512-48"],
)
def test_the_model_serves_what_sentence_transformers_computes(tmp_path, pooling, normalize, max_seq_length, dim):
    from sentence_transformers import SentenceTransformer
    from triton_embed_server.embedded import EmbeddedServer

    model = small_sentence_transformer(
        tmp_path / "st", dim, pooling=pooling, normalize=normalize, max_seq_length=max_seq_length
    )
    repo = repository_for(model, tmp_path / "repo")
    reference = SentenceTransformer(str(model), device="cpu")
    assert len(reference.tokenizer(TEXTS[4])["input_ids"]) > max_seq_length  # truncation is exercised
    expected = reference.encode(TEXTS, normalize_embeddings=True)
    server = EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log")
    with server:
        served = infer(server.grpc_url, TEXTS, None)
        one_by_one = np.concatenate([infer(server.grpc_url, [text], None) for text in TEXTS])
    assert served.shape == (len(TEXTS), dim)
    np.testing.assert_allclose(served, expected, atol=1e-5)
    np.testing.assert_allclose(one_by_one, expected, atol=1e-5)
