"""The one settings object. Nothing else in tabloop reads the environment.

Values come from, in increasing priority: defaults, a YAML file (the path in
``TABLOOP_CONFIG``, or ``tabloop.yaml`` in the working directory when present),
and ``TABLOOP_<FIELD>`` environment variables. A bad value, an unknown key or
an unknown ``TABLOOP_`` variable is an error naming it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_PREFIX = "TABLOOP_"
CONFIG_VAR = "TABLOOP_CONFIG"
DEFAULT_CONFIG_FILE = "tabloop.yaml"
REFERENCE_JUDGE_VARS = {"LLMASJUDGE_API_URL": "judge_api_url", "LLMASJUDGE_API_KEY": "judge_api_key",
                        "LLMASJUDGE_MODEL": "judge_model"}
_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


class SettingsError(ValueError):
    """A setting that can't be used; the message names where it came from."""


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kafka_bootstrap: str = Field("127.0.0.1:9092", description="host:port[,host:port…] of the Kafka brokers")
    state_dir: Path = Field(Path(".tabloop"), description="where local state lives (Kafka data, spool, ClickHouse…)")
    cache_dir: Path = Field(Path.home() / ".cache" / "tabloop", description="downloaded artifacts (the Kafka jars)")
    model: str = Field("demo", description="model path, hub id, or 'demo'")
    clickhouse_url: str = Field("", description="chdb:///dir (embedded, default under the state dir) or http://host:8123")
    schema_registry_url: str = Field("", description="a Confluent-compatible schema registry; empty = single-object encoding")
    topic_partitions: int = Field(6, ge=1, le=1000, description="partitions of the event topics")
    topic_replication: int = Field(1, ge=1, le=32, description="replication factor of every topic")
    kafka_heap: str = Field("512m", description="JVM heap of the local broker (-Xmx)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    demo_minutes: float = Field(8.0, gt=0, le=600, description="pretraining budget of the demo model (TABLOOP_MODEL=demo)")

    # -- the front door (serving/) --
    serve_host: str = Field("127.0.0.1", description="address the front door listens on")
    completions_port: int = Field(8081, ge=0, le=65535, description="port of /v1/completions (0: any free port)")
    feedback_port: int = Field(8082, ge=0, le=65535, description="port of the feedback routes (0: any free port)")
    engine: Literal["transformers", "vllm"] = Field("transformers", description="transformers (in-process) or vllm")
    vllm_urls: str = Field("", description="comma-separated base URLs of vLLM OpenAI servers (engine=vllm)")
    vllm_api_key: str = Field("", description="Bearer key for the vLLM servers, if they want one")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N (transformers engine)")
    max_batch: int = Field(8, ge=1, le=256, description="requests decoded together (transformers engine)")
    max_new_tokens: int = Field(256, ge=1, le=8192, description="server-side cap on max_tokens")
    max_prompt_tokens: int = Field(2048, ge=16, le=131072, description="longer prompts lose the top of the prefix")
    exploration_temperature: float | None = Field(None, ge=0, le=2,
                                                  description="if set, overrides the client's temperature")
    auth: Literal["keys", "open"] = Field("keys", description="keys: Bearer API keys; open: no auth, localhost only")
    rate_limit_per_minute: int = Field(600, ge=1, description="requests per minute per API key (default)")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="larger request bodies get 413")
    ack_timeout_s: float = Field(5.0, gt=0, le=120, description="wait for Kafka before spooling feedback")
    replica_id: str = Field("", description="name of this serving replica in events (default: host-pid)")

    # -- the streams worker (streams/) --
    join_window_s: float = Field(600, gt=0, description="how far back feedback without our id looks for its completion")
    join_lateness_s: float = Field(60, ge=0, description="how long feedback waits for a completion not yet seen")
    completion_ttl_s: float = Field(1800, gt=0, description="a completion with no feedback this long is IGNORED")
    emit_ignored: bool = Field(False, description="episodes for IGNORED completions (reward 'ignored')")
    keep_unmatched: bool = Field(True, description="unmatched and cache-hit feedback become off-policy episodes")
    idle_close_s: float = Field(300, ge=0, description="idle partitions close windows by wall clock minus this")
    reward_spec_file: Path | None = Field(None, description="YAML reward specs (default and per project)")
    judge_api_url: str = Field("", description="LLM judge: base URL of an OpenAI-compatible API (or LLMASJUDGE_API_URL)")
    judge_api_key: str = Field("", description="LLM judge: API key (or LLMASJUDGE_API_KEY)", repr=False)
    judge_model: str = Field("", description="LLM judge: model name (or LLMASJUDGE_MODEL)")
    judge_timeout_s: float = Field(30, gt=0, description="LLM judge: per-request timeout")
    judge_max_concurrency: int = Field(8, ge=1, description="LLM judge: requests in flight at once")
    tests_file: Path | None = Field(None, description="JSONL tasks with unit tests ({prompt|prompt_sha256, tests}) "
                                                      "for the tests scorer")
    tests_timeout_s: float = Field(10, gt=0, description="tests scorer: wall-clock limit per run")
    tests_memory_mb: int = Field(512, ge=16, description="tests scorer: address-space limit per run")
    scoring_concurrency: int = Field(8, ge=1, description="episodes being scored (judge, tests) at once per worker")

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap(cls, v: str) -> str:
        servers = [s.strip() for s in v.split(",")]
        if not servers or not all(_HOST_PORT.match(s) and 0 < int(s.rsplit(":", 1)[1]) < 65536 for s in servers):
            raise ValueError(f"expected host:port[,host:port…], got {v!r}")
        return ",".join(servers)

    @field_validator("exploration_temperature", "reward_spec_file", "tests_file", mode="before")
    @classmethod
    def _empty_is_none(cls, v):
        return None if v == "" else v

    @field_validator("clickhouse_url")
    @classmethod
    def _clickhouse(cls, v: str) -> str:
        if v and not re.match(r"^(chdb://|https?://)", v):
            raise ValueError(f"expected chdb:///path or http(s)://host:port, got {v!r}")
        return v

    @field_validator("schema_registry_url")
    @classmethod
    def _registry(cls, v: str) -> str:
        if v and not re.match(r"^https?://", v):
            raise ValueError(f"expected an http(s):// URL, got {v!r}")
        return v

    @field_validator("kafka_heap")
    @classmethod
    def _heap(cls, v: str) -> str:
        if not re.fullmatch(r"\d+[kmgKMG]", v):
            raise ValueError(f"expected a JVM size such as 512m or 1g, got {v!r}")
        return v.lower()

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        if v.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError(f"expected DEBUG, INFO, WARNING or ERROR, got {v!r}")
        return v.upper()

    # -- derived ------------------------------------------------------------

    @property
    def effective_clickhouse_url(self) -> str:
        return self.clickhouse_url or f"chdb://{(self.state_dir / 'clickhouse').resolve()}"

    @property
    def kafka_dir(self) -> Path:
        return self.state_dir / "kafka"

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def keys_file(self) -> Path:
        return self.state_dir / "keys.json"


