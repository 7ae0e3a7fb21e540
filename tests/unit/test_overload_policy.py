"""Overload control as pure logic: budgets, the door, the shared in-flight count, refusals held until due."""

from __future__ import annotations

import math
import threading
import time

import pytest
from triton_embed_protocol import request_parameters
from triton_embed_protocol.overload import BudgetError, InFlight, RefusalHold, admit, request_budget_ms, shed


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


def test_the_door_admits_up_to_the_limit_in_order_and_refuses_the_rest_naming_the_knob():
    refused = admit(in_flight=30, limit=32, budgets_ms=[math.inf] * 5)
    assert sorted(refused) == [2, 3, 4]
    assert "32 requests are in flight, the limit is 32 (MAX_IN_FLIGHT" in refused[2]


def test_budget_zero_passes_the_door_and_counts_in_flight():
    refused = admit(in_flight=31, limit=32, budgets_ms=[0.0, math.inf, 0.0, 180.0])
    assert sorted(refused) == [1, 3]


def test_no_limit_refuses_nothing():
    assert admit(in_flight=10_000, limit=0, budgets_ms=[math.inf] * 64) == {}


def test_the_in_flight_count_is_shared_by_the_stubs_of_one_repository_and_heals_itself(tmp_path):
    (tmp_path / "repo" / "tokenizer").mkdir(parents=True)
    (tmp_path / "repo" / "encoder").mkdir()
    (tmp_path / "other" / "encoder").mkdir(parents=True)
    tokenizer = InFlight(tmp_path / "repo" / "tokenizer")
    encoder = InFlight(tmp_path / "repo" / "encoder")
    elsewhere = InFlight(tmp_path / "other" / "encoder")
    try:
        encoder.reset(32, 1_000_000_000)  # the encoder's MAX_IN_FLIGHT and REFUSAL_HOLD_MS, for the door
        tokenizer.reset()  # a tokenizer loading keeps them
        assert tokenizer.door() == (0, 32, 1_000_000_000)
        encoder.started()  # busy: the count stands however long
        assert tokenizer.add(5) == 5
        time.sleep(0.15)
        assert encoder.door()[0] == 5 and elsewhere.door()[0] == 0  # another repository (or server) has its own
        assert encoder.answered(3) == 2
        assert tokenizer.door()[0] == 2  # the encoder went idle just now: the two may still reach it
        time.sleep(0.15)
        assert tokenizer.door()[0] == 0  # idle for 100 ms: they never will (a direct call of the tokenizer)
        tokenizer.add(3)  # handed on to an encoder idle for long: it has 100 ms from now to take them
        encoder.started()
        assert encoder.door()[0] == 3
        encoder.started()
        assert encoder.answered(7) == 0  # never below 0
        tokenizer.add(4)
        encoder.reset()
        assert tokenizer.door()[0] == 0
    finally:
        for count in (tokenizer, elsewhere):
            count.path.unlink(missing_ok=True)
