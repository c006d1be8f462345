"""A real single-node Apache Kafka (KRaft) on 127.0.0.1, for one machine.

The broker's jars are the official ``org.apache.kafka:kafka_2.13`` artifacts
and their dependencies, fetched once from Maven Central with Maven into the
cache directory. Storage is formatted on first start under the state dir, so
data survives stop/start.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from infra.bus import broker_answers
from infra.files import PRIVATE_UMASK, log_tail, open_private, private_dir, write_private
from infra.settings import Settings

POM = Path(__file__).parent / "kafka" / "pom.xml"
# Pinned in the pom (one place): the newest Kafka every client tabloop uses works with.
KAFKA_VERSION = re.search(r"<kafka.version>([^<]+)</kafka.version>", POM.read_text()).group(1)
MIN_JAVA = 17  # Kafka 4 brokers need Java 17
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0


class KafkaLaunchError(RuntimeError):
    """The local broker can't be fetched, started or stopped; the message says why."""


@dataclass
class BrokerStatus:
    running: bool
    answering: bool
    pid: int | None
    bootstrap: str
    version: str
    data_dir: str

    def as_dict(self) -> dict:
        return self.__dict__.copy()


SEVERAL_WORKERS_JOIN_WAIT_MS = 3000
"""Kafka's default ``group.initial.rebalance.delay.ms``: how long a new consumer group waits for more members
before its first assignment. Wherever several streams workers start together (``bench pipeline --workers N``,
the compose file's and the cluster's two replicas): with no wait the first one in is assigned every partition,
starts, and is rebalanced a moment later, and about one such start in ten left completions unjoined (Faust's
transactions across that rebalance; issue 32's note)."""
ABORT_CHECK_S = 2.0
"""How often the local broker looks for timed-out transactions to abort (Kafka's default: 10 s)."""


