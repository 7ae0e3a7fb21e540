"""Admission as each backend calls it: the tokenizer admits, queues or refuses; the encoder begins and ends executions.

The backends call these two classes and nothing else of admission. Underneath, :mod:`overload` holds the policy (the
door, the flood rule, the bulk lane, the wait rule, held refusals, the in-flight file both stubs share) and
:mod:`capacity` the service curve and the knobs derived from it; docs/overload.md describes the whole.

Per tokenizer execution: :meth:`TokenizerAdmission.sort` (door or lane; refuse past the door) -> the backend
tokenises -> :meth:`TokenizerAdmission.hand_on` (queue the bulk requests, count the rest in flight) -> the backend
sends its answers. Per encoder execution: :meth:`EncoderAdmission.begin` (torch threads for it) ->
:meth:`EncoderAdmission.ticket` per request -> :meth:`EncoderAdmission.refuse_late` (the wait rule) -> the backend
runs the batch -> :meth:`EncoderAdmission.served` (count out of flight, time each request in the service) -> the
backend sends its answers -> :meth:`EncoderAdmission.end` (time the execution into the curve).

Pure Python, no torch, no Triton: a response is a callable the backend makes (:data:`Answer`), and so is its counter
of refusals. tests/unit/test_admission.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triton_embed_protocol import BUDGET
from triton_embed_protocol.capacity import AdmissionConfig, Knobs, Limits, ServiceCurve
from triton_embed_protocol.metric_lifetime import keep
from triton_embed_protocol.overload import (
    BudgetError,
    BulkLane,
    CoreShare,
    Door,
    InFlight,
    RefusalHold,
    admit,
    capacity_share,
    is_bulk,
    request_budget_ms,
    shed,
)

Answer = Callable[[], None]
"""Sends one prepared response of the backend's (a result or an UNAVAILABLE refusal) as its request's final one."""

Refusal = Callable[[int, str], Answer]
"""``refusal(i, message)``: the backend's UNAVAILABLE answer to request ``i`` of the execution, with ``message``."""

PUBLISH_S = 5.0
"""The service curve's gauges are set at most this often, s (the admission knobs' whenever they change)."""

METRIC = "triton_embed_shed_requests_total"
"""Counter of the requests admission refused (:class:`RefusalCounter`), labelled ``model`` (the step that refused)."""
METRIC_HELP = (
    "Requests answered UNAVAILABLE as overloaded: at the tokenizer (MAX_IN_FLIGHT or BULK_QUEUE reached) or at the "
    "encoder (waited longer than its latency budget)"
)


class RefusalCounter:
    """The one counter of refused requests, :data:`METRIC` ``{model=<step>}``, as either backend keeps it.

    Call it with the number of requests refused; pass it as the ``count_refused`` of :class:`TokenizerAdmission` or
    :class:`EncoderAdmission`. Its family and series outlive the instance (``metric_lifetime.keep``), so that a reload
    does not delete the new instance's series.
    """

    def __init__(self, metric_family: Any, step: str) -> None:
        """Make the series of ``step`` (a tokenizer or encoder model's name).

        Args:
            metric_family: the Python backend's ``pb_utils.MetricFamily`` class (this module imports no Triton).
            step: the model the refusals are counted for.
        """
        self._family = metric_family(name=METRIC, description=METRIC_HELP, kind=metric_family.COUNTER)
        self._series = self._family.Metric(labels={"model": step})

    def __call__(self, requests: int) -> None:
        """Count ``requests`` more refused requests."""
        self._series.increment(requests)

    def close(self) -> None:
        """Keep the family and the series alive for good (a Triton 2.51 workaround: ``metric_lifetime.py``)."""
        keep(self._series, self._family)


@dataclass
class Sorted:
    """One tokenizer execution's requests as the door sorted them, by index in the execution."""

    arrived_ns: int
    """when the execution began (``time.monotonic_ns()``); refusals are answered ``REFUSAL_HOLD_MS`` after it"""
    bulk: set[int] = field(default_factory=set)
    """the bulk requests: :meth:`TokenizerAdmission.hand_on` queues them in the lane"""
    refused: set[int] = field(default_factory=set)
    """refused at the door; their refusals are held, the backend answers nothing else for them"""
    errors: dict[int, str] = field(default_factory=dict)
    """the INVALID_ARG message of each request whose request parameter ``latency_budget_ms`` is bad"""
    bulk_queue: int = 0
    """the encoder's ``BULK_QUEUE``, texts, as read for this execution"""
    refusal_hold_ns: int = 0
    """the encoder's ``REFUSAL_HOLD_MS``, ns, as read for this execution"""


