"""Dynamic batching: order is kept under concurrent load, and requests of different lengths share executions."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import reference_embed
from helpers import counts, infer, text_tensor
from triton_embed import AsyncEmbeddingClient, EmbeddingClient
from triton_embed_server.embedded import EmbeddedServer

from bench.serving import variant_repository

WORDS = [
    "the",
    "a",
    "man",
    "woman",
    "child",
    "dog",
    "plays",
    "runs",
    "guitar",
    "piano",
    "street",
    "park",
    "quickly",
    "slowly",
    "under",
    "over",
]


def varied_texts(seed: int, count: int) -> list[str]:
    """Texts of 1..60 words, so requests and rows differ in token length."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 60)))) for _ in range(count)]


def test_ensemble_keeps_order_under_16_threads(server, reference):
    jobs = [varied_texts(seed, int(seed % 5) + 1) for seed in range(96)]  # requests of 1..5 texts
    expected = reference_embed(reference, [t for job in jobs for t in job])

    def run(job):
        # latency_budget_ms=0: this test is about order; 16 threads of long texts may be shed on 2 cores
        with EmbeddingClient(url=server.grpc_url, latency_budget_ms=0) as client:
            return client.embed(job)

    with ThreadPoolExecutor(16) as pool:
        served = np.concatenate(list(pool.map(run, jobs)))
    np.testing.assert_allclose(served, expected, atol=1e-5)


BULK = {"latency_budget_ms": 0}  # the bulk lane: waits for room instead of being refused


def test_tokenizer_step_keeps_order_under_16_threads(server, reference):
    jobs = [varied_texts(1000 + seed, int(seed % 4) + 1) for seed in range(64)]

    def run(job):
        # latency_budget_ms 0: this test is about order; the door measured on a busy machine may be below 64 texts
        tensors = {"TEXT": text_tensor(job)}
        out = infer(server.grpc_url, "tokenizer", tensors, ["input_ids", "attention_mask"], parameters=BULK)
        return job, out

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    for job, out in results:
        want = reference.tokenize(job)
        width = int(want["attention_mask"].sum(dim=1).max())  # the request's own longest text, no more
        assert out["input_ids"].shape == (len(job), width)
        np.testing.assert_array_equal(out["input_ids"], want["input_ids"][:, :width].numpy())
        np.testing.assert_array_equal(out["attention_mask"], want["attention_mask"][:, :width].numpy())


def test_encoder_step_keeps_order_under_16_threads(server, reference):
    jobs = [varied_texts(2000 + seed, int(seed % 3) + 1) for seed in range(48)]

    def run(job):
        features = reference.tokenize(job)
        inputs = {
            "input_ids": features["input_ids"].numpy().astype(np.int64),
            "attention_mask": features["attention_mask"].numpy().astype(np.int64),
        }
        return infer(server.grpc_url, "encoder", inputs, ["embedding__0"])["embedding__0"]

    with ThreadPoolExecutor(16) as pool:
        served = np.concatenate(list(pool.map(run, jobs)))
    np.testing.assert_allclose(served, reference_embed(reference, [t for j in jobs for t in j]), atol=1e-5)


@pytest.fixture(scope="module")
def windowed_server(tmp_path_factory):
    """The shipped repository with a 200 ms batching window on the encoder (shipped: 0), so concurrent requests
    deterministically meet in the queue, and load shedding off (the window alone would exceed its budget)."""
    tmp = tmp_path_factory.mktemp("windowed")
    repo = variant_repository(
        tmp / "repo",
        encoder_delay_us=200_000,
        knobs={("encoder", "LATENCY_BUDGET_MS"): "0", ("encoder", "MAX_IN_FLIGHT"): "0"},
    )
    with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp / "log") as srv:
        yield srv


def test_two_requests_of_different_lengths_share_one_encoder_execution(windowed_server):
    # Ragged batching: without allow_ragged_batch Triton never merges [1, 4] and [1, 40] shaped requests (seen:
    # executions 2, 2, 2). With it they meet in the 200 ms window; on this shared machine one try in a few
    # missed it, and once in CI 3 tries in a row did (a busy spell), so up to 5 tries.
    url = windowed_server.grpc_url
    seen = []
    for attempt in range(5):
        short = f"short {attempt}"
        long = f"{attempt} " + " ".join(["considerably longer sentence"] * 12)
        before = counts(url, "encoder")
        barrier = threading.Barrier(2)

        def send(text, barrier=barrier):
            with EmbeddingClient(url=url, retries=0) as client:
                client.max_batch_size  # noqa: B018 - fetch the config before the barrier
                barrier.wait()
                return client.embed([text])

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(send, [short, long]))
        after = counts(url, "encoder")
        assert all(r.shape == (1, 384) for r in results)
        seen.append((after[0] - before[0], after[1] - before[1]))
        if seen[-1] == (2, 1):
            break
    assert (2, 1) in seen, f"(texts, executions) per pair: {seen}"


def test_tasks_sharing_one_async_client_are_not_held_back_by_its_chunk_limit(windowed_server):
    # 16 tasks, one text each, on one client whose max_concurrency (chunks of ONE long list) is 4: all 16 requests
    # are in flight together and meet in one 200 ms window. Were the limit applied to every request, they would
    # go 4 at a time, one window each: 4 executions.
    url = windowed_server.grpc_url

    async def run() -> list:
        async with AsyncEmbeddingClient(url=url, retries=0, max_concurrency=4) as client:
            await client.embed(["warm the config"])
            before = counts(url, "encoder")
            results = await asyncio.gather(*(client.embed([f"task {i} of sixteen"]) for i in range(16)))
            return results, before, counts(url, "encoder")

    results, before, after = asyncio.run(run())
    assert all(r.shape == (1, 384) for r in results)
    texts, executions = after[0] - before[0], after[1] - before[1]
    assert texts == 16 and executions <= 2, (texts, executions)


@pytest.mark.parametrize("sizes", [(2, 3, 1), (64, 1), (7, 7, 7, 7)])
def test_uneven_concurrent_requests_get_their_own_rows(server, reference, sizes):
    jobs = [varied_texts(3000 + i * 10 + n, n) for i, n in enumerate(sizes)]

    def run(job):
        with EmbeddingClient(url=server.http_url, protocol="http", latency_budget_ms=0) as client:  # rows, not shedding
            return client.embed(job)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for job, got in zip(jobs, results, strict=True):
        assert got.shape == (len(job), 384)
        np.testing.assert_allclose(got, reference_embed(reference, job), atol=1e-5)


def test_requests_sent_together_after_an_idle_spell_are_not_held_500_ms(server):
    """Triton 2.51's dynamic batcher with a queue policy holds one of 4 requests sent together after 0.3 s idle for
    exactly 500 ms (or 1,000) in about 1 round in 4 (docs/benchmarks.md, "Queue policy"): no step may have one.
    A stall of the shared machine may hit one round."""

    def one(text: str) -> float:
        start = time.perf_counter()
        infer(
            server.grpc_url, "embed", {"TEXT": text_tensor([text])}, ["EMBEDDING"], parameters={"latency_budget_ms": 0}
        )
        return (time.perf_counter() - start) * 1000

    held = []
    with ThreadPoolExecutor(4) as pool:
        for _ in range(30):
            time.sleep(0.3)
            tag = uuid.uuid4().hex  # new texts: the response cache cannot answer them
            slowest = max(pool.map(one, [f"sent together {tag} {i}" for i in range(4)]))
            if slowest > 450:
                held.append(round(slowest))
    assert len(held) <= 1, f"rounds with a request held over 450 ms: {held}"
