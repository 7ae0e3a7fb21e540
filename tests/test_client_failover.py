"""One client, two real servers: requests spread over both, a killed one costs no failed call, and it gets traffic
again once it is ready. Sync and asyncio clients, gRPC and HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from helpers import counts, read_counts
from triton_embed import AsyncEmbeddingClient, EmbeddingClient
from triton_embed_server.embedded import EmbeddedServer

CLI = [str(Path(sys.executable).parent / "triton-embed")]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two tritonservers on free loopback ports, started together (each takes ~20-40 s to load on 2 cores)."""
    logs = tmp_path_factory.mktemp("failover")
    pair = [EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=logs / f"{n}.log") for n in "ab"]
    try:
        for srv in pair:
            srv.start()
        for srv in pair:
            srv.wait_ready()
        yield pair
    finally:
        for srv in pair:
            srv.stop()


NEVER_REFUSED = {"latency_budget_ms": 0}
"""Budget 0: an overload refusal on a busy 2-core machine is retried on the other server and would skew the counts
these tests read (and, while a server loads, fail calls); the overload policy has its own tests."""


def unique(label: str) -> str:
    """A text no server has cached."""
    return f"{label} {secrets.token_hex(6)}"


def inferences(srv: EmbeddedServer) -> int:
    """Texts the server's ``embed`` ensemble has run, once its statistics have settled."""
    return counts(srv.grpc_url, "embed")[0]


def urls(servers, protocol: str) -> list[str]:
    return [s.grpc_url if protocol == "grpc" else s.http_url for s in servers]


class EventLoopThread:
    """An asyncio event loop in a thread of its own: an AsyncEmbeddingClient lives in one loop for its whole life,
    while the test's main thread kills and restarts a server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout_s: float = 120.0):
        return self.submit(coro).result(timeout=timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


# -- spreading -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sync-grpc", "sync-http", "asyncio-grpc", "asyncio-http"])
def test_calls_reach_every_endpoint_and_health_and_statistics_cover_both(servers, kind):
    mode, protocol = kind.split("-")
    # server a by name (resolved by the client: localhost has one address here, so it stays a name), b by address
    given = [urls(servers, protocol)[0].replace("127.0.0.1", "localhost"), urls(servers, protocol)[1]]
    before = [inferences(s) for s in servers]
    calls = 12

    def settled() -> list[int]:
        """Texts each server ran since ``before``, once Triton has recorded the last request."""
        return [inferences(s) - n for s, n in zip(servers, before, strict=True)]

    async def async_calls() -> tuple[list[np.ndarray], list[int], object, list]:
        async with AsyncEmbeddingClient(url=given, protocol=protocol, **NEVER_REFUSED) as client:
            rows = [await client.embed([unique(f"{kind} {i}")]) for i in range(calls)]
            got = await asyncio.to_thread(settled)
            return rows, got, await client.health(), await client.server_stats(("embed",))

    if mode == "sync":
        with EmbeddingClient(url=given, protocol=protocol, **NEVER_REFUSED) as client:
            rows = [client.embed([unique(f"{kind} {i}")]) for i in range(calls)]
            got = settled()
            health, stats = client.health(), client.server_stats(("embed",))
    else:
        rows, got, health, stats = asyncio.run(async_calls())
    assert all(r.shape == (1, 384) for r in rows)
    assert sum(got) == calls, got
    assert min(got) >= calls // 3, f"calls one after another should alternate between the servers: {got}"
    assert health.model_ready and health.live and health.error == "", health
    # the client's statistics are the two servers' added up
    assert stats[0].inferences == sum(read_counts(s.grpc_url, "embed")[0] for s in servers)


def test_concurrent_calls_spread_over_both(servers):
    async def fan_out() -> tuple[list[int], list[np.ndarray]]:
        async with AsyncEmbeddingClient(url=urls(servers, "grpc"), **NEVER_REFUSED) as client:
            await client.embed([unique("warm-up")])  # reads the model config, once
            before = await asyncio.to_thread(lambda: [inferences(s) for s in servers])
            return before, await asyncio.gather(*(client.embed([unique(f"fan-out {i}")]) for i in range(16)))

    before, rows = asyncio.run(fan_out())
    assert len(rows) == 16
    got = [inferences(s) - n for s, n in zip(servers, before, strict=True)]
    assert sum(got) == 16 and min(got) >= 4, got


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, check=False)


def test_the_cli_takes_several_urls_separated_by_commas(servers):
    both = ",".join(urls(servers, "grpc"))
    done = run_cli("health", "--json", "--url", both)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"live": True, "ready": True, "model_ready": True, "error": ""}
    done = run_cli("embed", "--url", both, "a", "b", "c")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 3
    settled = sum(inferences(s) for s in servers)
    done = run_cli("stats", "--json", "--url", both)
    assert done.returncode == 0, done.stderr
    embed = next(r for r in json.loads(done.stdout)["steps"] if r["model"] == "embed")
    assert embed["inferences"] == settled  # the two servers' statistics added up


# -- failover --------------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """What a steady loop of calls saw."""

    calls: int = 0
    failures: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


PAUSE_S = 0.05  # between calls: a steady load that leaves the 2 cores to the restarting server


def steady_sync(client: EmbeddingClient, tally: Tally, label: str) -> Tally:
    while not tally.stop.is_set():
        try:
            client.embed([unique(label)])
            tally.calls += 1
        except Exception as exc:  # noqa: BLE001 - counted; the test asserts there are none
            tally.failures.append(exc)
        time.sleep(PAUSE_S)
    return tally


async def steady_async(client: AsyncEmbeddingClient, tally: Tally, label: str) -> Tally:
    while not tally.stop.is_set():
        try:
            await client.embed([unique(label)])
            tally.calls += 1
        except Exception as exc:  # noqa: BLE001 - counted; the test asserts there are none
            tally.failures.append(exc)
        await asyncio.sleep(PAUSE_S)
    return tally


def kill(srv: EmbeddedServer) -> None:
    """SIGKILL tritonserver and its stubs (its process group), as a node failure or an OOM kill would; then clean up
    what it left (stop() of a dead server drains nothing)."""
    os.killpg(srv.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while srv.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.stop()


def grows(srv: EmbeddedServer, since: int, within_s: float) -> int:
    """Texts ``srv`` has run beyond ``since``, polled until there are some or ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while (now := read_counts(srv.grpc_url, "embed")[0] - since) == 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    return now


