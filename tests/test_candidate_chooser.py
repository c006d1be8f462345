"""The front door's candidate chooser (issue 41, item 2): with ``TABLOOP_CANDIDATE_SAMPLES`` a request served
greedily is drawn as greedy plus a few samples, each read by the model with the suffix after it, and the user
is shown the one with the highest log p(candidate) + log p(suffix | candidate).

The choice by hand on a small example; the engine's reading pass against the model run row by row; the door
end to end (the tiny model, HTTP, the session's broker) against an independent reading of the same candidates,
drawn again by a door without the chooser; the episodes it makes are left out of the gradient ("chosen")."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from policy.show_gate import LOGPROB_CLIP
from policy.shown import shown_line
from policy.value_model import SUFFIX_TOKENS, Read, posterior_choice
from schemas.token_ids import prompt_ids
from schemas.topics import COMPLETIONS
from tests.serving_helpers import find_events, start_door

PREFIX = "def total(values):\n    result = 0\n    for v in values:\n        result = "
SUFFIX = "\n    return result\n\n\nprint(total([1, 2, 3]))\n"


# -- the choice, by hand --------------------------------------------------------------------------------------


def test_the_posterior_choice_by_hand():
    # Candidate 0 (greedy) is likely itself (-0.3) but makes the suffix unlikely (-4.0): -4.3 in all.
    # Candidate 1 is less likely (-1.2) and explains the suffix (-0.6): -1.8, the best.
    # Candidate 2 is likelier still on paper (-0.1 + -0.2 = -0.3) but shows nothing (None): never chosen.
    reads = [Read((-0.1, -0.2), (-3.0, -1.0)), Read((-1.2,), (-0.4, -0.2)), Read((-0.1,), (-0.2,))]
    assert posterior_choice(["a = 1", "a = b", None], reads) == 1
    # The same with candidate 1 worse on the suffix (-3.2 in all): greedy's -4.3 still loses.
    reads[1] = Read((-1.2,), (-1.0, -1.0))
    assert posterior_choice(["a = 1", "a = b", None], reads) == 1
    reads[1] = Read((-1.2,), (-2.0, -1.2))  # -4.4: greedy's -4.3 wins
    assert posterior_choice(["a = 1", "a = b", None], reads) == 0
    # Each token's logprob is clipped at LOGPROB_CLIP: one impossible token does not sink a candidate further.
    assert posterior_choice(["x", "y"], [Read((LOGPROB_CLIP - 50,), ()), Read((LOGPROB_CLIP + 0.5,), ())]) == 1
    assert posterior_choice(["x", "y"], [Read((LOGPROB_CLIP - 50,), ()), Read((LOGPROB_CLIP - 1,), ())]) == 0
    # Nothing shows anything: no choice.
    assert posterior_choice([None, None], [Read((), ()), Read((), ())]) is None


def test_chosen_samples_are_left_out_of_the_gradient_and_greedy_candidates_stay_greedy():
    from trainer.episodes import drop_reason

    episode = {"gate_shown": True, "completion_token_ids": [5, 6], "completion_text": "a = b", "policy_version": 0,
               "temperature": 0.7, "top_p": 1.0, "candidates": 5, "chosen_candidate": 2}
    assert drop_reason(episode, 0, 4) == "chosen"
    assert drop_reason({**episode, "chosen_candidate": 0, "temperature": 0.0}, 0, 4) == "greedy"
    assert drop_reason({**episode, "candidates": 1, "chosen_candidate": 0}, 0, 4) is None  # an explored sample


# -- the engine's reading pass --------------------------------------------------------------------------------


def reference_logprobs(model, ids: list[int], start: int) -> list[float]:
    """Log-probabilities at temperature 1 of ``ids[start:]`` after ``ids[:start]``, one unpadded row."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(start, len(ids))]


