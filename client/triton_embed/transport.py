"""Retry policy, model-config reading and the shared memory fallback warning of the sync and asyncio clients.

Settings and url parsing live in :mod:`triton_embed.settings`, request building and response reading in
:mod:`triton_embed.request_builder`, counters in :mod:`triton_embed.client_stats`; their names are re-exported here
for code that imports them from ``triton_embed.transport``.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from typing import Any

from triton_embed.client_stats import ClientStats, Counters
from triton_embed.errors import EmbeddingError, ServerUnavailableError
from triton_embed.request_builder import INPUT, OUTPUT, RequestBuilder, serialized_bytes, text_tensor
from triton_embed.settings import (
    DEFAULT_URLS,
    MAX_BUDGET_MS,
    PROTOCOL_ENV,
    URL_ENV,
    Settings,
    copied,
    normalise_url,
    url_protocol,
)
from triton_embed.shm import ShmPool

__all__ = [
    "DEFAULT_BACKOFF_S",
    "DEFAULT_URLS",
    "INPUT",
    "MAX_BACKOFF_S",
    "MAX_BUDGET_MS",
    "OUTPUT",
    "PACKAGE_DIR",
    "PROTOCOL_ENV",
    "URL_ENV",
    "ClientStats",
    "Counters",
    "RequestBuilder",
    "Settings",
    "ShmPool",
    "backoff",
    "copied",
    "disable_shared_memory_warning",
    "max_batch_and_dim",
    "normalise_url",
    "retryable",
    "serialized_bytes",
    "text_tensor",
    "url_protocol",
]

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
"""This package's folder: warnings point at the first frame outside it."""

MAX_BACKOFF_S = 2.0
DEFAULT_BACKOFF_S = 0.1
"""First wait before a retry, seconds (``backoff_s``); it doubles per attempt up to :data:`MAX_BACKOFF_S`."""


def backoff(attempt: int, base_s: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): exponential, capped at 2 s, with 0-25% jitter."""
    return min(MAX_BACKOFF_S, base_s * 2.0**attempt) * (1 + random.random() / 4)  # noqa: S311 - jitter only


def retryable(error: EmbeddingError) -> bool:
    """Only unavailable/overloaded/connection errors are retried; bad input and timeouts never are."""
    return isinstance(error, ServerUnavailableError)


def disable_shared_memory_warning(url: str, error: Exception) -> None:
    """Warn once per failure that shared memory is off for this client.

    The warning points at the caller's line: the first frame outside this package.
    """
    frame, stacklevel = sys._getframe(0), 1  # stacklevel 1 is this function
    while frame.f_back is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(
        f"shared memory registration with {url} failed ({error}); falling back to sending tensors over the "
        "network (registration is an admin API: pass the server's admin key header, see docs/operations.md, threat "
        "model; and client and server must share /dev/shm, e.g. the same host or container IPC namespace)",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def max_batch_and_dim(config: dict[str, Any]) -> tuple[int, int]:
    """``(max_batch_size, embedding width)`` from a model config in JSON form."""
    output = next(o for o in config["output"] if o["name"] == OUTPUT)
    return int(config.get("max_batch_size", 1)) or 1, int(output["dims"][-1])
