"""The client library against the real server: every path gives the reference embeddings, in order."""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import reference_embed
from helpers import ByteCountingProxy, counts, read_counts
from triton_embed import AsyncEmbeddingClient, EmbeddingClient, InvalidInputError

VARIANTS = {
    "grpc": {"protocol": "grpc"},
    "http_binary": {"protocol": "http"},
    "http_json": {"protocol": "http", "binary": False},
    "grpc_shm": {"protocol": "grpc", "use_shared_memory": True},
    "http_shm": {"protocol": "http", "use_shared_memory": True},
}


def with_admin_headers(server, options: dict) -> dict:
    """Shared memory registration is an admin API: it needs the server's admin header."""
    if options.get("use_shared_memory"):
        return {**options, "headers": server.admin_headers(options["protocol"])}
    return options


def url_for(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


@pytest.fixture(scope="module")
def sts_500(sts_dev, reference):
    texts = [p.a for p in sts_dev[:250]] + [p.b for p in sts_dev[:250]]
    return texts, reference_embed(reference, texts)


def assert_rows_match(served: np.ndarray, expected: np.ndarray) -> None:
    assert served.shape == expected.shape and served.dtype == np.float32
    cosine = (served * expected).sum(axis=1) / (np.linalg.norm(served, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.9999, f"row {int(cosine.argmin())}: cosine {cosine.min():.6f}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sync_paths_give_reference_embeddings(server, sts_500, variant):
    texts, expected = sts_500
    options = with_admin_headers(server, VARIANTS[variant])
    with EmbeddingClient(url=url_for(server, options["protocol"]), **options) as client:
        served = client.embed(texts)
        assert client.stats().texts == 500
        if options.get("use_shared_memory"):
            assert client.stats().shared_memory_regions >= 1
    assert_rows_match(served, expected)


@pytest.mark.parametrize("variant", ["grpc", "http_binary", "grpc_shm"])
def test_async_paths_give_reference_embeddings(server, sts_500, variant):
    texts, expected = sts_500
    options = with_admin_headers(server, VARIANTS[variant])

    async def main():
        async with AsyncEmbeddingClient(url=url_for(server, options["protocol"]), **options) as client:
            return await client.embed(texts)

    assert_rows_match(asyncio.run(main()), expected)


def test_order_kept_for_1000_texts_across_concurrent_chunks(server, reference):
    texts = [f"text number {i} " + "word " * (i % 37) for i in range(1000)]
    with EmbeddingClient(url=server.grpc_url, max_concurrency=4) as client:
        served = client.embed(texts)
        assert client.stats().requests == 16  # ceil(1000 / 64)
    np.testing.assert_allclose(served, reference_embed(reference, texts), atol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        list,
        tuple,
        np.array,  # <U
        lambda t: np.array(t, dtype=object),
        lambda t: np.array([s.encode() for s in t]),  # |S
        lambda t: np.array(t, dtype=object).reshape(-1, 1),
        lambda t: (s for s in t),
        lambda t: [s.encode() for s in t],
    ],
    ids=["list", "tuple", "unicode_array", "object_array", "bytes_array", "column_array", "generator", "bytes_list"],
)
def test_input_forms(server, reference, make):
    texts = ["A man is playing a guitar.", "Ünïcödé and emoji 🎸"]
    with EmbeddingClient(url=server.grpc_url) as client:
        served = client.embed(make(texts))
    np.testing.assert_allclose(served, reference_embed(reference, texts), atol=1e-5)


def test_single_string_gives_one_row(server, reference):
    with EmbeddingClient(url=server.http_url, protocol="http") as client:
        served = client.embed("one text")
    np.testing.assert_allclose(served, reference_embed(reference, ["one text"]), atol=1e-5)


def test_empty_input_and_non_text_send_no_inference(server):
    before = counts(server.grpc_url, "embed")
    with EmbeddingClient(url=server.grpc_url) as client:
        assert client.embed([]).shape == (0, 384)
        with pytest.raises(InvalidInputError, match=r"texts\[2\] is float"):
            client.embed(["a", "b", 3.5])
        with pytest.raises(InvalidInputError, match=r"texts\[0\] is not valid UTF-8: byte 0x"):
            client.embed([b"\xff"])
        with pytest.raises(InvalidInputError, match=r"shape \(n,\) or \(n, 1\); got \(2, 2\)"):
            client.embed(np.array([["a", "b"], ["c", "d"]]))
        with pytest.raises(InvalidInputError, match=r"got a dict: pass list\(d.values\(\)\) or list\(d\)"):
            client.embed({"a key": 1})  # iterating it would embed the keys without a word
        assert client.stats().requests == 0
    assert counts(server.grpc_url, "embed") == before


def test_8_threads_share_one_client(server, reference):
    jobs = [[f"thread job {i} sentence {j} " + "x " * (i + j) for j in range(i % 5 + 1)] for i in range(40)]
    expected = [reference_embed(reference, job) for job in jobs]
    # latency_budget_ms=0 here and below: these tests are about sharing a client; a burst may be shed on 2 cores
    client = EmbeddingClient(url=server.http_url, protocol="http", latency_budget_ms=0)
    with client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client.embed, jobs))
    for got, want in zip(results, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_64_asyncio_tasks_share_one_client(server, reference):
    jobs = [[f"task {i} says " + "hello " * (i % 9)] * (i % 3 + 1) for i in range(64)]

    async def main():
        async with AsyncEmbeddingClient(url=server.grpc_url, latency_budget_ms=0) as client:
            return await asyncio.gather(*(client.embed(job) for job in jobs))

    for got, job in zip(asyncio.run(main()), jobs, strict=True):
        np.testing.assert_allclose(got, reference_embed(reference, job), atol=1e-5)


def test_coalescing_sends_each_distinct_text_once(server, reference):
    tag = secrets.token_hex(4)
    texts = [f"{tag} first"] * 50 + [f"{tag} second"] * 50 + [f"{tag} third"]
    before = counts(server.grpc_url, "embed")[0]
    with EmbeddingClient(url=server.grpc_url, coalesce=True) as client:
        served = client.embed(texts)
        assert client.stats().texts == 3
    assert counts(server.grpc_url, "embed")[0] - before == 3
    np.testing.assert_allclose(served, reference_embed(reference, texts), atol=1e-5)

    before = counts(server.grpc_url, "embed")[0]
    with EmbeddingClient(url=server.grpc_url) as client:  # off by default: every row is sent
        client.embed([f"{tag} again"] * 10)
    assert counts(server.grpc_url, "embed")[0] - before == 10


def test_concurrent_callers_wait_for_texts_in_flight_instead_of_sending_them_again(server, reference):
    """coalesce=True: seven callers ask for 32 texts that another call has in flight (they have passed the tokenizer
    and the encoder works on them, by Triton's statistics), each plus one text of its own. The server gets each
    text once: the 32 shared texts and the seven others, 39 of the 256 asked for; every caller gets its rows."""
    tag = secrets.token_hex(4)
    shared = [" ".join(f"w{i}x{j}" for j in range(200)) + f" {tag}" for i in range(32)]  # ~1-3 s of encoder work
    own = [[*shared, f"caller {k} own text {tag}"] for k in range(7)]
    with (
        EmbeddingClient(url=server.grpc_url, coalesce=True, latency_budget_ms=0, timeout_s=60) as client,
        ThreadPoolExecutor(8) as pool,
    ):
        client.max_batch_size  # noqa: B018 - the model config, fetched before the calls
        tokenized_before, sent_before = counts(server.grpc_url, "tokenizer")[0], counts(server.grpc_url, "embed")[0]
        first = pool.submit(client.embed, shared)
        deadline = time.monotonic() + 30
        while read_counts(server.grpc_url, "tokenizer")[0] < tokenized_before + len(shared):
            assert time.monotonic() < deadline and not first.done(), "the first call never reached the encoder"
            time.sleep(0.01)
        assert not first.done(), "the first call was answered before the others asked: nothing was in flight"
        others = [pool.submit(client.embed, texts) for texts in own]
        results = [first.result(timeout=120)] + [f.result(timeout=120) for f in others]
    sent = counts(server.grpc_url, "embed")[0] - sent_before
    assert sent == len(shared) + len(own), f"{sent} texts sent for {len(shared)} shared and {len(own)} own ones"
    np.testing.assert_allclose(results[0], reference_embed(reference, shared), atol=1e-5)
    for texts, got in zip(own, results[1:], strict=True):
        np.testing.assert_array_equal(got[: len(shared)], results[0])  # the first call's rows, not computed again
        np.testing.assert_allclose(got[-1:], reference_embed(reference, texts[-1:]), atol=1e-5)


def test_http_binary_is_at_least_3x_smaller_on_the_wire_than_json(server):
    port = int(server.http_url.rsplit(":", 1)[1])
    wire = {}
    for binary in (True, False):
        proxy = ByteCountingProxy(port)
        try:
            with EmbeddingClient(url=f"127.0.0.1:{proxy.port}", protocol="http", binary=binary) as client:
                client._model_config()  # fetch the config first, so only the inference is compared
                start = proxy.sent + proxy.received
                client.embed(["A man is playing a guitar."])
                reported = client.stats()
            wire[binary] = proxy.sent + proxy.received - start
        finally:
            proxy.close()
        assert reported.bytes_sent + reported.bytes_received <= wire[binary]  # bodies only, headers excluded
    assert wire[False] >= 3 * wire[True], wire


def child_embed(client: EmbeddingClient, queue) -> None:
    queue.put(client.embed(["embedded in a forked child"]))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_client_works_in_a_forked_child(server, reference, protocol):
    with EmbeddingClient(url=url_for(server, protocol), protocol=protocol) as client:
        client.embed(["used in the parent first"])
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=child_embed, args=(client, queue))
        child.start()
        got = queue.get(timeout=60)
        child.join(timeout=30)
        assert child.exitcode == 0
        assert client.embed(["the parent still works"]).shape == (1, 384)
    np.testing.assert_allclose(got, reference_embed(reference, ["embedded in a forked child"]), atol=1e-5)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_shared_memory_without_the_admin_header_falls_back_to_the_network(server, reference, protocol):
    texts = [f"fallback text {i}" for i in range(70)]  # two chunks: both threads meet the refusal
    client = EmbeddingClient(url=url_for(server, protocol), protocol=protocol, use_shared_memory=True)
    with pytest.warns(RuntimeWarning, match="shared memory registration .* failed") as warned, client:
        served, embed_line = client.embed(texts), inspect.currentframe().f_lineno
        assert client.stats().shared_memory_regions == 0
        served_again = client.embed(texts[:3])
    np.testing.assert_allclose(served, reference_embed(reference, texts), atol=1e-5)
    np.testing.assert_allclose(served_again, served[:3], atol=1e-6)
    # once, and at the caller's line (the chunks ran in worker threads)
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, embed_line)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_async_clients_shared_memory_fallback_warns_at_the_callers_line(server, protocol):
    async def main():
        texts = [f"async fallback text {i}" for i in range(70)]  # two chunks, two tasks
        async with AsyncEmbeddingClient(url=url_for(server, protocol), protocol=protocol, use_shared_memory=True) as c:
            return await c.embed(texts), inspect.currentframe().f_lineno

    with pytest.warns(RuntimeWarning, match="shared memory registration .* failed") as warned:
        served, line = asyncio.run(main())
    assert served.shape == (70, 384)
    assert [(w.filename, w.lineno) for w in warned] == [(__file__, line)]


