"""GPU deployment, the files and the real tools that check them; no server, no Docker engine, no GPU.

* docker-compose.yml: Debian's docker-compose 1.29 validates and resolves it; the resolved file is checked.
* docker/Dockerfile: its versions come from requirements.lock, docker/requirements-triton.lock and the Makefile; the
  image lock agrees with the project's lock and is what pip resolves for the image's Python (3.10); our backends
  parse as Python 3.10; the monitor image's install holds the monitor.
* docker/triton-entrypoint.sh checks the driver first and locks the admin APIs as the embedded server does.
* Prometheus (Debian's 2.42): promtool checks the config and rules and runs their unit tests; the Grafana
  dashboard is well formed. The servers behind them run in test_deploy_runtime.py.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from deploy_helpers import (
    ALERTS_YML,
    COMPOSE,
    DASHBOARD,
    DOCKERFILE,
    IMAGE_LOCK,
    MONITORING,
    NGC_PYTORCH,
    NGC_RELEASE,
    PROMETHEUS_YML,
    ROOT,
    canonical,
    compose,
    dashboard_targets,
    dockerfile_instructions,
    entrypoint_env,
    lock_pins,
    metric_names_in,
    resolved,
    tool,
)


# -- docker-compose.yml ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", [False, True], ids=["triton-alone", "monitoring"])
def test_compose_file_is_valid(profile):
    done = compose("config", "-q", profile=profile)
    assert done.returncode == 0, done.stderr
    # the validator does reject a broken file (so the check above means something)
    broken = COMPOSE.read_text().replace("shm_size: 1gb", "shm_size: [1]")
    bad = subprocess.run(
        [tool("docker-compose"), "-f", "-", "config", "-q"],
        input=broken,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert bad.returncode != 0 and "shm_size" in bad.stderr


def test_plain_up_starts_triton_and_the_gateway_and_the_profile_adds_the_monitoring_stack():
    services = resolved()["services"]
    profiles = {name: tuple(s.get("profiles", ())) for name, s in services.items()}
    assert profiles == {
        "model-export": (),
        "triton": (),
        "gateway": (),
        "gpu-monitor": ("monitoring",),
        "prometheus": ("monitoring",),
        "grafana": ("monitoring",),
        "jaeger": ("monitoring",),
    }
    for name, service in services.items():
        if not profiles[name]:  # `docker compose up` fails if a default service depends on a profiled one
            assert all(not profiles[dep] for dep in service.get("depends_on", {})), name


def test_one_variable_sends_triton_and_the_gateway_traces_to_the_profiles_jaeger():
    services = resolved(OTEL_EXPORTER_OTLP_ENDPOINT="http://jaeger:4318")["services"]
    for name in ("triton", "gateway"):
        environment = services[name]["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
        assert environment["OTEL_SERVICE_NAME"] == "triton-embed", name
    assert all(not v for k, v in resolved()["services"]["triton"]["environment"].items() if k.endswith("ENDPOINT"))
    jaeger = services["jaeger"]
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert jaeger["ports"] == ["127.0.0.1:16686:16686/tcp"]  # its UI, this machine only; OTLP stays inside


def test_gateway_service_talks_grpc_to_triton_once_it_is_healthy():
    gateway = resolved()["services"]["gateway"]
    assert gateway["build"]["target"] == "gateway"
    assert "--triton=triton:8001" in gateway["command"] and "--host=0.0.0.0" in gateway["command"]
    assert gateway["depends_on"] == {"triton": {"condition": "service_healthy"}}
    assert gateway["ports"] == ["127.0.0.1:8080:8080/tcp"]  # this machine only, as Triton's ports


def test_triton_service():
    triton = resolved()["services"]["triton"]
    (gpu,) = triton["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"] and gpu["count"] == 1
    assert triton["build"]["target"] == "triton" and triton["build"]["dockerfile"] == "docker/Dockerfile"
    assert triton["depends_on"] == {"model-export": {"condition": "service_completed_successfully"}}
    assert triton["ipc"] == "shareable" and triton["init"] is True
    shm = re.fullmatch(r"(\d+)([kmg])b?", str(triton["shm_size"]).lower())
    assert (
        shm and int(shm.group(1)) * 1024 ** "kmg".index(shm.group(2)) >= 256 * 1024
    )  # KiB; Docker's default 64 MB runs out
    # loopback by default, as the embedded server; TRITON_BIND opens them deliberately
    assert sorted(triton["ports"]) == [f"127.0.0.1:{p}:{p}/tcp" for p in (8000, 8001, 8002)]
    opened = resolved(TRITON_BIND="0.0.0.0")["services"]["triton"]  # noqa: S104 - what the setting is for
    assert sorted(opened["ports"]) == [f"0.0.0.0:{p}:{p}/tcp" for p in (8000, 8001, 8002)]
    # the model repository: read-only in Triton, written only by the one-shot model-export from read-only configs
    assert triton["volumes"] == ["model-repository:/models:ro"]
    export = resolved()["services"]["model-export"]
    assert sorted(export["volumes"]) == sorted(
        [
            f"{ROOT / 'model_repository'}:/src/configs:ro",
            f"{ROOT / 'docker' / 'no-model'}:/src/model:ro",  # MODEL unset: the packaged model, nothing exported
            f"{ROOT / 'docker' / 'no-model'}:/src/models:ro",  # MODELS_DIR unset: no models beside it
            "model-repository:/models:rw",
        ]
    )
    assert export["build"]["target"] == "export" and export.get("restart") == "no"
    assert export["environment"] == {"MODEL": "", "MODELS": "", "PRECISION": ""}  # unset: the image's, as built
    listed = resolved(MODELS_DIR="/data/models", MODELS="multi=e5")["services"]["model-export"]
    assert "/data/models:/src/models:ro" in listed["volumes"] and listed["environment"]["MODELS"] == "multi=e5"
    # a failure at every start (a refused driver, a model that does not load) stops instead of looping
    assert triton["restart"] == "on-failure:5"
    health = triton["healthcheck"]
    # the ensemble's readiness: /v2/health/ready is 200 again while the ensemble drains (unloaded)
    assert health["test"][0] == "CMD" and "http://127.0.0.1:8000/v2/models/embed/ready" in " ".join(health["test"])
    assert health["start_period"] and health["retries"] >= 1
    command = triton["command"]
    assert "--model-repository=/models" in command and "--metrics-config=summary_latencies=true" in command
    # explicit only for the stub watchdog, which the entrypoint starts unless TRITON_EMBED_WATCH_STUBS=0
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    assert triton["environment"]["TRITON_EMBED_WATCH_STUBS"] == "1"
    off = resolved(TRITON_EMBED_WATCH_STUBS="0")["services"]["triton"]["environment"]
    assert off["TRITON_EMBED_WATCH_STUBS"] == "0"
    # `docker compose stop` waits for the entrypoint's drain, then tritonserver's exit timeout, before SIGKILL
    drain_s = int(triton["environment"]["TRITON_EMBED_DRAIN_TIMEOUT"])
    exit_s = int(next(a for a in command if a.startswith("--exit-timeout-secs=")).split("=")[1])
    assert drain_s == 30 and int(str(triton["stop_grace_period"]).removesuffix("s")) >= drain_s + exit_s


def test_model_setting_mounts_that_folder_read_only_for_the_export(tmp_path):
    export = resolved(MODEL=str(tmp_path))["services"]["model-export"]
    assert f"{tmp_path}:/src/model:ro" in export["volumes"] and export["environment"]["MODEL"] == str(tmp_path)
    relative = resolved(MODEL="./model_repository")["services"]["model-export"]  # relative to docker-compose.yml
    assert f"{ROOT / 'model_repository'}:/src/model:ro" in relative["volumes"]
    # the export image's command exports /src/model only when MODEL is set
    (cmd,) = [a for i, a in dockerfile_instructions() if i == "CMD" and "sync-model-repository" in a]
    assert "${MODEL:+/src/model}" in cmd
    assert (ROOT / "docker" / "no-model").is_dir() and not (ROOT / "docker" / "no-model" / "modules.json").exists()


@pytest.mark.parametrize(("setting", "config"), [(None, "gpu"), ("libtorch", "libtorch"), ("gpu", "gpu")])
def test_encoder_config_is_chosen_by_environment(setting, config):
    command = resolved(**({"ENCODER_CONFIG": setting} if setting else {}))["services"]["triton"]["command"]
    assert f"--model-config-name={config}" in command
    assert (ROOT / "model_repository" / "encoder" / "configs" / f"{config}.pbtxt").is_file()


def test_monitoring_services_point_at_each_other_and_at_files_that_exist():
    from triton_embed_monitor.cli import DEFAULT_PORT

    services = resolved()["services"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("/"):
                assert Path(source).exists(), f"{name} mounts {source}, which is not in the repository"
    monitor = services["gpu-monitor"]
    assert "--triton-metrics-url=http://triton:8002/metrics" in monitor["command"]
    assert f"--port={DEFAULT_PORT}" in monitor["command"] and monitor["restart"] == "on-failure"
    assert monitor["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    scrape = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape}
    assert targets == {"triton": ["triton:8002"], "gpu-monitor": [f"gpu-monitor:{DEFAULT_PORT}"]}
    # the Prometheus image is the release that tests this configuration here
    version = subprocess.run([tool("promtool"), "--version"], capture_output=True, text=True, check=True)
    release = re.search(r"version (\d+\.\d+\.\d+)", version.stdout + version.stderr).group(1)
    assert services["prometheus"]["image"] == f"prom/prometheus:v{release}"
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/triton-embed.yml").read_text())
    grafana = services["grafana"]
    assert f"{MONITORING / 'grafana/dashboards'}:{provider['providers'][0]['options']['path']}:ro" in grafana["volumes"]


# -- docker/Dockerfile -----------------------------------------------------------------------------------------
def pip_installs() -> list[list[str]]:
    """Arguments of every ``pip install`` in the Dockerfile's RUN lines (after ``install``)."""
    installs = []
    for instruction, args in dockerfile_instructions():
        if instruction == "RUN":
            for command in args.split("&&"):
                words = shlex.split(command)
                if "pip" in words and "install" in words:
                    installs.append(words[words.index("install") + 1 :])
    return installs


