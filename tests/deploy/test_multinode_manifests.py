"""deployment/multinode/: one model over two nodes as a LeaderWorkerSet. The LeaderWorkerSet
matches the CRD kept in deployment/multinode/crds/ (test_manifests.py runs that check on every
kustomization), each pod template is a valid Pod for Kubernetes' schemas, the two templates
form one group (the same settings, GPUs per pod times pods = NUM_SHARD, a failure recreating
the group), the Service reaches the leader only, and the real launcher, given each pod's
env and LWS's variables, runs that pod's share of the ranks (--dry-run)."""

from __future__ import annotations

import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy import crd_schemas
from tests.deploy.test_manifests import K8S_VERSIONS, Doc, assert_drain_fits, env_of, one, render
from tests.deploy.tools import DEPLOY_DIR, require_kubernetes_validate
from tests.launcher.helpers import clean_env
from tgis.embedded_model import MODEL_DIR
from tgis.launcher.local_process import BIN_DIR
from tgis.launcher.node_link import LINK_PORT_OFFSET

CRD_DIR = DEPLOY_DIR / "multinode" / "crds"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"  # LWS's label of each pod


@pytest.fixture(scope="module")
def docs() -> tuple[Doc, ...]:
    return render("multinode")


def templates(docs: tuple[Doc, ...]) -> dict[str, Doc]:
    group = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return {"leader": group["leaderTemplate"], "worker": group["workerTemplate"]}


def container(template: Doc) -> Doc:
    (server,) = template["spec"]["containers"]
    return dict(server)


def gpus(template: Doc) -> int:
    resources = container(template)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    return int(resources["limits"]["nvidia.com/gpu"])


def test_the_crd_is_the_release_named_in_its_readme() -> None:
    readme = (CRD_DIR / "README.md").read_text()
    (path,) = CRD_DIR.glob("*.yaml")
    assert f"`{path.name}`" in readme and "v0.10.0" in readme
    crd = crd_schemas.load_yaml(path.read_text())
    assert crd["spec"]["names"]["kind"] == "LeaderWorkerSet"
    assert (CRD_DIR / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_each_pod_template_is_a_valid_pod(docs: tuple[Doc, ...]) -> None:
    kubernetes_validate = require_kubernetes_validate()
    versions = [
        kubernetes_validate.utils.latest_version() if v == "latest" else v for v in K8S_VERSIONS
    ]
    for role, template in templates(docs).items():
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": role, **template["metadata"]},
        }
        pod["spec"] = template["spec"]
        for version in versions:
            kubernetes_validate.validate(pod, version, strict=True)


def test_the_two_templates_form_one_group(docs: tuple[Doc, ...]) -> None:
    group = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader, worker = templates(docs).values()
    # A lost rank ends every launcher of the group: LWS must restart the group as one.
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert env_of(container(leader)) == env_of(container(worker))
    env = env_of(container(leader))
    assert {"NNODES", "NODE_RANK", "MASTER_ADDR"}.isdisjoint(env), "LWS's variables give them"
    assert gpus(leader) == gpus(worker) > 0
    assert int(env["NUM_SHARD"]) == group["size"] * gpus(leader)
    for template in (leader, worker):
        assert_drain_fits(env, template["spec"]["terminationGracePeriodSeconds"])
    # A deleted worker keeps its ranks while the leader drains: the same grace period.
    assert (
        worker["spec"]["terminationGracePeriodSeconds"]
        == leader["spec"]["terminationGracePeriodSeconds"]
    )
    ports = {p["name"]: p["containerPort"] for p in container(leader)["ports"]}
    assert ports["rendezvous"] == int(env["MASTER_PORT"])
    assert ports["node-link"] == int(env["MASTER_PORT"]) + LINK_PORT_OFFSET
    assert "ports" not in container(worker) and "readinessProbe" not in container(worker)


def test_the_service_reaches_the_leader_only(docs: tuple[Doc, ...]) -> None:
    service = one(docs, "Service")
    leader, worker = templates(docs).values()
    selector: dict[str, Any] = service["spec"]["selector"]

    def selected(template: Doc, index: str) -> bool:
        labels = {**template["metadata"]["labels"], WORKER_INDEX: index}
        return selector.items() <= labels.items()

    assert selected(leader, "0") and not selected(worker, "1")
    ports = {p["name"]: p for p in container(leader)["ports"]}
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]]["containerPort"] == port["port"]


@pytest.mark.parametrize("index", [0, 1])
def test_the_launcher_runs_each_pods_share_of_the_ranks(docs: tuple[Doc, ...], index: int) -> None:
    template = list(templates(docs).values())[index]
    env = env_of(container(template))
    size = one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["size"]
    lws = {
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(index),
        "LWS_LEADER_ADDRESS": "tgis-multinode-0.tgis-multinode.default",
    }
    env["MODEL_NAME"] = str(MODEL_DIR) + "/"
    result = subprocess.run(
        [str(BIN_DIR / "text-generation-launcher"), "--dry-run"],
        env=clean_env({**env, **lws}),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    per_pod = gpus(template)
    ranks = range(index * per_pod, (index + 1) * per_pod)
    assert [line.split(":")[0] for line in lines if line.startswith("Shard ")] == [
        f"Shard {rank}" for rank in ranks
    ]
    assert any(line.startswith("Router:") for line in lines) == (index == 0)
    for line in lines:
        if line.startswith("Shard "):
            assert f"MASTER_ADDR={lws['LWS_LEADER_ADDRESS']}" in line
            assert f"WORLD_SIZE={env['NUM_SHARD']}" in line


def test_the_crd_schema_refuses_a_typo(docs: tuple[Doc, ...]) -> None:
    """The strict schema is in force: an unknown field in the group is refused."""
    lws = yaml.safe_load(yaml.safe_dump(one(docs, "LeaderWorkerSet")))
    crd_schemas.validate(lws)
    lws["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(jsonschema.ValidationError):
        crd_schemas.validate(lws)
