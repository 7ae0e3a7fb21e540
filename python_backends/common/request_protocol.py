"""What the tokenizer and encoder backends agree on about a request: the hand-off stamp and the parameters' form."""

from __future__ import annotations

import json

QUEUED = "queued_ns"
"""Tensor from the tokenizer to the encoder, int64 ``[n_texts, 1]``: ``time.monotonic_ns()`` as the tokenizer hands
the request on to the encoder's queue (one clock for every process on the host)."""


def request_parameters(parameters: str | None) -> dict:
    """A request's parameters (JSON text from ``request.parameters()``) as a dict; {} when absent or unreadable."""
    try:
        value = json.loads(parameters or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
