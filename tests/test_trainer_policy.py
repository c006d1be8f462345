"""The policy update on the tiny model: alignment of logprobs, direction of updates, learning, saving."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.losses import BaselineState, baseline_advantages
from policy.models import load_model
from trainer.learner import PolicyTrainer, Sample, UpdateConfig, make_sample, sample_completions
from policy.weight_store import (Manifest, WeightStore, WeightStoreError, files_sha256, fold_statuses,
                                  promoted_version, version_event)


def _reference_logprobs(model, sample: Sample) -> list[float]:
    """Logprobs of the completion from one unpadded forward pass over prompt + completion."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    p = len(sample.prompt_ids)
    return [float(logp[p - 1 + j, t]) for j, t in enumerate(sample.completion_ids)]


def test_batched_logprobs_match_an_unpadded_forward(tiny_model):
    """Left padding, position ids and logits_to_keep must not move a single logprob."""
    model, tok = load_model(tiny_model)
    trainer = PolicyTrainer(model, tok, UpdateConfig(), full=True)
    samples = [make_sample(tok, "def add(a, b):\n    return", [10, 20, 30, 40], None, 0.0),
               make_sample(tok, "x = 1\n", [7], None, 0.0),
               make_sample(tok, "import os\nimport sys\n\nclass A:\n", [99, 3], None, 0.0)]
    batched = trainer.sequence_logprobs(samples)
    for sample, got in zip(samples, batched):
        assert got == pytest.approx(_reference_logprobs(trainer.model, sample), abs=1e-4)


@pytest.mark.parametrize("full", [True, False], ids=["full", "lora"])
def test_accepts_go_up_and_rejects_go_down(tiny_model, full):
    model, tok = load_model(tiny_model)
    trainer = PolicyTrainer(model, tok, UpdateConfig(lr=1e-2, warmup_updates=0), full=full, lora_rank=4, seed=0)
    good = make_sample(tok, "def f():\n    return", [11, 12], None, +0.5)
    bad = make_sample(tok, "def g():\n    return", [13, 14], None, -0.5)
    before = trainer.sequence_logprobs([good, bad])
    for _ in range(3):
        metrics = trainer.update([good, bad])
    after = trainer.sequence_logprobs([good, bad])
    assert sum(after[0]) > sum(before[0]) + 0.05, "the accepted completion did not become more likely"
    assert sum(after[1]) < sum(before[1]) - 0.05, "the rejected completion did not become less likely"
    assert metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(1e-2)
    assert {"policy_loss", "approx_kl", "clip_fraction", "entropy", "tokens_per_s", "update_seconds"} <= set(metrics)


def test_an_entropy_bonus_alone_moves_the_policy_towards_more_entropy(tiny_model):
    """Advantages of 0 give the clipped loss no gradient: with ``entropy_coef`` the update still raises the
    completion positions' entropy; without it (LoRA, B = 0 at the start) nothing moves at all."""
    model, tok = load_model(tiny_model)
    samples = [make_sample(tok, "def f():\n    return", [11, 12, 13], None, 0.0),
               make_sample(tok, "x = [", [7, 8], None, 0.0)]
    entropies = {}
    for coef in (0.0, 0.5):
        trainer = PolicyTrainer(load_model(tiny_model)[0], tok, UpdateConfig(lr=1e-2, warmup_updates=0,
                                                                            entropy_coef=coef), lora_rank=4, seed=0)
        first = trainer.update(samples)["entropy"]  # measured before the step
        second = trainer.update(samples)["entropy"]
        entropies[coef] = (first, second)
    assert entropies[0.0][1] == pytest.approx(entropies[0.0][0], abs=1e-6)
    assert entropies[0.5][1] > entropies[0.5][0] + 1e-3
    assert entropies[0.5][0] == pytest.approx(entropies[0.0][0], abs=1e-5)  # the same start


