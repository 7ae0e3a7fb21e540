"""Shared memory lifecycle, and behaviour when the server goes away and comes back."""

from __future__ import annotations

import ast
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import reference_embed
from helpers import ClosingProxy
from triton_embed import AsyncEmbeddingClient, EmbeddingClient, EmbeddingError, ServerUnavailableError
from triton_embed.errors import EmbeddingTimeoutError, InvalidInputError, from_triton
from triton_embed.shm import unregister_when_released
from triton_embed.transport import retryable
from triton_embed_server.embedded import EmbeddedServer


def server_regions(grpc_url: str, headers: dict) -> list[str]:
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        status = client.get_system_shared_memory_status(as_json=True, headers=headers)
    finally:
        client.close()
    return [r["name"] for r in status.get("regions", {}).values()]


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_shared_memory_regions_are_gone_after_close(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    client = EmbeddingClient(url=url, protocol=protocol, use_shared_memory=True, headers=server.admin_headers(protocol))
    client.embed([f"region test {i}" for i in range(70)])  # two chunks, two regions in flight
    mine = client._shm.regions
    assert mine and set(mine) <= set(server_regions(server.grpc_url, server.admin_headers("grpc")))
    client.close()
    assert not set(mine) & set(server_regions(server.grpc_url, server.admin_headers("grpc")))
    assert not [n for n in os.listdir("/dev/shm") if any(n == m for m in mine)]


def test_open_close_cycles_do_not_grow_memory(server):
    def cycle():
        with EmbeddingClient(
            url=server.grpc_url, use_shared_memory=True, headers=server.admin_headers("grpc")
        ) as client:
            client.embed(["memory cycle text"] * 8)

    for _ in range(5):  # warm up allocators and imports
        cycle()
    before = rss_kib()
    for _ in range(30):
        cycle()
    grown = rss_kib() - before
    assert grown < 8 * 1024, f"RSS grew by {grown} KiB over 30 open/close cycles"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"triton_embed_{os.getpid()}_")]
    assert not [
        n
        for n in server_regions(server.grpc_url, server.admin_headers("grpc"))
        if n.startswith(f"triton_embed_{os.getpid()}_")
    ]


def unregister_by(way: str, server, name: str) -> None:
    """``unregister(name)`` as the sync clients (:func:`unregister_when_released`) or the asyncio client do it."""
    if way == "sync":
        raw = grpcclient.InferenceServerClient(server.grpc_url)
        unregister_when_released(
            lambda n: raw.unregister_system_shared_memory(n, headers=server.admin_headers("grpc")), name
        )
        raw.close()
        return

    async def call():
        async with AsyncEmbeddingClient(url=server.grpc_url, headers=server.admin_headers("grpc")) as client:
            await client._unregister_when_released(name)

    asyncio.run(call())


