"""`tabloop model teach-fim` on a tiny Llama without FIM tokens (the shape of SmolLM2): the written model has
Qwen's FIM tokens, so every path prompts it with the code after the cursor, and the fine-tune lowered its loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policy.fim import prompt_format, prompt_token_ids
from policy.models import load_model
from trainer.teach_fim import TAUGHT_TOKENS, TeachFimConfig, teach_fim

SOURCES = Path(__file__).resolve().parents[1] / "trainer"  # Python files to cut FIM examples from


def test_teach_fim_gives_a_model_without_fim_tokens_qwens_template(tiny_llama, tmp_path):
    _, before = load_model(tiny_llama)
    assert prompt_format(before).kind == "prefix"
    config = TeachFimConfig(steps=40, minutes=5, batch_size=4, lr=1e-2, warmup_steps=2, lora_rank=4, seq_len=128,
                            per_file=2)
    out, marker = teach_fim(Path(tiny_llama), tmp_path / "taught", config, sources=SOURCES, progress=False,
                            log=lambda _: None)
    assert marker["steps_done"] == 40 and marker["loss_last"] < marker["loss_first"], marker
    model, tok = load_model(str(out))
    assert prompt_format(tok).kind == "qwen"
    new_ids = tok.convert_tokens_to_ids(list(TAUGHT_TOKENS))
    assert new_ids == list(range(len(before), len(before) + 3)), "the tokens go after the old vocabulary"
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    # The rows were trained (they started at the old rows' mean) and the output head still ties to them.
    rows = model.get_input_embeddings().weight[new_ids]
    assert not torch.allclose(rows[0], rows[1]), "the three new rows were not trained apart"
    assert torch.equal(model.get_output_embeddings().weight[new_ids], rows)
    # Continue's Qwen FIM prompt now reaches it whole: the suffix is in the ids fed to the model.
    ids, text = prompt_token_ids(tok, "<|fim_prefix|>def f(x):\n    return <|fim_suffix|>\nprint(f(2))<|fim_middle|>", 256)
    assert text.startswith(TAUGHT_TOKENS[0]) and "print(f(2))" in text and ids[0] == new_ids[0]
    # The front door stops at a FIM token the model emits (it is one of its special tokens now).
    assert set(TAUGHT_TOKENS) <= set(prompt_format(tok).stop_words)


def test_a_model_with_fim_tokens_needs_no_teaching(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="already has FIM tokens"):
        teach_fim(Path(tiny_model), tmp_path / "x", TeachFimConfig(steps=1), progress=False, log=lambda _: None)
    assert not (tmp_path / "x").exists()