def test_ppo_epochs_step_once_per_pass_and_the_later_passes_see_a_moved_policy(tiny_model):
    """With behaviour = the policy before the update, one pass sees a ratio of exactly 1; a second pass over
    the same batch sees the policy its first step moved (ratio ≠ 1, approx KL > 0), and the optimizer stepped
    twice."""
    model, tok = load_model(tiny_model)
    samples = [make_sample(tok, "def f():\n    return", [11, 12], None, 0.5),
               make_sample(tok, "def g():\n    return", [13, 14], None, -0.5)]
    seen = {}
    for epochs in (1, 2):
        trainer = PolicyTrainer(load_model(tiny_model)[0], tok, UpdateConfig(lr=1e-2, warmup_updates=0, epochs=epochs),
                                full=True, seed=0)
        metrics = trainer.update(samples)  # the metrics are the last pass's
        steps = trainer.optimizer.state[next(p for p in trainer.model.parameters() if p.requires_grad)]["step"]
        seen[epochs] = (metrics["ratio_mean"], metrics["approx_kl"], int(steps))
    assert seen[1] == (pytest.approx(1.0, abs=1e-6), pytest.approx(0.0, abs=1e-7), 1)
    assert abs(seen[2][0] - 1.0) > 1e-4 and seen[2][1] > 1e-7 and seen[2][2] == 2


def test_prompt_tokens_get_no_gradient_signal(tiny_model):
    """Changing only how a prompt token would be predicted changes nothing: the loss sees completion tokens only."""
    model, tok = load_model(tiny_model)
    trainer = PolicyTrainer(model, tok, UpdateConfig(lr=1e-2, warmup_updates=0), full=True, seed=0)
    sample = Sample([5, 6, 7, 8], [9, 10], [-7.0, -7.5], 1.0)
    logits, targets, mask = trainer._forward(trainer.model, [sample])
    assert targets.tolist() == [[9, 10]] and mask.tolist() == [[1.0, 1.0]]
    with pytest.raises(ValueError, match="behaviour logprobs"):
        Sample([1], [2, 3], [-1.0], 1.0)
    with pytest.raises(ValueError, match="prompt token"):
        Sample([], [2], None, 1.0)


def test_learning_on_a_synthetic_reward(tiny_model):
    """Seeded: completions whose first token is in a chosen set are accepted (+0.75), the rest rejected (−0.25).

    The set is the tokens nearest (by embedding) to the base model's likeliest first token, sized to hold 20%
    of the base model's probability. Full fine-tuning: the tiny random model's logits are nearly flat
    (entropy ≈ ln |V|), and LoRA on its projections cannot scale them up. Margin: the accept rate over the
    last 5 updates beats the first 5 by at least 0.3.
    """
    torch.manual_seed(0)
    model, tok = load_model(tiny_model)
    prompts = [tok.encode(f"def f{i}(x):\n    return", add_special_tokens=False) for i in range(8)]
    with torch.no_grad():
        probs = sum(torch.softmax(model(input_ids=torch.tensor([p])).logits[0, -1], -1) for p in prompts) / 8
    emb = model.get_input_embeddings().weight
    likeliest = int(torch.argmax(probs))
    order = torch.argsort(torch.nn.functional.cosine_similarity(emb, emb[likeliest][None], dim=-1), descending=True)
    size = int((torch.cumsum(probs[order], 0) < 0.2).sum()) + 1
    accepted_first_tokens = set(order[:size].tolist())

    trainer = PolicyTrainer(model, tok, UpdateConfig(lr=1e-2, warmup_updates=1, micro_batch=16), full=True, seed=0)
    generator = torch.Generator().manual_seed(0)
    state = BaselineState.empty()
    accept_rates = []
    for update in range(30):
        batch_prompts = [prompts[(update * 16 + j) % 8] for j in range(16)]
        completions = sample_completions(trainer.model, batch_prompts, max_new_tokens=3, generator=generator,
                                         eos_id=tok.eos_token_id, pad_id=trainer.pad_id)
        rewards = [0.75 if ids[0] in accepted_first_tokens else -0.25 for ids, _ in completions]
        advantages, state = baseline_advantages(rewards, ["p"] * 16, state, decay=0.9)
        trainer.update([Sample(p, ids, lps, a) for p, (ids, lps), a in zip(batch_prompts, completions, advantages)])
        accept_rates.append(sum(r > 0 for r in rewards) / 16)
    first, last = sum(accept_rates[:5]) / 5, sum(accept_rates[-5:]) / 5
    assert last >= first + 0.3, f"accept rate {first:.2f} → {last:.2f}: {accept_rates}"


