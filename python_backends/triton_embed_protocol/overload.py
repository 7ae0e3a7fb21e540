"""Overload control by work: at most ``MAX_IN_FLIGHT`` interactive texts in the service, bulk work in its own lane.

Policy: an interactive request (at most ``BULK_TEXTS`` texts and a latency budget other than 0) is refused at the
tokenizer when its texts would take the interactive texts between the tokenizer and the encoder's answer past
``MAX_IN_FLIGHT`` (under a flood, past as many as the encoder answers in ``FLOOD_LATENCY_MS``). A bulk request (more
than ``BULK_TEXTS`` texts, or the request parameter ``latency_budget_ms`` 0) waits in the tokenizer, in arrival
order, and is handed on while the bulk texts in flight stay within ``BULK_IN_FLIGHT`` (twice that when no interactive
request has come for a second; one bulk request at least); past ``BULK_QUEUE`` waiting texts it is refused. The
encoder refuses a request with a latency budget (its parameter, else ``LATENCY_BUDGET_MS``: none on CPU as shipped)
that has waited longer than it in its queue. Every refusal is answered ``REFUSAL_HOLD_MS`` after the request arrived,
so a client that retries at once cannot send faster than the server answers.

Nothing is refused on a prediction, and a closed loop of one-text clients up to ``MAX_IN_FLIGHT`` is never refused.
Design and figures: docs/overload.md.

The backends reach it through :mod:`triton_embed_protocol.admission` (the tokenizer's and the encoder's side of
admission); pure Python, no torch, no Triton: tests/unit/test_overload_policy.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import heapq
import itertools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from triton_embed_protocol import BUDGET, budget_problem, refusal, shared_folder


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
    return refusal(
        "budget",
        f"the request waited {waited_ms:.{digits}f} ms in the encoder's queue, over the {budget_ms:g} ms latency "
        f"budget ({source}). Retry with backoff",
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


def is_bulk(parameters: dict, texts: int, bulk_in_flight: int, bulk_texts: int) -> bool:
    """Whether a request goes the bulk lane (:class:`BulkLane`) rather than through the door (:func:`admit`).

    Args:
        parameters: the request's parameters (``triton_embed_protocol.request_parameters``).
        texts: its texts.
        bulk_in_flight: the encoder's ``BULK_IN_FLIGHT``, texts; 0 = no bulk lane, every request is interactive.
        bulk_texts: the encoder's ``BULK_TEXTS``: a request of more texts is bulk.

    Returns:
        True for a request of more than ``bulk_texts`` texts or with ``latency_budget_ms`` 0, when there is a lane.
        A bad ``latency_budget_ms`` reads as interactive (the tokenizer refuses it as INVALID_ARG).
    """
    if not bulk_in_flight:
        return False
    try:
        return texts > bulk_texts or request_budget_ms(parameters, math.inf) == 0
    except BudgetError:
        return False


def full_message(
    in_flight: int,
    texts: int,
    limit: int,
    *,
    max_in_flight: int | None = None,
    flood_ms: float = 0.0,
    bulk_texts: int = 0,
    share: float = 1.0,
) -> str:
    """The UNAVAILABLE message of a request refused at the door: the load, the request, the limit and the knobs.

    Args:
        in_flight: interactive texts in flight when it arrived.
        texts: the request's texts.
        limit: the door's limit then, texts.
        max_in_flight: ``MAX_IN_FLIGHT`` (None: ``limit``); a lower ``limit`` is the flood limit (:class:`Door`).
        flood_ms: ``FLOOD_LATENCY_MS``, ms.
        bulk_texts: ``BULK_TEXTS`` (0: no bulk lane, the message offers none).
        share: the model's :func:`capacity_share` (below 1: the limit is that share of the door).
    """
    reason = "door"
    if share < 1:
        reason = "shared"
        why = (
            f"{share:.0%} of this model's door, the other models of this server holding the rest of the "
            "machine's; MAX_IN_FLIGHT in each encoder's config"
        )
    elif max_in_flight is None or limit >= max_in_flight:
        why = "MAX_IN_FLIGHT, the encoder's door now; `triton-embed stats` shows how it was set"
    else:
        reason = "flood"
        why = (
            f"under a flood: the texts the encoder answers in FLOOD_LATENCY_MS, {flood_ms:g} ms, from half "
            f"of MAX_IN_FLIGHT to all of it, {max_in_flight}, in the encoder's config"
        )
    lane = (
        f"; a request of more than {bulk_texts} texts or with the request parameter latency_budget_ms 0 waits in the "
        "bulk lane instead"
        if bulk_texts
        else ""
    )
    noun = "text" if texts == 1 else "texts"
    return refusal(
        reason,
        f"{in_flight} texts are in flight and this request has {texts} {noun}; the limit is {limit} texts "
        f"({why}{lane}). Retry with backoff",
    )


def admit(
    in_flight: int,
    limit: int,
    texts: list[int],
    *,
    max_in_flight: int | None = None,
    flood_ms: float = 0.0,
    bulk_texts: int = 0,
    share: float = 1.0,
) -> dict[int, str]:
    """The interactive requests of one tokenizer execution to refuse at the door, each with its message.

    Requests are taken in order; each is admitted while its texts keep the interactive texts in flight (counting the
    ones admitted before it in this execution) within ``limit``, and always when none are in flight (a request larger
    than the limit runs alone).

    Args:
        in_flight: interactive texts handed on to the encoder and not yet answered by it (:class:`InFlight`).
        limit: the door's limit, texts (:meth:`Door.limit`); 0 = no limit.
        texts: per request, its texts.
        max_in_flight: ``MAX_IN_FLIGHT``, for the message (:func:`full_message`).
        flood_ms: ``FLOOD_LATENCY_MS``, ms, for the message.
        bulk_texts: ``BULK_TEXTS``, for the message (0: no bulk lane).
        share: the model's :func:`capacity_share` beside the other models of its server: the limit is that share of
            ``limit`` (at least one text).

    Returns:
        ``{request index: UNAVAILABLE message}``.
    """
    refused = {}
    if limit and share < 1:
        limit = max(1, int(limit * share))
    for i, n in enumerate(texts):
        if limit and in_flight and in_flight + n > limit:
            refused[i] = full_message(
                in_flight,
                n,
                limit,
                max_in_flight=max_in_flight,
                flood_ms=flood_ms,
                bulk_texts=bulk_texts,
                share=share,
            )
        else:
            in_flight += n
    return refused


def capacity_share(others: list[DoorState]) -> float:
    """The share of its own door a model may fill now, beside the other models of its server.

    Each door is sized for the whole machine (its model's curve, measured alone), and the models of one server share
    the machine: a model may fill what the others leave of theirs (1 minus the sum of their fills, a fill being a
    model's texts in flight, interactive and bulk, over its ``MAX_IN_FLIGHT``), and at least an equal part (1 over
    the models with texts in flight, itself included) however much the others hold. Alone: 1.

    Args:
        others: the other models' views (:meth:`InFlight.others`); a model without a door is not counted.
    """
    fills = [(o.interactive + o.bulk) / o.max_in_flight for o in others if o.max_in_flight and o.interactive + o.bulk]
    return max(1.0 - sum(fills), 1.0 / (1 + len(fills)))


class CoreShare:
    """Torch threads for an encoder's next execution: its part of the cores among the models of its server busy now.

    Encoders of one server that run at once split the cores instead of each taking all of them: two processes whose
    OpenMP threads each want every core take them from each other, spinning (OpenMP's default wait policy: 7-11
    answers/s each at p99 1-1.5 s on 2 cores) or waking up for every parallel region (``OMP_WAIT_POLICY=PASSIVE``:
    about 15% less throughput for a model served alone or beside idle ones). One busy model keeps every core;
    docs/benchmarks.md, "Several models on one CPU". The others are the models served from the same repository by the
    same server (:meth:`InFlight.others`); instances of one model share one count and each takes every core. Once
    none of the others is busy, the last count of busy ones stays for :data:`HOLD_NS`, so that the split does not flip
    in the gaps of a steady load (each flip from every core to a part leaves an OpenMP thread spinning on a core
    another model needs); a count that rises or falls to another non-zero value applies at once. One per encoder
    instance on a CPU.
    """

    HOLD_NS = 1_000_000_000
    """How long a model seen busy counts as busy, ns (1 s)."""

    def __init__(self, threads: int) -> None:
        """Share ``threads`` (``TORCH_NUM_THREADS``, else the encoder's cores), threads >= 1."""
        self.threads = threads
        self._busy = 0
        self._seen_ns = 0

    def threads_now(self, others: list[DoorState], now_ns: int) -> int:
        """Threads for an execution that begins at ``now_ns``.

        Args:
            others: the other models' views (:meth:`InFlight.others`); busy = texts in flight.
            now_ns: ``time.monotonic_ns()``.

        Returns:
            ``threads`` over the busy models, this one included; at least 1.
        """
        busy = sum(1 for o in others if o.interactive + o.bulk)
        if busy or now_ns - self._seen_ns >= self.HOLD_NS:
            self._busy = busy
        if busy:
            self._seen_ns = now_ns
        return max(1, self.threads // (1 + self._busy))


def queue_full_message(waiting: int, texts: int, bulk_queue: int) -> str:
    """The UNAVAILABLE message of a bulk request refused because the bulk lane holds ``bulk_queue`` texts already."""
    return refusal(
        "bulk_queue",
        f"{waiting} bulk texts are waiting and this request has {texts}; the limit is {bulk_queue} texts "
        "(BULK_QUEUE in the encoder's config). Retry with backoff",
    )


class DoorState(NamedTuple):
    """What the tokenizer's door and bulk lane read from :class:`InFlight`.

    The fields of :class:`InFlightRecord` under the same names, the counts healed (:meth:`InFlight.door`), the
    encoder's idle time left out.
    """

    interactive: int
    """interactive texts in flight (0 once the encoder has been idle for :data:`InFlight.IDLE_NS`)"""
    max_in_flight: int
    """the encoder's ``MAX_IN_FLIGHT``, texts (0 = no door)"""
    refusal_hold_ns: int
    """the encoder's ``REFUSAL_HOLD_MS``, ns"""
    flood_ns: int
    """the encoder's ``FLOOD_LATENCY_MS``, ns"""
    answered: int
    """interactive texts the encoder has counted out of flight since the server started"""
    bulk: int = 0
    """bulk texts in flight"""
    interactive_ns: int = 0
    """when the tokenizer last handed an interactive request on (``time.monotonic_ns()``; 0 = never)"""
    bulk_in_flight: int = 0
    """the encoder's ``BULK_IN_FLIGHT``, texts (0 = no bulk lane)"""
    bulk_queue: int = 0
    """the encoder's ``BULK_QUEUE``, texts"""
    bulk_texts: int = 0
    """the encoder's ``BULK_TEXTS``"""


class Door:
    """The door's limit: ``MAX_IN_FLIGHT`` texts, under a flood the texts the encoder answers in ``FLOOD_LATENCY_MS``.

    A flood is more interactive texts in the service and refused (their refusals held) than ``MAX_IN_FLIGHT``: more
    clients than the door lets in. Once one has lasted :data:`WINDOW_NS`, the limit is the encoder's interactive texts
    answered per second over the last :data:`WINDOW_NS` times ``FLOOD_LATENCY_MS``, so that an admitted request spends
    about ``FLOOD_LATENCY_MS`` in the service (Little's law) instead of waiting behind ``MAX_IN_FLIGHT`` others; never
    above ``MAX_IN_FLIGHT`` and never below :data:`FLOOR` of it. A load of up to ``MAX_IN_FLIGHT`` texts at a time (a
    closed loop of that many one-text clients; fresh, after an idle spell or after a flood) is never refused. One per
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
            held: texts of this door's refusals not answered yet (:meth:`RefusalHold.pending`).

        Returns:
            interactive texts that may be in flight; 0 = no limit.
        """
        self._answers.append((now_ns, state.answered))
        while len(self._answers) > 1 and self._answers[1][0] <= now_ns - self.WINDOW_NS:
            self._answers.popleft()
        if not (state.max_in_flight and state.flood_ns) or state.interactive + held <= state.max_in_flight:
            self._flood_since = None
            return state.max_in_flight
        if self._flood_since is None:
            self._flood_since = now_ns
        if now_ns - self._flood_since < self.WINDOW_NS:
            return state.max_in_flight  # the answers counted so far are not all from the flood yet
        since_ns, before = self._answers[0]
        per_ns = (state.answered - before) / max(now_ns - since_ns, 1)
        limit = state.max_in_flight
        return max(math.ceil(limit * self.FLOOR), min(limit, round(per_ns * state.flood_ns)))


class InFlightRecord(ctypes.LittleEndianStructure):
    """The in-flight file of one model (:class:`InFlight`): 11 little-endian int64 fields, 88 bytes."""

    _fields_ = (
        ("interactive", ctypes.c_int64),  # interactive texts in flight
        ("idle_since_ns", ctypes.c_int64),  # when the encoder last went idle (monotonic ns; 0 = executing)
        ("max_in_flight", ctypes.c_int64),  # the encoder's MAX_IN_FLIGHT, texts
        ("refusal_hold_ns", ctypes.c_int64),  # the encoder's REFUSAL_HOLD_MS, ns
        ("flood_ns", ctypes.c_int64),  # the encoder's FLOOD_LATENCY_MS, ns
        ("answered", ctypes.c_int64),  # interactive texts the encoder has counted out since the server started
        ("bulk", ctypes.c_int64),  # bulk texts in flight
        ("interactive_ns", ctypes.c_int64),  # when the tokenizer last handed an interactive request on (monotonic ns)
        ("bulk_in_flight", ctypes.c_int64),  # the encoder's BULK_IN_FLIGHT, texts
        ("bulk_queue", ctypes.c_int64),  # the encoder's BULK_QUEUE, texts
        ("bulk_texts", ctypes.c_int64),  # the encoder's BULK_TEXTS
    )

    @classmethod
    def parse(cls, raw: bytes) -> InFlightRecord:
        """The record in ``raw`` (the file's bytes); all zeros where they are not one record (a new, empty file)."""
        return cls.from_buffer_copy(raw) if len(raw) == ctypes.sizeof(cls) else cls()

    def state(self) -> DoorState:
        """The tokenizer's view of the record: its fields of the same names."""
        return DoorState(*(getattr(self, name) for name in DoorState._fields))


class InFlight:
    """Texts the tokenizer handed on that the encoder has not answered yet, in a file both stubs share.

    The file (``/dev/shm``) is keyed by the server's process id (the stubs' parent), the model repository and the
    ensemble, so every server on a host and every model it serves has its own; a change takes an exclusive ``flock``,
    a read a shared one and writes nothing. It holds (:class:`InFlightRecord`) the interactive and the bulk texts in
    flight, when the encoder last went idle, when the tokenizer last handed an interactive request on,
    the encoder's knobs (``MAX_IN_FLIGHT``, ``REFUSAL_HOLD_MS``, ``FLOOD_LATENCY_MS``, ``BULK_IN_FLIGHT``,
    ``BULK_QUEUE``, ``BULK_TEXTS``: the door's limits belong to the encoder's hardware, so they live in the encoder's
    config and reach the tokenizer here), and the interactive texts the encoder has counted out since the server
    started (:class:`Door` reads their rate). The tokenizer counts in only requests that ask for ``queued_ns`` (the
    ensemble does; a direct caller of the tokenizer that names its outputs does not). The counts heal themselves: they
    never go below 0, either backend sets them to 0 when it loads, and counts left while the encoder has sat idle for
    :data:`IDLE_NS` since the last hand-off (requests that never reached it: a direct call of the tokenizer asking for
    every output, a stub that died) read as 0. Exact with one encoder instance (as shipped); with more, they can only
    read low. The file outlives a reload of either backend (Triton finalizes the old instance after the new one
    loaded); the embedded server deletes its files when it stops (:meth:`remove_files`), and a backend loading deletes
    those of servers no longer running.
    """

    IDLE_NS = 100_000_000
    """An idle encoder takes a waiting request within this, ns (dynamic batcher without delay); 100 ms."""

    SIBLINGS_NS = 1_000_000_000
    """:meth:`others` looks for the files of models loaded or unloaded since at most this often, ns; 1 s. Listing
    ``/dev/shm`` took ~38 of a call's 52 us with two other models, at every execution of both stubs."""

    def __init__(self, model_directory: str | Path, model: str) -> None:
        """Count for this stub's server, the repository holding ``model_directory`` and the ensemble ``model``.

        Each model's tokenizer and encoder (``step_names``) share one file.
        """
        repository = Path(model_directory).resolve().parent
        key = hashlib.sha256(str(repository).encode()).hexdigest()[:12]
        self.path = shared_folder() / f"triton-embed-{os.getppid()}-{key}-{model}.in-flight"
        self._siblings = f"triton-embed-{os.getppid()}-{key}-*.in-flight"
        self._sibling_paths: list[Path] = []
        self._siblings_due_ns = 0

    @classmethod
    def files(cls, server_pid: int | str = "*") -> list[Path]:
        """The files of the server with process id ``server_pid`` (``"*"``: of every server)."""
        return list(shared_folder().glob(f"triton-embed-{server_pid}-*.in-flight"))

    @classmethod
    def remove_files(cls, server_pid: int) -> None:
        """Delete the files of the server with process id ``server_pid``, once it has exited (a clean stop)."""
        for path in cls.files(server_pid):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    @classmethod
    def _healed(cls, record: InFlightRecord, now: int) -> InFlightRecord:
        """``record`` with its counts at 0 where the encoder has sat idle for :data:`IDLE_NS` (never below 0)."""
        if record.idle_since_ns and now - record.idle_since_ns > cls.IDLE_NS:
            record.interactive = record.bulk = 0  # whatever is counted never reached it
        record.interactive, record.bulk = max(0, record.interactive), max(0, record.bulk)
        return record

    def _update(self, change: Callable[[InFlightRecord, int], None]) -> InFlightRecord:
        """Change the record under the file's exclusive lock: ``change(record, time.monotonic_ns())``."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            record = InFlightRecord.parse(os.pread(fd, ctypes.sizeof(InFlightRecord), 0))
            now = time.monotonic_ns()
            change(self._healed(record, now), now)
            self._healed(record, now)
            os.pwrite(fd, bytes(record), 0)
            return record
        finally:
            os.close(fd)  # releases the lock

    @classmethod
    def _read(cls, path: Path) -> DoorState:
        """The record of ``path`` under a shared lock, healed in the view only (nothing written); zeros if absent."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return InFlightRecord().state()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            raw = os.pread(fd, ctypes.sizeof(InFlightRecord), 0)
        finally:
            os.close(fd)
        return cls._healed(InFlightRecord.parse(raw), time.monotonic_ns()).state()

    def door(self) -> DoorState:
        """The tokenizer's view; the counts read 0 when the encoder has been idle for :data:`IDLE_NS`."""
        return self._read(self.path)

    def others(self) -> list[DoorState]:
        """The views of the other models this server serves from the same repository (:func:`capacity_share`).

        A model loaded since the last look (every :data:`SIBLINGS_NS`) counts from the next; one unloaded reads as
        idle (its file gone).
        """
        now = time.monotonic_ns()
        if now >= self._siblings_due_ns:
            self._sibling_paths = [path for path in shared_folder().glob(self._siblings) if path != self.path]
            self._siblings_due_ns = now + self.SIBLINGS_NS
        return [self._read(path) for path in self._sibling_paths]

    def add(self, texts: int, bulk: int = 0) -> int:
        """The tokenizer handed on ``texts`` interactive and ``bulk`` bulk texts; returns the interactive count."""

        def change(record: InFlightRecord, now: int) -> None:
            record.interactive += texts
            record.bulk += bulk
            if texts:
                record.interactive_ns = now
            if record.idle_since_ns:  # an idle encoder has IDLE_NS from now to take them
                record.idle_since_ns = now

        return self._update(change).interactive

    def started(self) -> int:
        """The encoder began an execution: it is not idle. Returns the interactive texts in flight."""

        def change(record: InFlightRecord, now: int) -> None:
            record.idle_since_ns = 0

        return self._update(change).interactive

    def answered(self, texts: int, bulk: int = 0, *, idle: bool = True, limits: tuple[int, int] | None = None) -> int:
        """The encoder answered ``texts`` interactive and ``bulk`` bulk texts; returns the interactive count.

        Args:
            texts: interactive texts.
            bulk: bulk texts.
            idle: the encoder's execution is over (False: it refused them and runs on).
            limits: the encoder's ``MAX_IN_FLIGHT`` and ``BULK_IN_FLIGHT`` now, texts (``capacity.Knobs``);
                None: keep the ones written.
        """

        def change(record: InFlightRecord, now: int) -> None:
            record.interactive -= texts
            record.answered += texts
            record.bulk -= bulk
            if idle:
                record.idle_since_ns = now
            if limits is not None:
                record.max_in_flight, record.bulk_in_flight = limits

        return self._update(change).interactive

    def reset(
        self,
        limit: int | None = None,
        hold_ns: int | None = None,
        flood_ns: int | None = None,
        bulk: tuple[int, int, int] | None = None,
    ) -> None:
        """Set the counts to 0 (a backend loading); delete the files of servers no longer running.

        Args:
            limit: the encoder's ``MAX_IN_FLIGHT``, texts (None: keep the one written).
            hold_ns: the encoder's ``REFUSAL_HOLD_MS``, ns (None: keep the one written).
            flood_ns: the encoder's ``FLOOD_LATENCY_MS``, ns (None: keep the one written).
            bulk: the encoder's ``BULK_IN_FLIGHT``, ``BULK_QUEUE`` and ``BULK_TEXTS`` (None: keep the ones written).
        """

        def change(record: InFlightRecord, now: int) -> None:
            record.interactive, record.idle_since_ns, record.bulk = 0, now, 0
            for name, value in (("max_in_flight", limit), ("refusal_hold_ns", hold_ns), ("flood_ns", flood_ns)):
                if value is not None:
                    setattr(record, name, value)
            if bulk is not None:
                record.bulk_in_flight, record.bulk_queue, record.bulk_texts = bulk

        self._update(change)
        for stale in self.files():
            pid = stale.name.split("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()


class _Worker:
    """A daemon thread running ``_run`` beside a condition it waits on; :meth:`close` wakes it to finish and joins."""

    def __init__(self, name: str) -> None:
        """Start the thread, named ``name``; subclasses set their own state before calling this."""
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Have the thread finish its work at once and wait for it.

        :class:`BulkLane` hands every waiting request on, :class:`RefusalHold` answers every held refusal.
        """
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()


class BulkLane(_Worker):
    """Bulk requests waiting in the tokenizer, handed on in arrival order as the bulk texts in flight allow.

    A bulk request (:func:`is_bulk`) is tokenised when it arrives and its answer to the ensemble held here. The head
    goes on while the bulk texts in flight plus its own stay within ``BULK_IN_FLIGHT``, twice that when no interactive
    request is in flight or has been handed on for :data:`QUIET_NS`, and whenever no bulk text is in flight (one
    request larger than the share runs alone). An interactive request therefore finds at most about one share of bulk
    work ahead of it in the encoder's queue. A thread of its own watches :class:`InFlight` while requests wait (every
    :data:`POLL_S`), so the lane moves as the encoder answers; :meth:`close` hands every waiting request on at once.
    """

    QUIET_NS = 1_000_000_000
    """No interactive request for this long, ns: the bulk lane may fill the whole service (1 s)."""
    POLL_S = 0.002
    """How often the lane reads the in-flight file while requests wait, s: a fraction of a bulk execution (80-160 ms
    for 64 texts on 2 cores, docs/benchmarks.md, "Admission by work")."""

    def __init__(self, in_flight: InFlight) -> None:
        """An empty lane over ``in_flight``'s counts; starts its thread."""
        self._in_flight = in_flight
        self._waiting: deque[tuple[int, Callable[[], None]]] = deque()
        self._texts = 0
        super().__init__("bulk-lane")

    def waiting(self) -> int:
        """Texts waiting in the lane."""
        with self._wake:
            return self._texts

    def offer(self, texts: int, hand_on: Callable[[], None], bulk_queue: int) -> str | None:
        """Queue a tokenised bulk request of ``texts`` texts; ``hand_on()`` answers the ensemble when its turn comes.

        Args:
            texts: its texts.
            hand_on: sends its tokenizer response (the lane counts it in flight just before).
            bulk_queue: the encoder's ``BULK_QUEUE``, texts (0 = no bound).

        Returns:
            None when queued; else the UNAVAILABLE message (the lane already holds ``bulk_queue`` texts).
        """
        with self._wake:
            if bulk_queue and self._texts and self._texts + texts > bulk_queue:
                return queue_full_message(self._texts, texts, bulk_queue)
            self._waiting.append((texts, hand_on))
            self._texts += texts
            self._wake.notify()
        return None

    def share(self, state: DoorState, now_ns: int, others: list[DoorState] | None = None) -> int:
        """Bulk texts that may be in flight now: ``BULK_IN_FLIGHT``, twice that with no interactive request about.

        Times the model's :func:`capacity_share` beside ``others`` (the other models' views).
        """
        quiet = not state.interactive and (not state.interactive_ns or now_ns - state.interactive_ns > self.QUIET_NS)
        return int(state.bulk_in_flight * (2 if quiet else 1) * capacity_share(others or []))

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._closed:
                    self._wake.wait()
                if not self._waiting and self._closed:
                    return
            released = False
            while True:
                with self._wake:
                    if not self._waiting:
                        break
                    texts, hand_on = self._waiting[0]
                    if not self._closed:
                        state = self._in_flight.door()
                        share = self.share(state, time.monotonic_ns(), self._in_flight.others())
                        if state.bulk and state.bulk + texts > share:
                            break
                    self._waiting.popleft()
                    self._texts -= texts
                    self._in_flight.add(0, texts)  # before the answer: the encoder's count-down must not come first
                released = True
                with contextlib.suppress(Exception):  # a client gone away must not stop the others
                    hand_on()
            if not released:
                time.sleep(self.POLL_S)


class RefusalHold(_Worker):
    """Answers refusals at their due time from a thread of its own, so that holding them never blocks an execution.

    Every held refusal is answered: at its time, or at once by :meth:`close`.
    """

    def __init__(self) -> None:
        """Start the thread that answers the refusals as they fall due."""
        self._due: list[tuple[int, int, Callable[[], None], int]] = []
        self._weight = 0
        self._order = itertools.count()
        super().__init__("refusal-hold")

    def hold(self, due_ns: int, answer: Callable[[], None], weight: int = 1) -> None:
        """Call ``answer()`` at ``due_ns`` (``time.monotonic_ns()`` clock), or at once if that has passed.

        ``weight``: what the refusal counts in :meth:`pending` (the door: the request's texts).
        """
        with self._wake:
            heapq.heappush(self._due, (due_ns, next(self._order), answer, weight))
            self._weight += weight
            self._wake.notify()

    def pending(self) -> int:
        """The weight of the refusals held and not yet answered (1 each unless :meth:`hold` was told otherwise)."""
        with self._wake:
            return self._weight

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
                _, _, answer, weight = heapq.heappop(self._due)
                self._weight -= weight
            with contextlib.suppress(Exception):  # a client gone away must not stop the others' answers
                answer()
