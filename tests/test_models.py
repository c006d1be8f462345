"""The tiny offline model and tokenizer, and load_model's errors. No network, no Kafka."""

from __future__ import annotations

import hashlib
import inspect
import json
import textwrap

import pytest
import torch

from policy.models import (DEFAULT_MODEL, FIM_TOKENS, QWEN_SPECIAL_TOKENS, ModelLoadError, build_tiny_model,
                            build_tokenizer, fim_token_ids, load_model)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


def _checksum(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


# -- tokenizer -----------------------------------------------------------------

def test_special_tokens_are_single_ids_in_qwen_order(tiny):
    _, tok = tiny
    ids = [tok.encode(t, add_special_tokens=False) for t in QWEN_SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids), dict(zip(QWEN_SPECIAL_TOKENS, ids))
    assert [i[0] for i in ids] == list(range(len(QWEN_SPECIAL_TOKENS)))
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert fim_token_ids(tok) == {t: i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}


SNIPPETS = [
    inspect.getsource(textwrap.dedent),
    inspect.getsource(json.dumps),
    inspect.getsource(hashlib),
    "def grüße(name: str) -> str:\n    return f\"こんにちは, {name} — ✓ 🐍\"\r\n\t\n",
    "  leading spaces, trailing tab\t",
    "x = '\\u00e9'  # é\n\n\n    \n",
]


@pytest.mark.parametrize("text", SNIPPETS, ids=["textwrap", "json", "hashlib", "unicode", "spaces", "escapes"])
def test_tokenizer_round_trips_python_source(tiny, text):
    _, tok = tiny
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # A trained BPE compresses code: far fewer tokens than bytes.
    if len(text) > 1000:
        assert len(ids) < len(text.encode()) / 2


def test_fim_prompt_keeps_fim_tokens_whole(tiny):
    _, tok = tiny
    ids = tok.encode("<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>", add_special_tokens=False)
    fim = fim_token_ids(tok)
    assert ids[0] == fim[FIM_TOKENS["prefix"]]
    assert ids[-1] == fim[FIM_TOKENS["middle"]]
    assert ids.count(fim[FIM_TOKENS["suffix"]]) == 1
    assert tok.decode(ids) == "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>"
    assert tok.decode(ids, skip_special_tokens=True) == "def f():\n"


def test_built_tokenizer_matches_the_loaded_one(tiny_dir, tiny):
    # build_tokenizer's return value and AutoTokenizer's view of the saved files
    # must tokenize identically, or training and serving would disagree.
    _, loaded = tiny
    built = build_tokenizer(tiny_dir / "rebuilt")
    assert type(built) is type(loaded)
    for text in SNIPPETS:
        assert built.encode(text) == loaded.encode(text)


def test_tokenizer_is_deterministic_and_follows_its_sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def alpha_beta_gamma(x):\n    return x\n" * 200)
    (src / "b.py").write_text("class Delta:\n    pass\n" * 200)
    one = build_tokenizer(tmp_path / "one", vocab_size=400, sources=[src])
    build_tokenizer(tmp_path / "two", vocab_size=400, sources=[src])
    assert (tmp_path / "one" / "tokenizer.json").read_bytes() == (tmp_path / "two" / "tokenizer.json").read_bytes()
    # Qwen's split gives "def", " alpha", "_beta", "_gamma": each learnt whole from a.py…
    assert len(one.encode("def alpha_beta_gamma", add_special_tokens=False)) == 4
    # …and not from b.py alone.
    b_only = build_tokenizer(tmp_path / "b", vocab_size=400, sources=[src / "b.py"])
    assert len(b_only.encode("def alpha_beta_gamma", add_special_tokens=False)) > 4


def test_tokenizer_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=100)
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        build_tokenizer(tmp_path, sources=[tmp_path / "no-such-dir"])


def test_fim_token_ids_names_missing_tokens():
    class NoFim:  # a tokenizer without most FIM tokens: only get_vocab is consulted
        name_or_path = "plain"

        def get_vocab(self):
            return {"<|endoftext|>": 0, "<|fim_prefix|>": 1}

    with pytest.raises(ModelLoadError, match=r"<\|fim_middle\|>.*<\|fim_suffix\|>.*<\|fim_pad\|>"):
        fim_token_ids(NoFim())


# -- tiny model --------------------------------------------------------------

def test_tiny_model_files_and_config(tiny_dir, tiny):
    model, tok = tiny
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "tabloop-model.json"):
        assert (tiny_dir / name).is_file(), name
    assert json.loads((tiny_dir / "tabloop-model.json").read_text()) == {
        "kind": "tiny", "seed": 0, "created_by": "tabloop model tiny"}
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32


def test_forward_gives_logits_over_the_vocabulary(tiny):
    model, tok = tiny
    ids = torch.tensor([tok.encode("def add(a, b):\n    return", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_greedy_generation_runs(tiny):
    model, tok = tiny
    ids = torch.tensor([tok.encode("<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>", add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 5)
    assert torch.equal(out[:, :ids.shape[1]], ids)
    assert isinstance(tok.decode(out[0, ids.shape[1]:]), str)


def test_same_seed_same_weights_other_seed_different(tiny, tmp_path):
    model, _ = tiny
    same, _ = load_model(str(build_tiny_model(tmp_path / "same", seed=0)))
    other, _ = load_model(str(build_tiny_model(tmp_path / "other", seed=1)))
    assert _checksum(same) == _checksum(model)
    assert _checksum(other) != _checksum(model)


def test_building_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=7, layers=1)
    assert torch.equal(torch.rand(3), expected)


# -- load_model errors ---------------------------------------------------------

def test_unreachable_hub_model_says_how_to_point_at_a_local_one():
    # local_files_only: the answer is the same offline or with an empty cache,
    # without waiting for the hub client's retries.
    with pytest.raises(ModelLoadError) as err:
        load_model(DEFAULT_MODEL, local_files_only=True)
    message = str(err.value)
    assert DEFAULT_MODEL in message
    assert "TABLOOP_MODEL" in message
    assert "tabloop model tiny" in message


def test_empty_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json") as err:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_missing_local_path_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as err:
        load_model(str(tmp_path / "nowhere"))
    assert "nowhere" in str(err.value)


def test_directory_without_weights_is_named(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_model(str(tmp_path))


def test_bad_dtype_is_named(tiny_dir):
    with pytest.raises(ValueError, match="int8"):
        load_model(str(tiny_dir), dtype="int8")
    model, _ = load_model(str(tiny_dir), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
