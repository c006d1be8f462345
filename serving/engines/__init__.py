"""Engines: what turns a tokenized prompt into tokens, with their behaviour-policy logprobs.

Each engine is registered by the name ``TABLOOP_ENGINE`` gives it (``ENGINES``); its module is imported only
when it is chosen (the transformers engine brings torch, the vLLM one needs none). A new engine is a module
with a ``from_settings(settings) -> Engine`` function and one entry in ``ENGINES``.
"""

from __future__ import annotations

import importlib

from serving.engines.base import Engine, GenerationRequest, TokenStep

ENGINES = {"transformers": "serving.engines.transformers_engine", "vllm": "serving.engines.vllm_engine"}
"""Engine name → the module whose ``from_settings`` makes it."""


class UnknownEngine(ValueError):
    pass


def make_engine(settings) -> Engine:
    """The engine ``settings.engine`` names, made from the settings."""
    module = ENGINES.get(settings.engine)
    if module is None:
        raise UnknownEngine(f"no engine named {settings.engine!r} (TABLOOP_ENGINE): the engines are "
                            f"{', '.join(sorted(ENGINES))}")
    return importlib.import_module(module).from_settings(settings)


__all__ = ["ENGINES", "Engine", "GenerationRequest", "TokenStep", "UnknownEngine", "make_engine"]
