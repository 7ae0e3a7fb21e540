"""Deadline-based load shedding for the encoder: answer UNAVAILABLE at once to requests that cannot finish in time.

A request is worth running only if it can still meet the SLA. At each execute the backend knows how long every
request has waited since the tokenizer stamped it (``arrival_ns``) and can estimate how long the execution will
take (a cost per padded token, learned from its own executions). Requests whose wait plus that estimate exceeds
``LATENCY_BUDGET_MS`` are shed, oldest first; each one shed shrinks the batch and so the estimate for the rest.
This is what Triton's ``default_queue_policy`` timeout would do, but sized to the work actually queued, and without
the queue policy that stalls Triton 2.51's dynamic batcher on this model (see encoder/config.pbtxt).
The tokenizer applies the same deadlines earlier, from the encoder's backlog (``admission.py``).
Pure Python (no torch, no Triton) so that it is unit-tested on its own: tests/unit/test_shedding.py. Lives in
``python_backends/common``, which both backends put on ``sys.path``.
"""

from __future__ import annotations

import json

from cost import CostModel

BIG_REQUEST_FACTOR = 4.0
"""A request's deadline is at least this many times its own run time (``CostModel.own_ms``: its tokens, not the
per-execution fixed part): a bulk caller that sends 4 chunks of 64 texts at once has each chunk wait for up to 3
others, which is not overload. (``triton_embed`` sends the chunks of one call with budget 0 unless told otherwise:
chunks of short texts are not big by this rule, and they queue behind each other past any per-request budget.)"""
MIN_WAIT_FRACTION = 0.5
"""A request is shed only after waiting at least this share of the latency budget (see :func:`choose_shed`)."""
SHED_METRIC = "triton_embed_shed_requests_total"
"""Counter of requests refused (tokenizer) or shed (encoder), labelled ``model``: the same family for both."""
SHED_METRIC_HELP = "Requests answered UNAVAILABLE because they could not finish within LATENCY_BUDGET_MS"


def overloaded(cause: str, budget_ms: float) -> str:
    """The UNAVAILABLE message for a request refused or shed, naming the budget it breaks and the knobs.

    Args:
        cause: the prediction, ending in the word that leads to the budget (e.g. "... needs ~90 ms, over").
        budget_ms: the request's latency budget, ms.
    """
    return (
        f"overloaded: {cause} the {budget_ms:g} ms latency budget (LATENCY_BUDGET_MS, sized to the SLA; request "
        "parameter latency_budget_ms overrides it, 0 = never shed). Retry with backoff"
    )


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
    deadline = [max(b, BIG_REQUEST_FACTOR * cost.own_ms(r, w)) for b, r, w in zip(budgets, rows, widths, strict=True)]
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


MAX_BUDGET_MS = 3_600_000.0
"""The longest ``latency_budget_ms`` a request may carry, ms (an hour; 0 is "never shed" for longer jobs)."""


class BudgetError(ValueError):
    """A request parameter of the latency budget is invalid.

    ``latency_budget_ms`` is not a number of ms from 0 to :data:`MAX_BUDGET_MS`, or ``sent_ns`` is not a whole
    number of ns >= 0 or is more than :data:`MAX_BUDGET_MS` old.
    """


def request_parameters(parameters: str | None) -> dict:
    """The request's parameters (JSON text from ``request.parameters()``) as a dict; {} when absent or unreadable.

    Parse them once per request and pass the dict to :func:`budget_from_parameters` and :func:`sent_age_ms`.
    """
    try:
        value = json.loads(parameters or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


SENT_PARAMETER = "sent_ns"
"""Request parameter: when the client sent the request, ns since the Unix epoch (``time.time_ns()``, the host's
``CLOCK_REALTIME``). Sent by ``triton_embed`` with ``send_time=True``: the budget then counts the wait before the
tokenizer's stamp too (the client's own send, the frontend, the tokenizer's queue), beyond :data:`SEND_ALLOWANCE_MS`;
under a burst on shared cores that wait was half of the late requests' excess (docs/benchmarks.md, "Where the
remaining misses come from")."""


SEND_ALLOWANCE_MS = 10.0
"""The time from the client's send to the tokenizer's stamp that ``LATENCY_BUDGET_MS`` already leaves room for, ms:
the budget is the SLA less the frontend and the network (180 of 200 ms as shipped), about half of it on the way in.
Only a longer wait counts against the budget (:func:`late_arrival_ms`)."""


def late_arrival_ms(before_stamp_ms: float) -> float:
    """The part of a request's wait before the tokenizer's stamp that counts against its budget, ms (>= 0).

    Args:
        before_stamp_ms: from the client's send (``sent_ns``) to the stamp, ms.
    """
    return max(0.0, before_stamp_ms - SEND_ALLOWANCE_MS)


def sent_age_ms(parameters: dict, wall_now_ns: int) -> float:
    """How long ago the client sent the request by its ``sent_ns`` parameter, ms; 0 when it has none.

    A stamp in the future (a clock ahead of this host's) counts as 0: such a clock cannot be corrected here, and a
    request is never shed for it. A clock behind makes every request look older by as much: only clients whose
    clock agrees with this host's should send it (the same host, or synchronised clocks).

    Args:
        parameters: the request's parameters (:func:`request_parameters`).
        wall_now_ns: now, ns since the Unix epoch (``time.time_ns()``).

    Raises:
        BudgetError: ``sent_ns`` is present but not a whole number >= 0, or more than :data:`MAX_BUDGET_MS` before
            now (a stamp in ms or s rather than ns, or a clock far behind: counted, it would refuse the request as
            overloaded, and the client would retry it); the message names it and the value.
    """
    value = parameters.get(SENT_PARAMETER)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BudgetError(
            f"request parameter '{SENT_PARAMETER}' must be a whole number of ns since the Unix epoch (time.time_ns()) "
            f"when the client sent the request; got {value!r}"
        )
    age_ms = (wall_now_ns - value) / 1e6
    if age_ms > MAX_BUDGET_MS:
        raise BudgetError(
            f"request parameter '{SENT_PARAMETER}' is {age_ms / 1000:.0f} s before the server's clock, more than the "
            f"{MAX_BUDGET_MS / 1000:.0f} s a latency budget may span: check that it is ns since the Unix epoch "
            f"(time.time_ns(), not ms or s) and the client's clock; got {value!r}"
        )
    return max(0.0, age_ms)


def budget_from_parameters(parameters: dict, default_ms: float) -> float:
    """The request parameter ``latency_budget_ms`` (ms, >= 0; 0 = never shed this request), else ``default_ms``.

    Args:
        parameters: the request's parameters (:func:`request_parameters`).
        default_ms: the model's ``LATENCY_BUDGET_MS``, ms.

    Raises:
        BudgetError: the parameter is present but not a number from 0 to :data:`MAX_BUDGET_MS`; the message names
            it, the limits and the value.
    """
    value = parameters.get("latency_budget_ms")
    if value is None:
        return default_ms
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_BUDGET_MS:
        raise BudgetError(
            f"request parameter 'latency_budget_ms' must be a number of ms from 0 to {MAX_BUDGET_MS:.0f} "
            f"(0 = never shed); got {value!r}"
        )
    return float(value)
