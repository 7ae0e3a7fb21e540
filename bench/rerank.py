"""Rerank throughput: pairs/s at p99 <= 200 ms for a query with 16 and with 64 documents, served vs in-process.

The reranker is a stand-in of cross-encoder/ms-marco-MiniLM-L6-v2's size and shape, which cannot be had offline:
all-MiniLM-L6-v2's own 6-layer BERT (the packaged one) under a one-label classification head with random weights,
saved as a sentence-transformers CrossEncoder. Compute per pair is the real model's; its scores mean nothing.

* ceiling: ``CrossEncoder.predict`` in this process on the same pairs, one query's documents per call, as a caller
  without a server would run them (all cores, torch's own threads).
* served: ``make model`` of the stand-in as ``rerank`` at ``--precision`` (default: the export's auto choice), one
  ``make serve``-style server, closed loops of the client library's ``rerank()`` at rising concurrency; each request
  is a query never sent before with the next documents of the corpus (no response cache hits).
* Infinity (``make peers``; skipped without its venv): the same folder served by ``infinity_emb v2`` (torch engine,
  fp32), its ``/rerank`` swept the same way over HTTP/JSON; its scores checked against ``CrossEncoder.predict``.

``make bench`` ends with it (``bench.run --rerank-sizes``); alone: ``python -m bench.rerank`` (``make bench-rerank``),
~4 min on 2 cores. Prints one table with the ratio to the ceiling.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.loadgen import best_under_sla, json_sender, post_json, sweep
from bench.serving import INFINITY, RERANK_WORK, cpu_model, stand_in, wait_http
from loadtest.corpus import CorpusError, load_corpus


def ceiling(model_dir: Path, queries: list[str], documents: list[str], size: int, seconds: float) -> float:
    """Pairs/s of ``CrossEncoder.predict`` in this process, one call per query with ``size`` documents."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(model_dir), device="cpu")
    docs = itertools.cycle(documents)
    model.predict([(queries[0], next(docs)) for _ in range(size)], batch_size=size)  # warm
    pairs, start = 0, time.perf_counter()
    for query in itertools.cycle(queries):
        model.predict([(query, next(docs)) for _ in range(size)], batch_size=size, show_progress_bar=False)
        pairs += size
        if time.perf_counter() - start >= seconds:
            return pairs / (time.perf_counter() - start)
    raise AssertionError("unreachable")


