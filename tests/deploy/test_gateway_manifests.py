"""deployment/gateway/: tgis behind the Gateway API Inference Extension. Its custom resources
match the CRDs kept in deployment/gateway/crds/ (crd_schemas.py; test_manifests.py runs the
same check on every kustomization), and they fit together and with tgis: the pool selects
the server pods of ../overlays/gpu-1 at their HTTP port, the endpoint picker's metric flags
name gauges of tgis's metric catalogue with the labels the protocol gives them, and the
route, the objective and the rewrite refer to the pool."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy import crd_schemas
from tests.deploy.test_manifests import Doc, of_kind, one, render, server_pod
from tgis.router.ops.metric_catalogue import CATALOGUE, Gauge

# The endpoint picker's metric flag -> the labels the protocol's gauge has (proposal 003).
METRIC_FLAGS = {
    "--total-queued-requests-metric": (),
    "--total-running-requests-metric": (),
    "--kv-cache-usage-percentage-metric": (),
    "--cache-info-metric": ("block_size", "num_gpu_blocks"),
    "--lora-info-metric": ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
}
# The gauge each flag must name (their meaning is tested in tests/e2e/test_gateway_metrics_e2e.py).
GAUGE_OF_FLAG = {
    "--total-queued-requests-metric": "tgi_queue_size",
    "--total-running-requests-metric": "tgi_batch_current_size",
    "--kv-cache-usage-percentage-metric": "tgi_kv_cache_usage_ratio",
    "--cache-info-metric": "tgi_cache_config_info",
    "--lora-info-metric": "tgi_lora_requests_info",
}


@pytest.fixture(scope="module")
def gateway() -> tuple[Doc, ...]:
    return render("gateway")


def epp_args(docs: tuple[Doc, ...]) -> dict[str, str]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    args = dict(a.split("=", 1) for a in container["args"])
    assert len(args) == len(container["args"]), "every flag as --name=value, once"
    return args


def test_the_crds_are_the_releases_named_in_their_readme() -> None:
    readme = (crd_schemas.CRD_DIR / "README.md").read_text()
    for path in sorted(crd_schemas.CRD_DIR.glob("*.yaml")):
        assert path.name in readme, path.name
        annotations = yaml.safe_load(path.read_text())["metadata"]["annotations"]
        (bundle,) = [v for k, v in annotations.items() if k.endswith("/bundle-version")]
        assert bundle in readme, (path.name, bundle)
    license_text = (crd_schemas.CRD_DIR / "LICENSE").read_text().split()
    assert license_text[:4] == ["Apache", "License", "Version", "2.0,"]


def test_custom_resources_match_the_vendored_crds(gateway: tuple[Doc, ...]) -> None:
    kinds = set()
    for doc in gateway:
        if doc["apiVersion"].startswith(crd_schemas.vendored_groups()):
            crd_schemas.validate(doc)
            kinds.add(doc["kind"])
    assert kinds == {"InferencePool", "HTTPRoute", "InferenceObjective", "InferenceModelRewrite"}


@pytest.mark.parametrize(
    ("kind", "change"),
    [
        ("InferencePool", lambda d: d["spec"].pop("targetPorts")),
        ("InferencePool", lambda d: d["spec"].update(targetPortNumber=3000)),  # v1alpha2's
        ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].update(failureMode="Open")),
        ("HTTPRoute", lambda d: d["spec"]["rules"][0].update(backendRef={})),
        ("InferenceModelRewrite", lambda d: d["spec"]["rules"][0].update(targets=[])),
        ("InferenceObjective", lambda d: d["spec"].update(priority="high")),
    ],
)
def test_the_schemas_reject_broken_resources(
    gateway: tuple[Doc, ...], kind: str, change: Any
) -> None:
    """The check can fail: a missing field, an unknown one, a value out of its enum or
    type are each refused."""
    doc = yaml.safe_load(yaml.safe_dump(one(gateway, kind)))
    change(doc)
    with pytest.raises(jsonschema.ValidationError):
        crd_schemas.validate(doc)


def test_the_pool_selects_the_servers_at_their_http_port(gateway: tuple[Doc, ...]) -> None:
    servers = render("overlays/gpu-1")
    labels = one(servers, "Deployment")["spec"]["template"]["metadata"]["labels"]
    _pod, container = server_pod(servers)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    pool = one(gateway, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": ports["http"]}]
    # the picker runs in its own pods, which the pool must not select
    epp_labels = one(gateway, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not pool["spec"]["selector"]["matchLabels"].items() <= epp_labels.items()


def test_the_pool_reaches_its_endpoint_picker(gateway: tuple[Doc, ...]) -> None:
    pool = one(gateway, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(gateway, "Service")
    assert ref["name"] == service["metadata"]["name"]
    deployment = one(gateway, "Deployment")
    template = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service_ports = {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert container_ports[service_ports[ref["port"]["number"]]] == ref["port"]["number"]
    args = epp_args(gateway)
    assert args["--pool-name"] == pool["metadata"]["name"]
    assert args["--model-server-metrics-path"] == "/metrics"
    # the picker's release is the CRDs' (crds/README.md)
    bundle = crd_schemas.vendored_bundle_version("InferencePool")
    assert container["image"].endswith(f"/epp:{bundle}")


def test_the_metric_flags_name_tgis_gauges_with_the_protocols_labels(
    gateway: tuple[Doc, ...],
) -> None:
    args = epp_args(gateway)
    gauges = {spec.name: spec for spec in CATALOGUE if isinstance(spec, Gauge)}
    assert {flag: args[flag] for flag in METRIC_FLAGS} == GAUGE_OF_FLAG
    for flag, labels in METRIC_FLAGS.items():
        assert set(gauges[args[flag]].labels) == set(labels), flag


def test_the_picker_may_read_what_it_watches(gateway: tuple[Doc, ...]) -> None:
    deployment = one(gateway, "Deployment")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert account == one(gateway, "ServiceAccount")["metadata"]["name"]
    (binding,) = [b for b in of_kind(gateway, "RoleBinding") if b["roleRef"]["name"] == "tgis-epp"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    granted = {
        (group, resource)
        for rule in one(gateway, "Role")["rules"]
        if {"get", "list", "watch"} <= set(rule["verbs"])
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert {
        ("", "pods"),
        ("inference.networking.k8s.io", "inferencepools"),
        ("inference.networking.x-k8s.io", "inferenceobjectives"),
        ("inference.networking.x-k8s.io", "inferencemodelrewrites"),
    } <= granted


def test_route_objective_and_rewrite_refer_to_the_pool(gateway: tuple[Doc, ...]) -> None:
    pool = one(gateway, "InferencePool")["metadata"]["name"]
    route = one(gateway, "HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}
    ]
    for kind in ("InferenceObjective", "InferenceModelRewrite"):
        ref = one(gateway, kind)["spec"]["poolRef"]
        assert (ref["group"], ref["name"]) == ("inference.networking.k8s.io", pool), kind
    (rule,) = one(gateway, "InferenceModelRewrite")["spec"]["rules"]
    assert rule["matches"] == [{"model": {"type": "Exact", "value": "sql"}}]
    assert [t["modelRewrite"] for t in rule["targets"]] == ["sql-lora"]
