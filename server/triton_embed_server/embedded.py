"""Run the real ``tritonserver`` (from the nvidia-pytriton wheel) on our model repository, on CPU or GPU.

Usage::

    with EmbeddedServer(http_port=0, grpc_port=0, metrics_port=0) as server:   # 0 = a free loopback port
        print(server.grpc_url)    # e.g. 127.0.0.1:40123
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from triton_embed_protocol import served_ensembles
from triton_embed_protocol.overload import InFlight

from triton_embed_server.drain import DrainError, drain
from triton_embed_server.layout import (
    DEFAULT_BUILD_DIR,
    DEFAULT_MODEL_REPOSITORY,
    assemble_backends,
    find_layout,
    server_environment,
)
from triton_embed_server.shm import backend_regions, remove_orphans
from triton_embed_server.supervisor import ADMIN_HEADER, StubWatchdog, finish_stop, group_members

log = logging.getLogger("triton_embed_server")
ADMIN_KEY_ENV = "TRITON_EMBED_ADMIN_KEY"
RESTRICTED_APIS = "model-repository,shared-memory,logging,trace"
"""Triton API groups that need the admin header; the rest (inference, health, metadata, statistics) stay open."""
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class ServerError(RuntimeError):
    """tritonserver failed to start, exited, or did not become ready in time; the message ends with its log tail."""


class StopFlag:
    """A stop request that a signal handler may set: a plain attribute, no lock.

    Not a ``threading.Event``: a Python signal handler runs in the main thread between two bytecodes, possibly
    while that thread is inside ``Event.wait()`` holding the Event's lock, and ``Event.set()`` in the handler then
    waits for that lock forever: Ctrl-C would hang ``make serve`` (tests/unit/test_stop_flag.py forces the moment).
    """

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        """Request the stop (safe in a signal handler)."""
        self._set = True

    def is_set(self) -> bool:
        """True once :meth:`set` was called."""
        return self._set

    def wait(self, timeout_s: float) -> bool:
        """Sleep until set or ``timeout_s`` seconds have passed (polling every 50 ms); return :meth:`is_set`."""
        deadline = time.monotonic() + timeout_s
        while not self._set and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return self._set


class StartupCancelled(ServerError):
    """:meth:`EmbeddedServer.wait_ready` gave up because its ``cancel`` event was set (a signal during startup)."""


@dataclass(frozen=True)
class ServerConfig:
    """Command-line settings of the embedded server; names follow ``tritonserver --help``.

    Attributes:
        model_repository: folder with ``embed``, ``tokenizer``, ``encoder``.
        host: address HTTP, gRPC and metrics bind to; ``127.0.0.1`` keeps the server off the network.
        http_port, grpc_port, metrics_port: TCP ports; 0 picks a free one at start.
        cache_size_bytes: size of the local response cache (``--cache-config local,size=N``), bytes.
        model_config_name: ``--model-config-name`` (e.g. ``libtorch``); None uses each model's ``config.pbtxt``.
        log_verbose: ``--log-verbose`` level.
        log_file: where tritonserver's stdout/stderr go; None inherits ours.
        exit_timeout_s: ``--exit-timeout-secs``, how long shutdown waits for in-flight requests, seconds.
        admin_key: value of the admin header that unlocks the restricted APIs (model repository, shared memory,
            logging, trace) on HTTP and gRPC; None = a random key made at start (the admin APIs then serve only
            this process, e.g. its stub watchdog). Inference, health, metadata, config and statistics stay open.
        admin_header: name of that header.
        watch_stubs: run :class:`~triton_embed_server.supervisor.StubWatchdog` while the server is up.
        extra_args: appended verbatim to the command line.
    """

    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    cache_size_bytes: int = 64 * 1024 * 1024
    model_config_name: str | None = None
    log_verbose: int = 0
    log_file: Path | None = None
    exit_timeout_s: int = 30
    admin_key: str | None = None
    admin_header: str = ADMIN_HEADER
    watch_stubs: bool = True
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# The child must get SIGTERM when its parent dies (no orphan servers). util-linux's setpriv sets that before it
# execs tritonserver; without it, a preexec_fn calls prctl, resolved here, before any fork: loading a library in
# a forked child of a threaded process can deadlock (Popen hangs while gRPC threads run).
_SETPRIV = shutil.which("setpriv")
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """Fallback preexec_fn: ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` with the function resolved before the fork."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def port_in_use(host: str, port: int) -> bool:
    """True if something listens on ``host:port`` now.

    A probe bind with ``SO_REUSEADDR``, as servers bind: a port left in TIME_WAIT by a server that just stopped
    counts as free.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def listens_on(pid: int, port: int) -> bool:
    """True if process ``pid`` holds a listening TCP socket on ``port`` (any address, IPv4 or IPv6).

    From /proc: the socket inodes listening on ``port`` (``/proc/net/tcp``, ``tcp6``: state ``0A``) against the
    inodes of ``pid``'s open files. True as well when ``pid``'s files cannot be read, so that it never holds back
    a readiness check where /proc says nothing.
    """
    try:
        held = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
    except OSError:
        return True
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port and f"socket:[{cols[9]}]" in held:
                    return True
    return False


def kill_leftovers(pgid: int, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL what is left of an exited tritonserver's process group; returns the PIDs that were left.

    tritonserver runs in its own session, so its process group (``pgid``, its PID) holds it and its Python backend
    stubs. A stub exits by itself once its server is gone, but not while it is stuck (in a long execution, or
    stopped): one left by a SIGKILLed tritonserver keeps running under PID 1, with its memory and its 1 MiB region
    in /dev/shm. Waits up to ``timeout_s`` seconds for them to go.
    """
    left = group_members(pgid)
    if not left:
        return []
    log.warning("killing %d process(es) tritonserver left behind: %s", len(left), left)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _spawn_args(command: list[str]) -> tuple[list[str], object]:
    """``(argv, preexec_fn)`` that start ``command`` with the parent-death signal set."""
    if _SETPRIV:
        return [_SETPRIV, "--pdeathsig", "TERM", "--", *command], None
    return command, _die_with_parent


class EmbeddedServer:
    """A ``tritonserver`` child process serving our model repository.

    The child gets SIGTERM if this process dies (``PR_SET_PDEATHSIG``; note it is tied to the thread that called
    :meth:`start`). :meth:`stop` sends SIGINT, waits ``exit_timeout_s + 10`` s, then SIGKILL.
    """

    DRAIN_SETTLE_S = 0.1
    """Pause between the drain and the stop signal, seconds (:meth:`stop`)."""

    def __init__(self, *, config: ServerConfig | None = None, **overrides) -> None:
        """Take a :class:`ServerConfig` and/or its fields as keywords (``EmbeddedServer(http_port=0)``)."""
        self.config = replace(config or ServerConfig(), **overrides)
        self._process: subprocess.Popen | None = None
        self._log_handle = None
        self._regions_before: set[str] | None = None  # /dev/shm regions before the first start (kept by restarts)
        self.watchdog: StubWatchdog | None = None

    # -- addresses --------------------------------------------------------------------------------------------
    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host  # noqa: S104 - a wildcard is reached via loopback

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP/REST endpoint (what tritonclient.http takes)."""
        return f"{self._client_host}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint (what tritonclient.grpc takes)."""
        return f"{self._client_host}:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Prometheus metrics URL."""
        return f"http://{self._client_host}:{self.config.metrics_port}/metrics"

    # -- lifecycle --------------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        """The tritonserver command line (after ports are resolved)."""
        c = self.config
        layout = find_layout()
        args = [
            str(layout.binary),
            f"--model-repository={c.model_repository}",
            f"--backend-directory={assemble_backends(layout, DEFAULT_BUILD_DIR)}",
            f"--cache-directory={layout.cache_dir}",
            f"--cache-config=local,size={c.cache_size_bytes}",
            # explicit (not none): the stub watchdog reloads a model whose stub died; the repository API that
            # allows it is behind the admin header like every other admin API.
            "--model-control-mode=explicit",
            "--load-model=*",
            # every config is complete: with auto-complete, the Python backend starts one more stub per model only
            # to ask its model.py for a config, and the encoder's imports torch for it (ready 5.8-6.0 s -> 2.5-2.8 s)
            "--disable-auto-complete-config",
            f"--http-restricted-api={RESTRICTED_APIS}:{c.admin_header}={c.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{c.admin_header}={c.admin_key}",
            "--strict-readiness=true",
            "--exit-on-error=true",
            f"--exit-timeout-secs={c.exit_timeout_s}",
            f"--http-address={c.host}",
            f"--http-port={c.http_port}",
            f"--grpc-address={c.host}",
            f"--grpc-port={c.grpc_port}",
            "--allow-metrics=true",
            f"--metrics-address={c.host}",
            f"--metrics-port={c.metrics_port}",
            # p50..p99.9 per model, as in docker-compose.yml: the p99-over-SLA alert and the dashboard read them
            "--metrics-config=summary_latencies=true",
            f"--log-verbose={c.log_verbose}",
        ]
        if c.model_config_name:
            args.append(f"--model-config-name={c.model_config_name}")
        return args + list(c.extra_args)

    def start(self) -> EmbeddedServer:
        """Start tritonserver and its stub watchdog (``watch_stubs``); does not wait for readiness (:meth:`wait_ready`).

        Raises:
            ServerError: already started, or a configured port is in use (Triton would load every model and only
                then fail to bind, while readiness checks reached whatever holds the port).
            LayoutError: nvidia-pytriton files missing.
        """
        if self._process is not None:
            raise ServerError("server already started")
        for kind in ("http", "grpc", "metrics"):
            port = getattr(self.config, f"{kind}_port")
            if port and port_in_use(self.config.host, port):
                raise ServerError(
                    f"{kind} port {port} on {self.config.host} is in use (another `make serve` or tritonserver?): "
                    f"stop it, or choose another port (--{kind}-port, make {kind.upper()}_PORT=...)"
                )
        ports = {k: getattr(self.config, k) or free_port() for k in ("http_port", "grpc_port", "metrics_port")}
        self.config = replace(self.config, **ports, admin_key=self.config.admin_key or secrets.token_urlsafe(24))
        if not any(self.config.model_repository.glob("*/1/model.pt")):
            raise ServerError(f"no model exported in {self.config.model_repository}: run `make model` first")
        stdout = None
        if self.config.log_file is not None:
            self.config.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log_handle = open(self.config.log_file, "ab")  # noqa: SIM115 - closed in stop()
            stdout = self._log_handle
        argv, preexec = _spawn_args(self.command())
        if self._regions_before is None:  # a restart keeps it: the crashed run's regions may still be mapped then
            self._regions_before = backend_regions()
        self._process = subprocess.Popen(  # noqa: S603 - fixed binary, our own arguments
            argv,
            env=server_environment(find_layout()),
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout else None,
            stdin=subprocess.DEVNULL,
            preexec_fn=preexec,  # noqa: PLW1509 - None when setpriv is there; else only an async-signal-safe call
            # its own process group: a terminal's Ctrl-C reaches only us, so stop() drains before tritonserver
            # hears of it (the parent-death signal still ends it with us)
            start_new_session=True,
        )
        if self.config.watch_stubs:  # from the start: a stub that dies while others still load is reloaded too
            self.watchdog = StubWatchdog(
                server_pid=self._process.pid,
                http_url=self.http_url,
                admin_header=self.config.admin_header,
                admin_key=self.config.admin_key,
            ).start()
        return self

    def is_alive(self) -> bool:
        """True while the tritonserver process runs."""
        return self._process is not None and self._process.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The exit status of tritonserver once it has exited (negative: the signal that ended it), else None."""
        return self._process.poll() if self._process is not None else None

    def admin_headers(self, protocol: str = "http") -> dict[str, str]:
        """The header that unlocks the restricted APIs (after :meth:`start`), e.g. for a shared-memory client.

        gRPC carries it as metadata ``triton-grpc-protocol-<header>`` (Triton's naming for restricted protocols).
        """
        prefix = "triton-grpc-protocol-" if protocol == "grpc" else ""
        return {prefix + self.config.admin_header: self.config.admin_key or ""}

    @property
    def pid(self) -> int | None:
        """PID of the tritonserver process, or None before start."""
        return self._process.pid if self._process else None

    def is_ready(self) -> bool:
        """True when ``GET /v2/models/<name>/ready`` answers 200 for every ensemble (:meth:`ensembles`)."""
        for name in self.ensembles():
            try:
                url = f"http://{self.http_url}/v2/models/{name}/ready"
                with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own http:// URL
                    if response.status != 200:
                        return False
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False
        return True

    def ensembles(self) -> list[str]:
        """The models ``make model`` exported into the repository (``served_ensembles``: ``embed`` first)."""
        return served_ensembles(self.config.model_repository)

    def wait_ready(self, timeout_s: float = 180.0, cancel: StopFlag | threading.Event | None = None) -> EmbeddedServer:
        """Block until every model is READY and the metrics port listens, or ``cancel`` is set.

        Triton opens its metrics port last, tens of ms after the HTTP one: a scrape right after ready must not be
        refused.

        Raises:
            StartupCancelled: ``cancel`` was set first (``serve`` sets it on SIGTERM/SIGINT: loading the models
                takes seconds, minutes for a long max_seq_length, and a stop asked for meanwhile must not wait).
            ServerError: the process exited, or ``timeout_s`` seconds passed; the message has the log tail.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise StartupCancelled("stop requested before the server was ready")
            if not self.is_alive():
                code = self._process.returncode if self._process else None
                raise ServerError(f"tritonserver exited with code {code} before it was ready{self._log_tail()}")
            # ours, not another server's answer on the same port (two started at once both pass start()'s check;
            # the one that loses the bind would otherwise report ready before it exits)
            if (
                self.is_ready()
                and listens_on(self.pid, self.config.http_port)
                and listens_on(self.pid, self.config.metrics_port)
            ):
                return self
            time.sleep(0.25)
        raise ServerError(f"models not ready after {timeout_s:.0f} s{self._log_tail()}")

    def stop(self) -> int | None:
        """Drain, stop tritonserver (SIGINT, then SIGKILL after ``exit_timeout_s + 10`` s); return its exit code.

        A ready server is drained first (``drain.py``): the ``embed`` ensemble is unloaded, which refuses new
        requests and lets those in flight finish through both steps, for up to ``exit_timeout_s`` seconds. A server
        that then waits only for a model instance whose stub died is killed at once, and 0 returned
        (``supervisor.finish_stop``: Triton 2.51 would wait out its exit timeout and exit 1). Then
        removes the Python backend regions in ``/dev/shm`` that appeared while it ran and that no live process
        maps (left by killed stubs: ``shm.py``), after killing any stub that outlived it (:func:`kill_leftovers`),
        and the overload control's in-flight file (``InFlight.remove_files``).
        """
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.is_alive() and self.is_ready():
            try:
                took = drain(self.http_url, None, self.admin_headers("http"), self.config.exit_timeout_s)
            except DrainError as exc:
                log.warning("no drain (%s); stopping anyway", exc)
            else:
                if took is None:
                    log.warning("the ensembles did not drain within %d s; stopping", self.config.exit_timeout_s)
                # Triton's HTTP server counts the drain's last connection, closed a moment ago, as still open if the
                # stop signal comes first, and its shutdown then waits a whole 1-s poll for it (stop: 3.8 s, 2.8 s)
                time.sleep(self.DRAIN_SETTLE_S)
        process, self._process = self._process, None
        code = None
        if process is not None:
            stuck_on = []
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                stuck_on = finish_stop(process.pid, self.config.exit_timeout_s + 10)
                try:
                    process.wait(timeout=10 if stuck_on else 1)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            # killed while it waited only for a dead stub (finish_stop): a clean stop, nothing was left to serve
            code = 0 if stuck_on else process.returncode
            kill_leftovers(process.pid)
            InFlight.remove_files(process.pid)  # the overload control's count, kept in /dev/shm while it ran
            # regions of stubs killed while it ran (Triton leaves them; see shm.py), now that nothing maps them
            remove_orphans(backend_regions() - (self._regions_before or set()))
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        return code

    def _log_tail(self, lines: int = 40) -> str:
        if self.config.log_file is None or not self.config.log_file.is_file():
            return ""
        tail = self.config.log_file.read_text(errors="replace").splitlines()[-lines:]
        return f"\n--- last lines of {self.config.log_file} ---\n" + "\n".join(tail)

    def __enter__(self) -> EmbeddedServer:
        """Start and wait until ready; stop if that fails."""
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        """Stop the server."""
        with contextlib.suppress(Exception):
            self.stop()
