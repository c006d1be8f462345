"""The behaviour policy the engines record is the distribution they sample from, and the exploration rule
that picks it; the trainer recomputes the same quantity (``policy.sampling.sampling_log_probs``)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from serving.engines.base import GenerationRequest
from serving.engines.transformers_engine import sample_token
from policy.sampling import sampling_log_probs
from schemas.token_ids import prompt_ids


def test_sample_token_draws_from_the_tempered_nucleus_and_records_its_logprob():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0])
    expected = sampling_log_probs(logits, 0.5, 0.8)
    nucleus = {i for i in range(5) if expected[i] > float("-inf")}
    # By hand: softmax(z/0.5) = .656, .241, .089, .012, .002; the nucleus is {0, 1} (.656 < .8 ≤ .897),
    # renormalised .731 and .269. The temperature-1 softmax — what the engine recorded before — gives .463.
    assert nucleus == {0, 1}
    assert float(expected[0].exp()) == pytest.approx(0.731, abs=1e-3)
    assert float(torch.softmax(logits, -1)[0]) == pytest.approx(0.463, abs=1e-3)
    g = torch.Generator().manual_seed(0)
    draws = [sample_token(logits, 0.5, 0.8, g) for _ in range(4000)]
    counts = Counter(t for t, _ in draws)
    assert set(counts) == nucleus  # never a token outside the nucleus
    assert {t: lp for t, lp in draws} == pytest.approx({0: float(expected[0]), 1: float(expected[1])})
    assert counts[0] / 4000 == pytest.approx(0.731, abs=0.03)
    # Greedy: the argmax, a point mass (log 1 = 0), not a sample weighed as if it were one.
    assert sample_token(logits, 0.0, 1.0, None) == (0, 0.0)


def test_transformers_engine_logprobs_are_what_the_trainer_recomputes(tiny_model):
    """Version 0 served at T=0.6, top-p 0.9: the recorded behaviour logprobs equal the policy's
    sampling_log_probs over the same prompt ids and tokens, so the trainer's first ratio is exactly 1."""
    from serving.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_model, max_batch=2)
    prompt = engine.tokenizer.encode("def mean(values):\n    return", add_special_tokens=False)

    async def generate():
        steps = [s async for s in engine.stream(GenerationRequest(prompt, 12, 0.6, 0.9, seed=3))]
        await engine.close()
        return steps

    steps = asyncio.run(generate())
    tokens = [s.token_id for s in steps]
    with torch.no_grad():
        logits = engine._base_model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    positions = range(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    expected = [float(sampling_log_probs(logits[p], 0.6, 0.9)[t]) for p, t in zip(positions, tokens)]
    assert [s.logprob for s in steps] == pytest.approx(expected, abs=1e-4)
    at_t1 = [float(torch.log_softmax(logits[p], -1)[t]) for p, t in zip(positions, tokens)]
    assert max(abs(a - b) for a, b in zip(at_t1, expected)) > 0.01  # the test can tell the two apart


# -- the exploration policy -------------------------------------------------------------------------------


def test_exploration_policy_shows_greedy_and_samples_the_coins_share(tmp_path):
    """Requests with no or a near-greedy temperature are greedy unless the coin makes them exploration samples
    at the exploration temperature; a client's own temperature and the operator's override are served as
    they are (the rule by hand: tests/test_exploration.py)."""
    from policy.exploration import explores
    from serving.completions import CompletionRun, parse_completion_request, sampling_temperature
    from tests.conftest import make_settings

    settings = make_settings(tmp_path)
    assert (settings.default_temperature, settings.min_temperature, settings.exploration_share) == (0.7, 0.1, 0.1)
    # What users get: Continue's autocomplete sends none, older Continue sent 0.01: greedy.
    assert sampling_temperature(None, settings) == 0.0
    assert sampling_temperature(0.01, settings) == 0.0
    assert sampling_temperature(0.0, settings) == 0.0
    assert sampling_temperature(0.1, settings) == 0.1 and sampling_temperature(1.3, settings) == 1.3
    # The operator's override still wins, greedy included.
    forced = make_settings(tmp_path, exploration_temperature=0.0)
    assert sampling_temperature(None, forced) == 0.0 and sampling_temperature(0.9, forced) == 0.0
    params = parse_completion_request({"prompt": "x = "}, settings)
    assert (params.temperature, params.top_p, params.requested_temperature) == (0.0, 1.0, None)
    params = parse_completion_request({"prompt": "x = ", "temperature": 0.01, "top_p": 0.9}, settings)
    assert (params.temperature, params.top_p, params.requested_temperature) == (0.0, 0.9, 0.01)
    # The run flips the coin once its completion id exists: an explored id is sampled at 0.7.
    explored = next(f"cmpl-{i}" for i in range(200) if explores(f"cmpl-{i}", 0.1))
    greedy = next(f"cmpl-{i}" for i in range(200) if not explores(f"cmpl-{i}", 0.1))
    for cid, want in ((explored, (0.7, True, 0.1)), (greedy, (0.0, False, 0.1))):
        run = CompletionRun(params, None, settings, "p", "u", "r", completion_id=cid)
        assert (run.params.temperature, run.sampling.explored, run.sampling.exploration_share) == want
    run = CompletionRun(parse_completion_request({"prompt": "x", "temperature": 0.4}, settings), None, settings,
                        "p", "u", "r", completion_id=explored)
    assert (run.params.temperature, run.sampling.explored, run.sampling.exploration_share) == (0.4, False, None)


def test_a_greedy_token_reports_its_gate_logprob_at_the_exploration_temperature(tiny_model):
    """Greedy: behaviour logprob 0 (a point mass), and beside it the logprob the exploration sampler gives the
    same token, which the show-gate scores; a request drawn at the gate's temperature reports none apart."""
    from serving.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_model, max_batch=1)
    prompt = engine.tokenizer.encode("def mean(values):\n    return", add_special_tokens=False)

    async def generate():
        greedy = [s async for s in engine.stream(GenerationRequest(prompt, 6, 0.0, 0.9, gate_temperature=0.7))]
        sampled = [s async for s in engine.stream(GenerationRequest(prompt, 6, 0.7, 1.0, seed=1))]
        await engine.close()
        return greedy, sampled

    steps, sampled = asyncio.run(generate())
    tokens = [s.token_id for s in steps]
    with torch.no_grad():
        logits = engine._base_model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    positions = range(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    assert tokens == [int(logits[p].argmax()) for p in positions]
    assert [s.logprob for s in steps] == [0.0] * len(steps)
    assert [s.gate_logprob for s in steps] == pytest.approx(
        [float(sampling_log_probs(logits[p], 0.7, 0.9)[t]) for p, t in zip(positions, tokens)], abs=1e-4)
    assert all(s.gate_logprob < 0 for s in steps)
    assert all(s.gate_logprob is None and s.logprob < 0 for s in sampled)


# -- what a CompletionServed event carries -----------------------------------------------------------------


class ScriptedEngine:
    """An engine that plays given (token id, text) steps: the event-building logic on a known token stream
    (the real engines' own tests check what they generate)."""

    name = "scripted"
    model_name = "scripted"
    policy_version = 0
    feeds_prompt_ids = True

    def __init__(self, tokenizer, steps, finish="stop"):
        self.tokenizer, self.steps, self.finish, self.fed = tokenizer, steps, finish, None

    async def stream(self, request):
        from serving.engines.base import TokenStep

        self.fed = list(request.prompt_ids)
        for i, (token, text) in enumerate(self.steps):
            last = i == len(self.steps) - 1
            yield TokenStep(token, -0.1 * (i + 1), text, 0, self.finish if last else None)


def run_completion(engine, body, settings):
    from serving.completions import CompletionRun, parse_completion_request

    run = CompletionRun(parse_completion_request(body, settings), engine, settings, "acme", "ann", "r0")

    async def consume():
        async for _ in run.sse_payloads():
            pass

    asyncio.run(consume())
    return run, run.event().record


def test_kept_token_count_by_hand():
    from policy.shown import kept_token_count

    # "x" | "\n" | "\n" | "foo": shown "x" (a stop "\n\n" cut it) → "x" and the "\n" that ended it.
    assert kept_token_count([1, 2, 3, 6], 1) == 2
    assert kept_token_count([1, 2, 3, 3], 3) == 4  # nothing cut: every token, the end of sequence included
    assert kept_token_count([0], 0) == 1  # end of sequence first: that one token
    assert kept_token_count([1, 1, 3], 1) == 3  # a half character (no text yet) stays with its neighbours
    assert kept_token_count([], 0) == 0


def test_event_trains_the_tokens_shown_plus_the_one_that_ended_them(tiny_model, tmp_path):
    """A stop string cut the text: the tokens generated past the shown text — held back, never sent — are
    not the episode's; the one that began the stop is (it is the choice to end there)."""
    from transformers import AutoTokenizer

    from tests.conftest import make_settings

    settings = make_settings(tmp_path, model=tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = ScriptedEngine(tok, [(11, "x = 1"), (12, "\n"), (13, "\n"), (14, "y = 2")], finish="length")
    run, event = run_completion(engine, {"prompt": "a = 0\n", "stop": ["\n\n"], "max_tokens": 8}, settings)
    assert event["completion_text"] == run.text == "x = 1"
    assert event["completion_token_ids"] == [11, 12] and event["completion_logprobs"] == pytest.approx([-0.1, -0.2])
    assert event["completion_token_ends"] == [5, 6]  # the join can cut further to what the IDE showed
    assert event["finish_reason"] == "stop"
    # Nothing cut: every token, the end-of-sequence token included.
    engine = ScriptedEngine(tok, [(11, "x"), (12, " = 1"), (tok.eos_token_id, "")])
    _, event = run_completion(engine, {"prompt": "a = 0\n", "max_tokens": 8}, settings)
    assert (event["completion_text"], event["completion_token_ids"]) == ("x = 1", [11, 12, tok.eos_token_id])
    # End of sequence first: an empty completion of one token, which the join makes an IGNORED episode.
    engine = ScriptedEngine(tok, [(tok.eos_token_id, "")])
    run, event = run_completion(engine, {"prompt": "a = 0\n", "max_tokens": 8}, settings)  # its coin: below
    assert (event["completion_text"], event["completion_token_ids"], event["aborted"]) == \
        ("", [tok.eos_token_id], False)
    # No temperature sent: greedy, or an exploration sample at 0.7 where the coin says so (its id decides).
    from policy.exploration import explores

    explored = explores(run.completion_id, settings.exploration_share, settings.exploration_seed)
    assert (event["temperature"], event["top_p"], event["requested_temperature"]) == \
        (0.7 if explored else 0.0, 1.0, None)
    assert (event["explored"], event["exploration_share"]) == (explored, 0.1)


def test_event_carries_the_prompt_ids_the_engine_was_fed_when_a_trim_splits_a_character(tiny_model, tmp_path):
    """Trimming cuts tokens, and a byte-level token can be half of a UTF-8 character: decoding the trimmed ids
    and encoding the text again does not give them back, so the event carries the ids themselves."""
    from transformers import AutoTokenizer

    from tests.conftest import make_settings

    settings = make_settings(tmp_path, model=tiny_model, max_prompt_tokens=24)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    split = None
    for cut in range(40):  # a prompt whose trim starts inside a multi-byte character
        prompt = "é" * cut + "ü日本語のコメント " * 6 + "\nx = "
        ids = tok.encode(prompt, add_special_tokens=False)[-24:]
        if tok.encode(tok.decode(ids), add_special_tokens=False) != ids:
            split = prompt
            break
    assert split is not None, "no trim that splits a character: the test would check nothing"
    engine = ScriptedEngine(tok, [(tok.eos_token_id, "")])
    run, event = run_completion(engine, {"prompt": split, "max_tokens": 4}, settings)
    fed = prompt_ids(event)
    assert fed == engine.fed == run.generation.prompt_ids and event["prompt_token_ids"] == []  # packed (v5)
    assert len(fed) <= 24
    assert tok.encode(event["prompt"], add_special_tokens=False) != fed  # why it matters


def test_vllm_steps_record_greedy_as_a_point_mass_and_the_replicas_prompt_ids():
    from serving.engines.vllm_engine import _steps

    chunk = {"choices": [{"text": "ab", "token_ids": [5, 6], "prompt_token_ids": [1, 2, 3],
                          "logprobs": {"token_logprobs": [-0.5, -0.25]}, "finish_reason": None}]}
    steps = _steps(chunk, 3)
    assert [(s.token_id, s.logprob, s.text) for s in steps] == [(5, -0.5, ""), (6, -0.25, "ab")]
    assert [s.prompt_token_ids for s in steps] == [(1, 2, 3), None]
    assert [s.logprob for s in _steps(chunk, 3, greedy=True)] == [0.0, 0.0]