def shortest(pairs, n: int) -> list[str]:
    """The ``n`` shortest distinct STS-B sentences (5-10 tokens)."""
    return sorted({p.a for p in pairs} | {p.b for p in pairs}, key=len)[:n]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_bulk_call_on_an_idle_server_is_not_refused_without_retries(server, sts_dev, reference, protocol):
    # 300 new short texts = 5 chunks, 4 at once: more encoder work than a 180 ms budget (the GPU config's) on 2 cores,
    # so under a wait budget the later chunks would be refused for waiting behind the earlier ones; the chunks of one
    # call go with latency_budget_ms=0.
    tag = secrets.token_hex(4)
    texts = [f"{text} {tag}" for text in shortest(sts_dev, 300)]
    with EmbeddingClient(url=url_for(server, protocol), protocol=protocol, retries=0) as client:
        served = client.embed(texts)
    np.testing.assert_allclose(served, reference_embed(reference, texts), atol=1e-5)


def test_an_async_bulk_call_on_an_idle_server_is_not_refused_without_retries(server, sts_dev, reference):
    tag = secrets.token_hex(4)
    texts = [f"{text} {tag}" for text in shortest(sts_dev, 300)]

    async def run() -> np.ndarray:
        async with AsyncEmbeddingClient(url=server.grpc_url, retries=0) as client:
            return await client.embed(texts)

    np.testing.assert_allclose(asyncio.run(run()), reference_embed(reference, texts), atol=1e-5)
