"""The Locust suite against the real embedded server: SLA gate, report, per-stage blame, gRPC under gevent.

Each run is a real ``python -m locust`` process. Request counts are checked against Locust's own final statistics
and against Triton's statistics API read by the test itself, not only against the report's arithmetic.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from conftest import REPO_ROOT, STS_DIR

from loadtest.report import TRITON_FAILURE_COUNTS

LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"
SLOW_QUEUE_DELAY_US = 400_000  # far above the 200 ms SLA: every lone request waits this long for a batch
GATE_SLA_MS = 1000  # the short run's gate: met by any working server on busy CI cores, where these users' p99 passes
# 200 ms on a slow day; the 200 ms SLA itself is measured by make loadtest (docs/benchmarks.md)
USERS = 3  # under a 2-core CPU's capacity at fp32 (make capacity: 4 users, where the door refuses an 8-text request
# now and then): the short run checks the gate and the report, make loadtest and make capacity measure the machine
RUN_S = 12  # the short run: Locust's ramp (~1 s) and its 3 s warm-up leave ~8 s in the gate's window


@pytest.fixture(scope="module", autouse=True)
def _needs_sts():
    if not (STS_DIR / "sts-train.csv").is_file():
        pytest.skip(f"STS Benchmark not found in {STS_DIR}: the load test's default corpus (set TRITON_EMBED_STS_DIR)")


def ensemble_requests(http_url: str) -> int:
    """Successes plus failures of the ``embed`` ensemble since the server started, read from Triton.

    Triton 2.51 counts each failed ensemble request twice (``loadtest.report.TRITON_FAILURE_COUNTS``): a run with
    refusals in its warm-up (a freshly started, busy machine) would otherwise disagree with Locust's count.
    """
    client = httpclient.InferenceServerClient(http_url)
    try:  # an HTTP client left open keeps its idle connection: tritonserver waits out its exit timeout at the end
        stats = client.get_inference_statistics("embed")["model_stats"][0]
    finally:
        client.close()
    failures = int(stats["inference_stats"]["fail"]["count"]) // TRITON_FAILURE_COUNTS
    return int(stats["inference_stats"]["success"]["count"]) + failures


def locust(srv, folder: Path, *args: str, users: int = USERS, seconds: int = RUN_S):
    """Run Locust headless against ``srv``; returns (completed process, report.json or None, Locust's request total)."""
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--users",
        str(users),
        "--spawn-rate",
        str(users),
        "--run-time",
        f"{seconds}s",
        "--stop-timeout",
        "10",
        "--triton-host",
        "127.0.0.1",
        "--http-port",
        str(srv.config.http_port),
        "--grpc-port",
        str(srv.config.grpc_port),
        "--metrics-port",
        str(srv.config.metrics_port),
        "--warmup-s",
        "3",
        "--report-dir",
        str(folder),
        "--json-file",
        str(folder / "locust"),
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120, check=False)
    path = folder / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else None
    stats = folder / "locust.json"  # Locust's own final statistics (--json-file adds .json; its CSV lags ~1 s)
    total = sum(entry["num_requests"] for entry in json.loads(stats.read_text())) if stats.is_file() else None
    return done, report, total


