"""Raw tritonclient calls the tests use to reach single steps and the statistics API."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def text_tensor(texts: list[str] | list[bytes]) -> np.ndarray:
    """[N, 1] object array of UTF-8 bytes, the TEXT layout the ensemble expects."""
    return np.array([[t.encode() if isinstance(t, str) else t] for t in texts], dtype=np.object_)


def infer(
    url: str,
    model: str,
    inputs: dict[str, np.ndarray],
    outputs: list[str],
    protocol: str = "grpc",
    parameters: dict | None = None,
):
    """Send one request with the given named inputs (and request ``parameters``); return {output name: array}.

    Raises:
        InferenceServerException: the server's error.
    """
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(url)
    try:
        tensors = []
        for name, array in inputs.items():
            dtype = "BYTES" if array.dtype == np.object_ else "INT64"
            tensor = module.InferInput(name, list(array.shape), dtype)
            if protocol == "http":
                tensor.set_data_from_numpy(array, binary_data=True)
            else:
                tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        requested = [module.InferRequestedOutput(o) for o in outputs]
        result = client.infer(model, tensors, outputs=requested, parameters=parameters)
        return {o: result.as_numpy(o) for o in outputs}
    finally:
        client.close()


def _read_counts(grpc_url: str, model: str) -> tuple[int, int]:
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        stats = client.get_inference_statistics(model_name=model, as_json=True)["model_stats"][0]
    finally:
        client.close()
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def counts(grpc_url: str, model: str, quiet_s: float = 0.3, timeout_s: float = 5.0) -> tuple[int, int]:
    """(inference_count, execution_count) of ``model`` from Triton's statistics API, once two reads ``quiet_s``
    apart agree: Triton records a request's statistics when it releases the request, which can be just after the
    client has its response."""
    last = _read_counts(grpc_url, model)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = _read_counts(grpc_url, model)
        if now == last:
            break
        last = now
    return last


class ByteCountingProxy:
    """A loopback TCP proxy that forwards to ``127.0.0.1:target_port`` and counts the bytes in each direction."""

    def __init__(self, target_port: int) -> None:
        import socket
        import threading

        self.target_port = target_port
        self.sent = 0  # client -> server
        self.received = 0  # server -> client
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stop:
            try:
                downstream, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(downstream, upstream, "sent"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, downstream, "received"), daemon=True).start()

    def _pipe(self, src, dst, counter: str) -> None:
        try:
            while chunk := src.recv(65536):
                with self._lock:
                    setattr(self, counter, getattr(self, counter) + len(chunk))
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._stop = True
        self._server.close()


def post_status(url: str, headers: dict | None = None) -> int:
    """HTTP status of an empty-JSON POST to ``url`` (e.g. an admin API: 403 without its header, 200 with it)."""
    request = urllib.request.Request(url, data=b"{}", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - our loopback server
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as ``{'name{labels}': value}`` (comments left out)."""
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - our own loopback server
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def embed_until_answered(grpc_url: str, text: str, within_s: float = 30.0, note=lambda: "") -> tuple[np.ndarray, list]:
    """Embed ``text`` over and over (no client retries, 0.5 s apart) until an answer comes, e.g. while a crashed stub
    is reloaded; returns ``(embedding (1, dim) float32, the errors seen before it)``. Fails the test after
    ``within_s`` seconds, with the last error and ``note()`` (e.g. the server's log tail then)."""
    import pytest
    from triton_embed import EmbeddingClient

    failures = []
    started = time.monotonic()
    with EmbeddingClient(url=grpc_url, retries=0, timeout_s=10) as client:
        while time.monotonic() - started < within_s:
            try:
                return client.embed([text]), failures
            except Exception as exc:  # noqa: BLE001 - returned to the caller, which checks them
                failures.append(exc)
                time.sleep(0.5)
    pytest.fail(f"no answer within {within_s:.0f} s; last error {failures[-1]!r}\n{note()}")


def load_across_a_signal(url: str, requests: list[list[str]], threads: int, signal_after_s: float, send_signal):
    """Send ``requests`` from ``threads`` closed-loop clients; ``signal_after_s`` seconds in, stop sending and call
    ``send_signal()``. Returns ``(numbers of the requests sent before the signal, {number: embedding or error})``.

    Budget 0 and no retries: nothing is refused for load or resent, so every error is the shutdown's.
    """
    from triton_embed import EmbeddingClient

    sent_before_signal: list[int] = []
    answers: dict[int, object] = {}
    stopping = threading.Event()

    def worker(i: int) -> None:
        with EmbeddingClient(url=url, retries=0, timeout_s=30, latency_budget_ms=0) as client:
            for n in range(i, len(requests), threads):
                if stopping.is_set():
                    return
                sent_before_signal.append(n)  # stopping is set before the signal: this one is sent before it
                try:
                    answers[n] = client.embed(requests[n])
                except Exception as exc:  # noqa: BLE001 - the caller checks
                    answers[n] = exc

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    time.sleep(signal_after_s)
    stopping.set()
    send_signal()
    for t in workers:
        t.join(timeout=60)
    return sent_before_signal, answers


def drained_requests(sts_pairs, per_request: int, count: int = 400) -> list[list[str]]:
    """``count`` unique requests of ``per_request`` texts: one STS-B sentence each, or four (~60-80 tokens) for
    multi-text requests, so that a drain has real work in flight."""
    words = 1 if per_request == 1 else 4
    sentences = [" ".join(p.a for p in sts_pairs[i : i + words]) for i in range(count)]
    return [[f"{sentences[(n * per_request + k) % count]} drained {n}.{k}" for k in range(per_request)]
            for n in range(count)]  # fmt: skip


def kill_stub_mid_request(grpc_url: str, server_pid: int, model: str = "encoder"):
    """SIGKILL ``model``'s stub while requests of 32 long texts (~300 tokens each) run through it, as an OOM kill
    would; return the stats of the retrying client that sent them (``retries >= 1``: a request was in the stub)
    once every one of its 8 calls has its answer (the stub watchdog has reloaded the model)."""
    from triton_embed import EmbeddingClient
    from triton_embed_server.supervisor import stub_processes

    stubs = [pid for pid, name in stub_processes(server_pid).items() if name == model]
    assert stubs, stub_processes(server_pid)
    failures: list[BaseException] = []

    def send(client) -> None:
        try:
            for i in range(8):
                client.embed([f"long text {i} {row} " * 60 for row in range(32)])
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    with EmbeddingClient(url=grpc_url, retries=30, backoff_s=0.25, latency_budget_ms=0) as client:
        sender = threading.Thread(target=send, args=(client,))
        sender.start()
        time.sleep(0.5)  # the first request has gone through the tokenizer: the encoder runs it for ~1 s
        os.kill(stubs[0], signal.SIGKILL)
        sender.join(timeout=120)
        assert not sender.is_alive(), "the retrying client got no answers within 120 s"
        assert not failures, failures
        return client.stats()
