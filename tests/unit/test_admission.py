"""Admission control in the tokenizer (python_backends/common/admission.py): who is refused, from the encoder's load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_backends" / "common"))

from admission import LOST_AFTER_MS, NEVER, OVERLOAD_MEMORY_S, Backlog, cost_of  # noqa: E402
from cost import CostModel  # noqa: E402
from loadboard import EncoderLoad  # noqa: E402

COST = CostModel(ms_per_token=0.1, margin=1.0)  # rows x width x 0.1 ms: 1 x 20 tokens = 2 ms, 64 x 16 = 102 ms
NOW = 10**12
MS = 1_000_000


def load(busy_ms: float = 0.0, newest_started_ns: int = 0, max_rows: int = 64) -> EncoderLoad:
    """An encoder instance that began, at NOW, an execution of ``busy_ms`` (0 = idle); the test's costs, 180 ms."""
    since = NOW if busy_ms else 0
    return EncoderLoad(1, NOW, since, newest_started_ns, 0, busy_ms, 0.0, COST.ms_per_token, 1.0, 180.0, 1.0, max_rows)


def test_an_idle_encoder_admits_a_small_request():
    plan = Backlog().plan([load()], COST, NOW)
    assert plan.judge(1, 20, budget_ms=180) is None


def test_an_idle_encoder_admits_its_first_request_even_when_the_cost_model_says_it_is_too_slow():
    # a cost model taught on contended cores (two servers loading at once): 800 ms for any execution
    slow = CostModel(ms_per_token=0.1, fixed_ms=800.0, margin=1.0)
    backlog = Backlog()
    plan = backlog.plan([load()], slow, NOW)
    assert plan.judge(1, 20, budget_ms=180, share=0.25) is None
    backlog.admit(plan, NOW, rows=1, width=20, budget_ms=180)
    assert plan.judge(1, 20, budget_ms=180, share=0.25) is not None  # a second one would wait behind it
    assert backlog.plan([load(busy_ms=5)], slow, NOW).judge(1, 20, 180) is not None  # so would one behind a run


def test_a_request_is_refused_when_the_running_execution_leaves_no_time_for_it():
    assert Backlog().plan([load(busy_ms=170)], COST, NOW).judge(1, 20, 180) is None  # 170 + 2 <= 180
    refusal = Backlog().plan([load(busy_ms=179)], COST, NOW).judge(1, 20, 180)  # 179 + 2 > 180
    assert refusal is not None
    message = refusal.message()
    assert "~179 ms of work before this request's batch" in message and "~2 ms" in message
    assert "180 ms latency budget (LATENCY_BUDGET_MS" in message and "latency_budget_ms" in message


def test_a_newcomer_is_refused_when_it_would_make_an_earlier_request_late():
    backlog = Backlog()
    plan = backlog.plan([load(busy_ms=50)], COST, NOW - 100 * MS)  # admitted 100 ms ago: deadline 80 ms from now
    backlog.admit(plan, NOW - 100 * MS, rows=1, width=20, budget_ms=180)
    plan = backlog.plan([load(busy_ms=70)], COST, NOW)  # its batch: 70 ms of the running one + 2 ms = 72 ms
    # 4 texts x 40 tokens = 16 ms: its own deadline (180 ms) holds, but the batch would end at 70 + 20 = 90 ms.
    refusal = plan.judge(4, 40, 180)
    assert refusal is not None and refusal.batch_ms == pytest.approx(20.0) and refusal.delays_earlier
    assert "end in ~90 ms, and make a request already in that batch miss the 180 ms latency budget" in (
        refusal.message()
    )
    assert plan.judge(1, 20, 180) is None  # 70 + 4 ms: both fit
    assert plan.judge(4, 40, 0) is None  # budget 0: never refused


def test_an_earlier_request_already_doomed_does_not_block_newcomers():
    backlog = Backlog()
    plan = backlog.plan([load()], COST, NOW - 175 * MS)
    backlog.admit(plan, NOW - 175 * MS, rows=1, width=20, budget_ms=180)  # 5 ms left, its batch needs 10 + 2
    assert backlog.plan([load(busy_ms=10)], COST, NOW).judge(4, 40, 180) is None


def test_big_requests_are_never_refused_here():
    # 64 x 100 tokens = 640 ms alone: 4 x that is over any budget, so only the encoder judges it, on its real wait.
    assert Backlog().plan([load(busy_ms=5000)], COST, NOW).judge(64, 100, 180) is None


def test_a_small_budget_is_judged_not_taken_for_a_big_request():
    # Busy cores: 30 ms per execution whatever it holds; one text of 20 tokens is 2 ms of its own. With a 50 ms
    # budget it is judged (4 x 2 < 50) and refused behind 100 ms of work, not waved through as big.
    busy = CostModel(ms_per_token=0.1, fixed_ms=30.0, margin=1.0)
    refusal = Backlog().plan([load(busy_ms=100)], busy, NOW).judge(1, 20, budget_ms=50)
    assert refusal is not None and refusal.budget_ms == 50


