"""``make tune`` (bench/tune.py): it serves each candidate, measures it, and writes the best into the config, which
then serves. A tiny model, two candidates and short levels keep it to seconds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import infer, text_tensor
from small_models import repository_for, small_sentence_transformer
from triton_embed_server import model_config
from triton_embed_server.embedded import EmbeddedServer

from bench.tune import MARK, Candidate, best, candidates, write_encoder

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_the_candidates_split_the_cores_and_the_best_is_the_fastest_within_the_target():
    assert candidates(2, [1, 2, 3], [0, 2000]) == [
        Candidate(1, 2, 0),
        Candidate(1, 2, 2000),
        Candidate(2, 1, 0),
        Candidate(2, 1, 2000),
    ]
    assert candidates(2, [1], [0], (True, False)) == [Candidate(1, 2, 0, True), Candidate(1, 2, 0, False)]
    assert candidates(1, [2], [0]) == [Candidate(1, 1, 0)]
    rows = [(8, 100.0, 90.0), (16, 150.0, 180.0), (32, 160.0, 260.0)]
    assert best(rows, 200).throughput == 150.0 and best(rows, 50) is None


def test_the_config_takes_a_candidate_and_a_later_run_replaces_its_comment(tmp_path):
    config = tmp_path / "config.pbtxt"
    shutil.copy(ROOT / "model_repository" / "encoder" / "config.pbtxt", config)
    write_encoder(config, Candidate(2, 1, 2000, half_steps=False), 256, ["first run", "chosen: 2 x 1"])
    once = model_config.read(config)
    assert model_config.buckets(once) == (64, [8, 16, 32, 64, 128, 256])
    assert once.instance_group[0].count == 2 and model_config.parameter(once, "TORCH_NUM_THREADS") == "1"
    assert once.dynamic_batching.max_queue_delay_microseconds == 2000
    assert model_config.header(config)[-2:] == [f"{MARK} first run", f"{MARK} chosen: 2 x 1"]
    write_encoder(config, Candidate(1, 2, 0), 256, ["second run"])
    twice, header = model_config.read(config), model_config.header(config)
    assert f"{MARK} first run" not in header and header[-1] == f"{MARK} second run"
    assert header[0].startswith("encoder: TorchScript")  # the template's own header stays
    assert 24 in model_config.buckets(twice)[1] and 192 in model_config.buckets(twice)[1]
    assert twice.instance_group[0].count == 1 and twice.dynamic_batching.max_queue_delay_microseconds == 0


@pytest.mark.whole_machine
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores for two candidates")
def test_make_tune_writes_the_fastest_candidate_into_a_config_that_serves(tmp_path):
    model = small_sentence_transformer(tmp_path / "st", 32)
    repo = repository_for(model, tmp_path / "repo")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"a user's own sentence number {i}\n" for i in range(500)))
    run = subprocess.run(  # noqa: S603 - our own module
        [
            sys.executable,
            "-m",
            "bench.tune",
            "--repository",
            str(repo),
            "--corpus",
            str(corpus),
            "--tool",
            "client",
            "--levels",
            "8",
            "--seconds",
            "2",
            "--instances",
            "1,2",
            "--delays-us",
            "0",
            "--buckets",
            "x1.5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    table = {
        m[0]: float(m[1]) for m in re.findall(r"  (\d x \d threads, delay 0 us, buckets x1.5): (\d+) req/s", run.stdout)
    }
    assert set(table) == {"1 x 2 threads, delay 0 us, buckets x1.5", "2 x 1 threads, delay 0 us, buckets x1.5"}, (
        run.stdout
    )
    chosen = max(table, key=table.get)
    assert f"{MARK} chosen: {chosen}" in model_config.header(repo / "encoder" / "config.pbtxt")
    config = model_config.read(repo / "encoder" / "config.pbtxt")
    instances, threads = int(chosen[0]), int(chosen[4])
    assert config.instance_group[0].count == instances
    assert model_config.parameter(config, "TORCH_NUM_THREADS") == str(threads)
    with EmbeddedServer(
        model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log"
    ) as server:
        served = infer(server.grpc_url, "embed", {"TEXT": text_tensor(["served by the tuned config"])}, ["EMBEDDING"])
    assert served["EMBEDDING"].shape == (1, 32)
