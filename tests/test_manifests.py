"""The Kubernetes examples that use other projects' resources, validated against those projects'
own definitions at the versions the examples name: the InferencePool and KEDA's ScaledObject
against their CRDs' OpenAPI schemas (strict: no field the CRD does not define), and the endpoint
picker's config against the plugin types and parameters the pinned picker registers. The CRDs come
from the Go module proxy (cached in Go's module cache); the core kinds are validated with
kubernetes-validate in the container stage (tests/container/images.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
INFERENCE_EXTENSION = ("sigs.k8s.io/gateway-api-inference-extension", "v1.4.0")
KEDA = ("github.com/kedacore/keda/v2", "v2.18.0")


def module(path: str, version: str) -> Path:
    if not shutil.which("go"):
        pytest.skip("no Go toolchain: the CRDs come from the Go module proxy")
    try:
        result = subprocess.run(["go", "mod", "download", "-json", f"{path}@{version}"], capture_output=True,
                                text=True, timeout=300, check=True)
    except (subprocess.SubprocessError, OSError) as error:
        pytest.skip(f"cannot download {path}@{version}: {error}")
    return Path(json.loads(result.stdout)["Dir"])


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def strict(schema):
    """additionalProperties: false wherever a CRD lists properties (kubeconform's --strict), so a
    misspelt field fails instead of being pruned by the API server."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_schema(crd_file: Path, version: str) -> dict:
    crd = documents(crd_file)[0]
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return strict(served["schema"]["openAPIV3Schema"])


def validate(resource: dict, crd_file: Path) -> None:
    version = resource["apiVersion"].split("/")[1]
    jsonschema.validate({k: v for k, v in resource.items() if k != "metadata"}, crd_schema(crd_file, version))


def test_the_inference_pool_matches_the_extension_s_crd():
    crds = module(*INFERENCE_EXTENSION) / "config" / "crd" / "bases"
    (pool,) = documents(K8S / "inference-extension" / "inferencepool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    crd = crds / "inference.networking.k8s.io_inferencepools.yaml"
    validate(pool, crd)
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: a misspelt field
        validate({**pool, "spec": {**pool["spec"], "targetPort": [{"number": 8080}]}}, crd)
    # The pool routes to (and the picker scrapes) the sidecar's HTTP port of deploy/k8s's pods.
    deployment = next(d for d in documents(K8S / "base" / "deployment.yaml") if d["kind"] == "Deployment")
    assert pool["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert pool["spec"]["targetPorts"][0]["number"] in ports


def test_the_pickers_config_names_registered_plugins_and_cy_llm_s_metrics():
    source = module(*INFERENCE_EXTENSION) / "pkg" / "epp"
    registered = set(re.findall(r'Type\s*=\s*"([a-z0-9-]+)"', "".join(
        p.read_text() for p in source.rglob("*.go") if not p.name.endswith("_test.go"))))
    config_map = next(d for d in documents(K8S / "inference-extension" / "epp.yaml") if d["kind"] == "ConfigMap")
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    types = {p["type"] for p in config["plugins"]}
    assert types <= registered, types - registered
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = {r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]}
    refs |= {s["pluginRef"] for s in config["data"]["sources"]}
    refs |= {e["pluginRef"] for s in config["data"]["sources"] for e in s["extractors"]}
    assert refs <= names
    # engineConfigs' keys are the pinned extractor's JSON fields; its metric names, the sidecar's.
    factories = (source / "framework" / "plugins" / "datalayer" / "extractor" / "metrics" / "factories.go").read_text()
    fields = set(re.findall(r'json:"([A-Za-z]+)"', factories))
    extractor = next(p for p in config["plugins"] if p["type"] == "model-server-protocol-metrics")["parameters"]
    assert set(extractor) <= fields
    (engine,) = extractor["engineConfigs"]
    assert set(engine) <= fields and extractor["defaultEngine"] == engine["name"]
    exported = (REPO / "sidecar" / "src" / "metrics.rs").read_text()
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        assert f'"{engine[key]}"' in exported, engine[key]


def test_the_scaled_object_matches_keda_s_crd():
    crd = module(*KEDA) / "config" / "crd" / "bases" / "keda.sh_scaledobjects.yaml"
    (scaled,) = documents(K8S / "autoscaling" / "scaledobject.yaml")
    validate(scaled, crd)
    with pytest.raises(jsonschema.ValidationError):
        validate({**scaled, "spec": {**scaled["spec"], "maxReplicas": 8}}, crd)
    assert scaled["spec"]["scaleTargetRef"]["name"] == "cy-llm"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "cyllm_pod_requests_waiting" in trigger["metadata"]["query"]
