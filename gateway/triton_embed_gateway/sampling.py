"""Trace sampling that follows load: every request when quiet, a floor at peak, raised when p95 crosses a threshold.

On when tracing is on and ``OTEL_TRACES_SAMPLER`` is unset (set, the SDK's fixed sampler and Triton's fixed rate
apply). Every ``TRITON_EMBED_TRACE_INTERVAL_S`` the controller reads the request rate (the gateway's API requests,
or Triton's ``embed`` requests from its statistics when more: direct callers count too) and the p95 of the gateway's
API requests over the interval, and picks the share of requests to trace:

- ``min(1, TRITON_EMBED_TRACE_BUDGET / rate)``, at least ``TRITON_EMBED_TRACE_FLOOR``: every request while the rate
  is within the budget of traces per second;
- at least ``TRITON_EMBED_TRACE_SLOW_RATIO`` once p95 is over ``TRITON_EMBED_TRACE_SLOW_MS``, until it is back under
  3/4 of it (hysteresis);
- a new share is applied when the slow state flips, when it reaches 1 or the floor, or when it is at least twice or
  at most half the current one, so that noise does not move it.

It sets the gateway's sampler (parent-based: a caller's sampled ``traceparent`` is always followed) and Triton's
``trace_rate`` (1 in round(1/share)) through Triton's trace settings API with the admin key
(``TRITON_EMBED_ADMIN_KEY``); without the key Triton keeps the rate it started with. Each change is logged and the
current share exported as ``triton_embed_gateway_trace_sampling_ratio``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the SDK is imported only when tracing is on (triton_embed_gateway.tracing)
    from triton_embed_gateway.ratio_sampler import AdaptiveRatio

log = logging.getLogger("triton_embed_gateway.sampling")
RECOVER = 0.75
"""p95 must fall under this share of ``TRITON_EMBED_TRACE_SLOW_MS`` to leave the slow state."""


class SamplingConfigError(ValueError):
    """A sampling variable out of range; the message names the variable, the range and the value."""


@dataclass(frozen=True)
class SamplingPolicy:
    """The controller's knobs, with their defaults.

    ``budget_per_s``: traces per second the steady state aims at (a rate up to it traces every request);
    ``floor``: the least share at peak, 0..1; ``slow_ms``: the p95 that raises the share, ms (the SLA);
    ``slow_ratio``: the share while p95 is over it; ``interval_s``: seconds between decisions.
    """

    budget_per_s: float = 20.0  # 11% of 165 requests/s costs nothing measurable: docs/benchmarks.md, tracing overhead
    floor: float = 0.01  # about 1 request in 100 still traced at any peak
    slow_ms: float = 200.0  # the SLA's p99
    slow_ratio: float = 0.5
    interval_s: float = 5.0  # the span exporters' own batch delay (OTEL_BSP_SCHEDULE_DELAY)

    _VARIABLES = (
        ("budget_per_s", "TRITON_EMBED_TRACE_BUDGET", 0.0, math.inf),
        ("floor", "TRITON_EMBED_TRACE_FLOOR", 0.0, 1.0),
        ("slow_ms", "TRITON_EMBED_TRACE_SLOW_MS", 0.0, math.inf),
        ("slow_ratio", "TRITON_EMBED_TRACE_SLOW_RATIO", 0.0, 1.0),
        ("interval_s", "TRITON_EMBED_TRACE_INTERVAL_S", 0.0, 3600.0),
    )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> SamplingPolicy:
        """The policy of the ``TRITON_EMBED_TRACE_*`` variables set in ``environ``; the defaults for the rest.

        Raises:
            SamplingConfigError: a value is not a number within its range (each > 0; the shares at most 1).
        """
        values: dict[str, float] = {}
        for field, name, low, high in cls._VARIABLES:
            given = environ.get(name, "").strip()
            if not given:
                continue
            try:
                value = float(given)
            except ValueError:
                value = math.nan
            if not low < value <= high:
                top = "1" if high == 1.0 else f"{high:g}"
                raise SamplingConfigError(f"{name} must be a number over 0 and at most {top}; got {given!r}")
            values[field] = value
        return cls(**values)

    def target(self, rate_per_s: float, p95_ms: float | None, slow: bool) -> tuple[float, bool]:
        """The share to trace, and whether latency is slow, given whether it was (``slow``).

        At ``rate_per_s`` requests/s and a p95 of ``p95_ms`` (None: no request, the slow state stays).
        """
        if p95_ms is not None:
            slow = p95_ms >= RECOVER * self.slow_ms if slow else p95_ms > self.slow_ms
        share = 1.0 if rate_per_s <= self.budget_per_s else max(self.floor, self.budget_per_s / rate_per_s)
        return (max(share, self.slow_ratio) if slow else share), slow

    def moves(self, current: float, target: float, flipped: bool) -> bool:
        """Whether ``target`` replaces ``current``: the slow state flipped, it reaches a bound, or it is 2x away."""
        if target == current:
            return False
        return flipped or target in (1.0, self.floor) or not current / 2 < target < current * 2


@dataclass
class Reading:
    """What one interval saw: requests/s and the p95 of the gateway's requests, ms (None: none)."""

    rate_per_s: float
    p95_ms: float | None


