"""`make bench` runs end to end (a tiny run: one level, half a second); it asserts the report, not the speed. And
``bench.perf_data`` writes perf_analyzer's input file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from helpers import infer, text_tensor
from triton_embed_server import model_config

from bench import run as bench_run
from bench.serving import variant_repository

ROOT = Path(__file__).resolve().parents[1]


def test_bench_runs_every_system_and_writes_the_report(tmp_path, sts_dev):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(p.a for p in sts_dev[:200]))
    code = bench_run.main(
        [
            "--corpus",
            str(corpus),
            "--levels",
            "1,2",
            "--duration",
            "1",
            "--tracing-rounds",
            "1",
            "--tracing-concurrency",
            "2",
            "--pa-levels",
            "",
            "--rerank-sizes",
            "4",
            "--rerank-levels",
            "1",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    results = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert set(results["systems"]) == {
        "naive",
        "infinity",
        "triton-fixed128",
        "triton-buckets",
        "triton-auto",
        "gateway",
    }
    assert results["systems"]["infinity"]["min_cosine"] > 0.9999  # the peer serves the same model at fp32
    assert results["systems"]["triton-auto"]["precision"] in ("bf16", "fp32")  # by the CPU: the gate may say fp32
    table = (tmp_path / "out" / "bench.md").read_text()
    for name, data in results["systems"].items():
        assert [lv["concurrency"] for lv in data["levels"]][0] == 1, name  # the sweep may stop early past the SLA
        assert all(lv["requests"] > 0 for lv in data["levels"]) and data["levels"][0]["errors"] == 0, name
        failed = [lv for lv in data["levels"] if lv["errors"]]
        if name != "triton-fixed128":
            assert not failed, name
        elif failed:  # padded to 128 tokens, its own door may admit 1-2 texts on a slow CPU: it refuses, and says so
            assert f"{name}: requests failed ({failed[0]['errors']} at concurrency {failed[0]['concurrency']}" in table
    assert results["ceiling"]["throughput"] > 0
    assert "| triton-buckets |" in table and "| gateway |" in table and "| infinity |" in table
    assert "x ceiling" in table and "x infinity" in table
    sizes = results["systems"]["gateway"]["response_bytes"]
    assert sizes["base64"] < sizes["float"] and "gateway vs gRPC: p50 at concurrency 1" in table
    assert (tmp_path / "out" / "bench.png").stat().st_size > 10_000
    tracing = results["tracing"]
    assert all(
        tracing[name]["rounds"][0]["errors"] == 0 and tracing[name]["throughput"] > 0 for name in ("off", "adaptive")
    )
    full = tracing["all"]["rounds"][0]  # tritonserver 2.51 can crash with every request traced: the report says so
    assert (full["errors"] == 0 and tracing["all"]["throughput"] > 0) or (
        full["triton_exit"] is not None and f"tritonserver exited with status {full['triton_exit']}," in table
    ), full
    assert full["share"] == 1.0 and tracing["exports"] > 0  # every request traced, spans exported
    assert "| follows load (default) |" in table and "| every request |" in table
    (rerank,) = results["rerank"]["rows"]  # a query with 4 documents, served, in process and in Infinity
    assert rerank["documents"] == 4 and rerank["served"] > 0 and rerank["ceiling"] > 0 and rerank["infinity"] > 0
    assert rerank["infinity_score_diff"] < 1e-4  # the peer scores the same folder as CrossEncoder.predict
    assert "| documents per request | served pairs/s at p99 <= 200 ms |" in table and "\n| 4 | " in table
    for name in ("triton-buckets", "triton-auto"):  # the door each measured on this machine, in the report
        assert results["systems"][name]["door"] >= 1
        assert f"\n{name}: at p99 <= 100 ms " in table and "the door it measured stood at" in table


def test_fixed_length_variant_has_a_single_bucket(tmp_path):
    repo = variant_repository(tmp_path / "repo", fixed_length=128)
    assert model_config.buckets(model_config.read(repo / "encoder" / "config.pbtxt")) == (64, [128])
    embed = model_config.read(repo / "embed" / "config.pbtxt")
    assert embed.HasField("response_cache") and not embed.response_cache.enable


@pytest.mark.parametrize("fixed", [None, 128])
def test_variant_keeps_the_artifacts_linked(tmp_path, fixed):
    repo = variant_repository(tmp_path / "repo", fixed_length=fixed)
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


def test_perf_data_holds_distinct_texts_the_ensemble_serves(tmp_path, server):
    corpus = tmp_path / "queries.txt"
    corpus.write_text("How do I reset my password?\n\nWhere is my order?\nCancel my plan.\n", encoding="utf-8")
    out = tmp_path / "perf.json"
    run = perf_data("--corpus", str(corpus), "--count", "7", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert f"--input-data {out}" in run.stdout  # the perf_analyzer command line to run next
    entries = json.loads(out.read_text())["data"]
    assert [set(e) for e in entries] == [{"TEXT"}] * 7  # no TRUNCATE / PROMPT_NAME for perf_analyzer to fill
    texts = [e["TEXT"]["content"][0] for e in entries]
    assert len(set(texts)) == 7 and texts[3].startswith("How do I reset my password?")
    cache_hits_before = read_cache_hits(server.grpc_url)
    vectors = [infer(server.grpc_url, "embed", {"TEXT": text_tensor([t])}, ["EMBEDDING"])["EMBEDDING"] for t in texts]
    assert all(v.shape == (1, 384) for v in vectors)
    assert read_cache_hits(server.grpc_url) == cache_hits_before  # every request computed, none from the cache

    again = perf_data("--corpus", str(corpus), "--count", "7", "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert not {e["TEXT"]["content"][0] for e in json.loads(out.read_text())["data"]} & set(texts)  # one file per level

    missing = perf_data("--corpus", str(tmp_path / "nope.txt"), "--out", str(out))
    assert missing.returncode == 2 and "nope.txt not found" in missing.stderr


def perf_data(*args: str) -> subprocess.CompletedProcess:
    """``python -m bench.perf_data ARGS`` as a user runs it, from the checkout."""
    command = [sys.executable, "-m", "bench.perf_data", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)  # noqa: S603


def read_cache_hits(grpc_url: str) -> int:
    """Response-cache hits of ``embed`` so far, from Triton's statistics API."""
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        stats = client.get_inference_statistics("embed", as_json=True)["model_stats"][0]["inference_stats"]
        return int(stats.get("cache_hit", {}).get("count", 0))
    finally:
        client.close()
