"""Crashed backend stubs, reloads and shutdown, each against a server of its own on free loopback ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from conftest import reference_embed
from helpers import drained_requests, embed_until_answered, kill_stub_mid_request, load_across_a_signal, scrape
from triton_embed import EmbeddingClient
from triton_embed_server.embedded import EmbeddedServer, free_port
from triton_embed_server.shm import backend_regions
from triton_embed_server.supervisor import STARTUP_INTERVAL_S, StubWatchdog, proc_state, stub_processes


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "tritonserver.log"
    with EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=log) as srv:
        yield srv


@pytest.mark.parametrize("model", ["tokenizer", "encoder"])
def test_killed_stub_is_replaced_without_a_server_restart(fault_server, reference, model):
    server_pid = fault_server.pid
    stubs = [pid for pid, name in stub_processes(server_pid).items() if name == model]
    assert stubs, stub_processes(server_pid)
    os.kill(stubs[0], signal.SIGKILL)

    started = time.monotonic()
    served, failures = embed_until_answered(fault_server.grpc_url, f"after the {model} stub died", within_s=30)
    assert time.monotonic() - started < 30
    assert all("not healthy" in str(e) or "not ready" in str(e) or "UNAVAILABLE" in repr(e) for e in failures)
    np.testing.assert_allclose(served, reference_embed(reference, [f"after the {model} stub died"]), atol=1e-5)
    assert fault_server.pid == server_pid and fault_server.is_alive()
    assert any(name == model for name, _ in fault_server.watchdog.reloads)


@pytest.mark.parametrize("model", ["tokenizer", "encoder"])
def test_an_operator_reload_keeps_metrics_and_load_and_is_not_taken_for_a_crash(fault_server, reference, model):
    """After a reload through the admin API: the watchdog does not reload again (it did, in a loop: the retired stub
    looked like a crash); the custom metrics are still there (the old instance's finalize deleted the new one's,
    and tritonserver then crashed under load)."""
    reloads = list(fault_server.watchdog.reloads)
    base = f"http://{fault_server.http_url}/v2"
    with urllib.request.urlopen(f"{base}/models/{model}/config", timeout=10) as response:  # noqa: S310
        config = json.loads(response.read())
    config.setdefault("parameters", {})["OPERATOR_RELOAD"] = {"string_value": str(time.time_ns())}  # a real load
    request = urllib.request.Request(  # noqa: S310 - our loopback server
        f"{base}/repository/models/{model}/load",
        data=json.dumps({"parameters": {"config": json.dumps(config)}}).encode(),
        headers={fault_server.config.admin_header: fault_server.config.admin_key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310
        assert response.status == 200
    time.sleep(6)  # the retired stub exits; the watchdog looks every second
    assert fault_server.watchdog.reloads == reloads
    with EmbeddingClient(url=fault_server.grpc_url, retries=5) as client:
        texts = [f"served after an operator's reload of the {model} {i}" for i in range(40)]
        np.testing.assert_allclose(client.embed(texts), reference_embed(reference, texts), atol=1e-5)
    rows = scrape(fault_server.metrics_url)
    for name in ("triton_embed_shed_requests_total", "triton_embed_padded_tokens_total"):
        assert any(k.startswith(f"{name}{{") for k in rows), sorted(rows)


def test_a_stub_killed_with_a_request_in_it_leaves_a_quick_clean_stop_and_no_shared_memory(tmp_path):
    """Triton 2.51 never finishes unloading an instance whose stub died with a request in it: its own stop waited
    out the 30 s exit timeout and exited 1. The wrapper kills it once every live stub has exited (nothing is left to
    serve), and removes the dead stub's shared-memory region."""
    before = backend_regions()
    with EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log") as srv:
        assert backend_regions() - before, "the stubs' regions should be in /dev/shm"
        assert kill_stub_mid_request(srv.grpc_url, srv.pid, "encoder").retries >= 1
        assert [model for model, _ in srv.watchdog.reloads] == ["encoder"]
        started = time.monotonic()
        code = srv.stop()
        took = time.monotonic() - started
    log = (tmp_path / "log").read_text(errors="replace")
    assert "Exit timeout expired" not in log and code == 0, log[-3000:]
    assert took < 20, f"the stop took {took:.0f} s (Triton's exit timeout is 30 s)"
    assert backend_regions() - before == set()  # the killed stub's region too


