"""Overload control: at most ``MAX_IN_FLIGHT`` requests in the service, and none served after its latency budget.

Policy: the tokenizer refuses a request that arrives while ``MAX_IN_FLIGHT`` requests are already between it and the
encoder's answer (under a flood, while as many as the encoder answers in ``FLOOD_LATENCY_MS`` are), and the encoder
refuses a request with a latency budget (the request parameter ``latency_budget_ms``, else ``LATENCY_BUDGET_MS``:
none on CPU as shipped) that has waited longer than it in its queue. Every refusal is answered ``REFUSAL_HOLD_MS``
after the request arrived, so a client that retries at once cannot send faster than the server answers.

Nothing is refused on a prediction, and a closed loop of up to ``MAX_IN_FLIGHT`` clients is never refused at the
door. The request parameter ``latency_budget_ms`` 0 exempts a request from both rules (bulk jobs). Design and
figures: docs/overload.md.

Used by both backends (tokenizer: :class:`Door` and :func:`admit`, encoder: :func:`shed`); pure Python, no torch, no
Triton: tests/unit/test_overload_policy.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import heapq
import itertools
import math
import os
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from triton_embed_protocol import BUDGET, budget_problem

METRIC = "triton_embed_shed_requests_total"
"""Counter of requests refused by the encoder's overload control, labelled ``model``."""
METRIC_HELP = (
    "Requests answered UNAVAILABLE as overloaded: at the tokenizer (MAX_IN_FLIGHT reached) or at the encoder "
    "(waited longer than its latency budget)"
)


class BudgetError(ValueError):
    """The request parameter ``latency_budget_ms`` breaks :func:`triton_embed_protocol.budget_problem`'s rule."""


def request_budget_ms(parameters: dict, default_ms: float) -> float:
    """A request's latency budget: its parameter ``latency_budget_ms`` when present, else ``default_ms``.

    Args:
        parameters: the request's parameters (``triton_embed_protocol.request_parameters``).
        default_ms: the model's ``LATENCY_BUDGET_MS``, ms.

    Returns:
        the budget, ms (0 = never refuse this request).

    Raises:
        BudgetError: the parameter is present but not a number of ms from 0 to an hour; the message names the
            field, the limits and the value.
    """
    value = parameters.get(BUDGET)
    if value is None:
        return default_ms
    if problem := budget_problem(value, "request parameter 'latency_budget_ms'"):
        raise BudgetError(problem)
    return float(value)


def refusal_message(waited_ms: float, budget_ms: float, *, own: bool = False) -> str:
    """The UNAVAILABLE message of a refused request: its wait, the budget and where the budget is set.

    Args:
        waited_ms: the request's wait in the encoder's queue, ms; written with as few decimals (up to 3) as show it
            over the budget (181 ms over 180, 180.4 over 180, 0.004 over 0.001).
        budget_ms: the request's latency budget, ms.
        own: the budget is the request's parameter ``latency_budget_ms``, not the encoder's ``LATENCY_BUDGET_MS``.
    """
    digits = next((d for d in range(3) if round(waited_ms, d) > budget_ms), 3)
    source = (
        "the request's parameter latency_budget_ms; 0 = never refused"
        if own
        else "LATENCY_BUDGET_MS in the encoder's config; the request parameter latency_budget_ms overrides it, "
        "0 = never refused"
    )
    return (
        f"overloaded: the request waited {waited_ms:.{digits}f} ms in the encoder's queue, over the {budget_ms:g} ms "
        f"latency budget ({source}). Retry with backoff"
    )


