"""Overload control of the encoder: serve what can finish within the latency budget, refuse the rest late.

Policy: at each execution the encoder refuses, oldest first, the requests that would end more than their latency
budget after entering its queue (their wait so far plus the batch's expected run time, less their own run time
alone), and runs the rest. A refusal is answered ``REFUSAL_HOLD_MS`` after the request entered the queue, about
when it would have been served had it waited its turn, so a client that retries at once cannot send faster than
the server answers.

Nothing else refuses: Triton's queues hold every request until the encoder takes it, so a load the encoder serves
within the budget is never refused, on a fresh server or after an idle spell alike. The budget is the model config
parameter ``LATENCY_BUDGET_MS`` (0 = never refuse); a request may carry its own as the request parameter
``latency_budget_ms``. Design and figures: docs/overload.md.

Pure Python (no torch, no Triton): tests/unit/test_overload.py.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_BUDGET_MS = 3_600_000.0
"""The longest ``latency_budget_ms`` a request may carry, ms (an hour; 0 is "never refuse" for longer jobs)."""
METRIC = "triton_embed_shed_requests_total"
"""Counter of requests refused by the encoder's overload control, labelled ``model``."""
METRIC_HELP = "Requests answered UNAVAILABLE because they could not finish within LATENCY_BUDGET_MS"


class BudgetError(ValueError):
    """The request parameter ``latency_budget_ms`` is not a number of ms from 0 to :data:`MAX_BUDGET_MS`."""


def request_budget_ms(parameters: str | None, default_ms: float) -> float:
    """A request's latency budget: its parameter ``latency_budget_ms`` when present, else ``default_ms``.

    Args:
        parameters: the request's parameters as JSON text (``request.parameters()``); None or "" = none.
        default_ms: the model's ``LATENCY_BUDGET_MS``, ms.

    Returns:
        the budget, ms (0 = never refuse this request).

    Raises:
        BudgetError: the parameter is present but not a number from 0 to :data:`MAX_BUDGET_MS`; the message names
            the field, the limits and the value.
    """
    try:
        values = json.loads(parameters or "{}")
    except ValueError:
        values = {}
    value = values.get("latency_budget_ms") if isinstance(values, dict) else None
    if value is None:
        return default_ms
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_BUDGET_MS:
        raise BudgetError(
            f"request parameter 'latency_budget_ms' must be a number of ms from 0 to {MAX_BUDGET_MS:.0f} "
            f"(0 = never shed); got {value!r}"
        )
    return float(value)


def refusal_message(waited_ms: float, run_ms: float, budget_ms: float) -> str:
    """The UNAVAILABLE message of a refused request: what it waited, what its batch needs, the budget and the knobs.

    Args:
        waited_ms: the request's wait in the encoder's queue, ms.
        run_ms: the expected run time of the batch it would have joined, ms.
        budget_ms: the request's latency budget, ms.
    """
    return (
        f"overloaded: the request waited {waited_ms:.0f} ms for the encoder and its batch needs ~{run_ms:.0f} ms, "
        f"over the {budget_ms:g} ms latency budget (LATENCY_BUDGET_MS in the encoder's config; the request parameter "
        "latency_budget_ms overrides it, 0 = never shed). Retry with backoff"
    )


@dataclass
class RunTime:
    """Expected run time of a batch: ``fixed_ms + ms_per_token x rows x padded length``, moving averages.

    Attributes:
        ms_per_token: cost per padded token, ms; learned from executions of at least ``min_tokens`` tokens.
        fixed_ms: cost of an execution whatever it holds, ms; learned from the smaller executions.
        alpha: weight of each new execution (0.1: about the last 10 of that kind).
        min_tokens: executions of at least this many padded tokens teach ``ms_per_token``, smaller ones ``fixed_ms``.
    """

    ms_per_token: float
    fixed_ms: float = 0.0
    alpha: float = 0.1
    min_tokens: int = 256

    def ms(self, rows: int, width: int) -> float:
        """Expected run time of ``rows`` texts padded to ``width`` tokens, ms."""
        return self.fixed_ms + self.ms_per_token * rows * width

    def observe(self, took_ms: float, rows: int, width: int) -> None:
        """Learn from one execution of ``rows`` x ``width`` padded tokens that took ``took_ms`` ms."""
        tokens = rows * width
        if tokens >= self.min_tokens:
            per_token = max(0.0, took_ms - self.fixed_ms) / tokens
            self.ms_per_token += self.alpha * (per_token - self.ms_per_token)
        else:
            fixed = max(0.0, took_ms - self.ms_per_token * tokens)
            self.fixed_ms += self.alpha * (fixed - self.fixed_ms)


def shed(
    waited_ms: list[float | None], rows: list[int], widths: list[int], budgets_ms: list[float], run_time: RunTime
) -> dict[int, str]:
    """The requests of one execution to refuse, each with its message; the others run as one batch.

    While some kept request would end past its deadline, the one that has waited longest of those is refused and
    the batch's run time recomputed. A request's deadline is its budget after it entered the queue plus its own run
    time alone: a request is refused for waiting behind others, never for its own size.

    Args:
        waited_ms: per request, ms since it entered the encoder's queue; None (a direct caller, no stamp) is never
            refused.
        rows: per request, its texts.
        widths: per request, its longest text in tokens.
        budgets_ms: per request, its latency budget, ms; 0 = never refused.
        run_time: the expected run time of a batch.

    Returns:
        ``{request index: UNAVAILABLE message}``.
    """
    kept = [i for i in range(len(rows)) if waited_ms[i] is not None and budgets_ms[i] > 0]
    others = [i for i in range(len(rows)) if i not in kept]
    refused: dict[int, str] = {}
    while kept:
        batch = [*kept, *others]
        run_ms = run_time.ms(sum(rows[i] for i in batch), max(widths[i] for i in batch))
        late = [i for i in kept if waited_ms[i] + run_ms > budgets_ms[i] + run_time.ms(rows[i], widths[i])]
        if not late:
            break
        oldest = max(late, key=lambda i: waited_ms[i])
        kept.remove(oldest)
        refused[oldest] = refusal_message(waited_ms[oldest], run_ms, budgets_ms[oldest])
    return refused


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
