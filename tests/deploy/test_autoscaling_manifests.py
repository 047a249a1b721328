"""Autoscaling and the drain-safe scale-down (deployment/components/keda for the Deployment,
deployment/components/kserve-keda for the InferenceService): the custom resources match the
CRDs kept in deployment/ (KEDA's, KServe's), the scaler targets the server and queries
gauges of tgis's metric catalogue, both variants scale on the same numbers, the replica range
and the HPA's behaviour hold together with the pod's termination budget, and that budget
(preStop, then the drain, then the stop) fits terminationGracePeriodSeconds in every
kustomization that runs tgis."""

from __future__ import annotations

import copy
import inspect
import re
from typing import Any

import jsonschema
import pytest

from tests.deploy import crd_schemas
from tests.deploy.test_manifests import GPUS, Doc, env_of, of_kind, one, render, server_pod
from tgis.launcher.supervisor import Supervisor
from tgis.router import shutdown
from tgis.router.ops.metric_catalogue import CATALOGUE, Gauge
from tgis.shard_api.messages import DEFAULT_MAX_BATCH_SIZE

KEDA_CRDS = crd_schemas.DEPLOY_DIR / "components" / "keda" / "crds"
KSERVE_CRDS = crd_schemas.DEPLOY_DIR / "kserve" / "crds"
# The gauges a scaler may follow: requests queued and running (proposal 003's, which the
# endpoint picker reads too).
LOAD_GAUGES = {"tgi_queue_size", "tgi_batch_current_size"}
# What the pod may still need after the drain: the calls' last words, the servers' stop,
# then the shards' (the launcher kills a shard after this long).
STOP_TAIL_S = (
    shutdown.END_WAIT_S
    + shutdown.SERVER_STOP_S
    + inspect.signature(Supervisor).parameters["shard_stop_timeout"].default
)
# HPA's own default scale-down stabilisation: ours may only be longer.
HPA_DEFAULT_SCALE_DOWN_WINDOW_S = 300


@pytest.fixture(scope="module")
def keda() -> tuple[Doc, ...]:
    return render("overlays/autoscaling")


@pytest.fixture(scope="module")
def kserve_keda() -> tuple[Doc, ...]:
    return render("overlays/kserve-autoscaling")


def pre_stop_sleep_s(container: Doc) -> float:
    """The preStop hook's pause: `sleep N` (the image has coreutils' sleep)."""
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def metric_names(query: str) -> set[str]:
    return set(re.findall(r"\b(tgi_[a-z_]+)\{", query))


def catalogue_gauges() -> set[str]:
    return {m.name for m in CATALOGUE if isinstance(m, Gauge)}


