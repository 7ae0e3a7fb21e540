"""Exceptions raised by :mod:`triton_embed`; each wraps the tritonclient error it came from (``__cause__``)."""

from __future__ import annotations

import errno
import re

from triton_embed_protocol import refusal_reason


class EmbeddingError(Exception):
    """Base class of every error this library raises."""


class InvalidInputError(EmbeddingError):
    """The request was rejected as bad input (gRPC INVALID_ARGUMENT / HTTP 400); retrying will not help.

    Attributes:
        text: the text the server's message names by its row in the request, when it names one (else None).
    """

    text: str | None = None


class ServerUnavailableError(EmbeddingError):
    """The server could not be reached, is not ready, or shed the request (gRPC UNAVAILABLE / HTTP 503)."""

    @property
    def reason(self) -> str | None:
        """For a refusal as overloaded, its code (``door``, ``flood``, ``bulk_queue``, ``budget``); else None."""
        return refusal_reason(str(self))


class EmbeddingTimeoutError(EmbeddingError):
    """No answer within the client's timeout (gRPC DEADLINE_EXCEEDED / HTTP timeout)."""


class ServerError(EmbeddingError):
    """The server failed while handling a valid request (gRPC INTERNAL / HTTP 5xx)."""


_BY_STATUS = {
    "StatusCode.INVALID_ARGUMENT": InvalidInputError,
    "400": InvalidInputError,
    "StatusCode.UNAVAILABLE": ServerUnavailableError,
    "503": ServerUnavailableError,
    "StatusCode.DEADLINE_EXCEEDED": EmbeddingTimeoutError,
    "504": EmbeddingTimeoutError,
}


def from_triton(exc: Exception, *, model: str, url: str) -> EmbeddingError:
    """Map a tritonclient ``InferenceServerException`` (or a connection error) to our exception tree.

    The message keeps the server's own text (which names the input, the limit and the value) and adds the
    model and URL.
    """
    status = str(exc.status()) if hasattr(exc, "status") and exc.status() is not None else ""
    message = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
    if not (message or "").strip():  # asyncio's TimeoutError says nothing
        message = "timed out: no answer within timeout_s" if isinstance(exc, TimeoutError) else type(exc).__name__
    cls = _BY_STATUS.get(status)
    if "has no available versions" in message:
        # the ensemble is being unloaded: the server drains before it stops (server/.../drain.py); a retry may
        # reach another replica, or this one restarted
        cls = ServerUnavailableError
    if "is not healthy" in message:
        # A crashed Python backend stub (Triton reports INTERNAL), a Triton 2.51 workaround (docs/troubleshooting.md):
        # the server's watchdog reloads the model within seconds, so for the caller it is an outage a retry gets past.
        cls = ServerUnavailableError
    if cls is None:
        lowered = message.lower()
        # timeouts first: the HTTP client's socket.timeout is an OSError too, and a timed-out request may still be
        # running on the server, so it must not be taken for an outage and retried
        if isinstance(exc, TimeoutError) or "timed out" in lowered or "deadline" in lowered:
            cls = EmbeddingTimeoutError
        elif isinstance(exc, (ConnectionError, OSError)) or "connect" in lowered or "unavailable" in lowered:
            cls = ServerUnavailableError
        else:
            cls = ServerError
    return cls(f"model '{model}' at {url}: {message}{_hint(message)}")


CUT = (errno.ECONNRESET, errno.EPIPE)
"""Errors of a socket whose peer closed it under a request: reset by peer, broken pipe."""


def connection_cut(exc: BaseException, closed: tuple[type[BaseException], ...]) -> bool:
    """True if ``exc`` says the connection closed under an HTTP request before any answer came.

    ``closed``: the HTTP library's own "the server closed the connection" errors (geventhttpclient's
    ``HTTPConnectionClosed``, aiohttp's ``ServerDisconnectedError``); a reset or a broken pipe counts too. A server or
    proxy closes a kept-alive connection when it has been idle long enough or on a reload (nginx's old workers), and a
    request sent at that moment meets the close.
    """
    return isinstance(exc, closed) or (isinstance(exc, OSError) and exc.errno in CUT)


def _hint(message: str) -> str:
    """What Triton's own message leaves out: the limit a full queue hit, or the port the client should use.

    Triton's "Exceeds maximum queue size" does not say which queue or how long it is. For ports: a hint when the
    answer looks like the other protocol's port (``--url``/``TRITON_EMBED_URL`` vs the protocol).

    HTTP/1.1 to Triton's gRPC port (HTTP/2) fails to parse the reply; gRPC to its HTTP port sees the socket closed
    (which a server going down also shows, hence "if"); HTTP to its metrics port gets 200 with an empty body.
    """
    if "Exceeds maximum queue size" in message:
        return (
            " (a step's queue is full: the max_queue_size of a default_queue_policy added to a model config; the "
            "shipped configs have none; retry with backoff)"
        )
    if "Expected HTTP/" in message:
        return (
            " (an HTTP client reached a port that does not speak HTTP/1.1: is this Triton's gRPC port? HTTP is "
            "--http-port, 8000 by default; or use protocol 'grpc')"
        )
    if "document is empty" in message:
        return (
            " (an empty answer: is this Triton's metrics port, 8002 by default? HTTP is --http-port, 8000 by "
            "default; gRPC is --grpc-port, 8001)"
        )
    if "Socket closed" in message:
        return (
            " (if this is Triton's HTTP port, 8000 by default, use protocol 'http'; its metrics port, 8002, serves no "
            "API; gRPC is --grpc-port, 8001 by default)"
        )
    return ""


_ROW = re.compile(r"\brow (\d+)\b")  # how the tokenizer names a bad text: "input 'TEXT' row 6 has 70000 bytes"


def note_request_row(exc: EmbeddingError, texts: list[str]) -> EmbeddingError:
    """Remember, on an :class:`InvalidInputError`, which of one request's ``texts`` its message names by row."""
    match = _ROW.search(str(exc))
    if isinstance(exc, InvalidInputError) and match and int(match.group(1)) < len(texts):
        exc.text = texts[int(match.group(1))]
    return exc


def at_call_index(exc: EmbeddingError, items: list[str]) -> EmbeddingError:
    """The error with the caller's index of the text it names (``texts[70] of this call``), or ``exc`` as it is.

    A call is split into requests of ``max_batch_size`` texts (and, with ``coalesce``, only its distinct texts
    not already in flight are sent), so the server's row numbers count within one request, not the caller's list.
    """
    if not isinstance(exc, InvalidInputError) or exc.text is None or exc.text not in items:
        return exc
    text = exc.text
    located = type(exc)(f"{exc} (texts[{items.index(text)}] of this call)")
    located.text = text
    return located
