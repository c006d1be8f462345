"""The whole loop on a broker of its own: feedback → front door → streams → episodes → trainer → the same
`tabloop serve` process answers with the new version, no request failing during the swap; rollback;
a canary made worse on purpose is rolled back by the rule."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from infra.bus import EventProducer, ensure_topics
from infra.settings import to_environ
from schemas.topics import WEIGHTS
from infra.auth import KeyStore
from tests.conftest import make_settings
from tests.serving_helpers import ProcessServer, find_events
from tests.system_helpers import wait
from policy.weight_store import WeightStore, version_event

pytestmark = [pytest.mark.kafka, pytest.mark.drill]  # three processes and a broker: minutes on two cores


@pytest.fixture
def kafka(own_kafka):
    """A fresh broker per test (conftest's ``own_kafka``): the workers read their topics from the start."""
    return own_kafka


def spawn(settings, args: list[str], log_name: str) -> subprocess.Popen:
    env = {**os.environ, **to_environ(settings), "PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, "-m", "tabloop.cli", *args], env=env,
                            stdout=open(settings.state_dir / log_name, "ab"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def liked(token_ids: list[int]) -> bool:
    """The synthetic user: accepts any completion that is not one token repeated."""
    return len(set(token_ids)) >= 2


class Load:
    """Clients sending completions all the time; every response's status and policy version is kept."""

    def __init__(self, url: str, key: str, clients: int = 3):
        self.url, self.key = url, key
        self.results: list[tuple[int, int, str, list[int]]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {self.key}"}) as http:
            n = 0
            while not self.stopping.is_set():
                r = http.post(f"{self.url}/v1/completions",
                              json={"prompt": f"def f{i}_{n}(x):\n", "max_tokens": 6, "temperature": 1.0,
                                    "return_token_ids": True})
                ids = r.json()["choices"][0].get("token_ids", []) if r.status_code == 200 else []
                with self.lock:
                    self.results.append((r.status_code, int(r.headers.get("x-tabloop-policy-version", -1)),
                                         r.headers.get("x-tabloop-completion-id", ""), ids))
                n += 1

    def since(self, start: int) -> list:
        with self.lock:
            return list(self.results[start:])

    def wait_for(self, predicate, timeout_s: float, what: str, start: int = 0) -> int:
        """The index of the first result from ``start`` on that satisfies ``predicate``."""
        found = wait(lambda: next(((i,) for i, r in enumerate(self.since(start), start) if predicate(r)), None),
                     timeout_s, what, poll_s=0.2,
                     explain=lambda: f"last versions: {[r[1] for r in self.since(0)[-20:]]}")
        return found[0]  # in a tuple: index 0 is a find

    def zero_from(self, start: int, run: int) -> int | None:
        """Where the latest unbroken run of version-0 answers after ``start`` begins, once it is ``run`` long."""
        results = self.since(start)
        other = [i for i, r in enumerate(results) if r[1] != 0]
        begin = other[-1] + 1 if other else 0
        return start + begin if len(results) - begin >= run else None

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(60)


def send_feedback(url: str, key: str, results) -> int:
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {key}"}) as http:
        for _, _, completion_id, ids in results:
            r = http.post(f"{url}/v1/feedback", json={"completion_id": completion_id, "accepted": liked(ids)})
            assert r.status_code in (200, 202), r.text
    return len(results)


def make_worse(base_dir: str, out_dir) -> str:
    """A FULL version that repeats one token: the last layer's values become one huge constant."""
    from policy.models import load_model

    model, tok = load_model(base_dir)
    attn = model.model.layers[-1].self_attn
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        attn.v_proj.weight.zero_()
        attn.v_proj.bias.copy_(torch.randn(attn.v_proj.bias.shape, generator=g) * 1000)
        model.model.norm.weight.mul_(300)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def binomial_tail(n: int, k: int, p: float) -> float:
    """min(P(X <= k), P(X >= k)) for X ~ Binomial(n, p)."""
    from math import comb

    pmf = [comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(n + 1)]
    return min(sum(pmf[:k + 1]), sum(pmf[k:]))


def assert_share_served(during: list[int], version: int, share: float, alpha: float = 1e-4) -> None:
    """The canary served its share of the requests while it ran, whatever their number: the count is one a
    fair split at ``share`` makes with probability above ``alpha`` (a few requests allow much, many little;
    the rule used to let any split through below 20 requests)."""
    n, k = len(during), during.count(version)
    assert n >= 2 and binomial_tail(n, k, share) > alpha, (f"{k} of {n} requests from the canary "
                                                           f"(share {share}): {during}")


def test_the_share_check_refuses_what_a_fair_canary_would_not_serve():
    assert_share_served([0, 7] * 5, 7, 0.5)
    assert_share_served([0] * 3 + [7] * 7, 7, 0.5)  # 7 of 10: a fair coin does that
    for unfair in ([0] + [7] * 18, [7] * 19 + [0], [0] * 15 + [7] * 45, [0] * 40 + [7] * 2):
        with pytest.raises(AssertionError):
            assert_share_served(unfair, 7, 0.5)


def test_feedback_to_new_version_to_serving_rollback_and_canary(kafka, tiny_model, tmp_path):
    base = str(tmp_path / "base")
    shutil.copytree(tiny_model, base)
    settings = make_settings(tmp_path / "state", kafka_bootstrap=kafka.settings.kafka_bootstrap, model=base,
                             join_window_s=30, join_lateness_s=5, idle_close_s=3, trainer_device="cpu",
                             trainer_batch_size=8, trainer_batch_wait_s=600, trainer_save_every=1,
                             trainer_lora_rank=4, trainer_lr=1e-3, canary_min_episodes=6, canary_margin=0.1)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    ensure_topics(settings)
    key = KeyStore(settings.keys_file).add("acme", "dev", rate_per_minute=100_000)
    server = ProcessServer(settings)
    streams = spawn(settings, ["streams"], "streams.log")
    trainer = spawn(settings, ["train"], "train.log")
    load = Load(server.completions_url, key)
    store = WeightStore(settings.effective_weight_store, base)
    try:
        # 1. Eight decisions through the front door's feedback route become eight episodes: one update, version 1.
        load.wait_for(lambda r: True, 60, "a first completion")
        wait(lambda: len([r for r in load.since(0) if r[0] == 200]) >= 8, 60, "eight answered completions")
        first = [r for r in load.since(0) if r[0] == 200][:8]
        send_feedback(server.feedback_url, key, first)
        v1_at = load.wait_for(lambda r: r[1] == 1, 240, "version 1 served")
        # The trainer stops here: the load's empty completions are IGNORED episodes at once (no decision comes
        # for them), so it would go on making versions, and the rollback and the canary below want a
        # still serving state. Version 2 may already be out; it is what the rollback then rolls back.
        stop(trainer)
        assert store.versions()[0] == 1 and store.manifest(1).episodes_consumed == 8

        # 2. Rollback: one command; the same process goes back to version 0.
        out = subprocess.run([sys.executable, "-m", "tabloop.cli", "weights", "rollback", "0"], capture_output=True,
                             text=True,
                             env={**os.environ, **to_environ(settings), "PYTHONPATH": os.getcwd()}, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "serving goes to version 0" in out.stdout
        v0_at = load.wait_for(lambda r: r[1] == 0, 60, "version 0 again", start=v1_at)

        # 3. Canary: a version made worse on purpose serves half of the requests; the trainer judges it.
        worse = make_worse(base, tmp_path / "worse")
        version = store.next_version()
        manifest = store.save(version, tmp_path / "worse", dict(
            parent_version=0, kind="FULL", trainer_step=0, episodes_consumed=0, episodes_trained=0,
            episodes_dropped={}, source_topic="tabloop.episodes", source_offsets_start=store.manifest(1).source_offsets,
            source_offsets=store.manifest(1).source_offsets, episodes_consumed_total=8, metrics={}))
        assert worse
        with EventProducer(settings) as producer:
            producer.publish(version_event(manifest, "CANDIDATE", {"canary_share": 0.5, "baseline_version": 0.0}))
        trainer = spawn(settings.model_copy(update={"trainer_batch_size": 10_000}), ["train"], "train.log")
        canary_at = load.wait_for(lambda r: r[1] == version, 120, "the canary served", start=v0_at)
        sent = [canary_at]

        def feedback_until_decided() -> list:
            """Feedback on what was served since the last call, then the canary's decision if it is out."""
            results = load.since(sent[0])
            sent[0] += len(results)
            send_feedback(server.feedback_url, key, [r for r in results if r[0] == 200 and r[1] in (0, version)])
            return find_events(settings, WEIGHTS.name, lambda e: e.record["base_model"] == base
                               and e.record["version"] == version and e.record["status"] != "CANDIDATE",
                               timeout_s=3)

        decided = wait(feedback_until_decided, 240, "the canary's decision", poll_s=0,
                       explain=lambda: "versions served since the canary: "
                       f"{sorted(set(r[1] for r in load.since(canary_at)))}\ntrain.log ends:\n"
                       + "\n".join((settings.state_dir / "train.log").read_text(errors="replace").splitlines()[-15:]))
        decision = decided[-1].record
        assert decision["status"] == "ROLLED_BACK", decision
        assert decision["metrics"]["canary_candidate_accept_rate"] < decision["metrics"]["canary_baseline_accept_rate"]
        assert decision["metrics"]["canary_candidate_episodes"] >= 6
        # Serving drops the canary: from some request on, every answer is version 0 again — eight in a row,
        # and it stays so for the sixteen after them.
        zero_from = wait(lambda: load.zero_from(sent[0], 8), 60, "eight answers in a row from version 0")
        wait(lambda: len(load.since(zero_from)) >= 24, 60, "sixteen more answers")
        tail = load.since(zero_from)
        assert {r[1] for r in tail} == {0}, [r[1] for r in tail]
    finally:
        load.stop()
        stop(trainer)
        stop(streams)
        server.stop()

    everything = load.since(0)
    assert everything and all(status == 200 for status, *_ in everything), "a request failed"
    served = [r[1] for r in everything]
    assert 1 in served and version in served
    # The canary served some share of requests while it ran, and only while it ran.
    last = max(i for i, v in enumerate(served) if v == version)
    during = served[canary_at:last + 1]
    assert set(during) == {0, version}
    assert_share_served(during, version, 0.5)
    assert v0_at > v1_at
