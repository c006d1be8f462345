"""The compose drill: the CPU profile (infra/compose/docker-compose.cpu.yml) built and run under a real container
engine, the loop checked through the published ports, everything brought down again.

    python -m tabloop.compose_drill            (make compose-drill)

1. Checks the engine: Podman (with podman-compose, installed into a virtual environment of its own under the
   cache dir when missing) or Docker with its compose plugin; says what is missing and how to set it up.
2. Builds the images that are missing: a Debian base (debootstrap + import) and a Python base from it when
   no registry is reachable (the default; --base-image python:3.12-slim where one is), the Kafka image from
   the jars `tabloop kafka fetch` caches, and the tabloop image (the Dockerfile; rebuilt on every run from
   the engine's layer cache, so the drill runs this checkout's code). This machine's extra CA certificates
   go into the build (infra/compose/ca-certificates/).
3. Brings the stack up on free ports, sends a Continue-shaped completion (streamed, Continue's headers and
   FIM prompt) and Continue's `autocomplete` data event for it, and reads the episode back from the history
   over SQL (`tabloop sql` against the history port).
4. Restarts the streams worker and sees it rejoin: a second completion and its feedback become an episode.
5. Brings everything down (volumes too) and checks that no container of the stack is left.

Progress and timings go to stdout; the exit status is 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from infra.kafka_broker import KAFKA_VERSION, LocalKafka
from infra.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_DIR = ROOT / "infra" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.cpu.yml"
PROJECT = "tabloop-cpu"
DEBIAN_IMAGE = "tabloop-debian:bookworm"
PYTHON_IMAGE = "tabloop-python:3.11-bookworm"
KAFKA_IMAGE = "tabloop-kafka:4.4.0"
TABLOOP_IMAGE = "tabloop:cpu"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
PODMAN_COMPOSE = "podman-compose==1.6.0"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
SERVICES = ("kafka", "topics", "serve", "streams", "trainer", "history")
LONG_RUNNING = ("kafka", "serve", "streams", "trainer", "history")
# A Continue-shaped FIM prompt (its Qwen template: the front door renders it in the served model's format).
PROMPTS = ("<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n<|fim_middle|>",
           "<|fim_prefix|>def is_even(n):\n    return <|fim_suffix|>\n<|fim_middle|>")


class DrillError(RuntimeError):
    """A step of the drill failed; the message says which and why."""


@dataclass
class Timings:
    started: float = field(default_factory=time.monotonic)
    steps: list[tuple[str, float]] = field(default_factory=list)

    def step(self, name: str, seconds: float) -> None:
        self.steps.append((name, seconds))
        say(f"  {name}: {seconds:.1f} s")


def say(line: str) -> None:
    print(f"[compose-drill {time.strftime('%H:%M:%S')}] {line}", flush=True)


def run(cmd: list[str], *, check: bool = True, capture: bool = True, env: dict | None = None,
        timeout: float | None = None, cwd: Path | None = None, input: str | bytes | None = None
        ) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=capture, text=not isinstance(input, bytes), env=env,
                          timeout=timeout, cwd=cwd, input=input)
    if check and proc.returncode != 0:
        out = ((proc.stdout or "") + (proc.stderr or "")) if capture else ""
        raise DrillError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{out[-4000:]}")
    return proc


def timed(timings: Timings, name: str, fn, *args, **kwargs):
    t0 = time.monotonic()
    result = fn(*args, **kwargs)
    timings.step(name, time.monotonic() - t0)
    return result


# -- the engine -------------------------------------------------------------------------------------------------


@dataclass
class Engine:
    name: str  # podman | docker
    compose: list[str]

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return run([self.name, *args], **kw)

    def compose_cmd(self, *args: str) -> list[str]:
        return [*self.compose, "-p", PROJECT, "-f", str(COMPOSE_FILE), *args]

    def image_exists(self, image: str) -> bool:
        return run([self.name, "image", "inspect", image], check=False).returncode == 0

    def image_size(self, image: str) -> int:
        out = run([self.name, "image", "inspect", image, "--format", "{{.Size}}"], check=False).stdout.strip()
        return int(out) if out.isdigit() else 0

    @property
    def project_label(self) -> str:
        name = "io.podman.compose.project" if self.name == "podman" else "com.docker.compose.project"
        return f"label={name}={PROJECT}"

    def project_containers(self) -> list[str]:
        out = run([self.name, "ps", "-a", "--filter", self.project_label, "--format", "{{.Names}}"],
                  check=False).stdout
        return [n for n in out.split() if n]

    def project_volumes(self) -> list[str]:
        out = run([self.name, "volume", "ls", "--filter", self.project_label, "--format", "{{.Name}}"],
                  check=False).stdout
        return [n for n in out.split() if n]


def podman_problems() -> list[str]:
    """What this machine lacks for Podman as the drill runs it (the README's CPU profile section)."""
    problems = []
    if shutil.which("iptables") is None:
        problems.append("iptables is missing (netavark's networks need it): apt-get install -y iptables")
    info = run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}} {{.Host.CgroupsVersion}}"], check=False)
    if info.returncode != 0:
        problems.append(f"`podman info` fails: {(info.stderr or info.stdout).strip()[-500:]}")
        return problems
    runtime, _, cgroups = info.stdout.strip().partition(" ")
    hybrid = Path("/sys/fs/cgroup").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").exists()
    if runtime == "crun" and hybrid:
        problems.append(f"the runtime is crun, which refuses this machine's cgroup v1 hierarchy: set "
                        f'runtime = "runc" under [engine] in {CONTAINERS_CONF} (apt-get install -y runc)')
    soft, hard = _ulimit_nofile()
    conf = CONTAINERS_CONF.read_text() if CONTAINERS_CONF.exists() else ""
    if "default_ulimits" not in conf and hard < 1048576:
        problems.append(f"containers' default ulimits exceed this shell's (nofile {soft}:{hard}): set "
                        f'default_ulimits = ["nofile={hard}:{hard}", "nproc=32768:32768"] under [containers] in '
                        f"{CONTAINERS_CONF}")
    return problems


def _ulimit_nofile() -> tuple[int, int]:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)


def setup_podman() -> None:
    """--setup: what podman_problems asks for, done (Debian, as root)."""
    run(["apt-get", "install", "-y", "podman", "iptables", "runc", "debootstrap"], capture=False,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    soft, hard = _ulimit_nofile()
    conf = CONTAINERS_CONF.read_text() if CONTAINERS_CONF.exists() else ""
    if "default_ulimits" not in conf or 'runtime = "runc"' not in conf:
        CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
        backup = CONTAINERS_CONF.with_name("containers.conf.before-tabloop")
        if CONTAINERS_CONF.exists() and not backup.exists():
            shutil.copy(CONTAINERS_CONF, backup)
        nofile = min(hard, 1048576)
        CONTAINERS_CONF.write_text(
            "# tabloop compose drill: crun refuses a hybrid cgroup v1 hierarchy; ulimits within the shell's own.\n"
            f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n\n'
            '[engine]\nruntime = "runc"\n')
        say(f"wrote {CONTAINERS_CONF}" + (f" (the previous one kept as {backup})" if backup.exists() else ""))


def podman_compose(cache_dir: Path) -> list[str]:
    """podman-compose: on PATH, else in its own virtual environment under the cache dir (made once)."""
    found = shutil.which("podman-compose")
    if found:
        return [found]
    venv = cache_dir / "podman-compose"
    exe = venv / "bin" / "podman-compose"
    if not exe.exists():
        say(f"installing {PODMAN_COMPOSE} into {venv} (one time)")
        run([sys.executable, "-m", "venv", str(venv)])
        run([str(venv / "bin" / "pip"), "install", "--quiet", PODMAN_COMPOSE])
    return [str(exe)]


def find_engine(choice: str | None, cache_dir: Path, setup: bool) -> Engine:
    if choice == "podman" or (choice is None and (shutil.which("podman") or setup)):
        if setup:
            setup_podman()
        if shutil.which("podman") is None:
            raise DrillError("podman is not installed: apt-get install -y podman iptables runc debootstrap "
                             "(or `python -m tabloop.compose_drill --setup`, Debian, as root)")
        problems = podman_problems()
        if problems:
            raise DrillError("Podman is not ready here:\n  - " + "\n  - ".join(problems)
                             + "\n(`python -m tabloop.compose_drill --setup` does these on Debian, as root)")
        return Engine("podman", podman_compose(cache_dir))
    if choice in (None, "docker") and shutil.which("docker"):
        if run(["docker", "info"], check=False).returncode != 0:
            raise DrillError("`docker info` fails: no Docker engine answers (start it, or install Podman: "
                             "`python -m tabloop.compose_drill --engine podman --setup`)")
        if run(["docker", "compose", "version"], check=False).returncode != 0:
            raise DrillError("Docker has no compose plugin (`docker compose version` fails)")
        return Engine("docker", ["docker", "compose"])
    raise DrillError("no container engine: install Podman (`python -m tabloop.compose_drill --setup` on "
                     "Debian: podman, iptables, runc, debootstrap) or Docker with its compose plugin")


# -- the images -----------------------------------------------------------------------------------------------


def build_debian(engine: Engine, rootfs_parent: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise DrillError(f"{DEBIAN_IMAGE} is missing and debootstrap is not installed (apt-get install -y "
                         "debootstrap), or give --base-image/--kafka-base-image images your engine can pull")
    rootfs_parent.mkdir(parents=True, exist_ok=True)
    rootfs = rootfs_parent / "bookworm"
    if not (rootfs / "etc" / "debian_version").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR])
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--exclude=./var/cache/apt/archives/*.deb",
                            "--exclude=./var/lib/apt/lists/*", "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run([engine.name, "import", "-", DEBIAN_IMAGE], stdin=tar.stdout, capture_output=True,
                              text=True)
    tar.stdout.close()
    if tar.wait() != 0 or imported.returncode != 0:
        raise DrillError(f"importing the debootstrap tree as {DEBIAN_IMAGE} failed: {imported.stderr[-2000:]}")


def build_python(engine: Engine) -> None:
    engine("build", "-t", PYTHON_IMAGE, "--build-arg", f"DEBIAN_IMAGE={DEBIAN_IMAGE}", "-f",
           str(COMPOSE_DIR / "base" / "Containerfile"), str(COMPOSE_DIR / "base"), capture=False)


def kafka_jars(cache_dir: Path) -> Path:
    """The jars `tabloop kafka fetch` caches, plus kafka-tools (the health check's tool), in the build context."""
    jars = LocalKafka(load_settings(cache_dir=cache_dir)).fetch()
    libs = COMPOSE_DIR / "kafka" / "libs"
    libs.mkdir(exist_ok=True)
    tools = f"kafka-tools-{KAFKA_VERSION}.jar"
    tools_cached = jars.parent / "extra" / tools
    if not tools_cached.exists():
        mvn = shutil.which("mvn")
        if mvn is None:
            raise DrillError("Maven (mvn) is needed once, to fetch kafka-tools for the Kafka image's health check")
        run([mvn, "-B", "-q", "dependency:copy", f"-Dartifact=org.apache.kafka:kafka-tools:{KAFKA_VERSION}",
             f"-DoutputDirectory={tools_cached.parent}"])
    wanted = {p.name: p for p in [*jars.glob("*.jar"), tools_cached]}
    for stale in libs.glob("*.jar"):
        if stale.name not in wanted:
            stale.unlink()
    for name, src in wanted.items():
        dst = libs / name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
    return libs


def build_kafka(engine: Engine, cache_dir: Path, base: str) -> None:
    kafka_jars(cache_dir)
    engine("build", "-t", KAFKA_IMAGE, "--build-arg", f"BASE_IMAGE={base}", "-f",
           str(COMPOSE_DIR / "kafka" / "Containerfile"), str(COMPOSE_DIR / "kafka"), capture=False)


def copy_ca_certificates() -> list[str]:
    """This machine's extra CA certificates into the build context (pip inside the build goes through the same
    network as pip here)."""
    target = COMPOSE_DIR / "ca-certificates"
    copied = []
    if HOST_CA_DIR.is_dir():
        for crt in sorted(HOST_CA_DIR.glob("*.crt")):
            dst = target / crt.name
            if not dst.exists() or dst.read_bytes() != crt.read_bytes():
                shutil.copy(crt, dst)
            copied.append(crt.name)
    return copied


def build_tabloop(engine: Engine, base: str, torch_index: str, pip_index: str) -> None:
    args = ["build", "-t", TABLOOP_IMAGE, "-f", str(ROOT / "Dockerfile"), "--build-arg", f"BASE_IMAGE={base}",
            "--build-arg", f"PIP_INDEX_URL={pip_index}"]
    if torch_index:
        args += ["--build-arg", f"TORCH_INDEX_URL={torch_index}"]
    engine(*args, str(ROOT), capture=False)


def build_images(engine: Engine, opts, timings: Timings) -> None:
    base, kafka_base = opts.base_image, opts.kafka_base_image
    need_debian = ((base == PYTHON_IMAGE and not engine.image_exists(PYTHON_IMAGE))
                   or (kafka_base == DEBIAN_IMAGE and not engine.image_exists(KAFKA_IMAGE)))
    if need_debian and not engine.image_exists(DEBIAN_IMAGE):
        say(f"building {DEBIAN_IMAGE} (debootstrap --variant=minbase bookworm, imported)")
        timed(timings, f"build {DEBIAN_IMAGE}", build_debian, engine, opts.cache_dir / "rootfs")
    if base == PYTHON_IMAGE and not engine.image_exists(PYTHON_IMAGE):
        say(f"building {PYTHON_IMAGE} (Debian's Python 3.11 in a virtual environment)")
        timed(timings, f"build {PYTHON_IMAGE}", build_python, engine)
    if not engine.image_exists(KAFKA_IMAGE):
        say(f"building {KAFKA_IMAGE} (Debian's Java 17 + the jars `tabloop kafka fetch` caches)")
        timed(timings, f"build {KAFKA_IMAGE}", build_kafka, engine, opts.cache_dir, kafka_base)
    certs = copy_ca_certificates()
    if certs:
        say(f"extra CA certificates for the build: {', '.join(certs)} (from {HOST_CA_DIR})")
    fresh = not engine.image_exists(TABLOOP_IMAGE)
    say(f"building {TABLOOP_IMAGE} from the Dockerfile on {base}"
        + (" (first build: torch and the rest from the index, minutes)" if fresh else " (layer cache)"))
    timed(timings, f"build {TABLOOP_IMAGE}" + (" (first)" if fresh else " (cached)"), build_tabloop, engine, base,
          opts.torch_index_url, opts.pip_index_url)
    for image in (DEBIAN_IMAGE, PYTHON_IMAGE, KAFKA_IMAGE, TABLOOP_IMAGE):
        if engine.image_exists(image):
            say(f"  image {image}: {engine.image_size(image) / 1e6:,.0f} MB")


# -- the stack ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    engine: Engine
    env: dict
    completions_port: int
    feedback_port: int
    history_port: int
    history_token: str
    key: str = ""
    scratch_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="tabloop-compose-drill-"))
    """The state dir of this machine's `tabloop sql` (it keeps nothing there)."""

    def compose(self, *args: str, check: bool = True, timeout: float | None = None, capture: bool = True):
        return run(self.engine.compose_cmd(*args), env=self.env, check=check, timeout=timeout, capture=capture)

    def logs(self, service: str, tail: int = 60) -> str:
        names = [n for n in self.engine.project_containers() if re.search(rf"[_-]{service}[_-]\d+$", n)]
        out = []
        for name in names:
            proc = run([self.engine.name, "logs", "--tail", str(tail), name], check=False)
            out.append(f"--- {name} ---\n{proc.stdout}{proc.stderr}")
        return "\n".join(out) or f"(no container of {service})"

    def container(self, service: str) -> str:
        names = [n for n in self.engine.project_containers() if re.search(rf"[_-]{service}[_-]\d+$", n)]
        if not names:
            raise DrillError(f"no container of the {service} service")
        return names[0]


def make_stack(engine: Engine) -> Stack:
    ports = [free_port() for _ in range(3)]
    token = "drill-" + secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TABLOOP_")}
    env.update({"TABLOOP_COMPLETIONS_PORT": str(ports[0]), "TABLOOP_FEEDBACK_PORT": str(ports[1]),
                "TABLOOP_HISTORY_PORT": str(ports[2]), "TABLOOP_HISTORY_TOKEN": token})
    return Stack(engine, env, *ports, history_token=token)


def wait_for(what: str, check, timeout_s: float, explain=None, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - reported if the wait runs out
            last_error = exc
        time.sleep(every_s)
    detail = f" (last error: {last_error})" if last_error else ""
    raise DrillError(f"{what}: not within {timeout_s:.0f} s{detail}" + (f"\n{explain()}" if explain else ""))


def service_running(stack: Stack, service: str) -> bool:
    state = run([stack.engine.name, "inspect", "--format", "{{.State.Status}}", stack.container(service)],
                check=False).stdout.strip()
    return state == "running"


def ready(stack: Stack) -> bool:
    import httpx

    return httpx.get(f"http://127.0.0.1:{stack.completions_port}/readyz", timeout=2).status_code == 200


def make_key(stack: Stack) -> str:
    out = stack.compose("exec", "-T", "serve", "tabloop", "keys", "add", "--project", "compose-drill",
                        "--user", "drill", timeout=120).stdout
    found = re.search(r"\btlk_\S+", out)
    if not found:
        raise DrillError(f"`tabloop keys add` printed no key:\n{out}")
    return found.group(0)


def complete(stack: Stack, prompt: str) -> tuple[str, str]:
    """One completion as Continue asks for it: streamed, its headers, its FIM prompt. (id, text)."""
    import httpx

    headers = {"Authorization": f"Bearer {stack.key}", "api-key": stack.key, "Content-Type": "application/json"}
    body = {"model": "qwen2.5-coder-1.5b", "prompt": prompt, "max_tokens": 12, "temperature": 0.01,
            "stop": ["<|endoftext|>", "<|fim_pad|>", "\n\n"], "stream": True}
    text, cid = [], None
    with httpx.stream("POST", f"http://127.0.0.1:{stack.completions_port}/v1/completions", json=body,
                      headers=headers, timeout=300) as resp:
        if resp.status_code != 200:
            raise DrillError(f"/v1/completions answered {resp.status_code}: {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            cid = cid or chunk.get("id")
            text.extend(c.get("text", "") for c in chunk.get("choices", []))
    if not cid:
        raise DrillError("the streamed completion carried no id")
    return cid, "".join(text)


def feedback(stack: Stack, prompt: str, completion: str) -> None:
    """Continue's `autocomplete` data event (its data: destination), accepted."""
    import httpx

    event = {"name": "autocomplete", "schema": "0.2.0", "level": "all", "profileId": "local",
             "data": {"eventName": "autocomplete", "completionId": str(uuid.uuid4()), "filepath": "/repo/drill.py",
                      "prefix": prompt, "suffix": "\n", "prompt": prompt, "completion": completion,
                      "modelProvider": "openai", "modelName": "qwen2.5-coder-1.5b", "accepted": True,
                      "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "time": 400,
                      "uniqueId": "compose-drill", "numLines": 1, "cacheHit": False, "userId": "drill"}}
    resp = httpx.post(f"http://127.0.0.1:{stack.feedback_port}/api/continue/events", json=event, timeout=60,
                      headers={"Authorization": f"Bearer {stack.key}", "api-key": stack.key})
    if resp.status_code != 202:
        raise DrillError(f"/api/continue/events answered {resp.status_code}: {resp.text[:500]}")


def sql(stack: Stack, query: str) -> list[dict]:
    """`tabloop sql` on this machine, against the history's published port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TABLOOP_")}
    env.update({"TABLOOP_HISTORY_HOST": "127.0.0.1", "TABLOOP_HISTORY_PORT": str(stack.history_port),
                "TABLOOP_HISTORY_TOKEN": stack.history_token, "TABLOOP_STATE_DIR": stack.scratch_dir})
    proc = run([sys.executable, "-m", "tabloop.cli", "sql", query, "--format", "json"], env=env, check=False,
               timeout=60, cwd=ROOT)
    if proc.returncode != 0:
        raise DrillError(f"tabloop sql: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def episode_in_history(stack: Stack, completion_id: str) -> dict | None:
    rows = sql(stack, "SELECT completion_id, outcome, reward, matched FROM tabloop.episodes "
                      f"WHERE completion_id = '{completion_id}'")
    return rows[0] if rows else None


def one_episode(stack: Stack, prompt: str, timings: Timings, label: str) -> dict:
    t0 = time.monotonic()
    cid, text = complete(stack, prompt)
    say(f"  completion {cid}: {text!r}")
    feedback(stack, prompt, text)
    row = wait_for(f"the episode of {cid} in the history", lambda: episode_in_history(stack, cid), 240,
                   explain=lambda: stack.logs("streams", 30) + "\n" + stack.logs("history", 30), every_s=2)
    timings.step(f"{label}: completion -> feedback -> episode row", time.monotonic() - t0)
    say(f"  episode: {row}")
    return row


def drill(opts) -> int:
    timings = Timings()
    engine = find_engine(opts.engine, opts.cache_dir, opts.setup)
    say(f"engine: {engine.name} ({' '.join(engine.compose)})")
    if not opts.no_build:
        build_images(engine, opts, timings)
    for image in (KAFKA_IMAGE, TABLOOP_IMAGE):
        if not engine.image_exists(image):
            raise DrillError(f"{image} is missing (run without --no-build)")
    if opts.build_only:
        return 0
    stack = make_stack(engine)
    if engine.project_containers():
        say("a previous drill's stack is still there: bringing it down first")
        stack.compose("down", "-v", check=False, timeout=300)
    say(f"up: completions :{stack.completions_port}, feedback :{stack.feedback_port}, "
        f"history :{stack.history_port}")
    ok = False
    try:
        t_up = time.monotonic()
        timed(timings, "compose up -d", stack.compose, "up", "-d", "--no-build", timeout=600)
        wait_for("the front door ready (/readyz)", lambda: ready(stack), opts.ready_timeout_s,
                 explain=lambda: stack.logs("serve") + "\n" + stack.logs("topics", 20), every_s=2)
        timings.step("up -> front door ready", time.monotonic() - t_up)
        for service in LONG_RUNNING:
            wait_for(f"{service} running", lambda s=service: service_running(stack, s), 120,
                     explain=lambda s=service: stack.logs(s))
        stack.key = make_key(stack)
        say("completion and feedback through the published ports; the episode over SQL")
        one_episode(stack, PROMPTS[0], timings, "first episode")

        say("restarting the streams worker")
        before = run([engine.name, "inspect", "--format", "{{.State.StartedAt}}", stack.container("streams")]).stdout
        t0 = time.monotonic()
        stack.compose("restart", "streams", timeout=180)
        wait_for("streams running again", lambda: service_running(stack, "streams"), 120,
                 explain=lambda: stack.logs("streams"))
        after = run([engine.name, "inspect", "--format", "{{.State.StartedAt}}", stack.container("streams")]).stdout
        if before == after:
            raise DrillError(f"the streams container was not restarted (started at {before.strip()} still)")
        timings.step("restart streams", time.monotonic() - t0)
        one_episode(stack, PROMPTS[1], timings, "after the restart")
        ok = True
    except DrillError as exc:
        say(f"FAILED: {exc}")
        if opts.keep_on_failure:
            say(f"left running for a look (--keep-on-failure): {' '.join(engine.compose_cmd('ps'))}")
            return 1
    finally:
        if ok or not opts.keep_on_failure:
            say("down (volumes too)")
            timed(timings, "compose down -v", stack.compose, "down", "-v", check=False, timeout=600)
            left, volumes = engine.project_containers(), engine.project_volumes()
            if left or volumes:
                say(f"FAILED: left after down: containers {left}, volumes {volumes}")
                ok = False
            else:
                say(f"nothing left: `{engine.name} ps -a` and `{engine.name} volume ls` show nothing of {PROJECT}")
    shutil.rmtree(stack.scratch_dir, ignore_errors=True)
    total = time.monotonic() - timings.started
    say(f"{'PASSED' if ok else 'FAILED'} in {total:.0f} s ({total / 60:.1f} min)")
    for name, seconds in timings.steps:
        print(f"  {seconds:7.1f} s  {name}")
    return 0 if ok else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    default_cache = Settings.model_fields["cache_dir"].default
    p = argparse.ArgumentParser(prog="python -m tabloop.compose_drill", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["podman", "docker"], default=None,
                   help="default: podman when installed, else docker")
    p.add_argument("--setup", action="store_true",
                   help="Debian, as root: install podman, iptables, runc, debootstrap and set the runtime and "
                        "default ulimits in /etc/containers/containers.conf")
    p.add_argument("--base-image", default=os.environ.get("BASE_IMAGE", PYTHON_IMAGE),
                   help=f"the tabloop image's base (default {PYTHON_IMAGE}, built here from Debian; "
                        "python:3.12-slim where a registry is reachable)")
    p.add_argument("--kafka-base-image", default=os.environ.get("KAFKA_BASE_IMAGE", DEBIAN_IMAGE),
                   help=f"the Kafka image's base, any Debian bookworm (default {DEBIAN_IMAGE}, built here)")
    p.add_argument("--torch-index-url", default=os.environ.get("TORCH_INDEX_URL", ""),
                   help="take torch from this index first (https://download.pytorch.org/whl/cpu: CPU-only)")
    p.add_argument("--pip-index-url", default=os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"))
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TABLOOP_CACHE_DIR", default_cache)))
    p.add_argument("--no-build", action="store_true", help="use the images as they are")
    p.add_argument("--build-only", action="store_true", help="build the images, run nothing")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--keep-on-failure", action="store_true", help="leave a failed stack running to look at")
    opts = p.parse_args(argv)
    opts.cache_dir = opts.cache_dir.expanduser()
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        return drill(opts)
    except DrillError as exc:
        say(f"FAILED: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
