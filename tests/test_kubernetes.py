"""Kubernetes manifests (deploy/kubernetes): rendered and checked offline; no cluster runs them here.

* kubectl's Kustomize renders each overlay, and every object validates against Kubernetes' own schemas (PyPI
  kubernetes-validate, 1.30 and the newest it carries, unknown fields refused).
* The pod is compose's: the same images, tritonserver command line (through the image's entrypoint, which adds the
  admin-API lock), drain and model export, with probes on Triton's health endpoints, a drain that fits the grace
  period, a disruption budget, an autoscaler on the encoder's queue time and the prometheus-adapter rule that serves
  it (its query evaluated by promtool), a headless Service for gRPC, and a GPU only in the gpu overlay.

Without kubectl (or with one whose Kustomize is older than v5) the rendering tests skip with the reason.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import COMPOSE, ROOT, dockerfile_instructions, entrypoint_env, tool

KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("gpu", "cpu")
ADAPTER = KUBERNETES / "prometheus-adapter"
# the oldest release the manifests are for, and the newest the validator carries
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
HPA_METRIC = "triton_embed_encoder_queue_us_per_request"


def kubectl() -> str:
    """kubectl with a Kustomize of v5 or newer; skips the calling test (with the reason) otherwise."""
    path = shutil.which("kubectl")
    if not path:
        pytest.skip("kubectl not found: the Kubernetes manifests are not rendered (Debian 13's kubectl will do)")
    version = [path, "version", "--client", "-o", "json"]
    done = subprocess.run(version, capture_output=True, text=True, check=False, timeout=60)
    kustomize = json.loads(done.stdout or "{}").get("kustomizeVersion", "")
    major = re.match(r"v(\d+)\.", kustomize)
    if not major or int(major.group(1)) < 5:
        pytest.skip(f"kubectl's Kustomize is {kustomize or 'unknown'}; the manifests need v5 or newer")
    return path


@functools.cache
def _render(folder: str) -> str:
    done = subprocess.run([kubectl(), "kustomize", folder], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered(folder: Path) -> list[dict]:
    """The objects `kubectl kustomize FOLDER` renders (a fresh copy each call)."""
    return [doc for doc in yaml.safe_load_all(_render(str(folder))) if doc]


def objects(overlay: str) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in rendered(KUBERNETES / "overlays" / overlay)}


def pod_spec(overlay: str) -> dict:
    return objects(overlay)["Deployment", "triton-embed"]["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return found


def port_number(c: dict, port: int | str) -> int:
    """A probe's or Service's port (a number, or the name of one of the container's ports) as a number."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in c["ports"]], f"{c['name']} does not listen on {port}"
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return number


def env(c: dict) -> dict[str, dict | str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


def compose_service(name: str) -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"][name]


def quantity(text: str) -> float:
    """A Kubernetes or Docker size ("1Gi", "512Mi", "1gb", "4") in bytes (CPU: in cores)."""
    number, unit = re.fullmatch(r"([\d.]+)([A-Za-z]*)", str(text)).groups()
    units = {
        "": 1,
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "kb": 2**10,
        "mb": 2**20,
        "gb": 2**30,
    }
    return float(number) * units[unit]


def adapter_rules() -> list[dict]:
    return yaml.safe_load((ADAPTER / "config.yaml").read_text())["rules"]


# -- rendering and schemas ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_and_every_object_validates(overlay, version):
    found = objects(overlay)
    assert sorted(found) == [
        ("Deployment", "triton-embed"),
        ("HorizontalPodAutoscaler", "triton-embed"),
        ("PodDisruptionBudget", "triton-embed"),
        ("Service", "triton-embed"),
        ("Service", "triton-embed-grpc"),
    ]
    for obj in found.values():
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_refuses_what_a_cluster_would():
    deployment = objects("gpu")["Deployment", "triton-embed"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}  # misspelt field
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessprobe"):
        kubernetes_validate.validate(deployment, SCHEMA_VERSIONS[0], strict=True)
    hpa = objects("gpu")["HorizontalPodAutoscaler", "triton-embed"]
    hpa["spec"]["minReplicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, SCHEMA_VERSIONS[0], strict=True)


# -- the pod: compose's images, command line, lock and export ------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_runs_composes_images_and_tritonserver_command_line(overlay):
    spec = pod_spec(overlay)
    triton, gateway, export = (container(spec, n) for n in ("triton", "gateway", "model-export"))
    assert triton["image"] == compose_service("triton")["image"]
    assert gateway["image"] == compose_service("gateway")["image"]
    assert export["image"] == compose_service("model-export")["image"]
    # the image's entrypoint stays (driver check, admin lock, watchdog, drain): no `command` replaces it
    assert "command" not in triton and "command" not in gateway
    command = compose_service("triton")["command"]
    if overlay == "gpu":  # compose's default ENCODER_CONFIG
        expected = [a.replace("${ENCODER_CONFIG:-gpu}", "gpu") for a in command]
    else:  # each model's config.pbtxt: the CPU configs `make serve` runs
        expected = [a for a in command if not a.startswith("--model-config-name=")]
    assert sorted(triton["args"]) == sorted(expected)
    compose_env = compose_service("triton")["environment"]
    for name in ("TRITON_EMBED_WATCH_STUBS", "TRITON_EMBED_DRAIN_TIMEOUT"):
        assert env(triton)[name] == re.fullmatch(r"\$\{\w+:-(\w+)\}", compose_env[name]).group(1), name
    # the gateway as compose starts it, over gRPC to Triton in the same pod
    assert gateway["args"] == [
        a.replace("--triton=triton:8001", "--triton=127.0.0.1:8001") for a in compose_service("gateway")["command"]
    ]
    assert port_number(triton, "grpc") == 8001


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_admin_apis_stay_locked_with_the_key_from_a_secret(overlay):
    from triton_embed_server.embedded import ADMIN_HEADER, RESTRICTED_APIS

    found = objects(overlay)
    triton = container(pod_spec(overlay), "triton")
    key = env(triton)["TRITON_EMBED_ADMIN_KEY"]
    assert key == {"secretKeyRef": {"name": "triton-embed-admin", "key": "admin-key", "optional": False}}
    assert not [k for k in found if k[0] == "Secret"], "no key is shipped: the user creates the Secret"
    assert not [a for a in triton["args"] if "restricted" in a], "the entrypoint's lock is the only one"
    # the image's entrypoint with these arguments and environment (TRITONSERVER=echo prints its command line)
    settings = {k: v for k, v in env(triton).items() if isinstance(v, str)}
    done = subprocess.run(
        ["bash", str(ROOT / "docker" / "triton-entrypoint.sh"), *triton["args"]],
        env=entrypoint_env(**settings, TRITONSERVER="echo", TRITON_EMBED_ADMIN_KEY="from-the-secret"),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        *triton["args"],
        f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}=from-the-secret",
        f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}=from-the-secret",
    ]


def test_the_export_images_paths_are_where_the_init_container_looks():
    export = container(pod_spec("gpu"), "model-export")
    script, configs, artifacts, dest = export["command"]
    instructions = dockerfile_instructions()
    start = next(i for i, (k, a) in enumerate(instructions) if k == "FROM" and a.endswith(" AS export"))
    end = next(i for i in range(start + 1, len(instructions)) if instructions[i][0] == "FROM")
    stage = instructions[start:end]
    assert ("COPY", f"docker/sync-model-repository.sh /usr/local/bin/{script}") in stage
    # the configs the image was built with (WORKDIR /src), the model exported at build time
    assert ("COPY", "model_repository/ model_repository/") in stage and configs == "/src/model_repository"
    assert ("WORKDIR", "/src") in instructions
    (cmd,) = [a for k, a in stage if k == "CMD"]
    assert f" {artifacts} /models " in cmd and dest == "/models"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_init_container_exports_the_model_into_the_volume_triton_serves(overlay):
    spec = pod_spec(overlay)
    export, triton = container(spec, "model-export"), container(spec, "triton")
    assert [c["name"] for c in spec["initContainers"]] == ["model-export"]  # runs to exit 0 before any server
    dest = export["command"][-1]
    (written,) = [m for m in export["volumeMounts"] if m["mountPath"] == dest]
    assert not written.get("readOnly")
    served = [m for m in triton["volumeMounts"] if m["name"] == written["name"]]
    assert served == [
        {"name": written["name"], "mountPath": flag(triton["args"], "--model-repository"), "readOnly": True}
    ]
    (volume,) = [v for v in spec["volumes"] if v["name"] == written["name"]]
    assert "emptyDir" in volume  # each pod exports its own: nothing shared to go stale
    # the gateway reads it only to learn the models it routes to (--repository)
    gateway = container(spec, "gateway")
    assert [m for m in gateway["volumeMounts"] if m["name"] == written["name"]] == [
        {"name": written["name"], "mountPath": flag(gateway["args"], "--repository"), "readOnly": True}
    ]
    readers = {"triton", "gateway"}
    others = [m for c in spec["containers"] if c["name"] not in readers for m in c.get("volumeMounts", [])]
    assert not [m for m in others if m["name"] == written["name"]]
    # MODELS' folders come from a volume of their own, read-only
    (source,) = [m for m in export["volumeMounts"] if m["mountPath"] == "/src/models"]
    assert source["readOnly"] is True and {e["name"] for e in export["env"]} >= {"MODELS", "PRECISION"}


# -- health, drain, disruption, scaling ---------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_tritons_health_endpoints(overlay):
    spec = pod_spec(overlay)
    triton, gateway = container(spec, "triton"), container(spec, "gateway")
    paths = {
        p: (triton[p]["httpGet"]["path"], port_number(triton, triton[p]["httpGet"]["port"]))
        for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert paths == {
        # READY only once every step is loaded and warm, and false again while the ensemble drains
        "startupProbe": ("/v2/models/embed/ready", 8000),
        "readinessProbe": ("/v2/models/embed/ready", 8000),
        "livenessProbe": ("/v2/health/live", 8000),
    }
    startup = triton["startupProbe"]
    start_period = int(compose_service("triton")["healthcheck"]["start_period"].removesuffix("s"))
    assert startup["periodSeconds"] * startup["failureThreshold"] >= start_period  # the graph capture fits
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"  # Triton's model ready, asked over gRPC
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {port_number(gateway, gateway[p]["httpGet"]["port"]) for p in ("readinessProbe", "livenessProbe")} == {8080}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_terminating_pod_drains_within_its_grace_period(overlay):
    spec = pod_spec(overlay)
    sleeps = {}
    for c in spec["containers"]:
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", c["name"]
        sleeps[c["name"]] = int(command[1])
    assert sleeps["triton"] >= 5 and sleeps["gateway"] >= sleeps["triton"]  # the gateway outlives no request
    triton = container(spec, "triton")
    drain_s = int(env(triton)["TRITON_EMBED_DRAIN_TIMEOUT"])
    exit_s = int(flag(triton["args"], "--exit-timeout-secs"))
    assert drain_s > 0
    # the grace period counts from the start of preStop: sleep, then SIGTERM's drain, then tritonserver's exit
    assert spec["terminationGracePeriodSeconds"] >= sleeps["triton"] + drain_s + exit_s


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_disruption_budget_and_an_autoscaler_on_queue_time(overlay):
    found = objects(overlay)
    deployment = found["Deployment", "triton-embed"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = found["PodDisruptionBudget", "triton-embed"]
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    hpa = found["HorizontalPodAutoscaler", "triton-embed"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "triton-embed"}
    assert "replicas" not in deployment["spec"], "the HPA owns the count; apply would reset it"
    assert hpa["spec"]["minReplicas"] >= 2  # the budget can then evict one while another serves
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == HPA_METRIC
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert 0 < quantity(metric["pods"]["target"]["averageValue"]) < 200_000  # µs, below the 200 ms SLA
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 120


def test_the_adapter_rule_serves_the_autoscalers_metric():
    rendered_objects = rendered(ADAPTER)
    (configmap,) = rendered_objects
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(configmap, version, strict=True)
    assert yaml.safe_load(configmap["data"]["config.yaml"]) == {"rules": adapter_rules()}
    (rule,) = [r for r in adapter_rules() if r["name"]["as"] == HPA_METRIC]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert re.search(rule["name"]["matches"], "nv_inference_queue_duration_us")
    assert 'model="encoder"' in rule["seriesQuery"]


def test_the_adapter_query_is_the_encoders_queue_time_per_request(tmp_path):
    """promtool evaluates the rule's query, as prometheus-adapter fills it in for two pods, on given counters."""
    (rule,) = [r for r in adapter_rules() if r["name"]["as"] == HPA_METRIC]
    query = (
        rule["metricsQuery"]
        .replace("<<.GroupBy>>", "pod")
        .replace("<<.LabelMatchers>>", 'namespace="ns",pod=~"busy|idle"')
    )

    def series(name: str, model: str, pod: str, per_15s: int) -> dict:
        return {
            "series": f'{name}{{model="{model}",version="1",namespace="ns",pod="{pod}"}}',
            "values": f"0+{per_15s}x40",
        }

    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    # busy: 3 requests and 150 ms of encoder queue time every 15 s = 50 ms per request
                    series("nv_inference_queue_duration_us", "encoder", "busy", 150_000),
                    series("nv_inference_request_success", "encoder", "busy", 3),
                    # the ensemble's and the tokenizer's counters are not the encoder's queue
                    series("nv_inference_queue_duration_us", "embed", "busy", 9_000_000),
                    series("nv_inference_request_success", "embed", "busy", 1),
                    series("nv_inference_queue_duration_us", "tokenizer", "busy", 9_000_000),
                    # idle: no requests reads 0, not NaN
                    series("nv_inference_queue_duration_us", "encoder", "idle", 0),
                    series("nv_inference_request_success", "encoder", "idle", 0),
                ],
                "promql_expr_test": [
                    {
                        "expr": query,
                        "eval_time": "5m",
                        "exp_samples": [
                            {"labels": '{pod="busy"}', "value": 50_000},
                            {"labels": '{pod="idle"}', "value": 0},
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "adapter_test.yml").write_text(yaml.safe_dump(tests))
    done = subprocess.run(
        [tool("promtool"), "test", "rules", "adapter_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0 and "SUCCESS" in done.stdout + done.stderr, done.stdout + done.stderr


# -- Services and metrics -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_http_has_a_cluster_ip_and_grpc_a_headless_service(overlay):
    found = objects(overlay)
    spec = pod_spec(overlay)
    labels = found["Deployment", "triton-embed"]["spec"]["template"]["metadata"]["labels"]

    def targets(service: dict) -> dict[int, tuple[str, int]]:
        assert service["spec"]["selector"].items() <= labels.items()
        out = {}
        for port in service["spec"]["ports"]:
            owners = [
                c
                for c in spec["containers"]
                if any(port["targetPort"] in (p["name"], p["containerPort"]) for p in c["ports"])
            ]
            (owner,) = owners
            out[port["port"]] = (owner["name"], port_number(owner, port["targetPort"]))
        return out

    http, grpc = found["Service", "triton-embed"], found["Service", "triton-embed-grpc"]
    assert http["spec"].get("type", "ClusterIP") == "ClusterIP" and http["spec"].get("clusterIP") != "None"
    assert targets(http) == {8000: ("triton", 8000), 8080: ("gateway", 8080)}
    # headless: DNS answers each ready pod, so gRPC clients can balance calls, not one HTTP/2 connection
    assert grpc["spec"]["clusterIP"] == "None"
    assert targets(grpc) == {8001: ("triton", 8001)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_tritons_metrics_port(overlay):
    template = objects(overlay)["Deployment", "triton-embed"]["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port_number(container(template["spec"], "triton"), "metrics")


def test_the_podmonitor_component_scrapes_triton_and_the_gateway(tmp_path):
    root = os.path.relpath(KUBERNETES, tmp_path)  # Kustomize takes relative folders only
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [f"{root}/overlays/gpu"], "components": [f"{root}/components/podmonitor"]})
    )
    found = {(o["kind"], o["metadata"]["name"]): o for o in rendered(tmp_path)}
    assert ("PodMonitor", "triton-embed") in found and len(found) == len(objects("gpu")) + 1
    monitor = found["PodMonitor", "triton-embed"]
    template = found["Deployment", "triton-embed"]["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    ports = {p["name"]: c["name"] for c in template["spec"]["containers"] for p in c["ports"]}
    assert {ports[e["port"]] for e in monitor["spec"]["podMetricsEndpoints"]} == {"triton", "gateway"}
    # not in the default build: the schema check cannot know the operator's CRD
    assert "podmonitor" not in (KUBERNETES / "base" / "kustomization.yaml").read_text().lower().split("#")[0]


# -- resources and security -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_gpu_only_in_the_gpu_overlay_and_cpu_and_memory_in_both(overlay):
    spec = pod_spec(overlay)
    triton = container(spec, "triton")
    every = spec["initContainers"] + spec["containers"]
    if overlay == "gpu":
        assert int(triton["resources"]["limits"]["nvidia.com/gpu"]) == 1
        config = flag(triton["args"], "--model-config-name")
        assert (ROOT / "model_repository" / "encoder" / "configs" / f"{config}.pbtxt").is_file()
    else:
        assert not [c["name"] for c in every if "nvidia.com/gpu" in json.dumps(c.get("resources", {}))]
        assert not [a for a in triton["args"] if a.startswith("--model-config-name")]
        assert "KIND_CPU" in (ROOT / "model_repository" / "encoder" / "config.pbtxt").read_text()
    for c in every:  # requests = limits: Guaranteed QoS, so the static CPU manager can pin the encoder's cores
        resources = c["resources"]
        for kind in ("cpu", "memory"):
            assert quantity(resources["requests"][kind]) == quantity(resources["limits"][kind]) > 0, (c["name"], kind)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_init_container_exports_for_the_config_the_overlay_serves(overlay):
    """The image's artifact is fp16, for the GPU config: the gpu overlay serves it as built, the cpu overlay exports
    again at PRECISION=auto for the CPU (bf16 with native bf16, else fp32), as docker/sync-model-repository.sh reads."""
    env = {e["name"]: e["value"] for e in container(pod_spec(overlay), "model-export")["env"]}
    assert (env["PRECISION"], env.get("EXPORT_DEVICE", "gpu")) == (("", "gpu") if overlay == "gpu" else ("auto", "cpu"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_the_images_non_root_user_with_compose_shared_memory(overlay):
    spec = pod_spec(overlay)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    for c in spec["initContainers"] + spec["containers"]:
        security = c["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        assert not security.get("privileged") and "runAsUser" not in security, c["name"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False  # no TRITON_EMBED_* variables from a Service named triton-embed
    (shm,) = [m for m in container(spec, "triton")["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert quantity(volume["emptyDir"]["sizeLimit"]) >= quantity(compose_service("triton")["shm_size"])
