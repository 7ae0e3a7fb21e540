"""``python -m triton_embed_server serve``: run the embedded Triton server in the foreground until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from triton_embed_server.embedded import DEFAULT_MODEL_REPOSITORY, EmbeddedServer, ServerConfig, ServerError
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
    return parser


def serve(args: argparse.Namespace) -> int:
    """Start, wait for READY, print the endpoints, block until a signal, stop. Returns the exit status."""
    server = EmbeddedServer(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        model_repository=args.model_repository.resolve(),
        model_config_name=args.model_config_name,
        log_verbose=args.log_verbose,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
        print(f"starting tritonserver (pid {server.pid}) on {args.host} ...", flush=True)
        server.wait_ready(args.ready_timeout)
    except (ServerError, LayoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        server.stop()
        return 1
    print(
        f"\ntriton-embed is ready: model 'embed'\n"
        f"  HTTP    http://{server.http_url}   (curl http://{server.http_url}/v2/models/embed)\n"
        f"  gRPC    {server.grpc_url}\n"
        f"  metrics {server.metrics_url}\n"
        f"Ctrl-C stops it.",
        flush=True,
    )
    while not stop.wait(0.5):
        if not server.is_alive():
            print("error: tritonserver exited unexpectedly", file=sys.stderr)
            return server.stop() or 1
    print("stopping tritonserver ...", flush=True)
    code = server.stop()
    return 0 if code in (0, None, -signal.SIGINT) else code


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = _parser().parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
