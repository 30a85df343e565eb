"""The KubeRay manifests in configs/ against KubeRay's own RayService CRD, and their Serve config against ours.

tests/data/ray.io_rayservices.yaml.gz is KubeRay's CRD, unchanged (gzipped):
github.com/ray-project/kuberay, tag v1.7.0 (commit 59d663aeec13760646da3db9c1cf8cfe883e30b7),
ray-operator/config/crd/bases/ray.io_rayservices.yaml, sha256 of the YAML
0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab.

Its ``openAPIV3Schema`` is validated with jsonschema, read as the API server reads it: a field that the
schema does not declare is an error (kubectl's default strict field validation) unless the schema says
``x-kubernetes-preserve-unknown-fields``; ``nullable`` admits null; list-map keys are unique. CEL rules
(``x-kubernetes-validations``) are not evaluated: the CRD's only ones are about updates and ``managedBy``.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import pathlib
import re
from typing import Any

import jsonschema
import pytest
import yaml

from app.config import AppConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD = ROOT / "tests" / "data" / "ray.io_rayservices.yaml.gz"
CRD_SHA256 = "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab"
MANIFESTS = {
    "configs/kuberay-rayservice.yaml": "configs/smollm2-cpu.yaml",
    "configs/ray-cluster-gpu.yaml": "configs/gpu-example.yaml",
}
WORKER_CONTAINER = "spec.rayClusterConfig.workerGroupSpecs.0.template.spec.containers.0"
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def kube_schema(node: Any) -> Any:
    """A structural schema as JSON Schema: undeclared fields rejected, ``nullable`` as a null type."""
    if isinstance(node, list):
        return [kube_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: kube_schema(value) for key, value in node.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _unique_list_map_keys(validator, keys, instance, schema):
    """``x-kubernetes-list-type: map``: no two items share the values of ``x-kubernetes-list-map-keys``."""
    if not validator.is_type(instance, "array"):
        return
    seen = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(repr(item.get(name)) for name in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate entry for list-map keys {keys}: {item!r}")
            seen.add(key)


KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"x-kubernetes-list-map-keys": _unique_list_map_keys}
)


@pytest.fixture(scope="module")
def crd_bytes() -> bytes:
    return gzip.decompress(CRD.read_bytes())


@pytest.fixture(scope="module")
def validator(crd_bytes) -> jsonschema.protocols.Validator:
    crd = yaml.load(crd_bytes, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: ~10x faster on 1 MB
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    schema = kube_schema(v1["schema"]["openAPIV3Schema"])
    KubeValidator.check_schema(schema)
    return KubeValidator(schema)


def load(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def errors(validator, manifest: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def test_vendored_crd_is_kuberays_file(crd_bytes):
    assert hashlib.sha256(crd_bytes).hexdigest() == CRD_SHA256


@pytest.mark.parametrize("path", MANIFESTS)
def test_manifest_matches_the_rayservice_crd(validator, path):
    manifest = load(path)
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert DNS_1123_SUBDOMAIN.match(manifest["metadata"]["name"])
    assert errors(validator, manifest) == []


@pytest.mark.parametrize("path", MANIFESTS)
def test_manifest_runs_the_projects_application(path):
    """serveConfigV2 is Serve YAML whose one application is build_app on the named config, and those
    args build an AppConfig exactly as build_app would."""
    manifest = load(path)
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": 8000}  # reachable through the pod's port
    (application,) = serve_config["applications"]
    shipped = load("serve_config.yaml")["applications"][0]
    for key in ("name", "route_prefix", "import_path"):
        assert application[key] == shipped[key]
    assert application["args"] == {"config": MANIFESTS[path]}
    config = AppConfig.from_args(copy.deepcopy(application["args"]))
    assert config.models, path

    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [group["template"]["spec"]["containers"][0] for group in cluster["workerGroupSpecs"]]
    for container in containers:
        assert {"containerPort": 8000, "name": "serve"} in container["ports"]
    # Every replica fits on some worker pod (the head has num-cpus 0), as Ray counts the pod (rayStartParams first).
    groups = cluster["workerGroupSpecs"]
    workers = [group["template"]["spec"]["containers"][0]["resources"]["limits"] for group in groups]
    cpus = [float(group["rayStartParams"].get("num-cpus", limits["cpu"])) for group, limits in zip(groups, workers)]
    for served in config.models:
        gpus = served.replica.num_gpus if served.replica.num_gpus is not None else int(served.model.device == "cuda")
        assert any(
            pod_cpus >= served.replica.num_cpus and int(limits.get("nvidia.com/gpu", 0)) >= gpus
            for pod_cpus, limits in zip(cpus, workers)
        ), served.model.name
    # A group that may grow is grown by the autoscaler, which the manifest turns on.
    assert cluster.get("enableInTreeAutoscaling") or all(g["maxReplicas"] == g["replicas"] for g in groups)
    # The GPU groups' pods, at their most, hold every model's replicas at their most (one replica per GPU).
    gpu_pods = sum(group["maxReplicas"] * int(limits.get("nvidia.com/gpu", 0)) for group, limits in zip(groups, workers))
    gpu_replicas = sum(_most_replicas(served) * (served.replica.num_gpus or int(served.model.device == "cuda"))
                       for served in config.models)
    assert gpu_pods >= gpu_replicas, (gpu_pods, gpu_replicas)


def _most_replicas(served) -> int:
    replica = served.replica
    return (replica.autoscaling_config or {}).get("max_replicas", 1) if replica.num_replicas == "auto" else replica.num_replicas


def _set(manifest: dict, path: str, value: Any) -> dict:
    broken = copy.deepcopy(manifest)
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
    node = broken
    for part in parents:
        node = node[part]
    node[last] = value
    return broken


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("spec.serveConfigV2", {"applications": []}, "is not of type 'string'"),  # YAML not in a block scalar
        ("spec.rayClusterConfig.workerGroupSpecs.0.replicas", "1", "is not of type 'integer'"),
        ("spec.rayClusterConfig.headGroupSpec.rayStartParams", {"num-cpus": 0}, "is not of type 'string'"),
        (f"{WORKER_CONTAINER}.resources.limits.cpu", "2 cores", "does not match"),  # not a quantity
        ("spec.rayClusterConfig.workerGroupSpecs.0.groupname", "cpu", "Additional properties"),  # a misspelt field
        (f"{WORKER_CONTAINER}.image", None, "is not of type 'string'"),
        ("spec.rayClusterConfig.authOptions", {"mode": "on"}, "is not one of"),
    ],
)
def test_a_broken_manifest_fails(validator, path, value, expected):
    manifest = load("configs/kuberay-rayservice.yaml")
    found = errors(validator, _set(manifest, path, value))
    assert found and any(expected in error for error in found), found


def test_missing_required_and_duplicate_keys_fail(validator):
    manifest = load("configs/kuberay-rayservice.yaml")
    no_group_name = copy.deepcopy(manifest)
    del no_group_name["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    assert any("'groupName' is a required property" in e for e in errors(validator, no_group_name))
    twice = copy.deepcopy(manifest)
    containers = twice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    containers.append(copy.deepcopy(containers[0]))  # two containers named ray-head
    assert any("duplicate entry" in e for e in errors(validator, twice))
