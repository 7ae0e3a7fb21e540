"""GPU deployment on real servers: the compose `triton` command line, the model export and the monitoring stack.

* tritonserver started with docker-compose.yml's `triton` command line through docker/triton-entrypoint.sh, on
  the model repository docker/sync-model-repository.sh assembles, with the CPU build of the same Triton (2.51.0):
  it serves, its healthcheck passes, its admin APIs are locked, it is the release the image is built from.
* The model-export service's script exports a model given as MODEL (a small random BERT here) with every config's
  embedding width set to the model's, and the compose command line serves it; models listed in MODELS are served
  beside it, and the compose gateway routes to each by name.
* A real Prometheus (Debian's 2.42) with monitoring/prometheus/prometheus.yml scrapes that server and the GPU
  monitor's exporter (fed with recorded samples: no GPU here), evaluates the alert rules and every query of the
  Grafana dashboard.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
import yaml
from conftest import reference_embed
from deploy_helpers import (
    ALERTS_YML,
    NGC_RELEASE,
    PROMETHEUS_YML,
    ROOT,
    compose_server_running,
    dashboard_targets,
    dockerfile_instructions,
    embedding_widths,
    metric_names_in,
    prom_api,
    prometheus_running,
    resolved,
    sync_model_repository,
)
from helpers import (
    embed_until_answered,
    held_repository,
    held_requests,
    held_requests_across_a_signal,
    kill_stub_mid_request,
    post_status,
)
from small_models import small_sentence_transformer
from triton_embed import EmbeddingClient
from triton_embed_server.supervisor import process_alive, stub_processes


@pytest.fixture(scope="module")
def compose_server(tmp_path_factory):
    with compose_server_running(tmp_path_factory.mktemp("compose")) as server:
        yield server


def test_compose_command_serves_embeddings_with_the_admin_apis_locked(compose_server):
    import numpy as np

    with EmbeddingClient(url=compose_server.grpc_url, protocol="grpc") as client:
        vectors = client.embed(["A man is playing a guitar.", "Someone plays music."])
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    index = f"http://{compose_server.http_url}/v2/repository/index"
    assert post_status(index) == 403
    assert post_status(index, {"triton-embed-admin-key": "wrong"}) == 403
    assert post_status(index, {"triton-embed-admin-key": compose_server.admin_key}) == 200
    # the synced repository: configs from the host, artifacts from the image, nothing left from before
    files = sorted(str(p.relative_to(compose_server.models)) for p in compose_server.models.rglob("*") if p.is_file())
    assert "left-over.pbtxt" not in files and "encoder/1/model.pt" in files and "embed/config.pbtxt" in files
    assert (compose_server.models / "embed" / "1").is_dir() and ".gitkeep" not in " ".join(files)
    # the entrypoint's driver check ran first: the CPU config needs no driver
    assert "triton-embed: config 'cpu' runs on the CPU: no NVIDIA driver check" in compose_server.log.read_text()


def test_model_given_to_the_export_is_exported_and_served_with_its_width(tmp_path):
    """MODEL=folder: the export service's script exports it (read-only source), sets every config's width to its
    own, and the compose command line serves it; the host's configs are left as they are."""
    import shutil

    source = small_sentence_transformer(tmp_path / "st", dim=48)
    before = {p: p.stat().st_mtime_ns for p in source.rglob("*")}
    models, done = sync_model_repository(tmp_path / "sync", model=source)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((models / "encoder" / "1" / "export.json").read_text())
    assert manifest["dim"] == 48 and manifest["precision"] == "fp16"  # auto, for the GPU configs compose serves
    widths = embedding_widths(models)
    assert len(widths) == len(embedding_widths(ROOT / "model_repository")) >= 4 and set(widths.values()) == {48}
    assert set(embedding_widths(ROOT / "model_repository").values()) == {384}  # the host's configs untouched
    assert {p: p.stat().st_mtime_ns for p in source.rglob("*")} == before  # the mounted folder, read only
    shutil.rmtree(tmp_path / "sync")
    with (
        compose_server_running(tmp_path / "serve", model=source) as server,
        EmbeddingClient(url=server.grpc_url, protocol="grpc") as client,
    ):
        vectors = client.embed(["A man is playing a guitar.", "Someone plays music.", "third"])
    assert vectors.shape == (3, 48)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_models_listed_beside_the_default_are_served_and_the_compose_gateway_routes_each(tmp_path):
    """MODELS=multi=FOLDER (a folder of MODELS_DIR): the export service adds the model as its own ensemble beside the
    packaged `embed`, the compose command line serves both, and the gateway as compose starts it (--repository on
    the same volume) lists both and answers each from its own model; a malformed entry stops the export."""
    import shutil

    from test_gateway import gateway_running, post

    root = tmp_path / "models"
    folder = small_sentence_transformer(root / "tiny", dim=48).relative_to(root)
    _, done = sync_model_repository(tmp_path / "bad", models="multi", models_root=root)
    assert done.returncode == 2 and "MODELS entry 'multi' is not NAME=FOLDER" in done.stderr
    _, done = sync_model_repository(tmp_path / "absent", models="multi=nowhere", models_root=root)
    assert done.returncode == 2 and f"{root}/nowhere is not a folder" in done.stderr
    shutil.rmtree(tmp_path / "bad")
    shutil.rmtree(tmp_path / "absent")
    with compose_server_running(tmp_path / "serve", models=f"multi={folder}", models_root=root) as server:
        widths = embedding_widths(server.models)
        assert {w for path, w in widths.items() if path.startswith("multi")} == {48}
        assert {w for path, w in widths.items() if not path.startswith("multi")} == {384}
        command = resolved()["services"]["gateway"]["command"]
        repository = [a.replace("=/models", f"={server.models}") for a in command if a.startswith("--repository=")]
        assert repository, command
        with gateway_running(server.grpc_url, tmp_path / "gateway.log", *repository) as base:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:  # noqa: S310 - our gateway
                assert [m["id"] for m in json.loads(response.read())["data"]] == ["embed", "multi"]
            for name, width in (("embed", 384), ("multi", 48)):
                status, body, _ = post(f"{base}/v1/embeddings", {"model": name, "input": ["a guitar", "music"]})
                assert status == 200 and body["model"] == name, body
                vectors = np.array([d["embedding"] for d in body["data"]])
                assert vectors.shape == (2, width)
                np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)


