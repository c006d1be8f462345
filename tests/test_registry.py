"""The schema-registry client (schemas/registry.py) and the codec's Confluent wire format against a real
registry: Apicurio Registry, whose Confluent-compatible API is served under /apis/ccompat/v7, with its
in-memory storage, started once per test session on a free port and stopped at the end.

Apicurio comes from its release on Maven Central (``io.apicurio:apicurio-registry-app``, the ``all``
zip: a Quarkus runner jar and its lib/), fetched once with Maven into the cache directory, as the Kafka
jars are. 2.6.x is the newest line that runs on Java 17 (3.x needs Java 21), the Java the project needs
anyway and the one CI installs. It starts in about 30 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

import httpx
import pytest

from infra.bus import make_codec
from infra.kafka_broker import find_java, free_port
from schemas.codec import CONFLUENT_MAGIC, Codec, UnknownSchemaError
from schemas.events import EVENT_TYPES
from schemas.examples import example_event
from schemas.registry import ConfluentSchemaRegistry, SchemaRegistryError
from tests.conftest import make_settings
from tests.test_codec import expected_after_round_trip

APICURIO_VERSION = "2.6.13.Final"
APICURIO_ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:zip:all"
RUNNER_JAR = f"apicurio-registry-app-{APICURIO_VERSION}-runner.jar"
CCOMPAT_PATH = "/apis/ccompat/v7"
MIN_JAVA = 17
FETCH_TIMEOUT_S = 420  # ~140 MB from Maven Central
START_TIMEOUT_S = 150  # ~30 s on two busy cores
STOP_TIMEOUT_S = 30
CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class RegistryLaunchError(RuntimeError):
    """Apicurio could not be fetched or started; the message says why."""


def fetch_apicurio(cache_dir: Path) -> Path:
    """The runner jar of Apicurio Registry, fetched with Maven once; later calls return the cache."""
    home = cache_dir.expanduser().resolve() / f"apicurio-registry-{APICURIO_VERSION}"
    if (home / ".complete").exists():
        return home / RUNNER_JAR
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RegistryLaunchError(
            f"Maven ('mvn') is not on PATH: it fetches Apicurio Registry {APICURIO_VERSION} from Maven Central "
            "once. Install it (e.g. `apt-get install maven`) and retry.")
    home.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="apicurio-", dir=home.parent))
    try:
        cmd = [mvn, "-B", "-q", "dependency:copy", f"-Dartifact={APICURIO_ARTIFACT}",
               f"-DoutputDirectory={staging}"]
        try:  # cwd: the empty staging directory, so that no pom.xml around is read
            proc = subprocess.run(cmd, cwd=staging, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RegistryLaunchError(f"Maven did not fetch {APICURIO_ARTIFACT} within {FETCH_TIMEOUT_S} s "
                                      "(is Maven Central reachable?)") from None
        archives = list(staging.glob("*.zip"))
        if proc.returncode != 0 or len(archives) != 1:
            tail = (proc.stdout + proc.stderr).strip()[-2000:]
            raise RegistryLaunchError(
                f"Maven could not fetch {APICURIO_ARTIFACT} (exit {proc.returncode}):\n{tail}")
        try:
            with zipfile.ZipFile(archives[0]) as archive:
                archive.extractall(staging)
        except zipfile.BadZipFile as exc:
            raise RegistryLaunchError(f"{APICURIO_ARTIFACT} from Maven is not a valid zip: {exc}") from exc
        archives[0].unlink()
        if not (staging / RUNNER_JAR).is_file():
            raise RegistryLaunchError(f"{APICURIO_ARTIFACT} holds no {RUNNER_JAR}: "
                                      f"{sorted(p.name for p in staging.iterdir())}")
        (staging / ".complete").write_text(APICURIO_VERSION + "\n")
        if home.exists():  # an interrupted earlier fetch
            shutil.rmtree(home)
        staging.rename(home)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return home / RUNNER_JAR


class Apicurio:
    """One Apicurio Registry process (in-memory storage) on 127.0.0.1."""

    def __init__(self, runner: Path, work_dir: Path):
        self.runner = runner
        self.work_dir = work_dir
        self.log_file = work_dir / "apicurio.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.start_s = 0.0

    @property
    def url(self) -> str:
        """The base of its Confluent-compatible API: what TABLOOP_SCHEMA_REGISTRY_URL is set to."""
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    def start(self, attempts: int = 3) -> None:
        java = find_java(needed_by=f"Apicurio Registry {APICURIO_VERSION}", min_major=MIN_JAVA)
        # Nothing from the developer's environment configures it (Quarkus reads QUARKUS_*, Apicurio REGISTRY_*).
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QUARKUS_", "REGISTRY_", "APICURIO_"))}
        for attempt in range(1, attempts + 1):
            self.port = free_port()
            started = time.monotonic()
            with open(self.log_file, "wb") as log:
                self.proc = subprocess.Popen(
                    [java, "-Xmx512m", f"-Djava.io.tmpdir={self.work_dir}",
                     "-Dquarkus.http.host=127.0.0.1", f"-Dquarkus.http.port={self.port}", "-jar", str(self.runner)],
                    cwd=self.work_dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            try:
                self._wait_ready(started)
                self.start_s = time.monotonic() - started
                return
            except RegistryLaunchError as exc:
                self.stop()
                # free_port hands on a port nothing held; something could still take it first: try another
                if "already in use" not in str(exc) and "already bound" not in str(exc) or attempt == attempts:
                    raise

    def _wait_ready(self, started: float) -> None:
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RegistryLaunchError(f"Apicurio Registry exited ({self.proc.returncode}) while starting; "
                                          f"{self.log_file}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/subjects", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RegistryLaunchError(f"Apicurio Registry did not answer on {self.url} within {START_TIMEOUT_S} s; "
                                  f"{self.log_file}:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def apicurio(tmp_path_factory) -> Apicurio:
    cache_dir = make_settings(tmp_path_factory.mktemp("apicurio-settings")).cache_dir
    registry = Apicurio(fetch_apicurio(cache_dir), tmp_path_factory.mktemp("apicurio"))
    registry.start()
    try:
        yield registry
    finally:
        registry.stop()


# -- helpers --------------------------------------------------------------------------------------------


def server_get(url: str) -> httpx.Response:
    """Ask the registry directly (not through the client under test)."""
    return httpx.get(url, headers={"Accept": CONTENT_TYPE}, timeout=10)


def probe_schema(name: str, extra_field: bool = False) -> str:
    fields = [{"name": "a", "type": "string"}]
    if extra_field:
        fields.append({"name": "b", "type": "long", "default": 0})
    return json.dumps({"type": "record", "name": name, "namespace": "tabloop.test", "fields": fields})


def unique_subject() -> str:
    return f"test-{uuid.uuid4().hex[:12]}-value"


# -- against the real registry ---------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", list(EVENT_TYPES))
def test_round_trip_through_the_registry(apicurio, tmp_path, type_name):
    """Encode with the codec the services build from TABLOOP_SCHEMA_REGISTRY_URL; decode with a fresh client
    that knows no id, so the writer schema must come from the server."""
    codec = make_codec(make_settings(tmp_path, schema_registry_url=apicurio.url))
    assert codec.wire_format == "confluent"
    event = example_event(type_name, 3)
    data = codec.encode(event)

    # The server's own answer: the codec registered the schema under <topic>-value (TopicNameStrategy).
    et = EVENT_TYPES[type_name]
    latest = server_get(f"{apicurio.url}/subjects/{et.topic}-value/versions/latest")
    assert latest.status_code == 200, latest.text
    server_id = latest.json()["id"]
    assert json.loads(latest.json()["schema"]) == et.schema_json
    assert data[:5] == CONFLUENT_MAGIC + server_id.to_bytes(4, "big")

    fresh = Codec(ConfluentSchemaRegistry(apicurio.url))
    assert fresh.current_body_offset(data, type_name) == 5
    decoded = fresh.decode(data)
    assert decoded.type == type_name
    assert decoded.record == expected_after_round_trip(event.record)
    # and the encoding codec reads its own bytes back too
    assert codec.decode(data).record == expected_after_round_trip(event.record)


def test_events_of_different_types_get_different_ids(apicurio, tmp_path):
    codec = make_codec(make_settings(tmp_path, schema_registry_url=apicurio.url))
    headers = {codec.encode(example_event(name))[:5] for name in EVENT_TYPES}
    assert len(headers) == len(EVENT_TYPES)
    assert all(h[:1] == CONFLUENT_MAGIC for h in headers)


def test_the_same_schema_registered_twice_gets_one_id(apicurio):
    subject, schema = unique_subject(), probe_schema(f"Probe{uuid.uuid4().hex[:8]}")
    first = ConfluentSchemaRegistry(apicurio.url).id_for(subject, schema)
    again = ConfluentSchemaRegistry(apicurio.url).id_for(subject, schema)  # a fresh client: asks the server
    assert again == first
    assert server_get(f"{apicurio.url}/subjects/{subject}/versions").json() == [1]

    # a changed schema under the same subject is a new version with a new id
    evolved = json.dumps({**json.loads(schema), "fields": json.loads(probe_schema("x", extra_field=True))["fields"]})
    second = ConfluentSchemaRegistry(apicurio.url).id_for(subject, evolved)
    assert second != first
    assert server_get(f"{apicurio.url}/subjects/{subject}/versions").json() == [1, 2]
    assert json.loads(ConfluentSchemaRegistry(apicurio.url).schema_for(second)) == json.loads(evolved)
    assert json.loads(ConfluentSchemaRegistry(apicurio.url).schema_for(first)) == json.loads(schema)


def test_an_unknown_id_names_the_id(apicurio, tmp_path):
    unknown = 987_654_321
    assert server_get(f"{apicurio.url}/schemas/ids/{unknown}").status_code == 404

    with pytest.raises(LookupError, match=f"schema id {unknown} not found in {re.escape(apicurio.url)}"):
        ConfluentSchemaRegistry(apicurio.url).schema_for(unknown)

    codec = make_codec(make_settings(tmp_path, schema_registry_url=apicurio.url))
    data = CONFLUENT_MAGIC + unknown.to_bytes(4, "big") + b"\x02a"
    with pytest.raises(UnknownSchemaError, match=f"schema id {unknown} is not in the registry"):
        codec.decode(data)
    assert codec.current_body_offset(data, "Episode") is None
    # the miss is not remembered as anything: known ids still decode
    event = example_event("FeedbackReceived")
    assert codec.decode(codec.encode(event)).record == event.record


def test_an_id_of_a_schema_that_is_not_a_tabloop_event(apicurio):
    schema = probe_schema(f"Other{uuid.uuid4().hex[:8]}").replace("tabloop.test", "elsewhere")
    other = ConfluentSchemaRegistry(apicurio.url).id_for(unique_subject(), schema)
    with pytest.raises(UnknownSchemaError, match=f"schema id {other} is .*not a tabloop event"):
        Codec(ConfluentSchemaRegistry(apicurio.url)).decode(CONFLUENT_MAGIC + other.to_bytes(4, "big") + b"\x02a")


def test_a_wrong_registry_path_is_not_an_unknown_id(apicurio):
    """A 404 without the registry's "not found" code (here Apicurio's root without /apis/ccompat/v7) is the
    registry's fault, not an unknown id: otherwise a misconfigured URL dead-letters every event."""
    wrong = apicurio.url.removesuffix(CCOMPAT_PATH)
    event = example_event("Episode")
    data = Codec(ConfluentSchemaRegistry(apicurio.url)).encode(event)
    try:
        Codec(ConfluentSchemaRegistry(wrong)).decode(data)
    except SchemaRegistryError as exc:
        assert wrong in str(exc)
    except UnknownSchemaError as exc:
        raise AssertionError(f"a wrong registry URL read as an unknown schema: {exc}") from exc
    else:
        raise AssertionError("decoded through a registry URL that serves no registry")


