"""A bad request gets its own INVALID_ARG error naming the problem; the server keeps serving everyone else."""

from __future__ import annotations

import asyncio
import gc
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import infer, text_tensor
from triton_embed import AsyncEmbeddingClient, EmbeddingClient, InvalidInputError
from triton_embed.errors import from_triton
from tritonclient.utils import InferenceServerException


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_non_utf8_is_invalid_arg_and_next_request_succeeds(server, protocol):
    pid = server.pid
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with pytest.raises(InferenceServerException) as info:
        infer(url, "embed", {"TEXT": text_tensor([b"ok", b"\xff\xfe broken"])}, ["EMBEDDING"], protocol)
    message = info.value.message()
    assert "not valid UTF-8" in message and "row 1" in message and "0xff" in message
    assert str(info.value.status()) in ("StatusCode.INVALID_ARGUMENT", "400")
    with EmbeddingClient(url=url, protocol=protocol) as client:
        assert client.embed(["a good request right after"]).shape == (1, 384)
    assert server.pid == pid and server.is_alive()


def test_bad_request_fails_alone_within_a_batch(server, reference):
    good = [f"good request number {i} with some words" for i in range(12)]

    def send(item):
        try:
            # the bulk lane (latency_budget_ms 0): 13 at once may pass the door measured on a busy machine
            tensors = {"TEXT": text_tensor([item])}
            bulk = {"latency_budget_ms": 0}
            return infer(server.grpc_url, "embed", tensors, ["EMBEDDING"], parameters=bulk)["EMBEDDING"]
        except InferenceServerException as exc:
            return exc

    with ThreadPoolExecutor(13) as pool:
        results = list(pool.map(send, [*good[:6], b"\xc3\x28", *good[6:]]))
    bad = results.pop(6)
    assert isinstance(bad, InferenceServerException) and "not valid UTF-8" in bad.message()
    served = np.concatenate(results)
    expected = reference.encode(good, normalize_embeddings=True)
    np.testing.assert_allclose(served, expected, atol=1e-5)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_server_invalid_arg_maps_to_invalid_input_error(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with pytest.raises(InferenceServerException) as info:
        infer(url, "embed", {"TEXT": text_tensor([b"\x80"])}, ["EMBEDDING"], protocol)
    error = from_triton(info.value, model="embed", url=url)
    assert isinstance(error, InvalidInputError)
    assert f"model 'embed' at {url}" in str(error) and "not valid UTF-8" in str(error)


@pytest.mark.parametrize("mode", ["split", "coalesce", "async"])
def test_a_server_side_error_names_the_callers_index_not_the_row_of_its_request(server, mode):
    """A call of 100 texts goes out as requests of 64; the server's "row 6" is the caller's texts[70]."""
    texts = [f"fine text {i} {mode}" for i in range(100)]
    texts[70] = "x" * 70_000  # over MAX_TEXT_BYTES (65536): rejected by the tokenizer, not the client
    if mode == "coalesce":  # only the distinct texts are sent: row 1 of the request is the caller's texts[3]
        texts = ["same", "same", "same", "y" * 70_000]
    if mode == "async":

        async def call() -> None:
            async with AsyncEmbeddingClient(url=server.grpc_url) as client:
                await client.embed(texts)

        with pytest.raises(InvalidInputError) as info:
            asyncio.run(call())
    else:
        with (
            EmbeddingClient(url=server.grpc_url, coalesce=mode == "coalesce") as client,
            pytest.raises(InvalidInputError) as info,
        ):
            client.embed(texts)
    index = 3 if mode == "coalesce" else 70
    row = 1 if mode == "coalesce" else 6
    message = str(info.value)
    assert f"row {row} has 70000 bytes; the limit is 65536 bytes" in message, message
    assert message.endswith(f"(texts[{index}] of this call)") and info.value.text == texts[index]
    assert isinstance(info.value.__cause__, InferenceServerException)  # the tritonclient error, as documented


def test_a_failed_coalesced_async_call_raises_without_asyncio_logging_its_futures(server):
    """Each distinct text's future got the exception and nobody awaited it: asyncio logged "Future exception was
    never retrieved" with a traceback per text, hundreds under overload.

    grpcio's own poller now and then logs an exception from its completion queue's callback (BlockingIOError, or an
    event for an earlier test's closed loop: grpcio aio's poller is per process, each asyncio.run a new loop); that
    line is grpcio's, not the client's, and is left out."""
    logged = []

    def record(_loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if not context["message"].startswith("Exception in callback PollerCompletionQueue._handle_events"):
            logged.append(context["message"])

    async def call() -> None:
        asyncio.get_running_loop().set_exception_handler(record)
        async with AsyncEmbeddingClient(url=server.grpc_url, coalesce=True) as client:
            with pytest.raises(InvalidInputError):
                await client.embed(["fine and coalesced", "x" * 70_000])  # over MAX_TEXT_BYTES: the server refuses
        gc.collect()  # a never-retrieved exception is logged when its future is collected
        await asyncio.sleep(0)

    asyncio.run(call())
    assert logged == []


def test_client_rejects_non_text_before_sending(server):
    with (
        EmbeddingClient(url=server.grpc_url) as client,
        pytest.raises(InvalidInputError, match=r"texts\[1\] is int; every text must be str or UTF-8 bytes"),
    ):
        client.embed(["fine", 42])


def test_wrong_shape_to_ensemble_is_rejected(server):
    flat = np.array([b"no batch column"], dtype=np.object_)  # [1] instead of [1, 1]
    with pytest.raises(InferenceServerException) as info:
        infer(server.grpc_url, "embed", {"TEXT": flat}, ["EMBEDDING"])
    assert "TEXT" in info.value.message()
    assert str(info.value.status()) == "StatusCode.INVALID_ARGUMENT"


def encoder_inputs(ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    return {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}


@pytest.mark.parametrize(
    ("ids", "mask", "expected"),
    [
        (np.full((1, 5), 1000), np.ones((1, 6)), "'input_ids' has shape [1, 5] but 'attention_mask' has [1, 6]"),
        (np.full((1, 300), 1000), np.ones((1, 300)), "'input_ids' has 300 tokens per row; the limit is 256"),
        (np.array([[101, 99999, 102]]), np.ones((1, 3)), "token id 99999; ids must be in [0, 30522)"),
        (np.array([[101, -1, 102]]), np.ones((1, 3)), "token id -1; ids must be in [0, 30522)"),
        (np.array([[101, 102]]), np.array([[1, 2]]), "'attention_mask' must hold only 0 and 1"),
    ],
    ids=["shape_mismatch", "too_long", "id_too_big", "id_negative", "bad_mask"],
)
def test_encoder_rejects_bad_tensors_with_the_limit_and_value(server, ids, mask, expected):
    with pytest.raises(InferenceServerException) as info:
        infer(server.grpc_url, "encoder", encoder_inputs(ids, mask), ["embedding__0"])
    assert expected in info.value.message()
    assert str(info.value.status()) == "StatusCode.INVALID_ARGUMENT"
    ok = infer(
        server.grpc_url, "encoder", encoder_inputs(np.array([[101, 7592, 102]]), np.ones((1, 3))), ["embedding__0"]
    )
    assert ok["embedding__0"].shape == (1, 384)


def test_encoder_takes_the_tokenizers_stamp_only_with_its_lane(server):
    # queued_ns and bulk are the tokenizer's hand-off: the lane is decided there, never guessed by the encoder
    tokens = encoder_inputs(np.array([[101, 7592, 102]]), np.ones((1, 3)))
    stamp = np.array([[time.monotonic_ns()]], dtype=np.int64)
    for extra, expected in (
        ({"queued_ns": stamp}, "input 'queued_ns' came without 'bulk'"),
        ({"bulk": np.array([[False]])}, "input 'bulk' came without 'queued_ns'"),
        (
            {"queued_ns": stamp, "bulk": np.array([[False], [True]])},
            "'queued_ns' batch size does not match",
        ),  # Triton's
    ):
        with pytest.raises(InferenceServerException) as info:
            infer(server.grpc_url, "encoder", {**tokens, **extra}, ["embedding__0"])
        assert expected in info.value.message()
        assert str(info.value.status()) == "StatusCode.INVALID_ARGUMENT"
    ok = infer(server.grpc_url, "encoder", {**tokens, "queued_ns": stamp, "bulk": np.array([[True]])}, ["embedding__0"])
    assert ok["embedding__0"].shape == (1, 384)


def test_non_kserve_http_bodies_get_tritons_own_answers(server):
    """Triton 2.51's HTTP frontend, before our code: documented in docs/troubleshooting.md, pinned here."""
    url = f"http://{server.http_url}/v2/models/embed/infer"
    for body, fragment in ((b"{}", "Unable to parse 'inputs'"), (b"{bad", "failed to parse the request JSON buffer")):
        request = urllib.request.Request(url, data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)  # noqa: S310 - our loopback server
        assert info.value.code == 500 and fragment in info.value.read().decode()
    request = urllib.request.Request(url, data=b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:  # a raw binary body: only for a model of one input
        urllib.request.urlopen(request, timeout=30)  # noqa: S310
    assert info.value.code == 400 and "Raw request must only have 1 input" in info.value.read().decode()
