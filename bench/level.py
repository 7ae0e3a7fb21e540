"""One concurrency level of a closed-loop load, as every load generator in bench/ reports it (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    """One concurrency level of a closed loop.

    Attributes:
        concurrency: clients, each with one request (one text) in flight.
        requests: answers received in the measured window.
        errors: requests that failed in the measured window (refusals under overload included).
        throughput: answers per second in the measured window (one text each, so also texts/s).
        p50_ms, p99_ms: latency percentiles of the answers, milliseconds (NaN without answers).
        first_error: the first error's message, empty when there was none or it was not kept.
    """

    concurrency: int
    requests: int
    errors: int
    throughput: float
    p50_ms: float
    p99_ms: float
    first_error: str = ""