def test_an_id_of_a_protobuf_schema_is_an_unknown_schema(apicurio):
    """The id of a PROTOBUF schema is an unknown schema (a dead letter), not a crash of the consumer."""
    resp = httpx.post(f"{apicurio.url}/subjects/{unique_subject()}/versions", timeout=10,
                      headers={"Content-Type": CONTENT_TYPE},
                      json={"schema": 'syntax = "proto3";\nmessage M { string a = 1; }', "schemaType": "PROTOBUF"})
    assert resp.status_code == 200, resp.text
    proto_id = resp.json()["id"]
    data = CONFLUENT_MAGIC + proto_id.to_bytes(4, "big") + b"\x0a\x01a"
    try:
        Codec(ConfluentSchemaRegistry(apicurio.url)).decode(data)
    except UnknownSchemaError as exc:
        assert str(proto_id) in str(exc)
    except Exception as exc:
        raise AssertionError(f"{type(exc).__name__} instead of UnknownSchemaError: {exc}") from exc


# -- no registry answering (no server needed) ------------------------------------------------------------


def test_an_unreachable_registry_is_a_quick_clear_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    codec = make_codec(make_settings(tmp_path, schema_registry_url=url))
    started = time.monotonic()
    with pytest.raises(SchemaRegistryError, match=f"schema registry {re.escape(url)} unreachable"):
        codec.encode(example_event("FeedbackReceived"))
    # decoding needs the registry too; an outage must not read as a poison message (UnknownSchemaError)
    with pytest.raises(SchemaRegistryError, match="unreachable"):
        codec.decode(CONFLUENT_MAGIC + (7).to_bytes(4, "big") + b"\x02a")
    assert time.monotonic() - started < 5


