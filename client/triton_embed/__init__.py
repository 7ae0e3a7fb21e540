"""triton_embed: client for the triton-embed text-embedding service on NVIDIA Triton Inference Server."""

from triton_embed.client import EmbeddingClient
from triton_embed.errors import (
    EmbeddingError,
    EmbeddingTimeoutError,
    InvalidInputError,
    ServerError,
    ServerUnavailableError,
)

__all__ = [
    "EmbeddingClient",
    "EmbeddingError",
    "EmbeddingTimeoutError",
    "InvalidInputError",
    "ServerError",
    "ServerUnavailableError",
]