def test_queued_work_runs_in_batches_of_max_rows_before_a_newcomer():
    backlog = Backlog()
    plan = backlog.plan([load(max_rows=4)], COST, NOW)
    for k in range(5):  # 5 single texts of 20 tokens: one full batch of 4 (8 ms), an open batch of 1 (2 ms)
        backlog.admit(plan, NOW + k, rows=1, width=20, budget_ms=180)
    plan = backlog.plan([load(busy_ms=100, max_rows=4)], COST, NOW + 10)
    assert (plan.ahead_ms, plan.rows) == (pytest.approx(108.0), 1)
    # 3 more texts of 40 tokens fill the open batch: 4 x 40 = 16 ms -> 124 ms; a 4th would open the next batch.
    assert plan.judge(3, 40, 125) is None
    refusal = plan.judge(4, 40, 125)
    assert refusal is not None and refusal.ahead_ms == pytest.approx(110.0) and refusal.batch_ms == pytest.approx(16.0)


def test_requests_taken_by_the_encoder_or_expired_are_forgotten():
    backlog = Backlog()
    plan = backlog.plan([load()], COST, NOW)
    for k in range(3):
        backlog.admit(plan, NOW + k, rows=1, width=20, budget_ms=180)
    backlog.plan([load(newest_started_ns=NOW + 1)], COST, NOW + 5)
    assert len(backlog) == 1  # the first two were taken
    backlog.plan([load()], COST, NOW + 2 * 1000 * MS + 10)  # never taken (failed on the way): gone after 2 s
    assert len(backlog) == 0


def test_a_request_that_may_never_be_shed_has_no_deadline():
    backlog = Backlog()
    plan = backlog.plan([load()], COST, NOW)
    backlog.admit(plan, NOW, rows=1, width=20, budget_ms=0)
    assert plan.deadlines_ns == [NEVER]


def test_the_open_batch_closes_when_it_starts_before_a_newcomer_could_reach_it():
    backlog = Backlog()
    plan = backlog.plan([load()], COST, NOW)
    backlog.admit(plan, NOW, rows=10, width=20, budget_ms=180)  # 20 ms, not taken yet
    plan = backlog.plan([load(busy_ms=1)], COST, NOW + 1, transit_ms=3.0)  # it starts in 1 ms: new ones miss it
    assert (plan.ahead_ms, plan.rows) == (pytest.approx(21.0), 0)
    plan = backlog.plan([load(busy_ms=5)], COST, NOW + 1, transit_ms=3.0)
    assert (plan.ahead_ms, plan.rows) == (pytest.approx(5.0), 10)


def test_queued_work_is_scaled_by_tokenizer_and_encoder_instances():
    def ahead(share: int, encoders: int) -> float:
        backlog = Backlog(share=share)
        plan = backlog.plan([load(max_rows=1)] * encoders, COST, NOW)
        backlog.admit(plan, NOW, rows=1, width=100, budget_ms=180)  # 10 ms
        backlog.admit(plan, NOW + 1, rows=1, width=100, budget_ms=180)  # a second batch: the first is ahead
        return backlog.plan([load(max_rows=1)] * encoders, COST, NOW + 2).ahead_ms

    assert ahead(1, 1) == pytest.approx(10.0)
    assert ahead(2, 1) == pytest.approx(20.0)  # another tokenizer instance queued as much again
    assert ahead(1, 2) == pytest.approx(5.0)  # two encoder instances share the queue


def test_the_encoders_margin_applies_only_right_after_a_late_request_or_a_refusal():
    def margin(late_ago_s: float | None, refused_ago_s: float | None = None) -> float:
        late = NOW - int(late_ago_s * 1e9) if late_ago_s is not None else 0
        refused = NOW - int(refused_ago_s * 1e9) if refused_ago_s is not None else 0
        published = EncoderLoad(1, NOW, 0, 0, late, 0.0, 2.0, 0.1, 1.4, 180.0, 1.0, 64)
        cost = cost_of([published], NOW, refused_ns=refused)
        assert (cost.fixed_ms, cost.ms_per_token) == (2.0, 0.1)
        return cost.margin

    assert margin(None) == 1.0  # never late: plan with typical times
    assert margin(0.5) == 1.4  # a request ran late 0.5 s ago: the tail matters now
    assert margin(OVERLOAD_MEMORY_S + 0.5) == 1.0
    assert margin(None, refused_ago_s=0.2) == 1.4