class TokenizerAdmission:
    """The tokenizer's side of admission: the door, the bulk lane and the count of texts handed on.

    The door's limits are the encoder's (they belong to its hardware): the encoder writes them to the in-flight file
    the two share (:class:`overload.InFlight`) and this reads them there each execution. One per tokenizer instance.
    """

    def __init__(self, model_directory: str | Path, model: str, count_refused: Callable[[int], None]) -> None:
        """Admission for the ensemble ``model`` served from the repository holding ``model_directory``.

        ``count_refused(n)``: the backend's counter of refused requests, called at most once per execution.
        """
        self.in_flight = InFlight(model_directory, model)
        self.in_flight.reset()
        self._door = Door()
        self._refusals = RefusalHold()
        self._lane = BulkLane(self.in_flight)
        self._count_refused = count_refused

    def sort(self, parameters: list[dict[str, Any]], texts: list[int], arrived_ns: int, refusal: Refusal) -> Sorted:
        """Sort an execution's requests into the door and the bulk lane; refuse those past the door.

        Args:
            parameters: per request, its parameters (``triton_embed_protocol.request_parameters``).
            texts: per request, its texts.
            arrived_ns: when the execution began (``time.monotonic_ns()``).
            refusal: makes the UNAVAILABLE answer of a refused request; it is sent ``REFUSAL_HOLD_MS`` after
                ``arrived_ns`` (:class:`overload.RefusalHold`).

        Returns:
            the sorting; requests in neither ``bulk``, ``refused`` nor ``errors`` passed the door.
        """
        state = self.in_flight.door()  # the counts, and the encoder's knobs
        result = Sorted(arrived_ns, bulk_queue=state.bulk_queue, refusal_hold_ns=state.refusal_hold_ns)
        interactive: list[int] = []
        for i, request_parameters in enumerate(parameters):
            try:
                request_budget_ms(request_parameters, math.inf)
            except BudgetError as exc:
                result.errors[i] = str(exc)
                continue
            if is_bulk(request_parameters, texts[i], state.bulk_in_flight, state.bulk_texts):
                result.bulk.add(i)
            else:
                interactive.append(i)
        limit = self._door.limit(arrived_ns, state, self._refusals.pending())
        if not limit:
            return result
        lane_texts = state.bulk_texts if state.bulk_in_flight else 0  # the message offers the lane where there is one
        share = capacity_share(self.in_flight.others())  # the other models of this server share the machine
        refused = admit(
            state.interactive,
            limit,
            [texts[i] for i in interactive],
            max_in_flight=state.max_in_flight,
            flood_ms=state.flood_ns / 1e6,
            bulk_texts=lane_texts,
            share=share,
        )
        for k, message in refused.items():
            i = interactive[k]
            self._refusals.hold(arrived_ns + state.refusal_hold_ns, refusal(i, message), texts[i])
            result.refused.add(i)
        if refused:
            self._count_refused(len(refused))  # once per execution: each call is a message to the server
        return result

    def hand_on(self, texts: int, bulk: dict[int, tuple[int, Answer]], sorted_: Sorted, refusal: Refusal) -> None:
        """Queue the execution's tokenised bulk requests; count the ``texts`` about to be answered in flight.

        Call it before sending the answers: the encoder's count-down must not come first.

        Args:
            texts: interactive texts whose tokens the backend sends next (to the encoder's queue).
            bulk: per bulk request (``sorted_.bulk``), its texts and the call that sends its tokens when the lane
                hands it on (:class:`overload.BulkLane`).
            sorted_: what :meth:`sort` returned for this execution.
            refusal: makes the UNAVAILABLE answer of a bulk request refused because the lane is full
                (``BULK_QUEUE``), held as the door's refusals are.
        """
        full = 0
        for i, (n, later) in bulk.items():
            if message := self._lane.offer(n, later, sorted_.bulk_queue):
                self._refusals.hold(sorted_.arrived_ns + sorted_.refusal_hold_ns, refusal(i, message), 0)
                full += 1
        if full:
            self._count_refused(full)
        if texts:
            self.in_flight.add(texts)

    def close(self) -> None:
        """Hand on every bulk request still waiting and answer every refusal still held, at once."""
        self._lane.close()
        self._refusals.close()


