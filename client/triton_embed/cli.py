"""``triton-embed``: embed texts and compare them from the command line.

    triton-embed embed "A man plays a guitar." "Someone plays music."   # one vector per line
    triton-embed embed --file texts.txt --json                            # one text per line
    triton-embed embed --input-type query --dimensions 128 "a question"   # prompt, Matryoshka width
    triton-embed similarity "A man plays a guitar." "Someone plays music."
    echo "text from stdin" | triton-embed embed --json
    triton-embed health
    triton-embed --url 10.0.0.5:8001 health                               # options before or after the subcommand
    triton-embed --url 10.0.0.5:8001,10.0.0.6:8001 embed "a text"          # several servers: balanced, failover
    triton-embed stats                                                    # per-step latency breakdown
    triton-embed gateway --triton 127.0.0.1:8001 --port 8080              # the OpenAI/TEI HTTP API

URL and protocol: ``--url``/``--protocol``, else ``TRITON_EMBED_URL``/``TRITON_EMBED_PROTOCOL``, else gRPC on
127.0.0.1:8001; a url scheme (``http://``, ``grpc://``) picks the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.request
from importlib.metadata import PackageNotFoundError, version

from triton_embed import server_stats
from triton_embed.client import EmbeddingClient
from triton_embed.errors import EmbeddingError


def _add_common_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The options every subcommand takes, accepted before the subcommand and after it.

    Args:
        parser: the main parser (``defaults=True``) or the subcommands' parent parser (``defaults=False``).
        defaults: whether the options have their defaults here. The subcommands' copies have none
            (``argparse.SUPPRESS``): argparse copies every value a subparser holds over the main parser's, so a
            default there would overwrite ``--url`` given before the subcommand. Given in both places, the value
            after the subcommand wins.
    """

    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--url",
        default=default(None),
        help="host:port, or several separated by commas: requests are spread over them and fail over (default: "
        "$TRITON_EMBED_URL, else 127.0.0.1:8001 for grpc, 127.0.0.1:8000 for http)",
    )
    parser.add_argument(
        "--protocol",
        choices=("grpc", "http"),
        default=default(None),
        help="default: the --url scheme, else $TRITON_EMBED_PROTOCOL, else grpc",
    )
    parser.add_argument(
        "--model", default=default(None), help="model name (default: embed; for the rerank command: rerank)"
    )
    parser.add_argument("--timeout", type=float, default=default(30.0), help="seconds per request (default: 30)")
    parser.add_argument("--json", action="store_true", default=default(False), help="print JSON")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triton-embed", description="Client for the triton-embed service.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_common_options(parser, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _add_common_options(common, defaults=False)
    sub = parser.add_subparsers(dest="command", required=True)
    embed = sub.add_parser("embed", parents=[common], help="print one embedding per text")
    embed.add_argument(
        "texts", nargs="*", help="texts; none = one text per line of --file or stdin (a blank line is the empty text)"
    )
    embed.add_argument("--file", type=argparse.FileType("rb"), help="one UTF-8 text per line")
    embed.add_argument(
        "--latency-budget-ms",
        type=float,
        default=None,
        help="how long the request may wait in the encoder's queue before the server refuses it as overloaded, ms "
        "(0 = never refuse, for bulk jobs; default: the server's LATENCY_BUDGET_MS)",
    )
    embed.add_argument("--input-type", default=None, help="a prompt name of the model, e.g. query or passage")
    embed.add_argument(
        "--truncate",
        choices=("END", "START", "NONE"),
        default=None,
        help="cut a text over the token limit at its end, its start, or refuse it",
    )
    embed.add_argument("--dimensions", type=int, default=None, help="keep the first N components, renormalised")
    rerank = sub.add_parser(
        "rerank", parents=[common], help="score documents against a query with a reranker, highest first"
    )
    rerank.add_argument("query")
    rerank.add_argument("documents", nargs="+", metavar="DOC")
    rerank.add_argument("--top-n", type=int, default=None, help="print the best N only")
    rerank.add_argument(
        "--truncate",
        choices=("END", "START", "NONE"),
        default=None,
        help="cut a pair over the token limit at its end, its start, or refuse it",
    )
    sim = sub.add_parser("similarity", parents=[common], help="print the cosine similarity of two texts")
    sim.add_argument("a")
    sim.add_argument("b")
    sub.add_parser("health", parents=[common], help="server liveness/readiness and the model's readiness")
    stats = sub.add_parser(
        "stats",
        parents=[common],
        help="per-step counters and queue/compute times since start, the admission knobs",
        epilog=server_stats.LEGEND,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stats.add_argument(
        "--metrics-url",
        default=None,
        help="Triton's metrics endpoint, for the admission knobs in force (default: port 8002 on --url's host)",
    )
    sub.add_parser(
        "gateway", add_help=False, help="serve the OpenAI/TEI embeddings HTTP API in front of Triton (gateway --help)"
    )
    return parser


def _gateway(argv: list[str]) -> int:
    """``gateway``: ``triton-embed-gateway`` with the rest of the arguments (needs the ``gateway`` extra)."""
    try:
        from triton_embed_gateway.__main__ import main as gateway_main
    except ImportError as exc:
        print(
            f"triton-embed: the gateway needs the 'gateway' extra (pip install 'triton-embed[gateway]'): {exc}",
            file=sys.stderr,
        )
        return 2
    return gateway_main(argv)


def gateway_command() -> int:
    """``triton-embed-gateway``: the gateway, or one line naming the extra it needs where that is not installed.

    Returns:
        The gateway's exit status; 2 without the ``gateway`` extra.
    """
    return _gateway(sys.argv[1:])


def _version() -> str:
    try:
        return version("triton-embed")
    except PackageNotFoundError:  # run from a checkout without installing
        return "(not installed)"


def _with_line_numbers(message: str) -> str:
    """``texts[i]`` in a message about input lines also as ``line i+1`` (lines count from 1, the list from 0)."""
    return re.sub(r"texts\[(\d+)\]", lambda m: f"{m.group(0)} (input line {int(m.group(1)) + 1})", message)


def _argument_text(text: str) -> str | bytes:
    """A text given as a command-line argument; one that is not valid UTF-8 as its original bytes.

    Python decodes such an argument with ``surrogateescape``, and the UTF-8 encoding of it then failed with a raw
    ``UnicodeEncodeError``; as bytes, the client names the byte and its offset, as it does for stdin.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(text)
    return text


def _embed(client: EmbeddingClient, args: argparse.Namespace) -> int:
    """``embed``: one vector (or JSON row) per text, in input order."""
    # one text per line of --file or stdin, blank lines included (they embed the empty string), so output line i
    # always belongs to input line i; lines are read as bytes: the client checks their UTF-8 and names the byte
    from_lines = not args.texts
    texts = [_argument_text(t) for t in args.texts] or [
        line.rstrip(b"\r\n") for line in (args.file or sys.stdin.buffer)
    ]
    try:
        vectors = client.embed(texts, input_type=args.input_type, truncate=args.truncate, dimensions=args.dimensions)
    except EmbeddingError as exc:
        if from_lines:
            raise type(exc)(_with_line_numbers(str(exc))) from exc
        raise
    if args.json:
        shown = [t.decode() if isinstance(t, bytes) else t for t in texts]
        rows = [{"text": t, "embedding": v.tolist()} for t, v in zip(shown, vectors, strict=True)]
        print(json.dumps(rows))
    else:
        for vector in vectors:
            print(" ".join(f"{x:.6f}" for x in vector))
    return 0


def _rerank(client: EmbeddingClient, args: argparse.Namespace) -> int:
    """``rerank``: one line per document, highest score first: its score, its index, its text (or JSON rows)."""
    documents = [_argument_text(d) for d in args.documents]
    results = client.rerank(_argument_text(args.query), documents, top_n=args.top_n, truncate=args.truncate)
    if args.json:
        print(json.dumps([{"index": r.index, "score": r.score, "document": r.document} for r in results]))
    else:
        for r in results:
            print(f"{r.score:.6f}\t{r.index}\t{r.document}")
    return 0


def _metrics_url(args: argparse.Namespace, client: EmbeddingClient) -> str:
    """``--metrics-url``, else Triton's default metrics port on the first endpoint's host."""
    if args.metrics_url:
        return str(args.metrics_url)
    host = str(client.urls[0]).split("://")[-1].rsplit(":", 1)[0]
    return f"http://{host}:8002/metrics"


def _stats(client: EmbeddingClient, args: argparse.Namespace) -> int:
    """``stats``: the per-step table, then the admission knobs from the metrics port (a note when it cannot be read)."""
    rows = client.server_stats()
    url = _metrics_url(args, client)
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as answer:  # noqa: S310 - the user's metrics URL
            encoder = server_stats.steps(client.model)[2]
            knobs: server_stats.Admission | None = server_stats.admission(answer.read().decode(), encoder)
        note = ""
    except (OSError, ValueError) as exc:
        knobs, note = None, f"admission knobs not read from {url}: {exc} (--metrics-url names the metrics port)"
    if args.json:
        print(json.dumps({"steps": [r.as_dict() for r in rows], "admission": knobs.as_dict() if knobs else None}))
    else:
        print(server_stats.table(rows))
        if knobs:
            print(f"\n{knobs.text()}")
    if note:
        print(f"triton-embed: {note}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns 0, 1 on a service error (or ``health`` when the model is not ready), 2 on bad arguments."""
    given = sys.argv[1:] if argv is None else argv
    return _gateway(given[1:]) if given[:1] == ["gateway"] else _client_command(given)


def model_of(args: argparse.Namespace) -> str:
    """The ensemble a command calls: ``--model``, else ``rerank`` for the rerank command and ``embed`` for the rest."""
    return str(args.model or ("rerank" if args.command == "rerank" else "embed"))


def _client_command(argv: list[str]) -> int:
    """The subcommands that call the service through :class:`EmbeddingClient`."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "embed" and not args.texts and args.file is None and sys.stdin.isatty():
        parser.error("embed: no texts: give them as arguments, with --file, or as lines on stdin")
    try:
        budget = getattr(args, "latency_budget_ms", None)
        with EmbeddingClient(
            url=args.url, protocol=args.protocol, model=model_of(args), timeout_s=args.timeout, latency_budget_ms=budget
        ) as client:
            if args.command == "similarity":
                score = client.similarity(_argument_text(args.a), _argument_text(args.b))
                print(json.dumps({"a": args.a, "b": args.b, "cosine": score}) if args.json else f"{score:.6f}")
                return 0
            if args.command == "health":
                health = client.health()
                states = {k: v for k, v in health.__dict__.items() if k != "error"}
                print(json.dumps(health.__dict__) if args.json else " ".join(f"{k}={v}" for k, v in states.items()))
                if health.error and not args.json:
                    print(f"triton-embed: {health.error}", file=sys.stderr)
                return 0 if health.model_ready else 1
            commands = {"stats": _stats, "rerank": _rerank}
            return commands.get(args.command, _embed)(client, args)
    except (EmbeddingError, ValueError) as exc:
        print(f"triton-embed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `triton-embed embed ... | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no "Exception ignored" at exit flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
