"""Client-side counters: requests, texts, retries, errors and bytes, safe to update from many threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class ClientStats:
    """Client-side counters since the client was made.

    Attributes:
        requests: inference requests answered (a long list is several requests).
        texts: texts embedded by the server (after coalescing).
        retries: attempts repeated after an unavailable/connection error.
        errors: requests that failed after their retries.
        bytes_sent, bytes_received: HTTP body bytes of inference requests/responses (headers excluded; the
            response size is rebuilt from the parsed response, so within a few bytes); 0 on gRPC.
        shared_memory_regions: regions registered with the server now.
    """

    requests: int = 0
    texts: int = 0
    retries: int = 0
    errors: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    shared_memory_regions: int = 0


class Counters:
    """Thread-safe :class:`ClientStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = ClientStats()

    def add(self, **deltas: int) -> None:
        """Add to counters by name."""
        with self._lock:
            for name, value in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def snapshot(self, regions: int) -> ClientStats:
        """A copy, with the current number of shared memory regions."""
        with self._lock:
            return ClientStats(**{**self._stats.__dict__, "shared_memory_regions": regions})
