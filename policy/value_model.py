"""A value model that reads the content: which of a request's candidate completions to show, if any.

Issue 41, item 2. The front door can draw a few candidates per request in one batched call (greedy plus a few
samples). Choosing among them by how sure the model was while writing them (the show-gate's logprob figures)
does not beat greedy; the oracle best of five does, by a third more accepted characters. What the logprobs
cannot see is the suffix: a model without FIM tokens (SmolLM2: ``policy.fim`` renders a prefix-only prompt)
writes the line without ever reading the code after the cursor, though the IDE sends it. Here every
candidate is read once more, teacher-forced, as ``prompt + candidate + the suffix's first tokens``:

* how likely the model finds the **true suffix after the candidate** (a right line makes the code after it
  likely; a wrong one, e.g. a call that the next line repeats, makes it unlikely);
* the candidate's own log-probabilities (at temperature 1, the model's own distribution);
* the policy's **hidden state** at the candidate's end and at the end of the suffix window, for a learned
  head to read (reduced to a few dimensions by a projection fit with the head).

``request_features`` turns those figures into one row of ``FEATURES`` per candidate, adding what needs the
whole request (how many candidates agree, each figure against the greedy candidate's, the best posterior).
``fit_value_model`` fits a logistic regression of "the user accepts it" on them (IRLS, the show-gate's
``fit_logistic``), and ``choose`` picks the candidate with the highest expected accepted characters
(P(accept) × its length), the default (greedy) on ties, or none when even the best is under a threshold.

Everything but ``score_candidates`` (the policy's forward passes) is pure and numpy.

``tabloop bench candidates`` (docs/bench-loop/value-model/) measures the choosers. The learned heads did not
beat greedy on train tasks; the parameter-free posterior (``posterior_choice``: log p(candidate) + log p(suffix
after it)) was above greedy on all 158 held-out tasks in three seeds. The front door serves it
(``TABLOOP_CANDIDATE_SAMPLES``: ``serving.completions``), reading the candidates with the engine that drew them
(``Engine.read_continuations``) rather than ``score_candidates``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from policy.show_gate import LOGPROB_CLIP, fit_logistic, sigmoid

SUFFIX_TOKENS = 16
"""How many tokens of the suffix are read after a candidate: enough for the rest of the next line or two
(where a wrong line shows), few enough that the pass costs little more than the candidate itself."""
SUFFIX_CHARS = 256
"""Characters of the suffix tokenized to get ``SUFFIX_TOKENS`` tokens (more than enough for 16 tokens)."""

BASE_FEATURES = ("suffix_mean_logprob", "suffix_vs_greedy", "cand_mean_logprob", "cand_min_logprob",
                 "cand_sum_logprob", "log_chars", "agreement", "same_as_greedy", "posterior_gap")
"""Each candidate's figures before the hidden state's projection (``request_features``):

* ``suffix_mean_logprob``: mean log-probability of the suffix's first tokens after prompt + candidate;
* ``suffix_vs_greedy``: the same minus the greedy candidate's (how much better this one explains the suffix);
* ``cand_mean_logprob``, ``cand_min_logprob``, ``cand_sum_logprob``: the candidate's own tokens, teacher-forced;
* ``log_chars``: log(1 + its characters);
* ``agreement``: the share of the request's candidates whose text is the same;
* ``same_as_greedy``: 1 when its text is the default (greedy) candidate's: every figure depends on the text
  alone, so a sample that repeats greedy is valued as greedy and the tie goes to greedy;
* ``posterior_gap``: log p(candidate, suffix | prompt) minus the request's best, ≤ 0 (0: the candidate the
  model itself, reading the suffix too, finds likeliest: Bayes' rule over the candidates)."""


