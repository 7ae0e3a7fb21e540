"""A small OTLP/HTTP trace receiver on a loopback port, built on ``opentelemetry-proto``: what a collector would get.

It takes ``POST /v1/traces`` in protobuf (``application/x-protobuf``: the Python SDK's exporter) and in JSON
(``application/json``: Triton's exporter; ids hex-encoded, field names in either case) and keeps every span.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as received: ids as lowercase hex (``parent`` "" for a root), its service and attributes."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict = field(default_factory=dict)
    events: tuple[str, ...] = ()


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
                spans.append(ReceivedSpan(
                    str(resource.get("service.name", "")), s.name, s.trace_id.hex(), s.span_id.hex(),
                    s.parent_span_id.hex(), int(s.kind), {a.key: _value(a.value) for a in s.attributes},
                    tuple(e.name for e in s.events),
                ))  # fmt: skip
    return spans


def _norm(node: object) -> object:
    """JSON with every key lowercased and without underscores (OTLP/JSON's camelCase or proto's snake_case)."""
    if isinstance(node, dict):
        return {k.replace("_", "").lower(): _norm(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_norm(v) for v in node]
    return node


def _json_value(value: dict) -> object:
    return next(iter(value.values()), None) if value else None


def _from_json(body: bytes) -> list[ReceivedSpan]:
    request = _norm(json.loads(body))
    spans = []
    for resource_spans in request.get("resourcespans", []):
        resource = {a["key"]: _json_value(a.get("value", {})) for a in resource_spans.get("resource", {}).get(
            "attributes", [])}  # fmt: skip
        for scope in resource_spans.get("scopespans", []):
            for s in scope.get("spans", []):
                kind = s.get("kind", 0)
                spans.append(ReceivedSpan(
                    str(resource.get("service.name", "")), s.get("name", ""), s.get("traceid", "").lower(),
                    s.get("spanid", "").lower(), s.get("parentspanid", "").lower(),
                    kind if isinstance(kind, int) else 0,
                    {a["key"]: _json_value(a.get("value", {})) for a in s.get("attributes", [])},
                    tuple(e.get("name", "") for e in s.get("events", [])),
                ))  # fmt: skip
    return spans


class OtlpReceiver:
    """``with OtlpReceiver() as receiver``: listening on ``receiver.endpoint`` (``http://127.0.0.1:PORT``)."""

    def __init__(self) -> None:
        """Bind a free loopback port."""
        self.spans: list[ReceivedSpan] = []
        self.requests: list[str] = []  # the content type of each export
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                content_type = self.headers.get("Content-Type", "")
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = _from_json(body) if "json" in content_type else _from_protobuf(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.requests.append(content_type)
                answer = b"{}" if "json" in content_type else ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", content_type or "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

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
                raise AssertionError(f"spans of trace {trace_id} after {timeout_s:g} s: {sorted(s.name for s in spans)}"
                                     f"; expected {sorted(names)}")  # fmt: skip
            time.sleep(0.1)
