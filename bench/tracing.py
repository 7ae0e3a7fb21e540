"""Tracing's cost: the gateway's throughput with tracing off, with the sampling that follows load, and at 100%.

Three stacks (tritonserver + gateway each, the shipped repository with the response cache off) run side by side:
``off`` (no OpenTelemetry variable), ``adaptive`` (``OTEL_EXPORTER_OTLP_ENDPOINT`` set, ``OTEL_TRACES_SAMPLER``
unset, the admin key given so that the controller sets Triton's rate too; decisions every second) and ``all``
(``OTEL_TRACES_SAMPLER=parentbased_always_on``: Triton and the gateway trace every request). Both traced stacks
export to one OTLP sink that answers and discards (``triton_embed_gateway.otlp.OtlpReceiver(decode=False)``).
Rounds alternate between the stacks, each a closed loop of ``--concurrency`` callers sending one-text OpenAI
requests (float JSON) for ``--warmup`` unmeasured seconds (the controller settles) and ``--duration`` measured
ones, so that a machine that slows down slows all three alike. Reports each stack's median throughput over the
rounds, its ratio to ``off``, p50/p99 and the share traced at each round's end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from bench.loadgen import closed_loop, json_sender
from bench.serving import ROOT, variant_repository, wait_http
from loadtest.corpus import CorpusError, load_corpus

if TYPE_CHECKING:
    from triton_embed_server.embedded import EmbeddedServer

ADMIN_KEY = "bench-tracing"
STACKS = ("off", "adaptive", "all")


@contextlib.contextmanager
def stack(name: str, sink: str, folder: Path) -> Iterator[tuple[int, EmbeddedServer]]:
    """Tritonserver and gateway, traced as ``name`` says, exporting to ``sink``; yields (gateway port, server)."""
    from triton_embed_server.embedded import EmbeddedServer, free_port
    from triton_embed_server.tracing import triton_trace_args

    env: dict[str, str] = {}
    if name != "off":
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink, "TRITON_EMBED_ADMIN_KEY": ADMIN_KEY}
    if name == "adaptive":
        env["TRITON_EMBED_TRACE_INTERVAL_S"] = "1"
    if name == "all":
        env["OTEL_TRACES_SAMPLER"] = "parentbased_always_on"
    repo = variant_repository(folder / name, None)
    with EmbeddedServer(
        model_repository=repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        admin_key=ADMIN_KEY,
        log_file=folder / f"{name}.log",
        extra_args=triton_trace_args(env),
    ) as server:
        port = free_port()
        command = [sys.executable, "-m", "triton_embed_gateway", "--triton", server.grpc_url, "--port", str(port)]
        scrubbed = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRITON_EMBED_TRACE_"))}
        with (folder / f"{name}-gateway.log").open("w") as log:
            process = subprocess.Popen(command, cwd=ROOT, env={**scrubbed, **env}, stdout=log, stderr=log)  # noqa: S603
        try:
            wait_http("127.0.0.1", port, "/ready", timeout_s=60)
            yield port, server
        finally:
            process.terminate()
            process.wait(timeout=30)


def share_traced(port: int) -> float:
    """The gateway's ``triton_embed_gateway_trace_sampling_ratio``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:  # noqa: S310 - loopback
        line = next(
            x for x in page.read().decode().splitlines() if x.startswith("triton_embed_gateway_trace_sampling_ratio ")
        )
    return float(line.split()[1])


def sender(port: int) -> Callable[[str], None]:
    """A one-text OpenAI request sender on its own connection (``bench.loadgen``'s ``make_sender``)."""
    return json_sender(port, "/v1/embeddings", lambda text: {"input": [text]})