# -- the weight store ------------------------------------------------------------------


def _fields(**over):
    base = dict(parent_version=0, kind="LORA", trainer_step=3, episodes_consumed=5, episodes_trained=4,
                episodes_dropped={"stale": 1}, source_topic="t", source_offsets_start={"0": 0},
                source_offsets={"0": 5}, episodes_consumed_total=5, metrics={"reward_mean": 0.1})
    return {**base, **over}


@pytest.mark.parametrize("root", ["dir", "memory"])
def test_weight_store_round_trip(tmp_path, root):
    uri = str(tmp_path / "weights") if root == "dir" else f"memory://tabloop-test-{tmp_path.name}"
    store = WeightStore(uri, "/models/base")
    assert store.versions() == [] and store.latest() is None and store.next_version() == 1
    files = tmp_path / "files"
    files.mkdir()
    (files / "adapter_model.safetensors").write_bytes(b"weights-1")
    (files / "adapter_config.json").write_text("{}")
    m1 = store.save(1, files, _fields())
    assert m1.sha256 == files_sha256(files, ["adapter_config.json", "adapter_model.safetensors"])[0]
    assert m1.size_bytes == len(b"weights-1") + 2 and m1.files == ["adapter_config.json", "adapter_model.safetensors"]
    assert store.versions() == [1] and store.next_version() == 2
    with pytest.raises(WeightStoreError, match="already exists"):
        store.save(1, files, _fields())
    loaded = store.manifest(1)
    assert loaded == m1 and Manifest.from_json(loaded.to_json()) == m1
    local = store.materialize(1, tmp_path / "cache")
    assert (local / "adapter_model.safetensors").read_bytes() == b"weights-1"
    with pytest.raises(WeightStoreError, match="not in the weight store"):
        store.manifest(7)
    if root == "dir":
        # A corrupted file is caught by its hash.
        (local / "adapter_model.safetensors").write_bytes(b"weights-X")
        with pytest.raises(WeightStoreError, match="does not match"):
            store.materialize(1, tmp_path / "cache")
        (local / "adapter_model.safetensors").write_bytes(b"weights-1")

    # A version directory without a manifest (a crash mid-save) is not a version; the next save takes its number
    # (the versions announced stay 1..N) and none of the crashed save's files stay in it.
    store.fs.makedirs(store.version_dir(2), exist_ok=True)
    with store.fs.open(f"{store.version_dir(2)}/stray.bin", "wb") as f:
        f.write(b"from the save that crashed")
    assert store.versions() == [1] and store.next_version() == 2
    assert store.save(2, files, _fields(parent_version=1)).files == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.version_dir(2), detail=False)) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]

    # A version removed and its number used again by other weights: a cached copy of the old one is not served.
    store.materialize(2, tmp_path / "cache")
    store.remove(2)
    assert store.versions() == [1] and not store.fs.exists(store.version_dir(2))
    (files / "adapter_model.safetensors").write_bytes(b"weights-2, other")
    store.save(store.next_version(), files, _fields(parent_version=1))
    local = store.materialize(2, tmp_path / "cache")
    assert (local / "adapter_model.safetensors").read_bytes() == b"weights-2, other"


