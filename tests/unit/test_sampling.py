"""The sampling policy: every request when quiet, budget/rate under load, a floor, a raised share when slow."""

from __future__ import annotations

import pytest
from triton_embed_gateway.ratio_sampler import AdaptiveRatio
from triton_embed_gateway.sampling import SamplingConfigError, SamplingPolicy

POLICY = SamplingPolicy(budget_per_s=20, floor=0.01, slow_ms=200, slow_ratio=0.5)


def test_quiet_traces_every_request_and_load_traces_the_budget_down_to_the_floor():
    assert POLICY.target(10, 50, slow=False) == (1.0, False)
    assert POLICY.target(200, 50, slow=False) == (0.1, False)
    assert POLICY.target(100_000, 50, slow=False) == (0.01, False)


def test_a_p95_over_the_threshold_raises_the_share_until_it_is_back_under_three_quarters():
    assert POLICY.target(1000, 250, slow=False) == (0.5, True)
    assert POLICY.target(1000, 180, slow=True) == (0.5, True)  # within the hysteresis
    assert POLICY.target(1000, 140, slow=True) == (0.02, False)
    assert POLICY.target(1000, None, slow=True) == (0.5, True)  # no request answered: the state stays


def test_a_new_share_moves_only_past_a_factor_of_two_at_a_bound_or_when_the_state_flips():
    assert not POLICY.moves(0.1, 0.15, flipped=False)
    assert POLICY.moves(0.1, 0.25, flipped=False) and POLICY.moves(0.1, 0.04, flipped=False)
    assert POLICY.moves(0.6, 1.0, flipped=False) and POLICY.moves(0.015, 0.01, flipped=False)
    assert POLICY.moves(0.1, 0.15, flipped=True)
    assert not POLICY.moves(0.5, 0.5, flipped=True)


def test_the_variables_set_the_knobs_and_a_bad_one_is_named_with_its_range_and_value():
    policy = SamplingPolicy.from_environment({"TRITON_EMBED_TRACE_BUDGET": "50", "TRITON_EMBED_TRACE_FLOOR": "0.001"})
    assert (policy.budget_per_s, policy.floor, policy.slow_ms) == (50, 0.001, 200)
    with pytest.raises(
        SamplingConfigError, match=r"TRITON_EMBED_TRACE_FLOOR must be a number over 0 and at most 1; got '2'"
    ):
        SamplingPolicy.from_environment({"TRITON_EMBED_TRACE_FLOOR": "2"})
    with pytest.raises(SamplingConfigError, match=r"TRITON_EMBED_TRACE_SLOW_MS must be a number over 0 .*got 'fast'"):
        SamplingPolicy.from_environment({"TRITON_EMBED_TRACE_SLOW_MS": "fast"})


def test_the_sampler_follows_its_ratio():
    sampler = AdaptiveRatio(1.0)
    ids = range(1, 2**64, 2**64 // 2000)
    assert all(sampler.should_sample(None, t, "x").decision.is_sampled() for t in ids)
    sampler.set(0.1)
    share = sum(sampler.should_sample(None, t, "x").decision.is_sampled() for t in ids) / len(ids)
    assert 0.05 < share < 0.15 and sampler.get_description() == "AdaptiveRatio{0.1}"