@pytest.mark.parametrize("way", ["sync", "asyncio"])
def test_unregister_waits_until_the_server_lets_go_of_a_region(server, way):
    """Triton 2.51 refuses to unregister a region that a request holds, and lets go of it only after the response is
    sent; a close right after a response (1 in 300 on busy cores) left the region registered on the server."""
    unique = str(time.time_ns())  # no response-cache hit
    # 16 texts of 256 tokens: ~1.3 s of encoder work on 2 cores, so the request still holds the region when the
    # unregister comes (0.5 s in) and lets go of it within the unregister's 5 s (64 such texts took ~5 s)
    texts = [" ".join(f"w{i}x{j}" for j in range(200)) + unique for i in range(16)]
    client = EmbeddingClient(
        url=server.grpc_url,
        use_shared_memory=True,
        latency_budget_ms=0,
        timeout_s=60,
        headers=server.admin_headers("grpc"),
    )
    try:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(client.embed, texts)
            deadline = time.monotonic() + 10
            while not set(client._shm.regions) & set(server_regions(server.grpc_url, server.admin_headers("grpc"))):
                assert time.monotonic() < deadline, "the client never registered its region"
                time.sleep(0.01)
            time.sleep(0.5)  # the request reaches the server and takes hold of the region
            (name,) = client._shm.regions
            unregister_by(way, server, name)
            # served: an unregister that did not wait for the server to let go would have failed the request
            assert slow.result(timeout=60).shape == (16, 384)
        assert name not in server_regions(server.grpc_url, server.admin_headers("grpc"))
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_call_whose_kept_alive_connection_closes_under_it_is_sent_again_on_a_new_one(server, reference, kind):
    """HTTP through a relay that closes each connection after one answer, as a server's idle timeout or an nginx
    reload does while the client reuses it: with ``retries=0`` every call is answered with the right vectors, no retry
    or error is counted, and each answer came on a connection of its own."""
    proxy = ClosingProxy(int(server.http_url.rsplit(":", 1)[1]))
    texts = [[f"{kind} call {i} through a closing relay {time.time_ns()}"] for i in range(4)]
    try:
        if kind == "asyncio":

            async def calls() -> tuple[list[np.ndarray], AsyncEmbeddingClient]:
                async with AsyncEmbeddingClient(url=f"127.0.0.1:{proxy.port}", protocol="http", retries=0) as client:
                    return [await client.embed(t) for t in texts], client

            got, client = asyncio.run(calls())
        else:
            with EmbeddingClient(url=f"127.0.0.1:{proxy.port}", protocol="http", retries=0) as client:
                got = [client.embed(t) for t in texts]
    finally:
        proxy.close()
    for t, vectors in zip(texts, got, strict=True):
        np.testing.assert_allclose(vectors, reference_embed(reference, t), atol=1e-5)
    assert (client.stats().retries, client.stats().errors) == (0, 0), client.stats()
    assert proxy.connections >= 1 + len(texts), f"{proxy.connections} connections for the config and {len(texts)} calls"