def test_status_fold_and_promoted_version():
    base = "/m"
    m = Manifest(version=1, parent_version=0, base_model=base, kind="LORA", uri="file:///w/1", sha256="a" * 64,
                 size_bytes=1, created_at_ms=0, **{k: v for k, v in _fields().items()
                                                   if k not in ("parent_version", "kind")})
    m2 = Manifest(**{**m.__dict__, "version": 2, "parent_version": 1})
    records = [version_event(m, "PROMOTED").record, version_event(m2, "CANDIDATE", {"canary_share": 0.2}).record]
    assert promoted_version(records, base) == 1
    statuses = fold_statuses(records, base)
    assert statuses[2].status == "CANDIDATE" and statuses[2].metrics["canary_share"] == 0.2
    records.append(version_event(m, "ROLLED_BACK").record)
    assert promoted_version(records, base) == 0
    assert promoted_version(records, "/other") == 0 and fold_statuses(records, "/other") == {}
    event = version_event(m, "PROMOTED")
    assert event.key == "/m@v1"  # one compacted record per version keeps every version's latest status
    assert json.loads(m.to_json())["source_offsets"] == {"0": 5}


# -- the ratio under the sampler's distribution ----------------------------------------


def _every_token_as_a_sample(trainer, tok, prompt_ids, temperature, top_p=1.0, *, record_temperature=None):
    """Each vocabulary token as a one-token completion, its advantage V·π_T,p(a): the PPO loss over them is
    then exactly the expectation under the sampler of a constant advantage (1), with no sampling noise."""
    from policy.sampling import sampling_log_probs

    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([prompt_ids])).logits[0, -1]
    drawn = sampling_log_probs(logits, temperature, top_p)  # the distribution the tokens are drawn from
    recorded_t = temperature if record_temperature is None else record_temperature
    recorded = sampling_log_probs(logits, recorded_t, top_p if record_temperature is None else 1.0)
    vocab = logits.shape[-1]
    return [Sample(list(prompt_ids), [a], [float(recorded[a])], vocab * float(drawn[a].exp()),
                   temperature=recorded_t, top_p=top_p if record_temperature is None else 1.0)
            for a in range(vocab) if torch.isfinite(drawn[a])]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_constant_advantage_gives_no_gradient_at_the_sampled_temperature(tiny_model, top_p):
    """At version 0 a constant advantage must not move the policy: E_π[∇ log π] = 0 — but only when the
    log-probability in the ratio is that of the distribution sampled (T = 0.5 here).

    The old trainer recomputed log π at T = 1 (and serving recorded T = 1 logprobs, so the ratio was 1):
    the same expectation then has a gradient, which sharpens or flattens the served distribution.
    """
    model, tok = load_model(tiny_model)
    trainer = PolicyTrainer(model, tok, UpdateConfig(lr=1e-9, warmup_updates=0, micro_batch=4096), full=True)
    prompt = tok.encode("def area(r):\n    return", add_special_tokens=False)
    samples = _every_token_as_a_sample(trainer, tok, prompt, 0.5, top_p)
    metrics = trainer.update(samples)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["grad_norm"] < 1e-5, metrics["grad_norm"]  # measured 3.5e-7 (float32 round-off)
    # The old way — drawn at T = 0.5, weighed at T = 1 — is biased: a clear gradient from the same expectation
    # (measured 0.08 at top-p 1, 0.20 at top-p 0.9).
    biased = trainer.update(_every_token_as_a_sample(trainer, tok, prompt, 0.5, top_p, record_temperature=1.0))
    assert biased["grad_norm"] > 0.01, biased["grad_norm"]


