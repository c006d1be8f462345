"""Commands on the infrastructure floor: `tabloop kafka`, `topics`, `events`, `schemas`, `keys`, `continue`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from infra.auth import KeyStore, new_local_key
from infra.bus import KafkaUnavailable, TopicSetupError, ensure_topics, read_topic, wanted_partitions
from infra.errors import TabloopError
from infra.kafka_broker import KafkaLaunchError, LocalKafka
from infra.local import ContinueConfigError, continue_config, endpoints, merge_continue_config
from infra.settings import settings_of
from schemas.compat import check_all, release, unreleased
from schemas.topics import CATALOG



@click.group()
def kafka() -> None:
    """The local single-node Apache Kafka (KRaft) broker."""


def _broker(ctx: click.Context):
    try:
        return LocalKafka(settings_of(ctx))
    except KafkaLaunchError as exc:
        raise TabloopError(str(exc)) from None


def broker_call(fn):
    try:
        return fn()
    except KafkaLaunchError as exc:
        raise TabloopError(str(exc)) from None


@kafka.command("fetch")
@click.pass_context
def kafka_fetch(ctx: click.Context) -> None:
    """Fetch the broker's jars from Maven Central into the cache (once)."""
    broker = _broker(ctx)
    click.echo(f"Kafka jars in {broker_call(broker.fetch)}")


@kafka.command("start")
@click.pass_context
def kafka_start(ctx: click.Context) -> None:
    """Start the broker; returns once it answers metadata requests."""
    broker = _broker(ctx)
    status = broker_call(broker.start)
    click.echo(f"Kafka {status.version} up on {status.bootstrap} (pid {status.pid}, data in {status.data_dir})")


@kafka.command("stop")
@click.pass_context
def kafka_stop(ctx: click.Context) -> None:
    """Stop the broker cleanly."""
    broker = _broker(ctx)
    click.echo("Kafka stopped" if broker_call(broker.stop) else "Kafka was not running")


@kafka.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
def kafka_status(ctx: click.Context, as_json: bool) -> None:
    """Is the broker running and answering? Exit code 0 only if it answers."""
    status = _broker(ctx).status()
    if as_json:
        click.echo(json.dumps(status.as_dict()))
    elif status.running:
        click.echo(f"Kafka {status.version} pid {status.pid} on {status.bootstrap}: "
                   f"{'answering' if status.answering else 'NOT answering'}")
    else:
        click.echo(f"Kafka is not running (would listen on {status.bootstrap})")
    ctx.exit(0 if status.answering else 1)


# -- topics -------------------------------------------------------------------


@click.group()
def topics() -> None:
    """The topic catalog on the broker."""


@topics.command("create")
@click.pass_context
def topics_create(ctx: click.Context) -> None:
    """Create the catalog's topics, or fix partition counts and configs that differ. Idempotent."""
    try:
        actions = ensure_topics(settings_of(ctx))
    except TopicSetupError as exc:
        raise TabloopError(f"some topics differ from the catalog in ways tabloop can't fix:\n{exc}") from None
    except Exception as exc:  # KafkaException: broker down, timeouts
        raise TabloopError(f"could not reach Kafka at {settings_of(ctx).kafka_bootstrap}: {exc}") from None
    for line in actions or ["all topics match the catalog"]:
        click.echo(line)


@topics.command("list")
@click.pass_context
def topics_list(ctx: click.Context) -> None:
    """The catalog: name, event type, partitions, configs."""
    s = settings_of(ctx)
    for t in CATALOG:
        configs = ",".join(f"{k}={v}" for k, v in t.configs.items())
        click.echo(f"{t.name:22s} {t.event_type:18s} partitions={wanted_partitions(t, s)} "
                   f"replication={s.topic_replication} {configs}")


@click.group()
def events() -> None:
    """Read the event log."""


