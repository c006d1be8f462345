"""Building a named model before anything resolves it: the demo model is pretrained by
``trainer.proof.demo_model`` (minutes), which the policy floor cannot import, so the commands and the
trainer resolve ``TABLOOP_MODEL`` through here; the front door and the streams worker use
``policy.named_models.resolve_model_spec``, which finds it built."""

from __future__ import annotations

from policy.named_models import named_model_dir, resolve_model_spec
from trainer.proof.demo_model import DemoConfig, build_demo_model, demo_marker


def build_named_model(settings) -> str:
    """``resolve_model_spec``, building the demo model first when ``TABLOOP_MODEL`` names it and it is not
    built (``TABLOOP_DEMO_MINUTES``); a later call reuses what was built."""
    if settings.model == "demo":
        out = named_model_dir(settings)
        if demo_marker(out) is None:
            build_demo_model(out, DemoConfig(minutes=settings.demo_minutes))
    return resolve_model_spec(settings)
