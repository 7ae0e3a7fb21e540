"""Locust entry point: ``python -m locust -f loadtest/locustfile.py`` (``make loadtest`` / ``make loadtest-ui``).

Users: :class:`GrpcUser` and :class:`HttpUser` (binary tensors), each one closed-loop caller with its own client;
name classes on the command line to run only some (``... GrpcUser``). Texts: STS-B sentences, or ``--corpus FILE``.
At the end of a run the SLA gate prints ``SLA PASS``/``SLA FAIL`` and sets the exit code; the report goes to
``--report-dir`` (default ``loadtest/runs/<time>/``). Options beyond Locust's own are listed by ``--help``.
"""

from __future__ import annotations

# gRPC's C core must cooperate with gevent before the first channel exists, or each call blocks Locust's loop.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `loadtest` is importable however Locust starts

from locust import events  # noqa: E402

from loadtest.corpus import CorpusError, Deck, load_corpus  # noqa: E402
from loadtest.session import LoadRun  # noqa: E402
from loadtest.users import GrpcUser, HttpUser  # noqa: E402

__all__ = ["GrpcUser", "HttpUser"]


@events.init_command_line_parser.add_listener
def add_options(parser) -> None:
    """Our options: where the server is, the SLA, the warm-up, the corpus, the report folder."""
    group = parser.add_argument_group("triton-embed")
    group.add_argument("--triton-host", default=os.environ.get("TRITON_EMBED_HOST", "127.0.0.1"), help="server host")
    group.add_argument("--http-port", type=int, default=8000, help="Triton HTTP port (also used for statistics)")
    group.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC port")
    group.add_argument("--model", default="embed", help="the ensemble to call")
    group.add_argument(
        "--rerank-model",
        default=None,
        help="a reranker's ensemble: each user also reranks 8 texts against one (weight 2 of 13), same SLA",
    )
    group.add_argument("--corpus", default=None, help="text file, one text per line (default: STS-B train+dev)")
    group.add_argument(
        "--deck-seed",
        type=int,
        default=None,
        help="order of the one-text requests' texts (default: random); with --deck-start, continue an earlier run",
    )
    group.add_argument("--deck-start", type=int, default=0, help="texts of --deck-seed's order already sent")
    group.add_argument("--request-timeout-s", type=float, default=10.0, help="per-request timeout, seconds")
    group.add_argument("--sla-ms", type=float, default=200.0, help="p99 latency limit, ms (the SLA)")
    group.add_argument("--sla-p95-ms", type=float, default=None, help="p95 latency limit, ms (default: --sla-ms)")
    group.add_argument("--max-fail-ratio", type=float, default=0.001, help="failed/all requests limit (0.001=0.1%%)")
    group.add_argument("--min-requests", type=int, default=100, help="fewer successes in the window is a FAIL")
    group.add_argument("--warmup-s", type=float, default=5.0, help="seconds after the last user starts not measured")
    group.add_argument("--metrics-port", type=int, default=8002, help="Triton metrics port (refusals, GPU flags)")
    group.add_argument("--gpu-interval-s", type=float, default=0.5, help="NVML sampling interval, seconds")
    group.add_argument(
        "--refusals-interval-s",
        type=float,
        default=1.0,
        help="seconds between reads of the refusal counter on Triton's /metrics (the report's timeline)",
    )
    group.add_argument("--report-dir", default=None, help="run folder (default loadtest/runs/<time>/)")


@events.init.add_listener
def on_init(environment, **_) -> None:
    """Load the corpus once for all users and attach the run's gate and report to this environment.

    Exits with a one-line message when the corpus is missing (STS-B absent and no ``--corpus``) or the server's
    statistics API does not answer (no server at ``--triton-host``/``--http-port``).
    """
    try:
        environment.corpus = load_corpus(environment.parsed_options.corpus)
        o = environment.parsed_options
        environment.deck = Deck(environment.corpus, seed=o.deck_seed, start=o.deck_start)
    except CorpusError as exc:
        sys.exit(f"loadtest: {exc} (--corpus FILE)")
    run = LoadRun(environment)
    try:
        run.stats.snapshot()
    except Exception as exc:  # noqa: BLE001 - any failure here means: no server to test
        sys.exit(
            f"loadtest: cannot read Triton's statistics at {run.stats.url} ({exc}); start the server "
            "(make serve) or point --triton-host/--http-port at it"
        )
    environment.load_run = run
