"""Closed-loop load: N threads each send one request after another for a fixed time; latency and throughput."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import numpy as np
from triton_embed.transport import DEFAULT_BACKOFF_S, backoff

from bench.level import Level

Sender = Callable[[str], None]


def closed_loop(
    make_sender: Callable[[], Sender], texts: list[str], concurrency: int, duration_s: float, warmup_s: float = 1.0
) -> Level:
    """Run ``concurrency`` threads for ``warmup_s + duration_s`` seconds; measure only the last ``duration_s``.

    ``make_sender`` is called once per thread (one connection per thread). Texts are taken round-robin from
    ``texts`` with a per-thread offset, so threads send different sentences. A thread whose request raised waits as
    ``triton_embed``'s retries would (0.1 s doubling, capped at 2 s) before the next, so that the benchmark measures
    the project's client; clients that retry at once are measured by ``make bench-overload`` (docs/overload.md).
    """
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    senders = [make_sender() for _ in range(concurrency)]

    def worker(i: int) -> None:
        send, failed_in_a_row = senders[i], 0
        for text in itertools.islice(itertools.cycle(texts), i * 997 % len(texts), None):
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            try:
                send(text)
            except Exception:  # noqa: BLE001 - counted, the run goes on
                errors[i] += 1
                time.sleep(backoff(failed_in_a_row, DEFAULT_BACKOFF_S))
                failed_in_a_row += 1
                continue
            failed_in_a_row = 0
            t1 = time.perf_counter()
            if t0 >= measure_from:
                latencies[i].append((t1 - t0) * 1000)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = np.array([x for per in latencies for x in per]) if any(latencies) else np.array([np.nan])
    return Level(
        concurrency=concurrency,
        requests=int(np.isfinite(flat).sum()),
        errors=sum(errors),
        throughput=float(np.isfinite(flat).sum() / duration_s),
        p50_ms=float(np.percentile(flat, 50)),
        p99_ms=float(np.percentile(flat, 99)),
    )


def sweep(
    make_sender: Callable[[], Sender],
    texts: list[str],
    *,
    levels: list[int],
    duration_s: float,
    sla_ms: float,
    log: Callable[[str], None] = print,
) -> list[Level]:
    """Closed loop at each concurrency in ``levels``; stops after the first level whose p99 exceeds 2x the SLA."""
    results = []
    for concurrency in levels:
        level = closed_loop(make_sender, texts, concurrency, duration_s)
        log(
            f"  concurrency {concurrency:3d}: {level.throughput:7.1f} req/s  p50 {level.p50_ms:7.1f} ms  "
            f"p99 {level.p99_ms:7.1f} ms  errors {level.errors}"
        )
        results.append(level)
        if level.p99_ms > 2 * sla_ms:
            break
    return results


def best_under_sla(levels: list[Level], sla_ms: float) -> Level | None:
    """The level with the highest throughput whose p99 stays at or under ``sla_ms`` and had no errors."""
    ok = [lv for lv in levels if lv.p99_ms <= sla_ms and lv.errors == 0]
    return max(ok, key=lambda lv: lv.throughput) if ok else None
