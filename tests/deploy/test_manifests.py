"""deployment/: every kustomization rendered by the real `kubectl kustomize`, built-in kinds
validated against the Kubernetes schemas (kubernetes-validate, strict), the CRD kinds
(KServe ServingRuntime / InferenceService, Prometheus Operator ServiceMonitor) checked here,
those of KServe, KEDA and the inference gateway also against the CRDs kept in deployment/
(crd_schemas.py; test_gateway_manifests.py and test_autoscaling_manifests.py check their
contract),
and the contract of ../shared/spec/ecosystem.md: ports, names, annotations, probes, env,
volumes, GPUs per overlay, TLS. The manifests' command line and env also go through the
real launcher (--dry-run)."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import crd_schemas
from tests.deploy.tools import (
    DEPLOY_DIR,
    DOCKERFILE,
    key_values,
    parse_dockerfile,
    require_binary,
    require_kubernetes_validate,
)
from tests.launcher.helpers import clean_env
from tgis.embedded_model import MODEL_DIR
from tgis.launcher.cli import command as launcher_command
from tgis.launcher.local_process import BIN_DIR
from tgis.router import config as router_config

Doc = dict[str, Any]

KUSTOMIZATIONS = sorted(
    str(path.parent.relative_to(DEPLOY_DIR))
    for path in DEPLOY_DIR.rglob("kustomization.yaml")
    if yaml.safe_load(path.read_text()).get("kind") != "Component"
    and not path.parent.name.startswith(".")
)
COMPONENTS = sorted(p.parent.name for p in (DEPLOY_DIR / "components").glob("*/kustomization.yaml"))
# Building blocks that the others include, without a server of their own.
PARTS = {"storage", "gateway"}
# Servers that are no Deployment or ServingRuntime, with a contract test of their own.
OTHER_SERVERS = {"multinode"}  # a LeaderWorkerSet: test_multinode_manifests.py
# GPUs each kustomization with a server asks for (0: CPU only)
GPUS = {
    "base": 0,
    "kserve": 1,
    "overlays/gpu-1": 1,
    "overlays/gpu-2": 2,
    "overlays/gpu-8": 8,
    "overlays/kserve-gpu-2": 2,
    "overlays/kserve-gpu-8": 8,
    "overlays/tls": 1,
    "overlays/monitoring": 1,
    "overlays/autoscaling": 1,
    "overlays/kserve-autoscaling": 1,
}
# the variant without KServe
DEPLOYMENTS = sorted(k for k in GPUS if "kserve" not in k)
# Kubernetes versions validated against: OpenShift 4.14's and the newest the schemas know.
K8S_VERSIONS = ("1.27", "latest")
CRD_GROUPS = ("serving.kserve.io/", "monitoring.coreos.com/")
# env vars the manifests may set that are not launcher flags
OTHER_ENV = {"HF_HOME", "HF_HUB_OFFLINE", "HF_HUB_CACHE"}
HEALTH = "http://localhost:3000/health"


@cache
def render(kustomization: str) -> tuple[Doc, ...]:
    kubectl = require_binary("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY_DIR / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def of_kind(docs: tuple[Doc, ...], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: tuple[Doc, ...], kind: str) -> Doc:
    (doc,) = of_kind(docs, kind)
    return doc


def server_pod(docs: tuple[Doc, ...]) -> tuple[Doc, Doc]:
    """(pod spec, serving container) of the Deployment, or of the ServingRuntime."""
    if of_kind(docs, "Deployment"):
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
    else:
        pod = one(docs, "ServingRuntime")["spec"]
        (container,) = pod["containers"]
    return pod, container


def env_of(container: Doc) -> dict[str, str]:
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate env: {names}"
    return {e["name"]: e["value"] for e in container.get("env", [])}


def mounts_of(pod: Doc, container: Doc) -> dict[str, tuple[Doc, Doc]]:
    """mountPath -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container.get("volumeMounts", [])}


