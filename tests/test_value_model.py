"""The value model (policy/value_model.py): its fit and its choice by hand on a tiny example, its features by
hand, and the shared-prompt reader against plain full forward passes of a real (tiny) model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policy.value_model import (BASE_FEATURES, Read, choose, expected_chars, fit_projection, fit_value_model,
                                request_features, score_candidates)


def test_fit_and_choice_by_hand():
    # One binary feature, an intercept, no penalty: the model is saturated, so its maximum-likelihood fit
    # gives each group its own acceptance rate. x = 0: 1 of 4 accepted → 1/4; x = 1: 3 of 4 → 3/4.
    # On the raw scale that is intercept log(1/3) and slope log(9) (log-odds −log 3 and +log 3).
    x = np.array([[0.0]] * 4 + [[1.0]] * 4)
    y = [True, False, False, False, True, True, True, False]
    head = fit_value_model(x, y, l2=0.0)
    p = head.accept_probability(np.array([[0.0], [1.0]]))
    assert p == pytest.approx([0.25, 0.75], abs=1e-6)
    slope = head.coef[0] / head.scale[0]
    assert slope == pytest.approx(math.log(9), abs=1e-5)
    assert head.intercept - slope * head.mean[0] == pytest.approx(math.log(1 / 3), abs=1e-5)

    # A request: greedy "abcdefgh" (x = 0, worth 1/4 × 8 = 2 characters) and a sample "abcd" (x = 1,
    # worth 3/4 × 4 = 3): the sample is shown. Were it "ab" (3/4 × 2 = 1.5), greedy would be.
    texts = ["abcdefgh", "abcd"]
    values = expected_chars(head.accept_probability(np.array([[0.0], [1.0]])), texts)
    assert values == pytest.approx([2.0, 3.0], abs=1e-5)
    assert choose(values, texts) == 1
    short = ["abcdefgh", "ab"]
    assert choose(expected_chars(head.accept_probability(np.array([[0.0], [1.0]])), short), short) == 0
    # Under a show threshold of 3.5 expected characters even the best (3) is not shown.
    assert choose(values, texts, threshold=3.5) is None
    assert choose(values, texts, threshold=2.5) == 1


def test_choice_prefers_greedy_on_ties_and_never_picks_nothing():
    assert choose([3.0, 3.0, 1.0], ["a", "b", "c"]) == 0
    assert choose([1.0, 3.0, 3.0], ["a", "b", "c"]) == 1  # the first of the best when greedy is not among them
    assert choose([5.0, 3.0], [None, "b"]) == 1  # greedy shows nothing: it cannot be chosen
    assert choose([5.0, 3.0], [None, None]) is None
    assert choose([2.0, 3.0], ["a", "b"], default=1) == 1


def test_request_features_by_hand():
    reads = [Read((-0.5, -1.5), (-1.0, -3.0)), Read((-0.1,), (-0.5, -0.5)), Read((-2.0,), (-4.0, -4.0))]
    x = request_features(["a b", "a", "a"], reads)
    assert request_features(["a", "b", "a"], reads)[:, BASE_FEATURES.index("same_as_greedy")].tolist() == [1, 0, 1]
    assert x.shape == (3, len(BASE_FEATURES))
    row = dict(zip(BASE_FEATURES, x[1]))
    assert row["suffix_mean_logprob"] == pytest.approx(-0.5)
    assert row["suffix_vs_greedy"] == pytest.approx(-0.5 - (-2.0))
    assert (row["cand_mean_logprob"], row["cand_min_logprob"], row["cand_sum_logprob"]) == pytest.approx(
        (-0.1, -0.1, -0.1))
    assert row["log_chars"] == pytest.approx(math.log(2))
    assert row["agreement"] == pytest.approx(2 / 3)  # "a" is two of the three candidates
    assert row["same_as_greedy"] == 0 and dict(zip(BASE_FEATURES, x[0]))["same_as_greedy"] == 1
    # log p(candidate, suffix): −6, −1.1, −10; the best is the second, the others are that far below it.
    assert x[:, BASE_FEATURES.index("posterior_gap")] == pytest.approx([-4.9, 0.0, -8.9])
    # A candidate that shows nothing is never the best posterior, and agrees with nobody.
    y = request_features([None, "a"], [Read((), (0.0,)), Read((-3.0,), (-1.0,))])
    assert y[:, BASE_FEATURES.index("posterior_gap")] == pytest.approx([0.0, 0.0])  # clipped at 0 for the empty
    assert y[0, BASE_FEATURES.index("agreement")] == 0.0


def test_projection_keeps_the_direction_that_varies():
    rng = np.random.default_rng(0)
    along = rng.normal(size=(50, 1)) * np.array([[3.0, 0.0, 0.0]]) + rng.normal(size=(50, 3)) * 0.01
    p = fit_projection(along, 1)
    assert abs(p.components[0, 0]) == pytest.approx(1.0, abs=1e-3)
    assert p(along).shape == (50, 1)
    assert fit_projection(along, 0)(along).shape == (50, 0)


def test_shared_prompt_reader_matches_full_forward(tiny_llama):
    import torch

    from policy.models import load_model

    model, tokenizer = load_model(tiny_llama)
    prompt = tokenizer.encode("def add(a, b):\n    return", add_special_tokens=False)
    candidates = [" a + b", " a - b + 1", ""]
    suffix = "\n\n\ndef sub(a, b):\n    return a - b\n"
    reads = score_candidates(model, tokenizer, prompt, candidates, suffix, suffix_tokens=6)
    suffix_ids = tokenizer.encode(suffix, add_special_tokens=False)[:6]
    assert len(reads) == 3
    for text, read in zip(candidates, reads):
        cand = tokenizer.encode(text, add_special_tokens=False) if text else []
        ids = prompt + cand + suffix_ids
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        logprobs = torch.log_softmax(out.logits.float(), -1)[0]
        want = [logprobs[p - 1, ids[p]].item() for p in range(len(prompt), len(ids))]
        assert len(read.cand_logprobs) == len(cand) and len(read.suffix_logprobs) == len(suffix_ids)
        assert list(read.cand_logprobs) + list(read.suffix_logprobs) == pytest.approx(want, abs=1e-4)
        hidden = out.hidden_states[-1][0].float().numpy()
        assert read.hidden_suffix == pytest.approx(hidden[-1], abs=1e-4)
        assert read.hidden_end == pytest.approx(hidden[len(prompt) + len(cand) - 1], abs=1e-4)


def test_the_parameter_free_choosers_by_hand():
    # Two tasks (bench candidates --heldout measures these choosers: they fit nothing). Task 0's true rest of
    # line is "x + 1"; greedy writes "x + 2" (rejected), the two samples "x + 1" (accepted, 5 characters) and
    # "y". Task 1's is "ok"; greedy writes it (accepted, 2), the samples "no" twice.
    from rewards.spec import RewardSpec
    from tabloop.candidates_bench import build_requests, measure_choosers, parameter_free_choosers
    from trainer.proof.simulate import UserModel
    from trainer.proof.tasks import FimTask

    tasks = [FimTask("t0", "a = ", "\nb = 1\n", "x + 1"), FimTask("t1", "s = ", "\n", "ok")]
    completions = [["x + 2", "x + 1", "y"], ["ok", "no", "no"]]

    def read(mean_suffix, cand):
        return Read(cand_logprobs=(cand,), suffix_logprobs=(mean_suffix,), hidden_end=np.zeros(2),
                    hidden_suffix=np.zeros(2))

    # The suffix reads best after task 0's right sample and after task 1's greedy; the candidates' own
    # logprobs favour greedy in task 0: the suffix likelihood picks the right one, the posterior (−0.1 − 0.5
    # against −1.0 − 0.2 = −1.2: greedy) does not.
    reads = [[read(-0.5, -0.1), read(-0.2, -1.0), read(-3.0, -2.0)], [read(-0.1, -0.1), read(-2.0, -0.5),
                                                                         read(-2.0, -0.5)]]
    user, spec = UserModel("exact"), RewardSpec()
    requests = build_requests(tasks, completions, reads, user, spec)
    measured = measure_choosers(parameter_free_choosers(2, 0.7, user), requests, tasks, user, spec)
    greedy, oracle = measured["greedy, always shown"], measured["oracle best of 3"]
    suffix, posterior = measured["(a) suffix likelihood after candidate"], measured[
        "posterior: log p(candidate) + log p(suffix after it)"]
    majority = measured["majority vote"]
    assert greedy["accepted_chars_per_request"] == pytest.approx((0 + 2) / 2)
    assert oracle["accepted_chars_per_request"] == pytest.approx((5 + 2) / 2)
    assert oracle["vs_greedy"]["accepted_chars_per_request"]["value"] == pytest.approx(2.5)
    assert suffix["accepted_chars_per_request"] == pytest.approx(3.5) and suffix["chose_other_than_greedy"] == 1
    assert posterior["accepted_chars_per_request"] == pytest.approx(1.0)
    assert posterior["chose_other_than_greedy"] == 0
    # Task 0's three texts differ (a tie: greedy); task 1's samples agree ("no" twice) against greedy's "ok": the
    # majority shows "no" (rejected). Nothing accepted.
    assert majority["accepted_chars_per_request"] == pytest.approx(0.0) and majority["chose_other_than_greedy"] == 1
