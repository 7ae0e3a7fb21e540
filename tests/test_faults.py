"""Crashed backend stubs, reloads and shutdown, each against a server of its own on free loopback ports."""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import reference_embed
from helpers import (
    embed_until_answered,
    held_repository,
    held_requests,
    held_requests_across_a_signal,
    infer,
    kill_stub_mid_request,
    pending,
    scrape,
    serve_running,
    text_tensor,
)
from triton_embed import EmbeddingClient, ServerUnavailableError
from triton_embed_protocol.overload import InFlightRecord
from triton_embed_server.embedded import EmbeddedServer
from triton_embed_server.shm import backend_regions
from triton_embed_server.supervisor import STARTUP_INTERVAL_S, StubWatchdog, proc_state, stub_processes
from tritonclient.utils import InferenceServerException


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
    reloads_before = len(fault_server.watchdog.reloads)
    os.kill(stubs[0], signal.SIGKILL)

    served, failures = embed_until_answered(fault_server.grpc_url, f"after the {model} stub died", within_s=30)
    assert all("not healthy" in str(e) or "not ready" in str(e) or "UNAVAILABLE" in repr(e) for e in failures)
    np.testing.assert_allclose(served, reference_embed(reference, [f"after the {model} stub died"]), atol=1e-5)
    assert fault_server.pid == server_pid and fault_server.is_alive()
    assert [name for name, _ in fault_server.watchdog.reloads[reloads_before:]] == [model]  # this kill's reload


@pytest.mark.parametrize("model", ["tokenizer", "encoder"])
def test_an_operator_reload_keeps_metrics_and_load_and_is_not_taken_for_a_crash(fault_server, reference, model):
    """After a reload through the admin API: the watchdog does not take the retired stub for a crash (no reload of
    its own); the custom metrics are still there (the old instance's finalize does not delete the new one's) and
    the server serves under load."""
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
    # The door still knows the encoder's knobs as the reloaded encoder measured them (the gauges), REFUSAL_HOLD_MS
    # (1 s) and BULK_QUEUE (2048): the shared in-flight file (overload.InFlight) outlives a reload of either backend.
    (door,) = Path("/dev/shm").glob(f"triton-embed-{fault_server.pid}-*.in-flight")
    record = InFlightRecord.parse(door.read_bytes())
    knobs = {k.split('knob="')[1].split('"')[0]: v for k, v in rows.items() if k.startswith("triton_embed_admission{")}
    assert record.max_in_flight == knobs["MAX_IN_FLIGHT"] > 0 and record.refusal_hold_ns == 1_000_000_000
    assert record.flood_ns == knobs["FLOOD_LATENCY_MS"] * 1_000_000
    assert (record.bulk_in_flight, record.bulk_queue, record.bulk_texts) == (
        knobs["BULK_IN_FLIGHT"],
        2048,
        knobs["BULK_TEXTS"],
    )


def stub_regions(server_pid: int) -> set[str]:
    """Names of the ``/dev/shm`` regions that ``server_pid``'s live stubs map (one each): this server's only, not
    those of other servers on the machine."""
    return {
        line.rsplit("/", 1)[1]
        for pid in stub_processes(server_pid)
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if "/dev/shm/triton_" in line and "_backend_shm_region_" in line
    }


def test_a_stub_killed_with_a_request_in_it_leaves_a_quick_clean_stop_and_no_shared_memory(tmp_path):
    """Triton 2.51 never finishes unloading an instance whose stub died with a request in it: its own stop waits
    out the 30 s exit timeout and exits 1. The wrapper kills it once every live stub has exited (nothing is left to
    serve), and removes the dead stub's shared-memory region."""
    with EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log") as srv:
        regions = stub_regions(srv.pid)  # the encoder stub's that is killed below among them
        assert len(regions) == 2, f"one region per stub in /dev/shm: {regions}"
        assert kill_stub_mid_request(srv.grpc_url, srv.pid, "encoder").retries >= 1
        assert [model for model, _ in srv.watchdog.reloads] == ["encoder"]
        regions |= stub_regions(srv.pid)  # and the reloaded encoder's
        started = time.monotonic()
        code = srv.stop()
        took = time.monotonic() - started
    log = (tmp_path / "log").read_text(errors="replace")
    assert "Exit timeout expired" not in log and code == 0, log[-3000:]
    assert took < 20, f"the stop took {took:.0f} s (Triton's exit timeout is 30 s)"
    assert len(regions) == 3 and not regions & backend_regions(), regions & backend_regions()


