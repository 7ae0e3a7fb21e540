"""Locust users that call the service through ``triton_embed``'s client, one client per user.

Built the way Locust's own non-HTTP examples are: a thin wrapper times each call with ``perf_counter`` and fires
Locust's ``request`` event; an abstract :class:`TritonUser` builds its client in ``__init__``. gRPC under gevent
needs ``grpc.experimental.gevent.init_gevent()`` before the first channel: the locustfile calls it at import.
"""

from __future__ import annotations

import random
import time

from locust import User, task
from triton_embed import EmbeddingClient
from triton_embed.errors import ServerUnavailableError
from triton_embed.transport import DEFAULT_BACKOFF_S, backoff

from loadtest.corpus import Deck

# Task weights: the online case (one sentence per request) dominates; small batches model bulk callers; with
# --rerank-model, a retrieval stack's rerank of a query's top hits.
SINGLE_WEIGHT = 10
BATCH_WEIGHT = 1
BATCH_SIZE = 8
RERANK_WEIGHT = 2
RERANK_DOCUMENTS = 8


class TimedEmbedder:
    """Times :meth:`EmbeddingClient.embed` and reports each call to Locust as one request.

    Locust sees ``request_type`` = protocol (``grpc``/``http``), ``name`` = ``"<model> x<texts>"``,
    ``response_time`` in ms (``perf_counter`` around the whole call), ``response_length`` = bytes of the returned
    ``(texts, dim) float32`` array, and the exception (our client's error classes) when the call failed.
    """

    def __init__(self, client: EmbeddingClient, request_event) -> None:
        self.client = client
        self._fire = request_event.fire
        self.refused_in_a_row = 0  # calls answered unavailable/overloaded since the last other answer

    def embed(self, texts: list[str]) -> None:
        """Embed ``texts`` once; never raises (a failure is reported to Locust instead)."""
        self._timed(f"{self.client.model} x{len(texts)}", lambda: self.client.embed(texts).nbytes)

    def rerank(self, query: str, documents: list[str]) -> None:
        """Rerank ``documents`` against ``query`` once (the client's model is a reranker); never raises.

        Locust sees ``name`` = ``"<model> rerank x<documents>"``, ``response_length`` = 8 bytes per document.
        """
        self._timed(
            f"{self.client.model} rerank x{len(documents)}", lambda: 8 * len(self.client.rerank(query, documents))
        )

    def _timed(self, name: str, call) -> None:
        start = time.perf_counter()
        length, error = 0, None
        try:
            length = call()
        except Exception as exc:  # noqa: BLE001 - every failure is a failed request for Locust, not a crash
            error = exc
        self.refused_in_a_row = self.refused_in_a_row + 1 if isinstance(error, ServerUnavailableError) else 0
        self._fire(
            request_type=self.client.protocol,
            name=name,
            response_time=(time.perf_counter() - start) * 1000.0,
            response_length=length,
            exception=error,
            context={},
        )


class TritonUser(User):
    """One closed-loop caller: sends a request, waits for the answer, sends the next (no think time).

    After a refusal (unavailable/overloaded) it waits as ``triton_embed``'s retries would (0.1 s doubling, capped at
    2 s): a caller that came straight back would multiply the overload it is measuring.

    Subclasses set ``protocol``. Connection settings come from the locustfile's options (``--triton-host``,
    ``--grpc-port``/``--http-port``, ``--model``, ``--request-timeout-s``; with ``--rerank-model``, a third task
    reranks ``RERANK_DOCUMENTS`` texts against one, gated by the same SLA); texts from the corpus the locustfile
    dealt into ``environment.deck`` (:class:`loadtest.corpus.Deck`: a one-text request repeats a text only after
    every text was sent once, so the response cache does not answer a third of them). The client does not retry: a
    failure is a failure.
    """

    abstract = True
    protocol = "grpc"

    def wait_time(self) -> float:
        """Seconds before the next task: 0, or the library's backoff after a refusal."""
        refused = max(timed.refused_in_a_row for timed in self.timed)
        return backoff(refused - 1, DEFAULT_BACKOFF_S) if refused else 0.0

    def __init__(self, environment) -> None:
        super().__init__(environment)
        opts = environment.parsed_options
        port = opts.grpc_port if self.protocol == "grpc" else opts.http_port

        def timed(model: str) -> TimedEmbedder:
            client = EmbeddingClient(
                url=f"{opts.triton_host}:{port}",
                protocol=self.protocol,
                model=model,
                timeout_s=opts.request_timeout_s,
                retries=0,
            )
            return TimedEmbedder(client, environment.events.request)

        self.embedder = timed(opts.model)
        self.reranker = timed(opts.rerank_model) if opts.rerank_model else None
        self.timed = [t for t in (self.embedder, self.reranker) if t is not None]
        if self.reranker is not None:  # this user's tasks, with the rerank task among them
            self.tasks = [*type(self).tasks, *[TritonUser.rerank_query] * RERANK_WEIGHT]
        self.deck: Deck = environment.deck
        self.rng = random.Random()  # noqa: S311 - picking sentences, not secrets

    @task(SINGLE_WEIGHT)
    def one_sentence(self) -> None:
        """The online case: one text per request."""
        self.embedder.embed([self.deck.deal()])

    @task(BATCH_WEIGHT)
    def small_batch(self) -> None:
        """A bulk caller: ``BATCH_SIZE`` texts per request, drawn at random (a whole batch hardly ever repeats)."""
        self.embedder.embed(self.rng.choices(self.deck.texts, k=BATCH_SIZE))

    def rerank_query(self) -> None:
        """With ``--rerank-model``: a query's ``RERANK_DOCUMENTS`` hits reranked, drawn at random."""
        assert self.reranker is not None  # noqa: S101 - the task is this user's only with a reranker
        self.reranker.rerank(self.deck.deal(), self.rng.choices(self.deck.texts, k=RERANK_DOCUMENTS))

    def on_stop(self) -> None:
        """Close the clients' connections when Locust stops this user."""
        for timed in self.timed:
            timed.client.close()


class GrpcUser(TritonUser):
    """Calls the ensemble over gRPC (port ``--grpc-port``)."""

    protocol = "grpc"


class HttpUser(TritonUser):
    """Calls the ensemble over HTTP with binary tensor data (port ``--http-port``)."""

    protocol = "http"