def scaled_object_triggers(docs: tuple[Doc, ...]) -> dict[str, tuple[str, float]]:
    """trigger name -> (query, threshold per replica)."""
    triggers = {}
    for trigger in one(docs, "ScaledObject")["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        # AverageValue: desired replicas = ceil(query / threshold)
        assert trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert meta["ignoreNullValues"] == "false", "no series must not read as no load"
        triggers[trigger["name"]] = (meta["query"], float(meta["threshold"]))
    return triggers


def isvc_triggers(isvc: Doc) -> list[tuple[str, float]]:
    triggers = []
    for metric in isvc["spec"]["predictor"]["autoScaling"]["metrics"]:
        assert metric["type"] == "External"
        external = metric["external"]
        assert external["metric"]["backend"] == "prometheus"
        assert external["target"]["type"] == "Value"
        triggers.append((external["metric"]["query"], float(external["target"]["value"])))
    return triggers


def test_the_crds_are_the_releases_named_in_their_readme() -> None:
    for directory, release in ((KEDA_CRDS, "v2.20.2"), (KSERVE_CRDS, "v0.20.0")):
        readme = (directory / "README.md").read_text()
        files = sorted(directory.glob("*.yaml"))
        assert files
        for path in files:
            assert f"/blob/{release}/config/crd/" in readme and path.name in readme, path.name
        license_text = (directory / "LICENSE").read_text().split()
        assert license_text[:4] == ["Apache", "License", "Version", "2.0,"]
    assert crd_schemas.vendored_schemas().keys() >= {
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("serving.kserve.io/v1beta1", "InferenceService"),
        ("serving.kserve.io/v1alpha1", "ServingRuntime"),
    }


@pytest.mark.parametrize("kustomization", sorted(GPUS))
def test_termination_budget_fits_the_grace_period(kustomization: str) -> None:
    """Pod deletion: preStop (the pod still serves while the endpoints drop it), SIGTERM, the
    drain (SHUTDOWN_GRACE_PERIOD), the stop; all before the kubelet's SIGKILL."""
    docs = render(kustomization)
    pod, container = server_pod(docs)
    if of_kind(docs, "InferenceService"):
        predictor = one(docs, "InferenceService")["spec"]["predictor"]
        grace = predictor["terminationGracePeriodSeconds"]
        env = env_of(predictor["model"])
    else:
        grace = pod["terminationGracePeriodSeconds"]
        env = env_of(container)
    pause = pre_stop_sleep_s(container)
    drain = float(env["SHUTDOWN_GRACE_PERIOD"])
    assert 5 <= pause <= 30, "long enough for the endpoints to follow, short of the drain"
    assert pause + drain + STOP_TAIL_S < grace, (pause, drain, STOP_TAIL_S, grace)


def test_endpoint_picker_waits_as_long_as_the_servers() -> None:
    docs = render("gateway")
    epp = one(docs, "Deployment")["spec"]["template"]["spec"]
    server = one(render("base"), "Deployment")["spec"]["template"]["spec"]
    assert epp["terminationGracePeriodSeconds"] >= server["terminationGracePeriodSeconds"]


def test_scaled_object_targets_the_server_and_its_gauges(keda: tuple[Doc, ...]) -> None:
    scaled = one(keda, "ScaledObject")
    crd_schemas.validate(scaled)
    deployment = one(keda, "Deployment")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    # the queries select the ServiceMonitor's `service` label, the Service that it scrapes
    monitor = one(keda, "ServiceMonitor")
    service = one(keda, "Service")["metadata"]["name"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        one(keda, "Service")["metadata"]["labels"].items()
    )
    triggers = scaled_object_triggers(keda)
    assert set(triggers) == {"requests", "queue"}
    for query, threshold in triggers.values():
        names = metric_names(query)
        assert names and names <= LOAD_GAUGES <= catalogue_gauges(), names
        assert query.count(f'service="{service}"') == len(re.findall(r"\btgi_", query))
        assert query.startswith("sum("), "one value for the whole Deployment"
        assert threshold > 0
    assert metric_names(triggers["requests"][0]) == LOAD_GAUGES
    assert metric_names(triggers["queue"][0]) == {"tgi_queue_size"}


def test_replica_range_and_behaviour(keda: tuple[Doc, ...]) -> None:
    spec = one(keda, "ScaledObject")["spec"]
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"], "no scale to zero"
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    down, up = behavior["scaleDown"], behavior["scaleUp"]
    assert down["stabilizationWindowSeconds"] >= HPA_DEFAULT_SCALE_DOWN_WINDOW_S
    assert up["stabilizationWindowSeconds"] < down["stabilizationWindowSeconds"]
    grace = one(keda, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    (policy,) = down["policies"]
    assert policy == {"type": "Pods", "value": 1, "periodSeconds": policy["periodSeconds"]}
    assert policy["periodSeconds"] > grace, "one replica drains at a time"
    assert spec["pollingInterval"] <= 30
    # Requests per replica: below the batch's cap (a replica that reaches it queues the
    # rest, and the target would only ever be met with a queue); the queue's target below
    # that (it signals a full replica, not a busy one).
    _query, per_replica = scaled_object_triggers(keda)["requests"]
    _query, queued = scaled_object_triggers(keda)["queue"]
    assert 0 < queued < per_replica < DEFAULT_MAX_BATCH_SIZE


def test_inference_service_scales_like_the_deployment(
    kserve_keda: tuple[Doc, ...], keda: tuple[Doc, ...]
) -> None:
    isvc = one(kserve_keda, "InferenceService")
    crd_schemas.validate(isvc)
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/autoscalerClass"] == "keda"
    assert annotations["serving.kserve.io/deploymentMode"] in ("RawDeployment", "Standard")
    predictor = isvc["spec"]["predictor"]
    scaled = one(keda, "ScaledObject")["spec"]
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (
        scaled["minReplicaCount"],
        scaled["maxReplicaCount"],
    )
    pods = f'pod=~"{isvc["metadata"]["name"]}-predictor-.*"'
    ours = isvc_triggers(isvc)
    theirs = list(scaled_object_triggers(keda).values())
    assert [t for _q, t in ours] == [t for _q, t in theirs]
    for (query, _t), (deployment_query, _) in zip(ours, theirs, strict=True):
        assert query.count(pods) == len(re.findall(r"\btgi_", query))
        assert re.sub(r"\{[^}]*\}", "{}", query) == re.sub(r"\{[^}]*\}", "{}", deployment_query)
    behavior = predictor["autoScaling"]["behavior"]
    windows = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    for direction in ("scaleUp", "scaleDown"):
        assert (
            behavior[direction]["stabilizationWindowSeconds"]
            == windows[direction]["stabilizationWindowSeconds"]
        )
    # without the component the InferenceService stays at one replica
    plain = one(render("kserve"), "InferenceService")["spec"]["predictor"]
    assert (plain["minReplicas"], plain["maxReplicas"]) == (1, 1)
    assert "autoScaling" not in plain


def broken(doc: Doc, change: Any) -> Doc:
    doc = copy.deepcopy(doc)
    change(doc)
    return doc


@pytest.mark.parametrize(
    ("kustomization", "kind", "change"),
    [
        ("overlays/autoscaling", "ScaledObject", lambda d: d["spec"]["triggers"][0].pop("type")),
        ("overlays/autoscaling", "ScaledObject", lambda d: d["spec"].update(minReplicas=1)),
        ("overlays/autoscaling", "ScaledObject", lambda d: d["spec"]["scaleTargetRef"].clear()),
        (
            "overlays/kserve-autoscaling",
            "InferenceService",
            lambda d: d["spec"]["predictor"].update(scaleMetric="queue"),
        ),
        (
            "overlays/kserve-autoscaling",
            "InferenceService",
            lambda d: d["spec"]["predictor"]["autoScaling"]["metrics"][0].update(type="Pods"),
        ),
        (
            "overlays/kserve-autoscaling",
            "InferenceService",
            lambda d: d["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"].update(
                threshold="24"
            ),
        ),
        (
            "overlays/kserve-autoscaling",
            "ServingRuntime",
            lambda d: d["spec"]["containers"][0]["lifecycle"].update(preStart={}),
        ),
    ],
)
def test_the_vendored_schemas_reject_mistakes(kustomization: str, kind: str, change: Any) -> None:
    """The schema check can fail: a wrong field, a missing one, a value outside an enum."""
    doc = one(render(kustomization), kind)
    crd_schemas.validate(doc)
    with pytest.raises(jsonschema.ValidationError):
        crd_schemas.validate(broken(doc, change))
