"""The SLA gate: latency percentiles and failure ratio over the measured window, PASS or FAIL.

Percentiles are exact (NumPy's linear interpolation over every successful request in the window), not Locust's
rounded histogram, over the requests that started in the measured window: ramp-up and warm-up are left out of the
latencies. Every failure a user saw counts, in the window or before it: a request refused during the warm-up is a
failure all the same.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Sample:
    """One request as Locust saw it.

    Attributes:
        start_s: wall-clock start, seconds since the epoch (``time.time()`` at the end minus the response time).
        response_ms: client-side latency, milliseconds.
        name: Locust's request name (``"embed x1"``); request_type: ``grpc`` or ``http``.
        failed: the call raised.
        error: the exception's class and message when it failed (first :data:`MAX_ERROR_CHARS` characters), else "".
    """

    start_s: float
    response_ms: float
    name: str
    request_type: str
    failed: bool
    error: str = ""


MAX_ERROR_CHARS = 1000
"""Longest error message kept per failed request, characters: the server's overload messages run to ~550 and end
with the knobs to turn."""


class Recorder:
    """Keeps every request Locust reports; register :meth:`on_request` on ``events.request``."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def on_request(self, request_type: str, name: str, response_time: float, exception=None, **_) -> None:
        """Locust ``request`` listener: ``response_time`` in ms; ``exception`` set when the request failed."""
        start_s = time.time() - response_time / 1000.0
        error = f"{type(exception).__name__}: {exception}"[:MAX_ERROR_CHARS] if exception is not None else ""
        self.samples.append(Sample(start_s, response_time, name, request_type, exception is not None, error))


@dataclass(frozen=True)
class SlaSpec:
    """The limits a run must meet.

    Attributes:
        p99_ms: the SLA: 99th percentile latency limit, milliseconds (product default 200).
        p95_ms: 95th percentile limit, milliseconds (defaults to the SLA too).
        max_fail_ratio: failed / all requests in the window (default 0.001 = 0.1%).
        min_requests: fewer successful requests than this in the window is a FAIL (a p99 of 10 samples proves
            nothing).
    """

    p99_ms: float = 200.0
    p95_ms: float = 200.0
    max_fail_ratio: float = 0.001
    min_requests: int = 100


@dataclass(frozen=True)
class GateResult:
    """The gate's verdict over one window.

    Attributes:
        passed: every limit of the :class:`SlaSpec` met.
        requests, failures: requests started before the window closed (warm-up included), and how many of them
            failed: the failure ratio counts every failure a user saw.
        window_s: length of the window, seconds; throughput_rps: successful requests per second in it.
        p50_ms, p95_ms, p99_ms, max_ms: latency of the successful requests, milliseconds (0.0 when none).
        reasons: one line per limit that was missed, naming the measure, the value and the limit.
        spec: the limits applied.
        warmup_requests, warmup_failures: of those, the requests that started before the window (ramp-up and
            warm-up, left out of the latencies) and how many of them failed; shown in the line when any failed.
    """

    passed: bool
    requests: int
    failures: int
    window_s: float
    throughput_rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    reasons: tuple[str, ...]
    spec: SlaSpec = field(default_factory=SlaSpec)
    warmup_requests: int = 0
    warmup_failures: int = 0

    @property
    def fail_ratio(self) -> float:
        """Failed / all requests, warm-up included (0.0 when there were none)."""
        return self.failures / self.requests if self.requests else 0.0

    def line(self) -> str:
        """The one-line verdict: ``SLA PASS: p99 ... ms <= 200 ms, ...`` or ``SLA FAIL: ...`` naming what missed."""
        s = self.spec
        figures = (
            f"p99 {self.p99_ms:.1f} ms (limit {s.p99_ms:g}), p95 {self.p95_ms:.1f} ms (limit {s.p95_ms:g}), "
            f"failures {self.failures}/{self.requests} = {100 * self.fail_ratio:.3f}% "
            f"(limit {100 * s.max_fail_ratio:g}%), {self.throughput_rps:.1f} req/s over {self.window_s:.1f} s"
        )
        if self.warmup_failures:
            figures += f"; {self.warmup_failures} of the failures were in the warm-up, before the window"
        if self.passed:
            return f"SLA PASS: {figures}"
        return f"SLA FAIL: {'; '.join(self.reasons)} -- {figures}"

    def as_dict(self) -> dict:
        """Fields, the fail ratio and the verdict line, for JSON."""
        return {**asdict(self), "fail_ratio": self.fail_ratio, "line": self.line()}


def percentiles(latencies_ms: np.ndarray, qs: list[float]) -> list[float]:
    """NumPy's (linear) percentiles ``qs`` of ``latencies_ms``, as floats; 0.0 each for an empty array."""
    return [float(v) for v in np.percentile(latencies_ms, qs)] if latencies_ms.size else [0.0] * len(qs)


def window(samples: list[Sample], start_s: float, end_s: float) -> list[Sample]:
    """The samples that started in ``[start_s, end_s)`` (seconds since the epoch)."""
    return [x for x in samples if start_s <= x.start_s < end_s]


