"""``make bench-precision``: the served encoder at fp32 and at ``make model``'s default precision, side by side.

Both are the packaged all-MiniLM-L6-v2 on the embedded server over a copy of the model repository (response cache
off), one after the other in the same run, beside the in-process sentence-transformers ceiling (fp32, batch 32):

* ``fp32``: ``make model PRECISION=fp32``;
* ``auto``: ``make model`` as shipped (bf16 on a CPU with native bf16, fp32 elsewhere: the table says which).

Each is swept with perf_analyzer (Triton's own client, ``../shared/tools/perf-analyzer``), closed loop over gRPC,
one new STS-B sentence per request, request parameter ``latency_budget_ms`` 0, at each concurrency of ``--levels``.
Prints one markdown table: infer/s and p99 per level, and the best throughput at p99 <= 200 ms and <= 100 ms over the
ceiling for each precision.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.perf_analyzer import perf_analyzer_level
from bench.perf_data import perf_analyzer_data, unique_texts
from bench.serving import in_process, variant_repository
from loadtest.corpus import CorpusError, load_corpus

BOUNDS_MS = (200.0, 100.0)
"""The p99 bounds the best throughput is quoted at."""


def best(levels: list, bound_ms: float) -> float:
    """The highest infer/s among ``levels`` that completed with p99 at most ``bound_ms``; 0 if none did."""
    return max((lv.throughput for lv in levels if not lv.error and lv.p99_ms <= bound_ms), default=0.0)


def main(argv: list[str] | None = None) -> int:
    """Sweep both servers and print the table; returns the exit code."""
    from triton_embed_server.embedded import EmbeddedServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="4,8,16,24,32")
    parser.add_argument("--ceiling-s", type=float, default=8.0, help="seconds of the in-process ceiling")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    try:
        corpus = load_corpus()
    except CorpusError as exc:
        parser.error(str(exc))
    rng = np.random.default_rng(0)
    ceiling = in_process([corpus[i] for i in rng.permutation(len(corpus))], seconds=args.ceiling_s)["throughput"]
    print(f"in-process sentence-transformers fp32, batch 32: {ceiling:.0f} sentences/s", flush=True)
    results: dict[str, tuple[str, list]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "texts.json"
        data.write_text(json.dumps(perf_analyzer_data(unique_texts(40_000, "precision"))))
        for name in ("fp32", "auto"):
            repo = variant_repository(Path(tmp) / f"repo-{name}", precision=name)
            served = json.loads((repo / "encoder" / "1" / "export.json").read_text())
            log = Path(tmp) / f"tritonserver-{name}.log"
            server = EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=log)
            with contextlib.ExitStack() as stack:
                stack.enter_context(server)
                port = int(server.grpc_url.rsplit(":", 1)[1])
                swept = []
                for c in levels:
                    swept.append(perf_analyzer_level(port, data, c, budget_off=True))
                    lv = swept[-1]
                    print(
                        f"{name} ({served['precision']}) concurrency {c}: {lv.throughput:.0f} infer/s, "
                        f"p99 {lv.p99_ms:.0f} ms {lv.error}",
                        flush=True,
                    )
            results[name] = (f"{served['precision']}, min cosine {served['min_cosine']:.6f}", swept)

    print(
        "\n| concurrency | "
        + " | ".join(f"{n} ({label}): infer/s | p99 ms" for n, (label, _) in results.items())
        + " |"
    )
    print("| --- |" + " --- | --- |" * len(results))
    for i, c in enumerate(levels):
        cells = " | ".join(f"{swept[i].throughput:.0f} | {swept[i].p99_ms:.0f}" for _, swept in results.values())
        print(f"| {c} | {cells} |")
    print()
    for bound in BOUNDS_MS:
        parts = [
            f"{n} {best(swept, bound):.0f} infer/s = {best(swept, bound) / ceiling:.2f}x the ceiling"
            for n, (_, swept) in results.items()
        ]
        print(f"best at p99 <= {bound:g} ms: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
