from pathlib import Path

import pytest

from infra.settings import SettingsError, load_settings


def test_defaults():
    s = load_settings(environ={})
    assert s.kafka_bootstrap == "127.0.0.1:9092"
    assert s.state_dir == Path(".tabloop")
    assert s.model == "smollm2"
    assert s.effective_clickhouse_url == f"chdb://{Path('.tabloop/clickhouse').resolve()}"


def test_environment_overrides():
    s = load_settings(environ={"TABLOOP_KAFKA_BOOTSTRAP": "localhost:1234, 10.0.0.2:9093",
                               "TABLOOP_TOPIC_PARTITIONS": "12", "TABLOOP_MODEL": "/models/x",
                               "TABLOOP_CLICKHOUSE_URL": "http://ch:8123", "PATH": "/bin"})
    assert s.kafka_bootstrap == "localhost:1234,10.0.0.2:9093"
    assert s.topic_partitions == 12
    assert s.effective_clickhouse_url == "http://ch:8123"


@pytest.mark.parametrize("var,value,words", [
    ("TABLOOP_KAFKA_BOOTSTRAP", "kafka", "host:port"),
    ("TABLOOP_KAFKA_BOOTSTRAP", "h:99999", "host:port"),
    ("TABLOOP_TOPIC_PARTITIONS", "many", "integer"),
    ("TABLOOP_TOPIC_PARTITIONS", "0", "greater than or equal to 1"),
    ("TABLOOP_CLICKHOUSE_URL", "postgres://x", "chdb:///path"),
    ("TABLOOP_KAFKA_HEAP", "lots", "512m"),
    ("TABLOOP_LOG_LEVEL", "LOUD", "DEBUG"),
    ("TABLOOP_KAFKA_BOOTSRAP", "127.0.0.1:1", "not a tabloop setting"),
    ("TABLOOP_PROJECT_POLICIES", "*,alpha", "either * (every project) or a list"),
])
def test_bad_values_name_the_variable(var, value, words):
    with pytest.raises(SettingsError) as err:
        load_settings(environ={var: value})
    assert str(err.value).startswith(var) and words in str(err.value)


def test_yaml_file_and_priority(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text("kafka_bootstrap: 127.0.0.1:7777\ntopic_partitions: 2\n")
    s = load_settings(environ={"TABLOOP_CONFIG": str(cfg), "TABLOOP_TOPIC_PARTITIONS": "5"})
    assert s.kafka_bootstrap == "127.0.0.1:7777" and s.topic_partitions == 5  # env beats the file

    cfg.write_text("topic_partitions: -3\n")
    with pytest.raises(SettingsError, match=f"topic_partitions in {cfg}"):
        load_settings(environ={}, config_file=cfg)
    cfg.write_text("colour: blue\n")
    with pytest.raises(SettingsError, match="colour in .*not a tabloop setting"):
        load_settings(environ={}, config_file=cfg)
    cfg.write_text("- a list\n")
    with pytest.raises(SettingsError, match="mapping"):
        load_settings(environ={}, config_file=cfg)
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(environ={"TABLOOP_CONFIG": str(tmp_path / "missing.yaml")})


def test_cli_reports_bad_settings(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tabloop.cli", "topics", "list"], capture_output=True, text=True,
                          env={"TABLOOP_TOPIC_PARTITIONS": "x", "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert proc.returncode == 1
    assert "TABLOOP_TOPIC_PARTITIONS" in proc.stderr and "Traceback" not in proc.stderr


def test_project_policies_name_projects_and_need_lora():
    s = load_settings(environ={"TABLOOP_PROJECT_POLICIES": " alpha , beta,"})
    assert s.project_policies == "alpha,beta" and s.has_project_policy("beta") and not s.has_project_policy("gamma")
    assert not s.has_project_policy("")  # "" is the shared policy, never a project
    assert load_settings(environ={"TABLOOP_PROJECT_POLICIES": "*"}).has_project_policy("anyone")
    with pytest.raises(SettingsError) as err:
        load_settings(environ={"TABLOOP_PROJECT_POLICIES": "alpha", "TABLOOP_TRAINER_FULL_FINETUNE": "true"})
    assert str(err.value).startswith("TABLOOP_PROJECT_POLICIES needs LoRA adapters")
