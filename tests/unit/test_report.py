"""The load-test report on recorded inputs: GPU rows and flagged episodes, missing statistics, cache-hit warning."""

from __future__ import annotations

import pytest
from triton_embed.server_stats import StepStats
from triton_embed_monitor import Episode, GpuSample

from loadtest import report
from loadtest.gate import Sample, SlaSpec, evaluate
from loadtest.stages import breakdown

pytestmark = pytest.mark.full_install  # the report draws with matplotlib (the loadtest extra)

RUN = {
    "started": "2026-11-30 00:00:00 UTC",
    "started_s": 100.0,
    "target": "127.0.0.1",
    "users": 4,
    "spawn_rate": 4,
    "warmup_s": 1.0,
    "user_classes": ["GrpcUser"],
    "corpus": "test",
}


def gpu(t, util):
    return GpuSample(t, 0, "NVIDIA H200", "GPU-0", util, 10.0, 2**30, 2**37, 1980.0, 300.0, 40.0, ((1, 2**29),))


def make(steps, gpu_rows=None, refusals=None):
    samples = [Sample(101.0 + i * 0.01, 20.0, "embed x1", "grpc", False) for i in range(200)]
    gate = evaluate(samples, 101.0, 103.0, SlaSpec())
    stages = breakdown(steps, 20.0) if steps else []
    return report.build(
        run=RUN,
        gate=gate,
        samples=samples,
        window_s=(101.0, 103.0),
        steps_run=steps,
        steps_window=steps,
        stages=stages,
        gpu=gpu_rows,
        refusals=refusals,
    )


def step(model, requests, cache_hits=0):
    return StepStats(model, requests, 0, 15.0, requests, requests, 1.0, 0.0, 10.0, 0.0, cache_hits)


