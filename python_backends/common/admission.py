"""Admission control in the tokenizer: refuse at once a request that the encoder could not finish in time.

The encoder sheds requests that can no longer meet ``LATENCY_BUDGET_MS`` (``shedding.py``), but only when it takes
them from its queue: under a burst that is ~200 ms after they arrived, and the ones it keeps are late already. The
tokenizer sees every request first, so it predicts the encoder's schedule instead (:class:`Plan`) and refuses
(UNAVAILABLE) a request, before any work is spent on it, when the batch it would run in ends past its budget:

    end of its batch = rest of the encoder's running execution (published start and typical duration)
                     + the batches queued before it (admitted here, not yet taken by the encoder)
                     + its batch: the open batch (what has queued since the running execution began) plus itself,
                       costed by the encoder's own model (``cost.CostModel``, published with the load)

The budget runs from the tokenizer's stamp; a request that says when the client sent it (request parameter
``sent_ns``) also has the time it took to get there counted, beyond the few ms the budget leaves for that
(``shedding.late_arrival_ms``): under a burst on shared cores, half the late requests had waited 60-185 ms before
the stamp, in the client's send, the frontend and the tokenizer's queue.

The dynamic batcher gives the encoder everything queued when it frees up (up to ``max_batch_size`` texts), so a
newcomer also delays every request already in the open batch: it is refused as well when its batch would end past
the deadline of any of them. Requests that are big by themselves (``BIG_REQUEST_FACTOR`` x their own execution >=
the share of the budget planned with: bulk chunks) are never refused here; the encoder judges them on their real
wait. Nor is the first request an idle encoder would run with nothing admitted before it: refusing it spares no
one a wait. So refusals happen where queueing, not size, would break the SLA.

The backlog: every admitted request is remembered with its ``arrival_ns`` stamp and forgotten once the encoder
publishes a ``newest_started_ns`` at or past it (Triton's dynamic batcher is FIFO), or after twice its deadline (a
request failed or cancelled on the way never reaches the encoder; this also ends a stale backlog after an encoder
restart).

Costs are typical (margin 1) unless the encoder has just run a request late or this tokenizer has just refused one:
then the encoder's margin applies (:func:`cost_of`). And the batch must end within a share of the budget
(``target.py``), which the encoder lowers when its requests run late and at the start of a busy period.

Measured (docs/benchmarks.md, ``python -m bench.burst``): a 192-client burst on 2 CPU cores gets refusals in ~7 ms
instead of ~220 ms, and accepted p99 171-231 ms over the whole burst with the shipped share feedback (268-356 ms
after its first second with the encoder's shedding alone).

Pure Python (no torch, no Triton): tests/unit/test_admission.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cost import CostModel
from loadboard import EncoderLoad
from shedding import BIG_REQUEST_FACTOR, SEND_ALLOWANCE_MS, overloaded


@dataclass(frozen=True)
class Admitted:
    """A request let through: stamp (ns), texts, longest text (tokens), its deadline and when to forget it (ns)."""

    stamp_ns: int
    rows: int
    width: int
    deadline_ns: int
    forget_ns: int


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: predicted work before its batch and its batch's run (ms), and its budget (ms).

    ``share`` is the part of that budget admission planned with (``target.py``); the message names it when < 1.
    ``delays_earlier``: its own budget would hold, but the batch would end past the deadline of a request already
    in it. ``waited_ms``: how much longer than :data:`shedding.SEND_ALLOWANCE_MS` it took to reach the tokenizer
    since the client sent it (``sent_ns``), ms.
    """

    ahead_ms: float
    batch_ms: float
    budget_ms: float
    share: float = 1.0
    delays_earlier: bool = False
    waited_ms: float = 0.0

    def message(self) -> str:
        """The UNAVAILABLE message the client sees; names the limit, the prediction and the knobs."""
        end_ms = self.waited_ms + self.ahead_ms + self.batch_ms
        prediction = (
            f"the encoder has ~{self.ahead_ms:.0f} ms of work before this request's batch, which would run "
            f"~{self.batch_ms:.0f} ms with it: it would end in ~{end_ms:.0f} ms"
        )
        if self.waited_ms >= 0.5:
            prediction = (
                f"the request reached the tokenizer ~{self.waited_ms + SEND_ALLOWANCE_MS:.0f} ms after it was sent "
                f"(sent_ns), ~{self.waited_ms:.0f} ms more than the {SEND_ALLOWANCE_MS:g} ms the budget leaves for "
                f"that, and {prediction} with that wait"
            )
        if self.delays_earlier:
            return overloaded(f"{prediction}, and make a request already in that batch miss", self.budget_ms)
        limit = ", past"
        if self.share < 1.0:
            limit = (
                f", past {self.share * self.budget_ms:.0f} ms, the {self.share:.0%} (admission's share after late "
                "requests or an idle spell) of"
            )
        return overloaded(f"{prediction}{limit}", self.budget_ms)