def test_a_killed_server_costs_no_failed_call_and_gets_traffic_again_once_ready(servers):
    """Default retry policy, sync gRPC and asyncio HTTP clients each in a steady loop of calls: server b is killed
    mid-run and started again on the same ports. No call fails; once b is ready, each client sends to it again.

    Budget 0: while b loads its model (~20-40 s of both cores) a's encoder queue grows; a refusal there would be the
    overload policy's (tested on its own), not failover's.
    """
    _, b = servers
    loop, pool = EventLoopThread(), ThreadPoolExecutor(1)
    sync_client = EmbeddingClient(url=urls(servers, "grpc"), **NEVER_REFUSED)
    # connects on its first call, in the loop's thread
    async_client = AsyncEmbeddingClient(url=urls(servers, "http"), protocol="http", **NEVER_REFUSED)
    loops: list[tuple[Tally, Future]] = []

    def start_sync(label: str) -> Tally:
        tally = Tally()
        loops.append((tally, pool.submit(steady_sync, sync_client, tally, label)))
        return tally

    def start_async(label: str) -> Tally:
        tally = Tally()
        loops.append((tally, loop.submit(steady_async(async_client, tally, label))))
        return tally

    def stop_loops() -> None:
        for tally, _ in loops:
            tally.stop.set()
        for _, run in loops:
            run.result(timeout=60)
        loops.clear()

    try:
        sync_tally, async_tally = start_sync("steady sync"), start_async("steady async")
        time.sleep(2.0)
        assert sync_tally.calls and async_tally.calls, "the loops should be calling"
        calls_before_kill = (sync_tally.calls, async_tally.calls)
        kill(b)
        time.sleep(3.0)  # calls go on, to a only
        assert sync_tally.calls > calls_before_kill[0] and async_tally.calls > calls_before_kill[1]
        # what each client reports: b is down
        assert [s.up for s in sync_client.endpoints] == [True, False], sync_client.endpoints
        assert [s.up for s in async_client.endpoints] == [True, False], async_client.endpoints
        health = sync_client.health()  # ready while one server is, naming the other
        assert health.model_ready and health.error.startswith(f"{b.grpc_url}: "), health
        b.start().wait_ready()  # the same ports: they stay in its config after the first start
        stop_loops()
        assert not sync_tally.failures, sync_tally.failures[:3]
        assert not async_tally.failures, async_tally.failures[:3]
        assert sync_tally.calls > calls_before_kill[0] + 10 and async_tally.calls > calls_before_kill[1] + 10

        # each client in turn, alone, until b's statistics grow: traffic has come back to it
        for name, start in (("sync gRPC", start_sync), ("asyncio HTTP", start_async)):
            since = inferences(b)
            tally = start(f"back {name}")
            got = grows(b, since, within_s=30)  # a probe after the cool-down (10 s at most) finds b ready
            stop_loops()
            assert got > 0, f"{name}: no call reached the restarted server within 30 s: {tally.calls} calls to a"
            assert not tally.failures, tally.failures[:3]
    finally:
        for tally, _ in loops:
            tally.stop.set()
        pool.shutdown(wait=True)
        sync_client.close()
        loop.run(async_client.close())
        loop.close()
        if not b.is_alive():  # for tests after this one
            with contextlib.suppress(Exception):
                b.start().wait_ready()