def test_gpu_rows_and_episodes_reach_the_markdown(tmp_path):
    samples = [gpu(100.0 + i, u) for i, u in enumerate([5.0, 97.0, 98.0, 99.0])]
    rows = report.gpu_summary(samples, [Episode("saturated", 0, 101.0, 103.0, 3), Episode("saturated", 1, 0, 1, 2)])
    assert rows[0]["gpu_util_mean_pct"] == 74.75 and rows[0]["gpu_util_max_pct"] == 99.0
    assert rows[0]["episodes"] == [{"kind": "saturated", "start_s": 101.0, "duration_s": 2.0}]  # GPU 1's is not ours
    steps = {"embed": step("embed", 200), "tokenizer": step("tokenizer", 200), "encoder": step("encoder", 200)}
    report.write(make(steps, rows), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "| 0 | NVIDIA H200 | 4 | 75 | 99 | 1024 | 300 |" in text
    assert "- GPU 0: **saturated** for 2.0 s" in text


def test_failures_are_listed_by_message(tmp_path):
    steps = {"embed": step("embed", 200), "tokenizer": step("tokenizer", 200), "encoder": step("encoder", 200)}
    data = make(steps)
    bad = [Sample(101.0, 5.0, "embed x1", "grpc", True, "ServerUnavailableError: overloaded")] * 3
    data["errors"] = report.errors(bad + [Sample(101.0, 5.0, "embed x8", "http", True, "EmbeddingTimeoutError: t")])
    assert data["errors"][0] == {
        "type": "grpc",
        "name": "embed x1",
        "error": "ServerUnavailableError: overloaded",
        "count": 3,
    }
    assert "| grpc | embed x1 | 3 | ServerUnavailableError: overloaded |" in report._markdown(data)


def test_failures_that_differ_only_in_their_numbers_are_one_kind():
    def refused(waited: int, budget: int) -> Sample:
        message = f"ServerUnavailableError: overloaded: the request waited {waited} ms in the encoder's queue, over "
        return Sample(101.0, 5.0, "embed x1", "grpc", True, message + f"the {budget} ms latency budget")

    timeout = Sample(101.0, 5.0, "embed x1", "grpc", True, "EmbeddingTimeoutError: no answer within 10 s")
    kinds = report.errors([refused(193, 180), refused(204, 180), refused(377, 180), timeout, refused(185, 100)])
    assert [(k["count"], k["error"]) for k in kinds] == [
        (
            4,
            "ServerUnavailableError: overloaded: the request waited 193 ms in the encoder's queue, over the 180 ms "
            "latency budget",
        ),
        (1, "EmbeddingTimeoutError: no answer within 10 s"),
    ]


def test_cache_hits_are_called_out():
    steps = {"embed": step("embed", 200, 50), "tokenizer": step("tokenizer", 150), "encoder": step("encoder", 150)}
    text = report._markdown(make(steps))
    assert "50 of 200 requests (25%) were answered from the response cache" in text
    assert "the tokenizer's and the encoder's requests are fewer by as many" in text  # why 150, not 200, below it
    assert "No GPU samples" in text


def test_a_report_without_triton_statistics_still_has_the_verdict(tmp_path):
    data = make({})
    assert data["count_check"]["triton_requests"] is None and data["culprit"] is None
    report.write(data, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert text.count("SLA PASS") == 1 and "could not be read at the end of the run" in text


def test_the_count_check_allows_for_triton_counting_each_failed_ensemble_request_twice():
    # 200 requests as Locust saw them: Triton 2.51 reports 190 successes and 20 failures for 10 failed requests.
    embed = StepStats("embed", 190, 2 * 10, 15.0, 190, 190, 1.0, 0.0, 10.0, 0.0, 0)
    data = make({"embed": embed, "tokenizer": step("tokenizer", 200), "encoder": step("encoder", 190)})
    assert data["count_check"]["triton_requests"] == 200
    assert data["count_check"]["relative_difference"] == 0.0


SCRAPE = """# HELP triton_embed_shed_requests_total Requests refused
# TYPE triton_embed_shed_requests_total counter
triton_embed_shed_requests_total{{model="encoder"}} {refused}
# TYPE nv_inference_count counter
nv_inference_count{{model="embed",version="1"}} 5
"""


def test_refusal_reads_become_per_second_rows_and_a_window_summary(tmp_path):
    from loadtest import refusals

    reads = [(100.0, 0), (101.0, 0), (102.0, 30), (103.0, 50), (104.0, 53)]
    samples = [refusals.parse(SCRAPE.format(refused=r), t) for t, r in reads]
    assert samples[2] == refusals.RefusalSample(102.0, 30)
    assert refusals.parse('nv_inference_count{model="embed"} 5\n', 100.0) is None  # no refusal counter published
    rows = refusals.per_second(samples, origin_s=100.0)
    assert [r["t_s"] for r in rows] == [0.0, 1.0, 2.0, 3.0]  # the read at 102 s closes second 1 (101-102 s)
    assert [r["refused_per_s"] for r in rows] == [0.0, 30.0, 20.0, 3.0]
    window = refusals.summary(samples, (101.0, 104.0))
    assert window == {"refused": 53, "window_s": 3.0}
    assert refusals.summary(samples, (103.5, 104.0)) is None  # one read in the window: no figure

    run = refusals.summary(samples, (100.0, float("inf")))
    assert run == {"refused": 53, "window_s": 4.0}

    data = make({}, refusals={"timeline": rows, "window": refusals.summary(samples, (102.0, 104.0)), "run": run})
    report.write(data, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "The encoder refused 23 requests as overloaded in the window's 2 s, 53 over the whole run" in text
    assert (tmp_path / "latency.png").stat().st_size > 1000


def test_a_report_without_refusal_reads_says_why():
    text = report._markdown(make({}))
    assert "No refusal figures: the server publishes no `triton_embed_shed_requests_total`" in text


def test_a_late_refusal_read_spreads_its_refusals_over_the_seconds_it_spanned():
    from loadtest import refusals

    reads = [(100.0, 0), (101.0, 0), (104.0, 30), (104.5, 35)]
    rows = refusals.per_second([refusals.parse(SCRAPE.format(refused=r), t) for t, r in reads], origin_s=100.0)
    assert [r["t_s"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0]  # no second without a row: 102 and 103 were missed
    assert [r["refused_per_s"] for r in rows] == [0.0, 10.0, 10.0, 10.0, 10.0]


def test_stage_total_row_explains_a_sum_past_100_percent(tmp_path):
    # The steps' means (15 ms each) exceed the ensemble's (15 ms): the overhead residual is clamped at 0.
    steps = {"embed": step("embed", 200), "tokenizer": step("tokenizer", 200), "encoder": step("encoder", 200)}
    report.write(make(steps), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "| total | 27.00 | 135% |" in text
    assert "The stages add up to 135.0% of the client's mean" in text


def test_stage_total_row_is_quiet_when_the_stages_add_up(tmp_path):
    def stats(model, request_ms, queue_ms, infer_ms):
        return StepStats(model, 200, 0, request_ms, 200, 200, queue_ms, 0.0, infer_ms, 0.0, 0)

    steps = {"embed": stats("embed", 15.0, 0.0, 0.0), "tokenizer": stats("tokenizer", 5.5, 0.5, 5.0)}
    steps["encoder"] = stats("encoder", 5.5, 0.5, 5.0)
    report.write(make(steps), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "| ensemble overhead | 4.00 | 20% |" in text and "| total | 20.00 | 100% |" in text
    assert "The stages add up to" not in text


def test_a_run_failed_by_refusals_points_at_make_capacity():
    from loadtest import refusals

    line = refusals.past_capacity_line(failures=69, refused=64)
    assert line is not None and line.startswith("64 of the 69 failures were refused as overloaded")
    assert "make capacity" in line
    assert refusals.past_capacity_line(failures=40, refused=10) is None  # mostly errors, not refusals: no such hint
    assert refusals.past_capacity_line(failures=0, refused=3) is None  # refusals the users never saw fail