def test_dockerfile_pins_agree_with_the_lock_and_the_makefile():
    pins = lock_pins()
    makefile = (ROOT / "Makefile").read_text()
    for name in ("pip", "setuptools"):
        pins[name] = re.search(rf"\b{name}==([\w.]+)", makefile).group(1)
    pinned = re.findall(r"\b([A-Za-z][\w.-]*)==([\w.+]+)", DOCKERFILE.read_text())
    assert pinned, "the Dockerfile pins pip and setuptools at least"
    for name, version in pinned:
        assert pins.get(canonical(name)) == version, (
            f"Dockerfile {name}=={version}, project {pins.get(canonical(name))}"
        )
    installs = pip_installs()
    assert len(installs) >= 5
    for args in installs:
        if "-r" in args:  # the triton stage: the image lock, exact pins, nothing resolved in the build
            assert args[args.index("-r") + 1] == f"/tmp/{IMAGE_LOCK.name}" and "--no-deps" in args, args
            continue
        packages, skip_next = [], False
        for word in args:
            if skip_next or "$" in word:
                skip_next = False
                continue
            if word in ("-c", "--index-url", "--extra-index-url", "--constraint"):
                skip_next = True
            elif not word.startswith("-"):
                packages.append(word)
        if any("==" in p for p in packages):
            continue  # pip/setuptools themselves, checked above
        assert "-c" in args, f"pip install {args} does not take its versions from the lock"
        for package in packages:  # "." is the project: its own pins are checked by tests/test_pins.py
            name = re.sub(r"\[.*\]$", "", package)
            assert name == "." or canonical(name) in pins, f"{package} is installed but not locked"