def shed(waited_ms: list[float | None], budgets_ms: list[float], own: list[bool] | None = None) -> dict[int, str]:
    """The requests of one execution to refuse, each with its message; the others run as one batch.

    A request is refused when it has waited longer than its budget in the encoder's queue: it has already missed,
    and serving it would only make the requests behind it miss too. Nothing is refused on a prediction.

    Args:
        waited_ms: per request, ms since it entered the encoder's queue; None (a direct caller, no stamp) is never
            refused.
        budgets_ms: per request, its latency budget, ms; 0 = never refused.
        own: per request, whether its budget is its own parameter (the message names it); None: none is.

    Returns:
        ``{request index: UNAVAILABLE message}``.
    """
    owns = own if own is not None else [False] * len(budgets_ms)
    return {
        i: refusal_message(waited, budget, own=mine)
        for i, (waited, budget, mine) in enumerate(zip(waited_ms, budgets_ms, owns, strict=True))
        if waited is not None and budget > 0 and waited > budget
    }


def full_message(in_flight: int, limit: int, max_in_flight: int | None = None, flood_ms: float = 0.0) -> str:
    """The UNAVAILABLE message of a request refused at the door: the load, the limit and the knobs.

    Args:
        in_flight: requests in flight when it arrived.
        limit: the door's limit then.
        max_in_flight: ``MAX_IN_FLIGHT`` (None: ``limit``); a lower ``limit`` is the flood limit (:class:`Door`).
        flood_ms: ``FLOOD_LATENCY_MS``, ms.
    """
    if max_in_flight is None or limit >= max_in_flight:
        why = "MAX_IN_FLIGHT in the encoder's config"
    else:
        why = (f"under a flood: the requests the encoder answers in FLOOD_LATENCY_MS, {flood_ms:g} ms, from half "
               f"of MAX_IN_FLIGHT to all of it, {max_in_flight}, in the encoder's config")  # fmt: skip
    return (
        f"overloaded: {in_flight} requests are in flight, the limit is {limit} ({why}; the request parameter "
        "latency_budget_ms 0 exempts a request). Retry with backoff"
    )


def admit(
    in_flight: int, limit: int, budgets_ms: list[float], max_in_flight: int | None = None, flood_ms: float = 0.0
) -> dict[int, str]:
    """The requests of one tokenizer execution to refuse at the door, each with its message.

    Requests are taken in order; each is admitted while fewer than ``limit`` requests are in flight (counting the
    ones admitted before it in this execution). A request with budget 0 is always admitted and counted.

    Args:
        in_flight: requests handed on to the encoder and not yet answered by it (:class:`InFlight`).
        limit: the door's limit (:meth:`Door.limit`); 0 = no limit.
        budgets_ms: per request, its latency budget, ms (0 = never refused).
        max_in_flight: ``MAX_IN_FLIGHT``, for the message (:func:`full_message`).
        flood_ms: ``FLOOD_LATENCY_MS``, ms, for the message.

    Returns:
        ``{request index: UNAVAILABLE message}``.
    """
    refused = {}
    for i, budget in enumerate(budgets_ms):
        if limit and budget > 0 and in_flight >= limit:
            refused[i] = full_message(in_flight, limit, max_in_flight, flood_ms)
        else:
            in_flight += 1
    return refused


class DoorState(NamedTuple):
    """What the tokenizer's door reads from :class:`InFlight`."""

    count: int
    """requests in flight (0 once the encoder has been idle for :data:`InFlight.IDLE_NS`)"""
    limit: int
    """the encoder's ``MAX_IN_FLIGHT`` (0 = no door)"""
    hold_ns: int
    """the encoder's ``REFUSAL_HOLD_MS``, ns"""
    flood_ns: int
    """the encoder's ``FLOOD_LATENCY_MS``, ns"""
    answered: int
    """requests the encoder has counted out of flight since the server started"""


