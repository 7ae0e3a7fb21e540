"""`python -m triton_embed_server serve`: starts, reports where it listens, stops on SIGTERM, leaves no orphan."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import serve_command, serve_running
from triton_embed import EmbeddingClient
from triton_embed_server.embedded import EmbeddedServer, ServerError, free_port
from triton_embed_server.shm import backend_regions
from triton_embed_server.supervisor import proc_state, process_alive, stub_processes


def process_gone(pid: int) -> bool:
    return not process_alive(pid)  # a zombie has exited; only its parent's wait is missing


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.2)
    return False


def in_flight_files(server_pid: int) -> list[Path]:
    """The overload control's in-flight files of that server (``/dev/shm``, or the temp folder on a host without)."""
    folders = {Path("/dev/shm"), Path(tempfile.gettempdir())}  # noqa: S108 - only read
    return [f for folder in folders for f in folder.glob(f"triton-embed-{server_pid}-*.in-flight")]


@pytest.fixture
def serve_process(request, tmp_path):
    """``python -m triton_embed_server serve`` on free ports, ready; extra arguments by indirect parametrization."""
    with serve_running(tmp_path / "serve.log", *getattr(request, "param", ())) as run:
        assert "triton-embed is ready" in run.output(), run.tail()
        yield run


def test_serve_prints_endpoints_and_stops_on_sigterm(serve_process):
    proc, server_pid, ports = serve_process.proc, serve_process.server_pid, serve_process.ports
    output = serve_process.output()
    assert f"http://127.0.0.1:{ports[0]}" in output and f"127.0.0.1:{ports[1]}" in output
    with EmbeddingClient(url=f"127.0.0.1:{ports[1]}") as client:
        assert client.embed(["served by the foreground server"]).shape == (1, 384)
    assert in_flight_files(server_pid)  # the overload control's count, while it serves
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert process_gone(server_pid)
    assert not in_flight_files(server_pid)  # a clean stop leaves nothing in /dev/shm


def test_sigterm_during_startup_stops_at_once_without_claiming_ready(tmp_path):
    with serve_running(tmp_path / "serve.log", wait_ready=False) as run:
        first = run.wait_for("starting tritonserver (pid", timeout_s=60)
        signalled = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)  # loading the models takes ~10-20 s here
        code = run.proc.wait(timeout=60)
        took_s = time.monotonic() - signalled
        rest = run.output()[len(first) :]
        assert process_gone(run.server_pid)  # here: leaving the block kills what is left
    assert code == 0, first + rest
    assert "stop requested before it was ready" in rest and "is ready" not in rest, rest[-2000:]
    assert took_s < 20, f"took {took_s:.1f} s to stop"


def test_a_second_serve_on_a_port_in_use_fails_at_once_and_leaves_the_first_serving(serve_process):
    proc, server_pid, ports = serve_process.proc, serve_process.server_pid, serve_process.ports
    second = subprocess.run(
        serve_command(ports[0], free_port(), free_port()), capture_output=True, text=True, check=False, timeout=60
    )
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"http port {ports[0]} on 127.0.0.1 is in use" in second.stderr
    assert "ready" not in second.stdout and "restart" not in second.stdout + second.stderr
    with EmbeddingClient(url=f"127.0.0.1:{ports[1]}") as client:
        assert client.embed(["the first server still serves"]).shape == (1, 384)
    assert proc.poll() is None and not process_gone(server_pid)


def test_no_orphan_server_when_parent_is_killed(serve_process):
    proc, server_pid = serve_process.proc, serve_process.server_pid
    assert server_pid and not process_gone(server_pid)
    proc.kill()  # SIGKILL: the parent gets no chance to clean up
    proc.wait(timeout=10)
    assert wait_gone(server_pid, timeout_s=60), f"tritonserver {server_pid} still running after its parent died"


