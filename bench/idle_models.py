"""What idle models cost the busy one: perf_analyzer on ``embed`` alone and beside two idle models, in one run.

    python -m bench.idle_models [--levels 8,16,24,32,48] [--rounds 2] [--sla-ms 200]

Three repositories over the checkout's served ``embed`` (``make model``; response cache off):

* ``alone``: ``embed`` only;
* ``idle beside``: ``embed``, the packaged all-MiniLM-L6-v2 again as ``second`` and the stand-in reranker of
  ``bench.rerank`` as ``rerank``, both fp32 and idle: what ``make model NAME=...`` gives a user;
* ``idle beside, spinning``: the same with ``OMP_WAIT_POLICY=ACTIVE``, OpenMP threads that spin between parallel
  regions with no end (as shipped, OpenMP's default: they spin briefly, then sleep), so the run shows what the wait
  policy of idle stubs does apart from everything else.

One server runs at a time; each round starts each in turn, so a machine that slows down during the run slows all.
Per server and level: perf_analyzer's closed loop over gRPC, one new STS-B text per request (never sent before),
count windows of 500 requests; a sweep stops at its first refused level or one past twice the SLA. Printed per
round: the best infer/s with p99 within the SLA, the door each encoder measured at start-up, the ratio to ``alone``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.perf_analyzer import PerfLevel, perf_analyzer_level, perf_analyzer_path
from bench.perf_data import perf_analyzer_data, unique_texts
from bench.serving import RERANK_WORK, door, stand_in, variant_repository

VARIANTS = ("alone", "idle beside", "idle beside, spinning")
TEXTS_PER_LEVEL = 20_000


def repositories(folder: Path) -> dict[str, Path]:
    """Each of :data:`VARIANTS` to its repository, a copy of the served ``embed``.

    Both "idle beside" variants share one copy, with two idle models exported into it.

    Raises:
        ValueError: the served repository lacks what ``bench.serving.variant_repository`` copies.
    """
    from triton_embed_server import export as exporter

    alone = variant_repository(folder / "alone", None)
    crowded = variant_repository(folder / "crowded", None)
    exporter.export(exporter.default_model_path(), crowded, name="second", precision="fp32")
    exporter.export(stand_in(RERANK_WORK), crowded, name="rerank", precision="fp32")
    return {"alone": alone, "idle beside": crowded, "idle beside, spinning": crowded}


def sweep(
    repo: Path, log: Path, levels: list[int], texts: list[str], *, tag: str, sla_ms: float, env: dict[str, str]
) -> dict[str, Any]:
    """perf_analyzer on ``embed`` of a server over ``repo`` level after level, until one is refused or past 2x the SLA.

    Args:
        repo: the model repository.
        log: tritonserver's log file; perf_analyzer's input files go beside it.
        levels: perf_analyzer concurrency levels.
        texts: ``TEXTS_PER_LEVEL`` new texts per level.
        tag: names the input files.
        sla_ms: the SLA, ms.
        env: environment variables set while the server runs (e.g. ``OMP_WAIT_POLICY``).

    Returns:
        ``{"door": MAX_IN_FLIGHT at start-up (texts), "levels": [PerfLevel as a dict]}``.
    """
    from triton_embed_server.embedded import EmbeddedServer

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=log) as srv:
            out: dict[str, Any] = {"door": door(srv.metrics_url), "levels": []}
            port = int(srv.grpc_url.rsplit(":", 1)[1])
            for concurrency in levels:
                data = log.parent / f"{tag}-{concurrency}.json"
                start = len(out["levels"]) * TEXTS_PER_LEVEL
                data.write_text(json.dumps(perf_analyzer_data(texts[start : start + TEXTS_PER_LEVEL])))
                level = perf_analyzer_level(port, data, concurrency, budget_off=False)
                out["levels"].append(asdict(level))
                print(
                    f"  {tag} {concurrency}: {level.throughput:.0f} infer/s, p99 {level.p99_ms:.0f} ms "
                    f"{level.error[:120]}",
                    flush=True,
                )
                if level.refused or level.p99_ms > 2 * sla_ms:  # one that did not settle (NaN) goes on
                    break
            return out
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def best(levels: list[dict[str, Any]], sla_ms: float) -> PerfLevel | None:
    """The level with the most infer/s whose p99 is within ``sla_ms`` and which completed."""
    ok = [PerfLevel(**lv) for lv in levels if not lv["error"] and lv["p99_ms"] <= sla_ms]
    return max(ok, key=lambda lv: lv.throughput) if ok else None


def table(rounds: list[dict[str, dict[str, Any]]], sla_ms: float) -> str:
    """Markdown: per round and variant, the best level within the SLA, the door at start-up and the ratio."""
    rows = [
        f"| round | repository | best infer/s at p99 <= {sla_ms:g} ms | at concurrency | p99 ms | door at "
        "start-up (texts) | x alone |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for n, result in enumerate(rounds, 1):
        base = best(result["alone"]["levels"], sla_ms)
        for name in VARIANTS:
            top = best(result[name]["levels"], sla_ms)
            ratio = f"{top.throughput / base.throughput:.2f}" if top and base else "-"
            cells = f"{top.throughput:.0f} | {top.concurrency} | {top.p99_ms:.0f}" if top else "none | - | -"
            rows.append(f"| {n} | {name} | {cells} | {result[name]['door']} | {ratio} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Build the repositories, sweep each server per round, print the table; 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="8,16,24,32,48", help="perf_analyzer concurrency levels")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the three servers")
    parser.add_argument("--sla-ms", type=float, default=200.0)
    parser.add_argument("--corpus", help="a text file, one text per line (default: STS-B train+dev)")
    parser.add_argument("--out", type=Path, help="folder for idle_models.json (default: none written)")
    args = parser.parse_args(argv)

    if perf_analyzer_path() is None:
        print("perf_analyzer not found: set PERF_ANALYZER or build ../shared/tools/perf-analyzer", file=sys.stderr)
        return 2
    levels = [int(c) for c in args.levels.split(",")]
    envs = {"alone": {}, "idle beside": {}, "idle beside, spinning": {"OMP_WAIT_POLICY": "ACTIVE"}}
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        repos = repositories(folder)
        for n in range(args.rounds):
            result = {}
            for name in VARIANTS:
                tag = f"r{n}-{name.replace(' ', '').replace(',', '-')}"
                texts = unique_texts(TEXTS_PER_LEVEL * len(levels), tag, args.corpus)
                print(f"round {n + 1}, {name} ...", flush=True)
                result[name] = sweep(
                    repos[name], folder / f"{tag}.log", levels, texts, tag=tag, sla_ms=args.sla_ms, env=envs[name]
                )
            rounds.append(result)
    print(table(rounds, args.sla_ms))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "idle_models.json").write_text(json.dumps({"sla_ms": args.sla_ms, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
