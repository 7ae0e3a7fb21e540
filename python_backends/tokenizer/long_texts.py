"""Tokenize long texts from their head only, when that gives the same truncated ids as the whole text.

A text over ``max_seq_length`` tokens is truncated, so the tokens past the cut never reach the encoder; but the
Hugging Face tokenizer still normalizes and splits the whole text, and builds every overflowing window of it, while
every short request waits behind it in the tokenizer's single queue (docs/benchmarks.md, "Long texts beside short
requests"). The first :data:`HEAD_CHARS` characters hold far more than 256 tokens of any ordinary text, and tokenize
in a few ms.

When the head gives the same ids: WordPiece (BERT and the like) maps each word on its own, and a word longer than
``max_input_chars_per_word`` (100) to one ``[UNK]``, so cutting the text can change only the tokens of the word
that the cut splits, all within the last ``max_input_chars_per_word`` characters of the head. If the head still
overflows (more tokens than fit) and every token kept ends :func:`margin_chars` characters before the cut, the
kept ids are the whole text's. Otherwise, and for other tokenizer models (BPE, Unigram), the whole text is
tokenized.

Pure Python on ``tokenizers`` (no Triton): tests/unit/test_long_texts.py checks the ids against the whole text's.
"""

from __future__ import annotations

HEAD_CHARS = 4096
"""Characters of a long text tokenized first, ~800 words of English: ~1,000 tokens, 4x what all-MiniLM-L6-v2 keeps.
Texts whose kept tokens do not fit (e.g. 256 words of 20+ characters each) are tokenized whole."""


def margin_chars(tokenizer) -> int | None:
    """How far before the cut the kept tokens must end, characters; None when heads may not be used (not WordPiece).

    Twice WordPiece's ``max_input_chars_per_word``: the word that the cut splits lies within the last that many
    characters of the head, and only its tokens can differ from the whole text's.
    """
    model = tokenizer.model
    if type(model).__name__ != "WordPiece":
        return None
    return 2 * int(model.max_input_chars_per_word) + 1


def encode_heads(
    tokenizer, texts: list[str], margin: int | None, head_chars: int = HEAD_CHARS
) -> tuple[list, list[int]]:
    """``tokenizer.encode_batch(texts)`` (special tokens added, truncation as configured), long texts from their head.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` with truncation set.
        texts: the texts, in order.
        margin: :func:`margin_chars` of ``tokenizer``; None tokenizes every text whole.
        head_chars: the head's length, characters.

    Returns:
        ``(encodings, chars)``: one ``tokenizers.Encoding`` per text, in order, and the characters tokenized for
        each (the head's length for a text read from its head; the head plus the whole text for one whose head did
        not suffice): what its tokenization cost, which grows about linearly with them. For a text tokenized from
        its head, ``ids`` and ``attention_mask`` equal the whole text's and ``overflowing`` is non-empty (it was
        truncated), but the overflowing windows cover the head only.
    """
    if margin is None:
        return tokenizer.encode_batch(texts, add_special_tokens=True), [len(text) for text in texts]
    cut = [len(text) > head_chars for text in texts]
    encodings = tokenizer.encode_batch(
        [text[:head_chars] if long else text for text, long in zip(texts, cut, strict=True)], add_special_tokens=True
    )
    chars = [min(len(text), head_chars) for text in texts]
    redo = [i for i, long in enumerate(cut) if long and not _head_suffices(encodings[i], head_chars - margin)]
    if redo:
        whole = tokenizer.encode_batch([texts[i] for i in redo], add_special_tokens=True)
        for i, encoding in zip(redo, whole, strict=True):
            encodings[i] = encoding
            chars[i] += len(texts[i])
    return encodings, chars


def _head_suffices(encoding, last_end: int) -> bool:
    """The head was truncated, and every token kept ends at or before character ``last_end`` of it."""
    return bool(encoding.overflowing) and max(end for _, end in encoding.offsets) <= last_end
