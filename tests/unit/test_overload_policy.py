"""The encoder's overload control as pure logic: budgets, which requests are refused, refusals held until due."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from triton_embed_protocol import request_parameters

BACKENDS = Path(__file__).resolve().parents[2] / "python_backends"
sys.path.insert(0, str(BACKENDS / "torchscript"))
from overload import BudgetError, RefusalHold, request_budget_ms, shed  # noqa: E402


@pytest.mark.parametrize(("parameters", "expected"), [
    (None, 180.0), ("", 180.0), ("{}", 180.0), ('{"truncate": true}', 180.0), ("not json", 180.0),
    ('{"latency_budget_ms": 0}', 0.0), ('{"latency_budget_ms": 2.5}', 2.5), ('{"latency_budget_ms": 3600000}', 3.6e6),
])  # fmt: skip
def test_the_budget_is_the_request_parameter_else_the_models(parameters, expected):
    assert request_budget_ms(request_parameters(parameters), 180.0) == expected


@pytest.mark.parametrize("value", ["-5", '"soon"', "1e308", "true"])
def test_a_bad_budget_names_the_field_the_limits_and_the_value(value):
    with pytest.raises(BudgetError, match=r"'latency_budget_ms' must be a number of ms from 0 to 3600000 .*; got"):
        request_budget_ms(request_parameters(f'{{"latency_budget_ms": {value}}}'), 180.0)


def test_only_requests_that_waited_past_their_budget_are_refused():
    waited = [181.0, 180.0, 10.0, 500.0]
    refused = shed(waited, [180.0, 180.0, 180.0, 600.0])
    assert set(refused) == {0}  # 180 ms is within a 180 ms budget; 500 ms within its own 600
    assert "waited 181 ms in the encoder's queue, over the 180 ms latency budget (LATENCY_BUDGET_MS" in refused[0]
    assert "latency_budget_ms" in refused[0]


def test_a_request_is_never_refused_for_its_own_size_or_on_a_prediction():
    # The refusal depends on the wait alone: a request that has not waited runs, whatever the batch will cost.
    assert shed([1.0, 179.0], [180.0, 180.0]) == {}


def test_budget_zero_and_unstamped_requests_are_never_refused():
    assert shed([5000.0, None, 5000.0], [0.0, 180.0, 180.0]).keys() == {2}


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
