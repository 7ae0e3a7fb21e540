"""The load test's deck: one-text requests repeat a text only after every distinct text has been dealt."""

from __future__ import annotations

import random

import pytest

from loadtest.corpus import CorpusError, Deck


def test_every_distinct_text_is_dealt_once_before_any_repeats():
    texts = [f"sentence {i}" for i in range(50)] + ["sentence 3", "sentence 7"]  # STS-B repeats sentences too
    deck = Deck(texts, random.Random(1))
    assert deck.texts == [f"sentence {i}" for i in range(50)]
    first = [deck.deal() for _ in range(50)]
    assert sorted(first) == sorted(deck.texts) and deck.wraps == 0
    second = [deck.deal() for _ in range(50)]
    assert sorted(second) == sorted(deck.texts) and deck.wraps == 1
    assert first != second  # shuffled again, not replayed in the same order


def test_an_empty_corpus_is_refused():
    with pytest.raises(CorpusError, match="no text"):
        Deck([])
