"""The models ``TABLOOP_MODEL`` can name rather than point at, and what a setting resolves to.

Apart from ``policy.models`` (loading any model) because the named ones are built by modules that load
models themselves: ``policy.smollm2`` converts the packaged SmolLM2 (built here on first use), and
``trainer.proof.demo_model`` pretrains the demo model — proof-of-learning code above this floor, so the
demo model is built by ``trainer.build_models.build_named_model`` (which ``tabloop up``, ``serve``,
``train`` and the benches call first) and only found here.
"""

from __future__ import annotations

import json
from pathlib import Path

from policy.models import MODEL_MARKER, ModelLoadError
from policy.smollm2 import PACKAGED_MODELS, build_packaged_model, packaged_marker

NAMED_MODELS = ("smollm2", "demo")
"""TABLOOP_MODEL values that name a model built under the state dir on first use (``resolve_model_spec``)."""


def named_model_dir(settings) -> Path:
    """Where the model a name in ``NAMED_MODELS`` is built: under the state dir."""
    name = PACKAGED_MODELS[settings.model].name if settings.model in PACKAGED_MODELS else settings.model
    return (settings.state_dir / "models" / name).resolve()


def resolve_model_spec(settings) -> str:
    """What ``TABLOOP_MODEL`` means: a path or hub id as given; a name in ``NAMED_MODELS`` → that model's
    directory under the state dir.

    ``smollm2`` (``policy.smollm2``) is fetched once from PyPI into the cache dir and converted (about a
    minute, progress on stderr) on first use. ``demo`` must have been built already (its pretraining is the
    trainer's: ``trainer.build_models.build_named_model``); if it was not, a clear error says how.
    """
    if settings.model in PACKAGED_MODELS:
        spec = PACKAGED_MODELS[settings.model]
        out = named_model_dir(settings)
        if packaged_marker(out, spec) is None:
            build_packaged_model(spec, out, settings.cache_dir / "wheels")
        return str(out)
    if settings.model != "demo":
        return settings.model
    out = named_model_dir(settings)
    try:
        kind = json.loads((out / MODEL_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind != "demo":
        raise ModelLoadError(f"TABLOOP_MODEL=demo but the demo model is not built in {out}: run "
                             "`tabloop model demo` (or `tabloop up`, which builds it first)")
    return str(out)
