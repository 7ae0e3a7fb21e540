"""Closed loops of gRPC clients that send again the moment an answer or a refusal comes (no backoff).

As the overload benchmarks and tests run them (a library: it imports no scenario).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoopResult:
    """A no-backoff closed loop: successes/s, refusals/s, other errors, accepted p50/p99 (ms)."""

    clients: int
    ok_per_s: float
    refused_per_s: float
    other_errors: int
    p50_ms: float
    p99_ms: float


@dataclass
class _Tally:
    """What one group of no-backoff loops saw in the measured window: accepted latencies (ms), refusals, errors."""

    ok_ms: list[float]
    refused: int = 0
    other: int = 0

    def result(self, clients: int, seconds: float) -> LoopResult:
        lat = np.array(self.ok_ms or [np.nan])
        return LoopResult(
            clients, len(self.ok_ms) / seconds, self.refused / seconds, self.other, *np.percentile(lat, [50, 99])
        )


async def _loops(
    client,
    texts: list[str],
    counter,
    *,
    clients: int,
    size: int,
    window: tuple[float, float],
    parameters: dict | None = None,
    model: str = "embed",
) -> _Tally:
    """``clients`` loops sending ``size`` new texts per request to ``model`` until ``window`` ends.

    With request ``parameters``; tallies the sends inside the window.
    """
    import tritonclient.grpc.aio as grpcclient

    begin, end = window
    tally = _Tally([])

    async def one() -> None:
        while (t0 := time.perf_counter()) < end:
            batch = [[texts[next(counter) % len(texts)].encode()] for _ in range(size)]
            tensor = grpcclient.InferInput("TEXT", [size, 1], "BYTES")
            tensor.set_data_from_numpy(np.array(batch, dtype=np.object_))
            try:
                await client.infer(model, [tensor], client_timeout=60, parameters=parameters)
                if t0 >= begin:
                    tally.ok_ms.append((time.perf_counter() - t0) * 1000)
            except Exception as exc:  # noqa: BLE001 - counted
                if t0 >= begin:
                    if "UNAVAILABLE" in str(getattr(exc, "status", lambda: "")()):
                        tally.refused += 1
                    else:
                        tally.other += 1

    await asyncio.gather(*(one() for _ in range(clients)))
    return tally


async def loop_groups(
    url: str, texts: list[str], groups: list[tuple], seconds: float, warmup_s: float
) -> list[LoopResult]:
    """Run each group of (loops, texts per request, request parameters[, model]) at once on one gRPC client.

    The model defaults to ``embed``; one :class:`LoopResult` per group.
    """
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    counter = itertools.count()
    start = time.perf_counter()
    window = (start + warmup_s, start + warmup_s + seconds)
    tallies = await asyncio.gather(
        *(
            _loops(
                client,
                texts,
                counter,
                clients=group[0],
                size=group[1],
                window=window,
                parameters=group[2],
                model=group[3] if len(group) > 3 else "embed",
            )
            for group in groups
        )
    )
    await client.close()
    return [tally.result(group[0], seconds) for tally, group in zip(tallies, groups, strict=True)]


async def no_backoff_loop(url: str, texts: list[str], clients: int, seconds: float, warmup_s: float = 2.0):
    """``clients`` gRPC loops of one text per request that send again the moment an answer (or a refusal) comes back."""
    (result,) = await loop_groups(url, texts, [(clients, 1, None)], seconds, warmup_s)
    return result


async def beside_bulk_loops(
    url: str, texts: list[str], clients: int, seconds: float, *, bulk: tuple[int, int], warmup_s: float = 2.0
) -> tuple[LoopResult, LoopResult]:
    """:func:`no_backoff_loop` beside ``bulk`` = (loops, texts per request) loops of large requests.

    Returns the one-text loops' result and the bulk loops' (their successes/s count requests, not texts).
    """
    one, big = await loop_groups(url, texts, [(clients, 1, None), (*bulk, None)], seconds, warmup_s)
    return one, big


async def model_loops(
    url: str, texts: list[str], groups: list[tuple[str, int, int]], seconds: float, warmup_s: float = 2.0
) -> list[LoopResult]:
    """No-backoff loops at several models at once: per group (model, loops, texts per request), one result each."""
    return await loop_groups(url, texts, [(n, size, None, model) for model, n, size in groups], seconds, warmup_s)
