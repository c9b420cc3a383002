"""The Kubernetes manifests in deploy/k8s: valid against Kubernetes' own
schemas (kubernetes-validate, offline, strict: unknown fields fail), and the
gateway's arguments accepted by SMG's own parser."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from smg.launch_router import parse_router_args

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.32"


def documents():
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                yield f.name, doc


def test_every_manifest_is_valid_kubernetes():
    kinds = []
    for name, doc in documents():
        kubernetes_validate.validate(doc, VERSION, strict=True)
        kinds.append((name, doc["kind"]))
    assert ("siliceo.yaml", "Deployment") in kinds
    assert ("smg.yaml", "Deployment") in kinds
    assert ("smg.yaml", "Role") in kinds


def test_a_broken_manifest_is_caught():
    name, doc = next(d for d in documents() if d[1]["kind"] == "Deployment")
    doc["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_smg_accepts_the_gateway_arguments_and_finds_the_replicas():
    docs = dict(((n, d["kind"], d["metadata"]["name"]), d) for n, d in documents())
    smg = docs[("smg.yaml", "Deployment", "smg")]
    args = smg["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "launch"
    parsed = parse_router_args(
        [a.replace("$(POD_NAMESPACE)", "default") for a in args[1:]]
    )
    assert parsed.service_discovery
    assert parsed.policy == "cache_aware"
    # It selects the replicas' pods, on the port their HTTP API listens on.
    replicas = docs[("siliceo.yaml", "Deployment", "siliceo")]
    labels = replicas["spec"]["template"]["metadata"]["labels"]
    selector = parsed.selector  # parsed into {key: value}
    assert selector.items() <= labels.items()
    ports = replicas["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "http", "containerPort": parsed.service_discovery_port} in ports
