"""Bulk work beside interactive requests, side by side in one run (``make bench-bulk``; docs/overload.md).

    python -m bench.bulk [--bulk 32x64] [--interactive 4] [--seconds 20] [--precision auto] [--compare KNOB=VALUE]

Against the embedded server on a copy of the model repository with the packaged model exported at ``--precision``
(``make model``'s default: auto; response cache off, every text new), from Python asyncio gRPC clients that send
again the moment an answer or a refusal comes back (raw tritonclient, no backoff):

1. ``--interactive`` loops of one-text requests (no parameters) alone;
2. the bulk loops alone: ``--bulk`` LOOPSxTEXTS, each request with ``latency_budget_ms`` 0;
3. both at once.

The goals: the one-text loops' p99 within 200 ms and at most 1% of their attempts refused beside the bulk loops,
which keep at least half their texts/s alone. ``--compare KNOB=VALUE`` runs 1-3 again against a second server with
one encoder knob changed (``BULK_IN_FLIGHT=128``: a larger bulk share).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.loops import LoopResult, loop_groups
from bench.perf_data import unique_texts
from bench.serving import SLA_MS, served, variant_repository

ROOT = Path(__file__).resolve().parents[1]
BULK = {"latency_budget_ms": 0}


def refused_share(r: LoopResult) -> float:
    """The refused share of a loop group's attempts in the window (successes + refusals)."""
    attempts = r.ok_per_s + r.refused_per_s
    return r.refused_per_s / attempts if attempts else 0.0


def three_runs(
    url: str, texts: list[str], args: argparse.Namespace
) -> list[tuple[str, LoopResult | None, LoopResult | None]]:
    """The interactive loops alone, the bulk loops alone, both at once: (label, interactive, bulk) per run."""
    loops, size = args.bulk
    one = (args.interactive, 1, None)
    big = (loops, size, BULK)
    rows = []
    for label, groups in (("one-text alone", [one]), ("bulk alone", [big]), ("both", [one, big])):
        time.sleep(2)
        results = asyncio.run(loop_groups(url, texts[len(rows) :: 3], groups, args.seconds, 3.0))
        interactive = results[0] if groups[0] is one else None
        bulk = results[-1] if groups[-1] is big else None
        rows.append((label, interactive, bulk))
    return rows


def print_rows(rows: list[tuple[str, LoopResult | None, LoopResult | None]], size: int, label: str) -> dict:
    """Print the table of :func:`three_runs`; return the goal figures."""
    print(f"\n{label}:")
    print(
        "| run | one-text successes/s | refused share | accepted p50 ms | p99 ms | bulk texts/s | bulk refused "
        "share | bulk accepted p50 ms | p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, one, big in rows:
        a = (
            f"{one.ok_per_s:.0f} | {refused_share(one):.1%} | {one.p50_ms:.0f} | {one.p99_ms:.0f}"
            if one
            else "- | - | - | -"
        )
        b = (
            f"{big.ok_per_s * size:.0f} | {refused_share(big):.1%} | {big.p50_ms:.0f} | {big.p99_ms:.0f}"
            if big
            else "- | - | - | -"
        )
        print(f"| {name} | {a} | {b} |", flush=True)
    _, _, alone = rows[1]
    _, one, both = rows[2]
    kept = both.ok_per_s / alone.ok_per_s if alone and alone.ok_per_s else 0.0
    goals = {"one_text_p99_ms": one.p99_ms, "one_text_refused": refused_share(one), "bulk_kept": kept}
    met = one.p99_ms <= SLA_MS and refused_share(one) <= 0.01 and kept >= 0.5
    print(
        f"goals (one-text p99 <= {SLA_MS:g} ms, <= 1% refused, bulk >= 0.5x alone): p99 {one.p99_ms:.0f} ms, "
        f"{refused_share(one):.1%} refused, bulk {kept:.2f}x alone: {'met' if met else 'NOT met'}"
    )
    return goals


def main(argv: list[str] | None = None) -> int:
    """Run the three loads against the shipped server (and the ``--compare`` one); print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bulk",
        type=lambda v: tuple(int(x) for x in v.split("x")),
        default=(32, 64),
        metavar="LOOPSxTEXTS",
        help="bulk loops and texts per request (32x64)",
    )
    parser.add_argument("--interactive", type=int, default=4, help="one-text loops")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each run")
    parser.add_argument("--precision", default="auto", help="make model's PRECISION for the served export")
    parser.add_argument(
        "--compare",
        default="",
        metavar="KNOB=VALUE",
        help="an encoder knob of a second server the three runs repeat against",
    )
    args = parser.parse_args(argv)
    knob, _, value = args.compare.partition("=")
    if args.compare and not (knob and value):
        parser.error(f"--compare takes KNOB=VALUE, an encoder config parameter, got {args.compare!r}")
    texts = unique_texts(300_000, "bulk")
    scratch = ROOT / ".build" if (ROOT / ".build").is_dir() else None
    with tempfile.TemporaryDirectory(dir=scratch) as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        exported = variant_repository(folder / "export", precision=args.precision)
        manifest = json.loads((exported / "encoder" / "1" / "export.json").read_text())
        print(
            f"model: {manifest.get('model_type')} at {manifest.get('precision')} "
            f"({manifest.get('precision_reason', '')})"
        )
        servers = [("shipped settings", None)] + (
            [(f"encoder {knob} {value}", {("encoder", knob): value})] if args.compare else []
        )
        for label, knobs in servers:
            with served(folder, label.replace(" ", "-"), knobs, source=exported) as server:
                print_rows(three_runs(server.grpc_url, texts, args), args.bulk[1], label)
        stack.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
