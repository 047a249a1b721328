"""Custom resources validated against the CRDs kept in deployment/ (verbatim from their
releases; the README beside each says which): the inference gateway's in gateway/crds/,
KServe's in kserve/crds/, KEDA's in components/keda/crds/, LeaderWorkerSet's in
multinode/crds/. Each version's openAPIV3Schema, made
strict the way kubernetes-validate's strict schemas are (an object that lists its
properties admits no other), through the validator kubernetes-validate uses
(jsonschema's Draft 2020-12). CEL rules (x-kubernetes-validations) are not evaluated.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import jsonschema
import yaml

from tests.deploy.tools import DEPLOY_DIR

CRD_DIR = DEPLOY_DIR / "gateway" / "crds"
# every folder of vendored CRDs (each with its README and LICENSE)
CRD_DIRS = (
    CRD_DIR,
    DEPLOY_DIR / "kserve" / "crds",
    DEPLOY_DIR / "components" / "keda" / "crds",
    DEPLOY_DIR / "multinode" / "crds",
)


def load_yaml(text: str) -> Any:
    """yaml.safe_load, through libyaml where PyYAML has it (KServe's InferenceService CRD
    is 2 MB: seconds in pure Python)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@cache
def vendored_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict schema of every served version of every CRD."""
    schemas = {}
    for path in sorted(p for d in CRD_DIRS for p in d.glob("*.yaml")):
        crd = load_yaml(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served", True):
                api_version = f"{spec['group']}/{version['name']}"
                schema = strict(version["schema"]["openAPIV3Schema"])
                schemas[api_version, spec["names"]["kind"]] = schema
    return schemas


def vendored_groups() -> tuple[str, ...]:
    """The API groups whose kinds are validated here, each as an apiVersion prefix."""
    return tuple(sorted({f"{api.split('/')[0]}/" for api, _ in vendored_schemas()}))


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy in which every object schema with ``properties`` and no other rule for
    unknown fields rejects them (what the API server's pruning would silently drop)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validate(doc: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` matches its kind's vendored
    schema; ``KeyError`` when no vendored CRD defines its apiVersion and kind."""
    schema = vendored_schemas()[doc["apiVersion"], doc["kind"]]
    jsonschema.validators.Draft202012Validator(schema).validate(doc)


def vendored_bundle_version(kind: str) -> str:
    """The release a vendored CRD comes from (its ``*/bundle-version`` annotation)."""
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            annotations = crd["metadata"]["annotations"]
            (version,) = [v for k, v in annotations.items() if k.endswith("/bundle-version")]
            return str(version)
    raise KeyError(kind)