def test_a_stub_killed_while_the_server_still_loads_is_replaced(tmp_path, reference):
    """The watchdog starts with tritonserver: a tokenizer stub killed after its model loaded, while the encoder still
    warms up, is reloaded once the server answers (without it every request fails 'not healthy' until a restart)."""
    server = EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log")
    try:
        server.start()
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
    """A stub that dies within one look of its start (0.25 s while the server loads) is one the watchdog never saw
    alive: it finds it by counting live stubs per model once the server is ready. Here the watchdog starts after
    the kill, so it has never seen the dead stub."""
    server = EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0, log_file=tmp_path / "log", watch_stubs=False)
    try:
        server.start().wait_ready()
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


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl_c"])
def test_sigterm_and_ctrl_c_drain_requests_still_waiting_for_their_first_step(tmp_path, reference, ctrl_c):
    """Eight requests wait in the tokenizer's queue (Triton's metrics show all eight there, none answered) when
    `serve` gets SIGTERM, or its process group SIGINT as from Ctrl-C. Their encoder step is still ahead, which
    Triton's own stop refuses ("Server is stopping"); serve drains the ensemble first, so each one gets its
    embedding, and serve exits 0."""
    repo = held_repository(tmp_path / "repo")
    # its own process group, as a terminal runs it: ctrl_c sends SIGINT to the whole group, as Ctrl-C does
    with serve_running(tmp_path / "serve.log", "--model-repository", str(repo), new_session=True) as run:

        def send_signal() -> None:
            if ctrl_c:
                os.killpg(run.proc.pid, signal.SIGINT)
            else:
                run.proc.send_signal(signal.SIGTERM)

        requests = held_requests()
        metrics_url = f"http://127.0.0.1:{run.ports[2]}/metrics"
        answers = held_requests_across_a_signal(run.grpc_url, metrics_url, requests, send_signal)
        assert run.proc.wait(timeout=60) == 0, run.tail()
    lost = [a for a in answers if not isinstance(a, np.ndarray)]
    assert not lost, f"{len(lost)} of {len(requests)} lost: {lost[0]!r}"
    for texts, served in zip(requests, answers, strict=True):
        np.testing.assert_allclose(served, reference_embed(reference, texts), atol=1e-5)


def test_a_draining_server_is_not_ready_and_refuses_new_requests_as_not_found_which_the_client_retries(
    tmp_path, reference
):
    """docs/operations.md, "Shutdown and drain": while a request is still in the ensemble, a stopping server is live
    but neither it nor the model is ready, Triton answers new requests "has no available versions" (gRPC NOT_FOUND,
    HTTP 404), and the client retries them as unavailable; the request in flight still gets its embedding."""
    repo = held_repository(tmp_path / "repo", hold_s=6.0)
    log = tmp_path / "tritonserver.log"
    with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=log) as server:
        held_text = f"held through the drain {secrets.token_hex(4)}"
        held: dict[str, object] = {}

        def send_held() -> None:
            with EmbeddingClient(url=server.grpc_url, retries=0, latency_budget_ms=0, timeout_s=60) as client:
                held["answer"] = client.embed([held_text])

        sender = threading.Thread(target=send_held)
        sender.start()
        deadline = time.monotonic() + 30
        while pending(server.metrics_url, "tokenizer") < 1:
            assert time.monotonic() < deadline and not held, f"the request never waited in the tokenizer: {held}"
            time.sleep(0.02)
        stopper = threading.Thread(target=server.stop)  # drains first: unloads the ensemble, then stops
        stopper.start()
        while server.is_ready():  # GET /v2/models/embed/ready (every ensemble), what a load balancer probes
            assert time.monotonic() < deadline, "the model stayed ready while the server drained"
            time.sleep(0.02)
        with EmbeddingClient(url=server.grpc_url) as client:
            health = client.health()
        assert health.live and not health.ready and not health.model_ready, health
        for protocol, url, status in (
            ("grpc", server.grpc_url, "StatusCode.NOT_FOUND"),
            ("http", server.http_url, "404"),
        ):
            with pytest.raises(InferenceServerException, match="has no available versions") as refused:
                infer(url, "embed", {"TEXT": text_tensor(["sent while it drains"])}, ["EMBEDDING"], protocol)
            assert str(refused.value.status()) == status
        with (
            EmbeddingClient(url=server.grpc_url, retries=2, backoff_s=0.05) as client,
            pytest.raises(ServerUnavailableError, match="has no available versions"),
        ):
            client.embed(["sent while it drains, through the client"])
        assert client.stats().retries == 2 and client.stats().errors == 1
        assert sender.is_alive() and not held, "the held request was answered before the checks: no drain seen"
        sender.join(timeout=60)
        stopper.join(timeout=60)
        assert not stopper.is_alive() and not server.is_alive()
    np.testing.assert_allclose(held["answer"], reference_embed(reference, [held_text]), atol=1e-5)
