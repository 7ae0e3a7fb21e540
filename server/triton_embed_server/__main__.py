"""``python -m triton_embed_server serve``: run the embedded Triton server in the foreground until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
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
from triton_embed_server.layout import LayoutError


def _parser() -> argparse.ArgumentParser:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(prog="python -m triton_embed_server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start tritonserver with the model repository and wait")
    serve.add_argument("--host", default=defaults.host, help="bind address (default %(default)s: loopback only)")
    serve.add_argument("--http-port", type=int, default=defaults.http_port)
    serve.add_argument("--grpc-port", type=int, default=defaults.grpc_port)
    serve.add_argument("--metrics-port", type=int, default=defaults.metrics_port)
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
    server = EmbeddedServer(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        model_repository=args.model_repository.resolve(),
        model_config_name=args.model_config_name,
        log_verbose=args.log_verbose,
        admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
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
    key_note = (
        f" = ${ADMIN_KEY_ENV}" if os.environ.get(ADMIN_KEY_ENV) else f" (locked: set {ADMIN_KEY_ENV} to use them)"
    )
    print(
        f"\ntriton-embed is ready: model 'embed'\n"
        f"  HTTP    http://{server.http_url}   (curl http://{server.http_url}/v2/models/embed)\n"
        f"  gRPC    {server.grpc_url}\n"
        f"  metrics {server.metrics_url}\n"
        f"Admin APIs (model repository, shared memory, logging, trace) need header '{server.config.admin_header}'"
        f"{key_note}.\n"
        f"{_exposure_note(args.host)}"
        f"Ctrl-C stops it.",
        flush=True,
    )
    restarts: list[float] = []
    while not stop.wait(0.5):
        if not server.is_alive() and not _restart(server, args, stop, restarts):
            return 1
    return _stop(server, "stopping tritonserver ...")


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
