"""Deadline-based load shedding for the encoder: answer UNAVAILABLE at once to requests that cannot finish in time.

A request is worth running only if it can still meet the SLA. At each execute the backend knows how long every
request has waited since the tokenizer stamped it (``arrival_ns``) and can estimate how long the execution will
take (a cost per padded token, learned from its own executions). Requests whose wait plus that estimate exceeds
``LATENCY_BUDGET_MS`` are shed, oldest first; each one shed shrinks the batch and so the estimate for the rest.
This is what Triton's ``default_queue_policy`` timeout would do, but sized to the work actually queued, and without
the queue policy that stalls Triton 2.51's dynamic batcher on this model (see encoder/config.pbtxt).
Pure Python (no torch, no Triton) so that it is unit-tested on its own: tests/unit/test_shedding.py.
"""

from __future__ import annotations

from dataclasses import dataclass

BIG_REQUEST_FACTOR = 4.0
"""A request's deadline is at least this many times its own run time: a bulk caller (``triton_embed`` sends 4 chunks
of 64 texts at once by default) has each chunk wait for up to 3 others, which is not overload."""
MIN_WAIT_FRACTION = 0.5
"""A request is shed only after waiting at least this share of the latency budget (see :func:`choose_shed`)."""


@dataclass
class CostModel:
    """Execution time of one batch: ``fixed_ms + ms_per_token x rows x padded length``, learned as moving averages.

    Attributes:
        ms_per_token: cost per padded token, ms (CPU, MiniLM: ~0.1; a GPU graph replay: far less). Learned from
            executions of at least ``min_tokens`` padded tokens, after taking ``fixed_ms`` off.
        fixed_ms: cost of an execution regardless of its size (call overhead, thread wake-up), ms. Learned from
            the smaller executions, after taking the per-token part off.
        alpha: weight of each new observation (0.1: about the last 10 executions of that kind).
        min_tokens: the boundary between "small" (teaches ``fixed_ms``) and "large" (teaches ``ms_per_token``).
        margin: factor on the estimate (measured: execution time / this model's estimate had p90 1.38 during a 4x
            overload on 2 CPU cores, where the server and its clients share the cores).
    """

    ms_per_token: float
    fixed_ms: float = 0.0
    alpha: float = 0.1
    min_tokens: int = 256
    margin: float = 1.4

    def estimate_ms(self, rows: int, width: int) -> float:
        """Expected execution time of ``rows`` texts padded to ``width`` tokens, milliseconds (margin included)."""
        return self.margin * (self.fixed_ms + self.ms_per_token * rows * width)

    def observe(self, took_ms: float, rows: int, width: int) -> None:
        """Learn from one execution of ``rows`` x ``width`` padded tokens that took ``took_ms`` ms."""
        tokens = rows * width
        if tokens >= self.min_tokens:
            per_token = max(0.0, took_ms - self.fixed_ms) / tokens
            self.ms_per_token += self.alpha * (per_token - self.ms_per_token)
        else:
            fixed = max(0.0, took_ms - self.ms_per_token * tokens)
            self.fixed_ms += self.alpha * (fixed - self.fixed_ms)


def choose_shed(
    waited_ms: list[float | None], rows: list[int], widths: list[int], cost: CostModel, budget_ms: float | list[float]
) -> set[int]:
    """Which requests of one execute to shed so that every kept one finishes within its deadline.

    A request's deadline is ``budget_ms`` after the tokenizer stamped it, or ``BIG_REQUEST_FACTOR`` times its own
    execution time alone if that is longer: a request that is big by itself (64 long texts, a bulk caller's chunk)
    is not late because of its size, only because of waiting. And only a request that has waited at least
    ``MIN_WAIT_FRACTION`` of the budget may be shed: before that, a late finish comes from the batch being large
    (long texts from a few clients), not from a queue building up, and rejecting fresh requests would turn
    moderate load into errors.

    Args:
        waited_ms: per request, ms since the tokenizer stamped it; None (no stamp: a direct caller) is never shed.
        rows: per request, texts in it.
        widths: per request, its longest real text in tokens.
        cost: the execution-time model.
        budget_ms: the latency budget from the tokenizer's start to the encoder's end, ms, for every request or one
            per request (a request parameter may set it); 0 = never shed that request.

    Returns:
        indices to answer UNAVAILABLE: while some kept request would miss its deadline (its wait plus the estimated
        execution of the kept batch), the longest-waiting of those is shed and the estimate recomputed.
    """
    shed: set[int] = set()
    budgets = list(budget_ms) if isinstance(budget_ms, list) else [budget_ms] * len(rows)
    if not any(b > 0 for b in budgets):
        return shed
    deadline = [
        max(b, BIG_REQUEST_FACTOR * cost.estimate_ms(r, w)) for b, r, w in zip(budgets, rows, widths, strict=True)
    ]
    kept = set(range(len(rows)))
    while kept:
        estimate = cost.estimate_ms(sum(rows[j] for j in kept), max(widths[j] for j in kept))
        late = [
            j
            for j in kept
            if waited_ms[j] is not None
            and budgets[j] > 0
            and waited_ms[j] >= MIN_WAIT_FRACTION * budgets[j]
            and waited_ms[j] + estimate > deadline[j]
        ]
        if not late:
            break
        oldest = max(late, key=lambda j: waited_ms[j])
        kept.discard(oldest)
        shed.add(oldest)
    return shed