@pytest.mark.parametrize("protocol", ["grpc", "http", "aio-grpc", "aio-http"])
def test_a_timeout_is_a_timeout_error_and_is_not_retried(server, protocol):
    """Both protocols, sync and asyncio: the HTTP client's socket timeout is a timeout, not an outage to retry."""
    transport = protocol.removeprefix("aio-")
    url = server.grpc_url if transport == "grpc" else server.http_url
    unique = f"{protocol} {time.time_ns()}"  # no response-cache hit
    texts = [" ".join(f"w{i}x{j}" for j in range(200)) + unique for i in range(64)]  # ~1 s of encoder work
    if protocol.startswith("aio-"):

        async def call() -> AsyncEmbeddingClient:
            async with AsyncEmbeddingClient(url=url, protocol=transport, timeout_s=0.05, retries=2) as client:
                with pytest.raises(EmbeddingTimeoutError):
                    await client.embed(texts)
            return client

        client = asyncio.run(call())
    else:
        with (
            EmbeddingClient(url=url, protocol=transport, timeout_s=0.05, retries=2) as client,
            pytest.raises(EmbeddingTimeoutError),
        ):
            client.embed(texts)
    assert client.stats().retries == 0 and client.stats().errors == 1
    # the abandoned request still runs (~1 s); wait it out (budget 0: queued, never refused) so that the next
    # tests do not find the encoder busy with it
    with EmbeddingClient(url=server.grpc_url, latency_budget_ms=0, timeout_s=60) as drain:
        drain.embed([f"after the timeout {unique}"])


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_timeout_s_bounds_every_grpc_call_to_a_server_that_never_answers(kind):
    """A port that accepts connections and says nothing (a hung server, a wrong service): gRPC's handshake waited
    ~20 s for the model config and for health(), whatever timeout_s said."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepted by the kernel, never answered
        url = f"127.0.0.1:{silent.getsockname()[1]}"

        async def async_calls():
            async with AsyncEmbeddingClient(url=url, protocol="grpc", timeout_s=1.0, retries=0) as client:
                with pytest.raises(EmbeddingError):
                    await client.embed(["never answered"])
                return await client.health()

        start = time.monotonic()
        if kind == "sync":
            with EmbeddingClient(url=url, protocol="grpc", timeout_s=1.0, retries=0) as client:
                with pytest.raises(EmbeddingError):
                    client.embed(["never answered"])
                health = client.health()
        else:
            health = asyncio.run(async_calls())
        took = time.monotonic() - start
    assert not health.live and health.error
    assert took < 8, f"embed and health took {took:.1f} s with timeout_s=1"


def test_one_headers_dict_serves_binary_json_and_shared_memory_clients_in_turn(server):
    """tritonclient's HTTP client writes Inference-Header-Content-Length into the headers dict it is given; the
    documented pattern (one dict with the admin key) then broke the next JSON or shared-memory client."""
    headers = server.admin_headers("http")
    kept = dict(headers)
    for options in ({}, {"binary": False}, {"use_shared_memory": True}, {"binary": False}):
        with EmbeddingClient(url=server.http_url, protocol="http", headers=headers, **options) as client:
            assert client.embed([f"one dict, {options}"]).shape == (1, 384)
    assert headers == kept


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_client_never_closed_unregisters_its_shared_memory_at_interpreter_exit(server, kind):
    """The exit cleanup sends the admin header the server's shared-memory API needs, sync and async."""
    script = f"""
import asyncio, sys
from triton_embed import AsyncEmbeddingClient, EmbeddingClient
headers = {server.admin_headers("grpc")!r}
if {kind!r} == "sync":
    client = EmbeddingClient(url={server.grpc_url!r}, use_shared_memory=True, headers=headers)
    client.embed(["left open"])
else:
    async def main():
        global client
        client = AsyncEmbeddingClient(url={server.grpc_url!r}, use_shared_memory=True, headers=headers)
        await client.embed(["left open"])
    asyncio.run(main())
print(client._shm.regions)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    regions = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert regions, done.stdout
    assert not set(regions) & set(server_regions(server.grpc_url, server.admin_headers("grpc")))
    assert "leaked shared_memory" not in done.stderr


@pytest.mark.parametrize("kind", ["grpc", "http", "async-grpc", "async-http"])
def test_close_waits_for_a_call_in_flight_and_refuses_later_ones(server, kind):
    """close() from another thread/task must not break a one-request call ("Channel closed!", CancelledError)."""
    transport = kind.removeprefix("async-")
    url = server.grpc_url if transport == "grpc" else server.http_url
    texts = [" ".join(f"c{i}x{j}" for j in range(120)) + f" {kind} {time.time_ns()}" for i in range(16)]  # ~0.5 s
    if kind.startswith("async-"):

        async def run() -> np.ndarray:
            client = AsyncEmbeddingClient(url=url, protocol=transport, latency_budget_ms=0)
            call = asyncio.create_task(client.embed(texts))
            await asyncio.sleep(0.1)  # the request is on the server now
            await client.close()
            for later in (client.embed(["after close"]), client.health(), client.server_stats()):
                with pytest.raises(EmbeddingError, match="is closed"):  # not "server unreachable"
                    await later
            return await call

        vectors = asyncio.run(run())
    else:
        client = EmbeddingClient(url=url, protocol=transport, latency_budget_ms=0)
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.embed, texts)
            time.sleep(0.1)
            client.close()
            vectors = call.result(timeout=60)
        for later in (lambda: client.embed(["after close"]), client.health, client.server_stats):
            with pytest.raises(EmbeddingError, match="is closed"):  # not "server unreachable"
                later()
    assert vectors.shape == (16, 384)


def attempt_starts(accepted: list[float], apart_s: float = 0.1) -> list[float]:
    """The first connection time of each attempt: an HTTP attempt opens a few connections at once."""
    return [t for i, t in enumerate(accepted) if i == 0 or t - accepted[i - 1] > apart_s]


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_retries_wait_backoff_s_doubling_capped_at_2_s_plus_at_most_a_quarter(kind):
    """docs/client.md: before retry k the client waits ``backoff_s * 2**k``, capped at 2 s, plus up to 25% jitter.
    The server end is a loopback port that accepts each connection and closes it (unavailable: retried); the waits
    are the gaps between the attempts' connections (0.2, 0.4, 0.8, 1.6 s, then 2 s where doubling gives 3.2 s)."""
    backoff_s, retries, slack_s = 0.2, 5, 0.25  # slack: the attempt's own time and a busy machine's scheduling
    accepted: list[float] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        url = f"127.0.0.1:{listener.getsockname()[1]}"

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                accepted.append(time.monotonic())
                conn.close()

        threading.Thread(target=accept, daemon=True).start()
        options = {"url": url, "protocol": "http", "retries": retries, "backoff_s": backoff_s, "timeout_s": 5}
        if kind == "sync":
            with EmbeddingClient(**options) as client, pytest.raises(ServerUnavailableError):
                client.embed(["never answered"])
        else:

            async def call() -> AsyncEmbeddingClient:
                async with AsyncEmbeddingClient(**options) as client:
                    with pytest.raises(ServerUnavailableError):
                        await client.embed(["never answered"])
                return client

            client = asyncio.run(call())
    assert client.stats().retries == retries and client.stats().errors == 1
    starts = attempt_starts(accepted)
    assert len(starts) == retries + 1, f"{len(starts)} attempts for {retries} retries: {accepted}"
    waits = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    for k, waited in enumerate(waits):
        scheduled = min(2.0, backoff_s * 2**k)
        assert scheduled <= waited <= scheduled * 1.25 + slack_s, f"wait {k}: {waited:.3f} s for {scheduled} s: {waits}"
    assert waits[-1] < backoff_s * 2 ** (retries - 1), f"the last wait is not capped at 2 s: {waits}"


