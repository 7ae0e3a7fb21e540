"""The SLA gate and the stage breakdown on hand-made inputs (the arithmetic; the real runs are test_loadtest.py)."""

from __future__ import annotations

import numpy as np
import pytest
from triton_embed.server_stats import StepStats

from loadtest.gate import Sample, SlaSpec, evaluate, stretch_line, timeline, worst_stretch
from loadtest.stages import breakdown, culprit


def samples(latencies_ms, *, start=100.0, step=0.01, failed=()):
    return [Sample(start + i * step, ms, "embed x1", "grpc", i in failed) for i, ms in enumerate(latencies_ms)]


def test_percentiles_are_exact_and_the_verdict_names_p99():
    lat = list(range(1, 1001))  # 1..1000 ms
    result = evaluate(samples(lat), 100.0, 200.0, SlaSpec(p99_ms=500, p95_ms=500))
    assert result.p99_ms == pytest.approx(np.percentile(lat, 99))
    assert result.p50_ms == pytest.approx(500.5)
    assert not result.passed
    assert result.line().startswith("SLA FAIL: p99 990.0 ms > 500 ms; p95 950.0 ms > 500 ms")


def test_latencies_before_the_window_are_left_out():
    slow_ramp = samples([5000.0] * 50, start=90.0)  # started before the window opened at 100 s
    steady = samples([20.0] * 200, start=100.0)
    result = evaluate(slow_ramp + steady, 100.0, 110.0, SlaSpec())
    assert result.passed, result.line()
    assert result.requests == 250 and result.p99_ms == 20.0
    assert result.throughput_rps == pytest.approx(20.0)
    assert "warm-up" not in result.line()  # none of them failed


def test_a_failure_in_the_warm_up_is_a_failure_all_the_same():
    ramp = samples([5000.0] * 50, start=90.0, failed={1, 2, 3})
    steady = samples([20.0] * 1950, start=100.0, step=0.005)
    result = evaluate(ramp + steady, 100.0, 110.0, SlaSpec())
    assert not result.passed and result.failures == 3 and result.requests == 2000
    assert (result.warmup_requests, result.warmup_failures) == (50, 3)
    assert result.line().startswith("SLA FAIL: failure ratio 0.150% > 0.1%")
    assert result.line().endswith("; 3 of the failures were in the warm-up, before the window")
    one = evaluate(samples([5000.0] * 50, start=90.0, failed={1}) + steady, 100.0, 110.0, SlaSpec())
    assert one.passed, one.line()  # 1 in 2,000: within the 0.1%


def test_failure_ratio_and_minimum_requests():
    result = evaluate(samples([10.0] * 1000, failed={3, 7}), 100.0, 200.0, SlaSpec(max_fail_ratio=0.001))
    assert not result.passed and "failure ratio 0.200% > 0.1%" in result.line()
    assert evaluate(samples([10.0] * 1000, failed={3}), 100.0, 200.0, SlaSpec()).passed
    few = evaluate(samples([10.0] * 20), 100.0, 200.0, SlaSpec(min_requests=100))
    assert not few.passed and "only 20 successful requests" in few.line()


def test_an_empty_window_is_an_error_not_a_pass():
    with pytest.raises(ValueError, match="empty measurement window"):
        evaluate(samples([10.0]), 105.0, 105.0, SlaSpec())


def test_timeline_bins_per_second():
    rows = timeline(samples([10.0] * 300, step=0.01), origin_s=100.0)
    assert [r["t_s"] for r in rows] == [0.0, 1.0, 2.0]
    assert [r["rps"] for r in rows] == [100.0, 100.0, 100.0]


def test_the_worst_stretch_names_the_seconds_that_failed_the_run():
    """A run whose ~3 s stall held 55 of 58 failures: the report names the stretch, which the mean per stage hides."""
    latencies = [20.0] * 2000  # 20 s at 100 requests/s
    latencies[1300:1600] = [780.0] * 300  # seconds 13-15: a stall
    failed = {1320, 1350, 1410, 1480, 1550, 1590, 500}  # six in the stall, one alone at 5 s
    rows = timeline(samples(latencies, failed=failed), origin_s=100.0)
    stretch = worst_stretch(rows, (3.0, 20.0), sla_ms=200.0)
    assert stretch == {"from_s": 13.0, "to_s": 16.0, "failures": 6, "window_failures": 7, "max_p99_ms": 780.0}
    assert stretch_line(stretch) == (
        "Worst stretch: 13-16 s into the run: 6 of the window's 7 failures, per-second p99 up to 780 ms"
    )
    assert worst_stretch(rows, (0.0, 12.0), sla_ms=1000.0) == {
        "from_s": 5.0,
        "to_s": 6.0,
        "failures": 1,
        "window_failures": 1,
        "max_p99_ms": 20.0,
    }
    assert worst_stretch(timeline(samples([20.0] * 500), origin_s=100.0), (0.0, 5.0), sla_ms=200.0) is None
    calm = worst_stretch(timeline(samples(latencies), origin_s=100.0), (3.0, 20.0), sla_ms=200.0)
    assert stretch_line(calm) == "Worst stretch: 13-16 s into the run: per-second p99 up to 780 ms, no failures"


def step(model, requests, *, request_ms, queue=0.0, infer=0.0, cache_hits=0):
    return StepStats(model, requests, 0, request_ms, requests, requests, queue, 0.0, infer, 0.0, cache_hits)


def test_breakdown_weights_steps_by_requests_and_names_the_culprit():
    # 100 ensemble requests, 20 of them cache hits: the steps saw 80.
    steps = {
        "embed": step("embed", 100, request_ms=0.8 * 52.0, cache_hits=20),
        "tokenizer": step("tokenizer", 80, request_ms=2.0, queue=1.0, infer=1.0),
        "encoder": step("encoder", 80, request_ms=50.0, queue=40.0, infer=10.0),
    }
    stages = {s.name: s for s in breakdown(steps, client_mean_ms=45.6)}
    assert stages["encoder queue"].ms == pytest.approx(32.0)
    assert stages["tokenizer compute infer"].ms == pytest.approx(0.8)
    assert stages["ensemble overhead"].ms == pytest.approx(0.0, abs=1e-9)
    assert stages["outside Triton (client + network)"].ms == pytest.approx(45.6 - 41.6)
    assert culprit(list(stages.values())).name == "encoder queue"
    assert sum(s.ms for s in stages.values()) == pytest.approx(45.6)