def test_without_model_the_host_configs_get_the_packaged_models_width(tmp_path):
    """The host's configs left at another width (a host-side `make model MODEL=...`) meet the image's packaged model:
    the synced configs say the artifact's width, so Triton never loads a mismatched pair."""
    import shutil

    from triton_embed_server.model_config import set_config_dims

    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "model_repository", configs, ignore=shutil.ignore_patterns("1"))
    for model in ("embed", "encoder", "tokenizer"):
        (configs / model / "1").mkdir()
    set_config_dims(configs, 768)
    models, done = sync_model_repository(tmp_path, configs=configs)
    assert done.returncode == 0, done.stderr
    assert set(embedding_widths(models).values()) == {384} and set(embedding_widths(configs).values()) == {768}
    assert "the model's values (width 384) in encoder/configs/gpu.pbtxt" in done.stderr


def test_healthcheck_passes_on_a_ready_server_and_fails_without_one(compose_server):
    from triton_embed_server.embedded import free_port

    kind, interpreter, *args = resolved()["services"]["triton"]["healthcheck"]["test"]
    assert (kind, interpreter) == ("CMD", "python3")

    def run(port: int) -> int:
        here = [a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in args]
        return subprocess.run([sys.executable, *here], capture_output=True, check=False, timeout=30).returncode

    assert run(compose_server.http_port) == 0
    assert run(free_port()) != 0


def test_image_versions_match_the_embedded_server_and_the_lock(compose_server):
    args = dict(a.split("=", 1) for i, a in dockerfile_instructions() if i == "ARG" and "=" in a)
    version = compose_server.metadata()["version"]
    assert args["TRITON_IMAGE"] == f"nvcr.io/nvidia/tritonserver:{NGC_RELEASE[version]}-py3"
    from packaging.specifiers import SpecifierSet

    # the image's Python is one the project declares and one the Makefile builds the server's venv with
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    image_python = re.fullmatch(r"python:3\.(\d+)-.*", args["PYTHON_IMAGE"])
    assert image_python, args["PYTHON_IMAGE"]
    accepted = ast.literal_eval(re.search(r"v in (\(.*?\)) or sys.exit", (ROOT / "Makefile").read_text())[1])
    assert SpecifierSet(requires).contains(f"3.{image_python[1]}.0") and (3, int(image_python[1])) in accepted


