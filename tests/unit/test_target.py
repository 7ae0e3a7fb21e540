"""The share of the latency budget that admission control plans with (python_backends/common/target.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_backends" / "common"))

from loadboard import EncoderLoad  # noqa: E402
from target import DECREASE, FLOOR, IDLE_SPELL_MS, INCREASE, WAKE_SHARE, AdmissionTarget, share_of  # noqa: E402

NOW = 10**12
MS = 1_000_000


def test_late_executions_cut_the_share_to_the_floor_and_in_time_ones_give_it_back_slowly():
    target = AdmissionTarget()
    target.executed(any_late=False)
    assert target.share == 1.0  # a load served in time keeps the whole budget
    target.executed(any_late=True)
    assert target.share == pytest.approx(DECREASE)
    for _ in range(50):
        target.executed(any_late=True)
    assert target.share == FLOOR
    for _ in range(10):
        target.executed(any_late=False)
    assert target.share == pytest.approx(FLOOR + 10 * INCREASE)


def test_a_busy_period_starts_from_the_wake_share():
    target = AdmissionTarget()
    target.woke()
    assert target.share == WAKE_SHARE < 1.0
    target.executed(any_late=False)
    assert target.share == pytest.approx(WAKE_SHARE + INCREASE)
    target.executed(any_late=True)  # cut back, but never below the floor
    assert target.share == pytest.approx(max(FLOOR, (WAKE_SHARE + INCREASE) * DECREASE))
    target.share = FLOOR / 2  # a share below the floor (a lower wake share) is left where it is
    target.executed(any_late=True)
    assert target.share == FLOOR / 2


def encoder(share: float, running_since_ns: int = 0, newest_started_ns: int = NOW) -> EncoderLoad:
    return EncoderLoad(1, NOW, running_since_ns, newest_started_ns, 0, 10.0, 2.0, 0.1, 1.4, 180.0, share, 64)


def test_the_tokenizer_plans_with_the_least_share_and_the_wake_share_on_an_idle_encoder():
    assert share_of([encoder(0.8), encoder(0.6)], NOW) == 0.6
    idle_since = NOW - int(IDLE_SPELL_MS * MS)  # the newest request it took
    assert share_of([encoder(0.8, newest_started_ns=idle_since)], NOW) == WAKE_SHARE
    assert share_of([encoder(0.8, newest_started_ns=idle_since + 1)], NOW) == 0.8  # not idle long enough
    assert share_of([encoder(0.8, running_since_ns=NOW - MS, newest_started_ns=idle_since)], NOW) == 0.8  # running
