"""``python -m triton_embed_server serve``: run the embedded Triton server in the foreground until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from triton_embed_server.embedded import (
    ADMIN_KEY_ENV,
    DEFAULT_MODEL_REPOSITORY,
    EmbeddedServer,
    ServerConfig,
    ServerError,
    StartupCancelled,
    StopFlag,
)
from triton_embed_server.export import served_models
from triton_embed_server.layout import LayoutError
from triton_embed_server.tracing import TraceConfigError, traces_url, triton_trace_args


def _parser() -> argparse.ArgumentParser:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(prog="python -m triton_embed_server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start tritonserver with the model repository and wait")
    serve.add_argument("--host", default=defaults.host, help="bind address (default %(default)s: loopback only)")
    serve.add_argument("--http-port", type=int, default=defaults.http_port)
    serve.add_argument("--grpc-port", type=int, default=defaults.grpc_port)
    serve.add_argument("--metrics-port", type=int, default=defaults.metrics_port)
    serve.add_argument(
        "--gateway-port", type=int, default=0, help="port of the OpenAI/TEI HTTP gateway beside it (default 0: none)"
    )
    serve.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    serve.add_argument("--model-config-name", default=None, help="e.g. libtorch (needs the official Triton image)")
    serve.add_argument("--log-verbose", type=int, default=0)
    serve.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for READY")
    serve.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts of tritonserver after an unexpected exit within 10 minutes before giving up (default 3)",
    )
    return parser


def install_stop_handlers() -> StopFlag:
    """SIGINT and SIGTERM set the returned flag (lock-free: see :class:`StopFlag`)."""
    stop = StopFlag()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def serve(args: argparse.Namespace) -> int:
    """Start, wait for READY, print the endpoints, block until a signal, stop. Returns the exit status.

    An unexpected exit of tritonserver is logged with its exit status and restarted, at most ``--max-restarts``
    times within 10 minutes. The admin key comes from ``TRITON_EMBED_ADMIN_KEY`` (else a random one).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        trace_args = triton_trace_args(os.environ)  # OTEL_EXPORTER_OTLP_ENDPOINT & co: Triton's traces on
    except TraceConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = EmbeddedServer(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        model_repository=args.model_repository.resolve(),
        model_config_name=args.model_config_name,
        log_verbose=args.log_verbose,
        admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
        extra_args=trace_args,
    )
    stop = install_stop_handlers()
    try:
        server.start()
        print(f"starting tritonserver (pid {server.pid}) on {args.host} ...", flush=True)
        server.wait_ready(args.ready_timeout, cancel=stop)
    except StartupCancelled:
        return _stop(server, "stopping tritonserver (stop requested before it was ready) ...")
    except (ServerError, LayoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        server.stop()
        return 1
    models = server.ensembles()
    served = served_models(server.config.model_repository)
    rerankers = tuple(name for name in models if served.get(name, {}).get("kind") == "reranker")
    gateway = (
        Gateway(server.grpc_url, args.host, args.gateway_port, models, server.config.admin_key, rerankers=rerankers)
        if args.gateway_port
        else None
    )
    if gateway is not None and not gateway.start():
        return _stop(server, "stopping tritonserver (the gateway did not start) ...")
    traced = "Triton and the gateway" if gateway else "Triton"
    trace_note = f"  traces  OTLP {traces_url(os.environ)} ({traced})\n" if trace_args else ""
    key_note = (
        f" = ${ADMIN_KEY_ENV}" if os.environ.get(ADMIN_KEY_ENV) else f" (locked: set {ADMIN_KEY_ENV} to use them)"
    )
    print(
        f"\ntriton-embed is ready: {'models' if len(models) > 1 else 'model'} {', '.join(models)}\n"
        f"  HTTP    http://{server.http_url}   (curl http://{server.http_url}/v2/models/{models[0]})\n"
        f"  gRPC    {server.grpc_url}\n"
        f"  metrics {server.metrics_url}\n"
        f"{gateway.banner() if gateway else ''}"
        f"{trace_note}"
        f"Admin APIs (model repository, shared memory, logging, trace) need header '{server.config.admin_header}'"
        f"{key_note}.\n"
        f"{_exposure_note(args.host)}"
        f"Ctrl-C stops it.",
        flush=True,
    )
    restarts: list[float] = []
    try:
        while not stop.wait(0.5):
            if not server.is_alive() and not _restart(server, args, stop, restarts):
                return 1
            if gateway is not None and not gateway.is_alive():
                print(f"warning: the gateway exited with status {gateway.returncode()}; restarting", file=sys.stderr)
                gateway.start()
    finally:
        if gateway is not None:
            gateway.stop()
    return _stop(server, "stopping tritonserver ...")


class Gateway:
    """The embeddings HTTP gateway (``python -m triton_embed_gateway``) as a child process, on ``host:port``."""

    def __init__(  # noqa: PLR0913 - where it runs and what it serves
        self,
        grpc_url: str,
        host: str,
        port: int,
        models: list[str],
        admin_key: str | None = None,
        *,
        rerankers: tuple[str, ...] = (),
    ) -> None:
        """Start nothing yet; ``models``: the ensembles it serves, the first the default.

        ``admin_key``: Triton's admin key, with which the gateway sets Triton's trace rate; ``rerankers``: which of
        ``models`` are rerankers (named in the banner beside the rerank routes).
        """
        self.models, self.rerankers = models, rerankers
        self._env = {**os.environ, ADMIN_KEY_ENV: admin_key} if admin_key else None
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '', '::') else host}:{port}"  # noqa: S104
        self._command = [
            sys.executable,
            "-m",
            "triton_embed_gateway",
            "--triton",
            grpc_url,
            "--host",
            host,
            "--port",
            str(port),
            *(arg for model in models for arg in ("--model", model)),
        ]
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> bool:
        """Start it and wait until ``/health`` answers; False (with the reason printed) if it does not."""
        self._process = subprocess.Popen(self._command, env=self._env)  # noqa: S603 - our own module, our own arguments
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                print(f"error: the gateway exited with status {self._process.returncode}", file=sys.stderr)
                return False
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).close()  # noqa: S310 - http to ourselves
                return True
            except OSError:
                time.sleep(0.1)
        print(f"error: the gateway did not answer on {self.url} within {timeout_s:.0f} s", file=sys.stderr)
        self.stop()
        return False

    def banner(self) -> str:
        """Its lines in the ready banner: the embedding routes, and the rerank routes when a reranker is served."""
        lines = ""
        if len(self.rerankers) < len(self.models):
            lines += f"  OpenAI  {self.url}/v1/embeddings   (TEI: {self.url}/embed)\n"
        if self.rerankers:
            lines += f"  rerank  {self.url}/v1/rerank   (TEI: {self.url}/rerank; {', '.join(self.rerankers)})\n"
        return lines

    def is_alive(self) -> bool:
        """Whether the process runs."""
        return self._process is not None and self._process.poll() is None

    def returncode(self) -> int | None:
        """Its exit status, None while it runs."""
        return None if self._process is None else self._process.poll()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _exposure_note(host: str) -> str:
    """A warning line when ``host`` is not loopback: the banner's URLs are the local ones, the bind is wider."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return ""
    wildcard = " (gRPC on every address, IPv6 included)" if host in ("0.0.0.0", "", "::") else ""  # noqa: S104
    return (
        f"Bound to {host}: inference, health, metadata, statistics and metrics are open to the network without a "
        f"key{wildcard}; see docs/operations.md, 'Threat model and the admin lock'.\n"
    )


def _restart(server: EmbeddedServer, args: argparse.Namespace, stop: StopFlag, restarts: list[float]) -> bool:
    """Restart a tritonserver that exited, until one is ready, a stop is requested, or the restarts run out.

    A restart that dies before it is ready (killed again, out of memory again) counts as one more restart and is
    followed by the next, so ``--max-restarts`` bounds them all (``restarts``: their times, updated in place).

    Returns:
        False when the restarts ran out (``--max-restarts`` within 10 minutes): the caller exits 1.
    """
    code = server.stop()
    while not stop.is_set():
        restarts[:] = [t for t in restarts if time.monotonic() - t < 600]
        if len(restarts) >= args.max_restarts:
            print(
                f"error: tritonserver exited with status {code}; {len(restarts)} restarts in 10 min, giving up",
                file=sys.stderr,
            )
            return False
        restarts.append(time.monotonic())
        print(f"warning: tritonserver exited unexpectedly with status {code}; restarting", file=sys.stderr, flush=True)
        try:
            server.start().wait_ready(args.ready_timeout, cancel=stop)
        except StartupCancelled:
            return True
        except (ServerError, LayoutError) as exc:
            print(f"warning: restart failed: {exc}", file=sys.stderr, flush=True)
            code = server.stop()
            continue
        print(f"tritonserver restarted (pid {server.pid})", flush=True)
        return True
    return True


def _stop(server: EmbeddedServer, message: str) -> int:
    """Print ``message``, drain and stop ``server``; the exit status: 0 for a clean stop, else tritonserver's."""
    print(message, flush=True)
    code = server.stop()
    return 0 if code in (0, None, -signal.SIGINT) else code


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = _parser().parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