def test_sample_completions_records_the_distribution_it_draws_from(tiny_model):
    """The behaviour logprob of a drawn token is log π_T,p (what a Sample at T, p is trained against), not T = 1."""
    from policy.sampling import sampling_log_probs

    model, tok = load_model(tiny_model)
    prompts = [tok.encode("def f(x):\n    return", add_special_tokens=False), tok.encode("import os\n", add_special_tokens=False)]
    drawn = sample_completions(model, prompts, max_new_tokens=3, temperature=0.5, top_p=0.9,
                               generator=torch.Generator().manual_seed(0))
    for prompt, (ids, lps) in zip(prompts, drawn):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]
        want = [float(sampling_log_probs(logits[len(prompt) - 1 + j], 0.5, 0.9)[t]) for j, t in enumerate(ids)]
        assert lps == pytest.approx(want, abs=1e-4)
    with pytest.raises(ValueError, match="greedy"):
        sample_completions(model, prompts, max_new_tokens=1, temperature=0.0)


def test_a_greedy_completion_is_not_a_sample_and_served_prompt_ids_are_kept(tiny_model):
    with pytest.raises(ValueError, match="greedy"):
        Sample([1], [2], [0.0], 1.0, temperature=1e-4)
    _, tok = load_model(tiny_model)
    # The served ids are trained as they are, even where re-encoding the text would give other ids.
    served = [5, 6, 7] + tok.encode("é", add_special_tokens=False)[:1]  # a trim that split a UTF-8 character
    s = make_sample(tok, tok.decode(served), [9], [-1.0], 0.5, prompt_ids=served, temperature=0.7, top_p=0.95)
    assert s.prompt_ids == served and (s.temperature, s.top_p) == (0.7, 0.95)
    assert tok.encode(tok.decode(served), add_special_tokens=False) != served
    # Old episodes have none: the text is encoded, its end kept.
    old = make_sample(tok, "x = 1\ny = 2\n", [9], None, 0.0, max_prompt_tokens=3)
    assert old.prompt_ids == tok.encode("x = 1\ny = 2\n", add_special_tokens=False)[-3:]


class _IgnoresLogitsToKeep(torch.nn.Module):
    """A causal LM that returns logits for every position whatever logits_to_keep says (as some models do)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, logits_to_keep=None, **kwargs):
        return self.inner(**kwargs)


def test_a_model_that_ignores_logits_to_keep_is_read_at_the_right_positions(tiny_model):
    model, tok = load_model(tiny_model)
    samples = [make_sample(tok, "def add(a, b):\n    return", [10, 20, 30], None, 0.0),
               make_sample(tok, "x = 1\n", [7], None, 0.0)]
    want = PolicyTrainer(model, tok, UpdateConfig(), full=True).sequence_logprobs(samples)
    got = PolicyTrainer(_IgnoresLogitsToKeep(model), tok, UpdateConfig(), full=True).sequence_logprobs(samples)
    for w, g in zip(want, got):
        assert g == pytest.approx(w, abs=1e-5)
    from trainer.learner import kept_logits

    with pytest.raises(RuntimeError, match="logits_to_keep"):
        kept_logits(torch.zeros((1, 5, 3)), 3, 9)


def test_the_kl_reference_stays_the_base_when_a_full_fine_tune_resumes(tiny_model, tmp_path):
    """Resuming from a saved FULL version must not make the saved weights the reference (kl_ref 0 after it)."""
    from tests.conftest import make_settings
    from trainer.online import load_policy

    settings = make_settings(tmp_path / "state", model=tiny_model, trainer_full_finetune=True, trainer_kl_coef=0.1,
                             trainer_lr=1e-2, trainer_warmup_updates=0, trainer_device="cpu")
    store = WeightStore(settings.effective_weight_store, tiny_model)
    first = load_policy(settings, store, None)
    tok = first.tokenizer
    samples = [make_sample(tok, "def f():\n    return", [11, 12], None, 0.5),
               make_sample(tok, "def g():\n    return", [13, 14], None, -0.5)]
    for _ in range(3):
        first.update(samples)
    files = tmp_path / "v1"
    first.save(files)
    manifest = store.save(1, files, _fields(kind="FULL"))
    resumed = load_policy(settings, store, manifest)
    assert resumed.full
    # Both measure the KL at the same (saved) weights, before their step.
    before, after = first.update(samples)["kl_ref"], resumed.update(samples)["kl_ref"]
    assert before > 1e-3
    assert after == pytest.approx(before, rel=1e-3)


def test_a_stale_rejected_episode_is_bounded_by_the_dual_clip(tiny_model):
    """A < 0 and a ratio of 20 (the current policy now likes the rejected tokens 20× more than the stale one
    that served them): plain PPO's loss is 20·|A| with a gradient to match; the dual clip caps it at 3·|A|."""
    import math

    model, tok = load_model(tiny_model)
    trainer = PolicyTrainer(model, tok, UpdateConfig(lr=1e-9, warmup_updates=0), full=True)
    sample = make_sample(tok, "def f():\n    return", [11, 12, 13], None, -1.0)
    current = trainer.sequence_logprobs([sample])[0]

    def update(ratio, clip_ratio_c):
        trainer.config = UpdateConfig(lr=1e-9, warmup_updates=0, clip_ratio_c=clip_ratio_c)
        stale = Sample(sample.prompt_ids, sample.completion_ids, [lp - math.log(ratio) for lp in current], -1.0)
        return trainer.update([stale])

    fresh, plain, capped = update(1.0, 3.0), update(20.0, math.inf), update(20.0, 3.0)
    assert plain["policy_loss"] == pytest.approx(20.0, rel=1e-3) and plain["grad_norm"] > 10 * fresh["grad_norm"]
    assert capped["policy_loss"] == pytest.approx(3.0) and capped["dual_clip_fraction"] == 1.0
    assert capped["grad_norm"] == 0.0