def test_the_engine_reads_continuations_as_the_model_run_row_by_row(tiny_model):
    from policy.models import load_model
    from serving.engines.base import GenerationRequest
    from serving.engines.transformers_engine import TransformersEngine

    model, tok = load_model(tiny_model)
    engine = TransformersEngine(tiny_model)
    try:
        prompt = tok.encode(PREFIX, add_special_tokens=False)
        conts = [tok.encode("sum(values)", add_special_tokens=False), [], tok.encode("v", add_special_tokens=False),
                 tok.encode(" 0  # nothing\n    return", add_special_tokens=False)]
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=1, temperature=0.0, top_p=1.0)
        got = asyncio.run(engine.read_continuations(request, conts))
    finally:
        asyncio.run(engine.close())
    assert [len(g) for g in got] == [len(c) for c in conts]  # one figure per token, an empty one none
    for g, c in zip(got, conts):
        if c:
            assert g == pytest.approx(reference_logprobs(model, prompt + c, len(prompt)), abs=1e-4)
            assert all(lp < 0 for lp in g)


# -- the front door, end to end -------------------------------------------------------------------------------


def complete(server, *, temperature=None, seed=None, suffix=SUFFIX) -> tuple[str, str]:
    body = {"prompt": PREFIX, "suffix": suffix, "max_tokens": 8}
    if temperature is not None:
        body["temperature"] = temperature
    if seed is not None:
        body["seed"] = seed
    resp = httpx.post(f"{server.completions_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"], resp.json()["choices"][0]["text"]


@pytest.mark.kafka
def test_the_door_shows_the_candidate_the_model_finds_likeliest_with_the_suffix(kafka, tiny_model, tmp_path):
    """Seeded requests (the samples are drawn at seed, seed+1, …): a door without the chooser draws the same
    candidates again (greedy; the client's own temperature 0.7 at each seed), the test reads each with the
    suffix on the model itself, row by row, and the chooser must have shown the likeliest, and recorded which."""
    from policy.models import load_model

    samples, seeds = 3, range(100, 106)
    chooser = start_door(kafka, tiny_model, tmp_path / "chooser", candidate_samples=samples, exploration_share=0.0)
    try:
        served = dict(complete(chooser, seed=s) for s in seeds)
        no_suffix, _ = complete(chooser, seed=100, suffix="")  # nothing to read: served greedily, no choice
        own, _ = complete(chooser, temperature=1.0, seed=100)  # the client's own temperature: no choice
    finally:
        chooser.stop()
    plain = start_door(kafka, tiny_model, tmp_path / "plain", exploration_share=0.0)
    try:
        drawn = {s: [complete(plain, seed=s)[1]] + [complete(plain, temperature=0.7, seed=s + i)[1]
                                                    for i in range(1, samples + 1)] for s in seeds}
    finally:
        plain.stop()

    events = {e.record["completion_id"]: e.record
              for e in find_events(chooser.settings, COMPLETIONS.name,
                                   lambda e: e.record["completion_id"] in {*served, no_suffix, own},
                                   want=len(served) + 2)}
    model, tok = load_model(tiny_model)
    suffix_ids = tok.encode(SUFFIX, add_special_tokens=False)[:SUFFIX_TOKENS]
    picks = []
    for (cid, text), s in zip(served.items(), seeds):
        record = events[cid]
        prompt = prompt_ids(record)
        texts = [shown_line(t, PREFIX) or None for t in drawn[s]]
        posterior = []
        for t in texts:
            cand = tok.encode(t, add_special_tokens=False) if t else []
            lps = reference_logprobs(model, prompt + cand + suffix_ids, len(prompt))
            posterior.append(sum(max(lp, LOGPROB_CLIP) for lp in lps) if t is not None else float("-inf"))
        best = max(posterior)
        expected = 0 if posterior[0] >= best - 1e-4 else posterior.index(best)
        assert record["candidates"] == samples + 1
        chosen = record["chosen_candidate"]
        assert texts[chosen] == texts[expected], (s, texts, posterior, chosen)
        # What the client got is that candidate as drawn, up to the end of its first line (single-line mode:
        # the editor shows nothing after it, so no candidate is generated past it).
        full = drawn[s][chosen]
        assert text == (full[:full.index("\n") + 1] if "\n" in full else full)
        if "\n" in full:
            assert record["finish_reason"] == "stop"
        assert record["completion_text"] == text
        assert record["temperature"] == (0.7 if chosen else 0.0) and record["explored"] is False
        picks.append(chosen)
    assert any(p > 0 for p in picks), picks  # the chooser did not just serve greedy
    assert (events[no_suffix]["candidates"], events[no_suffix]["chosen_candidate"]) == (1, 0)
    assert events[no_suffix]["temperature"] == 0.0
    assert (events[own]["candidates"], events[own]["temperature"]) == (1, 1.0)
