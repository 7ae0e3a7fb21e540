"""The service curve and the admission knobs derived from it, as pure logic."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
from triton_embed_protocol.capacity import (
    FEEDBACK_FLOOR_SHARE,
    FEEDBACK_IDLE_S,
    FEEDBACK_MIN_SAMPLES,
    FEEDBACK_PERIOD_S,
    FEEDBACK_SHARE,
    TARGET_SHARE,
    AdmissionConfig,
    Knobs,
    ServiceCurve,
    grid,
    largest_within,
    time_in_service,
    timing_alone,
)


def knobs_for(curve: ServiceCurve, **parameters: str) -> Knobs:
    """The knobs an encoder whose config sets ``parameters`` derives from ``curve``."""
    return Knobs(AdmissionConfig.read(parameters), curve)


def linear_curve(fixed_ms: float, per_text_ms: float, max_batch: int = 64) -> ServiceCurve:
    """A machine whose execution of n texts takes fixed + n x per_text, ms."""
    return ServiceCurve({n: (fixed_ms + n * per_text_ms) / 1000 for n in grid(max_batch)}, max_batch)


def test_the_grid_is_powers_of_two_up_to_the_largest_batch():
    assert grid(64) == [1, 2, 4, 8, 16, 32, 64]
    assert grid(48) == [1, 2, 4, 8, 16, 32, 48]
    assert grid(1) == [1]


def test_the_curve_interpolates_between_its_points_and_grows_linearly_past_a_batch():
    curve = linear_curve(2, 1)
    assert curve.seconds(1) == pytest.approx(0.003)
    assert curve.seconds(24) == pytest.approx(0.026)  # between 16 (18 ms) and 32 (34 ms)
    assert curve.seconds(128) == pytest.approx(2 * 0.066)


def within_one_batch(fixed_ms: float, per_text_ms: float, sla_ms: float = 200) -> int:
    """The door on a linear machine while it fits a batch: the most n with 2 (fixed + n per_text) <= share x SLA."""
    return math.floor((sla_ms * TARGET_SHARE / 2 - fixed_ms) / per_text_ms + 1e-9)


def test_the_door_is_the_most_texts_whose_predicted_time_in_service_fits_the_target():
    curve = linear_curve(3, 2)  # 2-core-like: 3 ms + 2 ms a text
    limits = knobs_for(curve).limits()
    door = within_one_batch(3, 2)
    assert limits.max_in_flight == door
    assert time_in_service(curve, door) <= TARGET_SHARE * 0.2 < time_in_service(curve, door + 1)
    # a one-text request behind a bulk execution of b and then its own batch: the same bound while both fit a batch
    assert limits.flood_latency_ms == 100 and limits.bulk_texts == door // 4 and limits.bulk_in_flight == door


def test_a_faster_machine_gets_a_wider_door_and_a_slower_one_a_narrower():
    fast = knobs_for(linear_curve(1, 0.2)).limits()  # batches run whole; several batches fit the SLA
    slow = knobs_for(linear_curve(5, 4)).limits()  # one core
    two_core = knobs_for(linear_curve(3, 2)).limits()
    assert slow.max_in_flight < two_core.max_in_flight < fast.max_in_flight
    assert fast.max_in_flight > 64  # past one batch: it waits for whole executions ahead of it
    assert slow.max_in_flight == within_one_batch(5, 4)


def test_the_sla_sizes_the_door():
    tight = knobs_for(linear_curve(3, 2), SLA_MS="100").limits()
    assert tight.max_in_flight == within_one_batch(3, 2, sla_ms=100) and tight.flood_latency_ms == 50


def test_a_number_pins_a_knob_and_auto_derives_it():
    pins = {"MAX_IN_FLIGHT": "32", "BULK_TEXTS": "8", "BULK_IN_FLIGHT": "0", "FLOOD_LATENCY_MS": "10"}
    limits = knobs_for(linear_curve(2, 2), **pins).limits()
    assert (limits.max_in_flight, limits.bulk_texts, limits.bulk_in_flight, limits.flood_latency_ms) == (32, 8, 0, 10)
    assert all(limits.how[k] == "pinned" for k in ("FLOOD_LATENCY_MS",))
    assert "MAX_IN_FLIGHT" not in limits.how  # pinned: describe() says so
    assert "MAX_IN_FLIGHT 32 (pinned)" in limits.describe()
    assert "measured" in knobs_for(linear_curve(2, 2), MAX_IN_FLIGHT="auto").limits().how["MAX_IN_FLIGHT"]


@pytest.mark.parametrize(("key", "value"), [("MAX_IN_FLIGHT", "many"), ("BULK_TEXTS", "-1"), ("SLA_MS", "0")])
def test_a_bad_knob_names_itself_and_the_value(key, value):
    with pytest.raises(ValueError, match=f"config parameter {key} must be .*; got '{value}'"):
        AdmissionConfig.read({key: value})


def test_the_executions_served_move_the_door_down_to_half_its_load_time_width_and_up():
    curve = linear_curve(3, 2)
    knobs = knobs_for(curve)
    before = knobs.limits(now=0).max_in_flight
    for _ in range(8):  # under load the executions take twice the time measured at load
        curve.observe(16, 2 * 0.035, now=0)
        curve.observe(32, 2 * 0.067, now=0)
    assert before / 2 <= knobs.limits(now=1).max_in_flight < before
    for _ in range(8):  # a stall: the door stays at half its width, where batches still keep the throughput
        curve.observe(16, 1.0, now=2)
        curve.observe(32, 1.0, now=2)
    stalled = knobs.limits(now=3)
    assert stalled.max_in_flight == math.ceil(before / 2) and "half the door at load" in stalled.how["MAX_IN_FLIGHT"]
    for _ in range(16):  # shorter texts than the load-time timing's
        curve.observe(16, 0.010, now=4)
        curve.observe(32, 0.018, now=4)
    assert knobs.limits(now=5).max_in_flight > before
    assert knobs.limits(now=5).bulk_texts == before // 4  # fixed at load: both backends must sort a request alike


def test_one_stalled_execution_moves_little_and_old_ones_are_forgotten():
    curve = linear_curve(3, 2)
    for _ in range(5):
        curve.observe(16, 0.035, now=0)
    curve.observe(16, 5.0, now=0)
    assert curve.seconds(16, curve.table(now=1)) == pytest.approx(0.035)
    curve.observe(32, 5.0, now=0)  # alone: not enough to replace the estimate
    assert curve.seconds(32, curve.table(now=1)) == pytest.approx(0.067)
    assert curve.table(now=100) == linear_curve(3, 2).table(now=100)  # past WINDOW_S: the load-time curve again


def test_a_point_not_reached_yet_carries_the_difference_the_nearest_reached_one_shows():
    curve = linear_curve(2, 2)
    for _ in range(3):  # a one-text execution costs 6 ms more than at load (the frontend, the tokenizer)
        curve.observe(1, 0.010, now=0)
    table = dict(curve.table(now=0))
    assert table[1] == pytest.approx(0.010)
    assert table[2] == pytest.approx(0.006 + 0.006)
    assert table[64] == pytest.approx(0.130 + 0.006)


def test_the_curve_never_falls_with_more_rows():
    curve = linear_curve(2, 2)
    for _ in range(3):
        curve.observe(8, 0.200, now=0)  # slow executions of 8
    values = [s for _, s in curve.table(now=0)]
    assert values == sorted(values)


def test_largest_within():
    assert largest_within(lambda n: n, 10.0, 100) == 10
    assert largest_within(lambda n: n, 1000.0, 100) == 100
    assert largest_within(lambda n: n, 0.0, 100) == 1


def test_a_timing_stalled_at_load_is_cut_to_what_smaller_executions_bound():
    # 32 rows timed during a stall: no slower than two executions of 16; 1 row stalled: no slower than 2 rows
    curve = ServiceCurve({1: 0.5, 2: 0.011, 4: 0.017, 8: 0.026, 16: 0.046, 32: 0.895, 64: 0.895}, 64)
    table = dict(curve.table(now=0))
    assert table[1] == pytest.approx(0.011) and table[32] == pytest.approx(0.092) and table[64] == pytest.approx(0.184)


def test_an_execution_served_slower_than_proportion_is_cut_too():
    curve = linear_curve(3, 2)
    for _ in range(3):
        curve.observe(16, 0.035, now=0)
        curve.observe(64, 5.0, now=0)  # stalled executions of 64: no slower than two of 32
    assert dict(curve.table(now=0))[64] == pytest.approx(2 * 0.067)


def serve_period(knobs: Knobs, now: float, *, ms: float, in_flight: int, answers: int = FEEDBACK_MIN_SAMPLES) -> int:
    """One feedback period: ``answers`` admitted requests each ``ms`` in the service, ``in_flight`` at their starts;
    returns the door in force at ``now`` (``time.monotonic()`` clock)."""
    for _ in range(answers):
        knobs.started(in_flight)
        knobs.answered(ms, now=now)
    return knobs.limits(now=now).max_in_flight


def test_a_served_p99_over_its_budget_shrinks_the_door_down_to_the_curves_floor():
    knobs = knobs_for(linear_curve(3, 2))
    start, door = time.monotonic(), knobs.limits().max_in_flight
    doors = [serve_period(knobs, start + k * FEEDBACK_PERIOD_S, ms=400, in_flight=door) for k in range(1, 20)]
    assert doors[0] < door and all(b <= a for a, b in zip(doors, doors[1:], strict=False))
    assert "served p99 (400 ms)" in knobs.limits(now=start + 10).how["MAX_IN_FLIGHT"]
    floor = doors[-1]  # what the curve predicts at a quarter of the budget: the encoder's queue is not the p99 there
    assert 1 < floor < door / 4
    assert 2 * knobs.curve.seconds(floor) * 1000 <= 200 * TARGET_SHARE * FEEDBACK_FLOOR_SHARE


def test_a_nearly_full_door_with_a_low_p99_opens_and_a_door_not_reached_stays():
    knobs = knobs_for(linear_curve(3, 2))
    start, door = time.monotonic(), knobs.limits().max_in_flight
    assert serve_period(knobs, start + 1, ms=20, in_flight=door // 4) == door  # not what keeps the p99 low
    opened = [door]
    for k in range(1, 4):  # each period the door fills up
        opened.append(serve_period(knobs, start + 1 + k, ms=20, in_flight=opened[-1]))
    assert opened == sorted(set(opened))


def test_the_door_moves_once_a_period_and_only_with_enough_answers():
    knobs = knobs_for(linear_curve(3, 2))
    start, door = time.monotonic(), knobs.limits().max_in_flight
    assert serve_period(knobs, start + 1, ms=400, in_flight=door, answers=FEEDBACK_MIN_SAMPLES - 1) == door
    moved = serve_period(knobs, start + 1, ms=400, in_flight=door, answers=1)
    assert moved < door
    assert serve_period(knobs, start + 1 + FEEDBACK_PERIOD_S / 2, ms=400, in_flight=door) == moved


def test_the_factor_is_forgotten_once_the_encoder_has_answered_nothing_for_a_while():
    knobs = knobs_for(linear_curve(3, 2))
    start, door = time.monotonic(), knobs.limits().max_in_flight
    for k in range(1, 6):  # a flood: the door shrinks
        serve_period(knobs, start + k * FEEDBACK_PERIOD_S, ms=400, in_flight=door)
    for _ in range(100):
        knobs.answered(400, now=start + 3)
    assert knobs.limits(now=start + 3).max_in_flight < door
    assert knobs.limits(now=start + 3 + FEEDBACK_IDLE_S + 0.1).max_in_flight == door  # the flood is over


def test_served_p99_ms_pins_the_target_and_zero_leaves_the_curves_door_alone():
    pinned_target = knobs_for(linear_curve(3, 2), SERVED_P99_MS="300")
    start, door = time.monotonic(), pinned_target.limits().max_in_flight
    assert pinned_target.limits().knobs()["SERVED_P99_MS"] == 300
    assert pinned_target.limits().how["SERVED_P99_MS"] == "pinned"
    assert serve_period(pinned_target, start + 1, ms=250, in_flight=door) == door  # within 300 ms: no shrink
    assert serve_period(pinned_target, start + 2, ms=400, in_flight=door) < door
    off = knobs_for(linear_curve(3, 2), SERVED_P99_MS="0")
    assert [serve_period(off, start + k, ms=4000, in_flight=door) for k in range(1, 4)] == [door] * 3
    assert knobs_for(linear_curve(3, 2)).limits().knobs()["SERVED_P99_MS"] == 200 * FEEDBACK_SHARE


def test_a_door_of_one_timed_on_busy_cores_opens_while_its_answers_come_back_fast():
    knobs = knobs_for(linear_curve(90, 2))  # load-time executions slowed by other work: 2 x 92 ms > budget
    start = time.monotonic()
    assert knobs.limits(now=start).max_in_flight == 1
    doors = [1]
    for k in range(1, 12):  # every period the door is full and the answers take 20 ms
        doors.append(serve_period(knobs, start + k * FEEDBACK_PERIOD_S, ms=20, in_flight=doors[-1]))
    assert doors == sorted(doors) and doors[1] == 2 and doors[-1] == 4  # up to the factor's cap on the curve's door


def test_encoders_time_their_executions_one_at_a_time_on_a_host(tmp_path):
    """A second process's timing waits for the first to finish (the lock spans processes, as stubs are)."""
    lock = tmp_path / "timing.lock"
    holder = (
        "import pathlib, sys, time\n"
        "from triton_embed_protocol.capacity import timing_alone\n"
        "with timing_alone(path=pathlib.Path(sys.argv[1])) as waited:\n"
        "    print('held', flush=True)\n"
        "    time.sleep(1.0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen([sys.executable, "-c", holder, lock], stdout=subprocess.PIPE, text=True, env=env) as first:
        assert first.stdout.readline().strip() == "held"
        with timing_alone(path=lock, wait_s=0.2) as waited:
            assert waited is None  # still held: past wait_s the body runs without the lock
        start = time.monotonic()
        with timing_alone(path=lock) as waited:
            assert waited is not None and 0.3 < waited < 5
            assert time.monotonic() - start == pytest.approx(waited, abs=0.1)
        assert first.wait(timeout=10) == 0
    with timing_alone(path=tmp_path / "no such folder" / "timing.lock") as waited:
        assert waited is None  # a lock file that cannot be made: the timing runs without it
