"""Load shedding end to end: an encoder that makes every request wait 400 ms sheds it, unless the request asks for
a longer budget (request parameter ``latency_budget_ms``, set by the client's ``latency_budget_ms``); and the
tokenizer refuses at once a request queued behind more work than its budget allows (admission control)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from helpers import scrape, text_tensor
from triton_embed import EmbeddingClient
from triton_embed.errors import ServerUnavailableError
from triton_embed_server.embedded import EmbeddedServer
from tritonclient.utils import InferenceServerException

from bench.run import variant_repository

QUEUE_DELAY_US = 400_000  # every lone request waits this long for a batch: over the 180 ms budget


@pytest.fixture(scope="module")
def late_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("late")
    repo = variant_repository(tmp / "repo", None, encoder_delay_us=QUEUE_DELAY_US)  # shipped budget (180 ms)
    with EmbeddedServer(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0, log_file=tmp / "log") as srv:
        yield srv


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_late_request_is_shed_with_an_error_naming_the_budget(late_server, protocol):
    url = late_server.grpc_url if protocol == "grpc" else late_server.http_url
    client = EmbeddingClient(url=url, protocol=protocol, retries=0)
    with client, pytest.raises(ServerUnavailableError, match="LATENCY_BUDGET_MS") as caught:
        client.embed(["this one waits 400 ms"])
    assert "waited 4" in str(caught.value) and "180 ms latency budget" in str(caught.value)


@pytest.mark.parametrize(("protocol", "budget"), [("grpc", 0), ("http", 0), ("grpc", 2000)])
def test_the_request_parameter_overrides_the_budget(late_server, protocol, budget):
    url = late_server.grpc_url if protocol == "grpc" else late_server.http_url
    with EmbeddingClient(url=url, protocol=protocol, retries=0, latency_budget_ms=budget) as client:
        served = client.embed(["a bulk job prefers slow to rejected"])
    assert served.shape == (1, 384)
    assert np.linalg.norm(served[0]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("value", [-5, "soon", 1e308])
def test_a_bad_budget_parameter_is_invalid_input(late_server, value):
    client = grpcclient.InferenceServerClient(late_server.grpc_url)
    tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(text_tensor(["x"]))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("embed", [tensor], parameters={"latency_budget_ms": value})
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    expected = f"'latency_budget_ms' must be a number of ms from 0 to 3600000 (0 = never shed); got {value!r}"
    assert expected in caught.value.message()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_budget_in_fractions_of_a_millisecond_is_applied(late_server, protocol):
    url = late_server.grpc_url if protocol == "grpc" else late_server.http_url
    with (
        EmbeddingClient(url=url, protocol=protocol, retries=0, latency_budget_ms=5.5) as client,
        pytest.raises(ServerUnavailableError, match=r"the 5\.5 ms latency budget"),
    ):
        client.embed(["a float budget reaches both steps of the ensemble"])


def tokenizer_refusals(server) -> float:
    """``triton_embed_shed_requests_total{model="tokenizer"}`` from the server's metrics (0 before the first)."""
    return scrape(server.metrics_url).get('triton_embed_shed_requests_total{model="tokenizer"}', 0.0)


def test_the_tokenizer_refuses_at_once_a_request_queued_behind_a_bulk_job(late_server):
    # 64 texts cut at 256 tokens: ~2 s of encoder work on 2 CPU cores; budget 0, so the bulk job itself is never shed.
    bulk_texts = [f"bulk {i} " + "several words of a long document " * 60 for i in range(64)]
    before = tokenizer_refusals(late_server)
    with (
        ThreadPoolExecutor(1) as pool,
        EmbeddingClient(url=late_server.grpc_url, retries=0, latency_budget_ms=0) as bulk,
        EmbeddingClient(url=late_server.grpc_url, retries=0) as interactive,
    ):
        job = pool.submit(bulk.embed, bulk_texts)
        time.sleep(0.3)  # the bulk request is through the tokenizer
        with pytest.raises(ServerUnavailableError, match="LATENCY_BUDGET_MS") as caught:
            interactive.embed(["an interactive request behind the bulk job"])
        assert not job.done()  # refused before the work ahead of it was done, not after queueing behind it
        assert "of work before this request's batch" in str(caught.value)
        assert job.result().shape == (64, 384)
    assert tokenizer_refusals(late_server) == before + 1


def test_the_client_checks_the_budget_before_sending():
    for bad in (-1, -0.5, True, float("nan"), float("inf"), 1e308, "180"):
        with pytest.raises(ValueError, match="latency_budget_ms must be a number of ms from 0 to 3600000"):
            EmbeddingClient(url="127.0.0.1:1", latency_budget_ms=bad)
