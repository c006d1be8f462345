"""The weight store: every trained version's files and manifest, in a directory or at an fsspec URI.

Layout (``<root>`` is ``TABLOOP_WEIGHT_STORE``, default ``<state_dir>/weights``)::

    <root>/<base-model-slug>/v000001/adapter_model.safetensors   LoRA (peft): + adapter_config.json
                                     model.safetensors           FULL: + config.json, tokenizer files
                                     manifest.json               written last: a version exists iff it has one

The manifest says what the files are (version, parent, base model, kind,
sha256, size) and where they came from (the episode topic's offsets before and
after, episodes consumed and dropped, trainer step, metrics). The trainer
resumes from the newest manifest's offsets, so the manifests alone prove that
every episode was consumed exactly once.

The status of a version (CANDIDATE, PROMOTED, ROLLED_BACK) is not in the store:
it is the latest WeightVersion event on ``tabloop.weights`` (``fold_statuses``).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from infra.bus import read_topic
from schemas.events import new_event
from schemas.topics import WEIGHTS

MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


class WeightStoreError(RuntimeError):
    """A version that is missing, incomplete or does not match its manifest."""


@dataclass
class Manifest:
    version: int
    parent_version: int | None
    base_model: str
    kind: str  # LORA | FULL
    uri: str
    sha256: str
    size_bytes: int
    created_at_ms: int
    trainer_step: int
    episodes_consumed: int
    """Episodes read from the topic since the parent's manifest (trained on, or dropped and counted)."""
    episodes_trained: int
    episodes_dropped: dict[str, int]
    """Why episodes were consumed without training on them: {"stale": n, "empty": n, …}."""
    source_topic: str
    source_offsets_start: dict[str, int]
    """Partition → first offset this version consumed (the parent's ``source_offsets``)."""
    source_offsets: dict[str, int]
    """Partition → next offset to consume: where a restart resumes."""
    episodes_consumed_total: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    project_id: str = ""
    """The project whose policy this version is (its own LoRA adapter); "" the shared policy."""
    training: dict = field(default_factory=dict)
    """How the version was trained when not from the episode topic: {"mode": "offline", "algo", "group_size",
    "scorer", "dataset", …} (trainer/proof/offline.py); empty for online versions."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def model_slug(base_model: str) -> str:
    """A directory name for a base model: readable tail + a hash of the whole spec (paths differ per machine)."""
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", base_model.rstrip("/").rsplit("/", 1)[-1]).strip("-") or "model"
    return f"{tail[:48]}-{hashlib.sha256(base_model.encode()).hexdigest()[:8]}"


def files_sha256(directory: Path, names: Iterable[str]) -> tuple[str, int]:
    """sha256 over the files in name order (name, NUL, bytes, for each), and their total size."""
    digest, size = hashlib.sha256(), 0
    for name in sorted(names):
        digest.update(name.encode() + b"\0")
        with open(directory / name, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    return digest.hexdigest(), size


class WeightStore:
    """Versions of one base model under a root directory or fsspec URI (``s3://…``, ``memory://…``, a path)."""

    def __init__(self, root: str, base_model: str):
        import fsspec

        self.root_uri = str(root)
        self.base_model = base_model
        self.fs, root_path = fsspec.core.url_to_fs(self.root_uri)
        self.local = self.fs.protocol in ("file", "local") or "file" in (self.fs.protocol or ())
        self.dir = f"{root_path.rstrip('/')}/{model_slug(base_model)}"

    def version_dir(self, version: int) -> str:
        return f"{self.dir}/v{version:06d}"

    def uri_of(self, version: int) -> str:
        path = self.version_dir(version)
        if self.local:
            return f"file://{path}"
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{path.removeprefix(protocol + '://')}"

    # -- reading ----------------------------------------------------------------

    def _directory_numbers(self) -> list[int]:
        """The numbers of every version directory, complete or not, oldest first."""
        if not self.fs.exists(self.dir):
            return []
        return sorted(int(m.group(1)) for e in self.fs.ls(self.dir, detail=False)
                      if (m := _VERSION_DIR.match(e.rstrip("/").rsplit("/", 1)[-1])))

    def _complete(self, version: int) -> bool:
        return self.fs.exists(f"{self.version_dir(version)}/{MANIFEST}")

    def versions(self) -> list[int]:
        """Complete versions (those with a manifest), oldest first."""
        return [v for v in self._directory_numbers() if self._complete(v)]

    def manifest(self, version: int) -> Manifest:
        path = f"{self.version_dir(version)}/{MANIFEST}"
        if not self.fs.exists(path):
            raise WeightStoreError(f"version {version} of {self.base_model} is not in the weight store "
                                   f"{self.root_uri} (no {path}); have: {self.versions() or 'none'}")
        with self.fs.open(path, "r") as f:
            return Manifest.from_json(f.read())

    def manifests(self) -> list[Manifest]:
        return [self.manifest(v) for v in self.versions()]

    def latest(self, project: str | None = None) -> Manifest | None:
        """The newest version (``project``: the newest of that project, "" the shared policy's)."""
        for version in reversed(self.versions()):
            manifest = self.manifest(version)
            if project is None or manifest.project_id == project:
                return manifest
        return None

    def next_version(self) -> int:
        """One more than the newest complete version. A half-written directory after it (a crash while saving:
        no manifest, so nothing announced or served it) gets its number used again, and ``save`` clears it
        first: the versions announced stay one unbroken sequence. Only the directories after the newest complete
        one are looked into (one manifest check each, not one per version: a remote store pays per request)."""
        return next((v for v in reversed(self._directory_numbers()) if self._complete(v)), 0) + 1

    # -- writing ----------------------------------------------------------------

    def save(self, version: int, files_dir: Path, manifest_fields: dict) -> Manifest:
        """Copy the files in ``files_dir`` into version ``version``, then write its manifest (last, durably).

        ``manifest_fields``: every Manifest field except version, base model, uri, sha256, size and files.
        """
        files_dir = Path(files_dir)
        names = sorted(p.name for p in files_dir.iterdir() if p.is_file() and p.name != MANIFEST)
        if not names:
            raise WeightStoreError(f"no weight files in {files_dir}")
        sha, size = files_sha256(files_dir, names)
        target = self.version_dir(version)
        if self.fs.exists(f"{target}/{MANIFEST}"):
            raise WeightStoreError(f"version {version} already exists in {self.root_uri}")
        if self.fs.exists(target):  # half-written by a save that crashed: none of its files may stay
            self.fs.rm(target, recursive=True)
        self.fs.makedirs(target, exist_ok=True)
        for name in names:
            if self.local:
                _durable_copy(files_dir / name, Path(target) / name)
            else:
                self.fs.put_file(str(files_dir / name), f"{target}/{name}")
        manifest = Manifest(version=version, base_model=self.base_model, uri=self.uri_of(version), sha256=sha,
                            size_bytes=size, files=names, created_at_ms=int(time.time() * 1000),
                            **manifest_fields)
        if self.local:
            _durable_write(Path(target) / MANIFEST, manifest.to_json())
        else:
            with self.fs.open(f"{target}/{MANIFEST}", "w") as f:
                f.write(manifest.to_json())
        return manifest

    def remove(self, version: int) -> None:
        """Delete a version's directory (the trainer's for a save point that never finished: nothing announced
        it). The manifest goes first, so a crash halfway leaves a half-written directory, never a version."""
        target = self.version_dir(version)
        if self.fs.exists(f"{target}/{MANIFEST}"):
            self.fs.rm(f"{target}/{MANIFEST}")
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    def materialize(self, version: int, cache_dir: Path) -> Path:
        """A local directory with the version's files, checked against the manifest's sha256."""
        manifest = self.manifest(version)
        if self.local:
            local = Path(self.version_dir(version))
        else:
            local = Path(cache_dir) / model_slug(self.base_model) / f"v{version:06d}"
            # A cached copy of another version of this number (one removed, its number used again) is fetched anew.
            cached = Manifest.from_json((local / MANIFEST).read_text()) if (local / MANIFEST).exists() else None
            if cached is None or cached.sha256 != manifest.sha256:
                Path(cache_dir).mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(dir=Path(cache_dir)))
                for name in manifest.files + [MANIFEST]:
                    self.fs.get_file(f"{self.version_dir(version)}/{name}", str(tmp / name))
                local.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(local, ignore_errors=True)
                tmp.rename(local)
        sha, _ = files_sha256(local, manifest.files)
        if sha != manifest.sha256:
            raise WeightStoreError(f"version {version} at {local}: sha256 {sha} does not match the manifest's "
                                   f"{manifest.sha256} (corrupt or partly written)")
        return local


def local_path_of(uri: str, cache_dir: Path) -> Path:
    """A local directory for a WeightVersion's uri: file:// and plain paths as they are, others fetched."""
    if "://" not in uri or uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    local = Path(cache_dir) / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if not (local / MANIFEST).exists():
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=Path(cache_dir)))
        fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
        shutil.rmtree(local, ignore_errors=True)
        tmp.rename(local)
    return local


def _durable_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        fout.flush()
        import os

        os.fsync(fout.fileno())


def _durable_write(path: Path, text: str) -> None:
    """Write via a temporary file, fsync, rename, fsync the directory: the manifest is whole or absent."""
    import os

    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- statuses (folded from tabloop.weights) ---------------------------------------


@dataclass(frozen=True)
class VersionStatus:
    version: int
    status: str
    at_ms: int
    metrics: dict


def fold_statuses(records: Iterable[dict], base_model: str) -> dict[int, VersionStatus]:
    """Latest status of each version of ``base_model``, from WeightVersion records in topic order."""
    out: dict[int, VersionStatus] = {}
    for r in records:
        if r["base_model"] != base_model:
            continue
        at = r["created_at"]
        at_ms = int(at.timestamp() * 1000) if hasattr(at, "timestamp") else int(at)
        out[r["version"]] = VersionStatus(r["version"], r["status"], at_ms, dict(r.get("metrics") or {}))
    return out


