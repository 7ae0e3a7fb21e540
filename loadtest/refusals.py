"""The server's refusals over a run, sampled from Triton's ``/metrics``.

The tokenizer refuses the interactive requests past ``MAX_IN_FLIGHT`` texts and the bulk ones past ``BULK_QUEUE``, and
the encoder those that waited longer than their latency budget in its queue
(python_backends/triton_embed_protocol/overload.py, docs/overload.md); both count them in
``triton_embed_shed_requests_total`` (labels ``model="tokenizer"`` and ``model="encoder"``); a run's failures and
tail are read against that count, second by second. The libtorch encoder publishes no such counter: then nothing is
sampled.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import gevent
from triton_embed_protocol.admission import METRIC

log = logging.getLogger("loadtest")


@dataclass(frozen=True)
class RefusalSample:
    """One read of ``/metrics``.

    Attributes:
        time_s: ``time.time()`` when it was read, seconds since the epoch.
        refused: requests refused as overloaded since the server started (the counter, summed over its series).
    """

    time_s: float
    refused: int


def parse(metrics_text: str, time_s: float) -> RefusalSample | None:
    """The :class:`RefusalSample` in a Prometheus text scrape of Triton, or None when it has no refusal counter.

    Args:
        metrics_text: the body of Triton's ``/metrics``.
        time_s: when it was read, seconds since the epoch.
    """
    from prometheus_client.parser import text_string_to_metric_families

    counts = [
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == METRIC
    ]
    return RefusalSample(time_s, int(sum(counts))) if counts else None


class RefusalSampler:
    """Reads ``metrics_url`` every ``interval_s`` seconds in a greenlet (Locust runs on gevent) until stopped."""

    def __init__(self, metrics_url: str, interval_s: float = 1.0) -> None:
        """Sample ``metrics_url`` (Triton's ``http://host:8002/metrics``) every ``interval_s`` seconds."""
        self.metrics_url, self.interval_s = metrics_url, interval_s
        self.samples: list[RefusalSample] = []
        self._greenlet = None
        self._warned = False

    def start(self) -> RefusalSampler:
        """Take a first sample now, then one every ``interval_s`` seconds."""
        self._greenlet = gevent.spawn(self._run)
        return self

    def stop(self) -> list[RefusalSample]:
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
                log.warning("no refusal timeline: could not read %s (%s)", self.metrics_url, exc)
                self._warned = True
            return
        sample = parse(text, time.time())
        if sample is not None:
            self.samples.append(sample)


def per_second(samples: list[RefusalSample], origin_s: float) -> list[dict]:
    """Rows for the report's timeline, one per second of the run that the samples cover.

    Each row: ``t_s`` (the second, counted from ``origin_s`` as the latency timeline counts it) and
    ``refused_per_s``. The counter's increase between two reads is spread evenly over the time between them, so a
    read that came late (the sampler shares the cores with Locust) leaves no second without a bar: each second it
    spanned gets the mean rate.

    Args:
        samples: the sampler's reads, oldest first.
        origin_s: the run's start, seconds since the epoch.
    """
    rows: dict[int, dict] = {}
    for before, now in zip(samples, samples[1:], strict=False):
        start, end = before.time_s - origin_s, now.time_s - origin_s
        rate = max(0, now.refused - before.refused) / max(1e-3, end - start)
        for second in range(math.floor(start), math.ceil(end)):
            overlap = min(end, second + 1) - max(start, second)
            row = rows.setdefault(second, {"refused": 0.0, "s": 0.0})
            row["refused"] += rate * overlap
            row["s"] += overlap
    return [
        {"t_s": float(t), "refused_per_s": r["refused"] / r["s"] if r["s"] else 0.0} for t, r in sorted(rows.items())
    ]


def summary(samples: list[RefusalSample], window_s: tuple[float, float]) -> dict | None:
    """The window's refusals: ``refused`` (the counter's increase) and ``window_s`` (seconds sampled).

    Args:
        samples: the sampler's reads, oldest first.
        window_s: the measured window, seconds since the epoch.

    Returns:
        the figures, or None without two samples in the window.
    """
    inside = [s for s in samples if window_s[0] <= s.time_s <= window_s[1]]
    if len(inside) < 2:
        return None
    return {"refused": inside[-1].refused - inside[0].refused, "window_s": inside[-1].time_s - inside[0].time_s}


def past_capacity_line(failures: int, refused: int) -> str | None:
    """What to do when a failed run's failures are mostly the server's refusals as overloaded, or None.

    Args:
        failures: the failures the users saw over the whole run.
        refused: the requests the server refused as overloaded over the whole run (:func:`summary`'s ``refused``).

    Returns:
        one line for the run's summary where at least half the failures were refusals: the load is past what this
        machine serves within the SLA (the door shed it), and ``make capacity`` finds the most users it serves.
    """
    if not failures or 2 * refused < failures:
        return None
    return (
        f"{min(refused, failures)} of the {failures} failures were refused as overloaded: the server shed the load "
        "it could not answer within the SLA, so this load is past this machine's capacity; `make capacity` finds the "
        "most users it serves within the SLA"
    )
