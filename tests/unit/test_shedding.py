"""Deadline-based shedding (python_backends/common/shedding.py): which requests go, and the cost model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_backends" / "common"))

from shedding import (  # noqa: E402
    SEND_ALLOWANCE_MS,
    BudgetError,
    CostModel,
    choose_shed,
    late_arrival_ms,
    request_parameters,
    sent_age_ms,
)

COST = CostModel(ms_per_token=0.1, margin=1.0)  # 64 rows x 16 tokens ~ 102 ms, roughly MiniLM on 2 CPU cores


def test_nothing_is_shed_when_everything_fits():
    assert choose_shed([5.0, 20.0, None], [1, 1, 8], [16, 12, 30], COST, budget_ms=150) == set()


def test_oldest_requests_go_first_and_only_as_many_as_needed():
    waited = [10.0, 90.0, 40.0, 60.0]
    rows = [16, 16, 16, 16]  # all 4: 64 x 16 = 102 ms; without the 90 ms one: 48 x 16 = 77 ms
    assert choose_shed(waited, rows, [16] * 4, COST, budget_ms=150) == {1}
    # A tighter budget also drops the 60 ms one (60 + 77 > 100); 40 + 51 (32 x 16) fits, and 40 < half of 100.
    assert choose_shed(waited, rows, [16] * 4, COST, budget_ms=100) == {1, 3}


def test_every_request_can_be_shed_but_unstamped_ones_never_are():
    assert choose_shed([500.0, 400.0], [1, 1], [16, 16], COST, budget_ms=150) == {0, 1}
    assert choose_shed([None, 400.0], [64, 1], [256, 16], COST, budget_ms=150) == {1}


def test_a_request_big_by_itself_gets_four_times_its_own_run_time():
    # 64 x 40 tokens alone: ~256 ms > the 150 ms budget; it is late only after waiting more than 3 x 256 ms.
    assert choose_shed([2.0], [64], [40], COST, budget_ms=150) == set()
    assert choose_shed([700.0], [64], [40], COST, budget_ms=150) == set()  # 700 + 256 <= 1024
    assert choose_shed([800.0], [64], [40], COST, budget_ms=150) == {0}
    # Beside it, a small request that waited 100 ms misses 150 ms (100 + 258), so it goes; the big one stays.
    assert choose_shed([2.0, 100.0], [64, 1], [40, 16], COST, budget_ms=150) == {1}


def test_the_fixed_cost_of_an_execution_does_not_make_a_small_request_big():
    # Busy cores: 30 ms per execution whatever it holds. One text of 20 tokens is 2 ms of its own, so with a 50 ms
    # budget its deadline stays 50 ms: waited 60 + 32 ms > 50, shed (with the fixed part counted as its own,
    # 4 x 32 = 128 ms would have kept it, and a small budget would have meant fewer refusals, not more).
    busy = CostModel(ms_per_token=0.1, fixed_ms=30.0, margin=1.0)
    assert choose_shed([60.0], [1], [20], busy, budget_ms=50) == {0}
    assert busy.own_ms(1, 20) == pytest.approx(2.0)


def test_fresh_requests_are_not_shed_even_when_the_batch_is_slow():
    # 16 requests of 4 long texts (64 x 100 tokens ~ 640 ms): late, but none has waited half the 150 ms budget.
    assert choose_shed([35.0] * 16, [4] * 16, [100] * 16, COST, budget_ms=150) == set()
    # Once they have queued for 80 ms, shedding starts with the oldest.
    assert 0 in choose_shed([80.0] + [35.0] * 15, [4] * 16, [100] * 16, COST, budget_ms=150)


def test_a_zero_budget_disables_shedding():
    assert choose_shed([10_000.0], [1], [16], COST, budget_ms=0) == set()


def test_the_widest_kept_request_sets_the_padded_width():
    # One long text (200 tokens, 20 ms alone) pads the whole batch: 17 x 200 = 340 ms. Shedding it (the oldest)
    # leaves 16 x 10 = 16 ms.
    assert choose_shed([80.0, 10.0], [1, 16], [200, 10], COST, budget_ms=150) == {0}


def test_cost_model_learns_the_fixed_part_from_small_executions_and_the_rest_from_large_ones():
    model = CostModel(ms_per_token=0.1, fixed_ms=0.0, alpha=0.5, min_tokens=256, margin=1.0)
    model.observe(took_ms=5.6, rows=1, width=16)  # small: 5.6 - 1.6 per-token part = 4 ms fixed, half learned
    assert model.fixed_ms == pytest.approx(2.0) and model.ms_per_token == 0.1
    model.observe(took_ms=104.4, rows=32, width=16)  # large: (104.4 - 2) / 512 = 0.2 ms/token, half learned
    assert model.ms_per_token == pytest.approx(0.15)
    assert model.estimate_ms(10, 20) == pytest.approx(2.0 + 30.0)
    assert CostModel(ms_per_token=0.1, fixed_ms=2.0, margin=1.4).estimate_ms(10, 20) == pytest.approx(1.4 * 22.0)
    assert CostModel(ms_per_token=0.1, fixed_ms=2.0, margin=1.4).typical_ms(10, 20) == pytest.approx(22.0)


def test_per_request_budgets_a_zero_one_is_never_shed():
    waited, rows, widths = [400.0, 400.0, 400.0], [1, 1, 1], [16, 16, 16]
    assert choose_shed(waited, rows, widths, COST, budget_ms=[150, 0, 1000]) == {0}
    assert choose_shed(waited, rows, widths, COST, budget_ms=[0, 0, 0]) == set()


def test_the_send_stamp_gives_the_requests_age_and_a_clock_ahead_counts_as_none():
    now = 1_790_000_000_000_000_000
    assert sent_age_ms({"sent_ns": now - 75_500_000}, now) == pytest.approx(75.5)
    assert sent_age_ms({"sent_ns": now + 3_000_000_000}, now) == 0.0  # the client's clock is ahead
    assert sent_age_ms(request_parameters('{"latency_budget_ms": 50}'), now) == 0.0
    assert sent_age_ms(request_parameters(None), now) == 0.0
    # The budget already leaves room for the way in: only the wait beyond it counts.
    assert late_arrival_ms(75.5) == pytest.approx(75.5 - SEND_ALLOWANCE_MS)
    assert late_arrival_ms(SEND_ALLOWANCE_MS / 2) == 0.0


@pytest.mark.parametrize("value", ['"soon"', "-1", "1.5e18", "true"])
def test_a_bad_send_stamp_names_the_parameter_and_the_value(value):
    with pytest.raises(BudgetError) as caught:
        sent_age_ms(request_parameters(f'{{"sent_ns": {value}}}'), 10**18)
    assert "request parameter 'sent_ns' must be a whole number of ns since the Unix epoch" in str(caught.value)
    assert str(caught.value).endswith(f"got {json.loads(value)!r}")


def test_a_send_stamp_older_than_the_longest_budget_is_rejected_as_a_wrong_unit_or_clock():
    now = 1_790_000_000_000_000_000
    assert sent_age_ms({"sent_ns": now - 3_599 * 10**9}, now) == pytest.approx(3_599_000.0)
    for stamp in (now // 10**6, now // 10**9, 0):  # ms, s, or no clock at all: decades "old"
        with pytest.raises(BudgetError, match=r"s before the server's clock, more than the 3600 s"):
            sent_age_ms({"sent_ns": stamp}, now)
