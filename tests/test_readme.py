"""The README's examples run as written against a real server, with its addresses swapped for the test server's: the
CLI lines, the Python client and curl on Triton's own route (tests/test_gateway.py runs the gateway's curl and OpenAI
examples). What each line's comment promises is what the test checks."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import reference_embed
from helpers import doc_examples

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXTS = ["A man is playing a guitar.", "Someone plays music."]


def commands(prefix: str) -> list[str]:
    """Commands of the bash blocks that start with ``prefix``: continuations and quoted newlines joined, comments
    dropped."""
    found = []
    for block in doc_examples(README, "bash"):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on on the next line
                continue
            if pending.startswith(prefix):
                found.append(shlex.join(words))
            pending = ""
    return found


def as_here(line: str, server) -> str:
    return line.replace("127.0.0.1:8001", server.grpc_url).replace("http://127.0.0.1:8000", f"http://{server.http_url}")


def run(line: str, server) -> subprocess.CompletedProcess:
    """``line`` in bash as the README says to run it: after ``source .venv/bin/activate``, the server's address."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "TRITON_EMBED_URL": server.grpc_url,
    }
    return subprocess.run(
        ["bash", "-c", as_here(line, server)], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_readmes_cli_lines_print_what_their_comments_say(server, reference):
    lines = commands("triton-embed ")
    assert {shlex.split(line)[1] for line in lines} == {"embed", "similarity", "health", "stats"}
    expected = reference_embed(reference, TEXTS)
    for line in lines:
        done = run(line, server)
        assert done.returncode == 0, (line, done.stderr)
        command = shlex.split(line)[1]
        if command == "embed":  # one vector per line
            rows = np.array([[float(x) for x in row.split()] for row in done.stdout.splitlines()], dtype=np.float32)
            np.testing.assert_allclose(rows, expected, atol=2e-6)
        elif command == "similarity":  # 0.6...
            assert done.stdout.startswith("0.6") and abs(float(done.stdout) - float(expected[0] @ expected[1])) < 1e-5
        elif command == "health":
            assert "live=True ready=True model_ready=True" in done.stdout, done.stdout
        else:  # per step: successes, texts run, batch, queue/compute ms
            assert all(step in done.stdout for step in ("embed", "tokenizer", "encoder")), done.stdout


def test_the_readmes_python_client_example_gives_the_reference_vectors(server, reference):
    (snippet,) = [block for block in doc_examples(README, "python") if "EmbeddingClient(" in block]
    scope: dict = {}
    exec(as_here(snippet, server), scope)  # noqa: S102 - our own README
    expected = reference_embed(reference, TEXTS)
    assert scope["vectors"].shape == (2, 384) and scope["vectors"].dtype == np.float32
    np.testing.assert_allclose(scope["vectors"], expected, atol=2e-6)
    assert abs(scope["score"] - float(expected[0] @ expected[1])) < 1e-5


def test_the_readmes_curl_on_tritons_route_answers_n_by_384(server, reference):
    (line,) = commands("curl -s http://127.0.0.1:8000/")
    done = run(line, server)
    assert done.returncode == 0, done.stderr
    (output,) = json.loads(done.stdout)["outputs"]
    assert output["name"] == "EMBEDDING" and output["shape"] == [2, 384]
    served = np.array(output["data"], dtype=np.float32).reshape(2, 384)
    np.testing.assert_allclose(served, reference_embed(reference, TEXTS), atol=2e-6)
