"""``triton-embed-traces``: where a run's requests spent their time, stage by stage, from their OpenTelemetry spans.

Each complete trace (the gateway's server span, or Triton's own ``InferRequest`` for a direct caller, down to the
encoder's ``compute``) is cut at its events into six stages:

- **gateway receive and parse**: the gateway's server span starts -> its client span to Triton starts;
- **queue before the tokenizer**: -> the tokenizer's ``COMPUTE_START`` (gRPC, Triton's frontend, the ensemble);
- **tokenizer**: -> the encoder step's ``REQUEST_START`` (tokenising, and a bulk request's wait in the bulk lane);
- **queue before the encoder**: -> the encoder's ``COMPUTE_START`` (the dynamic batcher's queue);
- **encoder compute**: -> Triton's ``INFER_RESPONSE_COMPLETE`` (the encoder answers before its execution ends);
- **response**: -> the end of the gateway's server span (without the gateway: Triton's ``GRPC_SEND_END`` or
  ``HTTP_SEND_END``): outputs, the network, the gateway's JSON.

A request the gateway split into several Triton requests follows the one that ended last. Response-cache hits (no
steps) and requests that never reached the encoder (refused at the door, failed) are counted, not cut. The table
gives each stage's p50, p99 and share of the end-to-end time, for all requests and for the slowest 1%; the stage
with the largest share of the slowest 1% is the one to blame at p99. Times within one host; across hosts, clock
skew enters the stages that cross a process.

Spans come from OTLP/JSON files (an OpenTelemetry Collector's ``file`` exporter, or ``--save`` here), or from a
receiver this command runs for a while (``--listen``), pointed at by ``OTEL_EXPORTER_OTLP_ENDPOINT``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from triton_embed_gateway.otlp import OtlpReceiver, ReceivedSpan, read_file

STAGES = (
    "gateway receive and parse",
    "queue before the tokenizer",
    "tokenizer",
    "queue before the encoder",
    "encoder compute",
    "response",
)
GATEWAY_ROUTES = ("/v1/embeddings", "/embed")
CLIENT_KIND = 3  # OTLP's SpanKind.CLIENT


@dataclass(frozen=True)
class RequestStages:
    """One request's end-to-end time and its stages, ms (``stages`` lacks the gateway's for a direct caller)."""

    trace_id: str
    total_ms: float
    stages: dict[str, float]


@dataclass(frozen=True)
class Cut:
    """What the spans of a run hold: the requests cut into stages, the cache hits, the requests left uncut."""

    requests: list[RequestStages]
    cache_hits: int
    incomplete: int


def _event(span: ReceivedSpan | None, *names: str) -> int | None:
    if span is None:
        return None
    times = dict(span.event_ns)
    return next((times[n] for n in names if n in times), None)


def _cut_trace(spans: list[ReceivedSpan]) -> RequestStages | str:
    """One trace's stages, or why it has none: ``"cache hit"``, ``"incomplete"``."""
    children: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        children[s.parent].append(s)

    def child(parent: ReceivedSpan | None, name: str) -> ReceivedSpan | None:
        found = [s for s in children.get(parent.span_id, []) if s.name == name] if parent else []
        return max(found, key=lambda s: s.end_ns) if found else None

    gateway = next((s for s in spans if s.attributes.get("http.route") in GATEWAY_ROUTES), None)
    client = None
    if gateway is not None:
        calls = [s for s in children.get(gateway.span_id, []) if s.kind == CLIENT_KIND]
        client = max(calls, key=lambda s: s.end_ns) if calls else None
        infer = child(client, "InferRequest")
    else:
        ids = {s.span_id for s in spans}
        infer = next((s for s in spans if s.name == "InferRequest" and s.parent not in ids), None)
    embed = next(iter(children.get(infer.span_id, [])), None) if infer else None
    tokenizer, encoder = child(embed, "tokenizer"), child(embed, "encoder")
    if embed is not None and not children.get(embed.span_id):
        return "cache hit"
    tokenize, encode = child(tokenizer, "compute"), child(encoder, "compute")
    if infer is None or encoder is None or tokenize is None or encode is None or (gateway and client is None):
        return "incomplete"
    end = gateway.end_ns if gateway else (_event(infer, "GRPC_SEND_END", "HTTP_SEND_END") or infer.end_ns)
    marks = [
        gateway.start_ns if gateway else None,
        client.start_ns if client else infer.start_ns,
        _event(tokenize, "COMPUTE_START") or tokenize.start_ns,
        _event(encoder, "REQUEST_START") or encoder.start_ns,
        _event(encode, "COMPUTE_START") or encode.start_ns,
        # the encoder answers through its response sender before its execution returns: Triton's frontend has the
        # answer at INFER_RESPONSE_COMPLETE, before the step's COMPUTE_END
        min(_event(infer, "INFER_RESPONSE_COMPLETE") or encode.end_ns, _event(encode, "COMPUTE_END") or encode.end_ns),
        end,
    ]
    stages = {
        name: max(0, marks[k + 1] - marks[k]) / 1e6  # type: ignore[operator]
        for k, name in enumerate(STAGES)
        if marks[k] is not None
    }
    start = marks[0] if marks[0] is not None else marks[1]
    return RequestStages(spans[0].trace_id, max(0, end - start) / 1e6, stages)  # type: ignore[operator]


