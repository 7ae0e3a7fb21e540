"""Overload control of the encoder: refuse what has already waited past the latency budget, and refuse it late.

Policy: at each execution the encoder refuses the requests that have waited longer than their latency budget in
its queue, and runs the rest. A refusal is answered ``REFUSAL_HOLD_MS`` after the request entered the queue, so a
client that retries at once cannot send faster than the server answers.

Nothing else refuses: Triton's queues hold every request until the encoder takes it, so a load the encoder serves
within the budget is never refused, on a fresh server or after an idle spell alike. The budget is the model config
parameter ``LATENCY_BUDGET_MS`` (0 = never refuse); a request may carry its own as the request parameter
``latency_budget_ms``. Design and figures: docs/overload.md.

Pure Python (no torch, no Triton): tests/unit/test_overload_policy.py.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable

MAX_BUDGET_MS = 3_600_000.0
"""The longest ``latency_budget_ms`` a request may carry, ms (an hour; 0 is "never refuse" for longer jobs)."""
METRIC = "triton_embed_shed_requests_total"
"""Counter of requests refused by the encoder's overload control, labelled ``model``."""
METRIC_HELP = "Requests answered UNAVAILABLE because they waited longer than LATENCY_BUDGET_MS in the queue"


class BudgetError(ValueError):
    """The request parameter ``latency_budget_ms`` is not a number of ms from 0 to :data:`MAX_BUDGET_MS`."""


def request_budget_ms(parameters: dict, default_ms: float) -> float:
    """A request's latency budget: its parameter ``latency_budget_ms`` when present, else ``default_ms``.

    Args:
        parameters: the request's parameters (``triton_embed_protocol.request_parameters``).
        default_ms: the model's ``LATENCY_BUDGET_MS``, ms.

    Returns:
        the budget, ms (0 = never refuse this request).

    Raises:
        BudgetError: the parameter is present but not a number from 0 to :data:`MAX_BUDGET_MS`; the message names
            the field, the limits and the value.
    """
    value = parameters.get("latency_budget_ms")
    if value is None:
        return default_ms
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_BUDGET_MS:
        raise BudgetError(
            f"request parameter 'latency_budget_ms' must be a number of ms from 0 to {MAX_BUDGET_MS:.0f} "
            f"(0 = never refused); got {value!r}"
        )
    return float(value)


def refusal_message(waited_ms: float, budget_ms: float) -> str:
    """The UNAVAILABLE message of a refused request: its wait, the budget and the knobs.

    Args:
        waited_ms: the request's wait in the encoder's queue, ms.
        budget_ms: the request's latency budget, ms.
    """
    return (
        f"overloaded: the request waited {waited_ms:.0f} ms in the encoder's queue, over the {budget_ms:g} ms "
        "latency budget (LATENCY_BUDGET_MS in the encoder's config; the request parameter latency_budget_ms "
        "overrides it, 0 = never refused). Retry with backoff"
    )


def shed(waited_ms: list[float | None], budgets_ms: list[float]) -> dict[int, str]:
    """The requests of one execution to refuse, each with its message; the others run as one batch.

    A request is refused when it has waited longer than its budget in the encoder's queue: it has already missed,
    and serving it would only make the requests behind it miss too. Nothing is refused on a prediction.

    Args:
        waited_ms: per request, ms since it entered the encoder's queue; None (a direct caller, no stamp) is never
            refused.
        budgets_ms: per request, its latency budget, ms; 0 = never refused.

    Returns:
        ``{request index: UNAVAILABLE message}``.
    """
    return {
        i: refusal_message(waited, budget)
        for i, (waited, budget) in enumerate(zip(waited_ms, budgets_ms, strict=True))
        if waited is not None and budget > 0 and waited > budget
    }


class RefusalHold:
    """Answers refusals at their due time from a thread of its own, so that holding them never blocks an execution.

    Every held refusal is answered: at its time, or at once by :meth:`close`.
    """

    def __init__(self) -> None:
        """Start the thread that answers the refusals as they fall due."""
        self._due: list[tuple[int, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="refusal-hold", daemon=True)
        self._thread.start()

    def hold(self, due_ns: int, answer: Callable[[], None]) -> None:
        """Call ``answer()`` at ``due_ns`` (``time.monotonic_ns()`` clock), or at once if that has passed."""
        with self._wake:
            heapq.heappush(self._due, (due_ns, next(self._order), answer))
            self._wake.notify()

    def pending(self) -> int:
        """Refusals held and not yet answered."""
        with self._wake:
            return len(self._due)

    def close(self) -> None:
        """Answer every held refusal now and stop the thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed:
                    if not self._due:
                        self._wake.wait()
                        continue
                    delay_s = (self._due[0][0] - time.monotonic_ns()) / 1e9
                    if delay_s <= 0:
                        break
                    self._wake.wait(delay_s)
                if not self._due:
                    return
                answer = heapq.heappop(self._due)[2]
            with contextlib.suppress(Exception):  # a client gone away must not stop the others' answers
                answer()
