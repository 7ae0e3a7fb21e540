"""Raw tritonclient calls the tests use to reach single steps and the statistics API."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

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
            dtype = {np.dtype(np.object_): "BYTES", np.dtype(np.bool_): "BOOL"}.get(array.dtype, "INT64")
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


def read_counts(grpc_url: str, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of ``model`` from Triton's statistics API, read once, now."""
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
    last = read_counts(grpc_url, model)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read_counts(grpc_url, model)
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
            import socket

            for s in (src, dst):  # shutdown first: a bare close leaves the other pipe's recv holding the connection
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._stop = True
        self._server.close()


class ClosingProxy:
    """A loopback HTTP relay to ``127.0.0.1:target_port`` that closes each client connection right after the first
    answer it relays, without ``Connection: close``: a server or proxy closing a kept-alive connection (its idle
    timeout, an nginx reload) just as the client sends its next request on it. ``connections``: those accepted."""

    def __init__(self, target_port: int) -> None:
        import socket

        self.target_port, self.connections = target_port, 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._relay_one_answer, args=(downstream,), daemon=True).start()

    def _relay_one_answer(self, downstream) -> None:
        import socket

        with downstream, socket.create_connection(("127.0.0.1", self.target_port)) as upstream:
            threading.Thread(target=self._forward, args=(downstream, upstream), daemon=True).start()
            answer = b""
            while (head := answer.find(b"\r\n\r\n")) < 0 or len(answer) < head + 4 + _content_length(answer[:head]):
                if not (chunk := upstream.recv(65536)):
                    return
                answer += chunk
            downstream.sendall(answer)
            for end in (downstream, upstream):  # shutdown, not close alone: it wakes _forward's recv and sends the FIN
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _forward(src, dst) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                dst.sendall(chunk)

    def close(self) -> None:
        self._server.close()


def _content_length(head: bytes) -> int:
    match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    return int(match.group(1)) if match else 0


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


HOLD_S = 3.0
"""How long the tokenizer of :func:`held_repository` holds each request before it runs, seconds."""


def held_repository(dst: Path, hold_s: float = HOLD_S) -> Path:
    """The shipped model repository at ``dst`` (artifacts linked, response cache off) whose tokenizer holds every
    request ``hold_s`` seconds before it runs (its dynamic batcher's ``max_queue_delay_microseconds``; requests of
    64 texts fill a batch and run at once), so that a test can see requests waiting for their first step."""
    from triton_embed_server import model_config

    from bench.serving import variant_repository

    repo = variant_repository(dst, None)
    delay_us = int(hold_s * 1e6)
    model_config.edit(repo / "tokenizer" / "config.pbtxt", lambda c: model_config.set_queue_delay(c, delay_us))
    return repo


def pending(metrics_url: str, model: str) -> int:
    """Requests waiting in ``model``'s queue now (Triton's ``nv_inference_pending_request_count``)."""
    rows = scrape(metrics_url)
    return int(sum(v for k, v in rows.items() if k.startswith(f'nv_inference_pending_request_count{{model="{model}"')))


def held_requests() -> list[list[str]]:
    """Eight new requests of 1-3 texts (15 in all: under one tokenizer batch of 64, so the tokenizer holds them all)."""
    import secrets

    tag = secrets.token_hex(4)
    return [[f"held request {n} text {k} {tag}" for k in range(n % 3 + 1)] for n in range(8)]


def held_requests_across_a_signal(
    grpc_url: str, metrics_url: str, requests: list[list[str]], send_signal
) -> list[np.ndarray | Exception]:
    """Send ``requests`` at once to a :func:`held_repository` server (no retries, budget 0: nothing is refused for
    load or resent, so every error is the shutdown's); once Triton's metrics show every one of them waiting in the
    tokenizer's queue and none is answered, call ``send_signal()``. Returns each request's embedding or error.

    A request still waiting for the tokenizer has its encoder step ahead of it: Triton's own stop refuses that step
    ("Server is stopping"); only a drain lets it through.
    """
    from triton_embed import EmbeddingClient

    answers: dict[int, np.ndarray | Exception] = {}

    def send(n: int) -> None:
        with EmbeddingClient(url=grpc_url, retries=0, timeout_s=60, latency_budget_ms=0) as client:
            try:
                answers[n] = client.embed(requests[n])
            except Exception as exc:  # noqa: BLE001 - returned to the caller, which checks them
                answers[n] = exc

    assert pending(metrics_url, "tokenizer") == 0, "the tokenizer's queue must be empty before the requests"
    senders = [threading.Thread(target=send, args=(n,)) for n in range(len(requests))]
    for t in senders:
        t.start()
    deadline = time.monotonic() + 30
    while (waiting := pending(metrics_url, "tokenizer")) < len(requests):
        assert not answers, f"answered before all {len(requests)} waited in the tokenizer's queue: {answers}"
        assert time.monotonic() < deadline, f"{waiting} of {len(requests)} requests reached the tokenizer's queue"
        time.sleep(0.02)
    assert not answers, f"answered while the tokenizer held them: {answers}"
    send_signal()
    for t in senders:
        t.join(timeout=120)
    assert len(answers) == len(requests), f"{len(requests) - len(answers)} requests got no answer within 120 s"
    return [answers[n] for n in range(len(requests))]


