"""The load test's deck: one-text requests repeat a text only after every distinct text has been dealt."""

from __future__ import annotations

import pytest

from loadtest.corpus import CorpusError, Deck


def test_every_distinct_text_is_dealt_once_before_any_repeats():
    texts = [f"sentence {i}" for i in range(50)] + ["sentence 3", "sentence 7"]  # STS-B repeats sentences too
    deck = Deck(texts, seed=1)
    assert deck.texts == [f"sentence {i}" for i in range(50)]
    first = [deck.deal() for _ in range(50)]
    assert sorted(first) == sorted(deck.texts) and deck.wraps == 0
    second = [deck.deal() for _ in range(50)]
    assert sorted(second) == sorted(deck.texts) and deck.wraps == 1
    assert first != second  # shuffled again, not replayed in the same order


def test_an_empty_corpus_is_refused():
    with pytest.raises(CorpusError, match="no text"):
        Deck([])


def test_a_later_run_continues_the_same_order_where_the_earlier_one_stopped():
    """A capacity search's steps are separate Locust processes: each continues the previous step's deck, so a step
    does not resend (and get cache hits for) what an earlier step sent."""
    texts = [f"sentence {i}" for i in range(30)]
    whole = Deck(texts, seed=7)
    expected = [whole.deal() for _ in range(70)]
    first = Deck(texts, seed=7)
    got = [first.deal() for _ in range(25)]
    later = Deck(texts, seed=first.seed, start=first.dealt)
    got += [later.deal() for _ in range(45)]
    assert got == expected and later.dealt == 70 and later.wraps == 2
