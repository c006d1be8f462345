"""infra/k8s: every manifest valid against Kubernetes' own schemas (offline, from kubernetes-validate), and
everything it names exists here: tabloop commands, settings, the objects it refers to."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from infra.kafka_broker import SEVERAL_WORKERS_JOIN_WAIT_MS
from tests.deploy_checks import check_settings_env, check_tabloop_command

K8S = Path(__file__).resolve().parent.parent / "infra" / "k8s"
# The oldest Kubernetes still supported upstream when this was written, and the newest the package knows.
VERSIONS = ["1.31.0", kubernetes_validate.latest_version()]
THIRD_PARTY = ("apache/kafka:", "clickhouse/clickhouse-server:", "vllm/vllm-openai:",
               "confluentinc/cp-schema-registry:")


def manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out.extend((path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return out


DOCS = manifests()
BY_KIND: dict[tuple[str, str], dict] = {(d["kind"], d["metadata"]["name"]): d for _, d in DOCS}


def pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def container_env(doc: dict, container: dict) -> dict[str, str]:
    env = {}
    for source in container.get("envFrom", []):
        env.update(BY_KIND[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "from-" + ",".join(item.get("valueFrom", {})))
    return env


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("index", range(len(DOCS)), ids=[f"{f}:{d['kind']}/{d['metadata']['name']}"
                                                          for f, d in DOCS])
def test_valid_against_the_kubernetes_schema(index, version):
    kubernetes_validate.validate(DOCS[index][1], version, strict=True)


def test_the_schema_check_catches_mistakes():
    serve = copy.deepcopy(BY_KIND[("Deployment", "serve")])
    serve["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] = 8081
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(serve, VERSIONS[-1], strict=True)
    serve = copy.deepcopy(BY_KIND[("Deployment", "serve")])
    serve["spec"]["replica"] = 2  # a typo: strict mode refuses unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(serve, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_file_but_the_optional_registry():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == present - {"schema-registry.yaml"}
    assert all(d["metadata"].get("namespace") == "tabloop" for _, d in DOCS if d["kind"] != "Namespace")


def test_every_image_command_and_setting_exists():
    commands = set()
    for _, doc in DOCS:
        spec = pod_spec(doc)
        if spec is None:
            continue
        for c in spec["containers"]:
            if c["image"].startswith("tabloop:"):
                commands.add(check_tabloop_command(c["args"]))
                check_settings_env(container_env(doc, c))
            else:
                assert c["image"].startswith(THIRD_PARTY), c["image"]
                assert not c["image"].endswith(":latest")
                assert not any(k.startswith("TABLOOP_") for k in container_env(doc, c))
    assert commands >= {"topics create", "serve", "streams", "train", "history"}


def test_services_select_pods_and_autoscalers_target_deployments():
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for _, d in DOCS
            if d["kind"] in ("Deployment", "StatefulSet")}
    for _, svc in DOCS:
        if svc["kind"] == "Service":
            assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pods.values()), svc
    targets = {d["spec"]["scaleTargetRef"]["name"] for _, d in DOCS if d["kind"] == "HorizontalPodAutoscaler"}
    assert targets == {"serve", "streams"}
    assert all(("Deployment", t) in BY_KIND for t in targets)
    assert BY_KIND[("HorizontalPodAutoscaler", "streams")]["spec"]["maxReplicas"] <= int(
        BY_KIND[("ConfigMap", "tabloop-config")]["data"]["TABLOOP_TOPIC_PARTITIONS"])


def test_gpus_probes_and_the_replica_list():
    vllm = BY_KIND[("StatefulSet", "vllm")]
    trainer = BY_KIND[("Deployment", "trainer")]
    for doc in (vllm, trainer):
        [c] = pod_spec(doc)["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    [v] = pod_spec(vllm)["containers"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in v["env"] and "--enable-lora" in v["args"]
    [s] = pod_spec(BY_KIND[("Deployment", "serve")])["containers"]
    assert s["livenessProbe"]["httpGet"]["path"] == "/healthz" and s["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {p["containerPort"] for p in s["ports"]} == {8081, 8082}
    settings = check_settings_env(container_env(BY_KIND[("Deployment", "serve")], s))
    assert settings.engine == "vllm"
    # Every vLLM pod, by its stable name, is in the front door's list, and nothing else is.
    expected = {f"http://vllm-{i}.vllm.tabloop.svc.cluster.local:8000" for i in range(vllm["spec"]["replicas"])}
    assert set(settings.vllm_urls.split(",")) == expected
    # The trainer writes weight versions where the replicas read them.
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for doc in (vllm, trainer) for c in pod_spec(doc)["containers"]}
    assert mounts["vllm"]["weights"] == mounts["trainer"]["weights"]
    # Kafka's clients and the history's ClickHouse point at the Services defined here.
    config = BY_KIND[("ConfigMap", "tabloop-config")]["data"]
    assert config["TABLOOP_KAFKA_BOOTSTRAP"].startswith("kafka-0.kafka.tabloop.svc") and ("Service", "kafka") in BY_KIND
    assert config["TABLOOP_CLICKHOUSE_URL"].startswith("http://clickhouse.tabloop.svc")
    # The streams replicas start together: the broker lets a new group wait for them (infra/kafka_broker.py).
    assert BY_KIND[("Deployment", "streams")]["spec"]["replicas"] >= 2
    [k] = pod_spec(BY_KIND[("StatefulSet", "kafka")])["containers"]
    assert container_env(BY_KIND[("StatefulSet", "kafka")], k)["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"] \
        == str(SEVERAL_WORKERS_JOIN_WAIT_MS)
    assert ("Service", "clickhouse") in BY_KIND