def assert_drain_fits(env: dict[str, str], termination_grace: int | None) -> None:
    """SIGTERM's drain (SHUTDOWN_GRACE_PERIOD, else the router's default) plus stopping the
    shards ends before the kubelet's SIGKILL (terminationGracePeriodSeconds, default 30)."""
    default = getattr(router_config, "DEFAULT_SHUTDOWN_GRACE_S", None)
    drain = float(env.get("SHUTDOWN_GRACE_PERIOD", default or 0))
    assert drain + 5 <= (termination_grace or 30), (drain, termination_grace)
    assert termination_grace is None or drain >= 60, "long streams get a minute at least"


def launcher_env_vars() -> set[str]:
    names: set[str] = set()
    for param in launcher_command.params:
        envvar = param.envvar
        names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


@pytest.fixture(params=KUSTOMIZATIONS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, tuple[Doc, ...]]:
    return request.param, render(request.param)


@pytest.fixture(params=sorted(GPUS))
def server(request: pytest.FixtureRequest) -> tuple[str, tuple[Doc, ...]]:
    """The kustomizations that run tgis (a Deployment or a ServingRuntime)."""
    return request.param, render(request.param)


def test_every_kustomization_is_known_and_every_component_used() -> None:
    assert set(KUSTOMIZATIONS) == set(GPUS) | PARTS | OTHER_SERVERS
    used: set[str] = set()
    for kustomization in KUSTOMIZATIONS:
        spec = yaml.safe_load((DEPLOY_DIR / kustomization / "kustomization.yaml").read_text())
        used.update(Path(c).name for c in spec.get("components", []))
    assert used == set(COMPONENTS)


def test_builtin_kinds_match_the_kubernetes_schemas(rendered: tuple[str, tuple[Doc, ...]]):
    kubernetes_validate = require_kubernetes_validate()
    name, docs = rendered
    versions = [
        kubernetes_validate.utils.latest_version() if v == "latest" else v for v in K8S_VERSIONS
    ]
    for doc in docs:
        if doc["apiVersion"].startswith(CRD_GROUPS + crd_schemas.vendored_groups()):
            continue
        for version in versions:
            error = None
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                error = f"{name}: {doc['kind']} {where}: {e.message} (Kubernetes {version})"
            assert error is None, error


def test_crd_kinds_are_known_and_well_formed(rendered: tuple[str, tuple[Doc, ...]]) -> None:
    _name, docs = rendered
    checks = {
        ("serving.kserve.io/v1alpha1", "ServingRuntime"): check_serving_runtime,
        ("serving.kserve.io/v1beta1", "InferenceService"): check_inference_service,
        ("monitoring.coreos.com/v1", "ServiceMonitor"): check_service_monitor,
    }
    for doc in docs:
        vendored = doc["apiVersion"].startswith(crd_schemas.vendored_groups())
        if vendored:
            crd_schemas.validate(doc)  # raises jsonschema.ValidationError
        if (doc["apiVersion"], doc["kind"]) in checks:
            assert doc["metadata"]["name"]
            checks[doc["apiVersion"], doc["kind"]](doc, docs)
        else:
            assert vendored or not doc["apiVersion"].startswith(CRD_GROUPS), doc["kind"]


def check_serving_runtime(runtime: Doc, docs: tuple[Doc, ...]) -> None:
    """OpenShift AI's TGIS runtime contract (ecosystem.md §1.2, §1.6, §7)."""
    assert runtime["metadata"]["name"] == "tgis-grpc-runtime"
    assert runtime["metadata"]["annotations"]["opendatahub.io/apiProtocol"] == "gRPC"
    assert runtime["metadata"]["labels"]["opendatahub.io/dashboard"] == "true"
    spec = runtime["spec"]
    assert spec["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "3000",
        "prometheus.io/path": "/metrics",
        "opendatahub.io/kserve-runtime": "tgis",
    }
    assert spec["multiModel"] is False
    assert {"name": "pytorch", "autoSelect": True} in spec["supportedModelFormats"]
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"
    assert container["command"] == ["text-generation-launcher"]
    assert {"--model-name=/mnt/models/", "--port=3000", "--grpc-port=8033"} <= set(
        container["args"]
    )
    # Knative takes one port: gRPC, named h2c; 3000 is reached inside the pod only
    assert container["ports"] == [{"name": "h2c", "containerPort": 8033, "protocol": "TCP"}]
    assert_drain_fits(env_of(container), None)  # whatever the InferenceService sets
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[0] == "curl" and "--fail" in command and command[-1] == HEALTH, probe
        assert container[probe]["timeoutSeconds"] > int(command[command.index("--max-time") + 1])