@dataclass(frozen=True)
class Read:
    """One candidate as the policy reads it (``score_candidates``)."""

    cand_logprobs: tuple[float, ...]
    """Log-probabilities (temperature 1) of the candidate's tokens after the prompt."""
    suffix_logprobs: tuple[float, ...]
    """Of the suffix's first ``SUFFIX_TOKENS`` tokens after prompt + candidate."""
    hidden_end: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros(0))
    """The last layer's hidden state at the candidate's last token (at the prompt's last one when empty)."""
    hidden_suffix: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros(0))
    """At the last suffix token read: the policy having read prompt, candidate and suffix."""


def score_candidates(model, tokenizer, prompt_ids: Sequence[int], candidates: Sequence[str], suffix: str, *,
                     suffix_tokens: int = SUFFIX_TOKENS) -> list[Read]:
    """Read every candidate: ``prompt_ids + candidate + suffix``, each part tokenized on its own so the suffix's
    tokens are the same after every candidate and the figures compare.

    The prompt is run once and its key/value cache shared by the candidates (repeated per row), which are run
    together right-padded (causal attention: padding after a row changes nothing before it); the vocabulary
    projection is applied only where a candidate or suffix token is predicted. At 256 prompt tokens and five
    candidates this costs about what one more greedy line does, where running five full rows cost five."""
    import torch  # lazy: the heads (fit, value, choose) are numpy alone; only reading candidates runs the model

    suffix_ids = tokenizer.encode(suffix[:SUFFIX_CHARS], add_special_tokens=False)[:suffix_tokens]
    cand_ids = [tokenizer.encode(c, add_special_tokens=False) if c else [] for c in candidates]
    conts = [c + suffix_ids for c in cand_ids]
    n, width = len(conts), max((len(c) for c in conts), default=0)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    with torch.no_grad():
        prompt = decoder(input_ids=torch.tensor([list(prompt_ids)], device=device), use_cache=True)
        last = prompt.last_hidden_state[0, -1].float()
        if width == 0:
            state = last.cpu().numpy()
            return [Read((), (), state.copy(), state.copy()) for _ in conts]
        cache = prompt.past_key_values
        cache.batch_repeat_interleave(n)
        ids = torch.tensor([c + [pad] * (width - len(c)) for c in conts], device=device)
        mask = torch.tensor([[1] * len(prompt_ids) + [1] * len(c) + [0] * (width - len(c)) for c in conts],
                            device=device)
        hidden = decoder(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True
                         ).last_hidden_state.float()
        # The state that predicts each continuation token: the prompt's last for the first, then the row's own.
        before = torch.cat([last.expand(n, 1, -1), hidden[:, :-1]], dim=1)
        logprobs = torch.log_softmax(head(before.to(head.weight.dtype)).float(), dim=-1)
        got = logprobs.gather(-1, ids[:, :, None]).squeeze(-1).tolist()
    reads = []
    for i, (c, cont) in enumerate(zip(cand_ids, conts)):
        end = hidden[i, len(c) - 1] if c else last
        after = hidden[i, len(cont) - 1] if cont else last
        reads.append(Read(cand_logprobs=tuple(got[i][:len(c)]), suffix_logprobs=tuple(got[i][len(c):len(cont)]),
                          hidden_end=end.cpu().numpy().copy(), hidden_suffix=after.cpu().numpy().copy()))
    return reads


def _clipped(xs: Sequence[float]) -> list[float]:
    return [max(float(x), LOGPROB_CLIP) for x in xs]