class LocalKafka:
    def __init__(self, settings: Settings, *, java: str = "java", maven: str = "mvn",
                 group_join_wait_ms: int = 0):
        """``group_join_wait_ms``: see ``SEVERAL_WORKERS_JOIN_WAIT_MS``. 0 by default: tests and one machine
        start a group's only member and want it assigned at once."""
        self.settings = settings
        self.group_join_wait_ms = group_join_wait_ms
        self.java_cmd = java
        self.maven_cmd = maven
        self.host, self.port = _local_listener(settings.kafka_bootstrap)
        self.dir = settings.kafka_dir.resolve()
        self.data_dir = self.dir / "data"
        self.pid_file = self.dir / "kafka.pid"
        self.log_file = self.dir / "kafka.log"
        self.properties_file = self.dir / "server.properties"
        # Keyed by the pom's content: a changed pin or logging binding fetches afresh.
        pom_digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:10]
        self.jars_dir = settings.cache_dir.expanduser().resolve() / f"kafka-{KAFKA_VERSION}-{pom_digest}" / "libs"

    # -- jars -----------------------------------------------------------------

    def fetch(self) -> Path:
        """Fetch the broker's jars with Maven once; later calls return the cache."""
        if (self.jars_dir / ".complete").exists():
            return self.jars_dir
        mvn = shutil.which(self.maven_cmd)
        if mvn is None:
            raise KafkaLaunchError(
                f"Maven ({self.maven_cmd!r}) is not on PATH: it fetches the Kafka {KAFKA_VERSION} jars "
                "from Maven Central once. Install it (e.g. `apt-get install maven`) and retry."
            )
        self.jars_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="libs-", dir=self.jars_dir.parent))
        cmd = [mvn, "-B", "-q", "-f", str(POM), "dependency:copy-dependencies",
               f"-DoutputDirectory={staging}", "-DincludeScope=runtime"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not any(staging.glob(f"kafka_2.13-{KAFKA_VERSION}.jar")):
            shutil.rmtree(staging, ignore_errors=True)
            tail = (proc.stdout + proc.stderr).strip()[-2000:]
            raise KafkaLaunchError(f"Maven could not fetch Kafka {KAFKA_VERSION} (exit {proc.returncode}):\n{tail}")
        (staging / ".complete").write_text(KAFKA_VERSION + "\n")
        if self.jars_dir.exists():  # an interrupted earlier fetch
            shutil.rmtree(self.jars_dir)
        staging.rename(self.jars_dir)
        return self.jars_dir

    # -- lifecycle ------------------------------------------------------------

    def start(self, *, timeout_s: float = READY_TIMEOUT_S) -> BrokerStatus:
        """Start the broker (formatting storage on first start); return once it answers metadata."""
        running = self._running_pid()
        if running:
            # It may be starting: another `tabloop kafka start` launched it a moment ago (two at once, or a
            # stop-and-start overlapping another). Waited for as this start would wait for its own broker.
            deadline = time.monotonic() + timeout_s
            while self._running_pid() == running:
                if self._answers():
                    return self.status()
                if time.monotonic() >= deadline:
                    raise KafkaLaunchError(f"a broker (pid {running}) is running from {self.dir} but did not answer "
                                           f"on {self.bootstrap} within {timeout_s:.0f}s; see {self.log_file} or "
                                           f"run `tabloop kafka stop`")
                time.sleep(0.3)
            return self.start(timeout_s=timeout_s)  # it exited (its start failed): one afresh
        java = self._java()
        if _port_in_use(self.host, self.port):
            raise KafkaLaunchError(f"port {self.port} on {self.host} is already in use; "
                                   "set TABLOOP_KAFKA_BOOTSTRAP to a free one")
        jars = self.fetch()
        # The broker's dir and log private, and its data (segments, checkpoints, meta.properties) too: the
        # broker and the storage tool run with the private umask. The events hold users' code.
        private_dir(self.settings.state_dir)
        private_dir(self.dir)
        # Not a port the settings give the front door or the history server: they bind theirs only after the
        # broker is up, and a port picked in another process (the settings') looks free here until then.
        s = self.settings
        self._write_config(controller_port=_free_port(
            self.host, avoid={self.port, s.completions_port, s.feedback_port, s.history_port}))
        classpath = f"{jars}/*"
        if not (self.data_dir / "meta.properties").exists():
            self._format(java, classpath)
        log = open_private(self.log_file)
        proc = subprocess.Popen(
            [java, f"-Xmx{self.settings.kafka_heap}", f"-Xms{self.settings.kafka_heap}",
             "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
             f"-Dlog4j2.configurationFile={self._log_config}",
             f"-Dkafka.logs.dir={self.dir / 'logs'}",
             "-cp", classpath, "kafka.Kafka", str(self.properties_file)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # survives the CLI that started it
            umask=PRIVATE_UMASK,
        )
        log.close()
        write_private(self.pid_file, f"{proc.pid}\n")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise KafkaLaunchError(f"Kafka exited with code {proc.returncode} while starting:\n{self._log_tail()}")
            if self._answers():
                return self.status()
            time.sleep(0.3)
        self.stop()
        raise KafkaLaunchError(f"Kafka did not answer on {self.bootstrap} within {timeout_s:.0f}s:\n{self._log_tail()}")

    def stop(self, *, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Stop the broker cleanly (SIGTERM, then SIGKILL after ``timeout_s``). False if it wasn't running."""
        pid = self._running_pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                break
            time.sleep(0.2)
        else:
            os.kill(pid, signal.SIGKILL)
            while pid_alive(pid):
                time.sleep(0.1)
        self.pid_file.unlink(missing_ok=True)
        return True

    def status(self) -> BrokerStatus:
        pid = self._running_pid()
        return BrokerStatus(
            running=pid is not None,
            answering=pid is not None and self._answers(),
            pid=pid,
            bootstrap=self.bootstrap,
            version=KAFKA_VERSION,
            data_dir=str(self.data_dir),
        )

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    # -- internals ------------------------------------------------------------

    def _java(self) -> str:
        return find_java(self.java_cmd, needed_by=f"Kafka {KAFKA_VERSION}")

    def _write_config(self, controller_port: int) -> None:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "listeners": f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            # A single voter: the controller address may change between starts.
            "controller.quorum.voters": f"1@{self.host}:{controller_port}",
            "log.dirs": str(self.data_dir),
            "num.partitions": "1",
            # Topics are created from the catalog (`tabloop topics create`), never by a typo.
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "group.initial.rebalance.delay.ms": str(self.group_join_wait_ms),
            # A transaction left open by a worker that was killed or cut off holds every read_committed reader of
            # its partitions until it times out (30 s, streams.upstream.TRANSACTION_TIMEOUT_S) and the broker's
            # next check aborts it: every 2 s here instead of Kafka's 10 s (issue 44).
            "transaction.abort.timed.out.transaction.cleanup.interval.ms": str(int(ABORT_CHECK_S * 1000)),
            "log.retention.check.interval.ms": "300000",
            "num.network.threads": "2",
            "num.io.threads": "4",
        }
        # Private like everything in the broker's dir (written by this process, not under the broker's umask).
        write_private(self.properties_file, "".join(f"{k}={v}\n" for k, v in props.items()))
        write_private(
            self._log_config,
            "status = warn\n"
            "appender.out.type = Console\nappender.out.name = STDOUT\n"
            "appender.out.layout.type = PatternLayout\nappender.out.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = INFO\nrootLogger.appenderRef.out.ref = STDOUT\n"
            "logger.request.name = kafka.request.logger\nlogger.request.level = WARN\n"
            "logger.state.name = state.change.logger\nlogger.state.level = WARN\n"
        )

    @property
    def _log_config(self) -> Path:
        return self.dir / "log4j2.properties"

    def _format(self, java: str, classpath: str) -> None:
        cluster_id_file = self.dir / "cluster.id"
        if not cluster_id_file.exists():
            write_private(cluster_id_file, base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=") + "\n")
        cluster_id = cluster_id_file.read_text().strip()
        proc = subprocess.run(
            [java, "-Xmx256m", f"-Dlog4j2.configurationFile={self._log_config}",
             "-cp", classpath, "kafka.tools.StorageTool", "format",
             # `=`: a base64 id may start with "-", which a separate argument would read as an option.
             f"--cluster-id={cluster_id}", "-c", str(self.properties_file), "--ignore-formatted"],
            capture_output=True, text=True, umask=PRIVATE_UMASK,
        )
        if proc.returncode != 0:
            raise KafkaLaunchError(f"formatting Kafka storage in {self.data_dir} failed:\n{proc.stdout}{proc.stderr}")

    def _running_pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not pid_alive(pid):
            return None
        try:  # the pid may have been reused by an unrelated process
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return pid
        return pid if str(self.properties_file).encode() in cmdline else None

    def _answers(self) -> bool:
        return broker_answers(self.settings)

    def _log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_file, lines)


def find_java(java_cmd: str = "java", *, needed_by: str, min_major: int = MIN_JAVA) -> str:
    """The path of ``java_cmd`` if it is Java ``min_major`` or newer; KafkaLaunchError saying what is wrong
    otherwise (``needed_by``: what needs it, for the message). Old "1.8.0"-style versions read as 8."""
    java = shutil.which(java_cmd)
    if java is None:
        raise KafkaLaunchError(
            f"Java ({java_cmd!r}) is not on PATH: {needed_by} needs Java {min_major} or newer. "
            "Install a JDK or JRE (e.g. `apt-get install openjdk-17-jre-headless`) and retry."
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True)
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    major = int(m.group(1)) if m else 0
    if major == 1 and m.group(2):  # "1.8.0" style
        major = int(m.group(2))
    if major < min_major:
        raise KafkaLaunchError(f"{java} is Java {major or '?'}; {needed_by} needs Java {min_major} or newer")
    return java


def _local_listener(bootstrap: str) -> tuple[str, int]:
    first = bootstrap.split(",")[0]
    host, _, port = first.rpartition(":")
    if host not in LOCAL_HOSTS:
        raise KafkaLaunchError(f"TABLOOP_KAFKA_BOOTSTRAP is {bootstrap!r}: the local broker listens on "
                               "127.0.0.1 only; point it at 127.0.0.1:<port>")
    return ("127.0.0.1" if host == "localhost" else host.strip("[]")), int(port)


def pid_alive(pid: int) -> bool:
    """Is ``pid`` a live process (a zombie is not)? Shared by the broker launcher and the supervisor."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:  # gone since the kill(0); with no /proc at all, trust the kill(0)
        return not Path("/proc/self").exists()
    except OSError:
        return True


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


_handed_out: set[int] = set()
PORT_FLOOR = 20000  # below it sit the ports developers' own services use (8080, 9092, 5432, ...)


def _free_port(host: str = "127.0.0.1", avoid: set[int] = frozenset()) -> int:
    """A port nothing holds now, for a server about to bind it.

    Binding port 0 and handing that port on (as this did) races the kernel: the port is one of its
    ephemeral ones, which it hands to the next outgoing connection or bind to port 0 of any process, so
    the server's own bind could fail. This picks a random port below the kernel's ephemeral range
    (``ip_local_port_range``), which the kernel never hands out by itself, checks that it binds, and never
    hands the same one out twice in a process, nor one of ``avoid`` (ports another process picked and will
    bind later): only another explicit bind of that very port can take it first (callers that can, retry on
    EADDRINUSE). Where the ephemeral range leaves too little room below it, the old way."""
    low = _ephemeral_low()
    candidates = range(PORT_FLOOR, low) if low - PORT_FLOOR >= 1000 else None
    for _ in range(50 if candidates else 0):
        port = random.choice(candidates)
        if port in _handed_out or port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    return _free_port()
