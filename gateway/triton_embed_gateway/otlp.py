"""OTLP trace data as a collector receives it, on ``opentelemetry-proto``: a small receiver, and OTLP/JSON files.

The files are what an OpenTelemetry Collector's ``file`` exporter writes: one export request per line.

The receiver takes ``POST /v1/traces`` in protobuf (``application/x-protobuf``: the Python SDK's exporter, the
gateway's) and in JSON (``application/json``: Triton's exporter; ids hex-encoded, field names in either case) and
keeps every span; with ``save`` it also appends each export to a file as one line of OTLP/JSON.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as received: ids as lowercase hex (``parent`` "" for a root), its service and attributes.

    ``start_ns`` and ``end_ns``: Unix time, ns; ``event_ns``: each event's name and Unix time in ns, in order
    (``events`` their names).
    """

    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict[str, Any] = field(default_factory=dict)
    event_ns: tuple[tuple[str, int], ...] = ()
    start_ns: int = 0
    end_ns: int = 0

    @property
    def events(self) -> tuple[str, ...]:
        """The events' names, in order."""
        return tuple(name for name, _ in self.event_ns)


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _from_protobuf(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                spans.append(
                    ReceivedSpan(
                        str(resource.get("service.name", "")),
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        int(s.kind),
                        {a.key: _value(a.value) for a in s.attributes},
                        tuple((e.name, int(e.time_unix_nano)) for e in s.events),
                        int(s.start_time_unix_nano),
                        int(s.end_time_unix_nano),
                    )
                )
    return spans


def _norm(node: Any) -> Any:
    """JSON with every key lowercased and without underscores (OTLP/JSON's camelCase or proto's snake_case)."""
    if isinstance(node, dict):
        return {k.replace("_", "").lower(): _norm(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_norm(v) for v in node]
    return node


def _json_value(value: dict[str, Any]) -> object:
    return next(iter(value.values()), None) if value else None


def _from_json(body: bytes) -> list[ReceivedSpan]:
    request = _norm(json.loads(body))
    spans = []
    for resource_spans in request.get("resourcespans", []):
        resource = {
            a["key"]: _json_value(a.get("value", {})) for a in resource_spans.get("resource", {}).get("attributes", [])
        }
        for scope in resource_spans.get("scopespans", []):
            for s in scope.get("spans", []):
                kind = s.get("kind", 0)
                spans.append(
                    ReceivedSpan(
                        str(resource.get("service.name", "")),
                        s.get("name", ""),
                        s.get("traceid", "").lower(),
                        s.get("spanid", "").lower(),
                        s.get("parentspanid", "").lower(),
                        kind if isinstance(kind, int) else 0,
                        {a["key"]: _json_value(a.get("value", {})) for a in s.get("attributes", [])},
                        tuple((e.get("name", ""), int(e.get("timeunixnano", 0))) for e in s.get("events", [])),
                        int(s.get("starttimeunixnano", 0)),
                        int(s.get("endtimeunixnano", 0)),
                    )
                )
    return spans


def _otlp_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """``request`` as OTLP/JSON: protobuf's JSON mapping, with enums as numbers and ids as hex, not base64."""
    data: dict[str, Any] = MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in data.get("resourceSpans", []):
        for scope in resource_spans.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return data


def parse(body: bytes, content_type: str) -> list[ReceivedSpan]:
    """The spans of one OTLP/HTTP export request: JSON when ``content_type`` says so, else protobuf.

    Raises:
        ValueError: ``body`` is not an export request in that encoding.
    """
    try:
        return _from_json(body) if "json" in content_type else _from_protobuf(body)
    except (json.JSONDecodeError, DecodeError, AttributeError, TypeError, KeyError) as exc:
        raise ValueError(f"not an OTLP export request ({content_type or 'protobuf'}): {exc}") from exc


def read_file(path: str | Path) -> list[ReceivedSpan]:
    """The spans in an OTLP/JSON file: one export request per line (blank lines skipped).

    Raises:
        ValueError: a line is not an OTLP/JSON export request; the message names the file and the line.
    """
    spans: list[ReceivedSpan] = []
    with Path(path).open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    spans += parse(line, "application/json")
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from exc
    return spans


class OtlpReceiver:
    """``with OtlpReceiver() as receiver``: listening on ``receiver.endpoint`` (``http://HOST:PORT``).

    Args:
        host: bind address (default loopback only).
        port: 0 = a free port.
        save: a file each export is appended to, as one line of OTLP/JSON (None: kept in memory only).
        decode: False: a sink that answers every export and counts it in ``requests``, keeping no span (a benchmark's
            collector, as cheap as can be).
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, save: str | Path | None = None, *, decode: bool = True
    ) -> None:
        """Bind ``host:port``."""
        self.spans: list[ReceivedSpan] = []
        self.requests: list[str] = []  # the content type of each export
        self._lock = threading.Lock()
        self.save_path = Path(save) if save is not None else None
        self._save = self.save_path.open("ab") if self.save_path is not None else None  # noqa: SIM115 - closed in __exit__
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                content_type = self.headers.get("Content-Type", "")
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                try:
                    spans = parse(body, content_type) if decode else []
                except ValueError as exc:
                    self.send_error(400, str(exc)[:200])
                    return
                receiver._keep(spans, body, content_type)
                answer = b"{}" if "json" in content_type else ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", content_type or "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.endpoint = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _keep(self, spans: list[ReceivedSpan], body: bytes, content_type: str) -> None:
        with self._lock:
            self.spans.extend(spans)
            self.requests.append(content_type)
            if self._save is not None and spans:
                data = (
                    json.loads(body)
                    if "json" in content_type
                    else _otlp_json(ExportTraceServiceRequest.FromString(body))
                )
                self._save.write(json.dumps(data, separators=(",", ":")).encode() + b"\n")
                self._save.flush()

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._save is not None:
            self._save.close()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans received so far of ``trace_id``."""
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def first(self, matches: Callable[[ReceivedSpan], bool], timeout_s: float = 20.0) -> ReceivedSpan:
        """The first span received that ``matches``, waiting for it up to ``timeout_s``.

        Raises:
            AssertionError: none came in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                found = next((s for s in self.spans if matches(s)), None)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching span after {timeout_s:g} s among {len(self.spans)}")
            time.sleep(0.1)

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The spans of ``trace_id`` once every name of ``names`` is among them (batching exporters wait ~5 s).

        Raises:
            AssertionError: not all of them came within ``timeout_s``, naming those that did.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"spans of trace {trace_id} after {timeout_s:g} s: {sorted(s.name for s in spans)}"
                    f"; expected {sorted(names)}"
                )
            time.sleep(0.1)