def request_features(texts: Sequence[str | None], reads: Sequence[Read], *, default: int = 0) -> np.ndarray:
    """One row of ``BASE_FEATURES`` per candidate of a request. ``texts``: what the editor would show of each
    (None when nothing: such a candidate is never chosen, its row is still there); ``reads``: each one's
    ``Read``; ``default``: the greedy candidate, the one ``suffix_vs_greedy`` compares with.

    >>> r = [Read((-0.5, -1.5), (-1.0, -3.0)), Read((-0.1,), (-0.5, -0.5))]
    >>> request_features(["a b", "a"], r).round(3).tolist()[1]
    [-0.5, 1.5, -0.1, -0.1, -0.1, 0.693, 0.5, 0.0, 0.0]
    """
    if len(texts) != len(reads):
        raise ValueError(f"{len(texts)} texts but {len(reads)} reads")
    suffix_mean = [float(np.mean(_clipped(r.suffix_logprobs))) if r.suffix_logprobs else 0.0 for r in reads]
    posterior = [sum(_clipped(r.cand_logprobs)) + sum(_clipped(r.suffix_logprobs)) for r in reads]
    live = [p for p, t in zip(posterior, texts) if t is not None] or posterior
    best = max(live)
    rows = []
    for i, (text, read) in enumerate(zip(texts, reads)):
        lps = _clipped(read.cand_logprobs) or [0.0]
        same = sum(1 for t in texts if t is not None and t == text) / len(texts) if text is not None else 0.0
        rows.append([suffix_mean[i], suffix_mean[i] - suffix_mean[default], float(np.mean(lps)), min(lps), sum(lps),
                     math.log1p(len(text or "")), same, 1.0 if text is not None and text == texts[default] else 0.0,
                     min(posterior[i] - best, 0.0)])
    return np.asarray(rows, dtype=float)


# -- the head ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Projection:
    """A fixed linear map of hidden states to a few dimensions: principal components fit on the head's
    training candidates (``fit_projection``). Empty (``components`` of 0 rows): no hidden-state features."""

    mean: np.ndarray
    components: np.ndarray
    """(k, hidden size): the top-k principal directions, rows of unit length."""

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        hidden = np.atleast_2d(np.asarray(hidden, dtype=float))
        if len(self.components) == 0:
            return np.zeros((len(hidden), 0))
        return (hidden - self.mean) @ self.components.T


def fit_projection(hidden: np.ndarray, k: int) -> Projection:
    """The top ``k`` principal components of ``hidden`` (rows: candidates), by SVD of the centred matrix.
    k = 0: the empty projection."""
    hidden = np.asarray(hidden, dtype=float)
    if k <= 0 or len(hidden) == 0:
        return Projection(np.zeros(hidden.shape[1] if hidden.ndim == 2 else 0), np.zeros((0, 0)))
    mean = hidden.mean(axis=0)
    _, _, vt = np.linalg.svd(hidden - mean, full_matrices=False)
    return Projection(mean, vt[:min(k, len(vt))])


@dataclass(frozen=True)
class ValueModel:
    """P(the user accepts a candidate) = sigmoid(coef · (x − mean) / scale + intercept) over a candidate's
    features (``BASE_FEATURES`` then the projection of its hidden state), and the threshold on
    P × characters under which nothing is shown (0: always show the best)."""

    coef: np.ndarray
    intercept: float
    mean: np.ndarray
    scale: np.ndarray
    columns: tuple[int, ...] = ()
    """Which of the feature row's columns the head reads (empty: all of them)."""
    projection: Projection | None = None
    threshold: float = 0.0

    def features(self, base: np.ndarray, hidden: np.ndarray | None = None) -> np.ndarray:
        """The head's input rows: the chosen base columns, then the projected hidden states."""
        base = np.atleast_2d(np.asarray(base, dtype=float))
        x = base[:, list(self.columns)] if self.columns else base
        if self.projection is not None and len(self.projection.components):
            x = np.hstack([x, self.projection(hidden)])
        return x

    def accept_probability(self, x: np.ndarray) -> np.ndarray:
        return sigmoid(((np.atleast_2d(x) - self.mean) / self.scale) @ self.coef + self.intercept)


def fit_value_model(x: np.ndarray, accepted: Sequence[bool], *, l2: float = 1.0, columns: Sequence[int] = (),
                    projection: Projection | None = None) -> ValueModel:
    """The logistic head on rows ``x`` (already ``ValueModel.features``) and whether each was accepted: the
    show-gate's IRLS (``fit_logistic``, standardised columns, L2 on the coefficients)."""
    coef, intercept, mean, scale = fit_logistic(np.asarray(x, dtype=float), np.asarray(accepted, dtype=float), l2=l2)
    return ValueModel(coef=coef, intercept=intercept, mean=mean, scale=scale, columns=tuple(columns),
                      projection=projection)