def test_a_stub_killed_while_the_server_still_loads_is_replaced(tmp_path, reference):
    """The watchdog starts with tritonserver: a tokenizer stub killed after its model loaded, while the encoder still
    warms up, is reloaded once the server answers (it was not: the watchdog started at READY, knew only live stubs,
    and every request failed 'not healthy' until a restart)."""
    server = EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log").start()
    try:
        deadline = time.monotonic() + 120
        while "successfully loaded 'tokenizer'" not in (tmp_path / "log").read_text(errors="replace"):
            assert time.monotonic() < deadline and server.is_alive(), "the tokenizer never loaded"
            time.sleep(0.05)
        time.sleep(2 * STARTUP_INTERVAL_S)  # the watchdog has seen the stub (it loads in ~0.15 s, between two looks)
        (stub,) = [pid for pid, model in stub_processes(server.pid).items() if model == "tokenizer"]
        os.kill(stub, signal.SIGKILL)
        assert not server.is_ready(), "the server was ready before the kill: this test needs a kill during the load"
        server.wait_ready()
        served, _ = embed_until_answered(server.grpc_url, "after a stub died during the load", within_s=30)
        np.testing.assert_allclose(served, reference_embed(reference, ["after a stub died during the load"]), atol=1e-5)
        assert [model for model, _ in server.watchdog.reloads] == ["tokenizer"]
    finally:
        server.stop()


def test_a_stub_that_died_before_the_watchdog_saw_it_is_replaced(tmp_path, reference):
    """A stub that dies within one look of its start (0.25 s while the server loads) was never reloaded: the
    watchdog knew only stubs it had seen alive. It now counts live stubs per model once the server is ready. Here
    the watchdog starts after the kill, so it has never seen the dead stub."""
    server = EmbeddedServer(
        http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log", watch_stubs=False
    ).start()
    try:
        server.wait_ready()
        (stub,) = [pid for pid, model in stub_processes(server.pid).items() if model == "tokenizer"]
        os.kill(stub, signal.SIGKILL)
        while (
            state := proc_state(stub)
        ) is not None and state.running:  # the kill takes a moment: a watchdog started before would see it alive
            time.sleep(0.01)
        watchdog = StubWatchdog(
            server_pid=server.pid,
            http_url=server.http_url,
            admin_header=server.config.admin_header,
            admin_key=server.config.admin_key,
        ).start()
        try:
            assert stub not in watchdog._known  # never seen alive
            served, _ = embed_until_answered(server.grpc_url, "after an unseen stub died", within_s=30)
            expected = reference_embed(reference, ["after an unseen stub died"])
            np.testing.assert_allclose(served, expected, atol=1e-5)
            assert [model for model, _ in watchdog.reloads] == ["tokenizer"]  # the encoder was not short
            time.sleep(3 * watchdog.interval_s)
            assert [model for model, _ in watchdog.reloads] == ["tokenizer"]  # and once only
        finally:
            watchdog.stop()
    finally:
        server.stop()


def test_retrying_client_does_not_see_a_stub_crash(fault_server, reference):
    stubs = [pid for pid, name in stub_processes(fault_server.pid).items() if name == "encoder"]
    texts = [f"retried request {i}" for i in range(5)]
    os.kill(stubs[0], signal.SIGKILL)  # requests now fail until the watchdog has reloaded the encoder
    with EmbeddingClient(url=fault_server.grpc_url, retries=20, backoff_s=0.25) as client:
        served = np.concatenate([client.embed([t]) for t in texts])
        assert client.stats().retries >= 1 and client.stats().errors == 0
    np.testing.assert_allclose(served, reference_embed(reference, texts), atol=1e-5)


@pytest.mark.parametrize(
    ("per_request", "threads", "signal_after_s", "ctrl_c"),
    [(1, 16, 2.0, False), (64, 10, 0.3, False), (64, 10, 0.3, True)],
)
def test_sigterm_drains_in_flight_requests(tmp_path, sts_dev, per_request, threads, signal_after_s, ctrl_c):
    """Ten requests of 64 long texts at once, SIGTERM 0.3 s later: most still wait for the tokenizer, so their
    encoder step would start after the signal, which Triton alone refused ("Server is stopping": 10 of 15 in a
    trial) until the server drained the ensemble first (drain.py)."""
    ports = [str(free_port()) for _ in range(3)]
    cmd = [sys.executable, "-m", "triton_embed_server", "serve", "--http-port", ports[0], "--grpc-port", ports[1],
           "--metrics-port", ports[2]]  # fmt: skip
    # its own process group, as a terminal runs it: ctrl_c sends SIGINT to the whole group, as Ctrl-C does
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "Ctrl-C stops it" not in (proc.stdout.readline() or "Ctrl-C stops it"):
            pass
        url = f"127.0.0.1:{ports[1]}"

        def send_signal() -> None:
            if ctrl_c:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)

        requests = drained_requests(sts_dev, per_request)
        sent_before_signal, answers = load_across_a_signal(url, requests, threads, signal_after_s, send_signal)
        assert proc.wait(timeout=60) == 0
        lost = [n for n in sent_before_signal if not isinstance(answers.get(n), np.ndarray)]
        assert sent_before_signal and not lost, f"{len(lost)} of {len(sent_before_signal)} lost: {answers[lost[0]]!r}"
    finally:
        if proc.poll() is None:
            proc.kill()
