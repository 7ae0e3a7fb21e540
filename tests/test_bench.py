"""`make bench` runs end to end (a tiny run: one level, half a second); it asserts the report, not the speed."""

from __future__ import annotations

import json

import pytest

from bench import run as bench_run


def test_bench_runs_every_system_and_writes_the_report(tmp_path, sts_dev):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(p.a for p in sts_dev[:200]))
    code = bench_run.main(
        ["--corpus", str(corpus), "--levels", "1,2", "--duration", "0.5", "--out", str(tmp_path / "out")]
    )
    assert code == 0
    results = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert set(results["systems"]) == {"naive", "triton-fixed128", "triton-buckets", "gateway"}
    for name, data in results["systems"].items():
        assert [lv["concurrency"] for lv in data["levels"]][0] == 1, name  # the sweep may stop early past the SLA
        assert all(lv["requests"] > 0 and lv["errors"] == 0 for lv in data["levels"]), name
    assert results["ceiling"]["throughput"] > 0
    table = (tmp_path / "out" / "bench.md").read_text()
    assert "| triton-buckets |" in table and "| gateway |" in table and "x ceiling" in table
    sizes = results["systems"]["gateway"]["response_bytes"]
    assert sizes["base64"] < sizes["float"] and "gateway vs gRPC: p50 at concurrency 1" in table
    assert (tmp_path / "out" / "bench.png").stat().st_size > 10_000


def test_fixed_length_variant_has_a_single_bucket(tmp_path):
    repo = bench_run.variant_repository(tmp_path / "repo", fixed_length=128)
    encoder = (repo / "encoder" / "config.pbtxt").read_text()
    assert encoder.count("batch_size: 64 input") == 1 and "dim: [ 128 ]" in encoder
    assert "response_cache { enable: false }" in (repo / "embed" / "config.pbtxt").read_text()


@pytest.mark.parametrize("fixed", [None, 128])
def test_variant_keeps_the_artifacts_linked(tmp_path, fixed):
    repo = bench_run.variant_repository(tmp_path / "repo", fixed_length=fixed)
    assert (repo / "encoder" / "1" / "model.pt").resolve().is_file()
    assert (repo / "tokenizer" / "1" / "tokenizer.json").resolve().is_file()
    assert (repo / "tokenizer" / "1" / "prompts.json").resolve().is_file()


def test_levels_with_failed_requests_are_named_under_the_table():
    """A level with failed requests is not eligible for the best point, and the report names it."""
    level = {"concurrency": 1, "throughput": 50.0, "p50_ms": 10.0, "p99_ms": 20.0, "errors": 0, "requests": 400}
    failed = {**level, "concurrency": 32, "errors": 416}
    fixed = {"best": level, "levels": [level, failed]}
    systems = {"naive": {"best": level, "levels": [level]}, "triton-fixed128": fixed}
    results = {"corpus": "c", "machine": "m", "systems": systems}
    args = type("Args", (), {"levels": [1, 32], "duration": 5.0})()
    table = bench_run.markdown(results, {"throughput": 100.0, "single_p50_ms": 5.0, "single_p99_ms": 6.0}, 200.0, args)
    assert "triton-fixed128: requests failed (416 at concurrency 32); those levels were not eligible." in table
    assert "naive: requests failed" not in table