def recorded_gpu_sample(timestamp: float, gpu: int, util: float):
    from triton_embed_monitor import GpuSample

    return GpuSample(
        timestamp,
        gpu,
        "NVIDIA H200",
        f"GPU-{gpu}",
        util,
        util / 3,
        9 << 30,
        141 << 30,
        1980.0,
        250.0,
        40.0,
        ((1234, 8 << 30),),
    )


@pytest.fixture(scope="module")
def monitor_exporter():
    """The monitor's real exporter fed with recorded samples (this machine has no GPU): GPU 1 saturated."""
    from triton_embed_monitor import FlagThresholds, QueueSample
    from triton_embed_monitor.exporter import MonitorExporter

    exporter = MonitorExporter(FlagThresholds(idle_window_s=2.0, saturation_window_s=2.0))
    start = time.time() - 5
    for i in range(5):
        samples = [recorded_gpu_sample(start + i, 0, 3.0), recorded_gpu_sample(start + i, 1, 99.0)]
        exporter.observe(samples, QueueSample(start + i - 0.1, 4))
    server, _ = exporter.serve("127.0.0.1", 0)
    yield exporter, server.server_port
    server.shutdown()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, compose_server, monitor_exporter):
    """Debian's prometheus with monitoring/prometheus/prometheus.yml, pointed at loopback targets, scraping each 1 s."""
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["rule_files"] == ["alerts.yml"] and (PROMETHEUS_YML.parent / "alerts.yml").is_file()
    config["rule_files"] = [str(ALERTS_YML)]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    targets = {"triton": f"127.0.0.1:{compose_server.metrics_port}", "gpu-monitor": f"127.0.0.1:{monitor_exporter[1]}"}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    with prometheus_running(tmp, config) as base:
        yield base


def wait_for(check, timeout_s: float = 30.0, what: str = ""):
    """Poll ``check()`` until it returns a truthy value; return it."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return result


def test_prometheus_scrapes_triton_and_the_monitor(prometheus):
    def both_up():
        up = {r["metric"]["job"]: r["value"][1] for r in prom_api(prometheus, "query", query="up")["result"]}
        return up if up == {"triton": "1", "gpu-monitor": "1"} else None

    wait_for(both_up, what="up == 1 for the triton and gpu-monitor jobs")
    # what was scraped is Triton's: the ensemble's counters carry the job label of the triton scrape
    series = prom_api(prometheus, "query", query='nv_inference_request_success{model="embed"}')["result"]
    assert series and series[0]["metric"]["job"] == "triton"


def test_alert_rules_load_and_evaluate_without_errors(prometheus):
    def evaluated():
        groups = prom_api(prometheus, "rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules) else None

    rules = wait_for(evaluated, what="a first evaluation of every rule")
    # the recorded GPU 1 is saturated: its alert turns pending (it would fire after `for: 2m`)
    saturated = wait_for(
        lambda: [
            a["labels"]["gpu"]
            for g in prom_api(prometheus, "rules")["groups"]
            for r in g["rules"]
            if r["name"] == "TritonEmbedGpuSaturated"
            for a in r["alerts"]
        ],
        what="the saturation alert of the recorded GPU",
    )
    assert saturated == ["1"]
    assert {r["name"] for r in rules} == {
        "TritonEmbedGpuIdleWithQueue",
        "TritonEmbedGpuSaturated",
        "TritonEmbedP99OverSla",
        "TritonEmbedShedding",
        "TritonEmbedDown",
        "TritonEmbedGpuMonitorDown",
    }
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_every_dashboard_and_alert_query_names_real_metrics_and_returns_data(
    prometheus, compose_server, monitor_exporter
):
    """Names: a real scrape of the compose-command server plus the monitor's exporter. Data: Prometheus answers."""
    import secrets

    from triton_embed_monitor.exporter import metric_names

    with EmbeddingClient(url=compose_server.grpc_url, protocol="grpc") as client:
        for i in range(3):  # traffic in two bursts a few scrapes apart, so rate() has an increase to show
            client.embed([f"sentence {secrets.token_hex(4)} number {i}" for _ in range(3)])
            client.embed(["the same text twice hits the response cache"])
            time.sleep(1.5)
    with urllib.request.urlopen(compose_server.metrics_url, timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    # sample names exactly as Prometheus stores them (a client-side parser would add _total to Triton's counters)
    scraped = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and line[0] != "#"}
    known = scraped | metric_names(monitor_exporter[0].registry) | {"ALERTS", "up"}  # the last two: Prometheus' own
    alert_exprs = [r["expr"] for g in yaml.safe_load(ALERTS_YML.read_text())["groups"] for r in g["rules"]]
    for expr in [t["expr"] for _, t in dashboard_targets()] + alert_exprs:
        assert metric_names_in(expr) <= known, f"{expr} reads {metric_names_in(expr) - known}, which nobody exports"

    for title, target in dashboard_targets():
        expr = target["expr"].replace("$__rate_interval", "1m").replace("$model", "embed")  # as Grafana sends it

        def answered(expr=expr):
            result = prom_api(prometheus, "query", query=expr)["result"]
            return result or expr.startswith("ALERTS")  # no alert firing is a fine answer

        wait_for(answered, timeout_s=20, what=f"data for panel {title!r}: {expr}")


