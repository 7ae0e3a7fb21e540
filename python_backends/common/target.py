"""How much of the latency budget the tokenizer's admission control may plan to fill: a feedback loop on lateness.

The admission control (``admission.py``) predicts each request's end from the encoder's cost model. On a host
whose cores are shared (the clients, the frontend, the tokenizer), executions run slower than the model says, and
by a factor that changes with the load, so a request predicted to end just inside the budget often ends outside it.
The encoder, which sees every request's real end, therefore steers the share of the budget that admission plans
with (:class:`AdmissionTarget`), by additive increase and multiplicative decrease (AIMD, as TCP's congestion
window, Jacobson 1988): each execution that ran a request late (or shed one) cuts the share by :data:`DECREASE`;
each one that ran every request in time gives back :data:`INCREASE`, up to the whole budget. A load that the encoder
serves in time never runs late, so it keeps the whole budget.

A busy period that starts after an idle spell starts from :data:`WAKE_SHARE`: the cost model was last taught by
another load (an idle server's warmup), and a burst on an idle host finds its cores far busier than the model knows
(TCP restarts from a small window after idle for the same reason: RFC 5681, section 4.1). The tokenizer sees a
burst before the encoder's first execution does, so it applies the same rule itself (:func:`share_of`).

Measured on 2 CPU cores shared with 192 burst clients (docs/benchmarks.md): accepted requests over 200 ms fell from
~6% of a 10 s burst to ~2% (floor 35%), then to ~0.5% (floor 25%, shipped); 16 closed-loop users were not refused.

Pure Python (no torch, no Triton): tests/unit/test_target.py.
"""

from __future__ import annotations

from dataclasses import dataclass

DECREASE = 0.85
"""Factor on the share after an execution that ran a request past its budget or shed one."""
INCREASE = 0.01
"""Share of the budget given back after each execution that ran every request in time."""
FLOOR = 0.25
"""The least share that late executions cut to (a share already below it, from a lower :data:`WAKE_SHARE`, is left
where it is). Measured (docs/benchmarks.md, 8 bursts each, alternated): 0.25 against 0.35, accepted requests over
200 ms 0-30 per burst (mean 12) against 1-76 (mean 36), whole-burst p99 within 200 ms in 6 of 8 against 2 of 8, at
the same ~233 answers/s; closed loops were not refused more (``make bench``: 32 clients 326 req/s, none refused;
16 users: none of ~4,940 refused, 3 runs)."""
WAKE_SHARE = 0.25
"""The share at the start of a busy period. Measured (docs/benchmarks.md): accepted requests over 200 ms in a burst's
first second 0-38 per burst with 0.25, 0-65 with 0.35, 99-146 without; ~7% fewer answers/s than with 0.35."""
IDLE_SPELL_MS = 500.0
"""An encoder that has taken no request for this long is idle (:func:`idle`), ms."""


@dataclass
class AdmissionTarget:
    """The share (:data:`WAKE_SHARE`..1) of each request's latency budget that admission control plans to fill.

    Kept by each encoder instance and published with its load (``loadboard.EncoderLoad.admit_share``).
    """

    share: float = 1.0

    def woke(self) -> None:
        """A busy period begins (the first execution after an idle spell): plan cautiously until it proves itself."""
        self.share = min(self.share, WAKE_SHARE)

    def executed(self, any_late: bool) -> None:
        """Learn from one execution: ``any_late`` when a request in it ended past its budget or was shed."""
        if any_late:
            self.share = max(min(FLOOR, self.share), self.share * DECREASE)
        else:
            self.share = min(1.0, self.share + INCREASE)


def idle(newest_started_ns: int, now_ns: int) -> bool:
    """Has the encoder taken no request for :data:`IDLE_SPELL_MS`? Then its next execution begins a busy period.

    Args:
        newest_started_ns: the newest ``arrival_ns`` stamp it has taken (``loadboard.EncoderLoad``; 0 = none yet).
        now_ns: ``time.monotonic_ns()``.
    """
    return now_ns - newest_started_ns >= IDLE_SPELL_MS * 1e6


def share_of(loads: list, now_ns: int) -> float:
    """The share to plan with now, from the encoder instances' published loads (``loadboard.EncoderLoad``).

    The least share any instance publishes; at most :data:`WAKE_SHARE` when every instance is idle and none has
    taken a request for :data:`IDLE_SPELL_MS` (a burst reaches the tokenizer before the encoder wakes).
    """
    share = min(load.admit_share for load in loads)
    running = any(load.running_since_ns for load in loads)
    if not running and idle(max(load.newest_started_ns for load in loads), now_ns):
        share = min(share, WAKE_SHARE)
    return share
