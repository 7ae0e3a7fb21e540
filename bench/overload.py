"""Overload benchmark: the figures of docs/overload.md side by side, from one run (``make bench-overload``).

    python -m bench.overload [--levels 1,2,4,8,16,32,48,64] [--loop-s 15] [--burst-s 20]

Against the embedded server on a copy of the model repository (response cache off; every text is new anyway):

1. perf_analyzer (Triton's own client, ``../shared/tools/perf-analyzer``), closed loop over gRPC, one new STS-B
   sentence per request, at each concurrency of ``--levels``: with the shipped settings, and with the request
   parameter ``latency_budget_ms`` 0 (bulk: past the door, through the bulk lane, which lets up to 128 texts in
   at once and refuses none below ``BULK_QUEUE``). perf_analyzer stops at the first error, so a level that
   completes had no refusal. The knee is the highest level whose p99 stays within the SLA with refusals off;
   capacity is the best throughput at or below it.
2. Closed loops that retry at once (no backoff) at 64 and 256 concurrent gRPC clients: successes/s against the
   best successes/s of the sweep, accepted p99.
3. Open-loop Poisson arrivals at 1.5x and 3x capacity: successes/s against capacity, accepted p99 after the
   first second, requests left without an answer.
4. Zero refusals right after an idle spell: the knee's concurrency again after 5 s of silence.
5. Parts 2 and 3 again against a second server with one encoder knob changed (``--compare KNOB=VALUE``, default
   ``MAX_IN_FLIGHT=0``, no door; ``--no-compare`` skips it), so that what a mechanism carries shows side by side.
   ``--alternate ROUNDS`` runs only the no-backoff loops (wrk's Poisson bursts too, given ``--capacity``), against
   both servers in turn, ROUNDS times, and prints the medians: the steadier comparison on a machine whose speed
   drifts.

Parts 2 and 3 run twice each: from wrk (C, HTTP; ``bench/wrk_embed.lua``) and from Python asyncio gRPC clients.

Runs on the same cores as the server, so the clients' own CPU counts against it (a shared 2-core machine here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.loops import LoopResult, beside_bulk_loops, no_backoff_loop
from bench.perf_analyzer import perf_analyzer_level
from bench.perf_data import perf_analyzer_data, unique_texts
from bench.serving import ROOT, SLA_MS, served

WRK_SCRIPT = ROOT / "bench" / "wrk_embed.lua"


def write_wrk_texts(path: Path, texts: list[str]) -> Path:
    """Write ``texts`` one per line, JSON-escaped without quotes, as ``bench/wrk_embed.lua`` reads them."""
    path.write_text("".join(json.dumps(t)[1:-1] + "\n" for t in texts))
    return path


@dataclass(frozen=True)
class BurstResult:
    """Open-loop Poisson arrivals: offered and served rates, refusals, accepted p99 after the first second."""

    rate: float
    sent: int
    ok_per_s: float
    refused: int
    unanswered: int
    p99_after_1s_ms: float
    late: int = 0  # sends that found no free connection and went out more than 5 ms after their arrival time


def run_wrk(http_url: str, texts_file: Path, connections: int, duration_s: int, script_args: list[float]) -> dict:
    """Run wrk (2 threads) with ``bench/wrk_embed.lua`` against the embed model; return its WRK_RESULT fields.

    Raises RuntimeError when wrk fails or prints no result.
    """
    command = [
        "wrk",
        "-t2",
        f"-c{connections}",
        f"-d{duration_s}s",
        "--timeout",
        "30s",
        "-s",
        str(WRK_SCRIPT),
        f"http://{http_url}/v2/models/embed/infer",
        "--",
        str(texts_file),
        *map(str, script_args),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=duration_s + 60, check=False)  # noqa: S603
    line = next((x for x in run.stdout.splitlines() if x.startswith("WRK_RESULT ")), None)
    if run.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit code {run.returncode}): {(run.stdout + run.stderr)[-500:]}")
    return json.loads(line.removeprefix("WRK_RESULT "))


def wrk_loop(
    http_url: str,
    texts_file: Path,
    connections: int,
    seconds: float,
    warmup_s: float = 2.0,
    *,
    budget_off: bool = False,
) -> LoopResult:
    """``connections`` HTTP clients in wrk (C) that send again the moment an answer or a refusal comes back.

    Counts the answers received from ``warmup_s`` to ``warmup_s + seconds`` after wrk starts; the accepted latency
    is send to answer, ms. ``budget_off`` sends ``latency_budget_ms`` 0 (never refused).
    """
    script_args = [warmup_s, warmup_s + seconds, 0, 0, *([0] if budget_off else [])]
    r = run_wrk(http_url, texts_file, connections, int(warmup_s + seconds) + 2, script_args)
    window = r["window_s"]
    other = r["other"] + r["socket_errors"]
    return LoopResult(connections, r["ok"] / window, r["refused"] / window, other, r["p50_ms"], r["p99_ms"])


def wrk_poisson(http_url: str, texts_file: Path, rate: float, seconds: float, connections: int = 1024) -> BurstResult:
    """Open-loop Poisson arrivals of ``rate`` per second for ``seconds`` from wrk (C), over HTTP; every answer counts.

    Waits up to 12 s after the last send for the answers; what has none by then is unanswered.
    """
    r = run_wrk(http_url, texts_file, connections, int(seconds) + 12, [1.0, seconds, rate / 2, seconds])
    return BurstResult(
        rate=rate,
        sent=r["sent"],
        ok_per_s=r["ok"] / seconds,
        refused=r["refused"],
        unanswered=r["sent"] - r["answered"] + r["other"],
        p99_after_1s_ms=r["p99_ms"],
        late=r["late"],
    )


async def poisson_burst(url: str, texts: list[str], rate: float, seconds: float, seed: int = 0) -> BurstResult:
    """Send requests at Poisson arrivals of ``rate`` per second for ``seconds``; wait for every answer (30 s max)."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    rng = random.Random(seed)  # noqa: S311 - arrival times, not secrets
    outcomes: list[tuple[float, str, float]] = []  # (sent s after start, outcome, ms)

    async def one(n: int, sent_s: float) -> None:
        tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[texts[n % len(texts)].encode()]], dtype=np.object_))
        t0 = time.perf_counter()
        try:
            await client.infer("embed", [tensor], client_timeout=30)
            outcome = "ok"
        except Exception as exc:  # noqa: BLE001 - counted
            status = str(getattr(exc, "status", lambda: "")())
            outcome = "refused" if "UNAVAILABLE" in status else f"error {status} {str(exc)[:100]}"
        outcomes.append((sent_s, outcome, (time.perf_counter() - t0) * 1000))

    start = time.perf_counter()
    tasks, at, n = [], 0.0, 0
    while at < seconds:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(n, at)))
        n += 1
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    await client.close()
    ok_after = [ms for sent, outcome, ms in outcomes if outcome == "ok" and sent >= 1.0]
    return BurstResult(
        rate=rate,
        sent=n,
        ok_per_s=sum(outcome == "ok" for _, outcome, _ in outcomes) / seconds,
        refused=sum(outcome == "refused" for _, outcome, _ in outcomes),
        unanswered=sum(outcome not in ("ok", "refused") for _, outcome, _ in outcomes),
        p99_after_1s_ms=float(np.percentile(ok_after, 99)) if ok_after else float("nan"),
    )


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``, from /proc."""
    from triton_embed_server.supervisor import group_members, proc_state

    return sum(stat.cpu_s for stat in map(proc_state, group_members(pgid)) if stat is not None)  # None: exited


def with_cores(run, server_pid: int, *, child_client: bool):
    """``run()``'s result, with the cores (CPU s per wall s) the server and the client used meanwhile.

    The server is its process group (tritonserver and its stubs); the client a child process (wrk) or this process
    (the asyncio clients).
    """
    who = resource.RUSAGE_CHILDREN if child_client else resource.RUSAGE_SELF

    def client_s() -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    server0, client0, t0 = group_cpu_s(server_pid), client_s(), time.perf_counter()
    result = run()
    wall = time.perf_counter() - t0
    return result, (group_cpu_s(server_pid) - server0) / wall, (client_s() - client0) / wall


@dataclass(frozen=True)
class Base:
    """What a protocol's floods are measured against, req/s: its sweep's best successes/s and its capacity.

    The capacity is the sweep's best throughput with p99 within the SLA.
    """

    best: float
    capacity: float


def floods(
    server, texts: list[str], wrk_texts: Path, args: argparse.Namespace, *, http: Base, grpc: Base, label: str
) -> None:
    """Print the no-backoff loops and the Poisson bursts against ``server``, each table labelled with ``label``.

    Each load runs twice: from wrk (C, HTTP) against ``http``'s figures and from Python asyncio gRPC clients against
    ``grpc``'s, both on the server's cores.
    """
    print(f"\nno-backoff closed loops (retry at once), {label}:")
    print(
        "| clients | client | successes/s | x best sweep | refusals/s | accepted p50 | p99 ms | other errors "
        "| server cores | client cores |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for clients in (int(x) for x in args.loops.split(",")):
        for name, base, loop in (
            ("wrk, HTTP", http, lambda c=clients: wrk_loop(server.http_url, wrk_texts, c, args.loop_s)),
            (
                "asyncio, gRPC",
                grpc,
                lambda c=clients: asyncio.run(no_backoff_loop(server.grpc_url, texts, c, args.loop_s)),
            ),
        ):
            time.sleep(2)
            r, server_cores, client_cores = with_cores(loop, server.pid, child_client=name.startswith("wrk"))
            print(
                f"| {r.clients} | {name} | {r.ok_per_s:.0f} | {r.ok_per_s / base.best:.2f} | {r.refused_per_s:.0f} | "
                f"{r.p50_ms:.0f} | {r.p99_ms:.0f} | {r.other_errors} | {server_cores:.2f} | {client_cores:.2f} |",
                flush=True,
            )
    if args.bulk:
        loops, size = args.bulk
        print(f"\none-text loops beside {loops} loops of {size}-text requests, both retrying at once, gRPC, {label}:")
        print(
            "| one-text clients | successes/s | refusals/s | accepted p50 ms | p99 ms | bulk texts/s "
            "| bulk refusals/s | bulk accepted p99 ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for clients in (8, 32):
            time.sleep(2)
            one, big = asyncio.run(beside_bulk_loops(server.grpc_url, texts, clients, args.loop_s, bulk=args.bulk))
            print(
                f"| {clients} | {one.ok_per_s:.0f} | {one.refused_per_s:.0f} | {one.p50_ms:.0f} | {one.p99_ms:.0f} | "
                f"{big.ok_per_s * size:.0f} | {big.refused_per_s:.0f} | {big.p99_ms:.0f} |",
                flush=True,
            )
    print(
        f"\nopen-loop Poisson bursts, {args.burst_s:g} s each (capacity: HTTP {http.capacity:.0f}, gRPC "
        f"{grpc.capacity:.0f} req/s), {label}:"
    )
    print(
        "| offered | client | sent | successes/s | x capacity | refused | unanswered | accepted p99 after 1 s "
        "| late sends | server cores | client cores |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for factor in (float(x) for x in args.rates.split(",")):
        for name, base, burst in (
            ("wrk, HTTP", http, lambda rate: wrk_poisson(server.http_url, wrk_texts, rate, args.burst_s)),
            (
                "asyncio, gRPC",
                grpc,
                lambda rate: asyncio.run(poisson_burst(server.grpc_url, texts[::-1], rate, args.burst_s)),
            ),
        ):
            time.sleep(3)
            rate = factor * base.capacity
            r, server_cores, client_cores = with_cores(
                lambda rate=rate, burst=burst: burst(rate), server.pid, child_client=name.startswith("wrk")
            )
            print(
                f"| {factor:g}x = {rate:.0f}/s | {name} | {r.sent} | {r.ok_per_s:.0f} | "
                f"{r.ok_per_s / base.capacity:.2f} | {r.refused} | {r.unanswered} | {r.p99_after_1s_ms:.0f} ms | "
                f"{r.late} | {server_cores:.2f} | {client_cores:.2f} |",
                flush=True,
            )


LOOP_TEXTS = 20_000
"""Texts one gRPC loop of :func:`alternating_floods` may send (a 15 s loop at ~500 answers/s takes ~8,000)."""


def alternating_floods(servers: dict[str, object], wrk_texts: Path, texts: list[str], args: argparse.Namespace) -> None:
    """Run the floods against each of ``servers`` in turn, ``args.alternate`` times; print each run and the medians.

    The floods: no-backoff loops of ``args.loops`` clients from wrk (HTTP) and from asyncio gRPC clients (one new
    text of ``texts`` each request), and with ``args.capacity`` wrk's Poisson bursts at ``args.rates`` times it.
    Alternating, rather than one server's floods after the other's, spreads a shared machine's drifts in speed over
    every server alike.

    Args:
        servers: ``{label: running EmbeddedServer}``.
        wrk_texts: ``write_wrk_texts``'s file.
        texts: the gRPC loops' texts, never sent before (each run takes the next ones).
        args: the command line.
    """
    unsent = iter(texts)

    def grpc_loop(srv, clients: int) -> LoopResult:
        batch = list(itertools.islice(unsent, LOOP_TEXTS))
        return asyncio.run(no_backoff_loop(srv.grpc_url, batch, clients, args.loop_s))

    loads = []
    for c in (int(x) for x in args.loops.split(",")):
        loads += [
            (f"{c} retrying at once, wrk HTTP", lambda srv, c=c: wrk_loop(srv.http_url, wrk_texts, c, args.loop_s)),
            (f"{c} retrying at once, asyncio gRPC", lambda srv, c=c: grpc_loop(srv, c)),
        ]
    if args.capacity:
        loads += [
            (
                f"Poisson {f:g}x = {f * args.capacity:.0f}/s",
                lambda srv, f=f: wrk_poisson(srv.http_url, wrk_texts, f * args.capacity, args.burst_s),
            )
            for f in (float(x) for x in args.rates.split(","))
        ]
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    print("| round | load | server | successes/s | accepted p99 ms |")
    print("|---|---|---|---|---|")
    for k, (load, run) in itertools.product(range(args.alternate), loads):
        for label, server in servers.items():
            time.sleep(3)
            r = run(server)
            p99 = r.p99_ms if isinstance(r, LoopResult) else r.p99_after_1s_ms
            runs.setdefault((load, label), []).append((r.ok_per_s, p99))
            print(f"| {k + 1} | {load} | {label} | {r.ok_per_s:.0f} | {p99:.0f} |", flush=True)
    print(f"\nmedians of {args.alternate} rounds:")
    print("| load | server | successes/s | accepted p99 ms | each round: successes/s, p99 ms |")
    print("|---|---|---|---|---|")
    for (load, label), rs in runs.items():
        each = "; ".join(f"{ok:.0f}, {p99:.0f}" for ok, p99 in rs)
        print(
            f"| {load} | {label} | {np.median([ok for ok, _ in rs]):.0f} | {np.median([p for _, p in rs]):.0f} | "
            f"{each} |"
        )


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915 - one run, printed in order
    """Run every part against one server; print the figures with their ratios to the best throughput and capacity."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,2,4,8,16,24,32,48,64")
    parser.add_argument("--http-levels", default="8,16,24,32", help="concurrency levels of the wrk (HTTP) sweep")
    parser.add_argument("--loops", default="64,256", help="no-backoff client counts")
    parser.add_argument("--loop-s", type=float, default=15.0)
    parser.add_argument("--rates", default="1.5,3", help="Poisson rates, multiples of capacity")
    parser.add_argument("--burst-s", type=float, default=20.0)
    parser.add_argument(
        "--bulk",
        type=lambda v: tuple(int(x) for x in v.split("x")),
        default=None,
        metavar="LOOPSxTEXTS",
        help="one-text loops beside LOOPS loops of TEXTS-text requests (8x64)",
    )
    parser.add_argument("--skip-sweep", action="store_true", help="no perf_analyzer; needs --capacity")
    parser.add_argument("--capacity", type=float, default=0.0, help="req/s, when the sweep is skipped")
    parser.add_argument(
        "--compare",
        default="MAX_IN_FLIGHT=0",
        metavar="KNOB=VALUE",
        help="the encoder knob KNOB=VALUE of a second server the floods run against",
    )
    parser.add_argument(
        "--no-compare",
        dest="compare",
        action="store_const",
        const="",
        help="run the floods against the shipped server only",
    )
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only wrk's floods (Poisson too with --capacity), against the shipped server and the "
        "--compare one in turn, ROUNDS times",
    )
    args = parser.parse_args(argv)
    knob, _, value = args.compare.partition("=")
    if args.compare and not (knob and value):
        parser.error(f"--compare takes KNOB=VALUE, an encoder config parameter, got {args.compare!r}")
    compared = {("encoder", knob): value}
    scratch = ROOT / ".build" if (ROOT / ".build").is_dir() else None

    if args.alternate:
        if not args.compare:
            parser.error("--alternate needs a --compare KNOB=VALUE")
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=scratch)))
            servers = {
                "shipped": stack.enter_context(served(tmp, "shipped")),
                f"{knob} {value}": stack.enter_context(served(tmp, "compared", compared)),
            }
            wrk_texts = write_wrk_texts(tmp / "wrk-texts.txt", unique_texts(20_000, "wrk"))
            loop_texts = unique_texts(LOOP_TEXTS * len(servers) * args.alternate * len(args.loops.split(",")), "loop")
            alternating_floods(servers, wrk_texts, loop_texts, args)
        return 0

    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        data = Path(tmp) / "texts.json"
        texts = unique_texts(60_000, "pa")
        data.write_text(json.dumps(perf_analyzer_data(texts)))
        with served(Path(tmp), "shipped") as server:
            port = int(server.grpc_url.rsplit(":", 1)[1])
            levels = [int(x) for x in args.levels.split(",")]
            on, off = [], []
            if not args.skip_sweep:
                print("perf_analyzer closed loop, gRPC, one new sentence per request:")
                print("| concurrency | budget off: infer/s | p99 ms | shipped: infer/s | p99 ms | refusals |")
                print("|---|---|---|---|---|---|")
                for c in levels:
                    off.append(perf_analyzer_level(port, data, c, budget_off=True))
                    on.append(perf_analyzer_level(port, data, c, budget_off=False))
                    a, b = off[-1], on[-1]
                    print(
                        f"| {c} | {a.throughput:.0f} | {a.p99_ms:.0f} | {b.throughput:.0f} | {b.p99_ms:.0f} | "
                        f"{b.outcome()} |",
                        flush=True,
                    )
            within = [a for a in off if a.p99_ms <= SLA_MS and not a.error]
            knee = max((a.concurrency for a in within), default=0)
            capacity = args.capacity or max((a.throughput for a in within), default=0.0)
            best_shipped = max((b.throughput for b in on if not b.error), default=capacity)
            refused_below_knee = [b.concurrency for b in on if b.concurrency <= knee and b.refused]
            print(
                f"\nknee (p99 <= {SLA_MS:g} ms, refusals off): concurrency {knee}; capacity {capacity:.0f} req/s; "
                f"levels up to the knee refused: {refused_below_knee or 'none'}"
            )

            if knee and not args.skip_sweep:
                time.sleep(5)  # an idle spell, then the knee again
                again = perf_analyzer_level(port, data, knee, budget_off=False)
                print(
                    f"after 5 s idle, concurrency {knee}: {again.throughput:.0f} infer/s, p99 {again.p99_ms:.0f} ms, "
                    f"refusals: {again.outcome()}"
                )

            wrk_texts = write_wrk_texts(Path(tmp) / "wrk-texts.txt", unique_texts(10_000, "wrk"))
            print("\nwrk closed loop, HTTP, one new sentence per request, latency_budget_ms 0 (never refused):")
            print("| concurrency | infer/s | p50 ms | p99 ms |")
            print("|---|---|---|---|")
            http_levels = []
            for c in (int(x) for x in args.http_levels.split(",")):
                time.sleep(2)
                http_levels.append(wrk_loop(server.http_url, wrk_texts, c, 10, budget_off=True))
                r = http_levels[-1]
                print(f"| {c} | {r.ok_per_s:.0f} | {r.p50_ms:.0f} | {r.p99_ms:.0f} |", flush=True)
            http_within = [r.ok_per_s for r in http_levels if r.p99_ms <= SLA_MS]
            http = Base(best=max(r.ok_per_s for r in http_levels), capacity=max(http_within, default=float("nan")))
            grpc = Base(best=best_shipped, capacity=capacity)
            http_knee = max((r.clients for r in http_levels if r.p99_ms <= SLA_MS), default=0)
            print(f"HTTP knee (p99 <= {SLA_MS:g} ms): concurrency {http_knee}; capacity {http.capacity:.0f} req/s")

            loop_texts = unique_texts(400_000, "loop")
            floods(server, loop_texts, wrk_texts, args, http=http, grpc=grpc, label="shipped settings")
        if args.compare:  # the same floods with one knob changed: what its mechanism carries
            with served(Path(tmp), "compared", compared) as server:
                floods(server, loop_texts[::-1], wrk_texts, args, http=http, grpc=grpc, label=f"encoder {knob} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