def kill_stub_mid_request(grpc_url: str, server_pid: int, model: str = "encoder"):
    """SIGKILL ``model``'s stub while requests of 32 long texts (~300 tokens each) run through it, as an OOM kill
    would; return the stats of the retrying client that sent them (``retries >= 1``: a request was in the stub)
    once every one of its 3 calls has its answer (the stub watchdog has reloaded the model)."""
    from triton_embed import EmbeddingClient
    from triton_embed_server.supervisor import stub_processes

    stubs = [pid for pid, name in stub_processes(server_pid).items() if name == model]
    assert stubs, stub_processes(server_pid)
    failures: list[BaseException] = []

    def send(client) -> None:
        try:
            for i in range(3):  # the kill lands in the first (~1 s in the encoder); the rest go to its replacement
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


class ServeRun:
    """A running ``python -m triton_embed_server serve`` whose output (tritonserver's too) goes to ``log``."""

    def __init__(self, proc, ports: list[str], log: Path) -> None:
        self.proc, self.ports, self.log = proc, ports, log

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports[1]}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]

    def server_pids(self) -> list[int]:
        """Every tritonserver it reported starting, first to last."""
        return [
            int(p) for p in re.findall(r"(?:starting tritonserver|tritonserver restarted) \(pid (\d+)\)", self.output())
        ]

    @property
    def server_pid(self) -> int:
        return self.server_pids()[0]

    def wait_for(self, text: str, timeout_s: float = 240.0) -> str:
        """Wait until ``text`` is in the output; fail with its tail if serve exits or ``timeout_s`` passes first."""
        import pytest

        deadline = time.monotonic() + timeout_s
        while text not in (out := self.output()):
            if self.proc.poll() is not None and text not in self.output():
                pytest.fail(f"serve exited with {self.proc.returncode} before {text!r}:\n{out[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {text!r} from serve within {timeout_s:.0f} s:\n{out[-3000:]}")
            time.sleep(0.05)
        return self.output()


def serve_command(http_port: int | str, grpc_port: int | str, metrics_port: int | str, *args: str) -> list[str]:
    """``python -m triton_embed_server serve`` on the three ports, with ``args``, as a user starts it."""
    import sys

    ports = ("--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port))
    return [sys.executable, "-m", "triton_embed_server", "serve", *ports, *args]


@contextlib.contextmanager
def serve_running(log: Path, *args: str, new_session: bool = False, wait_ready: bool = True):
    """``python -m triton_embed_server serve`` on free loopback ports with ``args``, its output in the file ``log``
    (a pipe nobody reads fills up and blocks tritonserver's writes); ready (its banner printed) unless
    ``wait_ready`` is False. Afterwards, whatever happened, serve and every tritonserver it started are gone.

    ``new_session``: its own process group, as a terminal runs it (a Ctrl-C test signals the whole group).
    """
    import subprocess

    from triton_embed_server.embedded import free_port

    ports = [str(free_port()) for _ in range(3)]
    cmd = serve_command(*ports, *args)
    with open(log, "ab") as out:
        proc = subprocess.Popen(  # noqa: S603 - our own module
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=new_session
        )
    run = ServeRun(proc, ports, log)
    try:
        if wait_ready:
            run.wait_for("Ctrl-C stops it")
        yield run
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        _kill_tritonservers(run.server_pids())


def _kill_tritonservers(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that is still a live tritonserver, with its process group (its stubs)."""
    from triton_embed_server.supervisor import process_alive

    for pid in pids:
        with contextlib.suppress(OSError):
            if process_alive(pid) and Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver":
                os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_until_ready(process, log: Path, ready_url: str, name: str, timeout_s: float = 60.0):
    """Wait until ``ready_url`` answers 200 while ``process`` (a ``subprocess.Popen`` writing to ``log``) runs; stop
    it on exit (SIGTERM, SIGKILL after 30 s), whatever happened.

    Raises:
        AssertionError: it exited or did not answer within ``timeout_s``, with the log's tail.
    """
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert process.poll() is None, f"{name} exited:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(OSError), urllib.request.urlopen(ready_url, timeout=2) as response:  # noqa: S310
                if response.status == 200:
                    break
            assert time.monotonic() < deadline, f"{name} not ready at {ready_url}:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def doc_examples(path: Path, fence: str) -> list[str]:
    """The code blocks of one kind (```bash, ```python) in a doc page."""
    return [block.split("```", 1)[0] for block in path.read_text().split(f"```{fence}\n")[1:]]
