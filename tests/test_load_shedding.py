"""Load shedding end to end: an encoder that makes every request wait 400 ms sheds it, unless the request asks for
a longer budget (request parameter ``latency_budget_ms``, set by the client's ``latency_budget_ms``)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from helpers import text_tensor
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


@pytest.mark.parametrize("value", [-5, "soon"])
def test_a_bad_budget_parameter_is_invalid_input(late_server, value):
    client = grpcclient.InferenceServerClient(late_server.grpc_url)
    tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(text_tensor(["x"]))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("embed", [tensor], parameters={"latency_budget_ms": value})
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"'latency_budget_ms' must be a number >= 0 (0 = never shed); got {value!r}" in caught.value.message()


def test_the_client_checks_the_budget_before_sending():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="latency_budget_ms must be an int >= 0"):
            EmbeddingClient(url="127.0.0.1:1", latency_budget_ms=bad)
