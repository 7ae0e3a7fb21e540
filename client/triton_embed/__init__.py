"""triton_embed: client for the triton-embed text-embedding service on NVIDIA Triton Inference Server.

``EmbeddingClient`` (threads) and ``AsyncEmbeddingClient`` (asyncio) over gRPC or HTTP, to one server or spread over
several; errors are subclasses of ``EmbeddingError``. See docs/client.md.
"""

from triton_embed.aio import AsyncEmbeddingClient
from triton_embed.client import EmbeddingClient
from triton_embed.client_stats import ClientStats
from triton_embed.core import Health, Ranked
from triton_embed.endpoints import EndpointState
from triton_embed.errors import (
    EmbeddingError,
    EmbeddingTimeoutError,
    InvalidInputError,
    ServerError,
    ServerUnavailableError,
)
from triton_embed.server_stats import StepStats

__all__ = [
    "AsyncEmbeddingClient",
    "ClientStats",
    "EmbeddingClient",
    "EmbeddingError",
    "EmbeddingTimeoutError",
    "EndpointState",
    "Health",
    "InvalidInputError",
    "Ranked",
    "ServerError",
    "ServerUnavailableError",
    "StepStats",
]
