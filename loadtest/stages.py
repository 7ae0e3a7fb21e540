"""Where the time went: Triton's per-step statistics turned into a per-request stage breakdown and a culprit."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from triton_embed.server_stats import StepStats

STEP_ORDER = ("tokenizer", "encoder")


@dataclass(frozen=True)
class Stage:
    """One stage's share of the mean request latency.

    Attributes:
        name: e.g. ``encoder queue``, ``encoder compute infer``, ``outside Triton (client + network)``.
        ms: mean time an ensemble request spent there, milliseconds (step means weighted by the step's requests
            per ensemble request, so response-cache hits, which skip the steps, are accounted for).
        share: ``ms`` over the client's mean latency, 0..1.
    """

    name: str
    ms: float
    share: float

    def as_dict(self) -> dict:
        """Fields, for JSON."""
        return asdict(self)


def breakdown(steps: dict[str, StepStats], client_mean_ms: float) -> list[Stage]:
    """Split the client's mean latency into stages, from the difference of two statistics snapshots.

    Args:
        steps: ``embed``, ``tokenizer`` and ``encoder`` counters over the window (``server_stats.parse`` with
            ``before``).
        client_mean_ms: mean latency of the successful requests as the client measured them, milliseconds.

    Returns:
        tokenizer and encoder queue / compute input / compute infer / compute output, the ensemble's own
        overhead (ensemble request time minus its steps'), and the time outside Triton (client mean minus the
        ensemble's mean request time: serialisation, the network, the HTTP/gRPC frontend). Negative residuals
        (rounding, requests straddling a snapshot) are shown as 0.

    Raises:
        KeyError: a step is missing from ``steps``.
    """
    embed = steps["embed"]
    stages: list[tuple[str, float]] = []
    inside_steps = 0.0
    for name in STEP_ORDER:
        step = steps[name]
        per_request = step.requests / embed.requests if embed.requests else 0.0
        inside_steps += step.request_ms * per_request
        stages += [
            (f"{name} queue", step.queue_ms * per_request),
            (f"{name} compute input", step.compute_input_ms * per_request),
            (f"{name} compute infer", step.compute_infer_ms * per_request),
            (f"{name} compute output", step.compute_output_ms * per_request),
        ]
    stages.append(("ensemble overhead", max(0.0, embed.request_ms - inside_steps)))
    stages.append(("outside Triton (client + network)", max(0.0, client_mean_ms - embed.request_ms)))
    total = client_mean_ms if client_mean_ms > 0 else 1.0
    return [Stage(name, ms, ms / total) for name, ms in stages]


def culprit(stages: list[Stage]) -> Stage | None:
    """The stage with the largest mean time (None for an empty list): the first place to look when p99 misses."""
    return max(stages, key=lambda s: s.ms, default=None)