def test_compose_stop_drains_requests_still_waiting_for_their_first_step(tmp_path, reference):
    """`docker compose stop` sends the entrypoint SIGTERM while eight requests wait in the tokenizer's queue (configs
    whose tokenizer holds them; Triton's metrics show all eight there, none answered). Their encoder step is still
    ahead, which Triton's own stop refuses ("Server is stopping"), so the entrypoint drains the ensemble first
    (drain.py), then stops tritonserver and exits with its status: each request gets its embedding."""
    configs = held_repository(tmp_path / "configs")
    with compose_server_running(tmp_path / "compose", configs=configs) as server:
        requests = held_requests()
        answers = held_requests_across_a_signal(
            server.grpc_url, server.metrics_url, requests, lambda: server.process.send_signal(signal.SIGTERM)
        )
        lost = [a for a in answers if not isinstance(a, np.ndarray)]
        assert not lost, f"{len(lost)} of {len(requests)} lost: {lost[0]!r}"
        assert server.process.wait(timeout=75) == 0, server.log_tail()
        assert "triton-embed: 'embed' drained in" in server.log.read_text(errors="replace"), server.log_tail()
        assert not process_alive(server.server_pid)
    for texts, served in zip(requests, answers, strict=True):
        np.testing.assert_allclose(served, reference_embed(reference, texts), atol=1e-5)


@pytest.mark.parametrize("model", ["tokenizer", "encoder"])
def test_compose_watchdog_reloads_a_model_whose_stub_was_killed(tmp_path, reference, model):
    """Triton 2.51 leaves a killed stub dead (requests fail, the model stays READY); the entrypoint's watchdog reloads
    it through the locked repository API, without restarting tritonserver."""
    with compose_server_running(tmp_path) as server:
        assert server.watchdog_pid, f"the entrypoint started no stub watchdog:\n{server.log_tail()}"
        stubs = [pid for pid, name in stub_processes(server.server_pid).items() if name == model]
        assert stubs, stub_processes(server.server_pid)
        os.kill(stubs[0], signal.SIGKILL)

        text = f"served by the compose server after its {model} stub died"
        served, _ = embed_until_answered(server.grpc_url, text, within_s=30, note=server.log_tail)
        np.testing.assert_allclose(served, reference_embed(reference, [text]), atol=1e-5)
        assert server.process.poll() is None and process_alive(server.server_pid)
        assert re.findall(r"model '(\w+)' reloaded", server.log.read_text()) == [model], server.log_tail()
        assert stubs[0] not in stub_processes(server.server_pid)
        assert model in stub_processes(server.server_pid).values()


def test_compose_stop_after_a_stub_died_with_a_request_in_it_is_quick_and_clean(tmp_path):
    """Triton 2.51 never finishes unloading an instance whose stub died with a request in it, so its own stop waits
    out the 30 s exit timeout and exits 1 (a failed `docker compose stop`); the entrypoint's watchdog kills it once
    every live stub has exited, and the entrypoint exits 0."""
    with compose_server_running(tmp_path) as server:
        assert kill_stub_mid_request(server.grpc_url, server.server_pid, "encoder").retries >= 1
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)  # `docker compose stop`
        code = server.process.wait(timeout=75)
        took = time.monotonic() - started
        log = server.log.read_text(errors="replace")
        assert "Exit timeout expired" not in log and code == 0, server.log_tail()
        assert "has unloaded every model but the one whose stub died" in log, server.log_tail()
        assert took < 20, f"the stop took {took:.0f} s (Triton's exit timeout is 30 s)"