def test_serve_restarts_a_killed_tritonserver_and_nothing_of_the_old_one_is_left(serve_process):
    """A killed tritonserver is restarted; a restart killed while it loads counts as one restart and the next one is
    made; the killed servers' stubs and shared-memory regions are gone."""
    proc, server_pid, ports = serve_process.proc, serve_process.server_pid, serve_process.ports
    stubs = stub_processes(server_pid)
    assert set(stubs.values()) == {"tokenizer", "encoder"}, stubs
    killed_regions = {
        line.rsplit("/", 1)[1]
        for pid in stubs
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if "/dev/shm/triton_" in line and "_backend_shm_region_" in line
    }
    assert killed_regions
    os.kill(server_pid, signal.SIGKILL)  # as the kernel's OOM killer would
    kill_next_tritonserver(proc.pid, other_than={server_pid})  # and once more while the restarted one loads
    output = serve_process.wait_for("tritonserver restarted (pid")
    assert "tritonserver exited unexpectedly with status -9; restarting" in output, output[-3000:]
    assert "warning: restart failed: tritonserver exited with code -9 before it was ready" in output, output[-3000:]
    # Its stubs exit once serve has reaped it (a 2.51 stub watches its parent's pid; while the dead server is an
    # unreaped zombie they run on): nothing of the killed server is left holding memory.
    assert all(wait_gone(pid, timeout_s=10) for pid in stubs), {p: process_gone(p) for p in stubs}
    with EmbeddingClient(url=f"127.0.0.1:{ports[1]}") as client:
        assert client.embed(["served by the restarted server"]).shape == (1, 384)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    # the killed server's stub regions too: the restart must not count them as older than the server
    assert not killed_regions & backend_regions(), killed_regions & backend_regions()


def kill_next_tritonserver(parent: int, other_than: set[int], within_s: float = 60.0) -> int:
    """SIGKILL the next tritonserver ``parent`` starts (one not in ``other_than``) as soon as it runs; its PID."""
    deadline = time.monotonic() + within_s
    while (started := tritonserver_child(parent, other_than)) is None:
        assert time.monotonic() < deadline, f"no new tritonserver within {within_s:.0f} s"
        time.sleep(0.05)
    os.kill(started, signal.SIGKILL)
    return started


def tritonserver_child(parent: int, other_than: set[int]) -> int | None:
    """PID of a live ``tritonserver`` child of ``parent`` not in ``other_than`` (a restarted one), or None."""
    for proc in Path("/proc").glob("[0-9]*"):
        stat = proc_state(int(proc.name))
        if stat is None or stat.ppid != parent or not stat.running or int(proc.name) in other_than:
            continue
        with contextlib.suppress(OSError):
            if (proc / "comm").read_text().strip() == "tritonserver":
                return int(proc.name)
    return None