def test_retry_policy():
    assert retryable(ServerUnavailableError("x"))
    assert not retryable(InvalidInputError("x"))
    assert not retryable(EmbeddingTimeoutError("x"))


@pytest.fixture
def own_server(tmp_path):
    srv = EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "tritonserver.log")
    try:
        srv.start().wait_ready()
        yield srv
    finally:
        srv.stop()


def test_stopped_server_fails_fast_then_retries_reach_it_again(own_server):
    url = own_server.grpc_url
    with EmbeddingClient(url=url, retries=0, timeout_s=5) as client:
        assert client.embed(["while it runs"]).shape == (1, 384)
        own_server.stop()
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match=url):
            client.embed(["after it stopped"])
        assert time.monotonic() - started < 5

    # The server restarts from this thread (PR_SET_PDEATHSIG ties it to the thread that started it); the client
    # call waits in a worker thread, retrying until the server is back.
    outcome = {}

    def call():
        with EmbeddingClient(url=url, retries=40, backoff_s=0.5, timeout_s=5) as client:
            try:
                outcome["vectors"] = client.embed(["reached after the restart"])
            except Exception as exc:  # noqa: BLE001 - reported below
                outcome["error"] = exc
            outcome["retries"] = client.stats().retries

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(1.0)  # the client is retrying against the stopped server now
    own_server.start().wait_ready()
    caller.join(timeout=120)
    assert not caller.is_alive(), "the retrying call did not end within 120 s of the restart"
    assert "vectors" in outcome, f"the retrying call failed: {outcome}"
    assert outcome["vectors"].shape == (1, 384)
    assert outcome["retries"] >= 1  # it was sent while the server was down, and retried until it was back


def test_a_draining_ensemble_is_unavailable_but_an_unknown_model_is_not():
    """While the server drains before it stops, Triton answers 'has no available versions' (gRPC NOT_FOUND, HTTP
    404): retryable, perhaps on another replica. A misspelt model name is not."""
    from tritonclient.utils import InferenceServerException

    draining = "Request for unknown model: 'embed' has no available versions"
    for status in ("StatusCode.NOT_FOUND", "404"):
        error = from_triton(InferenceServerException(draining, status=status), model="embed", url="u")
        assert isinstance(error, ServerUnavailableError) and retryable(error)
    typo = InferenceServerException("Request for unknown model: 'embedd' is not found", status="StatusCode.NOT_FOUND")
    assert not retryable(from_triton(typo, model="embedd", url="u"))
