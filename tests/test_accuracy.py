"""The served embeddings equal in-process sentence-transformers, on real text and on edge cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import reference_embed
from scipy.stats import spearmanr
from triton_embed import EmbeddingClient

# Spearman x100 of cosine vs gold on STS-B dev for in-process all-MiniLM-L6-v2 (measured here, ../shared/NOTES.md).
REFERENCE_SPEARMAN = 86.72


def test_sts_dev_equals_reference_and_keeps_spearman(server, reference, sts_dev):
    sentences = [s for p in sts_dev for s in (p.a, p.b)]
    assert len(sentences) == 3000
    served = []
    with EmbeddingClient(url=server.grpc_url, protocol="grpc") as client:
        start = 0
        for size in itertools.cycle((1, 7, 64)):  # mixed request sizes
            if start >= len(sentences):
                break
            served.append(client.embed(sentences[start : start + size]))
            start += size
    served = np.concatenate(served)
    expected = reference_embed(reference, sentences)

    assert served.shape == (3000, 384) and served.dtype == np.float32
    cosine = (served * expected).sum(axis=1) / (np.linalg.norm(served, axis=1) * np.linalg.norm(expected, axis=1))
    worst = int(cosine.argmin())
    assert cosine[worst] >= 0.9999, f"sentence {worst} {sentences[worst]!r}: cosine {cosine[worst]:.6f}"

    a, b = served[0::2], served[1::2]
    spearman = spearmanr((a * b).sum(axis=1), [p.score for p in sts_dev]).statistic * 100
    assert spearman == pytest.approx(REFERENCE_SPEARMAN, abs=0.05)


EDGE_TEXTS = {
    "one_char": "a",
    "empty": "",
    "whitespace": "   \t ",
    "ten_thousand_chars": ("The quick brown fox jumps over the lazy dog. " * 230)[:10_000],
    "cjk": "日本語の文章を埋め込みます。今日は良い天気です。",
    "cyrillic": "Мужчина играет на гитаре на сцене.",
    "arabic": "رجل يعزف على الجيتار",
    "emoji": "🎸🔥😀 great show tonight 👏",
    "combining_marks": "Ünïcödé e\u0301 ﬁ ligature",
}


@pytest.mark.parametrize("name", list(EDGE_TEXTS))
def test_edge_texts_equal_reference(client, reference, name):
    text = EDGE_TEXTS[name]
    served = client.embed([text])
    expected = reference_embed(reference, [text])
    assert served.shape == (1, 384)
    np.testing.assert_allclose(served, expected, atol=1e-5)


def test_long_text_is_truncated_like_sentence_transformers(server, reference):
    # Two texts that differ only after the 256th token embed identically, in the service as in process.
    base = "word " * 300
    with EmbeddingClient(url=server.grpc_url) as client:
        served = client.embed([base + "alpha", base + "omega"])
    np.testing.assert_allclose(served[0], served[1], atol=1e-6)
    np.testing.assert_allclose(served, reference_embed(reference, [base + "alpha", base + "omega"]), atol=1e-5)


def test_similarity_of_paraphrases_beats_unrelated(server):
    with EmbeddingClient(url=server.http_url, protocol="http") as client:
        close = client.similarity("A man is playing a guitar.", "Someone is playing a guitar.")
        far = client.similarity("A man is playing a guitar.", "The stock market fell sharply today.")
    assert 0.7 < close <= 1.0 + 1e-6
    assert far < 0.3