def test_an_episode_served_by_these_weights_starts_at_ratio_one_whatever_the_servers_numerics(tiny_model):
    """Issue 43, item 3: a sample served by the weights being trained whose server logprobs are off by the
    server's numerics (here: every token 0.1 nats less likely, as a bf16 replica might say) — the ratio starts at
    1 (the trainer's own logprobs are its denominator), the gap is measured, and each token is weighed by the
    truncated importance weight exp(0.1). Without the flag the same sample's ratio starts at exp(0.1)."""
    import math

    model, tok = load_model(tiny_model)
    sample = make_sample(tok, "def f():\n    return", [11, 12, 13], None, 1.0)
    trainer = PolicyTrainer(model, tok, UpdateConfig(lr=1e-9, warmup_updates=0), full=True)
    current = trainer.sequence_logprobs([sample])[0]
    served = [lp - 0.1 for lp in current]

    corrected = trainer.update([Sample(sample.prompt_ids, sample.completion_ids, served, 1.0, same_weights=True)])
    assert corrected["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert corrected["logprob_gap_mean"] == pytest.approx(0.1, abs=1e-4)
    assert corrected["logprob_gap_tokens"] == 3.0
    # −min(r·A, clip(r)·A) at r = 1, A = 1, weighed by exp(0.1): −1.105 per token.
    assert corrected["policy_loss"] == pytest.approx(-math.exp(0.1), abs=1e-3)

    plain = trainer.update([Sample(sample.prompt_ids, sample.completion_ids, served, 1.0)])
    assert plain["ratio_mean"] == pytest.approx(math.exp(0.1), abs=1e-3) and plain["logprob_gap_tokens"] == 0.0
    trainer.config = UpdateConfig(lr=1e-9, warmup_updates=0, tis_cap=0.0)  # off: measured, not corrected
    off = trainer.update([Sample(sample.prompt_ids, sample.completion_ids, served, 1.0, same_weights=True)])
    assert off["ratio_mean"] == pytest.approx(math.exp(0.1), abs=1e-3)
    assert off["logprob_gap_mean"] == pytest.approx(0.1, abs=1e-4)
