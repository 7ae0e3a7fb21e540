"""The triton-embed CLI against the real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import reference_embed
from helpers import infer, text_tensor
from tritonclient.utils import InferenceServerException

CLI = [str(Path(sys.executable).parent / "triton-embed")]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, text=True, timeout=120, check=False)


def test_embed_prints_reference_vectors(server, reference):
    texts = ["A man is playing a guitar.", "Un homme joue de la guitare."]
    done = run_cli("embed", "--url", server.grpc_url, *texts)
    assert done.returncode == 0, done.stderr
    rows = [[float(x) for x in line.split()] for line in done.stdout.splitlines()]
    np.testing.assert_allclose(np.array(rows), reference_embed(reference, texts), atol=2e-6)


def test_embed_json_from_stdin_over_http(server, reference):
    done = run_cli("embed", "--json", "--protocol", "http", "--url", server.http_url, stdin="first line\nsecond line\n")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["text"] for r in rows] == ["first line", "second line"]
    served = np.array([r["embedding"] for r in rows])
    np.testing.assert_allclose(served, reference_embed(reference, ["first line", "second line"]), atol=1e-6)


def test_stdin_lines_map_one_to_one_to_output_lines(server, reference):
    done = run_cli("embed", "--url", f"grpc://{server.grpc_url}", stdin="one\r\n\nthree\n")
    assert done.returncode == 0, done.stderr
    rows = np.array([[float(x) for x in line.split()] for line in done.stdout.splitlines()])
    np.testing.assert_allclose(rows, reference_embed(reference, ["one", "", "three"]), atol=2e-6)


def test_non_utf8_stdin_is_a_clear_error_naming_the_line_and_byte(server):
    command = [*CLI, "embed", "--url", server.grpc_url]
    done = subprocess.run(command, input=b"good\nab\xffcd\n", capture_output=True, timeout=120, check=False)
    stderr = done.stderr.decode()
    assert done.returncode == 1, stderr
    assert "InvalidInputError" in stderr and "texts[1] (input line 2) is not valid UTF-8" in stderr, stderr
    assert "0xff" in stderr


@pytest.mark.parametrize("command", ["embed", "similarity"])
def test_a_non_utf8_argument_is_a_clear_error_naming_the_byte(server, command):
    """An argument that is not UTF-8 is named by its byte, as stdin does, not a raw UnicodeEncodeError."""
    texts = [b"good", b"ok\xffbad"]
    done = subprocess.run(
        [*CLI, command, "--url", server.grpc_url, *texts], capture_output=True, timeout=120, check=False
    )
    stderr = done.stderr.decode()
    assert done.returncode == 1, stderr
    assert "InvalidInputError: texts[1] is not valid UTF-8: byte 0xff at offset 2" in stderr, stderr


def test_a_server_side_error_names_the_input_line(server):
    lines = "\n".join(["first", "second", "x" * 70_000, "fourth"]) + "\n"  # line 3 is over MAX_TEXT_BYTES
    done = run_cli("embed", "--url", server.grpc_url, stdin=lines)
    assert done.returncode == 1 and "row 2 has 70000 bytes" in done.stderr, done.stderr
    assert "(texts[2] (input line 3) of this call)" in done.stderr, done.stderr


def test_embed_without_texts_on_a_terminal_says_so_instead_of_waiting():
    main, terminal = os.openpty()
    try:
        done = subprocess.run([*CLI, "embed"], stdin=terminal, capture_output=True, text=True, timeout=60, check=False)
    finally:
        os.close(main)
        os.close(terminal)
    assert done.returncode == 2 and "no texts: give them as arguments, with --file, or as lines on stdin" in done.stderr


def test_version():
    done = run_cli("--version")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert done.returncode == 0 and done.stdout.strip() == f"triton-embed {project['version']}"


def test_similarity_prints_cosine(server, reference):
    a, b = "A man is playing a guitar.", "Someone plays an instrument."
    done = run_cli("similarity", "--url", server.grpc_url, a, b)
    assert done.returncode == 0, done.stderr
    expected = float(np.dot(*reference_embed(reference, [a, b])))
    assert abs(float(done.stdout) - expected) < 1e-5


def test_unreachable_server_is_a_clear_error():
    done = run_cli("similarity", "--url", "127.0.0.1:1", "a", "b")
    assert done.returncode == 1
    assert "ServerUnavailableError" in done.stderr and "127.0.0.1:1" in done.stderr


def test_the_wrong_port_for_the_protocol_says_which_port_to_use(server):
    # TRITON_EMBED_URL at the gRPC port, then `--protocol http`, as docs/client.md's stdin example shows
    env = {**os.environ, "TRITON_EMBED_URL": server.grpc_url}
    done = subprocess.run(
        [*CLI, "embed", "--protocol", "http", "x"], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert done.returncode != 0 and "is this Triton's gRPC port? HTTP is --http-port" in done.stderr, done.stderr
    done = run_cli("embed", "--protocol", "grpc", "--url", server.http_url, "x")
    assert done.returncode != 0 and "HTTP port, 8000 by default, use protocol 'http'" in done.stderr, done.stderr


def test_embed_reads_a_file(server, reference, tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("from a file\nsecond line\n", encoding="utf-8")
    done = run_cli("embed", "--json", "--url", server.grpc_url, "--file", str(path))
    assert done.returncode == 0, done.stderr
    served = np.array([r["embedding"] for r in json.loads(done.stdout)])
    np.testing.assert_allclose(served, reference_embed(reference, ["from a file", "second line"]), atol=1e-6)


def test_health_reports_ready(server):
    done = run_cli("health", "--json", "--url", server.grpc_url)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"live": True, "ready": True, "model_ready": True, "error": ""}
    down = run_cli("health", "--url", "127.0.0.1:1")
    assert down.returncode == 1 and "model_ready=False" in down.stdout and "127.0.0.1:1" in down.stderr
    # the other protocol's port: not just "down", but why
    wrong = run_cli("health", "--url", server.http_url)
    assert wrong.returncode == 1 and "HTTP port, 8000 by default, use protocol 'http'" in wrong.stderr
    # the metrics port answers 200 to /v2/health/ready too, with an empty body: not a healthy Triton endpoint
    metrics = f"127.0.0.1:{server.config.metrics_port}"
    for command in (("health", "--protocol", "http"), ("embed", "--protocol", "http", "x")):
        done = run_cli(*command, "--url", metrics)
        assert done.returncode == 1 and "is this Triton's metrics port" in done.stderr, (command, done.stderr)
    assert "model_ready=False" in run_cli("health", "--protocol", "http", "--url", metrics).stdout
    grpc_to_metrics = run_cli("health", "--url", metrics)  # gRPC, the default protocol
    assert grpc_to_metrics.returncode == 1 and "its metrics port, 8002, serves no API" in grpc_to_metrics.stderr


def test_stats_table_has_every_step(server):
    run_cli("embed", "--url", server.grpc_url, "stats warm-up text")
    before = {r["model"]: r for r in json.loads(run_cli("stats", "--json", "--url", server.grpc_url).stdout)["steps"]}
    with pytest.raises(InferenceServerException, match="NUL byte"):  # refused by the tokenizer: a failure
        infer(server.grpc_url, "embed", {"TEXT": text_tensor([b"a NUL \0 byte"])}, ["EMBEDDING"])
    done = run_cli("stats", "--url", server.http_url, "--protocol", "http", "--metrics-url", server.metrics_url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["model", "successes", "failures"] and "queue" in lines[0] and "infer" in lines[0]
    assert "texts run" in lines[0] and lines[0].endswith("cache hits")  # a cache hit is a success, not a text run
    legend = run_cli("stats", "--help").stdout
    assert "texts run    texts the step computed (a cache hit is not run)" in legend, legend
    table, _, knobs = done.stdout.partition("\n\n")
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert set(rows) == {"embed", "tokenizer", "encoder"}
    assert all(int(row[1]) > 0 for row in rows.values())  # every step has served requests
    # Triton 2.51 counts it on the ensemble, twice; the tokenizer's own row counts its execution as a success
    assert int(rows["embed"][2]) == before["embed"]["failures"] + 2, done.stdout
    as_json = json.loads(
        run_cli("stats", "--json", "--url", server.grpc_url, "--metrics-url", server.metrics_url).stdout
    )
    encoder = next(r for r in as_json["steps"] if r["model"] == "encoder")
    assert encoder["executions"] <= encoder["inferences"] and encoder["compute_infer_ms"] > 0
    # the admission knobs in force, from the metrics port, as the encoder measured them on this machine
    assert knobs.startswith("admission: SLA_MS 200 (pinned), MAX_IN_FLIGHT "), done.stdout
    door = as_json["admission"]["knobs"]["MAX_IN_FLIGHT"]
    assert door["source"] == "derived" and door["value"] >= 1
    assert sorted(map(int, as_json["admission"]["curve_ms"])) == [1, 2, 4, 8, 16, 32, 64]
    elsewhere = run_cli("stats", "--url", server.grpc_url, "--metrics-url", "http://127.0.0.1:1/metrics")
    assert elsewhere.returncode == 0 and "admission knobs not read from http://127.0.0.1:1/metrics" in elsewhere.stderr
