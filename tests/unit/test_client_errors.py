"""How the client maps Triton's errors to its own (tritonclient's real exception type, no server needed)."""

from __future__ import annotations

from triton_embed.errors import ServerUnavailableError, from_triton
from tritonclient.utils import InferenceServerException


def test_a_full_queue_names_the_queue_and_its_limit():
    """Triton's own message names neither; the status decides the class (retryable)."""
    message = "in ensemble 'embed', [request id: <id_unknown>] Exceeds maximum queue size"
    raw = InferenceServerException(msg=message, status="StatusCode.UNAVAILABLE")
    error = from_triton(raw, model="embed", url="127.0.0.1:8001")
    assert isinstance(error, ServerUnavailableError)
    assert "Exceeds maximum queue size (a step's queue is full: the max_queue_size of a default_queue_policy" in str(
        error
    )