@pytest.fixture(scope="module")
def grpc_run(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpc-run")
    before = ensemble_requests(server.http_url)
    done, report, locust_total = locust(server, folder, "GrpcUser", "--sla-ms", str(GATE_SLA_MS))
    after = ensemble_requests(server.http_url)
    return done, report, locust_total, after - before, folder


def test_short_run_passes_the_gate_and_writes_the_report(grpc_run):
    done, report, _, _, folder = grpc_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SLA PASS: p99" in done.stdout
    for name in ("report.md", "report.json", "latency.png", "stages.png"):
        assert (folder / name).stat().st_size > 1000, name
    assert (folder / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gate = report["gate"]
    assert gate["passed"] and gate["failures"] == 0
    assert 0 < gate["p50_ms"] <= gate["p95_ms"] <= gate["p99_ms"] <= GATE_SLA_MS
    assert RUN_S - 6 <= gate["window_s"] <= RUN_S - 2  # the run minus the ramp (~1 s) and the 3 s warm-up
    assert gate["throughput_rps"] > 20
    names = {(r["type"], r["name"]) for r in report["requests"]}
    assert names == {("grpc", "embed x1"), ("grpc", "embed x8")}
    assert "SLA PASS" in (folder / "report.md").read_text()


def test_report_has_the_servers_refusal_timeline(grpc_run):
    """Read from the server's /metrics during the run: the encoder's refusal counter, second by second."""
    _, report, _, _, folder = grpc_run
    timeline, window, run = (report["refusals"][key] for key in ("timeline", "window", "run"))
    assert len(timeline) >= RUN_S - 5, timeline  # one read a second
    assert RUN_S - 6 <= window["window_s"] <= RUN_S - 2 and window["window_s"] < run["window_s"]
    # the server counted exactly the refusals the users saw (none, on a machine that is not busy)
    seen = sum(e["count"] for e in report["errors"] if "overloaded" in e["error"])
    assert run["refused"] == seen and window["refused"] <= seen, report["errors"]
    text = (folder / "report.md").read_text()
    assert "## Refusals (window)" in text and f"{run['refused']} over the whole run" in text


def test_request_counts_agree_between_locust_and_triton(grpc_run):
    _, report, locust_total, triton_delta, _ = grpc_run
    assert locust_total > 500
    assert abs(locust_total - triton_delta) <= 0.01 * triton_delta, (locust_total, triton_delta)
    assert report["count_check"]["locust_requests"] == locust_total
    assert report["count_check"]["relative_difference"] <= 0.01


def test_stage_breakdown_is_plausible(grpc_run):
    _, report, _, _, _ = grpc_run
    stages = {s["name"]: s["ms"] for s in report["stages"]}
    assert all(ms >= 0 for ms in stages.values())
    assert stages["encoder compute infer"] > 0 and stages["tokenizer compute infer"] > 0
    client_mean_ms = report["triton"]["window"]["embed"]["request_ms"] + stages["outside Triton (client + network)"]
    assert sum(stages.values()) <= client_mean_ms * 1.05
    assert report["triton"]["window"]["embed"]["requests"] > 100


def test_grpc_users_do_not_block_the_event_loop(grpc_run):
    """Little's law: with USERS users, requests in flight = throughput x mean latency must be near USERS, not 1."""
    _, report, _, _, _ = grpc_run
    gate = report["gate"]
    x1 = next(r for r in report["requests"] if r["name"] == "embed x1")
    in_flight = gate["throughput_rps"] * x1["p50_ms"] / 1000
    assert in_flight > USERS / 2, f"{in_flight:.2f} requests in flight with {USERS} users: gRPC calls block gevent"


def test_impossible_sla_fails_and_http_users_keep_up_with_grpc(server, grpc_run, tmp_path):
    done, report, _ = locust(server, tmp_path, "HttpUser", "--sla-ms", "1")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    verdict = next(line for line in done.stdout.splitlines() if line.startswith("SLA "))
    assert verdict.startswith("SLA FAIL: p99 ") and "> 1 ms" in verdict
    grpc_rps, http_rps = grpc_run[1]["gate"]["throughput_rps"], report["gate"]["throughput_rps"]
    assert 0.5 <= grpc_rps / http_rps <= 2.0, (grpc_rps, http_rps)


@pytest.fixture(scope="module")
def slow_encoder_server(tmp_path_factory):
    """A second server whose encoder waits 400 ms for a batch (a misconfigured dynamic batcher); no shedding (no door,
    no wait budget), which would turn the slow requests into failures: the served p99 over 400 ms narrows the door."""
    from triton_embed_server.embedded import EmbeddedServer

    from bench.serving import variant_repository

    tmp = tmp_path_factory.mktemp("slow")
    repo = variant_repository(
        tmp / "repo",
        encoder_delay_us=SLOW_QUEUE_DELAY_US,
        knobs={("encoder", "LATENCY_BUDGET_MS"): "0", ("encoder", "MAX_IN_FLIGHT"): "0"},
    )
    with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp / "log") as srv:
        yield srv


def test_slow_encoder_fails_the_gate_and_is_blamed(slow_encoder_server, tmp_path):
    done, report, _ = locust(slow_encoder_server, tmp_path, "GrpcUser", "--min-requests", "20")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SLA FAIL: p99" in done.stdout
    assert report["culprit"]["name"] == "encoder queue"
    assert report["culprit"]["ms"] > 200
    assert "Largest stage: encoder queue" in done.stdout
    stretch = report["worst_stretch"]  # every second of the window is over the SLA: the stretch is all of it
    assert stretch["max_p99_ms"] > 200 and stretch["to_s"] - stretch["from_s"] >= 3, stretch
    assert "Worst stretch: " in done.stdout
    assert not report["errors"]  # slow, not refused: the door and the budget are off


def test_missing_corpus_file_is_a_one_line_error(server, tmp_path):
    done, report, _ = locust(server, tmp_path, "--corpus", str(tmp_path / "absent.txt"), seconds=2)
    assert done.returncode != 0 and report is None
    assert f"corpus file {tmp_path / 'absent.txt'} not found" in done.stderr


def test_capacity_search_reports_the_best_passing_step(server, tmp_path):
    ports = [f"--{kind}-port={getattr(server.config, f'{kind}_port')}" for kind in ("http", "grpc", "metrics")]
    common = [sys.executable, "-m", "loadtest.capacity", "--users", "1,3", "--step-s", "5"]
    args = [*ports, "--warmup-s", "2", "--min-requests", "20", "GrpcUser"]
    done = subprocess.run(
        [*common, "--out", str(tmp_path / "ok"), "--", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "ok" / "capacity.json").read_text())
    assert [s["users"] for s in result["steps"]] == [1, 3]  # the first step passes, so the search goes on
    assert result["steps"][0]["passed"], result["steps"][0]["line"]
    assert result["best"]["throughput_rps"] == max(s["throughput_rps"] for s in result["steps"] if s["passed"])
    assert f"Capacity: {result['best']['throughput_rps']:.1f} req/s" in done.stdout
    # a search that never failed says its figure is a lower bound
    assert ("Every step passed: the capacity is at least this" in done.stdout) == result["steps"][-1]["passed"]
    # the second step continued the first one's deck: same order, and it went on past the first step's texts
    decks = [json.loads((tmp_path / "ok" / f"users-{u}" / "report.json").read_text())["run"]["deck"] for u in (1, 3)]
    assert decks[0]["seed"] == decks[1]["seed"] and 0 < decks[0]["dealt"] < decks[1]["dealt"]
    assert [s["dealt"] for s in result["steps"]] == [d["dealt"] for d in decks]

    done = subprocess.run(
        [*common, "--out", str(tmp_path / "fail"), "--", *args, "--sla-ms", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert [s["users"] for s in json.loads((tmp_path / "fail" / "capacity.json").read_text())["steps"]] == [1]
    assert "Capacity: no step passed the SLA gate" in done.stdout
