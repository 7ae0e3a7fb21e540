"""Per-step latency breakdown from Triton's statistics API (``/v2/models/<m>/stats``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from triton_embed_protocol import DEFAULT_MODEL, step_names
from triton_embed_protocol.capacity import KNOB_GAUGE, read_gauges


def steps(model: str = DEFAULT_MODEL) -> tuple[str, str, str]:
    """The model ``model``'s ensemble and its tokenizer and encoder steps, as Triton names them."""
    return (model, *step_names(model))


STEPS = steps()
_DURATIONS = ("queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class StepStats:
    """One model's counters since the server started (or the difference of two snapshots).

    Attributes:
        model: model name (``embed``, ``tokenizer``, ``encoder``).
        requests: successful requests (``inference_stats.success.count``; response-cache hits included).
        failures: failed requests (``inference_stats.fail.count``).
        request_ms: mean time of a successful request inside this model, from arrival to response, milliseconds
            (``success.ns / success.count``; for the ensemble, the whole pipeline; cache hits count as ~0).
        inferences: texts run (``inference_count``; a request of N texts counts N).
        executions: model executions (``execution_count``); ``inferences / executions`` is the average batch.
        queue_ms, compute_input_ms, compute_infer_ms, compute_output_ms: mean per request, milliseconds.
        cache_hits: requests answered from the response cache.
    """

    model: str
    requests: int
    failures: int
    request_ms: float
    inferences: int
    executions: int
    queue_ms: float
    compute_input_ms: float
    compute_infer_ms: float
    compute_output_ms: float
    cache_hits: int

    @property
    def avg_batch(self) -> float:
        """Texts per execution (0.0 before the first)."""
        return self.inferences / self.executions if self.executions else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Fields plus ``avg_batch``, for JSON."""
        return {**asdict(self), "avg_batch": self.avg_batch}


def _count_ns(stats: dict[str, Any], key: str) -> tuple[int, int]:
    entry = stats.get("inference_stats", {}).get(key, {})
    return int(entry.get("count", 0)), int(entry.get("ns", 0))


def parse(model_stats: dict[str, Any], before: dict[str, Any] | None = None) -> StepStats:
    """Build a :class:`StepStats` from one entry of ``model_stats`` (JSON form); with ``before``, the difference."""

    def delta(key: str) -> tuple[int, int]:
        count, ns = _count_ns(model_stats, key)
        if before is not None:
            c0, n0 = _count_ns(before, key)
            count, ns = count - c0, ns - n0
        return count, ns

    def total(key: str) -> int:
        return int(model_stats.get(key, 0)) - (int(before.get(key, 0)) if before else 0)

    requests, success_ns = delta("success")
    means = {}
    for name in _DURATIONS:
        count, ns = delta(name)
        means[f"{name}_ms"] = ns / count / 1e6 if count else 0.0
    return StepStats(
        model=model_stats.get("name", "?"),
        requests=requests,
        failures=delta("fail")[0],
        request_ms=success_ns / requests / 1e6 if requests else 0.0,
        inferences=total("inference_count"),
        executions=total("execution_count"),
        cache_hits=delta("cache_hit")[0],
        **means,
    )


def merge(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of one model's ``model_stats`` entries (JSON form) from several servers; one entry as it is.

    Counts and times add up (``inference_count``, ``execution_count``, every ``inference_stats`` count and ns), so
    :func:`parse` of the sum gives the totals and the means over every server.

    Raises:
        ValueError: no entries.
    """
    if not entries:
        raise ValueError("no statistics to merge")
    if len(entries) == 1:
        return entries[0]
    keys = {k for e in entries for k in e.get("inference_stats", {})}
    return {
        "name": entries[0].get("name", "?"),
        "inference_count": sum(int(e.get("inference_count", 0)) for e in entries),
        "execution_count": sum(int(e.get("execution_count", 0)) for e in entries),
        "inference_stats": {
            k: {field: sum(_count_ns(e, k)[i] for e in entries) for i, field in enumerate(("count", "ns"))}
            for k in keys
        },
    }


LEGEND = """\
one row per step (embed: the whole ensemble), counted since the server started:
  successes    requests answered, response-cache hits included; a request a backend refuses or rejects counts as
               a success of its step and a failure of embed
  failures     failed requests (Triton 2.51 counts each failed embed request twice)
  texts run    texts the step computed (a cache hit is not run)
  execs        executions; batch = texts run / execs
  queue ms, input ms, infer ms, output ms
               mean per request, milliseconds
  cache hits   requests answered from the response cache"""
"""What :func:`table`'s columns mean (``triton-embed stats --help``)."""


def table(rows: list[StepStats]) -> str:
    """A fixed-width text table, one row per step.

    ``successes`` is :attr:`StepStats.requests` (cache hits included); ``failures`` is Triton's count, which on 2.51
    counts each failed request of the ``embed`` ensemble twice; ``texts run`` is :attr:`StepStats.inferences`, so a
    request answered from the response cache adds to ``successes`` and ``cache hits`` but not to ``texts run``.
    """
    w = max([10, *(len(r.model) for r in rows)])  # the model column fits the longest step name
    head = (
        f"{'model':<{w}} {'successes':>9} {'failures':>9} {'texts run':>9} {'execs':>8} {'batch':>6} {'queue ms':>9} "
        f"{'input ms':>9} {'infer ms':>9} {'output ms':>10} {'cache hits':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.model:<{w}} {r.requests:>9} {r.failures:>9} {r.inferences:>9} {r.executions:>8} {r.avg_batch:>6.1f} "
            f"{r.queue_ms:>9.2f} {r.compute_input_ms:>9.2f} {r.compute_infer_ms:>9.2f} {r.compute_output_ms:>10.2f} "
            f"{r.cache_hits:>10}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Admission:
    """The encoder's admission knobs in force and its service curve, from the metrics port's gauges.

    Attributes:
        knobs: ``{knob: (value, source)}`` from ``triton_embed_admission`` (``SLA_MS``, ``MAX_IN_FLIGHT``,
            ``BULK_IN_FLIGHT``, ``BULK_TEXTS``, ``FLOOD_LATENCY_MS``, ``SERVED_P99_MS``; source ``derived`` or
            ``pinned``).
        curve_ms: ``{rows: ms}``: predicted time of one execution of that many texts, from
            ``triton_embed_service_seconds``.
    """

    knobs: dict[str, tuple[float, str]]
    curve_ms: dict[int, float]

    def as_dict(self) -> dict[str, Any]:
        """For JSON: ``{"knobs": {knob: {"value", "source"}}, "curve_ms": {rows: ms}}``."""
        return {
            "knobs": {k: {"value": v, "source": s} for k, (v, s) in self.knobs.items()},
            "curve_ms": self.curve_ms,
        }

    def text(self) -> str:
        """Two lines: the knobs with how each was set, and the curve."""
        order = ("SLA_MS", "MAX_IN_FLIGHT", "BULK_IN_FLIGHT", "BULK_TEXTS", "FLOOD_LATENCY_MS", "SERVED_P99_MS")
        named = sorted(self.knobs.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
        knobs = ", ".join(f"{k} {v:g} ({s})" for k, (v, s) in named)
        curve = ", ".join(f"{rows} in {ms:.1f} ms" for rows, ms in sorted(self.curve_ms.items()))
        return f"admission: {knobs}\nservice curve (one execution): {curve}"


def admission(metrics_text: str, model: str = "encoder") -> Admission:
    """:class:`Admission` of ``model`` from the text of Triton's metrics endpoint (Prometheus exposition format).

    Raises:
        ValueError: the text holds no ``triton_embed_admission`` gauge of ``model`` (not this server's metrics port,
            or an encoder not on the project's backend).
    """
    knobs, curve = read_gauges(metrics_text, model)
    if not knobs:
        raise ValueError(f"no {KNOB_GAUGE} gauge of model {model!r} in the metrics")
    return Admission(knobs, {rows: seconds * 1000 for rows, seconds in curve.items()})