@pytest.mark.parametrize("serve_process", [("--max-restarts", "0")], indirect=True)
def test_serve_gives_up_after_its_restart_limit(serve_process):
    proc = serve_process.proc
    os.kill(serve_process.server_pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == 1
    output = serve_process.output()
    assert "error: tritonserver exited with status -9; 0 restarts in 10 min, giving up" in output, output[-2000:]


def test_make_serve_restarts_3_times_in_10_minutes_then_gives_up(serve_process):
    """docs/operations.md: `make serve` (no --max-restarts) restarts a tritonserver that exits unexpectedly at most 3
    times in 10 minutes, a restart that dies before it is ready counting as one; then it exits 1."""
    proc, killed = serve_process.proc, {serve_process.server_pid}
    os.kill(serve_process.server_pid, signal.SIGKILL)
    for _ in range(3):  # each restart, killed while it loads
        killed.add(kill_next_tritonserver(proc.pid, other_than=killed))
    assert proc.wait(timeout=60) == 1, serve_process.tail()
    output = serve_process.output()
    assert output.count("warning: restart failed: tritonserver exited with code -9 before it was ready") == 3, output
    assert "error: tritonserver exited with status -9; 3 restarts in 10 min, giving up" in output, output[-2000:]
    assert tritonserver_child(proc.pid, other_than=set()) is None and all(process_gone(pid) for pid in killed)


def test_a_server_stop_had_to_kill_leaves_no_stuck_stub_behind(tmp_path):
    # A hung tritonserver (SIGINT does nothing) and stubs that cannot run: stop() SIGKILLs the server after
    # exit_timeout_s + 10 s. A 2.51 stub exits by itself once its server is gone only if it can run; a stuck one
    # lived on under PID 1 after a CI run, so stop() kills the server's whole process group.
    server = EmbeddedServer(
        http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=1, watch_stubs=False, log_file=tmp_path / "t.log"
    )
    stubs: dict[int, str] = {}
    try:
        server.start().wait_ready()
        stubs = stub_processes(server.pid)
        assert set(stubs.values()) == {"tokenizer", "encoder"}, stubs
        for pid in (server.pid, *stubs):
            os.kill(pid, signal.SIGSTOP)
        assert server.stop() == -signal.SIGKILL
        assert all(wait_gone(pid, timeout_s=10) for pid in stubs), {p: proc_state(p) for p in stubs}
    finally:
        server.stop()  # nothing left to do after the stop above; stops a server that failed before it
        for pid in stubs:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_two_servers_started_at_once_on_the_same_ports_one_serves_and_the_other_fails(tmp_path):
    # Both pass start()'s port check; the one that loses the bind must not report ready on the winner's answer.
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    servers = [EmbeddedServer(**ports, watch_stubs=False, log_file=tmp_path / f"{i}.log") for i in range(2)]
    outcome: dict[int, str] = {}

    def wait(i: int) -> None:
        try:
            servers[i].wait_ready(timeout_s=240)
            outcome[i] = "ready"
        except ServerError as exc:
            outcome[i] = str(exc).splitlines()[0]

    try:
        for server in servers:
            server.start()
        threads = [threading.Thread(target=wait, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        ready = [i for i, o in outcome.items() if o == "ready"]
        assert len(ready) == 1 and "exited with code" in outcome[1 - ready[0]], outcome
        winner = servers[ready[0]]
        with EmbeddingClient(url=winner.grpc_url) as client:
            assert client.embed(["served by the winner"]).shape == (1, 384)
    finally:
        for server in servers:
            server.stop()


# On one core beside another test, serve's restart of the crashed tritonserver outlasted the callers' 12 retries.
@pytest.mark.whole_machine
def test_a_stub_stalled_past_tritons_health_check_costs_a_retrying_client_no_request(serve_process, reference):
    """A stub that does not run for over a second (a starved or stopped process) under load.

    Triton 2.51's Python backend answers the execution it waits for "Stub process ... is not healthy" after one
    second without the stub's heartbeat, and tritonserver dies (SIGSEGV) once the stub, running again, answers
    those requests itself (docs/troubleshooting.md). serve restarts it; the project's client retries across that,
    so a caller with retries loses no request and gets the right embeddings.
    """
    from conftest import reference_embed

    stop, results, errors = threading.Event(), [], []

    def caller(k: int) -> None:
        with EmbeddingClient(url=serve_process.grpc_url, retries=12, backoff_s=0.25) as client:
            n = 0
            while not stop.is_set():
                text = f"stalled stub, caller {k}, request {n}"
                try:
                    results.append((text, client.embed([text])[0]))
                except Exception as exc:  # noqa: BLE001 - every failure is what the test reports
                    errors.append(repr(exc))
                n += 1

    callers = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in callers:
        t.start()
    try:
        time.sleep(2)
        (encoder,) = [pid for pid, m in stub_processes(serve_process.server_pid).items() if m == "encoder"]
        os.kill(encoder, signal.SIGSTOP)
        time.sleep(2.5)
        with contextlib.suppress(ProcessLookupError):  # gone with its server
            os.kill(encoder, signal.SIGCONT)
        time.sleep(2)
        deadline = time.monotonic() + 60  # until a request sent now is answered: the server serves again
        answered = len(results)
        while len(results) < answered + 8 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        for t in callers:
            t.join(timeout=120)
    print(f"stalled encoder stub: {len(results)} answers, tritonservers started: {serve_process.server_pids()}")
    assert not errors, errors[:3]
    assert len(results) >= answered + 8, serve_process.tail()
    served = np.stack([row for _, row in results])  # every answer, before, across and after the restart
    np.testing.assert_allclose(served, reference_embed(reference, [text for text, _ in results]), atol=1e-5)
