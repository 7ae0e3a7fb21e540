"""``make bench-encoder``: the exported encoder's variants in process, side by side, against sentence-transformers.

Each variant embeds the same texts in batches of 32 sorted by length (as ``SentenceTransformer.encode`` batches
them), with all CPU cores as torch threads; the variants run in turns, round after round, so the machine's drift
falls on all of them alike, and each one's median round is reported. Variants:

* ``sentence-transformers``: ``SentenceTransformer.encode`` itself, fp32 (the reference and the ceiling).
* ``traced <attention> <precision>``: the module ``make model`` writes (``encoder_module.build_traced_encoder``),
  with transformers' ``eager`` and ``sdpa`` attention at fp32, and with ``sdpa`` at bf16 (``PRECISION=bf16``: traced
  under CPU autocast). bf16 is fast only on a CPU with native bf16 (``precision.NATIVE_BF16_FLAGS``).

Two corpora: STS-B sentences (median 14 tokens; or ``--corpus FILE``) and texts at the model's ``max_seq_length``,
where attention's share of the work is largest. Prints one markdown table: sentences/s, x sentence-transformers, and
the worst |difference| and lowest cosine of each variant's embeddings to sentence-transformers' (fp32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from triton_embed_server.precision import NATIVE_BF16_FLAGS, cpu_flags

from bench.serving import cpu_model
from loadtest.corpus import CorpusError, load_corpus


def batches(tokenizer, texts: list[str], max_length: int, batch_size: int = 32) -> list[tuple]:
    """``texts`` sorted by length, tokenized in batches of ``batch_size``.

    Returns:
        ``[(input_ids, attention_mask)]``, int64 torch tensors ``[batch_size, longest]``, padded on the right.
    """
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(texts)), key=lengths.__getitem__)
    out = []
    for start in range(0, len(order), batch_size):
        chunk = [texts[i] for i in order[start : start + batch_size]]
        enc = tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        out.append((enc["input_ids"], enc["attention_mask"]))
    return out


def compare(corpus_name: str, texts: list[str], st, modules: dict, rounds: int) -> list[tuple]:
    """Time sentence-transformers and each of ``modules`` on ``texts`` in turns for ``rounds`` rounds.

    Returns:
        One row per variant: (corpus name, variant, median sentences/s, "slowest-fastest" sentences/s,
        x sentence-transformers, max abs diff and min cosine of its embeddings to sentence-transformers').
    """
    import torch

    limit = st.max_seq_length
    prepared = batches(st.tokenizer, texts, limit)
    reference = st.encode(texts, batch_size=32, normalize_embeddings=True)
    lengths = [len(ids) for ids in st.tokenizer(texts, truncation=True, max_length=limit)["input_ids"]]
    sorted_reference = reference[sorted(range(len(texts)), key=lengths.__getitem__)]

    def run_module(module):
        with torch.no_grad(), torch.jit.optimized_execution(False):
            return np.concatenate([module(ids, mask).float().numpy() for ids, mask in prepared])

    systems = {"sentence-transformers": lambda: st.encode(texts, batch_size=32)}
    for name, module in modules.items():
        systems[name] = lambda module=module: run_module(module)
    outputs = {name: run() for name, run in systems.items()}  # warm-up, and the embeddings compared
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name, run in systems.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = len(texts) / statistics.median(times["sentence-transformers"])
    rows = []
    for name in systems:
        rate = len(texts) / statistics.median(times[name])
        got = outputs[name] / np.linalg.norm(outputs[name], axis=1, keepdims=True)
        expected = reference if name == "sentence-transformers" else sorted_reference
        diff = float(np.abs(got - expected).max())
        cosine = float((got * expected).sum(axis=1).min())
        spread = f"{len(texts) / max(times[name]):.0f}-{len(texts) / min(times[name]):.0f}"
        rows.append((corpus_name, name, rate, spread, rate / base, diff, cosine))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print its table; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="text file, one text per line (default: STS-B train+dev)")
    parser.add_argument("--texts", type=int, default=1024, help="texts of the short corpus per round")
    parser.add_argument("--long-texts", type=int, default=128, help="texts at max_seq_length per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer
    from triton_embed_server.encoder_module import build_traced_encoder
    from triton_embed_server.export import default_model_path

    try:
        corpus = load_corpus(args.corpus)
    except CorpusError as exc:
        parser.error(str(exc))
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    path = default_model_path()
    st = SentenceTransformer(str(path), device="cpu")
    limit = st.max_seq_length
    rng = np.random.default_rng(0)
    short = [corpus[i] for i in rng.choice(len(corpus), size=min(args.texts, len(corpus)), replace=False)]
    words = " ".join(corpus).split()
    long = [" ".join(rng.choice(words, size=limit)) for _ in range(args.long_texts)]

    variants = {
        "traced sdpa fp32": ("sdpa", "fp32"),
        "traced eager fp32": ("eager", "fp32"),
        "traced sdpa bf16": ("sdpa", "bf16"),
    }
    modules = {
        name: build_traced_encoder(st, path, attention=attention, precision=precision)[0]
        for name, (attention, precision) in variants.items()
    }

    rows = []
    for corpus_name, texts in (("STS-B sentences", short), (f"{limit}-token texts", long)):
        rows += compare(corpus_name, texts, st, modules, args.rounds)
        print(f"{corpus_name}: done", file=sys.stderr, flush=True)

    native = sorted(cpu_flags() & set(NATIVE_BF16_FLAGS)) or ["no native bf16"]
    print(
        f"CPU: {cpu_model()} ({', '.join(native)}), {threads} torch threads, torch {torch.__version__}; "
        f"{args.rounds} rounds, median"
    )
    print("| texts | variant | sentences/s | spread | x sentence-transformers | max abs diff | min cosine |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for corpus_name, name, rate, spread, ratio, diff, cosine in rows:
        print(f"| {corpus_name} | {name} | {rate:.0f} | {spread} | {ratio:.2f} | {diff:.1e} | {cosine:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
