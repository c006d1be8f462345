"""Weight pickup: follow ``tabloop.weights`` and hot-load the promoted versions into the engine.

Every replica reads the whole (compacted) topic without a consumer group, so
each one sees every decision. The rule, per project: a WeightVersion names the
project whose policy it is ("" the shared policy). Serve the newest PROMOTED
version of our base model; if the version being served is ROLLED_BACK with
nothing promoted after it, go back to the base model (version 0) for the shared
policy, and to the shared policy for a project. A version that fails to load is
logged and skipped; the replica keeps serving what it has.

Canary: a CANDIDATE whose metrics hold ``canary_share`` > 0 is served next to
the promoted version for that share of its project's requests, until a
PROMOTED (it takes over, without a reload) or ROLLED_BACK (it is dropped) event
for it arrives, or a CANDIDATE without the share (the trainer withdrew it: dropped). ``next_plan`` is the whole rule, as a pure function.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from infra.bus import decoded_records, make_codec, whole_topic_reader
from infra.settings import Settings
from policy.weight_store import local_path_of
from schemas.topics import WEIGHTS
from serving.engines.base import Engine

log = logging.getLogger("tabloop.weights")


Served = tuple[int, str, str]  # (version, uri, kind)
BASE: Served = (0, "", "FULL")


def project_of(event: dict) -> str:
    """The project whose policy a WeightVersion is ("" the shared policy; records before the field: shared)."""
    return event.get("project_id") or ""


def target_version(current: Served | None, event: dict, base_model: str, *,
                   fallback: Served | None = BASE) -> Served | None:
    """Pure rule: given what is served (version, uri, kind) and a WeightVersion record, what to serve next
    (``current`` itself when nothing changes). A rollback of what is served goes to ``fallback``: the base
    model for the shared policy, None (the shared policy) for a project."""
    if event["base_model"] != base_model:
        return current
    version, status = event["version"], event["status"]
    if status == "PROMOTED" and (current is None or version != current[0]):
        return version, event["uri"], event["kind"]
    if status == "ROLLED_BACK" and current is not None and version == current[0] and version != 0:
        return fallback
    return current


@dataclass(frozen=True)
class ServingPlan:
    promoted: Served | None = BASE
    """None: a project without a version of its own (the shared policy serves it)."""
    candidate: Served | None = None
    share: float = 0.0


SHARED_PLAN = ServingPlan()
PROJECT_PLAN = ServingPlan(promoted=None)


def next_plan(plan: ServingPlan, event: dict, base_model: str, *, project: bool = False) -> ServingPlan:
    """Pure rule: what to serve after a WeightVersion record (the promoted version and an optional canary);
    ``project``: the plan is a project's, whose rollback falls back to the shared policy (None)."""
    if event["base_model"] != base_model:
        return plan
    version, status = event["version"], event["status"]
    candidate = plan.candidate
    if status == "CANDIDATE":
        share = float((event.get("metrics") or {}).get("canary_share", 0.0))
        if share > 0 and (plan.promoted is None or version != plan.promoted[0]):
            return replace(plan, candidate=(version, event["uri"], event["kind"]), share=share)
        if candidate is not None and candidate[0] == version:  # the canary withdrawn: a CANDIDATE, no share
            return replace(plan, candidate=None, share=0.0)
        return plan
    if candidate is not None and candidate[0] == version:  # the canary is decided either way
        plan = replace(plan, candidate=None, share=0.0)
    return replace(plan, promoted=target_version(plan.promoted, event, base_model,
                                                 fallback=None if project else BASE))


def next_plans(plans: dict[str, ServingPlan], event: dict, base_model: str) -> dict[str, ServingPlan]:
    """Pure rule over every project: the record changes the plan of the project it names."""
    project = project_of(event)
    plan = plans.get(project, PROJECT_PLAN if project else SHARED_PLAN)
    after = next_plan(plan, event, base_model, project=bool(project))
    return plans if after == plan else {**plans, project: after}


class WeightWatcher:
    def __init__(self, settings: Settings, engine: Engine):
        self.settings = settings
        self.engine = engine
        self.codec = make_codec(settings)
        self.failures = 0
        self.canaries = True  # until the engine says it cannot hold a second version
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="tabloop-weights")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await asyncio.wait([self._task], timeout=5)

    async def _follow(self) -> None:
        consumer = whole_topic_reader(self.settings, "tabloop-weights", WEIGHTS.name)
        current = {"": ServingPlan(promoted=(self.engine.policy_version, "", "FULL"))}
        try:
            while not self._stopping:
                messages = await asyncio.to_thread(consumer.consume, 500, 0.5)
                # Fold the whole batch first: catching up on history loads one version per project, not each.
                wanted = current
                for record in decoded_records(self.codec, messages, "weight"):
                    wanted = next_plans(wanted, record, self.engine.model_name)
                if wanted != current:
                    current = dict(current)
                    for project, plan in wanted.items():
                        before = current.get(project, PROJECT_PLAN if project else SHARED_PLAN)
                        if plan != before:
                            current[project] = await self._apply(project, before, plan)
        finally:
            await asyncio.to_thread(consumer.close)

    async def _apply(self, project: str, current: ServingPlan, wanted: ServingPlan) -> ServingPlan:
        """Make the engine serve ``wanted`` to ``project``; returns what it serves now (a failed load keeps the
        old)."""
        label = f"project {project}: " if project else ""
        if not self.canaries:
            wanted = replace(wanted, candidate=None, share=0.0)
        if wanted.promoted != current.promoted:
            try:
                if wanted.promoted is None:
                    await self.engine.drop_project(project)
                    log.info("%sserved by the shared policy", label)
                    current = replace(current, promoted=None, candidate=None, share=0.0)
                elif current.candidate is not None and wanted.promoted[0] == current.candidate[0]:
                    await self.engine.promote_candidate(project=project)
                    log.info("%sserving policy version %d (the canary, promoted)", label, wanted.promoted[0])
                    current = replace(current, promoted=current.candidate, candidate=None, share=0.0)
                else:
                    version, uri, kind = wanted.promoted
                    await self.engine.load_version(version, await self._local(uri), kind, project=project)
                    log.info("%sserving policy version %d", label, version)
                    current = replace(current, promoted=wanted.promoted)
            except Exception:
                self.failures += 1
                log.exception("%scould not serve policy version %s", label, wanted.promoted)
        if wanted.candidate != current.candidate or wanted.share != current.share:
            try:
                if wanted.candidate is None:
                    await self.engine.drop_candidate(project=project)
                    log.info("%scanary ended", label)
                else:
                    version, uri, kind = wanted.candidate
                    await self.engine.load_candidate(version, await self._local(uri), kind, wanted.share,
                                                     project=project)
                    log.info("%scanary: policy version %d serves %.0f%% of requests", label, version,
                             100 * wanted.share)
                current = replace(current, candidate=wanted.candidate, share=wanted.share)
            except NotImplementedError as exc:
                # Serve the promoted version only; a later PROMOTED event for the candidate loads it in full.
                log.warning("%s: version %s is not served as a canary", exc, wanted.candidate)
                self.canaries = False
            except Exception:
                self.failures += 1
                log.exception("%scould not load canary version %s", label, wanted.candidate)
        return current

    async def _local(self, uri: str) -> str:
        """A local path for ``uri``: weight stores at fsspec URIs are fetched into the cache first."""
        if not uri or "://" not in uri or uri.startswith("file://"):
            return uri
        cache = self.settings.state_dir / "weights-cache"
        cache.mkdir(parents=True, exist_ok=True)
        return str(await asyncio.to_thread(local_path_of, uri, cache))
