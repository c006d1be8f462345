"""The demo model: FIM sequences and the schedule by hand; a short pretraining run (loss falls), the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import make_settings
from trainer.proof.demo_model import (DemoConfig, build_demo_model, collate, fim_sequence, lr_at_progress, new_model,
                                training_progress)
from policy.models import MODEL_MARKER, load_model
from trainer.build_models import build_named_model

SPECIAL = {"prefix": 3, "middle": 4, "suffix": 5}
EOS = 0
SOURCES = Path(json.__file__).parent  # a small package of the standard library


def test_fim_sequence_layout():
    seq = fim_sequence([10, 11, 12], [20, 21], [30], special=SPECIAL, eos_id=EOS, seq_len=32)
    assert seq == [3, 10, 11, 12, 5, 20, 21, 4, 30, 0]


def test_fim_sequence_gives_way_from_the_top_of_the_prefix():
    prefix, suffix, middle = list(range(100, 140)), list(range(200, 240)), [30, 31]
    seq = fim_sequence(prefix, suffix, middle, special=SPECIAL, eos_id=EOS, seq_len=32)
    assert len(seq) == 32 and seq[-3:] == [30, 31, 0] and seq[0] == 3
    s, m = seq.index(5), seq.index(4)
    kept_prefix, kept_suffix = seq[1:s], seq[s + 1:m]
    assert kept_prefix == prefix[-len(kept_prefix):], "the end of the prefix (next to the cursor) stays"
    assert kept_suffix == suffix[:len(kept_suffix)], "the start of the suffix stays"
    assert len(kept_prefix) > len(kept_suffix) > 0


def test_collate_masks_padding_out_of_the_loss():
    ids, mask, labels = collate([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert labels.tolist() == [[1, 2, 3], [4, -100, -100]]


def test_lr_schedule_follows_steps_or_the_clock():
    assert lr_at_progress(0, 0.0, base=1.0, warmup=10) == pytest.approx(0.1)
    assert lr_at_progress(9, 0.5, base=1.0, warmup=10) == pytest.approx(1.0)  # still warming up
    assert lr_at_progress(10, 0.0, base=1.0, warmup=10) == pytest.approx(1.0)
    assert lr_at_progress(50, 0.5, base=1.0, warmup=10) == pytest.approx(1.0)
    assert lr_at_progress(80, 0.8, base=1.0, warmup=10) == pytest.approx(1.0)
    assert lr_at_progress(90, 0.9, base=1.0, warmup=10) == pytest.approx(0.55)
    assert lr_at_progress(99, 1.0, base=1.0, warmup=10) == pytest.approx(0.1)
    assert training_progress(30, 600, elapsed_s=60, budget_s=480) == pytest.approx(0.125)  # the clock leads
    assert training_progress(300, 600, elapsed_s=60, budget_s=480) == pytest.approx(0.5)  # the steps lead


def test_config_errors_are_named():
    with pytest.raises(ValueError, match="heads"):
        DemoConfig(hidden_size=100, heads=3)
    with pytest.raises(ValueError, match="steps"):
        DemoConfig(steps=0)


SMALL = DemoConfig(steps=30, vocab_size=400, hidden_size=64, layers=2, heads=2, kv_heads=1, intermediate_size=128,
                   seq_len=96, batch_size=8, lr=3e-3, warmup_steps=5, per_file=16)


def test_short_pretraining_lowers_the_loss_and_is_cached(tmp_path):
    out = tmp_path / "demo"
    logs = []
    path, marker = build_demo_model(out, SMALL, sources=SOURCES, progress=False, log=logs.append)
    assert path == out and not (tmp_path / "demo.building").exists()
    assert marker["steps_done"] == 30 and marker["stopped_by"] == "steps"
    assert marker["loss_last"] < marker["loss_first"] - 0.5, marker
    assert json.loads((out / MODEL_MARKER).read_text()) == marker

    model, tok = load_model(str(out))
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 64
    assert tok.convert_tokens_to_ids("<|fim_middle|>") == 4
    prompt = tok("<|fim_prefix|>import json\n\ndef load(path):\n    with open(path) as f:\n        return <|fim_suffix|>"
                 "\n<|fim_middle|>", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]

    # The same config again: the cached model, untouched.
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    logs.clear()
    again, marker2 = build_demo_model(out, SMALL, sources=SOURCES, progress=False, log=logs.append)
    assert again == out and marker2 == marker and weights.stat().st_mtime_ns == stamp and logs == []


def test_same_seed_same_weights(tmp_path):
    tiny = DemoConfig(**{**SMALL.__dict__, "steps": 3})
    a, _ = build_demo_model(tmp_path / "a", tiny, sources=SOURCES, progress=False, log=lambda _: None)
    b, _ = build_demo_model(tmp_path / "b", tiny, sources=SOURCES, progress=False, log=lambda _: None)
    ma, mb = (load_model(str(p))[0].state_dict() for p in (a, b))
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    _, tok = load_model(str(a))
    init0, init1 = (new_model(DemoConfig(**{**tiny.__dict__, "seed": s}), tok).state_dict() for s in (0, 1))
    assert not all(torch.equal(init0[k], init1[k]) for k in init0)


def test_model_demo_setting_serves_the_cached_demo_model(tmp_path):
    settings = make_settings(tmp_path, model="demo")
    out = tmp_path / "models" / "demo"
    build_demo_model(out, DemoConfig(**{**SMALL.__dict__, "steps": 2}), sources=SOURCES, progress=False,
                     log=lambda _: None)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert build_named_model(settings) == str(out.resolve())
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # found, not rebuilt
    assert build_named_model(make_settings(tmp_path, model="/some/dir")) == "/some/dir"