class Door:
    """The door's limit: ``MAX_IN_FLIGHT``, and under a flood the requests the encoder answers in ``FLOOD_LATENCY_MS``.

    A flood is more requests in the service and refused (their refusals held) than ``MAX_IN_FLIGHT``: more clients
    than the door lets in. Once one has lasted :data:`WINDOW_NS`, the limit is the encoder's answers per second over
    the last :data:`WINDOW_NS` times ``FLOOD_LATENCY_MS``, so that an admitted request spends about
    ``FLOOD_LATENCY_MS`` in the service (Little's law) instead of waiting behind ``MAX_IN_FLIGHT`` others; never above
    ``MAX_IN_FLIGHT`` and never below :data:`FLOOR` of it. A load of up to ``MAX_IN_FLIGHT`` requests at a time (a
    closed loop of that many clients; fresh, after an idle spell or after a flood) is never refused. One per
    tokenizer instance, asked once per execution.
    """

    WINDOW_NS = 1_000_000_000
    """How long a flood lasts before the limit follows the encoder's answers, and the span they are counted over, ns
    (1 s)."""
    FLOOR = 0.5
    """The lowest limit, a share of ``MAX_IN_FLIGHT``: below it the encoder's batches are too small to keep its
    throughput while refusals share the cores (docs/benchmarks.md, "The flood limit")."""

    def __init__(self) -> None:
        """A door that has seen no flood."""
        self._answers: deque[tuple[int, int]] = deque()  # (monotonic ns, the encoder's answers so far)
        self._flood_since: int | None = None

    def limit(self, now_ns: int, state: DoorState, held: int) -> int:
        """The limit for an execution that begins at ``now_ns``.

        Args:
            now_ns: ``time.monotonic_ns()``.
            state: the count and the encoder's knobs and answers (:meth:`InFlight.door`).
            held: refusals of this door not answered yet (:meth:`RefusalHold.pending`).

        Returns:
            requests that may be in flight; 0 = no limit.
        """
        self._answers.append((now_ns, state.answered))
        while len(self._answers) > 1 and self._answers[1][0] <= now_ns - self.WINDOW_NS:
            self._answers.popleft()
        if not (state.limit and state.flood_ns) or state.count + held <= state.limit:
            self._flood_since = None
            return state.limit
        if self._flood_since is None:
            self._flood_since = now_ns
        if now_ns - self._flood_since < self.WINDOW_NS:
            return state.limit  # the answers counted so far are not all from the flood yet
        since_ns, before = self._answers[0]
        per_ns = (state.answered - before) / max(now_ns - since_ns, 1)
        return max(math.ceil(state.limit * self.FLOOR), min(state.limit, round(per_ns * state.flood_ns)))


