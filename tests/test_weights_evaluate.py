"""`tabloop weights evaluate`: a version's off-policy estimates from episodes on the real broker."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from tests.conftest import make_settings
from tests.system_helpers import cli
from trainer.cli import parse_since


def publish_sampled_episodes(settings, model_dir: str, project: str, n: int = 24) -> list[dict]:
    """Episodes the tiny model served at temperature 0.8, top-p 0.95 (its behaviour logprobs recorded as
    serving records them), decided by a fixed rule: accepted when the first token's id is even."""
    from infra.bus import EventProducer, ensure_topics
    from schemas.events import new_event
    from policy.models import load_model
    from trainer.learner import sample_completions

    model, tok = load_model(model_dir)
    prompts = [tok.encode(f"def f{i}(x):\n    return x + {i}", add_special_tokens=False) for i in range(n)]
    drawn = sample_completions(model, prompts, max_new_tokens=5, temperature=0.8, top_p=0.95,
                               generator=torch.Generator().manual_seed(3), eos_id=tok.eos_token_id,
                               pad_id=tok.pad_token_id)
    ensure_topics(settings)
    records = []
    with EventProducer(settings, client_id="test-ope") as producer:
        for prompt, (ids, logprobs) in zip(prompts, drawn):
            accepted = ids[0] % 2 == 0
            event = new_event("Episode", completion_id=f"cmpl-{uuid.uuid4()}", project_id=project, user_id="u",
                              policy_version=0, prompt=tok.decode(prompt), prompt_token_ids=prompt,
                              prompt_sha256="0" * 64, completion_text=tok.decode(ids, skip_special_tokens=True) or "x",
                              completion_token_ids=ids, behaviour_logprobs=logprobs, temperature=0.8, top_p=0.95,
                              outcome="ACCEPTED" if accepted else "REJECTED", reward=0.75 if accepted else -0.25,
                              reward_components={"acceptance": 0.75 if accepted else -0.25}, scorer="acceptance",
                              matched=True)
            producer.publish(event)
            records.append(event.record)
    return records


def evaluate(settings, *args) -> dict:
    done = cli(settings, "weights", "evaluate", *args, "--json", timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_evaluate_the_serving_policy_gives_its_logged_rates_and_another_one_is_weighed(kafka, tiny_model,
                                                                                       tmp_path):
    from policy.models import load_model
    from trainer.ope import LoggedOutcome, estimate
    from trainer.learner import PolicyTrainer, Sample, UpdateConfig

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.bootstrap, model=tiny_model)
    project = f"ope-{uuid.uuid4().hex[:8]}"
    records = publish_sampled_episodes(settings, tiny_model, project)
    accepted = sum(r["outcome"] == "ACCEPTED" for r in records)
    assert 0 < accepted < len(records)

    # The policy that served, evaluated on its own traffic: every weight is 1, so the estimates are the
    # log's own rates and the effective sample size is the number of episodes. Any mismatch between the
    # recorded sampler and the one the evaluation applies (temperature, top-p, token alignment) breaks this.
    same = evaluate(settings, "0", "--project", project)
    assert same["episodes"] == len(records) and same["skipped"] == {}
    assert same["effective_sample_size"] == pytest.approx(len(records), rel=1e-3)
    assert same["accept_rate_shown"]["value"] == pytest.approx(accepted / len(records), abs=1e-3)
    assert same["shown_share"]["value"] == pytest.approx(1.0)
    assert same["reward_mean"]["value"] == pytest.approx(same["logged"]["reward_mean"], abs=1e-3)
    low, high = same["accept_rate_shown"]["low"], same["accept_rate_shown"]["high"]
    assert low < accepted / len(records) < high
    assert evaluate(settings, "0", "--project", project, "--since", "1h", "--limit", "10")["episodes"] == 10
    later = cli(settings, "weights", "evaluate", "0", "--project", project, "--since", "2099-01-01T00:00")
    assert later.returncode != 0 and "no logged episode to evaluate on" in later.stderr

    # Another policy (the same model, its logits sharpened by a larger final norm): weights away from 1.
    model, tok = load_model(tiny_model)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    other = tmp_path / "sharper"
    model.save_pretrained(other)
    tok.save_pretrained(other)
    got = evaluate(settings, str(other), "--project", project, "--clip", "50")
    assert got["effective_sample_size"] < 0.9 * len(records)

    # The same estimate from the trainer's own log-probabilities of the logged tokens (another code path).
    policy = PolicyTrainer(load_model(str(other))[0], tok, UpdateConfig(), full=True)
    samples = [Sample(r["prompt_token_ids"], r["completion_token_ids"], None, 0.0, 0.8, 0.95) for r in records]
    target = [sum(lp) for lp in policy.sequence_logprobs(samples)]
    outcomes = [LoggedOutcome(sum(r["behaviour_logprobs"]), t, True, r["outcome"] == "ACCEPTED", r["reward"])
                for r, t in zip(records, target)]
    expected = estimate(outcomes, clip=50)
    assert got["accept_rate_shown"]["value"] == pytest.approx(expected.accept_rate_shown.value, abs=1e-3)
    assert got["effective_sample_size"] == pytest.approx(expected.effective_sample_size, rel=1e-2)


def test_evaluate_says_what_is_wrong(kafka, tiny_model, tmp_path):
    settings = make_settings(tmp_path, kafka_bootstrap=kafka.bootstrap, model=tiny_model)
    nothing = cli(settings, "weights", "evaluate", "0", "--project", f"none-{uuid.uuid4().hex[:8]}")
    assert nothing.returncode != 0 and "no logged episode to evaluate on" in nothing.stderr
    bad_since = cli(settings, "weights", "evaluate", "0", "--since", "yesterday")
    assert bad_since.returncode == 2 and "--since" in bad_since.stderr and "'yesterday'" in bad_since.stderr
    missing = cli(settings, "weights", "evaluate", "7")
    assert missing.returncode != 0 and "version 7" in missing.stderr


def test_parse_since():
    from datetime import datetime, timedelta, timezone

    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    assert parse_since("30m", now) == now - timedelta(minutes=30)
    assert parse_since("1.5h", now) == now - timedelta(minutes=90)
    assert parse_since("7d", now) == now - timedelta(days=7)
    assert parse_since("2026-12-01T08:00", now) == datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)
    with pytest.raises(ValueError, match="ISO time"):
        parse_since("soon", now)
