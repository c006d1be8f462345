"""The loss math against numbers worked by hand (the working is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.canary import CanaryTally, canary_decision
from trainer.losses import (LOGPROB_FLOOR, BaselineState, baseline_advantages, completion_mask, entropy_from_logits,
                            gap_figures, grpo_advantages, kl_k3, masked_mean, policy_token_logprobs,
                            ppo_clipped_loss, rloo_advantages, token_logprobs, train_inference_correction)


def test_ppo_ratio_and_clipping_positive_advantage():
    # Token 1: ratio 1.5 → clipped to 1.2; min(1.5, 1.2)·1 = 1.2 (the clip binds: no gradient).
    # Token 2: ratio 0.5 → clip 0.8; min(0.5, 0.8) = 0.5 (unclipped: gradient flows).
    # Loss = −(1.2 + 0.5) / 2 = −0.85; one token of two clipped.
    logprobs = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    behaviour = torch.zeros((1, 2))
    out = ppo_clipped_loss(logprobs, behaviour, torch.tensor([1.0]), torch.ones((1, 2)), clip_eps=0.2)
    assert out.loss.item() == pytest.approx(-0.85)
    assert out.clip_fraction == pytest.approx(0.5)
    assert out.ratio_mean == pytest.approx(1.0)
    out.loss.backward()
    # d/dlogp of −ratio/2 = −ratio/2: 0 where clipped, −0.25 at token 2.
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -0.25])
    # KL(behaviour‖current), k3 per token with r = π/μ: r − 1 − ln r: 0.5 − ln1.5 = 0.094535; ln2 − 0.5 = 0.193147.
    assert out.approx_kl == pytest.approx((0.0945349 + 0.1931472) / 2, abs=1e-6)


def test_ppo_negative_advantage_clips_the_other_side():
    # A = −1. Token 1: min(−1.5, −1.2) = −1.5 (unclipped). Token 2: min(−0.5, −0.8) = −0.8 (clipped).
    # Loss = (1.5 + 0.8) / 2 = 1.15.
    logprobs = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    out = ppo_clipped_loss(logprobs, torch.zeros((1, 2)), torch.tensor([-1.0]), torch.ones((1, 2)), clip_eps=0.2)
    assert out.loss.item() == pytest.approx(1.15)
    assert out.clip_fraction == pytest.approx(0.5)
    out.loss.backward()
    # d/dlogp of ratio/2 = 1.5/2 at token 1; 0 at the clipped token 2. Descending lowers the rejected token.
    assert logprobs.grad[0].tolist() == pytest.approx([0.75, 0.0])


def test_ppo_ignores_masked_tokens():
    # The padding position has an absurd ratio (e^5) and must change nothing.
    logprobs = torch.tensor([[0.0, 5.0], [0.1, 0.0]])
    behaviour = torch.zeros((2, 2))
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    adv = torch.tensor([2.0, 1.0])
    out = ppo_clipped_loss(logprobs, behaviour, adv, mask, clip_eps=0.2)
    # Row 1 token 1: ratio 1 → −2. Row 2: ratio e^0.1 = 1.10517 (inside the clip) → −1.10517; ratio 1 → −1.
    assert out.loss.item() == pytest.approx(-(2 + 1.1051709 + 1) / 3)
    assert out.clip_fraction == 0.0


def test_completion_mask_covers_completion_tokens_only():
    assert completion_mask([2, 1], [2, 3], 5).tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]
    with pytest.raises(ValueError, match="exceed"):
        completion_mask([3], [3], 5)
    assert masked_mean(torch.tensor([[1.0, 100.0]]), torch.tensor([[1.0, 0.0]])).item() == 1.0
    assert masked_mean(torch.tensor([[1.0]]), torch.tensor([[0.0]])).item() == 0.0  # empty mask: 0, not NaN


def test_baseline_advantages_per_project_running_mean():
    # New project: the baseline is the batch mean (0.75 − 0.25 + 0.75) / 3 = 0.41667.
    adv, state = baseline_advantages([0.75, -0.25, 0.75], ["a", "a", "a"], BaselineState.empty(), decay=0.9)
    assert adv == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    # The first episodes are a plain mean (weights 1, 1/2, 1/3).
    assert state.means["a"] == pytest.approx(5 / 12) and state.counts["a"] == 3
    # Next batch: the stored mean is the baseline; the update weight is max(1/4, 1 − 0.5) = 0.5.
    adv, state = baseline_advantages([-0.25, 0.75], ["a", "b"], state, decay=0.5)
    assert adv == pytest.approx([-0.25 - 5 / 12, 0.0])  # b is new: its own mean, advantage 0
    assert state.means["a"] == pytest.approx(5 / 12 + 0.5 * (-0.25 - 5 / 12))
    assert state.means["b"] == pytest.approx(0.75)
    # A reject always sits below a project's usual reward here: its advantage is negative (pushed down).
    with pytest.raises(ValueError, match="2 rewards but 1 projects"):
        baseline_advantages([1.0, 0.0], ["a"], state)


def test_grpo_advantages():
    # Group x: mean 0.5, population std 0.5 → ±1. Group y: all equal → 0. Group z: one sample → 0.
    adv = grpo_advantages([1, 0, 0, 1, 2, 2, 7], ["x", "x", "x", "x", "y", "y", "z"], eps=0.0 + 1e-12)
    assert adv == pytest.approx([1, -1, -1, 1, 0, 0, 0])
    # Without the std: just centred. Rewards 3, 1, 2 → mean 2 → 1, −1, 0.
    assert grpo_advantages([3, 1, 2], [0, 0, 0], scale_by_std=False) == pytest.approx([1, -1, 0])


def test_rloo_advantages():
    # [1, 0, 0]: 1 − mean(0, 0) = 1; 0 − mean(1, 0) = −0.5 (twice). Equals k/(k−1)·(r − mean) = 1.5·(r − 1/3).
    assert rloo_advantages([1, 0, 0], ["g", "g", "g"]) == pytest.approx([1, -0.5, -0.5])
    assert rloo_advantages([4, 2, 5, 5], [1, 1, 2, 2]) == pytest.approx([2, -2, 0, 0])
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages([1, 2, 3], ["a", "a", "b"])


def test_kl_k3_and_entropy_and_token_logprobs():
    # log p = ln 0.5, log q = ln 0.25: r = 2 → 2 − ln 2 − 1 = 0.30685.
    kl = kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert kl.item() == pytest.approx(2 - math.log(2) - 1)
    assert kl_k3(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()  # never negative
    uniform = torch.zeros((1, 1, 4))
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(4))
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probabilities 1/4, 3/4
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))


def test_canary_rule():
    # Not enough episodes of either version yet: no decision.
    assert canary_decision(9, 9, 5, 10, min_episodes=10, margin=0.05) is None
    # 0.50 vs 0.52: within the 0.05 margin → promoted. 0.40 vs 0.52 → rolled back.
    assert canary_decision(10, 20, 13, 25, min_episodes=20, margin=0.05) == "PROMOTED"
    assert canary_decision(8, 20, 13, 25, min_episodes=20, margin=0.05) == "ROLLED_BACK"
    tally = CanaryTally(candidate=2, baseline=1, since_ms=1000)
    tally.add(2, "ACCEPTED", 2000, completion_id="a")
    tally.add(2, "REJECTED", 2000, completion_id="b")
    tally.add(2, "ACCEPTED", 500, completion_id="c")  # before the canary started: not counted
    tally.add(3, "ACCEPTED", 2000, completion_id="d")  # another version
    tally.add(1, "IGNORED", 2000, completion_id="e")  # undecided
    tally.add(1, "ACCEPTED", 2000, completion_id="c1")
    tally.add(1, "ACCEPTED", 2000, completion_id="c1")  # the same completion from the other reader: once
    assert tally.summary() == {"canary_candidate_episodes": 2.0, "canary_candidate_accept_rate": 0.5,
                               "canary_baseline_episodes": 1.0, "canary_baseline_accept_rate": 1.0}
    assert tally.decide(min_episodes=1, margin=0.1) == "ROLLED_BACK"


def test_sampling_log_probs_by_hand():
    from policy.sampling import sampling_log_probs

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    # T = 1, no cut: the softmax itself.
    assert torch.allclose(sampling_log_probs(logits, 1.0, 1.0).exp(), torch.tensor([[0.5, 0.3, 0.2]]), atol=1e-6)
    # top-p 0.7: the nucleus is {0.5, 0.3} (0.5 alone is short of 0.7), renormalised to 0.625 / 0.375.
    cut = sampling_log_probs(logits, 1.0, 0.7)
    assert torch.allclose(cut[0, :2].exp(), torch.tensor([0.625, 0.375]), atol=1e-6)
    assert cut[0, 2] == float("-inf")
    # T = 0.5 squares the probabilities before normalising: 0.25 : 0.09 : 0.04.
    half = sampling_log_probs(logits, 0.5, 1.0).exp()
    assert torch.allclose(half, torch.tensor([[0.25, 0.09, 0.04]]) / 0.38, atol=1e-6)
    # greedy: the point mass on the argmax.
    greedy = sampling_log_probs(logits, 0.0, 1.0)
    assert greedy[0, 0] == 0.0 and torch.isinf(greedy[0, 1:]).all()


def test_approx_kl_is_kl_of_behaviour_to_current():
    # The tokens are drawn from the behaviour policy μ = (3/4, 1/4); the current policy is π = (1/2, 1/2).
    # Four tokens in μ's proportions (a, a, a, b) make the sample mean the exact expectation under μ, and
    # E_μ[r − 1 − ln r] with r = π/μ is E_μ[π/μ] − 1 + KL(μ‖π) = KL(μ‖π)
    # = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.304099 − 0.173287 = 0.130812.
    # (The arguments reversed give E_μ[μ/π − 1 − ln(μ/π)] = 1.25 − 1 − 0.130812 = 0.119188.)
    behaviour = torch.tensor([[math.log(0.75)] * 3 + [math.log(0.25)]])
    current = torch.full((1, 4), math.log(0.5))
    out = ppo_clipped_loss(current, behaviour, torch.tensor([0.0]), torch.ones((1, 4)))
    assert out.approx_kl == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), abs=1e-6)


def test_dual_clip_caps_negative_advantages_of_stale_tokens():
    # A = −1, ratio 20 (a stale episode whose token the current policy now likes 20× more).
    # PPO alone: −min(20·(−1), 1.2·(−1)) = 20 per token, gradient 20. Dual clip c = 3: min(20, 3) = 3, no gradient.
    logprobs = torch.tensor([[math.log(20.0), math.log(2.0)]], requires_grad=True)
    out = ppo_clipped_loss(logprobs, torch.zeros((1, 2)), torch.tensor([-1.0]), torch.ones((1, 2)), clip_ratio_c=3.0)
    # Token 2, ratio 2 < c: the plain PPO term, max(2, 1.2) = 2, gradient 2. Loss = (3 + 2) / 2.
    assert out.loss.item() == pytest.approx(2.5)
    assert out.dual_clip_fraction == pytest.approx(0.5)
    out.loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 1.0])  # d/dlogp of ratio/2 at ratio 2 is 1
    # A positive advantage is untouched by c: ratio 20 is PPO-clipped at 1.2 → loss −1.2, no gradient.
    pos = ppo_clipped_loss(torch.tensor([[math.log(20.0)]]), torch.zeros((1, 1)), torch.tensor([1.0]),
                           torch.ones((1, 1)), clip_ratio_c=3.0)
    assert pos.loss.item() == pytest.approx(-1.2) and pos.dual_clip_fraction == 0.0
    # c = inf: the plain PPO loss, (20 + 2) / 2.
    plain = ppo_clipped_loss(torch.tensor([[math.log(20.0), math.log(2.0)]]), torch.zeros((1, 2)),
                             torch.tensor([-1.0]), torch.ones((1, 2)), clip_ratio_c=math.inf)
    assert plain.loss.item() == pytest.approx(11.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clipped_loss(logprobs, torch.zeros((1, 2)), torch.tensor([-1.0]), torch.ones((1, 2)), clip_ratio_c=1.0)


def test_policy_token_logprobs_per_row_sampler_and_floor():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]], [[0.5, 0.3, 0.2]]])).requires_grad_(True)
    targets = torch.tensor([[1], [2]])
    # Row 0 at T = 0.5: 0.09 / 0.38. Row 1, top-p 0.7: token 2 is outside the nucleus {0, 1} → the floor, not −inf.
    lp = policy_token_logprobs(logits, targets, [0.5, 1.0], [1.0, 0.7])
    assert lp[0, 0].item() == pytest.approx(math.log(0.09 / 0.38), abs=1e-6)
    assert lp[1, 0].item() == LOGPROB_FLOOR
    # Through the loss: a finite, tiny ratio and a finite gradient (no NaN from −inf).
    out = ppo_clipped_loss(lp, torch.log(torch.tensor([[0.3], [0.2]])), torch.tensor([1.0, -1.0]), torch.ones((2, 1)))
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and math.isfinite(out.approx_kl)
    assert torch.isfinite(logits.grad).all() and logits.grad[1].abs().sum() == 0.0
    with pytest.raises(ValueError, match="greedy"):
        policy_token_logprobs(logits, targets, [0.0, 1.0], [1.0, 1.0])


def test_the_train_inference_correction_by_hand():
    # Two rows of two tokens. Row 0 was served by the weights being trained: the trainer finds its tokens at
    # probabilities 0.5 and 0.9, the server said 0.4 and 0.3 (bf16 numerics, say). Row 1 came from an older
    # version: the trainer's 0.2, 0.2 against the server's 0.1, 0.1, a policy change, not numerics.
    trainer = torch.log(torch.tensor([[0.5, 0.9], [0.2, 0.2]]))
    server = torch.log(torch.tensor([[0.4, 0.3], [0.1, 0.1]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    same = torch.tensor([True, False])
    c = train_inference_correction(trainer, server, mask, same, cap=2.0)
    # Row 0: the trainer's own logprobs are the ratio's denominators (ratio 1 at the first step), each token
    # weighed by min(π/μ, 2): 0.5/0.4 = 1.25, 0.9/0.3 = 3 → 2. Row 1: the server's, weight 1.
    assert torch.allclose(c.denominators, torch.stack([trainer[0], server[1]]))
    assert c.weights.flatten().tolist() == pytest.approx([1.25, 2.0, 1.0, 1.0])
    # The gap, over row 0's two tokens only: |ln 1.25| = 0.2231, |ln 3| = 1.0986; mean 0.6609.
    assert (c.tokens, round(c.gap_mean, 4), round(c.gap_max, 4)) == (2, 0.6609, 1.0986)
    # Off (cap 0): measured all the same, corrected nowhere.
    off = train_inference_correction(trainer, server, mask, same, cap=0.0)
    assert torch.equal(off.denominators, server) and off.weights.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert off.gap_mean == c.gap_mean
    # An update's figures weigh each micro-batch's mean by its tokens: (0.6609·2 + 0.1·1) / 3.
    other = train_inference_correction(torch.tensor([[0.0]]), torch.tensor([[-0.1]]), torch.ones(1, 1),
                                       torch.tensor([True]), cap=2.0)
    figures = gap_figures([c, other])
    assert figures["logprob_gap_tokens"] == 3.0 and figures["logprob_gap_max"] == pytest.approx(1.0986, abs=1e-4)
    assert figures["logprob_gap_mean"] == pytest.approx((c.gap_mean * 2 + 0.1) / 3)
    assert gap_figures([]) == {"logprob_gap_mean": 0.0, "logprob_gap_max": 0.0, "logprob_gap_tokens": 0.0}


def test_token_weights_scale_each_tokens_surrogate():
    # A = +1, ratios 1 (no clip): per-token loss −1 each; weights 2 and 0.5 → (−2 − 0.5) / 2 = −1.25, and the
    # gradient of each token's logprob is −weight/2.
    logprobs = torch.zeros((1, 2), requires_grad=True)
    out = ppo_clipped_loss(logprobs, torch.zeros((1, 2)), torch.tensor([1.0]), torch.ones((1, 2)),
                           token_weights=torch.tensor([[2.0, 0.5]]))
    assert out.loss.item() == pytest.approx(-1.25)
    out.loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-1.0, -0.25])
