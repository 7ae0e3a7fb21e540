"""Client settings: the url and protocol (from arguments, the environment or defaults) and their checks."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from triton_embed_protocol import budget_problem

DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}
URL_ENV = "TRITON_EMBED_URL"
PROTOCOL_ENV = "TRITON_EMBED_PROTOCOL"


def normalise_url(url: str) -> str:
    """Return ``url`` as the ``host:port`` tritonclient wants.

    Drops a scheme (``http://``, ``grpc://``) and a trailing ``/``; a bare ``:port`` means ``127.0.0.1:port``.

    Raises:
        ValueError: no port, e.g. ``"localhost"``.
    """
    host_port = url.strip().split("://", 1)[-1].rstrip("/")
    if host_port.startswith(":"):
        host_port = "127.0.0.1" + host_port
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"url must be host:port (e.g. 127.0.0.1:8001); got {url!r}")
    return host_port


def url_protocol(url: str) -> str | None:
    """The protocol a url's scheme names: ``"http"`` for ``http://``, ``"grpc"`` for ``grpc://``, None without one.

    Raises:
        ValueError: another scheme (``https://``: TLS is not supported by this client).
    """
    scheme, sep, _ = url.strip().partition("://")
    if not sep:
        return None
    if scheme.lower() not in ("http", "grpc"):
        raise ValueError(f"url scheme must be http:// or grpc:// (or none); got {url!r}")
    return scheme.lower()


def split_urls(url: str | Sequence[str]) -> list[str]:
    """The endpoints in ``url``: a list (or tuple) of urls, or one string of urls separated by commas.

    Each is stripped of spaces; none is normalised here.

    Raises:
        ValueError: an empty entry (``"a:1,,b:2"``), no entry at all, or an entry that is not a str.
    """
    parts = url.split(",") if isinstance(url, str) else list(url)
    if not parts or not all(isinstance(p, str) and p.strip() for p in parts):
        raise ValueError(f"url must be host:port, or several separated by commas or in a list; got {url!r}")
    return [p.strip() for p in parts]


def urls_protocol(urls: Sequence[str]) -> str | None:
    """The protocol the urls' schemes name (:func:`url_protocol`); None when none has a scheme.

    Raises:
        ValueError: an unknown scheme, or two urls whose schemes differ.
    """
    schemes = {s for s in (url_protocol(u) for u in urls) if s}
    if len(schemes) > 1:
        raise ValueError(f"the urls' schemes differ; one client speaks one protocol: {', '.join(urls)}")
    return schemes.pop() if schemes else None


@dataclass(frozen=True)
class Settings:
    """Client settings; see :class:`triton_embed.EmbeddingClient` for their meaning.

    ``urls``: the endpoints, normalised ``host:port``; ``url``: the same joined by commas (one url: that url).
    """

    url: str
    protocol: str
    model: str
    timeout_s: float
    retries: int
    backoff_s: float
    binary: bool
    use_shared_memory: bool
    coalesce: bool
    max_concurrency: int
    headers: dict[str, str] | None
    latency_budget_ms: float | None = None
    truncate: bool | None = None
    urls: tuple[str, ...] = ()

    @classmethod
    def make(cls, *, url: str | Sequence[str] | None, protocol: str | None, **kwargs: Any) -> Settings:
        """Fill ``url``/``protocol`` from ``TRITON_EMBED_URL``/``TRITON_EMBED_PROTOCOL`` or the defaults.

        ``url`` (and ``TRITON_EMBED_URL``) may name several endpoints: a list, or one string separated by commas.

        Raises:
            ValueError: unknown protocol, a url that is not host:port, urls whose schemes differ, one url listed
                twice, ``use_shared_memory`` with more than one url, or retries/timeout/concurrency/latency budget
                out of range.
        """
        url_given = bool(url)
        given = url or os.environ.get(URL_ENV)
        raw = split_urls(given) if given else []
        scheme = urls_protocol(raw)
        if protocol and scheme and protocol.lower() != scheme:
            raise ValueError(f"protocol {protocol!r} contradicts the url's scheme: {given!r}")
        from_env = os.environ.get(PROTOCOL_ENV)
        # a url passed in picks its protocol over the environment's; two environment settings must agree
        if not protocol and not url_given and scheme and from_env and from_env.lower() != scheme:
            raise ValueError(f"${PROTOCOL_ENV}={from_env!r} contradicts the url's scheme: {given!r}")
        protocol = (protocol or scheme or from_env or "grpc").lower()
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be 'grpc' or 'http'; got {protocol!r}")
        urls = tuple(normalise_url(u) for u in raw or [DEFAULT_URLS[protocol]])
        if twice := sorted({u for u in urls if urls.count(u) > 1}):
            raise ValueError(f"url lists {', '.join(twice)} more than once")
        if kwargs.get("use_shared_memory") and len(urls) > 1:
            raise ValueError(
                f"use_shared_memory needs one url (shared memory works only with a server on this host); got "
                f"{len(urls)}: {', '.join(urls)}"
            )
        settings = cls(url=",".join(urls), protocol=protocol, urls=urls, **kwargs)
        if settings.latency_budget_ms is not None and (problem := budget_problem(settings.latency_budget_ms)):
            raise ValueError(problem)
        if not isinstance(settings.binary, bool):
            raise ValueError(f"binary must be True or False; got {settings.binary!r}")
        headers = settings.headers
        strings = isinstance(headers, dict) and all(isinstance(x, str) for kv in headers.items() for x in kv)
        if headers is not None and not strings:
            raise ValueError(f"headers must be a dict of str to str; got {headers!r}")
        if settings.truncate is not None and not isinstance(settings.truncate, bool):
            raise ValueError(f"truncate must be True, False or None; got {settings.truncate!r}")
        if settings.timeout_s <= 0 or settings.retries < 0 or settings.max_concurrency < 1 or settings.backoff_s < 0:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0, max_concurrency >= 1, backoff_s >= 0; got {settings.timeout_s}, "
                f"{settings.retries}, {settings.max_concurrency}, {settings.backoff_s}"
            )
        return replace(settings, headers=copied(headers))  # the caller's dict stays the caller's


def traced(headers: dict[str, str] | None) -> dict[str, str] | None:
    """``headers`` with the caller's OpenTelemetry context (W3C ``traceparent``) when a sampled span is current.

    Only with ``opentelemetry-api`` installed (the extra ``triton-embed[tracing]``); without it, or without a
    sampled span, ``headers`` as given. Triton then traces the request as a child of the caller's span.
    """
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return headers
    if not trace.get_current_span().get_span_context().trace_flags.sampled:
        return headers
    carrier = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def copied(headers: dict[str, str] | None) -> dict[str, str] | None:
    """A fresh copy of ``headers`` for one call.

    tritonclient's HTTP client adds ``Inference-Header-Content-Length`` to the dict it is given; a dict used again
    would carry it into the next JSON or shared-memory request.
    """
    return dict(headers) if headers else None
