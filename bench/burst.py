"""Overload burst: many closed-loop gRPC clients against the service, with and without load shedding.

    python -m bench.burst --clients 192 --seconds 10 --budgets 0,120,180

For each ``LATENCY_BUDGET_MS`` it starts the embedded server on a copy of the model repository (response cache
off, that budget on the encoder, ``--metrics-config summary_latencies=true`` for Triton's own p99), runs
:func:`burst`, and prints one markdown row: answered/s, shed, accepted p50/p99 as the clients saw them, p99 of the
ensemble inside Triton (``nv_inference_request_summary_us``), and how long shed requests took to come back.
``tests/test_faults.py`` runs the same burst against the shipped configs.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def burst(url: str, texts: list[str], clients: int, seconds: float, timeout_s: float) -> list[tuple]:
    """``clients`` concurrent single-sentence gRPC loops for ``seconds``.

    A client whose request was shed backs off exponentially (``triton_embed.transport.backoff``: 0.1 s doubling,
    capped at 2 s), as the library's retries do. Texts are taken round-robin with a per-client offset.

    Returns:
        one ``(outcome, latency ms, error message or "")`` per request; outcome ``ok``, the gRPC status
        (``StatusCode.UNAVAILABLE``, ...), or ``hung`` when no answer came within ``timeout_s + 5`` s.
    """
    import tritonclient.grpc.aio as grpcaio
    from triton_embed.transport import backoff
    from tritonclient.utils import InferenceServerException

    client = grpcaio.InferenceServerClient(url)
    results: list[tuple] = []
    stop_at = time.monotonic() + seconds

    async def loop(i: int) -> None:
        n, shed_in_a_row = i, 0
        while time.monotonic() < stop_at:
            tensor = grpcaio.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[texts[n % len(texts)].encode()]], dtype=np.object_))
            n += clients
            start = time.perf_counter()
            try:
                await asyncio.wait_for(client.infer("embed", [tensor], client_timeout=timeout_s), timeout_s + 5)
                results.append(("ok", (time.perf_counter() - start) * 1000, ""))
                shed_in_a_row = 0
            except InferenceServerException as exc:
                results.append((str(exc.status()), (time.perf_counter() - start) * 1000, exc.message()))
                await asyncio.sleep(backoff(shed_in_a_row, 0.1))  # a shed client backs off as triton_embed does
                shed_in_a_row += 1
            except TimeoutError:
                results.append(("hung", (time.perf_counter() - start) * 1000, ""))

    try:
        await asyncio.gather(*(loop(i) for i in range(clients)))
    finally:
        await client.close()
    return results


def triton_p99_ms(metrics_url: str) -> float:
    """The ensemble's p99 request duration from Triton's summary metric (ms; NaN when absent)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()  # noqa: S310 - our own loopback server
    match = re.search(r'nv_inference_request_summary_us\{model="embed",version="1",quantile="0.99"\} (\S+)', text)
    return float(match.group(1)) / 1000 if match else float("nan")


def run_budget(budget: float, texts: list[str], clients: int, seconds: float) -> str:
    """Start a server with ``LATENCY_BUDGET_MS`` = ``budget``, burst it, return the markdown row."""
    from triton_embed_server.embedded import EmbeddedServer

    from bench.run import variant_repository

    with tempfile.TemporaryDirectory() as tmp:
        repo = variant_repository(Path(tmp) / "repo", None, latency_budget_ms=budget)
        extra = ("--metrics-config=summary_latencies=true",)
        log = Path(tmp) / "tritonserver.log"
        with EmbeddedServer(
            model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=log, extra_args=extra
        ) as srv:
            results = asyncio.run(burst(srv.grpc_url, texts, clients=clients, seconds=seconds, timeout_s=10.0))
            inside = triton_p99_ms(srv.metrics_url)
    ok = np.array([ms for outcome, ms, _ in results if outcome == "ok"])
    shed = np.array([ms for outcome, ms, _ in results if outcome == "StatusCode.UNAVAILABLE"])
    other = len(results) - len(ok) - len(shed)
    p50, p99 = np.percentile(ok, [50, 99]) if ok.size else (float("nan"),) * 2
    shed_p50 = f"{np.percentile(shed, 50):.0f} ms" if shed.size else "-"
    return (
        f"| {budget:g} | {ok.size / seconds:.0f} | {shed.size} | {other} | {p50:.0f} / {p99:.0f} ms | {inside:.0f} ms "
        f"| {shed_p50} |"
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: one server and one burst per budget; prints a markdown table."""
    from loadtest.corpus import STS_DIR, sts_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=192)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--budgets", default="0,120,180", help="LATENCY_BUDGET_MS values, ms (0 = no shedding)")
    args = parser.parse_args(argv)
    dev = STS_DIR / "sts-dev.csv"
    if not dev.is_file():
        sys.exit(f"STS Benchmark not found at {dev} (set TRITON_EMBED_STS_DIR)")
    texts = [f"{cols[5]} {i}" for i, cols in enumerate(sts_rows(dev))]  # unique, as in tests/test_faults.py
    print(f"{args.clients} clients, {args.seconds:g} s, single STS-B dev sentences over gRPC")
    print("| LATENCY_BUDGET_MS | answered ok/s | shed | other errors | accepted p50 / p99 | p99 in Triton | shed p50 |")
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for budget in (float(b) for b in args.budgets.split(",")):
        print(run_budget(budget, texts, args.clients, args.seconds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