def promoted_version(records: Iterable[dict], base_model: str, project: str = "") -> int:
    """The version serving follows: the last PROMOTED one, unless it was rolled back afterwards (then 0).

    The same rule as ``serving.weights.target_version``, over the whole topic. ``project``: that project's
    own versions only, where 0 means it has none (the shared policy serves it); "" the shared policy.
    """
    current = 0
    for r in records:
        if r["base_model"] != base_model or (r.get("project_id") or "") != project:
            continue
        if r["status"] == "PROMOTED":
            current = r["version"]
        elif r["status"] == "ROLLED_BACK" and r["version"] == current:
            current = 0
    return current


def version_event(manifest: Manifest, status: str, extra_metrics: dict[str, float] | None = None):
    """The WeightVersion event announcing ``manifest``'s version with ``status``."""
    return new_event("WeightVersion", project_id=manifest.project_id, version=manifest.version,
                     parent_version=manifest.parent_version,
                     base_model=manifest.base_model, kind=manifest.kind, uri=manifest.uri, sha256=manifest.sha256,
                     size_bytes=manifest.size_bytes, trainer_step=manifest.trainer_step,
                     episodes_consumed=manifest.episodes_consumed,
                     source_offsets={str(k): int(v) for k, v in manifest.source_offsets.items()},
                     metrics={**{k: float(v) for k, v in manifest.metrics.items()}, **(extra_metrics or {})},
                     status=status)


def base_version_event(base_model: str, status: str = "PROMOTED"):
    """Version 0 (the base model itself), for rolling back to it explicitly."""
    return new_event("WeightVersion", version=0, parent_version=None, base_model=base_model, kind="FULL", uri="",
                     sha256="", size_bytes=0, trainer_step=0, episodes_consumed=0, source_offsets={}, metrics={},
                     status=status)


def read_weight_records(settings) -> list[dict]:
    """Every WeightVersion record on tabloop.weights, in order (empty when the topic does not exist yet)."""
    from confluent_kafka import KafkaException

    for attempt in range(10):
        try:
            return [r.event.record for r in read_topic(settings, WEIGHTS.name) if r.event is not None]
        except ValueError:  # the topic does not exist yet
            return []
        except KafkaException:  # a topic created a moment ago may have no leader yet
            if attempt == 9:
                raise
            time.sleep(1)
    return []
