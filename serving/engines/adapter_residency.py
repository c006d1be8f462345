"""Which LoRA adapters the transformers engine keeps loaded, and the routes that name them.

A project's LoRA versions are named adapters of one peft model over the base. The peft model is made when the
first project version arrives, with an all-zero adapter active, so rows on the plain base compute what they did.
At most ``max_adapters`` adapters stay routed: past that, the project whose route was least recently used is
unloaded (served by the shared policy until its next request loads it again), and adapters that no route serves
and no running row uses are deleted.

``AdapterResidency`` is the part of ``TransformersEngine`` that does this, apart so that the engine's class reads
as batching and generation. It works on the engine's state: ``_base_model``, ``_lora_targets``, ``_peft`` and
``_peft_lock``, ``_routes``, ``_unloaded``, ``_last_used``, ``max_adapters`` and ``_adapters_changed``; its methods
run on the generation thread, except ``loaded_adapters``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("tabloop.engine")

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a row of a mixed batch
ZERO_ADAPTER = "tabloop-zero"  # all-zero LoRA: the peft model's active adapter, so a plain call is the base


@dataclass(frozen=True, eq=False)
class Policy:
    """A servable version: the model that computes it and, for a LoRA version, its adapter in that model."""
    version: int
    model: torch.nn.Module
    adapter: str | None = None
    """The adapter name in the engine's peft model (BASE_ADAPTER for the base); None: ``model`` is plain."""
    source: tuple[str, str] = ("", "FULL")
    """(uri, kind) it was loaded from: how to load it again after it was unloaded."""


@dataclass(frozen=True)
class Route:
    """What one project (or the shared policy, project "") serves: a promoted version and maybe a canary."""
    promoted: Policy | None
    """None: the project has only a canary; its other requests take the shared policy's promoted version."""
    candidate: Policy | None = None
    share: float = 0.0

    def policies(self) -> list[Policy]:
        return [p for p in (self.promoted, self.candidate) if p is not None]


class AdapterResidency:
    """The adapters of ``TransformersEngine``'s routes: loaded when a row needs them, unloaded past the cap."""

    def loaded_adapters(self) -> list[str]:
        """The LoRA adapters held in memory now (not counting the engine's all-zero one)."""
        peft = self._peft
        return [] if peft is None else sorted(n for n in peft.peft_config if n != ZERO_ADAPTER)

    def _base_policy(self) -> Policy:
        return Policy(0, self._peft, BASE_ADAPTER) if self._peft is not None else Policy(0, self._base_model)

    def _resident(self, policy: Policy, running: list) -> Policy:
        """``policy`` ready to decode: the base as the peft model sees it, a LoRA version's adapter loaded."""
        if policy.version == 0:
            return self._base_policy()
        if policy.adapter is None:
            return policy
        if self._peft is None:
            self._make_peft()
        if policy.adapter not in self._peft.peft_config:
            self._make_room(running)
            self._peft.load_adapter(policy.source[0].removeprefix("file://"), adapter_name=policy.adapter)
            self._peft.set_adapter(ZERO_ADAPTER)  # a plain call stays the base
        return Policy(policy.version, self._peft, policy.adapter, policy.source)

    def _make_peft(self) -> None:
        """Wrap the base in a peft model whose active adapter is all zeros: rows running on the plain base
        compute exactly what they did (the LoRA term is 0), and rows that name an adapter get it."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=1, lora_alpha=1, target_modules=self._lora_targets, lora_dropout=0.0,
                            init_lora_weights=True)  # B = 0: the adapter adds nothing
        with self._peft_lock:
            self._peft = get_peft_model(self._base_model, config, adapter_name=ZERO_ADAPTER).eval()
        base = self._base_policy()
        self._routes = {project: Route(*(base if p is not None and p.version == 0 else p
                                          for p in (r.promoted, r.candidate)), r.share)
                        for project, r in self._routes.items()}

    def _routed_adapters(self) -> set[str]:
        return {p.adapter for r in self._routes.values() for p in r.policies() if p.adapter not in (None, BASE_ADAPTER)}

    def _make_room(self, running: list) -> None:
        """Room for one more adapter: the routes may hold ``max_adapters`` - 1; past that, the projects whose
        routes were least recently used are unloaded (their rows still running keep theirs until they end)."""
        while len(self._routed_adapters()) >= self.max_adapters:
            projects = [p for p, r in self._routes.items()
                        if p and any(x.adapter not in (None, BASE_ADAPTER) for x in r.policies())]
            if not projects:
                log.warning("%d adapters routed (TABLOOP_MAX_ADAPTERS) and none can be unloaded",
                            len(self._routed_adapters()))
                break
            oldest = min(projects, key=lambda p: self._last_used.get(p, 0.0))
            self._unloaded[oldest] = self._routes.pop(oldest)
            log.warning("project %s unloaded to make room (TABLOOP_MAX_ADAPTERS=%d): the shared policy serves "
                        "it until its next request loads it again", oldest, self.max_adapters)
        self._collect_adapters(running)

    def _collect_adapters(self, running: list) -> None:
        """Unload adapters that no route serves and no running row uses."""
        self._adapters_changed = False
        if self._peft is None:
            return
        used = {p.adapter for r in self._routes.values() for p in r.policies()}
        used |= {s.policy.adapter for b in running for s in b.slots if s.policy is not None}
        for name in self.loaded_adapters():
            if name not in used:
                self._peft.delete_adapter(name)
                log.info("adapter %s unloaded", name)