@dataclass(frozen=True)
class HandOff:
    """What the tokenizer hands the encoder with a request's tokens (its tensors ``queued_ns`` and ``bulk``)."""

    stamp_ns: int
    """``time.monotonic_ns()`` as the tokenizer handed the request on to the encoder's queue"""
    texts: int
    """the request's texts, counted in flight by the tokenizer"""
    bulk: bool
    """the lane the tokenizer's admission chose (:meth:`TokenizerAdmission.sort`): True the bulk lane, False the door"""


@dataclass
class Ticket:
    """One request of an encoder execution as admission sees it (:meth:`EncoderAdmission.ticket`)."""

    stamp: int | None
    """the tokenizer's ``queued_ns`` (None: a direct caller, never counted in flight or refused)"""
    waited_ms: float | None
    """ms from ``stamp`` to the start of this execution"""
    interactive: int
    """the interactive texts it counts in flight"""
    bulk: int
    """the bulk texts it counts in flight"""
    budget_ms: float = 0.0
    """its latency budget, ms (0 = never refused)"""
    own_budget: bool = False
    """the budget is its request parameter ``latency_budget_ms``"""
    error: str | None = None
    """its INVALID_ARG message (a bad budget here; the backend adds its own reading errors): not run"""


class EncoderAdmission:
    """The encoder's side of admission: its knobs, the wait rule, its count out of flight and its share of the cores.

    It derives the door and the bulk lane from the service curve (:class:`capacity.Knobs`), writes them where the
    tokenizer reads them, refuses requests that waited past their budget, counts each execution's texts out of flight
    and times it into the curve. One per encoder instance.
    """

    def __init__(  # noqa: PLR0913 - what the backend measured and the two callbacks into its metrics
        self,
        model_directory: str | Path,
        model: str,
        config: AdmissionConfig,
        curve: ServiceCurve,
        *,
        threads: int | None,
        publish: Callable[[Limits, ServiceCurve], None],
        count_refused: Callable[[int], None],
    ) -> None:
        """Derive the knobs from ``curve`` (measured at load) and write them for the tokenizer.

        Args:
            model_directory: the encoder's folder in the model repository.
            model: its ensemble.
            config: its knobs as its config sets them (:meth:`capacity.AdmissionConfig.read`).
            curve: its service curve.
            threads: torch threads to share among the busy models of this server (a CPU instance); None: a GPU's,
                not shared.
            publish: sets the backend's gauges of the knobs in force and the curve.
            count_refused: the backend's counter of requests refused by the wait rule.
        """
        self.config = config
        self.knobs = Knobs(config, curve)
        self.limits = self.knobs.limits()
        self._publish = publish
        self._count_refused = count_refused
        publish(self.limits, curve)
        self._published = time.monotonic()
        self._refusals = RefusalHold()
        self._cores = CoreShare(threads) if threads else None
        self._owed: list[int] | None = None
        self.in_flight = InFlight(model_directory, model)
        self.in_flight.reset(  # the tokenizer's door and bulk lane read them
            self.limits.max_in_flight,
            config.refusal_hold_ns,
            int(self.limits.flood_latency_ms * 1e6),
            (self.limits.bulk_in_flight, config.bulk_queue, self.limits.bulk_texts),
        )

    def begin(self, requests: int) -> int | None:
        """An execution of ``requests`` requests begins: the encoder is busy.

        Returns:
            torch threads for it on a CPU: this model's part of the cores among its server's busy models
            (:class:`overload.CoreShare`); None on a GPU, or when another model's file cannot be read.
        """
        self.knobs.started(self.in_flight.started())
        self._owed = [requests, 0]  # until the tickets are read (counting out too many only reads low)
        if self._cores is None:
            return None
        try:
            others = self.in_flight.others()
        except OSError:
            return None
        return self._cores.threads_now(others, time.monotonic_ns())

    def ticket(self, parameters: dict[str, Any], handed: HandOff | None, now_ns: int) -> Ticket:
        """Read one request of the execution that began at ``now_ns``.

        Args:
            parameters: its parameters (``triton_embed_protocol.request_parameters``).
            handed: the tokenizer's hand-off: when, how many texts, which lane (None: a direct caller, never counted
                in flight or refused).
            now_ns: ``time.monotonic_ns()`` at the start of the execution.

        Returns:
            its ticket, its texts owed out of flight in the lane the tokenizer chose; a bad ``latency_budget_ms`` is
            its ``error``.
        """
        if handed is None:
            ticket = Ticket(None, None, 0, 0, own_budget=BUDGET in parameters)
        else:
            lanes = (0, handed.texts) if handed.bulk else (handed.texts, 0)
            ticket = Ticket(handed.stamp_ns, (now_ns - handed.stamp_ns) / 1e6, *lanes, own_budget=BUDGET in parameters)
        try:
            ticket.budget_ms = request_budget_ms(parameters, self.config.latency_budget_ms)
        except BudgetError as exc:
            ticket.error = str(exc)
        return ticket

    def refuse_late(self, tickets: list[Ticket], refusal: Refusal) -> set[int]:
        """The wait rule: refuse each request without an error that waited past its budget (``overload.shed``).

        Counts every ticket's texts as owed out of flight, and the refused ones out at once (their clients may send
        again the moment the refusal comes); each refusal is answered ``REFUSAL_HOLD_MS`` after its stamp.

        Args:
            tickets: the execution's tickets, in order (the backend has set ``error`` where it cannot read one).
            refusal: makes the UNAVAILABLE answer of ticket ``i``.

        Returns:
            the indices of the refused tickets; run the others without an error.
        """
        self._owed = [sum(t.interactive for t in tickets), sum(t.bulk for t in tickets)]  # direct callers: 0
        live = [i for i, t in enumerate(tickets) if t.error is None]
        refused = shed(
            [tickets[i].waited_ms for i in live],
            [tickets[i].budget_ms for i in live],
            [tickets[i].own_budget for i in live],
        )
        if not refused:
            return set()
        gone = [sum(tickets[live[k]].interactive for k in refused), sum(tickets[live[k]].bulk for k in refused)]
        self.in_flight.answered(*gone, idle=False)  # before a refusal falls due: its client may send again at once
        self._owed = [self._owed[0] - gone[0], self._owed[1] - gone[1]]
        for k, message in refused.items():
            ticket = tickets[live[k]]
            self._refusals.hold((ticket.stamp or 0) + self.config.refusal_hold_ns, refusal(live[k], message))
        self._count_refused(len(refused))
        return {live[k] for k in refused}

    def served(self, tickets: list[Ticket], done_ns: int) -> None:
        """The execution ran ``tickets``: count its texts out of flight, time each interactive one in the service.

        Call it before sending the answers: a client may send again the moment its answer comes.
        """
        self._count_out()
        for ticket in tickets:
            if ticket.interactive and ticket.stamp is not None:  # an admitted request: its time steers the door
                self.knobs.answered((done_ns - ticket.stamp) / 1e6, done_ns / 1e9)

    def end(self, rows: int, seconds: float) -> None:
        """The execution is over (answered, or failed): count out what it still owes, time it into the curve.

        Args:
            rows: the rows it ran (0: none).
            seconds: the whole execution, s.
        """
        self._count_out()
        self.knobs.curve.observe(rows, seconds)

    def _count_out(self) -> None:
        """Count this execution's texts out of flight and mark the encoder idle, once, with the knobs now in force.

        Also after an execution of direct callers only: an encoder never marked idle keeps strays counted for good.
        The texts are counted out even when deriving the knobs fails (the knobs then stay as they were).
        """
        if self._owed is None:
            return
        owed, self._owed = self._owed, None
        try:
            limits = self.knobs.limits()  # the curve and the served p99 as of the last execution
            now = time.monotonic()
            if limits.knobs() != self.limits.knobs() or now - self._published > PUBLISH_S:
                self._publish(limits, self.knobs.curve)
                self._published = now
            self.limits = limits
        finally:
            self.in_flight.answered(*owed, limits=(self.limits.max_in_flight, self.limits.bulk_in_flight))

    def close(self) -> None:
        """Answer every refusal still held, at once."""
        self._refusals.close()