def check_inference_service(isvc: Doc, docs: tuple[Doc, ...]) -> None:
    predictor = isvc["spec"]["predictor"]
    model = predictor["model"]
    runtime = one(docs, "ServingRuntime")
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = [f["name"] for f in runtime["spec"]["supportedModelFormats"]]
    assert model["modelFormat"]["name"] in formats
    claim = model["storageUri"].removeprefix("pvc://").split("/")[0]
    assert claim in [p["metadata"]["name"] for p in of_kind(docs, "PersistentVolumeClaim")]
    assert_drain_fits(env_of(model), predictor["terminationGracePeriodSeconds"])
    for section in ("requests", "limits"):
        assert {"cpu", "memory", "nvidia.com/gpu"} <= set(model["resources"][section])


def check_service_monitor(monitor: Doc, docs: tuple[Doc, ...]) -> None:
    spec = monitor["spec"]
    services = [
        s
        for s in of_kind(docs, "Service")
        if spec["selector"]["matchLabels"].items() <= s["metadata"].get("labels", {}).items()
    ]
    assert len(services) == 1, "the ServiceMonitor selects exactly one Service"
    ports = {p["name"]: p["port"] for p in services[0]["spec"]["ports"]}
    assert spec["endpoints"], "no endpoints"
    for endpoint in spec["endpoints"]:
        assert ports[endpoint["port"]] == 3000
        assert endpoint["path"] == "/metrics" and endpoint.get("scheme", "http") == "http"


def test_pod_security_and_writable_paths(server: tuple[str, tuple[Doc, ...]]) -> None:
    """Read-only root: every path the image writes (Dockerfile ENV) is on an emptyDir."""
    _name, docs = server
    pod, container = server_pod(docs)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security.get("runAsNonRoot") or pod.get("securityContext", {}).get("runAsNonRoot")
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    mounts = mounts_of(pod, container)
    writable = [
        path for path, (m, v) in mounts.items() if "emptyDir" in v and not m.get("readOnly")
    ]
    image_env = {}
    instructions = parse_dockerfile(DOCKERFILE.read_text())
    for instruction in instructions:
        if instruction.keyword == "ENV" and instruction.stage == instructions[-1].stage:
            image_env.update(key_values(instruction.args))
    env = {**image_env, **env_of(container)}
    for var in ("HOME", "TMPDIR", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        assert any(env[var] == w or env[var].startswith(w + "/") for w in writable), var
    assert env["HF_HUB_OFFLINE"] == "1"
    shm = mounts["/dev/shm"][1]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]


def test_env_names_are_launcher_settings(server: tuple[str, tuple[Doc, ...]]) -> None:
    _name, docs = server
    known = launcher_env_vars() | OTHER_ENV
    containers = [server_pod(docs)[1]] + [
        isvc["spec"]["predictor"]["model"] for isvc in of_kind(docs, "InferenceService")
    ]
    for container in containers:
        assert set(env_of(container)) <= known, set(env_of(container)) - known


@pytest.mark.parametrize("kustomization", DEPLOYMENTS)
def test_deployment_and_service(kustomization: str) -> None:
    """The variant without KServe: TGIS's ports, probes on /health, the model PVC read-only."""
    docs = render(kustomization)
    deployment = one(docs, "Deployment")
    template = deployment["spec"]["template"]
    pod, container = server_pod(docs)
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "3000",
        "prometheus.io/path": "/metrics",
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 8033, "http": 3000}
    env = env_of(container)
    assert (env["PORT"], env["GRPC_PORT"]) == ("3000", "8033")
    assert env["MODEL_NAME"].startswith("/mnt/models/")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and ports[get["port"]] == 3000, probe
    assert_drain_fits(env, pod["terminationGracePeriodSeconds"])
    model_mount, model_volume = mounts_of(pod, container)["/mnt/models"]
    assert model_mount["readOnly"] is True
    claim = model_volume["persistentVolumeClaim"]["claimName"]
    assert claim in [p["metadata"]["name"] for p in of_kind(docs, "PersistentVolumeClaim")]
    for section in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][section])
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert service_ports == {"grpc": (8033, "grpc"), "http": (3000, "http")}


