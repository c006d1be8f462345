"""The drills' own instruments (tests/system_helpers.py), on a real broker: a drill that ends on what they
say is only as good as they are."""

from __future__ import annotations

import json
import os

import pytest

from infra.bus import ensure_topics
from schemas.topics import Topic
from tests.conftest import make_settings
from tests.system_helpers import feedback_waiting


@pytest.mark.kafka
def test_feedback_waiting_counts_the_last_state_of_each_key(kafka, tmp_path):
    """Read as a restarted worker restores its tables: the last value of each key, a deleted key gone; only
    feedback still waiting (``waiting`` in the prompt state, ``early`` in the completion state) counts."""
    from confluent_kafka import Producer

    settings = make_settings(tmp_path, kafka_bootstrap=kafka.settings.kafka_bootstrap)
    app_id = f"helpers-{os.getpid()}-{tmp_path.name}"
    prompt, completion = f"{app_id}-prompt-state-changelog", f"{app_id}-completion-state-changelog"
    ensure_topics(settings, (Topic(prompt, "(internal)", {}), Topic(completion, "(internal)", {})))
    assert feedback_waiting(settings, app_id) == 0  # empty changelogs

    writer = Producer({"bootstrap.servers": settings.kafka_bootstrap})

    def write(topic, key, state):
        writer.produce(topic, key=key, value=None if state is None else json.dumps(state).encode(), partition=0)

    write(prompt, b"a", {"candidates": [], "waiting": [{"event_id": "f1"}]})  # waits …
    write(prompt, b"a", {"candidates": [{"completion_id": "c1"}], "waiting": []})  # … then matched
    write(prompt, b"b", {"waiting": [{"event_id": "f2"}], "candidates": []})  # still waiting
    write(prompt, b"c", {"waiting": [{"event_id": "f3"}]})
    write(prompt, b"c", None)  # deleted
    write(completion, b"c1", {"early": [{"event_id": "f4"}], "t": 1})  # feedback before its completion
    write(completion, b"c2", {"closed": True, "served_at": 1})
    assert writer.flush(30) == 0
    assert feedback_waiting(settings, app_id) == 2  # b and c1
    write(completion, b"c1", {"completion": {"completion_id": "c1"}, "t": 2})  # its completion came
    assert writer.flush(30) == 0
    assert feedback_waiting(settings, app_id) == 1

    # The one join's table: both kinds of state under one changelog, told apart by their keys.
    joined = f"{app_id}-join-state-changelog"
    ensure_topics(settings, (Topic(joined, "(internal)", {}),))
    write(joined, b"p\x1fproj\x1fuser\x1fsha", {"waiting": [{"event_id": "f5"}], "candidates": []})
    write(joined, b"c\x1fc3", {"early": [{"event_id": "f6"}]})
    write(joined, b"c\x1fc4", {"waiting": [{"event_id": "not a prompt's"}], "closed": True})
    assert writer.flush(30) == 0
    assert feedback_waiting(settings, app_id) == 3
