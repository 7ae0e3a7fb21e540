"""KServe v2 JSON over ``http.client`` and a closed-loop concurrency sweep, with the standard library alone.

The GPU machine has no tritonclient and nothing can be installed there, so ``bench/gpu_check.py`` talks to the
served ``embed`` ensemble through this module: one text per request, ``EMBEDDING`` asked for as binary data
(``binary_data: true``), so that neither side spends its time on 384 floats in JSON.

Run as a program it sweeps one server and prints the result as JSON on stdout (progress on stderr)::

    python -m bench.gpu_load --url 127.0.0.1:8000 --texts texts.json --levels 1,2,4,8 --duration 4

Each level runs ``concurrency`` client threads spread over up to ``--processes`` forked processes (one Python
process tops out at a few thousand requests per second, below what a GPU server answers), each thread with one
keep-alive connection and one request in flight.
"""

from __future__ import annotations

import argparse
import array
import http.client
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict

from bench.level import Level

MODEL = "embed"


class InferError(RuntimeError):
    """The server answered an inference request with an error; the message has its status and reason."""


class EmbedClient:
    """One keep-alive HTTP connection to Triton's ``embed`` ensemble.

    Args:
        url: ``host:port`` of Triton's HTTP endpoint.
        timeout_s: socket timeout per request, seconds.
    """

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        host, port = url.rsplit(":", 1)
        self._host, self._port, self._timeout_s = host, int(port), timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def embed(self, texts: list[str]) -> list[array.array]:
        """Embed ``texts`` in one request.

        Returns:
            One ``array('f')`` per text (the embedding, float32, ``dim`` values), in order.

        Raises:
            InferError: a non-200 answer (Triton's error text in the message), or an answer of the wrong size.
            OSError: the connection failed (it is reopened on the next call).
        """
        body = json.dumps(
            {
                "inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}],
                "outputs": [{"name": "EMBEDDING", "parameters": {"binary_data": True}}],
            }
        ).encode()
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            self._conn.request("POST", f"/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"})
            response = self._conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if response.status != 200:
            raise InferError(f"HTTP {response.status}: {payload[:300].decode(errors='replace')}")
        header_len = int(response.getheader("Inference-Header-Content-Length") or len(payload))
        values = array.array("f")
        values.frombytes(payload[header_len:])
        if not texts or len(values) % len(texts):
            raise InferError(f"{len(values)} float32 values for {len(texts)} texts")
        dim = len(values) // len(texts)
        return [values[i * dim : (i + 1) * dim] for i in range(len(texts))]

    def close(self) -> None:
        """Close the connection (the next :meth:`embed` opens a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def get_json(url: str, path: str, timeout_s: float = 10.0) -> dict:
    """``GET http://{url}{path}`` and parse the JSON answer (e.g. ``/v2/models/encoder/stats``).

    Raises:
        InferError: a non-200 answer.
    """
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise InferError(f"GET {path}: HTTP {response.status}: {payload[:300].decode(errors='replace')}")
    return json.loads(payload)


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0..100) of ascending ``sorted_values``; NaN when empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def _client_process(job: tuple) -> tuple[list[float], int, str]:
    """``threads`` closed-loop clients until ``stop_at``: latencies (ms) after ``measure_from``, errors, first error.

    ``job`` is ``(url, texts, threads, offset, measure_from, stop_at)``, times in ``time.time()`` seconds, so that
    every process measures the same window.
    """
    import threading

    url, texts, threads, offset, measure_from, stop_at = job
    latencies: list[float] = []
    errors = [0]
    first_error: list[str] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        client, mine, failed = EmbedClient(url), [], 0
        position = (offset + index) * 997
        while True:
            text = texts[position % len(texts)]
            position += 1
            t0 = time.time()
            if t0 >= stop_at:
                break
            try:
                client.embed([text])
            except (InferError, OSError, http.client.HTTPException) as exc:
                with lock:
                    if t0 >= measure_from:
                        errors[0] += 1
                    if not first_error:
                        first_error.append(str(exc))
                time.sleep(min(2.0, 0.1 * 2**failed))  # as the project's clients back off after a refusal
                failed += 1
                continue
            failed = 0
            if t0 >= measure_from:
                mine.append((time.time() - t0) * 1000)
        client.close()
        with lock:
            latencies.extend(mine)

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return latencies, errors[0], first_error[0] if first_error else ""


def closed_loop(
    url: str, texts: list[str], concurrency: int, *, duration_s: float, warmup_s: float = 1.0, processes: int = 1
) -> Level:
    """``concurrency`` clients for ``warmup_s + duration_s`` seconds; only the last ``duration_s`` is measured.

    The clients are spread over ``min(processes, concurrency)`` processes forked from this one (this module imports
    nothing heavy, so forking is cheap and safe here; do not call it from a process that holds a CUDA context).
    """
    procs = max(1, min(processes, concurrency))
    counts = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    start = time.time() + 0.2 * procs  # lets every process start before the window opens
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    offsets = [sum(counts[:i]) for i in range(procs)]
    jobs = [(url, texts, n, off, measure_from, stop_at) for n, off in zip(counts, offsets, strict=True)]
    if procs == 1:
        results = [_client_process(jobs[0])]
    else:
        with multiprocessing.get_context("fork").Pool(procs) as pool:
            results = pool.map(_client_process, jobs)
    latencies = sorted(x for lat, _, _ in results for x in lat)
    return Level(
        concurrency=concurrency,
        requests=len(latencies),
        errors=sum(e for _, e, _ in results),
        throughput=len(latencies) / duration_s,
        p50_ms=_percentile(latencies, 50),
        p99_ms=_percentile(latencies, 99),
        first_error=next((msg for _, _, msg in results if msg), ""),
    )


def sweep(
    url: str,
    texts: list[str],
    levels: list[int],
    *,
    duration_s: float,
    warmup_s: float = 1.0,
    processes: int = 1,
    stop_p99_ms: float = math.inf,
) -> list[Level]:
    """:func:`closed_loop` at each concurrency in ``levels``, stopping after the first whose p99 passes ``stop_p99_ms``.

    Progress goes to stderr, one line per level.
    """
    out = []
    for concurrency in levels:
        level = closed_loop(url, texts, concurrency, duration_s=duration_s, warmup_s=warmup_s, processes=processes)
        print(
            f"  concurrency {concurrency:4d}: {level.throughput:8.1f} req/s  p50 {level.p50_ms:7.2f} ms  "
            f"p99 {level.p99_ms:7.2f} ms  errors {level.errors}" + (f" ({level.first_error})" if level.errors else ""),
            file=sys.stderr,
            flush=True,
        )
        out.append(level)
        if not level.p99_ms <= stop_p99_ms:  # NaN (no answers) stops too
            break
    return out


def best_under(levels: list[Level], p99_ms: float) -> Level | None:
    """The level with the highest throughput whose p99 is at most ``p99_ms`` and that had no errors; None if none."""
    ok = [lv for lv in levels if lv.p99_ms <= p99_ms and lv.errors == 0 and lv.requests]
    return max(ok, key=lambda lv: lv.throughput) if ok else None


def main(argv: list[str] | None = None) -> int:
    """Sweep the server at ``--url`` and print ``{"levels": [...]}`` as JSON on stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="host:port of Triton's HTTP endpoint")
    parser.add_argument("--texts", required=True, help="JSON file holding a list of texts")
    parser.add_argument("--levels", default="1,2,4,8", help="comma-separated concurrencies")
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each level")
    parser.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 2) // 3))
    parser.add_argument("--stop-p99-ms", type=float, default=400.0, help="stop after a level whose p99 is above")
    args = parser.parse_args(argv)
    with open(args.texts, encoding="utf-8") as handle:
        texts = json.load(handle)
    levels = sweep(
        args.url,
        texts,
        [int(x) for x in args.levels.split(",")],
        duration_s=args.duration,
        warmup_s=args.warmup,
        processes=args.processes,
        stop_p99_ms=args.stop_p99_ms,
    )
    json.dump({"levels": [asdict(lv) for lv in levels]}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
