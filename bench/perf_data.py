"""perf_analyzer's ``--input-data`` file for the ``embed`` ensemble: one text per request, none repeated.

perf_analyzer without ``--input-data`` sends one random string as every text, which the response cache answers from
the second request on, and random strings as the optional inputs ``TRUNCATE`` and ``PROMPT_NAME``, which the
tokenizer refuses (INVALID_ARG). This file names ``TEXT`` alone, shape ``[1]``, and appends a tag new to each file
and a number to each corpus text: 200,000 texts, none held by an earlier file. perf_analyzer starts every
concurrency level from the file's first text, so each level needs a file of its own, or the response cache answers
the repeats::

    for c in 4 8 16; do
      python -m bench.perf_data --out .build/perf-texts.json   # make perf-data; --corpus FILE for your texts
      perf_analyzer -m embed -i grpc -u 127.0.0.1:8001 --input-data .build/perf-texts.json --concurrency-range $c
    done
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".build" / "perf-texts.json"


def unique_texts(count: int, tag: str, corpus: str | Path | None = None) -> list[str]:
    """``count`` texts that never repeat: the corpus's texts in order, each with ``tag`` and its number appended.

    Args:
        count: how many.
        tag: a word put before each number, so two files with different tags share no text.
        corpus: a text file, one text per line; None = STS-B train+dev (``loadtest.corpus.load_corpus``).

    Raises:
        loadtest.corpus.CorpusError: the file is missing or empty, or no file is named and STS-B is absent.
    """
    from loadtest.corpus import load_corpus

    texts = load_corpus(corpus)
    return [f"{texts[i % len(texts)]} {tag}{i}" for i in range(count)]


def perf_analyzer_data(texts: list[str]) -> dict:
    """perf_analyzer's input-data JSON: ``{"data": [{"TEXT": {"content": [text], "shape": [1]}}, ...]}``."""
    return {"data": [{"TEXT": {"content": [text], "shape": [1]}} for text in texts]}


def main(argv: list[str] | None = None) -> int:
    """Write the file; print its path and how to run perf_analyzer with it."""
    from loadtest.corpus import CorpusError

    parser = argparse.ArgumentParser(prog="python -m bench.perf_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="text file, one text per line (default: STS-B train+dev)")
    parser.add_argument("--count", type=int, default=200_000, help="texts (requests) in the file")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be at least 1; got {args.count}")
    try:
        texts = unique_texts(args.count, f"pa{secrets.token_hex(3)}-", args.corpus)
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(perf_analyzer_data(texts)))
    print(f"{args.out}: {len(texts)} texts no earlier file held, TEXT only")
    print(
        f"perf_analyzer -m embed -i grpc -u 127.0.0.1:8001 --input-data {args.out} --concurrency-range C "
        "--stability-percentage 25   # one level C per file: perf_analyzer starts each level from the first text"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
