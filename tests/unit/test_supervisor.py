"""The stub watchdog's standalone side (the compose entrypoint runs it as a script): liveness and exit rules.

Real processes and sockets; the reload itself is covered against real servers in test_faults.py (embedded) and
test_deploy_runtime.py (the compose entrypoint).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from triton_embed_server.embedded import free_port
from triton_embed_server.supervisor import StubWatchdog, crashed_stubs, main, process_alive, server_answers

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "server", "triton_embed_server", "supervisor.py")


def kill_unreaped(child: subprocess.Popen) -> None:
    """SIGKILL ``child`` and wait (up to 10 s) until it is a zombie: killed and not reaped, as a crashed stub."""
    child.kill()
    deadline = time.monotonic() + 10
    while process_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def only_for_this_process(monkeypatch, module, name: str, fake) -> None:
    """Patch ``module.name`` with ``fake`` for a watchdog of this process; others get the real one.

    The session's embedded server runs its own watchdog thread in this process, through the same module: patched
    for all, its scan killed and reaped this test's stub (``Popen.kill`` polls first), and the test lost it.
    """
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda pid, *a: fake(pid, *a) if pid == os.getpid() else real(pid, *a))


def watchdog_of_this_process():
    """A watchdog (not started) whose tritonserver is this test process; no server answers at its URL."""
    return StubWatchdog(server_pid=os.getpid(), http_url=f"127.0.0.1:{free_port()}", admin_header="h", admin_key="k")


def test_a_zombie_counts_as_gone_and_a_running_process_as_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603 - our interpreter
    deadline = time.monotonic() + 10
    while process_alive(child.pid) and time.monotonic() < deadline:  # exited, not yet reaped: a zombie
        time.sleep(0.05)
    assert not process_alive(child.pid)
    assert os.path.exists(f"/proc/{child.pid}")  # still there as a zombie until reaped
    child.wait()
    assert process_alive(os.getpid())


def test_no_server_on_the_port_means_not_live():
    assert not server_answers(f"127.0.0.1:{free_port()}", "live")


def test_without_a_key_it_refuses_to_watch(monkeypatch):
    monkeypatch.delenv("TRITON_EMBED_ADMIN_KEY", raising=False)
    assert main(["--server-pid", str(os.getpid())]) == 2


def test_the_script_exits_at_once_when_the_server_is_already_gone():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603 - our interpreter
    gone.wait()
    # as the entrypoint runs it, a script; -I -S: no site-packages, so it must need nothing beyond the stdlib
    done = subprocess.run(
        [sys.executable, "-I", "-S", SCRIPT, "--server-pid", str(gone.pid), "--http-port", str(free_port())],
        env={"TRITON_EMBED_ADMIN_KEY": "k"},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


def test_only_an_unreaped_stub_counts_as_crashed():
    """Triton reaps a stub it stops (unload, reload, shutdown) at once; a crashed one stays a zombie: only that one
    is a crash. This test process plays tritonserver, its children the stubs."""
    stubs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]  # noqa: S607 - coreutils
    crashed, retired, alive = stubs
    try:
        kill_unreaped(crashed)  # a zombie, as Triton 2.51 leaves a crashed stub
        retired.kill()
        retired.wait()  # reaped: gone from /proc
        known = {crashed.pid: "tokenizer", retired.pid: "encoder", alive.pid: "encoder"}
        assert crashed_stubs(os.getpid(), known, confirm_s=0.05) == {crashed.pid: "tokenizer"}
        assert crashed_stubs(os.getpid() + 1, known, confirm_s=0.05) == {}  # another parent's zombie is not ours
    finally:
        for stub in stubs:
            stub.kill()
            stub.wait()


def test_a_stub_that_dies_during_a_look_is_kept_for_the_next_one(monkeypatch):
    """A stub dying between the crash check and the rescan is a zombie at the rescan, which lists live stubs only:
    it must stay on the watch list, or its crash is never seen."""
    import triton_embed_server.supervisor as supervisor

    stub = subprocess.Popen(["sleep", "60"])  # noqa: S607 - coreutils; this test process plays tritonserver
    try:
        kill_unreaped(stub)
        only_for_this_process(monkeypatch, supervisor, "crashed_stubs", lambda *_: {})  # looked just before the death
        assert watchdog_of_this_process()._tick({stub.pid: "encoder"}) == {stub.pid: "encoder"}
    finally:
        stub.kill()
        stub.wait()


def test_a_stub_that_dies_while_proc_is_scanned_is_kept_for_the_next_look(monkeypatch):
    """The rescan of /proc takes a while on busy cores; a stub that dies during it is left out as a zombie, so the
    zombie check must come after the rescan (a CI run lost an encoder killed right after the tokenizer's reload)."""
    import triton_embed_server.supervisor as supervisor

    stub = subprocess.Popen(["sleep", "60"])  # noqa: S607 - coreutils; this test process plays tritonserver

    def scan_during_which_it_dies(_server_pid):
        kill_unreaped(stub)  # a zombie, which the scan leaves out
        return {}

    try:
        only_for_this_process(monkeypatch, supervisor, "crashed_stubs", lambda *_: {})  # alive when it looked
        only_for_this_process(monkeypatch, supervisor, "stub_processes", scan_during_which_it_dies)
        assert watchdog_of_this_process()._tick({stub.pid: "encoder"}) == {stub.pid: "encoder"}
    finally:
        stub.kill()
        stub.wait()


def test_finish_stop_as_a_script_reports_a_server_that_exited_by_itself():
    """The entrypoint's stop runs ``--finish-stop`` after its signal: 1 (keep tritonserver's own status) unless it
    had to kill a server stuck on a dead stub; the real case is in test_deploy_runtime.py."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603 - our interpreter
    gone.wait()
    done = subprocess.run(
        [sys.executable, "-I", "-S", SCRIPT, "--server-pid", str(gone.pid), "--finish-stop", "--timeout-s", "5"],
        env={},
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert done.returncode == 1, done.stderr