def env_var(field: str) -> str:
    return ENV_PREFIX + field.upper()


def to_environ(settings: Settings) -> dict[str, str]:
    """The TABLOOP_* variables that reproduce ``settings`` in a child process."""
    out = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        out[env_var(name)] = str(value)
    return out


def load_settings(environ: Mapping[str, str] | None = None, config_file: Path | None = None,
                  **overrides: Any) -> Settings:
    """Settings from the environment (``os.environ`` by default), a YAML file and overrides."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}

    path = config_file or (Path(environ[CONFIG_VAR]) if environ.get(CONFIG_VAR) else None)
    if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        path = Path(DEFAULT_CONFIG_FILE)
    if path is not None:
        for key, value in _read_yaml(path).items():
            values[key] = value
            origin[key] = f"{key} in {path}"

    # The reference recipe's judge variables, so its users' environments work as they are;
    # TABLOOP_JUDGE_* (below) win over them.
    for name, field in REFERENCE_JUDGE_VARS.items():
        if environ.get(name):
            values[field] = environ[name]
            origin[field] = name

    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_VAR:
            continue
        field = name[len(ENV_PREFIX):].lower()
        values[field] = value
        origin[field] = name

    values.update(overrides)
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise SettingsError(_describe(exc, origin)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise SettingsError(f"{CONFIG_VAR}: config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of settings, not {type(data).__name__}")
    return {str(k): v for k, v in data.items()}


def _describe(exc: ValidationError, origin: dict[str, str]) -> str:
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        where = origin.get(field, field)
        if err["type"] == "extra_forbidden":
            known = ", ".join(env_var(f) for f in Settings.model_fields)
            lines.append(f"{where}: not a tabloop setting (known: {known})")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}")
    return "; ".join(lines)
