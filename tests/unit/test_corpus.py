"""The load test's deck: one-text requests repeat a text only after every distinct text has been dealt."""

from __future__ import annotations

import pytest

from loadtest.corpus import CorpusError, Deck


def words(texts: list[str]) -> list[tuple[str, ...]]:
    """Each text's words, order aside: what the deck keeps of a text."""
    return sorted(tuple(sorted(text.split(" "))) for text in texts)


def test_every_distinct_text_is_dealt_once_before_any_repeats():
    texts = [f"sentence {i}" for i in range(50)] + ["sentence 3", "sentence 7"]  # STS-B repeats sentences too
    deck = Deck(texts, seed=1)
    assert deck.texts == [f"sentence {i}" for i in range(50)]
    first = [deck.deal() for _ in range(50)]
    assert words(first) == words(deck.texts) and deck.wraps == 0
    second = [deck.deal() for _ in range(50)]
    assert words(second) == words(deck.texts) and deck.wraps == 1
    assert first != second  # shuffled again, not replayed in the same order


def test_another_run_deals_texts_the_server_has_not_answered():
    """Two runs against one server (another seed each) send the same words in other orders: the response cache
    answers almost none of the second run's texts, and a pass after the deck went round is new bytes too."""
    texts = [f"a sentence of several words number {i}" for i in range(200)] + ["one-word"]
    first, second = Deck(texts, seed=1), Deck(texts, seed=2)
    one = [first.deal() for _ in range(201)]
    other = [second.deal() for _ in range(201)]
    assert words(one) == words(other) == words(texts)
    assert set(one) & set(other) == {"one-word"}  # a text of one word has no other order
    again = [first.deal() for _ in range(201)]
    assert first.wraps == 1 and set(again) & set(one) == {"one-word"}
    assert set(one) & set(texts) == {"one-word"}


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
