"""``triton-embed-gateway`` (``python -m triton_embed_gateway``): the embeddings HTTP API in front of one Triton.

Several models: ``triton-embed-gateway --model embed --model multi --served-model-name multi=multilingual-e5-small``,
or ``--repository DIR``: every ensemble of the model repository Triton serves (compose and Kubernetes mount it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import uvicorn
from triton_embed_protocol import served_ensembles

from triton_embed_gateway.app import ADMIN_HEADER, DEFAULT_PAYLOAD_LIMIT, GatewaySettings, build_app
from triton_embed_gateway.protocol import DEFAULT_MAX_INPUTS
from triton_embed_gateway.sampling import SamplingConfigError, SamplingPolicy
from triton_embed_gateway.tracing import Tracing
from triton_embed_gateway.triton import TritonEmbedder

API_KEY_ENV = "TRITON_EMBED_API_KEY"
ADMIN_KEY_ENV = "TRITON_EMBED_ADMIN_KEY"
DEFAULT_PORT = 8080


def parser() -> argparse.ArgumentParser:
    """The command line's options."""
    p = argparse.ArgumentParser(prog="triton-embed-gateway", description=__doc__)
    p.add_argument("--triton", default="127.0.0.1:8001", help="Triton's gRPC host:port (default %(default)s)")
    p.add_argument(
        "--model",
        action="append",
        help="an ensemble to serve, repeatable; the first is the TEI routes' and a request's without 'model' "
        "(default: embed)",
    )
    p.add_argument(
        "--repository",
        type=Path,
        metavar="DIR",
        help="serve every ensemble of the model repository DIR (embed first), after the --model ones",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="[MODEL=]ID",
        help="the id answered in 'model' and /v1/models for MODEL (without MODEL=: the first), repeatable",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (default %(default)s)")
    p.add_argument(
        "--api-key", default=None, help=f"Bearer key the embedding routes need (default: ${API_KEY_ENV}, else none)"
    )
    p.add_argument("--payload-limit", type=int, default=DEFAULT_PAYLOAD_LIMIT, help="largest body, bytes")
    p.add_argument("--max-inputs", type=int, default=DEFAULT_MAX_INPUTS, help="most texts per API request")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of each Triton request, seconds")
    p.add_argument(
        "--admin-header",
        default=ADMIN_HEADER,
        help=f"header of Triton's admin lock, key in ${ADMIN_KEY_ENV} (default %(default)s): sets its trace_rate",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM. Returns the exit status (2 for a bad option)."""
    args = parser().parse_args(argv)
    for name in ("payload_limit", "max_inputs", "timeout"):
        if getattr(args, name) <= 0:
            print(
                f"triton-embed-gateway: --{name.replace('_', '-')} must be > 0; got {getattr(args, name)}",
                file=sys.stderr,
            )
            return 2
    try:
        sampling = SamplingPolicy.from_environment(os.environ)
    except SamplingConfigError as exc:
        print(f"triton-embed-gateway: {exc}", file=sys.stderr)
        return 2
    models = list(args.model or [])
    if args.repository is not None:
        found = served_ensembles(args.repository)
        if not found:
            print(f"triton-embed-gateway: --repository {args.repository}: no ensemble in it", file=sys.stderr)
            return 2
        models += [name for name in found if name not in models]
    models = models or ["embed"]
    names = {}
    for alias in args.served_model_name:
        model, _, name = alias.rpartition("=")
        if model and model not in models:
            print(f"triton-embed-gateway: --served-model-name {alias}: {model} is not a --model", file=sys.stderr)
            return 2
        names[model or models[0]] = name
    settings = GatewaySettings(
        served_names=names,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        payload_limit=args.payload_limit,
        max_inputs=args.max_inputs,
        sampling=sampling,
        admin_header=args.admin_header,
        admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
    )
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("triton-embed-gateway: %(message)s"))
    logger = logging.getLogger("triton_embed_gateway")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    tracing = Tracing.from_environment()  # OTEL_EXPORTER_OTLP_ENDPOINT & co; off without an endpoint
    app = build_app([TritonEmbedder(args.triton, model, args.timeout, tracing) for model in models], settings)
    print(
        f"triton-embed-gateway: http://{args.host}:{args.port}/v1/embeddings -> grpc://{args.triton} "
        f"({', '.join(names.get(m, m) for m in models)})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
