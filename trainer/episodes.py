"""An Episode event as the trainer reads it: the sampler it was drawn with, whether it is trained on, and
the training sample it becomes. The online trainer and off-policy evaluation (``trainer.ope_episodes``)
read episodes by these same rules."""

from __future__ import annotations

from policy.sampling import GREEDY_TEMPERATURE
from schemas.token_ids import prompt_ids
from trainer.learner import Sample, make_sample


def episode_sampler(episode: dict) -> tuple[float, float]:
    """(temperature, top_p) the episode's tokens were sampled with; (1.0, 1.0) for episodes written before
    Episode carried them (the engines then sampled at the request's temperature, most often 1.0)."""
    temperature = episode.get("temperature")
    top_p = episode.get("top_p")
    return (1.0 if temperature is None else float(temperature), 1.0 if top_p is None else float(top_p))


def drop_reason(episode: dict, current_version: int, max_staleness: int, serving_version: int | None = None,
                staleness_of=None) -> str | None:
    """Why an episode is consumed without training on it, or None to train on it.

    "stale": served by a version more than ``max_staleness`` versions older than the trainer's, unless it is
    ``serving_version``, the one users are served now. Versions a promotion gate or a canary holds back
    do not reach users: without that exception the trainer would drop all of today's traffic once it had
    saved ``max_staleness`` versions nobody was served, and never learn again.

    "greedy": served at a temperature at or below GREEDY_TEMPERATURE, the argmax — a point mass, with no
    importance ratio to weigh it by (its probability under any other policy is 0 or 1). Counted in the
    manifest's dropped episodes, so a deployment serving greedily shows up as a trainer that trains on nothing.
    By default most traffic is greedy (``policy.exploration``: users are shown the policy's best guess) and
    the trainer learns from the exploration samples, ``TABLOOP_EXPLORATION_SHARE`` of it (``explored``),
    drawn at the exploration temperature, each weighed by its ratio against its own behaviour logprobs as
    any sample is. That is exact: the coin is a hash of the completion id, independent of the content, so
    the explored episodes are an unbiased sample of the sampling policy at that temperature, and given the
    coin each one's probability is its recorded one. A greedy episode can't join them. Its recorded
    logprobs are 0 (probability 1), so weighed "as served" its ratio would be π_θ,T(y)/1: a gradient that
    pushes up whatever the argmax was, as if it had been drawn with probability 1 from the distribution the
    ratio assumes — which it was not: the distribution at T would have drawn other completions for the same
    prompt, with the rewards they would have got, and the log has none of them. Nor is a point mass a
    supervised target: reward-weighted likelihood of the argmax moves the policy towards its own mode
    whatever the alternatives earn, an objective of its own, not the one PPO estimates. So greedy episodes
    are left out of the policy gradient and of the reward baseline (the baseline is the mean reward of the
    samples it centres), and only counted; the show-gate's learner does learn from them (trainer/show_gate_learner.py):
    its decision, show or not, was drawn with a recorded probability whichever branch served the text.

    "chosen": a sample the front door's chooser picked among greedy and others (``chosen_candidate`` ≥ 1,
    ``TABLOOP_CANDIDATE_SAMPLES``). Its behaviour logprobs are those it was drawn with, but it was served
    because it won the choice, with a probability nobody recorded (that of being drawn *and* read as the
    likeliest): weighed by them, the ratio would treat a selected sample as an unselected one. Left out like
    greedy, and counted.

    "gate_hidden": the show-gate hid the completion (``gate_shown`` false). The model did not choose to show
    nothing, the gate did, over a line the user never saw: trained as an abstention it would teach the model
    to end its completions where the gate, not the user, said no (the gate learns from these in
    trainer/show_gate_learner.py).

    ``staleness_of(version)``: how many versions old ``version`` is (default ``current_version - version``;
    with a policy per project, the shared policy's versions since, as projects' versions share the numbers).
    """
    if episode.get("gate_shown") is False:
        return "gate_hidden"
    if not episode["completion_token_ids"] and not episode.get("completion_text"):
        return "empty"
    if episode.get("chosen_candidate"):
        return "chosen"
    if episode["completion_token_ids"] and episode_sampler(episode)[0] <= GREEDY_TEMPERATURE:
        return "greedy"
    behaviour = episode["policy_version"]
    age = (lambda v: current_version - v) if staleness_of is None else staleness_of
    if behaviour is not None and behaviour != serving_version and age(behaviour) > max_staleness:
        return "stale"
    return None


def episode_sample(episode: dict, tokenizer, *, max_prompt_tokens: int) -> Sample | None:
    """The training sample (advantage 0 until the batch's baseline) of an episode ``drop_reason`` let
    through; None when there is no token to train on. ValueError: an episode that can't be a sample.

    What was served is trained as it was served:
    - the completion is the event's ``completion_token_ids``, the tokens the user saw plus the one that ended
      them (decided at serving time), never re-derived from the text;
    - the prompt is the ids the replica fed the model after its trim (``schemas.token_ids.prompt_ids``:
      packed, or the ``prompt_token_ids`` array of episodes written before v8); only episodes written
      before they were recorded (neither) re-encode the prompt text;
    - the ratio is taken under the episode's temperature and top-p, the distribution the tokens were drawn
      from and the behaviour logprobs describe.
    """
    token_ids = list(episode["completion_token_ids"])
    behaviour = (list(episode["behaviour_logprobs"]) if len(episode["behaviour_logprobs"]) == len(token_ids)
                 else None)
    temperature, top_p = episode_sampler(episode)
    if not token_ids:  # off-policy feedback we never served: the text the IDE showed, no behaviour logprobs
        token_ids = tokenizer.encode(episode["completion_text"], add_special_tokens=False)
        behaviour = None
        temperature, top_p = 1.0, 1.0  # no sampler of ours drew it: trained on-policy (ratio 1)
    if not token_ids:
        return None
    return make_sample(tokenizer, episode["prompt"] or " ", token_ids, behaviour, 0.0,
                       max_prompt_tokens=max_prompt_tokens, prompt_ids=prompt_ids(episode) or None,
                       temperature=temperature, top_p=top_p)