def evaluate(samples: list[Sample], start_s: float, end_s: float, spec: SlaSpec) -> GateResult:
    """Apply ``spec``: latencies of the requests that started in ``[start_s, end_s)``, failures of all before ``end_s``.

    Raises:
        ValueError: ``end_s <= start_s`` (an empty window: the run was shorter than its warm-up).
    """
    if end_s <= start_s:
        raise ValueError(f"empty measurement window: it starts at {start_s:.1f} and ends at {end_s:.1f} (s)")
    chosen = window(samples, start_s, end_s)
    before = [x for x in samples if x.start_s < start_s]
    counted = before + chosen
    ok = np.array([x.response_ms for x in chosen if not x.failed])
    failures = sum(x.failed for x in counted)
    p50, p95, p99 = percentiles(ok, [50, 95, 99])
    reasons = []
    if p99 > spec.p99_ms:
        reasons.append(f"p99 {p99:.1f} ms > {spec.p99_ms:g} ms")
    if p95 > spec.p95_ms:
        reasons.append(f"p95 {p95:.1f} ms > {spec.p95_ms:g} ms")
    if counted and failures / len(counted) > spec.max_fail_ratio:
        reasons.append(f"failure ratio {100 * failures / len(counted):.3f}% > {100 * spec.max_fail_ratio:g}%")
    if ok.size < spec.min_requests:
        reasons.append(f"only {ok.size} successful requests in the window (need {spec.min_requests})")
    return GateResult(
        passed=not reasons,
        requests=len(counted),
        failures=failures,
        window_s=end_s - start_s,
        throughput_rps=ok.size / (end_s - start_s),
        p50_ms=p50,
        p95_ms=p95,
        p99_ms=p99,
        max_ms=float(ok.max()) if ok.size else 0.0,
        reasons=tuple(reasons),
        spec=spec,
        warmup_requests=len(before),
        warmup_failures=sum(x.failed for x in before),
    )


def timeline(samples: list[Sample], origin_s: float, bin_s: float = 1.0) -> list[dict]:
    """Per-``bin_s`` rows since ``origin_s``: ``t_s``, ``rps`` (successes/s), ``failures``, ``p50_ms/p95_ms/p99_ms``."""
    rows: dict[int, list[Sample]] = {}
    for x in samples:
        rows.setdefault(int((x.start_s - origin_s) // bin_s), []).append(x)
    out = []
    for k in sorted(rows):
        ok = np.array([x.response_ms for x in rows[k] if not x.failed])
        p50, p95, p99 = percentiles(ok, [50, 95, 99])
        out.append(
            {
                "t_s": k * bin_s,
                "rps": ok.size / bin_s,
                "failures": sum(x.failed for x in rows[k]),
                "p50_ms": p50,
                "p95_ms": p95,
                "p99_ms": p99,
            }
        )
    return out


def worst_stretch(rows: list[dict], window_t: tuple[float, float], sla_ms: float) -> dict | None:
    """The window's worst run of bad seconds: consecutive :func:`timeline` rows with a failure or a p99 over ``sla_ms``.

    A verdict can fail on a few seconds (a stall of the machine, a burst of refusals) that the mean per stage hides;
    this names them, so they can be matched to the plot and the server's log.

    Args:
        rows: :func:`timeline` rows (``t_s`` since the run's start, 1 s bins).
        window_t: the judged window, seconds since the run's start ``(from, to)``.
        sla_ms: the p99 limit, milliseconds.

    Returns:
        ``{"from_s", "to_s", "failures", "window_failures", "max_p99_ms"}`` of the stretch with the most failures
        (then the highest p99), ``to_s`` the end of its last second; None when no second of the window was bad.
    """
    inside = [r for r in rows if window_t[0] - 1 < r["t_s"] < window_t[1]]
    stretches: list[list[dict]] = []
    for row in inside:
        if row["failures"] or row["p99_ms"] > sla_ms:
            if stretches and stretches[-1][-1]["t_s"] == row["t_s"] - 1:
                stretches[-1].append(row)
            else:
                stretches.append([row])
    if not stretches:
        return None
    worst = max(stretches, key=lambda st: (sum(r["failures"] for r in st), max(r["p99_ms"] for r in st)))
    return {
        "from_s": worst[0]["t_s"],
        "to_s": worst[-1]["t_s"] + 1,
        "failures": sum(r["failures"] for r in worst),
        "window_failures": sum(r["failures"] for r in inside),
        "max_p99_ms": max(r["p99_ms"] for r in worst),
    }


def stretch_line(stretch: dict) -> str:
    """``Worst stretch: 13-16 s into the run: 55 of the window's 58 failures, per-second p99 up to 780 ms``.

    A window without failures: ``Worst stretch: 58-59 s into the run: per-second p99 up to 277 ms, no failures``.
    """
    seconds = f"Worst stretch: {stretch['from_s']:g}-{stretch['to_s']:g} s into the run: "
    p99 = f"per-second p99 up to {stretch['max_p99_ms']:.0f} ms"
    if not stretch["window_failures"]:
        return f"{seconds}{p99}, no failures"
    return f"{seconds}{stretch['failures']} of the window's {stretch['window_failures']} failures, {p99}"
