"""Per-bucket statistics on Triton's metrics endpoint and in the load log."""

from __future__ import annotations

import re
import secrets

from helpers import scrape
from triton_embed import EmbeddingClient


def bucket_samples(samples: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in samples.items() if k.startswith("triton_embed_bucket_executions_total{")}


def test_bucket_executions_and_padding_tokens_are_exported(server):
    before = scrape(server.metrics_url)
    unique = secrets.randbelow(10**6)  # no response-cache hit from an earlier run
    texts = [f"hi {unique}", f"{unique} a somewhat longer sentence that needs more than sixteen tokens to be encoded"]
    with EmbeddingClient(url=server.grpc_url) as client:
        for text in texts:
            client.embed([text])
    after = scrape(server.metrics_url)

    grew = {k: after[k] - before.get(k, 0.0) for k in bucket_samples(after) if after[k] > before.get(k, 0.0)}
    assert sum(grew.values()) == 2, grew
    assert all('model="encoder"' in k and 'path="eager"' in k for k in grew)
    lengths = sorted(int(re.search(r'bucket="\*x(\d+)"', k).group(1)) for k in grew for _ in range(int(grew[k])))
    assert lengths[0] <= 8 and lengths[-1] >= 24  # the short text took a short bucket, the long one a longer one

    real = after['triton_embed_real_tokens_total{model="encoder"}'] - before.get(
        'triton_embed_real_tokens_total{model="encoder"}', 0.0
    )
    padded = after['triton_embed_padded_tokens_total{model="encoder"}'] - before.get(
        'triton_embed_padded_tokens_total{model="encoder"}', 0.0
    )
    assert 0 < real <= padded


def test_load_log_names_the_buckets(server):
    log = server.config.log_file.read_text()
    line = next(x for x in log.splitlines() if "warmup done" in x)
    assert "10 bucket lengths, eager on cpu (rows exact); lengths [8, 16, 24, 32, 48, 64, 96, 128, 192, 256]" in line


def test_the_p99_the_sla_alert_reads_is_published(server):
    """monitoring/prometheus/alerts.yml's p99-over-SLA alert reads the ensemble's compute-infer summary, which Triton
    publishes only with ``--metrics-config=summary_latencies=true``: without it, on `make serve`, the alert had no
    data and stayed silent."""
    with EmbeddingClient(url=server.grpc_url) as client:
        client.embed([f"summary latencies {secrets.randbelow(10**6)}"])  # not a cache hit: it reaches the steps
    samples = scrape(server.metrics_url)
    p99 = [
        v
        for k, v in samples.items()
        if k.startswith("nv_inference_compute_infer_summary_us{") and 'model="embed"' in k and 'quantile="0.99"' in k
    ]
    assert p99 and 0 < p99[0] < 10_000_000, sorted(k for k in samples if "summary" in k)[:10]