def measure(texts: list[str], concurrency: int, rounds: int, duration_s: float, warmup_s: float) -> dict:
    """Run the three stacks' rounds, interleaved; returns per stack its rounds and medians."""
    from triton_embed_gateway.otlp import OtlpReceiver

    results: dict[str, list[dict]] = {name: [] for name in STACKS}
    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver(decode=False) as sink, contextlib.ExitStack() as stacks:
        started = {name: stacks.enter_context(stack(name, sink.endpoint, Path(tmp))) for name in STACKS}
        ports = {name: port for name, (port, _) in started.items()}
        for k in range(rounds):
            for name in STACKS if k % 2 == 0 else STACKS[::-1]:  # each stack first and last alike
                start = k * 5000 % len(texts)  # each round other texts, though the cache is off
                rotated = texts[start:] + texts[:start]
                level = closed_loop(lambda p=ports[name]: sender(p), rotated, concurrency, duration_s, warmup_s)
                exit_code = started[name][1].exit_code  # a crash of tritonserver, not of ours (markdown)
                results[name].append(
                    {
                        "throughput": level.throughput,
                        "p50_ms": level.p50_ms,
                        "p99_ms": level.p99_ms,
                        "errors": level.errors,
                        "triton_exit": exit_code,
                        "share": share_traced(ports[name]),
                    }
                )
                shared = "-" if name == "off" else f"{results[name][-1]['share']:.3g}"
                print(
                    f"  round {k + 1} {name}: {level.throughput:.1f} req/s, p99 {level.p99_ms:.0f} ms, "
                    f"share traced {shared}",
                    flush=True,
                )
        exports = len(sink.requests)
    out: dict = {"concurrency": concurrency, "rounds": rounds, "duration_s": duration_s, "exports": exports}
    clean = {name: [r for r in results[name] if not r["errors"] and r["throughput"] > 0] for name in STACKS}
    base = statistics.median(r["throughput"] for r in clean["off"]) if clean["off"] else float("nan")
    for name in STACKS:
        rs = clean[name]  # medians over the rounds without a failed request; markdown names the others
        median = statistics.median(r["throughput"] for r in rs) if rs else float("nan")
        out[name] = {
            "rounds": results[name],
            "failed_rounds": len(results[name]) - len(rs),
            "throughput": median,
            "x_off": median / base,
            "p50_ms": statistics.median(r["p50_ms"] for r in rs) if rs else float("nan"),
            "p99_ms": statistics.median(r["p99_ms"] for r in rs) if rs else float("nan"),
            "share": statistics.median(r["share"] for r in rs) if rs else float("nan"),
        }
    return out


def markdown(result: dict) -> str:
    """The table: throughput, its ratio to tracing off, latency and the share traced, per stack."""
    lines = [
        f"Tracing's cost through the gateway: {result['concurrency']} callers of one-text OpenAI requests, "
        f"{result['rounds']} interleaved rounds of {result['duration_s']:g} s per stack (medians).",
        "",
        "| tracing | requests/s | x off | p50 ms | p99 ms | share traced |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {"off": "off", "adaptive": "follows load (default)", "all": "every request"}
    failed = []
    for name in STACKS:
        r = result[name]
        if r["failed_rounds"]:
            errors = sum(round_["errors"] for round_ in r["rounds"])
            died = next((round_["triton_exit"] for round_ in r["rounds"] if round_["triton_exit"] is not None), None)
            cause = (
                ""
                if died is None
                else (
                    f"; tritonserver exited with status {died}, its known crash with every request traced: "
                    "docs/troubleshooting.md"
                )
            )
            failed.append(
                f"{names[name]}: {r['failed_rounds']} of {len(r['rounds'])} rounds had failed requests "
                f"({errors} in all{cause}) and are left out of its medians"
            )
        if r["failed_rounds"] == len(r["rounds"]):
            lines.append(f"| {names[name]} | every round failed | - | - | - | - |")
            continue
        share = "0" if name == "off" else f"{r['share']:.3g}"
        lines.append(
            f"| {names[name]} | {r['throughput']:.1f} | {r['x_off']:.3f} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {share} |"
        )
    if failed:
        lines += ["", "; ".join(failed) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure and print; write ``tracing.md`` and ``tracing.json`` into ``--out`` if given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, help="text file, one text per line (default: STS-B)")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="callers (default %(default)s: the knee on 2 cores)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per round")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each round's")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        texts = load_corpus(args.corpus)
    except CorpusError as exc:
        sys.exit(str(exc))
    result = measure(texts, args.concurrency, args.rounds, args.duration, args.warmup)
    table = markdown(result)
    print("\n" + table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tracing.md").write_text(table)
        (args.out / "tracing.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
