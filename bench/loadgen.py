"""Closed-loop load: N threads each send one request after another for a fixed time; latency and throughput.

The senders it drives (:func:`grpc_sender`, :func:`json_sender`) are here too (a library: it imports no scenario).
"""

from __future__ import annotations

import http.client
import itertools
import json
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


def post_json(conn: http.client.HTTPConnection, path: str, body: dict) -> bytes:
    """POST ``body`` as JSON to ``path``; the answer's bytes.

    Raises:
        RuntimeError: any status but 200, with the answer's first 200 bytes.
    """
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    if response.status != 200:
        raise RuntimeError(payload[:200])
    return payload


def json_sender(port: int, path: str, body_of: Callable[[str], dict]) -> Callable[[str], None]:
    """A ``bench.loadgen`` sender on its own keep-alive connection to 127.0.0.1:``port``.

    Each text goes as ``body_of(text)``, POSTed as JSON to ``path`` (:func:`post_json`).
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def send(text: str) -> None:
        post_json(conn, path, body_of(text))

    return send


def grpc_sender(url: str) -> Callable[[str], None]:
    """A new raw tritonclient gRPC connection to ``url`` and a call that embeds one text over it (no retries).

    Raises (from the call): InferenceServerException, the server's error.
    """
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)

    def send(text: str) -> None:
        tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
        client.infer("embed", [tensor])

    return send