@events.command("dump")
@click.argument("topic")
@click.option("--from-beginning", is_flag=True, help="Start at the first event (default: the end, or --limit before it).")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Print at most N events; without --from-beginning, start N before the end of each partition.")
@click.option("--follow", is_flag=True, help="Keep printing new events (otherwise stop at the current end).")
@click.pass_context
def events_dump(ctx: click.Context, topic: str, from_beginning: bool, limit: int | None, follow: bool) -> None:
    """Print decoded events of TOPIC as JSON lines; undecodable ones as error lines."""
    last = None if from_beginning or limit is None else limit
    try:
        for r in read_topic(settings_of(ctx), topic, from_beginning=from_beginning, last=last, follow=follow,
                            limit=limit):
            line = {"topic": r.topic, "partition": r.partition, "offset": r.offset,
                    "key": r.key.decode(errors="replace") if r.key is not None else None}
            if r.event is not None:
                line.update(r.event.to_json())
            else:
                line.update(error=f"{type(r.error).__name__}: {r.error}", raw=r.value[:256].hex())
            click.echo(json.dumps(line, default=str))
    except (ValueError, KafkaUnavailable) as exc:
        raise TabloopError(str(exc)) from None
    except KeyboardInterrupt:
        pass


@click.group()
def keys() -> None:
    """API keys: each maps to a project and a user. Stored hashed under the state dir."""


def _keystore(ctx: click.Context):
    return KeyStore(settings_of(ctx).keys_file)


@keys.command("add")
@click.option("--project", required=True, help="Project the key belongs to.")
@click.option("--user", required=True, help="User the key belongs to.")
@click.option("--rate", type=click.IntRange(min=1), default=None, help="Requests per minute (default: server's).")
@click.pass_context
def keys_add(ctx: click.Context, project: str, user: str, rate: int | None) -> None:
    """Make a key and print it once (only its hash is kept)."""
    try:
        click.echo(_keystore(ctx).add(project, user, rate))
    except ValueError as exc:
        raise TabloopError(str(exc)) from None


@keys.command("list")
@click.pass_context
def keys_list(ctx: click.Context) -> None:
    """Key ids with their project and user (never the keys)."""
    for p in _keystore(ctx).list():
        click.echo(f"{p.key_id}  project={p.project_id}  user={p.user_id}  rate={p.rate_per_minute or 'default'}")


@keys.command("revoke")
@click.argument("key_id")
@click.pass_context
def keys_revoke(ctx: click.Context, key_id: str) -> None:
    """Revoke a key by its id."""
    if not _keystore(ctx).revoke(key_id):
        raise TabloopError(f"no key with id {key_id!r}")
    click.echo(f"revoked {key_id}")


@click.group("continue")
def continue_group() -> None:
    """Continue (the IDE extension): its config for this system."""


@continue_group.command("config")
@click.option("--merge", "merge_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Add the model and the data destination to this Continue config.yaml instead of printing "
                   "a whole one (everything else kept; the old file kept as <file>.bak).")
@click.option("--new-key", is_flag=True, help="Make a new API key (project 'local') and put it in.")
@click.pass_context
def continue_config_cmd(ctx: click.Context, merge_path: str | None, new_key: bool) -> None:
    """Print a complete Continue config.yaml for this system, or merge its entries into one."""
    s = settings_of(ctx)
    addresses = endpoints(s)
    key = new_local_key(s.keys_file) if new_key and addresses["auth"] == "keys" else None
    if key:
        click.echo(f"API key (project 'local'; shown once, only its hash is kept): {key}", err=True)
    if merge_path is None:
        click.echo(continue_config(addresses, key), nl=False)
        return
    try:
        backup = merge_continue_config(Path(merge_path), addresses, key)
    except ContinueConfigError as exc:
        raise TabloopError(str(exc)) from None
    click.echo(f"merged the tabloop model and data destination into {merge_path} (the old file: {backup})")


@click.group()
def schemas() -> None:
    """The Avro event schemas and their released versions."""


@schemas.command("check")
def schemas_check() -> None:
    """Fail if a current schema can't read a released version's data, or vice versa."""
    bad = {n: p for n, p in check_all().items() if p}
    for name, problems in bad.items():
        for p in problems:
            click.echo(f"{name}: {p}", err=True)
    for name in unreleased():
        click.echo(f"{name}: changed since its last release (compatible); run `tabloop schemas release`")
    if bad:
        raise TabloopError("breaking schema changes")


@schemas.command("release")
def schemas_release() -> None:
    """Keep each changed schema as its next released version."""
    try:
        written = release()
    except ValueError as exc:
        raise TabloopError(str(exc)) from None
    for path in written or []:
        click.echo(f"released {path}")
    if not written:
        click.echo("nothing to release: every schema is a released version")
