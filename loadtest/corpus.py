"""Real text for load: STS Benchmark sentences, or a text file with one text per line."""

from __future__ import annotations

import os
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The data lives beside the checkout and is never copied into it; TRITON_EMBED_STS_DIR points elsewhere.
STS_DIR = Path(os.environ.get("TRITON_EMBED_STS_DIR", ROOT.parent / "shared" / "data" / "stsbenchmark"))
STS_FILES = ("sts-train.csv", "sts-dev.csv")


class CorpusError(ValueError):
    """No usable text: the named file is missing or empty, or STS-B is absent and no file was named."""


def load_corpus(path: str | Path | None = None, sts_dir: Path = STS_DIR) -> list[str]:
    """Texts to send, in file order.

    Args:
        path: a UTF-8 text file, one text per line (blank lines skipped); None = STS-B train+dev, both sentence
            columns (14,498 sentences, 13,227 distinct: median 14 tokens, p95 31, max 53 for all-MiniLM-L6-v2).
        sts_dir: folder with ``sts-train.csv`` and ``sts-dev.csv`` (tab-separated, sentences in columns 5 and 6).

    Returns:
        the texts, non-empty strings.

    Raises:
        CorpusError: ``path`` is missing or holds no text, or ``path`` is None and STS-B is not in ``sts_dir``.
    """
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise CorpusError(f"corpus file {file} not found (expected a text file, one text per line)")
        texts = [line.strip() for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            raise CorpusError(f"corpus file {file} holds no text")
        return texts
    files = [sts_dir / name for name in STS_FILES]
    if not all(f.is_file() for f in files):
        raise CorpusError(
            f"STS Benchmark not found in {sts_dir} (set TRITON_EMBED_STS_DIR to its folder); or name a text file, "
            "one text per line, instead: --corpus FILE (make perf-data CORPUS=FILE, make bench BENCH_ARGS='--corpus "
            "FILE', make loadtest LOCUST_ARGS='--corpus FILE')"
        )
    return [text for f in files for cols in sts_rows(f) for text in (cols[5], cols[6])]


def sts_rows(path: Path) -> list[list[str]]:
    """The tab-separated columns of one STS Benchmark file: 4 is the gold score 0..5, 5 and 6 the sentences."""
    return [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]


class Deck:
    """The corpus's distinct texts in a random order, dealt one at a time without repeats until all are dealt.

    Drawing single texts at random with replacement repeats them, and a third or more of a run's requests are then
    response-cache hits, which measure the cache, not the model (docs/benchmarks.md, "Response-cache hits"). Dealt
    from a deck, a one-text request repeats a text only after the whole corpus has been dealt (then the deck is
    shuffled again). A text is dealt with its words in an order of its own to the seed and the pass (:func:`reword`):
    the same words, so the same tokens and the same work for the model, but bytes the server has not answered before,
    so that a second run against the same server, or a pass after the deck went round, measures the model and not the
    response cache. One deck per Locust process (gevent: no locks needed). The order follows from ``seed`` alone, so a
    later run (a capacity search's next step) continues where an earlier one stopped by starting at its ``dealt``.

    Attributes:
        texts: the distinct texts, in corpus order of first appearance.
        seed: the order's seed. dealt: texts dealt so far, ``start`` included.
        wraps: how many times the whole deck has been dealt and shuffled again.
    """

    def __init__(self, texts: list[str], seed: int | None = None, start: int = 0) -> None:
        """Deal from ``seed``'s order (None: a random seed), skipping its first ``start`` texts.

        Raises:
            CorpusError: ``texts`` is empty.
        """
        self.texts = list(dict.fromkeys(texts))
        if not self.texts:
            raise CorpusError("no text to send")
        self.seed = random.SystemRandom().randrange(2**32) if seed is None else seed
        self._rng = random.Random(self.seed)  # noqa: S311 - ordering sentences, not secrets
        self.dealt = self.wraps = 0
        self._order = self._shuffled()
        for _ in range(start):
            self.deal()

    def _shuffled(self) -> list[str]:
        words = random.Random(f"{self.seed}:{self.wraps}")  # noqa: S311 - ordering words, not secrets
        return [reword(text, words) for text in self._rng.sample(self.texts, len(self.texts))]

    def deal(self) -> str:
        """The next text; once all are dealt, the deck is shuffled again first (``wraps`` counts it)."""
        if not self._order:
            self.wraps += 1
            self._order = self._shuffled()
        self.dealt += 1
        return self._order.pop()


def reword(text: str, rng: random.Random) -> str:
    """``text`` with its space-separated words in ``rng``'s order (a text of one word comes back as it is).

    The words, and so the tokens a WordPiece tokenizer makes of them, are the same (a byte-level BPE tokenizer may
    count one more or one fewer where a word moves to or from the start): the model does the same work for a text
    whose bytes are new to the response cache.
    """
    words = text.split(" ")
    if len(words) < 2:
        return text
    rng.shuffle(words)
    return " ".join(words)