def infinity_levels(model_dir: Path, requests, size: int, *, levels: list[int], duration_s: float, sla_ms: float):
    """Infinity's ``/rerank`` on ``model_dir``, swept at ``levels`` with ``requests()`` ((query, documents) per call).

    Returns:
        (levels, the max |Infinity's score - CrossEncoder.predict's| over one request's documents).
    """
    import http.client
    import json
    import subprocess

    from sentence_transformers import CrossEncoder
    from triton_embed_server.embedded import free_port

    port = free_port()
    command = [
        str(INFINITY),
        "v2",
        "--model-id",
        str(model_dir),
        "--served-model-name",
        "rerank",
        "--engine",
        "torch",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-vector-disk-cache",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    offline = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
    proc = subprocess.Popen(command, env={**os.environ, **offline})  # noqa: S603 - the pinned peer
    try:
        wait_http("127.0.0.1", port, "/health", timeout_s=180)
        query, docs = requests()
        answer = json.loads(
            post_json(
                http.client.HTTPConnection("127.0.0.1", port, timeout=60),
                "/rerank",
                {"model": "rerank", "query": query, "documents": docs},
            )
        )
        got = np.array([r["relevance_score"] for r in sorted(answer["results"], key=lambda r: r["index"])])
        reference = CrossEncoder(str(model_dir), device="cpu").predict([(query, d) for d in docs])
        agreement = float(np.abs(got - reference).max())

        def make_sender():
            def body(_: str) -> dict:
                query, docs = requests()
                return {"model": "rerank", "query": query, "documents": docs}

            return json_sender(port, "/rerank", body)

        print(f"Infinity, {size} documents per request (max |score - CrossEncoder.predict| {agreement:.2g}):")
        return sweep(make_sender, [""], levels=levels, duration_s=duration_s, sla_ms=sla_ms), agreement
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure(
    texts: list[str],
    sizes: list[int],
    levels: list[int],
    *,
    duration_s: float,
    sla_ms: float,
    precision: str = "auto",
    work: Path = RERANK_WORK,
) -> dict:
    """Export the stand-in at ``precision`` into a served repository, sweep it and its peers per size of ``sizes``.

    ``texts``: queries (the first half, shuffled) and documents (the rest). Returns ``{"precision", "reason",
    "sla_ms", "rows"}``, a row per size: ``documents``, ``served`` (pairs/s at the best level within ``sla_ms``, 0
    without one), ``concurrency`` and ``p99_ms`` there (None without one), ``ceiling`` (``CrossEncoder.predict``
    pairs/s), ``infinity`` (pairs/s; None without its venv) and ``infinity_score_diff``.
    """
    from triton_embed import EmbeddingClient
    from triton_embed_server import export as exporter
    from triton_embed_server.embedded import EmbeddedServer

    texts = [texts[i] for i in np.random.default_rng(0).permutation(len(texts))]
    half = len(texts) // 2
    queries, documents = texts[:half], texts[half:]
    model_dir = stand_in(work)
    print(f"reranker: {model_dir} (all-MiniLM-L6-v2's BERT + a random one-label head)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        manifest = exporter.export(model_dir, Path(tmp) / "repo", precision=precision, name="rerank")
        print(f"served at {manifest.precision} ({manifest.precision_reason})")
        with EmbeddedServer(
            model_repository=Path(tmp) / "repo", http_port=0, grpc_port=0, metrics_port=0, log_file=Path(tmp) / "log"
        ) as server:
            fresh = itertools.count()  # every request a query never sent before: no response cache hits
            for size in sizes:

                def requests(size: int = size) -> tuple[str, list[str]]:
                    k = next(fresh)
                    return queries[k % len(queries)] + f" #{k}", [
                        documents[(k * size + j) % len(documents)] for j in range(size)
                    ]

                def make_sender(requests=requests):
                    client = EmbeddingClient(url=server.grpc_url, model="rerank", retries=0)
                    return lambda _: client.rerank(*requests())

                print(f"served, {size} documents per request:")
                levels_run = sweep(make_sender, queries, levels=levels, duration_s=duration_s, sla_ms=sla_ms)
                best = best_under_sla(levels_run, sla_ms)
                row = {
                    "documents": size,
                    "served": best.throughput * size if best else 0.0,
                    "concurrency": best.concurrency if best else None,
                    "p99_ms": best.p99_ms if best else None,
                    "ceiling": ceiling(model_dir, queries, documents, size, duration_s),
                    "infinity": None,
                    "infinity_score_diff": None,
                }
                if INFINITY.exists():
                    peer, row["infinity_score_diff"] = infinity_levels(
                        model_dir, requests, size, levels=levels, duration_s=duration_s, sla_ms=sla_ms
                    )
                    peer_best = best_under_sla(peer, sla_ms)
                    row["infinity"] = peer_best.throughput * size if peer_best else 0.0
                rows.append(row)
    return {"precision": manifest.precision, "reason": manifest.precision_reason, "sla_ms": sla_ms, "rows": rows}


def markdown(result: dict) -> str:
    """The table: served pairs/s within the SLA beside ``CrossEncoder.predict`` and Infinity, per request size."""
    lines = [
        f"Rerank: the stand-in of ms-marco-MiniLM-L6-v2's size, served at {result['precision']}.",
        "",
        f"| documents per request | served pairs/s at p99 <= {result['sla_ms']:.0f} ms | concurrency | p99 ms | "
        "CrossEncoder.predict pairs/s | x ceiling | Infinity pairs/s | x Infinity |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        served, peer = row["served"], row["infinity"]
        where = f"{row['concurrency']} | {row['p99_ms']:.0f}" if row["concurrency"] else "- | -"
        versus = f"{peer:.0f} | {served / peer:.2f}" if peer else ("0 | -" if peer == 0 else "not run | -")
        lines.append(
            f"| {row['documents']} | {served:.0f} | {where} | {row['ceiling']:.0f} | {served / row['ceiling']:.2f} "
            f"| {versus} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Export, serve, sweep, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, help="text file, one text per line (default: STS-B)")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per concurrency level")
    parser.add_argument("--sla-ms", type=float, default=200.0)
    parser.add_argument("--precision", default="auto", help="the export's PRECISION (default: auto)")
    parser.add_argument("--work", type=Path, default=RERANK_WORK, help="the stand-in's folder")
    args = parser.parse_args(argv)
    try:
        texts = load_corpus(args.corpus)
    except CorpusError as exc:
        sys.exit(str(exc))
    from triton_embed_server.precision import NATIVE_BF16_FLAGS, cpu_flags

    native = ", ".join(f for f in NATIVE_BF16_FLAGS if f in cpu_flags()) or "no native bf16"
    print(f"machine: {platform.machine()}, {cpu_model()} ({native}), {os.cpu_count()} CPUs, no GPU")
    result = measure(
        texts,
        args.sizes,
        args.levels,
        duration_s=args.duration,
        sla_ms=args.sla_ms,
        precision=args.precision,
        work=args.work,
    )
    print("\n" + markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