NEVER = 2**62
"""Deadline of a request that may never be shed (budget 0), ns."""
LOST_AFTER_MS = 50.0
"""An admitted request that an idle encoder has not taken this long after its stamp never reached it (a direct
caller of the tokenizer, a request cancelled on the way): it is forgotten, not counted as queued work. The
tokenizer's transit to the encoder's queue is ~2-5 ms; an encoder with a batching delay (``max_queue_delay``) may
hold requests longer, which only makes the prediction short, never a refusal."""


@dataclass
class Plan:
    """The encoder's predicted schedule for one tokenizer execute: what runs before the last, still open batch.

    Attributes:
        now_ns: when the prediction was made (monotonic ns).
        ahead_ms: predicted time until the open batch starts (the running execution's rest and the full batches
            queued before it, spread over the encoder instances).
        rows, width: the open batch so far: texts, longest text (tokens).
        deadlines_ns: deadlines of the open batch's requests that it can still meet.
        max_rows: texts per execution (the encoder's ``max_batch_size``).
        cost: the encoder's execution-time model.
        spread: tokenizer instances / encoder instances: batches queued ahead take ``spread`` x their run time
            (other tokenizer instances queue as much again; several encoder instances run batches side by side).
    """

    now_ns: int
    ahead_ms: float
    rows: int
    width: int
    deadlines_ns: list[int]
    max_rows: int
    cost: CostModel
    spread: float = 1.0

    def batch_ms_of(self, rows: int, width: int) -> float:
        """Predicted run time of one execution of ``rows`` texts padded to ``width`` tokens, ms (0 for none)."""
        return self.cost.estimate_ms(rows, width) if rows else 0.0

    def judge(
        self, rows: int, width: int, budget_ms: float, share: float = 1.0, *, waited_ms: float = 0.0
    ) -> Refusal | None:
        """Refuse a request of ``rows`` texts (longest ``width`` tokens) arriving now with ``budget_ms``?

        It joins the open batch if the texts fit, else opens the next one. Refused when the budget is on (> 0), the
        request is not big by itself (``BIG_REQUEST_FACTOR`` x its own run < its target), and the batch it joins
        would end past its target (``share`` x budget, less ``waited_ms``: how late it reached the tokenizer;
        :class:`target.AdmissionTarget`) or the deadline of a request already in that batch (which it would delay).
        "Big" is measured against the same target the plan uses: against the whole budget, a chunk of 64 short texts
        (~40 ms on 2 CPU cores) was refused by the 25% share of an idle server with nothing queued, for its size alone
        (a new user's bulk call, 2026-11-30).
        """
        own = self.cost.own_ms(rows, width)
        if budget_ms <= 0 or BIG_REQUEST_FACTOR * own >= share * budget_ms:
            return None
        if self.ahead_ms <= 0 and not self.rows:
            # An idle encoder and nothing admitted before: no wait to spare anyone, and running is the only way a
            # wrong cost model learns. (A model calibrated on contended cores, two servers loading at once,
            # predicted ~820 ms for one short text and refused every request of the idle server, for good.)
            return None
        ahead, joined, deadlines = self.ahead_ms, (self.rows, self.width), self.deadlines_ns
        if self.rows + rows > self.max_rows:
            ahead, joined, deadlines = ahead + self.spread * self.batch_ms_of(self.rows, self.width), (0, 0), []
        batch_ms = self.batch_ms_of(joined[0] + rows, max(joined[1], width))
        end_ns = self.now_ns + int(1e6 * (ahead + batch_ms))
        limit_ns = self.now_ns + int(1e6 * (share * budget_ms - waited_ms))
        if end_ns <= min([limit_ns, *deadlines]):
            return None
        return Refusal(ahead, batch_ms, budget_ms, share, delays_earlier=end_ns <= limit_ns, waited_ms=waited_ms)

    def close(self) -> None:
        """Close the open batch: what comes next goes into a new one after it."""
        self.ahead_ms += self.spread * self.batch_ms_of(self.rows, self.width)
        self.rows, self.width, self.deadlines_ns = 0, 0, []

    def add(self, rows: int, width: int, deadline_ns: int) -> None:
        """Put an admitted request into the open batch (or the next one when it does not fit)."""
        if self.rows + rows > self.max_rows:
            self.close()
        self.rows, self.width = self.rows + rows, max(self.width, width)
        self.deadlines_ns.append(deadline_ns)


