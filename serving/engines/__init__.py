"""Engines: what turns a tokenized prompt into tokens, with their behaviour-policy logprobs."""

from serving.engines.base import Engine, GenerationRequest, TokenStep

__all__ = ["Engine", "GenerationRequest", "TokenStep"]
