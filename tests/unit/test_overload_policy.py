"""Overload control as pure logic: budgets, the door, the shared in-flight count, refusals held until due."""

from __future__ import annotations

import threading
import time

import pytest
from triton_embed_protocol import request_parameters
from triton_embed_protocol.overload import (
    BudgetError,
    BulkLane,
    CoreShare,
    Door,
    DoorState,
    InFlight,
    InFlightRecord,
    RefusalHold,
    admit,
    capacity_share,
    is_bulk,
    request_budget_ms,
    shed,
)


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        (None, 180.0),
        ("", 180.0),
        ("{}", 180.0),
        ('{"truncate": true}', 180.0),
        ("not json", 180.0),
        ('{"latency_budget_ms": 0}', 0.0),
        ('{"latency_budget_ms": 2.5}', 2.5),
        ('{"latency_budget_ms": 3600000}', 3.6e6),
    ],
)
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


def test_a_refusal_names_where_its_budget_was_set():
    refused = shed([200.0, 200.0], [150.0, 150.0], own=[True, False])
    assert "150 ms latency budget (the request's parameter latency_budget_ms; 0 = never refused)" in refused[0]
    assert "LATENCY_BUDGET_MS" not in refused[0] and "(LATENCY_BUDGET_MS in the encoder's config" in refused[1]


@pytest.mark.parametrize(("waited", "budget", "written"), [(180.4, 180.0, "180.4"), (0.0042, 0.001, "0.004")])
def test_the_refusal_shows_the_wait_over_the_budget_however_close(waited, budget, written):
    assert f"waited {written} ms in the encoder's queue, over the {budget:g} ms" in shed([waited], [budget])[0]


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
    refused = admit(in_flight=30, limit=32, texts=[1] * 5)
    assert sorted(refused) == [2, 3, 4]
    assert "32 texts are in flight and this request has 1 text; the limit is 32 texts (MAX_IN_FLIGHT" in refused[2]


def test_the_door_weighs_texts_and_a_request_larger_than_the_limit_runs_alone():
    refused = admit(in_flight=24, limit=32, texts=[8, 2, 1], bulk_texts=8)
    assert sorted(refused) == [1, 2]  # 24 + 8 = 32: full
    assert "32 texts are in flight and this request has 2 texts; the limit is 32 texts" in refused[1]
    assert "more than 8 texts or with the request parameter latency_budget_ms 0 waits in the bulk lane" in refused[1]
    assert admit(in_flight=0, limit=4, texts=[6, 1]) == {1: admit(in_flight=6, limit=4, texts=[1])[0]}


def state(count: int, limit: int, bulk: int = 0) -> DoorState:
    """A model's view with ``count`` interactive and ``bulk`` bulk texts in flight behind a door of ``limit``."""
    return DoorState(count, limit, 0, 0, 0, bulk)


def test_models_of_one_server_share_the_machine_and_each_keeps_an_equal_part_however_full_the_others_are():
    assert capacity_share([]) == 1.0  # alone: its whole door
    assert capacity_share([state(0, 40), state(0, 0, 0)]) == 1.0  # the others idle
    assert capacity_share([state(10, 40)]) == 0.75  # a quarter of the other's door in use: three quarters left
    assert capacity_share([state(30, 40, bulk=10)]) == 0.5  # the other's door full (bulk counts): an equal part
    assert capacity_share([state(40, 40), state(500, 1024)]) == pytest.approx(1 / 3)
    assert capacity_share([state(9, 0)]) == 1.0  # a model without a door is not counted