def expected_chars(probabilities: Sequence[float], texts: Sequence[str | None]) -> list[float]:
    """What each candidate is worth: P(accept) × its characters (0 for one that shows nothing)."""
    return [float(p) * len(t) if t is not None else 0.0 for p, t in zip(probabilities, texts)]


def choose(values: Sequence[float], texts: Sequence[str | None], *, default: int = 0, threshold: float | None = None,
           tie: float = 1e-9) -> int | None:
    """The candidate to show: the highest ``values`` among those that show something, ``default`` (greedy)
    when it is within ``tie`` of the best; None when none shows anything, or when the best's value is under
    ``threshold`` (None: always show).

    >>> choose([1.0, 3.0, 3.0], ["a", "b", "c"])
    1
    >>> choose([3.0, 3.0], ["a", "b"]), choose([1.0, 3.0], [None, "b"], threshold=4.0)
    (0, None)
    """
    live = [i for i, t in enumerate(texts) if t is not None]
    if not live:
        return None
    best = max(values[i] for i in live)
    pick = default if default in live and values[default] >= best - tie else \
        next(i for i in live if values[i] == best)
    if threshold is not None and values[pick] < threshold:
        return None
    return pick


POSTERIOR = BASE_FEATURES.index("posterior_gap")


def posterior_choice(texts: Sequence[str | None], reads: Sequence[Read], *, default: int = 0) -> int | None:
    """The parameter-free chooser the front door serves: the candidate the model finds likeliest once it has
    read the code after the cursor too, log p(candidate | prompt) + log p(suffix | prompt + candidate) (each
    token's logprob clipped at ``LOGPROB_CLIP``, as every figure here), ``default`` (greedy) on ties, never a
    candidate that shows nothing (``texts`` None); None when none shows anything.

    >>> reads = [Read((-0.1, -0.2), (-3.0,)), Read((-0.5,), (-0.5,)), Read((), ())]
    >>> posterior_choice(["x = 1", "x = 2", None], reads)  # -3.3 against -1.0 (the third shows nothing)
    1
    >>> posterior_choice(["x = 1", "x = 1"], [Read((-1.0,), ()), Read((-1.0,), ())])  # a tie: greedy
    0
    """
    if not any(t is not None for t in texts):
        return None
    return choose(list(request_features(texts, reads, default=default)[:, POSTERIOR]), texts, default=default)


def candidate_continuations(texts: Sequence[str | None], suffix: str, tokenizer
                            ) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """What a reading pass reads for ``posterior_pick``: the distinct texts (nothing shown reads as ""), each one's
    token ids, and each one's continuation, its ids then the first ``SUFFIX_TOKENS`` of ``suffix`` (tokenized on
    its own, so the suffix's tokens are the same after every candidate and the figures compare)."""
    suffix_ids = tokenizer.encode(suffix[:SUFFIX_CHARS], add_special_tokens=False)[:SUFFIX_TOKENS]
    distinct = list(dict.fromkeys(t or "" for t in texts))
    cand_ids = [tokenizer.encode(t, add_special_tokens=False) if t else [] for t in distinct]
    return distinct, cand_ids, [c + suffix_ids for c in cand_ids]


def posterior_pick(texts: Sequence[str | None], distinct: Sequence[str], cand_ids: Sequence[Sequence[int]],
                   logprobs: Sequence[Sequence[float]]) -> int:
    """``posterior_choice`` over a request's candidates given the reading of ``candidate_continuations``' rows
    (each row's logprobs: the candidate's tokens, then the suffix's); 0 (greedy) when none shows anything."""
    read = {t: Read(tuple(lp[:len(c)]), tuple(lp[len(c):])) for t, c, lp in zip(distinct, cand_ids, logprobs)}
    return posterior_choice(texts, [read[t or ""] for t in texts]) or 0
