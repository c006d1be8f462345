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


@dataclass(frozen=True)
class TokenStep:
    """One generated token: its id, its logprob under the policy (temperature 1), its text."""

    token_id: int
    logprob: float
    text: str
    policy_version: int
    finish_reason: str | None = None
    """Set on the last step: "stop" (end of sequence) or "length"."""


class Engine(ABC):
    name: str = "engine"
    model_name: str = ""
    policy_version: int = 0

    @property
    @abstractmethod
    def tokenizer(self):
        """A Hugging Face tokenizer for the served model (prompt trimming, token counting)."""

    @abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenStep]:
        """Yield tokens as they are generated. Closing the iterator stops generation."""

    @abstractmethod
    async def load_version(self, version: int, uri: str, kind: str) -> None:
        """Load weight version ``version`` (kind LORA or FULL at ``uri``; version 0 = base) and swap it in
        between requests; returns once requests that start afterwards use it."""

    # -- canaries: a second version serving a share of requests (engines that can hold two) --

    candidate_version: int | None = None

    async def load_candidate(self, version: int, uri: str, kind: str, share: float) -> None:
        """Serve ``share`` of new requests from ``version`` next to the promoted one."""
        raise NotImplementedError(f"the {self.name} engine does not serve canaries")

    async def promote_candidate(self) -> None:
        """The candidate becomes the promoted version (no reload) and serves every request."""
        raise NotImplementedError(f"the {self.name} engine does not serve canaries")

    async def drop_candidate(self) -> None:
        """Stop serving the candidate."""
        raise NotImplementedError(f"the {self.name} engine does not serve canaries")

    def ready(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass
