"""Stub watchdog: reload a model whose Python backend stub process died.

A Triton 2.51 workaround, as is :func:`finish_stop` (docs/troubleshooting.md, "Triton 2.51 defects").
Triton 2.51's Python backend does not restart a stub that was killed (out of memory, SIGKILL): the model stays
READY while every request fails with "Stub process '<instance>' is not healthy". The watchdog polls the server's
child processes once a second, every 0.25 s from the server's start until it is ready; when a stub has died, it
reloads that model through the model repository API (``POST /v2/repository/models/<m>/load`` with the model's
current config plus a fresh ``TRITON_EMBED_RELOAD`` parameter as override, which forces a new load while the old
instance keeps answering), using the admin header. A stub that dies before any look sees it (within 0.25 s of its
own start) is a dead stub child it does not know: once the server is ready, the models with fewer live stubs than
instances are reloaded (:meth:`StubWatchdog._staffing`).

"Died" means the stub is a zombie child of ``tritonserver``: Triton 2.51 does not reap a stub that crashed, while
one that Triton stops itself (an unload, an operator's reload, the watchdog's own reload, shutdown) is reaped at
once and simply vanishes; it is not counted as dead, or each reload would set off the next one. On a busy machine
such a stub can stay a zombie past the look's confirmation: a dead stub whose model is READY with every stub alive
is taken for one a reload retired, not for a crash.

Run as a script (``python3 supervisor.py --server-pid PID``, stdlib only, Python >= 3.10) it is the compose
deployment's watchdog: docker/triton-entrypoint.sh starts it beside ``tritonserver`` in the container, and runs
it again with ``--finish-stop`` after its stop signal (:func:`finish_stop`: a stop stuck on a dead stub).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("triton_embed_server")
STUB_NAME = "triton_python_backend_stub"
# Between looks until the server is ready (the tokenizer's stub loads its model in ~0.15 s, the encoder's in seconds).
# A stub that dies sooner after its start is caught once the server is ready, by counting stubs per model.
STARTUP_INTERVAL_S = 0.25
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's unit of CPU time, per second
ADMIN_HEADER = "triton-embed-admin-key"  # the admin APIs' header, here and in docker/triton-entrypoint.sh


class ProcState(NamedTuple):
    """One process as ``/proc/<pid>/stat`` gives it.

    Attributes:
        state: as ``ps`` shows it: ``R``, ``S``, ``T`` (stopped), ``Z`` (zombie: exited, not yet reaped), ...
        ppid, pgrp: parent process ID, process group ID.
        cpu_s: CPU seconds it has used so far, user + system.
    """

    state: str
    ppid: int
    pgrp: int
    cpu_s: float

    @property
    def running(self) -> bool:
        """Not a zombie (``Z``) or dead (``X``): it has not exited."""
        return self.state not in ("Z", "X")


def proc_state(pid: int) -> ProcState | None:
    """``pid``'s :class:`ProcState`, or None when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold ")" and spaces
    except (OSError, IndexError):
        return None
    return ProcState(fields[0], int(fields[1]), int(fields[2]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    stat = proc_state(pid)
    return stat is not None and stat.running


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes (not zombies) in process group ``pgid``, from /proc."""
    members = []
    for proc in Path("/proc").glob("[0-9]*"):
        stat = proc_state(int(proc.name))
        if stat is not None and stat.pgrp == pgid and stat.running:
            members.append(int(proc.name))
    return members


def server_answers(http_url: str, endpoint: str) -> bool:
    """True if ``GET http://<http_url>/v2/health/<endpoint>`` (``live`` or ``ready``) answers 200 within 5 s.

    Triton answers ``live`` 503 from the moment it starts to shut down (SIGTERM/SIGINT), before it unloads the
    models and their stubs exit.
    """
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/{endpoint}", timeout=5) as response:  # noqa: S310
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stub_processes(server_pid: int) -> dict[int, str]:
    """``{pid: model name}`` of the Python backend stubs that are children of ``server_pid`` (from /proc)."""
    stubs = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        stat = proc_state(int(proc.name))
        if stat is None or stat.ppid != server_pid or not stat.running:
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) < 2 or not argv[0].endswith(STUB_NAME.encode()):
            continue
        model_file = Path(argv[1].decode(errors="replace"))  # <repository>/<model>/<version>/model.py
        stubs[int(proc.name)] = model_file.parts[-3] if len(model_file.parts) >= 3 else "?"
    return stubs


def crashed_stubs(server_pid: int, known: dict[int, str], confirm_s: float = 0.25) -> dict[int, str]:
    """Those of ``known`` (``{pid: model}``) that are zombie children of ``server_pid``: stubs that died unreaped.

    A zombie is looked at twice, ``confirm_s`` apart: a stub that Triton stops is a zombie only for the moment
    between its exit and Triton's ``waitpid``, a crashed one until its model is reloaded.
    """
    dead = {pid: model for pid, model in known.items() if _zombie_child(pid, server_pid)}
    if dead:
        time.sleep(confirm_s)
        dead = {pid: model for pid, model in dead.items() if _zombie_child(pid, server_pid)}
    return dead


def _zombie_child(pid: int, parent: int) -> bool:
    stat = proc_state(pid)
    return stat is not None and (stat.state, stat.ppid) == ("Z", parent)


def dead_stub_children(server_pid: int) -> list[int]:
    """PIDs of the zombie children of ``server_pid`` named as a stub: stubs that died and that it never reaped.

    A zombie has no command line left, so the name comes from ``/proc/<pid>/comm`` (the first 15 bytes of it).
    """
    dead = []
    for proc in Path("/proc").glob("[0-9]*"):
        if not _zombie_child(int(proc.name), server_pid):
            continue
        try:
            name = (proc / "comm").read_text().strip()
        except OSError:
            continue
        if name == STUB_NAME[:15]:
            dead.append(int(proc.name))
    return dead


def finish_stop(server_pid: int, timeout_s: float, confirm_s: float = 1.0) -> list[int]:
    """Wait until the stopping ``server_pid`` exits; kill it if it waits only for a stub that died. Returns those PIDs.

    Triton 2.51's shutdown unloads every model and waits for each to finish, for up to its exit timeout
    (``--exit-timeout-secs``). A model instance whose stub died while a request was in it never finishes unloading
    (the stub stays an unreaped zombie), so a server that had such a crash waits out the whole timeout (30 s) and
    exits 1 (``failed to stop server: Internal - Exit timeout expired``). Once every live stub has exited, for
    ``confirm_s`` seconds, with a dead one left, nothing can run any more, since the shutdown ends inference first: the
    server is SIGKILLed and the dead stubs' PIDs returned. Call it after the stop signal (and the drain).

    Args:
        server_pid: the ``tritonserver`` process, after SIGINT/SIGTERM.
        timeout_s: longest wait, seconds; returns ``[]`` with the server still running after it.
        confirm_s: how long the server must have had no live stub and a dead one before it is killed, seconds (a
            stub that Triton stops is a zombie only until Triton reaps it, within milliseconds).

    Returns:
        ``[]`` when the server exited by itself (or is still running after ``timeout_s``), else the dead stubs that
        it was waiting for when it was killed.
    """
    deadline = time.monotonic() + timeout_s
    stuck_since = None
    while process_alive(server_pid) and time.monotonic() < deadline:
        dead = [] if stub_processes(server_pid) else dead_stub_children(server_pid)
        if not dead:
            stuck_since = None
        elif stuck_since is None:
            stuck_since = time.monotonic()
        elif time.monotonic() - stuck_since >= confirm_s:
            log.warning(
                "tritonserver (pid %d) has unloaded every model but the one whose stub died (pid %s, never reaped), "
                "which Triton 2.51 waits for until its exit timeout; killed it: no request could still be in it",
                server_pid,
                ", ".join(map(str, dead)),
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(server_pid, signal.SIGKILL)
            return dead
        time.sleep(0.1)
    return []


class StubWatchdog:
    """A daemon thread reloading models whose stub died; stops with :meth:`stop`.

    Attributes:
        reloads: ``[(model, seconds the reload took)]`` so far.
    """

    def __init__(self, *, server_pid: int, http_url: str, admin_header: str, admin_key: str, interval_s: float = 1.0):
        """Watch the stubs of ``server_pid``; reload through ``http://<http_url>`` with the admin header."""
        self.server_pid = server_pid
        self.http_url = http_url
        self.admin_header = admin_header
        self.admin_key = admin_key
        self.interval_s = interval_s
        self.reloads: list[tuple[str, float]] = []
        self._known: dict[int, str] = {}
        self._unknown_dead: set[int] = set()  # dead stubs never seen alive, already counted for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="triton-embed-stub-watchdog", daemon=True)

    def start(self) -> StubWatchdog:
        """Start watching: the stubs alive now are the ones watched, so one that dies right after is reloaded.

        Start it with ``tritonserver``: until the server is ready it looks every :data:`STARTUP_INTERVAL_S`, and a
        stub it knew that dies before the server answers (others still load) is reloaded once the server does.
        """
        self._known = stub_processes(self.server_pid)  # here, not in the thread: a kill may come before it runs
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (waits for a reload in progress)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=120)

    def _run(self) -> None:
        known, ready = self._known, False
        while not self._stop.wait(self.interval_s if ready else min(self.interval_s, STARTUP_INTERVAL_S)):
            try:
                known = self._tick(known)
                if not ready and server_answers(self.http_url, "ready"):
                    ready = True
                    log.info("server ready; watching the stubs of: %s", ", ".join(sorted(set(known.values()))))
                if ready:
                    self._catch_unknown(known)
            except Exception:  # the watchdog must outlive any one bad tick
                log.exception("stub watchdog tick failed")

    def _tick(self, known: dict[int, str]) -> dict[int, str]:
        """Reload models whose stubs in ``known`` died; return the stubs to look at next time.

        Stubs that Triton started since (a reload) join the next look; those it stopped drop out. A model whose
        reload failed, or that died while the server was not answering ``live`` (shutting down), keeps its dead
        stub in the next look, so it is tried again.
        """
        dead = crashed_stubs(self.server_pid, known)
        if dead and not server_answers(self.http_url, "live"):  # starting (endpoints come up after loads) or stopping
            return known | stub_processes(self.server_pid)
        staffing = self._staffing() if dead else {}
        if staffing is None:  # the server did not answer: look again next time
            return known | stub_processes(self.server_pid)
        # A READY model with every stub alive lost none: its dead stub is one a reload retired, that Triton has not
        # reaped yet on a busy machine (not a crash). _catch_unknown accounts for it if it stays a zombie.
        retired = {pid for pid, m in dead.items() if m in staffing and staffing[m][0] >= staffing[m][1]}
        if retired:
            log.info(
                "stub process %s exited with its model's stubs all alive (a reload); not a crash",
                ", ".join(map(str, sorted(retired))),
            )
        crashed = {pid: m for pid, m in dead.items() if pid not in retired}
        failed = {}
        for model in sorted(set(crashed.values())):
            if self._stop.is_set() or not self._reload(model):
                failed |= {pid: m for pid, m in crashed.items() if m == model}
        # A stub that died after crashed_stubs looked is a zombie now, which stub_processes leaves out: keep it. Looked
        # for after stub_processes, so that one dying while /proc is scanned is in one or the other, and reloaded.
        alive = stub_processes(self.server_pid)
        late = {
            pid: m
            for pid, m in known.items()
            if pid not in dead and pid not in alive and _zombie_child(pid, self.server_pid)
        }
        return alive | failed | late

    def _catch_unknown(self, known: dict[int, str], confirm_s: float = 0.25) -> None:
        """Reload the models a dead stub it never saw alive left short (it died within a look of its start).

        A zombie stub child of the server that is not in ``known`` is such a stub (a zombie has no command line
        left to name its model), once it is still there ``confirm_s`` later (a stub Triton stops is a zombie only
        until Triton reaps it). The models short of stubs (:meth:`_staffing`) are reloaded, which reaps it.
        """
        unknown = set(dead_stub_children(self.server_pid)) - set(known) - self._unknown_dead
        if not unknown:
            return
        time.sleep(confirm_s)
        unknown &= set(dead_stub_children(self.server_pid))
        if not unknown:
            return
        staffing = self._staffing()
        if staffing is None:  # the server did not answer: look again next time
            return
        short = [model for model, (alive, instances) in staffing.items() if alive < instances]
        log.warning(
            "stub process %s died before it was watched; short of stubs: %s",
            ", ".join(map(str, sorted(unknown))),
            ", ".join(short) or "no model",
        )
        if all([self._reload(model) for model in short]):
            self._unknown_dead |= unknown  # counted for: not again, even if Triton never reaps it

    def _staffing(self) -> dict[str, tuple[int, int]] | None:
        """READY models of a Python-based backend (config ``runtime: model.py``): ``{model: (live stubs, instances)}``.

        Instances: the config's ``instance_group`` counts, each times its GPUs (at least 1). None when the server
        did not answer (the repository index is an admin API: the watchdog's header unlocks it).
        """
        base = f"http://{self.http_url}/v2"
        try:
            request = urllib.request.Request(  # noqa: S310 - our own loopback server
                f"{base}/repository/index", data=b"{}", method="POST", headers={self.admin_header: self.admin_key}
            )
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
                index = json.loads(response.read())
            alive = list(stub_processes(self.server_pid).values())
            staffing = {}
            for model in sorted({entry["name"] for entry in index if entry.get("state") == "READY"}):
                with urllib.request.urlopen(f"{base}/models/{model}/config", timeout=10) as response:  # noqa: S310
                    config = json.loads(response.read())
                if config.get("runtime") != "model.py":
                    continue
                groups = config.get("instance_group") or [{}]
                instances = sum(int(g.get("count", 1)) * max(1, len(g.get("gpus") or [])) for g in groups)
                staffing[model] = (alive.count(model), instances)
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            log.error("counting the stubs per model failed: %s", exc)
            return None
        return staffing

    def _reload(self, model: str) -> bool:
        """Reload ``model`` with its current config (see the module docstring); False if that failed."""
        start = time.monotonic()
        log.warning("stub process of model '%s' died; reloading the model", model)
        try:
            base = f"http://{self.http_url}/v2"
            with urllib.request.urlopen(f"{base}/models/{model}/config", timeout=10) as response:  # noqa: S310
                config = json.loads(response.read())
            # Triton skips a load whose config equals the loaded one; a fresh parameter makes every reload real.
            config.setdefault("parameters", {})["TRITON_EMBED_RELOAD"] = {"string_value": str(time.time_ns())}
            body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
            request = urllib.request.Request(  # noqa: S310 - our own loopback server
                f"{base}/repository/models/{model}/load",
                data=body,
                method="POST",
                headers={self.admin_header: self.admin_key, "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=300) as response:  # noqa: S310
                response.read()
        except (urllib.error.URLError, OSError) as exc:
            log.error("reloading model '%s' failed: %s", model, exc)
            return False
        took = time.monotonic() - start
        self.reloads.append((model, took))
        log.warning("model '%s' reloaded in %.1f s", model, took)
        return True


def main(argv: list[str] | None = None) -> int:
    """The compose deployment's watchdog: watch the server's stubs from its start until it exits.

    Reads the admin key from ``TRITON_EMBED_ADMIN_KEY``; logs to stderr (the container's log). Returns 0 when
    the server process is gone, 2 without a key.

    With ``--finish-stop`` (the entrypoint's stop, after its signal to the server): :func:`finish_stop`; exits 0
    when it killed a server that waited only for a dead stub, 1 when the server exited by itself or outlived
    ``--timeout-s``. Needs no key.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-pid", type=int, required=True, help="the tritonserver process whose stubs to watch")
    parser.add_argument("--http-port", type=int, default=8000, help="its HTTP port, reached on 127.0.0.1")
    parser.add_argument("--admin-header", default=ADMIN_HEADER, help="header the repository API is locked to")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between looks at the stubs")
    parser.add_argument(
        "--finish-stop",
        action="store_true",
        help="the server was told to stop: wait until it exits, killing it if it waits only for a dead stub",
    )
    parser.add_argument("--timeout-s", type=float, default=40.0, help="with --finish-stop: longest wait, seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="triton-embed stub watchdog: %(message)s")
    if args.finish_stop:
        return 0 if finish_stop(args.server_pid, args.timeout_s) else 1
    key = os.environ.get("TRITON_EMBED_ADMIN_KEY", "")
    if not key:
        log.error("TRITON_EMBED_ADMIN_KEY is empty: the watchdog cannot reload models; not watching")
        return 2
    if not process_alive(args.server_pid):
        return 0
    watchdog = StubWatchdog(
        server_pid=args.server_pid,
        http_url=f"127.0.0.1:{args.http_port}",
        admin_header=args.admin_header,
        admin_key=key,
        interval_s=args.interval_s,
    ).start()
    log.info("watching the stubs of tritonserver (pid %d) from its start", args.server_pid)
    while process_alive(args.server_pid):
        time.sleep(args.interval_s)
    watchdog.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