class SamplingController:
    """Sets the gateway's sampler and Triton's ``trace_rate`` from the load, every ``policy.interval_s``.

    Args:
        policy: the knobs.
        sampler: the gateway's root sampler.
        triton_requests: async, Triton's ``embed`` requests so far (success + failure), or None when it cannot say.
        set_triton_rate: async, set Triton's ``trace_rate`` to 1 in N; returns an error message, or None when done;
            None here: Triton's rate is left alone.
        on_change: called with the new share after each change (the metrics).
    """

    def __init__(
        self,
        policy: SamplingPolicy,
        sampler: AdaptiveRatio,
        triton_requests: Callable[[], Awaitable[int | None]],
        set_triton_rate: Callable[[int], Awaitable[str | None]] | None,
        on_change: Callable[[float, int | None], None] = lambda share, rate: None,
    ) -> None:
        self.policy, self.sampler = policy, sampler
        self._triton_requests, self._set_triton_rate, self._on_change = triton_requests, set_triton_rate, on_change
        self._latencies: list[float] = []
        self._in_flight = 0
        self._since = time.monotonic()
        self._triton_before: int | None = None
        self.slow = False
        self.triton_rate: int | None = None
        self._warned: str | None = None

    def begin(self) -> None:
        """One API request came in."""
        self._in_flight += 1

    def observe(self, seconds: float) -> None:
        """One API request (counted in by :meth:`begin`) answered in ``seconds``."""
        self._in_flight -= 1
        self._latencies.append(seconds)

    async def read(self) -> Reading | None:
        """The interval since the last reading: the rate (the larger of the gateway's and Triton's) and p95.

        None when no request was answered while some are in flight: requests slower than the interval say nothing of
        the rate yet.
        """
        if not self._latencies and self._in_flight > 0:
            return None
        now = time.monotonic()
        took, self._since = max(now - self._since, 1e-6), now
        latencies, self._latencies = self._latencies, []
        rate = len(latencies) / took
        triton = await self._triton_requests()
        if triton is not None and self._triton_before is not None:
            rate = max(rate, (triton - self._triton_before) / took)
        self._triton_before = triton
        p95 = float(np.percentile(latencies, 95)) * 1e3 if latencies else None
        return Reading(rate, p95)

    async def step(self) -> Reading | None:
        """Read the interval, apply the policy, log and report a change (none without a reading)."""
        reading = await self.read()
        if reading is None:
            return None
        was = self.slow
        share, self.slow = self.policy.target(reading.rate_per_s, reading.p95_ms, self.slow)
        current = self.sampler.ratio
        if self.policy.moves(current, share, self.slow != was):
            self.sampler.set(share)
            await self._triton(share)
            p95 = "no request" if reading.p95_ms is None else f"p95 {reading.p95_ms:.0f} ms"
            log.info(
                "trace sampling %.4g -> %.4g (%.1f requests/s, %s%s); Triton trace_rate %s",
                current,
                share,
                reading.rate_per_s,
                p95,
                ", slow" if self.slow else "",
                self.triton_rate if self.triton_rate is not None else "unchanged",
            )
            self._on_change(share, self.triton_rate)
        return reading

    async def _triton(self, share: float) -> None:
        if self._set_triton_rate is None:
            return
        rate = max(1, round(1 / share))
        error = await self._set_triton_rate(rate)
        if error is None:
            self.triton_rate, self._warned = rate, None
        elif error != self._warned:
            log.warning("Triton's trace_rate stays as it is: %s", error)
            self._warned = error

    async def run(self) -> None:
        """Decide every ``policy.interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                await self.step()
            except Exception:  # a bad interval must not end the controller
                log.exception("trace sampling: the controller's step failed")


def adaptive(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the sampling follows load: ``OTEL_TRACES_SAMPLER`` unset (or empty) in ``environ`` (``os.environ``)."""
    environ = os.environ if environ is None else environ
    return not environ.get("OTEL_TRACES_SAMPLER", "").strip()
