"""The encoder's overload control as pure logic: budgets, which requests are refused, refusals held until due."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_backends" / "torchscript"))
from overload import BudgetError, RefusalHold, RunTime, request_budget_ms, shed  # noqa: E402

COST = RunTime(ms_per_token=0.1, fixed_ms=5.0)  # 16 texts x 16 tokens: 5 + 25.6 = 30.6 ms


@pytest.mark.parametrize(("parameters", "expected"), [
    (None, 180.0), ("", 180.0), ("{}", 180.0), ('{"truncate": true}', 180.0), ("not json", 180.0),
    ('{"latency_budget_ms": 0}', 0.0), ('{"latency_budget_ms": 2.5}', 2.5), ('{"latency_budget_ms": 3600000}', 3.6e6),
])  # fmt: skip
def test_the_budget_is_the_request_parameter_else_the_models(parameters, expected):
    assert request_budget_ms(parameters, 180.0) == expected


@pytest.mark.parametrize("value", ["-5", '"soon"', "1e308", "true"])
def test_a_bad_budget_names_the_field_the_limits_and_the_value(value):
    with pytest.raises(BudgetError, match=r"'latency_budget_ms' must be a number of ms from 0 to 3600000 .*; got"):
        request_budget_ms(f'{{"latency_budget_ms": {value}}}', 180.0)


def test_nothing_is_refused_when_the_batch_ends_within_every_budget():
    assert shed([100.0] * 16, [1] * 16, [16] * 16, [180.0] * 16, COST) == {}


def test_the_longest_waiting_are_refused_until_the_rest_fits():
    waited = [170.0, 160.0, 10.0, 5.0]
    refused = shed(waited, [16, 16, 16, 16], [16] * 4, [180.0] * 4, COST)
    assert set(refused) == {0, 1}  # 170 and 160 ms waited + ~30 ms of batch: past 180 + their own ~30 ms
    assert "waited 170 ms for the encoder" in refused[0]
    assert "the 180 ms latency budget (LATENCY_BUDGET_MS" in refused[0] and "latency_budget_ms" in refused[0]


def test_a_request_is_never_refused_for_its_own_size():
    # 64 texts of 256 tokens: ~1.6 s alone, far over the budget, but it has not waited.
    assert shed([1.0], [64], [256], [180.0], COST) == {}
    # Behind it, a small request that waited 100 ms would end 1.7 s late: it is refused, not the big one.
    assert set(shed([1.0, 100.0], [64, 1], [256, 8], [180.0, 180.0], COST)) == {1}


def test_budget_zero_and_unstamped_requests_are_never_refused():
    assert shed([5000.0, None, 5000.0], [1, 1, 1], [8, 8, 8], [0.0, 180.0, 180.0], COST).keys() == {2}


def test_the_run_time_learns_from_executions():
    cost = RunTime(ms_per_token=0.1, fixed_ms=5.0)
    for _ in range(50):
        cost.observe(5.0 + 0.2 * 32 * 32, 32, 32)  # the cores got twice as slow per token
    assert cost.ms_per_token == pytest.approx(0.2, rel=0.01)
    for _ in range(50):
        cost.observe(20.0 + 0.2 * 8, 1, 8)  # and each execution costs 20 ms more
    assert cost.fixed_ms == pytest.approx(20.0, rel=0.01)


def test_refusals_are_answered_when_due_in_due_order_and_all_on_close():
    hold = RefusalHold()
    answered: list[tuple[str, float]] = []
    start = time.monotonic_ns()
    for name, after_ms in (("late", 300), ("early", 100), ("past", -50)):
        hold.hold(
            start + after_ms * 1_000_000, lambda n=name: answered.append((n, (time.monotonic_ns() - start) / 1e6))
        )
    time.sleep(0.5)
    assert [n for n, _ in answered] == ["past", "early", "late"]
    assert answered[1][1] >= 100 and answered[2][1] >= 300
    done = threading.Event()
    hold.hold(time.monotonic_ns() + 60 * 10**9, done.set)  # due in a minute
    hold.hold(time.monotonic_ns(), lambda: 1 / 0)  # an answer that fails does not stop the others
    assert hold.pending() >= 1
    hold.close()
    assert done.is_set() and hold.pending() == 0