def cut(spans: Iterable[ReceivedSpan]) -> Cut:
    """Group ``spans`` by trace and cut each complete request into :data:`STAGES`."""
    traces: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    requests, hits, incomplete = [], 0, 0
    for trace in traces.values():
        outcome = _cut_trace(trace)
        if isinstance(outcome, RequestStages):
            requests.append(outcome)
        elif outcome == "cache hit":
            hits += 1
        else:
            incomplete += 1
    return Cut(requests, hits, incomplete)


def _stage_rows(requests: list[RequestStages]) -> dict[str, dict[str, float]]:
    total = sum(r.total_ms for r in requests) or 1.0
    rows = {}
    for name in STAGES:
        values = np.array([r.stages[name] for r in requests if name in r.stages])
        if values.size:
            rows[name] = {
                "p50_ms": float(np.percentile(values, 50)),
                "p99_ms": float(np.percentile(values, 99)),
                "share": float(values.sum() / total),
            }
    return rows


def summary(run: Cut) -> dict[str, Any]:
    """The table as data.

    For ``all`` requests and the ``slowest`` 1% (at least one): per stage ``p50_ms``, ``p99_ms`` and ``share`` (0..1
    of the end-to-end time); ``end_to_end`` p50/p99 ms; ``blame``: the stage with the largest share of the slowest 1%
    (None without requests); the counts ``requests``, ``cache_hits``, ``incomplete``, ``slowest_requests``.
    """
    requests = run.requests
    totals = np.array([r.total_ms for r in requests]) if requests else np.zeros(0)
    out: dict[str, Any] = {"requests": len(requests), "cache_hits": run.cache_hits, "incomplete": run.incomplete}
    if not requests:
        return {**out, "all": {}, "slowest": {}, "end_to_end": {}, "blame": None}
    p99 = float(np.percentile(totals, 99))
    slowest = sorted(requests, key=lambda r: r.total_ms)[-max(1, len(requests) // 100) :]
    out["end_to_end"] = {"p50_ms": float(np.percentile(totals, 50)), "p99_ms": p99}
    out["all"], out["slowest"] = _stage_rows(requests), _stage_rows(slowest)
    out["slowest_requests"] = len(slowest)
    out["blame"] = max(out["slowest"], key=lambda name: out["slowest"][name]["share"])
    return out


def table(data: dict[str, Any]) -> str:
    """:func:`summary`'s data as a Markdown table, with the counts and the stage to blame under it."""
    if not data["requests"]:
        return f"no complete request among the spans ({data['cache_hits']} cache hits, {data['incomplete']} incomplete)"
    slow = data["slowest"]
    lines = [
        f"| stage | p50 ms | p99 ms | share | slowest {data['slowest_requests']}: p50 ms | share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in data["all"].items():
        worst = slow.get(name, {"p50_ms": 0.0, "share": 0.0})
        lines.append(
            f"| {name} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {100 * row['share']:.0f}% "
            f"| {worst['p50_ms']:.2f} | {100 * worst['share']:.0f}% |"
        )
    e2e = data["end_to_end"]
    lines += [
        f"| end to end | {e2e['p50_ms']:.2f} | {e2e['p99_ms']:.2f} | 100% | | 100% |",
        "",
        f"{data['requests']} requests ({data['cache_hits']} response-cache hits and {data['incomplete']} requests that "
        f"never reached the encoder not included); to blame at p99: {data['blame']}",
    ]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line's options."""
    p = argparse.ArgumentParser(prog="triton-embed-traces", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="OTLP/JSON files, one export request per line")
    p.add_argument("--listen", metavar="HOST:PORT", help="receive OTLP/HTTP on HOST:PORT (e.g. 127.0.0.1:4318)")
    p.add_argument("--seconds", type=float, default=None, help="with --listen: stop after this long (default: Ctrl-C)")
    p.add_argument("--save", metavar="FILE", help="with --listen: append each export to FILE as OTLP/JSON")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    return p


def _listen(address: str, seconds: float | None, save: str | None) -> list[ReceivedSpan]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--listen must be HOST:PORT, such as 127.0.0.1:4318; got {address!r}")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with OtlpReceiver(host, int(port), save) as receiver:
        print(f"triton-embed-traces: receiving OTLP/HTTP on {receiver.endpoint}/v1/traces", file=sys.stderr, flush=True)
        stop.wait(seconds)
        return list(receiver.spans)


def main(argv: list[str] | None = None) -> int:
    """Print the stage table of the spans read or received. Returns the exit status (2 for a bad option or file)."""
    args = parser().parse_args(argv)
    if bool(args.files) == bool(args.listen):
        print("triton-embed-traces: give OTLP/JSON files or --listen HOST:PORT, not both or neither", file=sys.stderr)
        return 2
    try:
        if args.listen:
            spans = _listen(args.listen, args.seconds, args.save)
        else:
            spans = [s for path in args.files for s in read_file(path)]
    except (OSError, ValueError) as exc:
        print(f"triton-embed-traces: {exc}", file=sys.stderr)
        return 2
    data = summary(cut(spans))
    print(json.dumps(data, indent=2) if args.json else table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
