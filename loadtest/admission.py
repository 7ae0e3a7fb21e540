"""The server's refusals over a run, sampled from Triton's ``/metrics``.

The encoder refuses requests it could not finish within their latency budget (python_backends/torchscript/overload.py,
docs/overload.md) and counts them in ``triton_embed_shed_requests_total{model="encoder"}``. A run's failures and tail
are read against that timeline. ``share`` and ``refused`` (a gauge ``triton_embed_admission_share`` and the counter's
``model="tokenizer"`` series) stay None and 0 on this server, which publishes neither; the libtorch encoder publishes
no counter at all: then nothing is sampled.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import gevent

log = logging.getLogger("loadtest")

SHARE_METRIC = "triton_embed_admission_share"
SHED_METRIC = "triton_embed_shed_requests_total"  # python_backends/torchscript/overload.py: METRIC


@dataclass(frozen=True)
class AdmissionSample:
    """One read of ``/metrics``.

    Attributes:
        time_s: ``time.time()`` when it was read, seconds since the epoch.
        share: the least ``triton_embed_admission_share`` over the encoder instances, 0.25..1 (None: not published).
        refused: requests the tokenizer refused since the server started (counter).
        shed: requests the encoder shed since the server started (counter).
    """

    time_s: float
    share: float | None
    refused: int
    shed: int


def parse(metrics_text: str, time_s: float) -> AdmissionSample | None:
    """The :class:`AdmissionSample` in a Prometheus text scrape of Triton, or None when it has none of our metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    shares, shed, seen = [], {}, False
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == SHARE_METRIC:
                shares.append(sample.value)
                seen = True
            elif sample.name == SHED_METRIC:
                model = sample.labels.get("model", "")
                shed[model] = shed.get(model, 0) + int(sample.value)
                seen = True
    if not seen:
        return None
    return AdmissionSample(time_s, min(shares) if shares else None, shed.get("tokenizer", 0), shed.get("encoder", 0))


class AdmissionSampler:
    """Reads ``metrics_url`` every ``interval_s`` seconds in a greenlet (Locust runs on gevent) until stopped."""

    def __init__(self, metrics_url: str, interval_s: float = 1.0) -> None:
        """Sample ``metrics_url`` (Triton's ``http://host:8002/metrics``) every ``interval_s`` seconds."""
        self.metrics_url, self.interval_s = metrics_url, interval_s
        self.samples: list[AdmissionSample] = []
        self._greenlet = None
        self._warned = False

    def start(self) -> AdmissionSampler:
        """Take a first sample now, then one every ``interval_s`` seconds."""
        self._greenlet = gevent.spawn(self._run)
        return self

    def stop(self) -> list[AdmissionSample]:
        """Take a last sample, stop, and return every sample, oldest first."""
        if self._greenlet is not None:
            self._greenlet.kill()
            self._greenlet = None
        self._sample()
        return self.samples

    def _run(self) -> None:
        while True:
            self._sample()
            gevent.sleep(self.interval_s)

    def _sample(self) -> None:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as response:  # noqa: S310 - the operator's URL
                text = response.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            if not self._warned:
                log.warning("no admission timeline: could not read %s (%s)", self.metrics_url, exc)
                self._warned = True
            return
        sample = parse(text, time.time())
        if sample is not None:
            self.samples.append(sample)


def per_second(samples: list[AdmissionSample], origin_s: float) -> list[dict]:
    """Rows for the report's timeline, one per second of the run that the samples cover.

    Each row: ``t_s`` (the second, counted from ``origin_s`` as the latency timeline counts it), ``share`` (the
    least read at the end of that second, None if not published or not read there), ``refused_per_s`` and
    ``shed_per_s``. A counter's increase between two reads is spread evenly over the time between them, so a read
    that came late (the sampler shares the cores with Locust) leaves no second without a bar: each second it
    spanned gets the mean rate.
    """
    rows: dict[int, dict] = {}

    def row(second: int) -> dict:
        return rows.setdefault(second, {"share": None, "refused": 0.0, "shed": 0.0, "s": 0.0})

    for before, now in zip(samples, samples[1:], strict=False):
        start, end = before.time_s - origin_s, now.time_s - origin_s
        elapsed = max(1e-3, end - start)
        refused_rate = max(0, now.refused - before.refused) / elapsed
        shed_rate = max(0, now.shed - before.shed) / elapsed
        for second in range(math.floor(start), math.ceil(end)):
            overlap = min(end, second + 1) - max(start, second)
            r = row(second)
            r["refused"] += refused_rate * overlap
            r["shed"] += shed_rate * overlap
            r["s"] += overlap
        if now.share is not None:
            last = row(math.ceil(end) - 1)  # the second that ``now`` closes
            last["share"] = now.share if last["share"] is None else min(last["share"], now.share)
    return [
        {
            "t_s": float(t),
            "share": r["share"],
            "refused_per_s": r["refused"] / r["s"] if r["s"] else 0.0,
            "shed_per_s": r["shed"] / r["s"] if r["s"] else 0.0,
        }
        for t, r in sorted(rows.items())
    ]


def summary(samples: list[AdmissionSample], window_s: tuple[float, float]) -> dict | None:
    """The window's admission figures; None without two samples in ``window_s`` (epoch seconds).

    Keys: ``refused`` and ``shed`` (counter increases), ``min_share``, ``below_full_s`` (seconds between samples
    whose later share was under 1; both None when the share is not published), ``window_s`` (seconds sampled).
    """
    inside = [s for s in samples if window_s[0] <= s.time_s <= window_s[1]]
    if len(inside) < 2:
        return None
    shares = [s.share for s in inside if s.share is not None]
    below = sum(
        now.time_s - before.time_s
        for before, now in zip(inside, inside[1:], strict=False)
        if now.share is not None and now.share < 1.0
    )
    return {
        "refused": inside[-1].refused - inside[0].refused,
        "shed": inside[-1].shed - inside[0].shed,
        "min_share": min(shares) if shares else None,
        "below_full_s": below if shares else None,
        "window_s": inside[-1].time_s - inside[0].time_s,
    }