def test_a_registry_that_never_answers_times_out(tmp_path):
    """A server that accepts the connection and then says nothing: the client gives up after its timeout."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # the kernel completes the handshakes; nobody ever reads or writes
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        client = ConfluentSchemaRegistry(url, timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(SchemaRegistryError, match=f"schema registry {re.escape(url)} unreachable"):
            client.schema_for(1)
        assert time.monotonic() - started < 5


# -- the client's loose ends (issue 31), against a small Confluent-API double ------------------------------


class CountingRegistry:
    """A Confluent-API double on a free port: assigns ids per schema, counts the requests, records the
    Authorization header; ``hang_s`` makes it sit on every request that long, ``fail`` answer 500."""

    def __init__(self):
        import base64
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, str]] = []
        self.auth: list[str | None] = []
        self.hang_s = 0.0
        self.fail = False
        ids: dict[str, int] = {}
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                double.requests.append(("POST", self.path))
                double.auth.append(self.headers.get("Authorization"))
                time.sleep(double.hang_s)
                if double.fail:
                    return self._answer(500, {"error_code": 50001, "message": f"failed for {self.path}"})
                self._answer(200, {"id": ids.setdefault(body["schema"], len(ids) + 1)})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.basic = lambda user, password: "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, userinfo: str = "") -> str:
        return f"http://{userinfo}127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def counting_registry():
    double = CountingRegistry()
    yield double
    double.stop()


def test_a_producer_looks_up_every_schema_id_once_at_start(counting_registry, tmp_path):
    """The ids are looked up when the producer starts (the front door's feedback path encodes before it answers a
    202): afterwards no encode asks the registry, so a registry that stalls cannot hold an acknowledgement."""
    from infra.bus import EventProducer

    settings = make_settings(tmp_path, schema_registry_url=counting_registry.url())
    producer = EventProducer(settings)
    try:
        assert len(counting_registry.requests) == len(EVENT_TYPES), counting_registry.requests
        counting_registry.hang_s = 5.0  # the registry stalls from now on
        started = time.monotonic()
        for name in EVENT_TYPES:
            assert producer.codec.encode(example_event(name))[:1] == CONFLUENT_MAGIC
        assert time.monotonic() - started < 1.0
        assert len(counting_registry.requests) == len(EVENT_TYPES)
    finally:
        counting_registry.hang_s = 0.0
        producer.close()


def test_registry_credentials_are_sent_but_never_shown(counting_registry, tmp_path, caplog):
    """user:password in the URL becomes basic auth; no message (an error answer, an unreachable registry) and no
    log line carries the password."""
    secret = "s3cr3t-pw"
    client = ConfluentSchemaRegistry(counting_registry.url(f"alice:{secret}@"))
    try:
        client.id_for(unique_subject(), probe_schema("Creds"))
        assert counting_registry.auth[-1] == counting_registry.basic("alice", secret)
        counting_registry.fail = True
        with pytest.raises(SchemaRegistryError) as failed:
            client.id_for(unique_subject(), probe_schema("Creds2"))
        assert "answered 500" in str(failed.value) and secret not in str(failed.value)
        assert client.url == counting_registry.url()
    finally:
        client.close()
    down = f"http://alice:{secret}@127.0.0.1:{free_port()}"
    codec = make_codec(make_settings(tmp_path, schema_registry_url=down))
    with pytest.raises(SchemaRegistryError) as unreachable:
        codec.encode(example_event("FeedbackReceived"))
    text = str(unreachable.value) + repr(unreachable.value.__cause__) + repr(unreachable.value.__context__)
    assert "unreachable" in text and secret not in text and "alice:" not in text
    assert secret not in caplog.text
    codec.close()


def test_the_registry_client_is_closed_with_its_owner(counting_registry, tmp_path):
    """A producer that made its own codec closes the registry client with it; so does the trainer's codec."""
    from infra.bus import EventProducer

    producer = EventProducer(make_settings(tmp_path, schema_registry_url=counting_registry.url()))
    registry = producer.codec.registry
    assert not registry.closed
    producer.close()
    assert registry.closed