def test_a_running_execution_past_its_typical_time_makes_the_plan_cautious():
    running = EncoderLoad(1, NOW, NOW - 30 * MS, 0, 0, 20.0, 2.0, 0.1, 1.4, 180.0, 1.0, 64)  # 30 ms of a 20 ms run
    cost = cost_of([running], NOW)
    assert cost.margin == 1.4  # the cores are slower than the model right now
    assert cost_of([EncoderLoad(**{**running.__dict__, "running_ms": 40.0})], NOW).margin == 1.0
    # Its rest is taken as (margin - 1) x what it has run: 0.4 x 30 ms, not 0 ms.
    assert Backlog().plan([running], cost, NOW).ahead_ms == pytest.approx(12.0)


def test_a_request_must_end_within_the_share_of_its_budget():
    plan = Backlog().plan([load(busy_ms=100)], COST, NOW)  # 100 ms + 2 ms for one text of 20 tokens
    assert plan.judge(1, 20, 180, share=0.6) is None  # 102 ms <= 108 ms
    refusal = plan.judge(1, 20, 180, share=0.5)  # 102 ms > 90 ms
    assert refusal is not None and refusal.budget_ms == 180
    assert "it would end in ~102 ms, past 90 ms, the 50% (admission's share" in refusal.message()
    assert "of the 180 ms latency budget" in refusal.message()
    # Big by itself against the share planned with: 4 x 20 ms = 80 ms < 90 ms, so judged (and refused: 100 + 20 ms);
    # 4 x 40 ms = 160 ms >= 90 ms, so never refused here (the encoder judges it on its real wait).
    assert plan.judge(10, 20, 180, share=0.5) is not None
    assert plan.judge(20, 20, 180, share=0.5) is None


def test_a_bulk_callers_concurrent_chunks_are_not_refused_on_an_idle_encoder_at_the_wake_share():
    # A new user's embed() of 200 short texts: 4 chunks of 64 texts x 6 tokens (~38 ms each) at once, share 25%.
    backlog = Backlog()
    plan = backlog.plan([load()], COST, NOW)
    for i in range(4):
        assert plan.judge(64, 6, 180, share=0.25) is None, i
        backlog.admit(plan, NOW + i, 64, 6, 180)
    # A single text behind them is refused: it would wait ~154 ms, past 25% of 180 ms.
    assert plan.judge(1, 6, 180, share=0.25) is not None


def test_requests_an_idle_encoder_never_took_are_forgotten():
    backlog = Backlog()
    plan = backlog.plan([load()], COST, NOW)
    backlog.admit(plan, NOW, rows=64, width=20, budget_ms=180)  # e.g. a direct caller of the tokenizer
    backlog.plan([load(busy_ms=5)], COST, NOW + int(LOST_AFTER_MS * MS) + 1)  # the encoder is busy: still queued
    assert len(backlog) == 1
    backlog.plan([load()], COST, NOW + int(LOST_AFTER_MS * MS) - 1)  # idle, but it may still be on its way
    assert len(backlog) == 1
    backlog.plan([load()], COST, NOW + int(LOST_AFTER_MS * MS) + 1)
    assert len(backlog) == 0


def test_the_wait_before_the_tokenizer_counts_against_the_budget():
    # sent_ns: the request reached the tokenizer 60 ms later than the budget allows for; with 100 + 2 ms ahead of its
    # end that is 162 ms.
    plan = Backlog().plan([load(busy_ms=100)], COST, NOW)
    assert plan.judge(1, 20, 180, waited_ms=60) is None  # 162 ms <= 180 ms
    refusal = plan.judge(1, 20, 180, waited_ms=90)  # 192 ms > 180 ms; without the wait 102 ms would pass
    assert plan.judge(1, 20, 180) is None
    assert refusal is not None and not refusal.delays_earlier
    assert refusal.message().startswith(
        "overloaded: the request reached the tokenizer ~100 ms after it was sent (sent_ns), ~90 ms more than the 10 ms "
        "the budget leaves for that, and the encoder has ~100 ms of work before this request's batch, which would run "
        "~2 ms with it: it would end in ~192 ms with that wait, past the 180 ms latency budget"
    )


def test_a_late_arrival_decides_its_own_admission_only():
    # A request admitted though it arrived late by sent_ns keeps the deadline its stamp gives: a newcomer is not
    # refused to protect it, or one client whose clock runs ahead would have every other client refused.
    backlog = Backlog()
    plan = backlog.plan([load(busy_ms=95)], COST, NOW)
    assert plan.judge(1, 20, 180, waited_ms=70) is None  # 95 + 2 + 70 = 167 ms
    backlog.admit(plan, NOW, rows=1, width=20, budget_ms=180)
    assert plan.deadlines_ns == [NOW + 180 * MS]
    assert plan.judge(4, 40, 180) is None  # 95 + 5 x 40 x 0.1 = 115 ms: within 180 ms of its stamp, so admitted
