"""The small interface every engine implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    prompt_text: str | None = None
    """The prompt as text, for engines that send text (remote servers tokenize themselves)."""
    project_id: str = ""
    """The requesting project: it is served its own promoted version where it has one, else the shared one."""
    gate_temperature: float | None = None
    """Also report each token's logprob at this temperature (and ``top_p``): the show-gate's confidence
    figures, when the request is drawn at another temperature (greedy's behaviour logprobs are all 0)."""
    route_seed: int | None = None
    """Requests with the same route seed take the same side of a canary's coin: the candidates of one request
    (``TABLOOP_CANDIDATE_SAMPLES``) are drawn by one version, so they compare. None: a coin of its own."""


@dataclass(frozen=True)
class TokenStep:
    """One generated token: its id, its behaviour logprob, its text.

    ``logprob`` is log π of the token under the distribution it was drawn from — the request's temperature
    and top-p nucleus, ``policy.sampling.sampling_log_probs`` (0.0 for greedy: a point mass) — which is what
    the trainer's importance ratio divides by, not the temperature-1 log-softmax."""

    token_id: int
    logprob: float
    text: str
    policy_version: int
    finish_reason: str | None = None
    """Set on the last step: "stop" (end of sequence) or "length"."""
    prompt_token_ids: tuple[int, ...] | None = None
    """Set (on one step) by engines whose server tokenized the prompt text itself: the ids it fed the model,
    which are what the episode must train on (``GenerationRequest.prompt_ids`` otherwise)."""
    gate_logprob: float | None = None
    """The token's logprob at the request's ``gate_temperature`` (the show-gate's figure); None: not asked
    for, or the engine can't tell (the behaviour ``logprob`` stands in)."""


class Engine(ABC):
    name: str = "engine"
    model_name: str = ""
    policy_version: int = 0
    feeds_prompt_ids: bool = True
    """The model is fed ``GenerationRequest.prompt_ids`` as they are (False: a server tokenizes the text)."""

    @property
    @abstractmethod
    def tokenizer(self):
        """A Hugging Face tokenizer for the served model (prompt trimming, token counting)."""

    @abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        """Yield tokens as they are generated. Closing the iterator stops generation."""

    @abstractmethod
    async def load_version(self, version: int, uri: str, kind: str, *, project: str = "") -> None:
        """Load weight version ``version`` (kind LORA or FULL at ``uri``; version 0 = base) and swap it in
        between requests; returns once requests that start afterwards use it. ``project``: the version is
        that project's policy (its requests only); "" the shared policy (every other request)."""

    async def drop_project(self, project: str) -> None:
        """The project has no version of its own any more: the shared policy serves it again."""
        raise NotImplementedError(f"the {self.name} engine does not serve per-project versions")

    # -- canaries: a second version serving a share of requests (engines that can hold two) --

    candidate_version: int | None = None
    """The shared policy's canary version, if any."""

    async def load_candidate(self, version: int, uri: str, kind: str, share: float, *, project: str = "") -> None:
        """Serve ``share`` of the project's new requests from ``version`` next to its promoted one."""
        raise NotImplementedError(f"the {self.name} engine does not serve canaries")

    async def promote_candidate(self, *, project: str = "") -> None:
        """The candidate becomes the project's promoted version (no reload) and serves all its requests."""
        raise NotImplementedError(f"the {self.name} engine does not serve canaries")

    async def drop_candidate(self, *, project: str = "") -> None:
        """Stop serving the project's candidate."""
        raise NotImplementedError(f"the {self.name} engine does not serve canaries")

    reads_candidates: bool = False
    """The engine implements ``read_continuations`` (the front door's candidate chooser needs it)."""

    async def read_continuations(self, request: GenerationRequest, continuations: list[list[int]], *,
                                 version: int | None = None) -> list[list[float]]:
        """Teacher-forced: the log-probability at temperature 1 (the model's own distribution) of each token of
        each continuation after ``request.prompt_ids``, under the policy that serves ``request.project_id``
        — version ``version`` where that route still holds it (the version that drew the candidates)."""
        raise NotImplementedError(f"the {self.name} engine does not read candidates")

    def ready(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass
