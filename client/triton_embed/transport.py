"""Names that code outside the client (loadtest, bench, tests) imports from ``triton_embed.transport``.

They live by concern: settings and url parsing in :mod:`triton_embed.settings`; request building and response
reading in :mod:`triton_embed.request_builder`; counters in :mod:`triton_embed.client_stats`; the retry policy,
model-config reading and the shared memory fallback warning in :mod:`triton_embed.core`.
"""

from triton_embed_protocol import MAX_BUDGET_MS

from triton_embed.client_stats import ClientStats, Counters
from triton_embed.core import (
    DEFAULT_BACKOFF_S,
    MAX_BACKOFF_S,
    PACKAGE_DIR,
    backoff,
    disable_shared_memory_warning,
    max_batch_and_dim,
    retryable,
)
from triton_embed.request_builder import INPUT, OUTPUT, RequestBuilder, serialized_bytes, text_tensor
from triton_embed.settings import (
    DEFAULT_URLS,
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
