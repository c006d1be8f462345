"""A container's entrypoint that waits for Kafka before it runs a `tabloop` command.

    python -m infra.wait <tabloop arguments…>        e.g.  python -m infra.wait streams

Services started together (infra/compose/docker-compose.cpu.yml) need the broker answering, and all but the
topic job need the catalog's topics: rather than the engine's health checks and ``depends_on`` conditions
(which Podman without systemd and podman-compose do not honour), each waits for them itself, up to
``TABLOOP_KAFKA_WAIT_S`` seconds, and then becomes `tabloop <arguments…>` (exec: same process, same signals).
With ``TABLOOP_KAFKA_WAIT_S`` 0 (the default) or a command that needs no Kafka it execs at once.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from infra.bus import KafkaUnavailable, wait_for_kafka
from infra.settings import SettingsError, load_settings
from schemas.topics import CATALOG

NEEDS_BROKER = {"topics"}
"""Commands that need the broker answering, not the topics (they make them)."""
NEEDS_TOPICS = {"serve", "streams", "train", "history", "replay"}
"""Commands that produce to or consume from the catalog's topics."""


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    """(the value of tabloop's own --config, the words of the command line that are not options)."""
    config, words, rest = None, [], list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--config" and rest and not words:
            config = rest.pop(0)
        elif arg.startswith("--config=") and not words:
            config = arg.partition("=")[2]
        elif not arg.startswith("-"):
            words.append(arg)
    return config, words


def needs(args: list[str]) -> str | None:
    """'topics', 'broker' or None: what ``tabloop <args>`` must find before it starts."""
    _, words = _split(args)
    command = words[0] if words else None
    if command in NEEDS_TOPICS:
        if command == "history" and len(words) > 1 and words[1] in ("token", "schema"):
            return None  # `history token`, `history schema`: no Kafka
        return "topics"
    return "broker" if command in NEEDS_BROKER else None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    need = needs(args)
    if need is not None:
        try:
            config, _ = _split(args)
            settings = load_settings(config_file=Path(config) if config else None)
        except SettingsError as exc:
            print(f"tabloop: bad setting: {exc}", file=sys.stderr)
            return 2
        if settings.kafka_wait_s > 0:
            topics = [t.name for t in CATALOG] if need == "topics" else []

            def say(line: str) -> None:
                print(f"infra.wait ({' '.join(args)}): {line}", file=sys.stderr, flush=True)

            try:
                waited = wait_for_kafka(settings, settings.kafka_wait_s, topics=topics, say=say)
            except KafkaUnavailable as exc:
                print(f"tabloop {' '.join(args)}: {exc}", file=sys.stderr, flush=True)
                return 1
            say(f"ready after {waited:.1f} s")
    tabloop = shutil.which("tabloop")
    if tabloop is None:
        print("infra.wait: no `tabloop` command on PATH", file=sys.stderr)
        return 127
    os.execv(tabloop, ["tabloop", *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