def test_busy_models_of_one_server_split_the_cores_and_idle_ones_leave_them():
    hold = CoreShare.HOLD_NS
    assert CoreShare(2).threads_now([], 0) == 2  # alone: every core
    assert CoreShare(2).threads_now([state(0, 32), state(0, 32)], 0) == 2  # the others idle
    assert CoreShare(2).threads_now([state(3, 32)], 0) == 1  # one other busy: half each
    assert CoreShare(2).threads_now([state(0, 32, bulk=64)], 0) == 1  # bulk work is work
    assert CoreShare(8).threads_now([state(1, 32), state(5, 0), state(0, 32)], 0) == 2  # three busy: 8 // 3
    assert CoreShare(2).threads_now([state(1, 32)] * 3, 0) == 1  # never below one thread
    share = CoreShare(2)
    assert share.threads_now([state(1, 32)], hold) == 1
    assert share.threads_now([state(0, 32)], hold + hold // 2) == 1  # a gap in a steady load keeps the split
    assert share.threads_now([state(0, 32)], 2 * hold) == 2  # idle for the hold: every core again


def test_the_door_shrinks_to_its_share_and_the_refusal_says_why():
    refused = admit(in_flight=15, limit=32, texts=[1, 1], share=0.5, max_in_flight=32)
    assert sorted(refused) == [1]  # 16 of 32
    assert refused[1].startswith("overloaded[shared]: 16 texts are in flight") and "the limit is 16 texts" in refused[1]
    assert "50% of this model's door, the other models of this server holding the rest" in refused[1]
    assert admit(in_flight=0, limit=32, texts=[1], share=0.0) == {}  # nothing in flight: admitted
    assert admit(in_flight=1, limit=32, texts=[1], share=0.01) == {0: admit(1, 1, [1], share=0.01)[0]}  # at least 1


def test_no_limit_refuses_nothing():
    assert admit(in_flight=10_000, limit=0, texts=[64] * 64) == {}


@pytest.mark.parametrize(
    ("parameters", "texts", "expected"),
    [
        ({}, 8, False),
        ({}, 9, True),
        ({"latency_budget_ms": 0}, 1, True),
        ({"latency_budget_ms": 50}, 1, False),
        ({"latency_budget_ms": 50}, 64, True),
        ({"latency_budget_ms": -1}, 1, False),
    ],
)
def test_bulk_is_more_than_bulk_texts_or_budget_zero(parameters, texts, expected):
    assert is_bulk(parameters, texts, bulk_in_flight=64, bulk_texts=8) is expected
    assert is_bulk(parameters, texts, bulk_in_flight=0, bulk_texts=8) is False  # no lane: all meet the door


S = 1_000_000_000  # ns


def flood_state(count: int, answered: int) -> DoorState:
    """MAX_IN_FLIGHT 32, FLOOD_LATENCY_MS 100."""
    return DoorState(count, max_in_flight=32, refusal_hold_ns=S, flood_ns=S // 10, answered=answered)


def test_the_door_stays_at_max_in_flight_until_more_than_that_have_come_for_a_second():
    door = Door()
    assert door.limit(0, flood_state(32, 0), held=0) == 32  # 32 clients: no flood, however slow the answers
    assert door.limit(S // 2, flood_state(32, 1), held=0) == 32
    assert door.limit(S, flood_state(32, 2), held=8) == 32  # 40 clients: a flood begins
    assert door.limit(S + S // 2, flood_state(32, 50), held=8) == 32  # not a second yet
    # a second of it: 200 answers/s over the last second (2 -> 202) x 100 ms
    assert door.limit(2 * S, flood_state(32, 202), held=8) == 20


def test_under_a_flood_the_limit_follows_the_answers_between_half_and_all_of_max_in_flight():
    door = Door()
    door.limit(0, flood_state(32, 0), held=100)
    assert door.limit(S, flood_state(32, 1000), held=100) == 32  # 1000/s x 100 ms = 100: capped
    assert door.limit(2 * S, flood_state(32, 1250), held=100) == 25  # 250/s
    assert door.limit(3 * S, flood_state(32, 1250), held=100) == 16  # the encoder answered nothing for a second


def test_the_limit_is_max_in_flight_again_once_the_clients_fit_under_it():
    door = Door()
    door.limit(0, flood_state(32, 0), held=100)
    assert door.limit(S, flood_state(20, 200), held=100) == 20
    # the flood's clients are gone (their refusals answered): 25 clients, fewer than 32, are never refused
    assert door.limit(S + 1, flood_state(20, 200), held=5) == 32
    door.limit(S + 2, flood_state(32, 150), held=1)  # a flood again: a second before the limit moves
    assert door.limit(2 * S, flood_state(32, 300), held=1) == 32


def test_no_door_or_no_flood_latency_keeps_the_configured_limit():
    for limit, flood_ns in ((0, S // 10), (32, 0)):
        door = Door()
        for t in range(4):
            state = DoorState(10_000, max_in_flight=limit, refusal_hold_ns=S, flood_ns=flood_ns, answered=t)
            assert door.limit(t * S, state, held=1000) == limit


def test_a_refusal_under_a_flood_names_the_lowered_limit_and_both_knobs():
    refused = admit(in_flight=20, limit=20, texts=[1], max_in_flight=32, flood_ms=100.0)
    assert "the limit is 20 texts (under a flood" in refused[0]
    assert "FLOOD_LATENCY_MS, 100 ms, from half of MAX_IN_FLIGHT to all of it, 32, in" in refused[0]


def test_the_in_flight_count_is_shared_by_the_stubs_of_one_model_and_heals_itself(tmp_path):
    (tmp_path / "repo" / "tokenizer").mkdir(parents=True)
    (tmp_path / "repo" / "encoder").mkdir()
    (tmp_path / "other" / "encoder").mkdir(parents=True)
    tokenizer = InFlight(tmp_path / "repo" / "tokenizer", "embed")
    encoder = InFlight(tmp_path / "repo" / "encoder", "embed")
    elsewhere = InFlight(tmp_path / "other" / "encoder", "embed")
    beside = InFlight(tmp_path / "repo" / "multi_encoder", "multi")  # another model of the same repository
    try:
        encoder.reset(32, 1_000_000_000, 100_000_000)  # MAX_IN_FLIGHT, REFUSAL_HOLD_MS, FLOOD_LATENCY_MS
        tokenizer.reset()  # a tokenizer loading keeps them
        assert tokenizer.door() == DoorState(0, 32, 1_000_000_000, 100_000_000, answered=0)
        encoder.reset(bulk=(64, 2048, 8))  # BULK_IN_FLIGHT, BULK_QUEUE, BULK_TEXTS
        assert tokenizer.door()[-3:] == (64, 2048, 8) and tokenizer.door().max_in_flight == 32
        encoder.started()  # busy: the count stands however long
        assert tokenizer.add(5) == 5
        time.sleep(0.15)
        assert encoder.door()[0] == 5 and elsewhere.door()[0] == 0  # another repository (or server) has its own
        assert tokenizer.others() == []  # a model whose backends have not loaded has no file
        beside.reset()  # its backends loaded
        assert beside.door()[0] == 0 and encoder.door()[0] == 5  # another model has its own count
        assert [o.interactive for o in beside.others()] == [5]
        assert tokenizer.others() == []  # the tokenizer looked for other models' files less than SIBLINGS_NS ago
        time.sleep(InFlight.SIBLINGS_NS / 1e9)
        assert [o.interactive for o in tokenizer.others()] == [0]  # its next look finds the model loaded since
        assert elsewhere.others() == []
        assert encoder.answered(3) == 2
        assert tokenizer.door()[0] == 2  # the encoder went idle just now: the two may still reach it
        time.sleep(0.15)
        assert tokenizer.door()[0] == 0  # idle for 100 ms: they never will (a direct call of the tokenizer)
        assert InFlightRecord.parse(encoder.path.read_bytes()).interactive == 2  # a read writes nothing
        tokenizer.add(3)  # handed on to an encoder idle for long: it has 100 ms from now to take them
        encoder.started()
        assert encoder.door()[0] == 3
        encoder.started()
        assert encoder.answered(7) == 0  # never below 0
        tokenizer.add(4)
        encoder.reset()
        assert tokenizer.door()[0] == 0
        assert tokenizer.door().answered == 10  # every count-out, whatever the count did
    finally:
        for count in (tokenizer, elsewhere, beside):
            count.path.unlink(missing_ok=True)


class FakeFlight:
    """An in-flight count the lane reads, moved by the test as the encoder would."""

    def __init__(self, count: int = 0, bulk_in_flight: int = 64, interactive_ns: int = 0) -> None:
        self.state = DoorState(count, 32, S, S // 10, 0, 0, interactive_ns, bulk_in_flight, 256, 8)
        self.lock = threading.Lock()
        self.beside: list[DoorState] = []  # the other models' views

    def others(self) -> list[DoorState]:
        with self.lock:
            return list(self.beside)

    def door(self) -> DoorState:
        with self.lock:
            return self.state

    def add(self, texts: int, bulk: int = 0) -> int:
        with self.lock:
            self.state = self.state._replace(interactive=self.state.interactive + texts, bulk=self.state.bulk + bulk)
            return self.state.interactive

    def answer(self, bulk: int) -> None:
        with self.lock:
            self.state = self.state._replace(bulk=self.state.bulk - bulk)


def wait_for(condition, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_bulk_lane_hands_on_in_order_within_its_share_and_refuses_past_its_queue():
    flight = FakeFlight(count=1)  # an interactive request in flight: the share is BULK_IN_FLIGHT, 64
    lane = BulkLane(flight)  # type: ignore[arg-type]
    sent: list[str] = []
    try:
        for name, texts in (("a", 64), ("b", 32), ("c", 32), ("d", 64)):
            assert lane.offer(texts, lambda n=name: sent.append(n), bulk_queue=256) is None
        wait_for(lambda: sent == ["a"])  # 64 texts fill the share: b waits
        time.sleep(0.05)
        assert sent == ["a"] and lane.waiting() == 128 and flight.door().bulk == 64
        message = lane.offer(200, lambda: sent.append("e"), bulk_queue=256)
        assert message == (
            "overloaded[bulk_queue]: 128 bulk texts are waiting and this request has 200; the limit is "
            "256 texts (BULK_QUEUE in the encoder's config). Retry with backoff"
        )
        flight.answer(64)
        wait_for(lambda: sent == ["a", "b", "c"])  # 32 + 32 fit the share
        time.sleep(0.05)
        assert sent == ["a", "b", "c"]
        flight.answer(32)
        time.sleep(0.05)
        assert sent == ["a", "b", "c"]  # 32 + 64 > 64
        flight.answer(32)
        wait_for(lambda: sent == ["a", "b", "c", "d"])  # none in flight: the head goes, whatever its size
    finally:
        lane.close()


def test_the_lane_takes_its_models_share_of_the_machine_beside_a_busy_model():
    flight = FakeFlight(count=1)
    lane = BulkLane(flight)  # type: ignore[arg-type]
    assert lane.share(flight.door(), time.monotonic_ns(), []) == 64
    assert lane.share(flight.door(), time.monotonic_ns(), [state(40, 40)]) == 32  # the other's door full: half
    flight.beside = [state(40, 40)]
    sent: list[str] = []
    try:
        for name in "abc":
            assert lane.offer(32, lambda n=name: sent.append(n), bulk_queue=0) is None
        wait_for(lambda: sent == ["a"])
        time.sleep(0.05)
        assert sent == ["a"]  # 32 texts fill half the share
        flight.beside = []
        wait_for(lambda: sent == ["a", "b"])  # the other model went idle: the whole share
    finally:
        lane.close()


def test_with_no_interactive_request_for_a_second_the_lane_takes_twice_its_share_and_close_hands_on_all():
    flight = FakeFlight(count=0, interactive_ns=time.monotonic_ns() - 2 * S)
    lane = BulkLane(flight)  # type: ignore[arg-type]
    sent: list[int] = []
    for k in range(4):
        lane.offer(64, lambda k=k: sent.append(k), bulk_queue=0)
    wait_for(lambda: sent == [0, 1])
    time.sleep(0.05)
    assert sent == [0, 1] and flight.door().bulk == 128
    lane.close()  # unloading: nothing accepted is lost
    assert sent == [0, 1, 2, 3]