@pytest.mark.parametrize("kustomization", sorted(GPUS))
def test_gpus_and_shards(kustomization: str) -> None:
    docs = render(kustomization)
    gpus = GPUS[kustomization]
    containers = [server_pod(docs)[1]] if of_kind(docs, "Deployment") else []
    containers += [isvc["spec"]["predictor"]["model"] for isvc in of_kind(docs, "InferenceService")]
    assert containers
    for container in containers:
        resources = container["resources"]
        for section in ("requests", "limits"):
            assert resources[section].get("nvidia.com/gpu", "0") == str(gpus), section
        assert env_of(container).get("NUM_SHARD") == (str(gpus) if gpus else None)


def test_tls_overlay() -> None:
    """Cert, key and client CA from mounted Secrets (whole directories, so rotated files show
    up in place), TLS_* env as the launcher names it, probes still on plain HTTP 3000."""
    docs = render("overlays/tls")
    pod, container = server_pod(docs)
    env = env_of(container)
    tls_vars = ("TLS_CERT_PATH", "TLS_KEY_PATH", "TLS_CLIENT_CA_CERT_PATH")
    assert set(tls_vars) <= launcher_env_vars()
    secrets = {}
    for var in tls_vars:
        path = Path(env[var])
        mount, volume = mounts_of(pod, container)[str(path.parent)]
        assert mount["readOnly"] is True and "subPath" not in mount, var
        secrets[var] = (volume["secret"]["secretName"], path.name)
    assert secrets == {
        "TLS_CERT_PATH": ("tgis-tls", "tls.crt"),
        "TLS_KEY_PATH": ("tgis-tls", "tls.key"),
        "TLS_CLIENT_CA_CERT_PATH": ("tgis-client-ca", "ca.crt"),
    }
    annotations = one(docs, "Service")["metadata"]["annotations"]
    assert annotations["service.beta.openshift.io/serving-cert-secret-name"] == "tgis-tls"
    assert container["readinessProbe"]["httpGet"]["port"] == "http"
    assert not set(tls_vars) & set(env_of(server_pod(render("overlays/gpu-1"))[1]))


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    """A real certificate, key and CA under the Secret's file names (the launcher checks
    they form a usable pair before anything starts, --dry-run included)."""
    from tests.e2e.certs import make_pki

    pki = make_pki(tmp_path / "pki")
    return {
        "tls.crt": str(pki.server_cert),
        "tls.key": str(pki.server_key),
        "ca.crt": str(pki.ca_cert),
    }


@pytest.mark.parametrize("kustomization", ["kserve", "overlays/gpu-2", "overlays/tls"])
def test_launcher_accepts_the_manifests_settings(
    kustomization: str, tls_files: dict[str, str]
) -> None:
    """The container's command, args and env through the real launcher (--dry-run), with
    the model and certificate paths moved to local files."""
    _pod, container = server_pod(render(kustomization))

    def local(value: str) -> str:
        if value.startswith("/mnt/models/"):
            return str(MODEL_DIR) + "/"
        if value.startswith("/etc/tgis/"):
            return tls_files[Path(value).name]
        return value

    argv = [str(BIN_DIR / "text-generation-launcher")]
    argv += [
        a.split("=", 1)[0] + "=" + local(a.split("=", 1)[1]) for a in container.get("args", [])
    ]
    env = clean_env({name: local(value) for name, value in env_of(container).items()})
    result = subprocess.run(
        [*argv, "--dry-run"], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    shards = [line for line in result.stdout.splitlines() if line.startswith("Shard ")]
    assert len(shards) == max(GPUS[kustomization], 1), result.stdout
