"""The autoscaler's signal against client latency: a closed-loop sweep against one replica.

The HorizontalPodAutoscaler (deploy/kubernetes/base/hpa.yaml) scales on the encoder's queue time per request, which
prometheus-adapter computes from Triton's counters (``nv_inference_queue_duration_us`` over
``nv_inference_request_success``, model ``encoder``). Its target should sit just below the value a replica shows when
its clients' p99 nears the SLA. This script measures that: the embedded server as ``make serve`` runs it (shipped
model repository, response cache on), then for each concurrency N threads send one STS-B sentence after another over
gRPC (single-sentence requests, the server's latency budget, no client retries: refusals count as errors). Each level
gets sentences no earlier level sent, so the response cache answers none of them. Around each level the script reads
the same two counters from the metrics endpoint and prints, per level: throughput, p50/p99, errors, the encoder's
queue time per request (what the adapter serves) and its mean batch.

    python -m bench.autoscale_signal                       # levels 1,8,16,24,32, 5 s each (+1 s warm-up)
    python -m bench.autoscale_signal --levels 1,4,8,12,16,20,24 --seconds 8

Results: docs/benchmarks.md, "Autoscaling signal".
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.loadgen import closed_loop, grpc_sender
from loadtest.corpus import CorpusError, load_corpus

COUNTERS = (
    "nv_inference_queue_duration_us",
    "nv_inference_request_success",
    "nv_inference_count",
    "nv_inference_exec_count",
)


def encoder_counters(metrics_url: str) -> dict[str, float]:
    """The encoder's counters in ``COUNTERS`` from Triton's metrics page, summed over versions."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:  # noqa: S310 - our own loopback server
        text = response.read().decode()
    found = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = re.match(r'(\w+)\{[^}]*model="encoder"[^}]*\} (\S+)$', line)
        if m and m.group(1) in found:
            found[m.group(1)] += float(m.group(2))
    return found


def cache_hits(grpc_url: str) -> int:
    """Response-cache hits of the ``embed`` ensemble so far (Triton's statistics API)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        stats = client.get_inference_statistics("embed", as_json=True)["model_stats"][0]
    finally:
        client.close()
    return int(stats["inference_stats"].get("cache_hit", {}).get("count", 0))


def main(argv: list[str] | None = None) -> int:
    """Start the server, sweep, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16, 24, 32])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level (after 1 s warm-up)")
    parser.add_argument("--sla-ms", type=float, default=200.0)
    args = parser.parse_args(argv)

    from triton_embed_server.embedded import EmbeddedServer

    try:
        texts = list(dict.fromkeys(load_corpus()))
    except CorpusError as exc:
        sys.exit(str(exc))
    rng = np.random.default_rng(0)
    texts = [texts[i] for i in rng.permutation(len(texts))]
    share = len(texts) // len(args.levels)  # each level its own sentences: no cache hits
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}; "
        f"{args.seconds:.0f} s per level, {share} distinct sentences each",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "tritonserver.log"
        with EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=log) as srv:

            def make_sender() -> Callable[[str], None]:
                return grpc_sender(srv.grpc_url)

            make_sender()("warm-up")
            for k, concurrency in enumerate(args.levels):
                before = encoder_counters(srv.metrics_url)
                level = closed_loop(make_sender, texts[k * share : (k + 1) * share], concurrency, args.seconds)
                time.sleep(0.5)  # Triton records a request's counters just after its answer
                delta = {n: v - before[n] for n, v in encoder_counters(srv.metrics_url).items()}
                queue_ms = delta["nv_inference_queue_duration_us"] / max(1.0, delta["nv_inference_request_success"])
                batch = delta["nv_inference_count"] / max(1.0, delta["nv_inference_exec_count"])
                rows.append((level, queue_ms / 1000, batch))
                print(
                    f"  {concurrency:3d} clients: {level.throughput:6.1f} req/s  p50 {level.p50_ms:6.1f} ms  "
                    f"p99 {level.p99_ms:6.1f} ms  errors {level.errors:4d}  encoder queue "
                    f"{queue_ms / 1000:6.1f} ms/request  batch {batch:4.1f}",
                    flush=True,
                )
            hits = cache_hits(srv.grpc_url)

    print(f"\nresponse-cache hits: {hits}\n")
    print("| clients | req/s | p50 ms | p99 ms | errors | encoder queue ms/request | encoder batch |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for level, queue_ms, batch in rows:
        print(
            f"| {level.concurrency} | {level.throughput:.1f} | {level.p50_ms:.1f} | {level.p99_ms:.1f} | "
            f"{level.errors} | {queue_ms:.1f} | {batch:.1f} |"
        )
    under = [(lv, q) for lv, q, _ in rows if lv.p99_ms <= args.sla_ms and lv.errors == 0]
    if under:
        lv, q = max(under, key=lambda row: row[0].concurrency)
        print(
            f"\nhighest load with p99 <= {args.sla_ms:.0f} ms and no errors: {lv.concurrency} clients, "
            f"p99 {lv.p99_ms:.1f} ms, encoder queue {q * 1000:.0f} us/request"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