class Backlog:
    """Requests admitted by this tokenizer instance and not yet taken by the encoder, in arrival order.

    Args:
        share: how many tokenizer instances feed the encoder; each sees only its own admissions, so the queued
            work is scaled by this (an approximation that assumes an even split).
    """

    def __init__(self, share: int = 1) -> None:
        self.share = max(1, share)
        self._queue: deque[Admitted] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def plan(self, loads: list[EncoderLoad], cost: CostModel, now_ns: int, transit_ms: float = 0.0) -> Plan:
        """Forget what the encoder has taken or what expired, and predict its schedule (see :class:`Plan`).

        Taken: stamp <= any instance's ``newest_started_ns``; lost: older than :data:`LOST_AFTER_MS` while every
        instance is idle. The rest runs after the soonest-free instance's
        running execution, in FIFO batches of ``max_rows`` texts padded to their longest text. Requests of the
        open batch whose deadline falls before even its present end are left out of its deadlines: the encoder
        will shed them whatever comes after. A request judged now reaches the encoder's queue ``transit_ms``
        later (the rest of the tokenizer's execute, the ensemble's hand-over): if the open batch starts before
        that, it is closed, since the new requests will miss it and wait for the next one.
        """
        newest = max((load.newest_started_ns for load in loads), default=0)
        lost_ns = now_ns - int(LOST_AFTER_MS * 1e6) if loads and all(not load.running_since_ns for load in loads) else 0
        self._queue = deque(a for a in self._queue if a.stamp_ns > max(newest, lost_ns) and a.forget_ns > now_ns)
        running = min((self._running_left_ms(load, cost, now_ns) for load in loads), default=0.0)
        max_rows = max(1, max((load.max_rows for load in loads), default=1))
        plan = Plan(now_ns, running, 0, 0, [], max_rows, cost, spread=self.share / max(1, len(loads)))
        for entry in self._queue:
            plan.add(entry.rows, entry.width, entry.deadline_ns)
        end_ns = now_ns + int(1e6 * (plan.ahead_ms + plan.batch_ms_of(plan.rows, plan.width)))
        plan.deadlines_ns = [d for d in plan.deadlines_ns if d >= end_ns]
        if plan.rows and plan.ahead_ms < transit_ms:
            plan.close()
        return plan

    @staticmethod
    def _running_left_ms(load: EncoderLoad, cost: CostModel, now_ns: int) -> float:
        """What is left of an instance's running execution, ms, with ``cost``'s margin (0 when idle).

        One that has outlasted its typical duration is given ``margin - 1`` times what it has run so far.
        """
        if not load.running_since_ns:
            return 0.0
        elapsed_ms = (now_ns - load.running_since_ns) / 1e6
        return max(0.0, cost.margin * max(load.running_ms, elapsed_ms) - elapsed_ms)

    def admit(self, plan: Plan, stamp_ns: int, rows: int, width: int, budget_ms: float) -> None:
        """Remember an admitted request (and add it to ``plan``) until the encoder takes it or it expires.

        Its deadline is ``budget_ms`` after ``stamp_ns`` (never when 0), or ``BIG_REQUEST_FACTOR`` x its own run when
        longer, as in the encoder's shedding; it is forgotten after twice that (at least 2 s). A late arrival by
        ``sent_ns`` is left out: it decided this request's own admission, but later requests are not refused to
        protect it (one client whose clock runs behind the server's had 8 others refused 1.2-1.8% of their
        requests, at p99 ~70 ms: a new user's trial).
        """
        own = plan.cost.own_ms(rows, width)
        deadline_ms = max(budget_ms, BIG_REQUEST_FACTOR * own) if budget_ms > 0 else 0.0
        deadline_ns = stamp_ns + int(1e6 * deadline_ms) if deadline_ms else NEVER
        self._queue.append(Admitted(stamp_ns, rows, width, deadline_ns, stamp_ns + int(2e6 * max(deadline_ms, 1e3))))
        plan.add(rows, width, deadline_ns)


OVERLOAD_MEMORY_S = 1.0
"""How long after a request ran late (or was shed) the admission control stays cautious, seconds."""


def cost_of(loads: list[EncoderLoad], now_ns: int, refused_ns: int = 0) -> CostModel:
    """The encoder's execution-time model as its latest publication gives it, with the margin it calls for now.

    Cautious (the encoder's ``margin``, sized to the slow tail of executions) when some instance had a request
    finish late or shed, or this tokenizer refused one (at ``refused_ns``), within :data:`OVERLOAD_MEMORY_S`, or
    when an instance's running execution has already outlasted its typical duration (the cores are slower than the
    model right now); otherwise plain (margin 1: the typical execution), so
    that a load the encoder serves in time is not refused on a pessimistic guess. This is the idea of CoDel
    (Nichols and Jacobson, 2012): act on a standing queue, not on a passing one. Measured on 2 CPU cores: with the
    margin always on, 16 closed-loop users at p99 ~150 ms were refused 0.3-3.7% of their requests; without it ever,
    a 192-client burst's accepted p99 rose from ~190 to 206-218 ms.
    """
    latest = max(loads, key=lambda load: load.updated_ns)
    marks = [load.late_ns for load in loads] + [refused_ns]
    overrun = any(load.running_since_ns and now_ns - load.running_since_ns > load.running_ms * 1e6 for load in loads)
    cautious = overrun or any(0 < now_ns - mark < OVERLOAD_MEMORY_S * 1e9 for mark in marks if mark)
    margin = latest.margin if cautious else 1.0
    return CostModel(ms_per_token=latest.ms_per_token, fixed_ms=latest.fixed_ms, margin=margin)