def _closure(roots: list[str], python: str) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions ``roots`` need on ``python`` (markers evaluated for it), by canonical name."""
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    found, todo = {}, list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in found:
            continue
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.distribution(name)
            for text in found[name].requires or []:
                requirement = Requirement(text)
                if requirement.marker is None or requirement.marker.evaluate(env):
                    todo.append(requirement.name)
    return found


IMAGE_ROOTS = ["torch", "tokenizers", "numpy"]  # what python_backends/ import beyond the standard library
# Packages whose image version differs from requirements.lock on purpose, beside those whose locked version needs
# Python >= 3.11 (recomputed below from the installed packages' metadata).
IMAGE_OWN_VERSIONS = {
    "torch": "the release of Triton 24.10's libtorch (NGC_PYTORCH)",
    "sympy": "torch 2.5.0 requires sympy==1.13.1",
}


def test_image_lock_agrees_with_the_project_lock_and_the_images_libtorch():
    """The image lock differs from requirements.lock only where it must: torch (the image's libtorch release), what
    torch 2.5.0 pins, and packages whose locked version cannot install on the image's Python 3.10."""
    from packaging.specifiers import SpecifierSet

    project, image = lock_pins(), lock_pins(IMAGE_LOCK)
    assert set(IMAGE_ROOTS) <= set(image)
    assert image["torch"] == NGC_PYTORCH[NGC_RELEASE["2.51.0"]]
    needs_311 = {
        name
        for name, dist in _closure(IMAGE_ROOTS, "3.10").items()
        if name in project and not SpecifierSet(dist.metadata.get("Requires-Python") or "").contains("3.10.12")
    }
    differ = {name for name in image if name in project and image[name] != project[name]}
    assert differ == needs_311 | set(IMAGE_OWN_VERSIONS), differ ^ (needs_311 | set(IMAGE_OWN_VERSIONS))
    assert not needs_311 & set(IMAGE_ROOTS), "the packages our backends import keep their locked versions"
    # the same torch and CUDA libraries as the scratch venv that runs the exported model (libtorch compatibility)
    compat = lock_pins(ROOT / "tests" / "libtorch-24.10.lock")
    assert {n: v for n, v in compat.items() if n == "torch" or n.startswith("nvidia-")} == {
        n: v for n, v in image.items() if n == "torch" or n.startswith("nvidia-")
    }


def test_image_lock_is_exactly_what_pip_resolves_for_the_images_python(tmp_path):
    """pip (PyPI metadata only, nothing installed) resolves the image lock with dependencies for CPython 3.10 on
    manylinux x86_64, the Triton 24.10 image: nothing missing, nothing extra, no version moved."""
    platforms = ("manylinux_2_35_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--ignore-installed",
            "--report",
            str(report),
            "--python-version",
            "3.10",
            "--implementation",
            "cp",
            "--abi",
            "cp310",
            *(a for p in platforms for a in ("--platform", p)),
            "--only-binary=:all:",
            "--target",
            str(tmp_path / "t"),
            "-r",
            str(IMAGE_LOCK),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = {canonical(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}
    # pip evaluates dependency markers for the Python running it, not --python-version (torch adds setuptools for
    # 3.12 and later): keep what the lock's packages need on 3.10.
    needed, todo = set(), list(lock_pins(IMAGE_LOCK))
    while todo:
        name = todo.pop()
        if name in resolved and name not in needed:
            needed.add(name)
            todo += required_on_python_310(resolved[name].get("requires_dist", []))
    assert {n: resolved[n]["version"] for n in needed} == lock_pins(IMAGE_LOCK)


def required_on_python_310(requires_dist: list[str]) -> list[str]:
    """Names of the requirements (``Requires-Dist`` lines, no extras asked) that apply on CPython 3.10 Linux."""
    from packaging.requirements import Requirement

    on_310 = {"python_version": "3.10", "python_full_version": "3.10.12", "extra": ""}
    return [canonical(r.name) for r in map(Requirement, requires_dist) if r.marker is None or r.marker.evaluate(on_310)]


# Modules and names added to the standard library after Python 3.10 (the image's interpreter).
ADDED_AFTER_310 = {
    "tomllib",
    "wsgiref.types",
    "typing.Self",
    "typing.LiteralString",
    "typing.Never",
    "typing.assert_never",
    "typing.reveal_type",
    "enum.StrEnum",
    "datetime.UTC",
    "asyncio.TaskGroup",
    "asyncio.timeout",
    "typing.override",
    "itertools.batched",
}


IMAGE_PYTHON = [
    *sorted((ROOT / "python_backends").rglob("*.py")),
    *(ROOT / "server" / "triton_embed_server" / name for name in ("supervisor.py", "drain.py", "driver_check.py")),
]


@pytest.mark.parametrize("path", IMAGE_PYTHON, ids=lambda p: p.name)
def test_backends_are_python_310(path):
    """What runs on the image's python3 (3.10): the backends, the driver check, the stub watchdog and the drain."""
    tree = ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            used |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            used.add(f"{node.value.id}.{node.attr}")
    assert not used & ADDED_AFTER_310


def test_dockerfile_installs_every_backend_and_the_context_carries_what_it_copies():
    copies = [a.split() for i, a in dockerfile_instructions() if i == "COPY" and not a.startswith("--from")]
    backends = sorted(p.parent.name for p in (ROOT / "python_backends").glob("*/model.py"))
    for name in backends:
        assert [f"python_backends/{name}/", f"/opt/tritonserver/backends/{name}/"] in copies
    # the package both backends import, and nothing else beside the backends
    shared = sorted({p.parent.name for p in (ROOT / "python_backends").glob("*/*.py")} - set(backends))
    assert shared == ["triton_embed_protocol"]
    assert ["python_backends/triton_embed_protocol/", "/tmp/triton_embed_protocol/"] in copies
    configs = "".join(p.read_text() for p in ROOT.glob("model_repository/**/*.pbtxt"))
    assert set(re.findall(r'backend: "(\w+)"', configs)) == set(backends)
    patterns = [
        line.strip()
        for line in (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "send nothing by default (.venv alone is gigabytes)"
    for copy in copies:  # a COPY of a path the context lacks fails the build
        assert all((ROOT / src).exists() for src in copy[:-1]), copy
    sent = [p[1:] for p in patterns if p.startswith("!")]
    for source in {src.rstrip("/") for c in copies for src in c[:-1]}:
        assert any(source == s or source.startswith(f"{s}/") for s in sent), f"COPY {source}, left out of the context"
    assert "model_repository/*/1/*" in patterns  # a host-side export never reaches the image
    # the stub watchdog, where the entrypoint looks for it by default
    watchdog, drainer = "/opt/triton-embed/supervisor.py", "/opt/triton-embed/drain.py"
    assert ["server/triton_embed_server/supervisor.py", watchdog] in copies
    assert ["server/triton_embed_server/drain.py", drainer] in copies
    checker, tracer = "/opt/triton-embed/driver_check.py", "/opt/triton-embed/tracing.py"
    assert ["server/triton_embed_server/driver_check.py", checker] in copies
    assert ["server/triton_embed_server/tracing.py", tracer] in copies
    assert ["docker/requirements-triton.lock", f"/tmp/{IMAGE_LOCK.name}"] in copies
    entrypoint = (ROOT / "docker" / "triton-entrypoint.sh").read_text()
    assert f'driver_check="${{TRITON_EMBED_DRIVER_CHECK:-{checker}}}"' in entrypoint
    assert f'watchdog="${{TRITON_EMBED_WATCHDOG:-{watchdog}}}"' in entrypoint
    assert f'drainer="${{TRITON_EMBED_DRAIN:-{drainer}}}"' in entrypoint
    assert f'tracer="${{TRITON_EMBED_TRACING:-{tracer}}}"' in entrypoint


def test_the_monitor_image_install_carries_the_monitor(tmp_path):
    """The monitor image runs `pip install .[monitor]`: the built wheel must hold the package and its script."""
    for name in (
        "pyproject.toml",
        "README.md",
        "client",
        "server",
        "python_backends/triton_embed_protocol",
        "monitoring/triton_embed_monitor",
        "gateway/triton_embed_gateway",
    ):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "triton_embed_monitor/cli.py" in names and "triton_embed_monitor/__main__.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "triton-embed-monitor = triton_embed_monitor.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_entrypoint_locks_admin_apis_like_the_embedded_server():
    from triton_embed_server.embedded import ADMIN_HEADER, RESTRICTED_APIS

    script = str(ROOT / "docker" / "triton-entrypoint.sh")

    def run(**env: str) -> subprocess.CompletedProcess:
        # TRITONSERVER=echo prints the command line the entrypoint would exec
        return subprocess.run(
            ["bash", script, "--model-repository=/models"],
            env=entrypoint_env(TRITONSERVER="echo", **env),
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )

    given = run(TRITON_EMBED_ADMIN_KEY="s3cret-key")
    assert given.returncode == 0 and given.stdout.split() == [
        "--model-repository=/models",
        f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}=s3cret-key",
        f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}=s3cret-key",
    ]
    keys = []
    for _ in range(2):  # unset: a random key per start, so the admin APIs are closed to everyone
        done = run()
        assert done.returncode == 0 and "random key" in done.stderr
        keys.append(re.search(rf"--http-restricted-api=[^:]+:{ADMIN_HEADER}=(\S+)", done.stdout).group(1))
        assert f"{ADMIN_HEADER}={keys[-1]}" in done.stdout.split()[-1]
    assert keys[0] != keys[1] and all(len(k) >= 24 for k in keys)
    bad = run(TRITON_EMBED_ADMIN_KEY="has space")
    assert bad.returncode == 2 and "TRITON_EMBED_ADMIN_KEY" in bad.stderr
    # outside the image there is no watchdog script at the default path: said, not silent; 0 turns it off
    assert "no stub watchdog at /opt/triton-embed/supervisor.py" in given.stderr
    assert "no driver check at /opt/triton-embed/driver_check.py" in given.stderr
    assert "watchdog" not in run(TRITON_EMBED_ADMIN_KEY="k", TRITON_EMBED_WATCH_STUBS="0").stderr


@pytest.mark.parametrize("config", ["gpu", "libtorch"])
def test_entrypoint_refuses_a_gpu_config_without_a_usable_driver_before_tritonserver_starts(config):
    """No NVIDIA driver here: a GPU config stops at the driver check with one line and status 78; tritonserver
    (TRITONSERVER=echo prints its command line) never runs. The CPU configs pass through."""
    from triton_embed_server.driver_check import EXIT_REFUSED

    def run(name: str) -> subprocess.CompletedProcess:
        args = [f"--model-repository={ROOT / 'model_repository'}", f"--model-config-name={name}"]
        env = entrypoint_env(
            TRITONSERVER="echo",
            TRITON_EMBED_ADMIN_KEY="k",
            TRITON_EMBED_WATCH_STUBS="0",
            TRITON_EMBED_DRIVER_CHECK=str(ROOT / "server" / "triton_embed_server" / "driver_check.py"),
        )
        return subprocess.run(
            ["bash", str(ROOT / "docker" / "triton-entrypoint.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )

    refused = run(config)
    assert refused.returncode == EXIT_REFUSED and refused.stdout == "", refused
    (line,) = [ln for ln in refused.stderr.splitlines() if "ERROR" in ln]
    assert line.startswith(f"triton-embed: ERROR: config '{config}' runs encoder on a GPU, but no NVIDIA driver")
    cpu = run("cpu")
    assert cpu.returncode == 0 and cpu.stdout.startswith("--model-repository=")
    assert "config 'cpu' runs on the CPU: no NVIDIA driver check" in cpu.stderr


def test_the_entrypoints_drain_says_so_when_no_server_answers():
    """A stop before tritonserver is up: the drain says at once that it did not happen, not "did not drain within
    30 s" after 0.2 s."""
    from triton_embed_server.embedded import free_port

    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "server" / "triton_embed_server" / "drain.py"),
            "--http-port",
            str(free_port()),
            "--admin-header",
            "triton-embed-admin-key",
            "--timeout-s",
            "30",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={"TRITON_EMBED_ADMIN_KEY": "k"},
    )
    assert done.returncode == 0 and time.monotonic() - started < 10
    assert "triton-embed: no drain (could not read the repository index at 127.0.0.1:" in done.stderr, done.stderr
    assert "within 30 s" not in done.stderr


# -- Prometheus and the Grafana dashboard -------------------------------------------------------------------------
def test_promtool_accepts_the_config_and_the_rules_and_their_unit_tests():
    promtool = tool("promtool")
    for args in (
        ["check", "config", str(PROMETHEUS_YML)],  # loads alerts.yml too
        ["check", "rules", str(ALERTS_YML)],
        ["test", "rules", str(MONITORING / "prometheus" / "alerts_test.yml")],
    ):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, check=False, timeout=120)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
        assert "SUCCESS" in done.stdout + done.stderr


def test_metric_name_extraction():
    assert metric_names_in(
        'sum by (model) (rate(a_total{model=~"x|y"}[$__rate_interval]) + rate(b{q="0.99"}[1m])) / max(c) / 1000'
    ) == {"a_total", "b", "c"}


def test_dashboard_is_well_formed_and_covers_the_issue():
    dashboard = json.loads(DASHBOARD.read_text())
    provisioned = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = provisioned["datasources"][0]["uid"]
    panels = dashboard["panels"]
    assert dashboard["uid"] == "triton-embed" and len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid and panel["targets"] and panel["description"], panel["title"]
            assert all(t["datasource"]["uid"] == uid for t in panel["targets"])
    exprs = " ".join(t["expr"] for _, t in dashboard_targets())
    # one model or all at a time: the variable offers the ensembles Triton reports, none of their steps
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "model" and variable["multi"] and variable["includeAll"]
    assert "label_values(nv_inference_request_success, model)" in variable["definition"]
    reported = ["embed", "tokenizer", "encoder", "multi", "multi_tokenizer", "multi_encoder", "encoder_tokenizer"]
    keep = re.compile(variable["regex"].strip("/"))
    assert [name for name in reported if keep.fullmatch(name)] == ["embed", "multi"]
    assert '{model=~"$model"' in exprs and 'model="embed"' not in exprs
    for needed in (
        "nv_inference_request_success",  # request rate
        "triton_embed_shed_requests_total",  # refusals, what TritonEmbedShedding fires on
        'quantile="0.99"',  # p99
        "nv_inference_queue_duration_us",  # queue vs compute per step
        "nv_inference_compute_infer_duration_us",
        "nv_inference_exec_count",  # average batch
        "triton_embed_gpu_utilization_percent",
        "triton_embed_gpu_memory_used_bytes",
        "triton_embed_gpu_power_watts",
    ):
        assert needed in exprs, needed
