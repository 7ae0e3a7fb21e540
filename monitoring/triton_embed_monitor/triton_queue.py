"""Triton's queue as the monitor sees it: ``nv_inference_pending_request_count`` read from Triton's ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

PENDING_METRIC = "nv_inference_pending_request_count"
"""Triton's gauge of requests waiting for an execution, per model and version (Triton >= 2.34)."""


@dataclass(frozen=True)
class QueueSample:
    """Requests waiting in Triton at one instant.

    Attributes:
        timestamp: ``time.time()`` when ``/metrics`` was read, seconds since the epoch.
        pending: requests queued and not yet executing (``nv_inference_pending_request_count``, summed over
            the versions of the chosen model, or over every model).
    """

    timestamp: float
    pending: int


def pending_requests(metrics_text: str, model: str | None = "encoder") -> int | None:
    """Sum ``nv_inference_pending_request_count`` in a Prometheus text scrape of Triton.

    Args:
        metrics_text: the body of Triton's ``/metrics`` (Prometheus text format 0.0.4).
        model: count only this model's series (label ``model``); None sums every model. Note that a request
            waiting inside the ensemble's steps counts on the step, and the ensemble ``embed`` reports its own.

    Returns:
        The number of pending requests, or None when the scrape has no series of that metric for that model
        (metrics disabled, wrong model name, or not a Triton scrape).
    """
    from prometheus_client.parser import text_string_to_metric_families

    total = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name != PENDING_METRIC:
            continue
        for sample in family.samples:
            if model is None or sample.labels.get("model") == model:
                total = (total or 0) + int(sample.value)
    return total