class InFlight:
    """Requests the tokenizer handed on that the encoder has not answered yet, in a file both stubs share.

    The file (``/dev/shm``) is keyed by the server's process id (the stubs' parent) and the model repository, so every
    server on a host has its own; each read or change takes an exclusive ``flock``. It holds the count, when the
    encoder last went idle, the encoder's ``MAX_IN_FLIGHT``, ``REFUSAL_HOLD_MS`` and ``FLOOD_LATENCY_MS`` (the door's
    limit belongs to the encoder's hardware, so it lives in the encoder's config and reaches the tokenizer here), and
    the requests the encoder has counted out since the server started (:class:`Door` reads their rate). The tokenizer
    counts in only requests that ask for ``queued_ns`` (the ensemble does; a direct caller of the tokenizer that names
    its outputs does not). The count heals itself: it never goes below 0, either backend sets it to 0 when it loads, and
    a count left while the encoder has sat idle for :data:`IDLE_NS` since the last hand-off (requests that never
    reached it: a direct call of the tokenizer asking for every output, a stub that died) reads as 0. Exact with one
    encoder instance (as shipped); with more, it can only read low. The file outlives a reload of either backend
    (Triton finalizes the old instance after the new one loaded); the embedded server deletes its files when it stops
    (:meth:`remove_files`), and a backend loading deletes those of servers no longer running.
    """

    IDLE_NS = 100_000_000
    """An idle encoder takes a waiting request within this, ns (dynamic batcher without delay); 100 ms."""

    _FORMAT = "<qqqqqq"  # count, idle since (monotonic ns, 0 = executing), limit, refusal hold ns, flood ns, answered

    def __init__(self, model_directory: str | Path) -> None:
        """Count for the server that runs this stub and the repository holding ``model_directory``."""
        repository = Path(model_directory).resolve().parent
        key = hashlib.sha256(str(repository).encode()).hexdigest()[:12]
        self.path = self.folder() / f"triton-embed-{os.getppid()}-{key}.in-flight"

    @staticmethod
    def folder() -> Path:
        """Where the files live: ``/dev/shm``, or the temp folder on a host without one."""
        shm = Path("/dev/shm")  # noqa: S108 - opened O_NOFOLLOW, mode 0600
        return shm if shm.is_dir() else Path(tempfile.gettempdir())

    @classmethod
    def files(cls, server_pid: int | str = "*") -> list[Path]:
        """The files of the server with process id ``server_pid`` (``"*"``: of every server)."""
        return list(cls.folder().glob(f"triton-embed-{server_pid}-*.in-flight"))

    @classmethod
    def remove_files(cls, server_pid: int) -> None:
        """Delete the files of the server with process id ``server_pid``, once it has exited (a clean stop)."""
        for path in cls.files(server_pid):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _update(self, change: Callable[[list[int], int], None]) -> list[int]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = struct.calcsize(self._FORMAT)
            raw = os.pread(fd, size, 0)
            fields = list(struct.unpack(self._FORMAT, raw)) if len(raw) == size else [0] * 6
            now = time.monotonic_ns()
            if fields[1] and now - fields[1] > self.IDLE_NS:
                fields[0] = 0  # the encoder sat idle: whatever is counted never reached it
            change(fields, now)
            fields[0] = max(0, fields[0])
            os.pwrite(fd, struct.pack(self._FORMAT, *fields), 0)
            return fields
        finally:
            os.close(fd)  # releases the lock

    def door(self) -> DoorState:
        """The tokenizer's view; the count reads 0 when the encoder has been idle for :data:`IDLE_NS`."""
        count, _, limit, hold_ns, flood_ns, answered = self._update(lambda fields, now: None)
        return DoorState(count, limit, hold_ns, flood_ns, answered)

    def add(self, requests: int) -> int:
        """The tokenizer handed ``requests`` on; returns the new count."""

        def change(fields: list[int], now: int) -> None:
            fields[0] += requests
            if fields[1]:  # an idle encoder has IDLE_NS from now to take them
                fields[1] = now

        return self._update(change)[0]

    def started(self) -> None:
        """The encoder began an execution: it is not idle."""

        def change(fields: list[int], now: int) -> None:
            fields[1] = 0

        self._update(change)

    def answered(self, requests: int, *, idle: bool = True) -> int:
        """The encoder answered ``requests`` of those handed on; returns the new count.

        Args:
            requests: how many.
            idle: the encoder's execution is over (False: it refused them and runs on).
        """

        def change(fields: list[int], now: int) -> None:
            fields[0] -= requests
            fields[5] += requests
            if idle:
                fields[1] = now

        return self._update(change)[0]

    def reset(self, limit: int | None = None, hold_ns: int | None = None, flood_ns: int | None = None) -> None:
        """Set the count to 0 (a backend loading); delete the files of servers no longer running.

        Args:
            limit: the encoder's ``MAX_IN_FLIGHT`` (None: keep the one written).
            hold_ns: the encoder's ``REFUSAL_HOLD_MS``, ns (None: keep the one written).
            flood_ns: the encoder's ``FLOOD_LATENCY_MS``, ns (None: keep the one written).
        """

        def change(fields: list[int], now: int) -> None:
            fields[0], fields[1] = 0, now
            for k, value in ((2, limit), (3, hold_ns), (4, flood_ns)):
                if value is not None:
                    fields[k] = value

        self._update(change)
        for stale in self.files():
            pid = stale.name.split("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()


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
