"""Workarounds for Faust and aiokafka, kept apart from the topology (streams/app.py) that relies on them.

Each one subclasses or reads a private part of faust-streaming (<0.16) or aiokafka, names the upstream
issue it works around where one is known, and is covered by a test that fails if an upgrade moves what it
touches (tests/test_streams*.py, the fault drills). ``StreamsApp`` wires them into Faust's transport.

- ``TransactionalTable``: table changelog writes inside the event's transaction (stock Faust sends them
  from a background buffer; robinhood/faust#599 is the nearest report), a key's last value only, when
  the transaction commits (``ChangelogWrites``).
- ``SourceBoundTransactions``: a repartitioned send commits with its input's offset (duplicates after a
  crash otherwise; faust-streaming/faust#517 reports such duplicates under exactly_once).
- ``SeekSafeConsumer``: no commit stall after a seek (faust-streaming/faust#596), stream partitions
  resumed only once the seek after a rebalance is done, no commit past a message still in flight
  (faust-streaming/faust#606), O(log n) gap bookkeeping, highwaters from ListOffsets
  (``ListedHighwatersThread``; no upstream report found for these two).
- ``dead_producers``: aiokafka's sender routine dies for good on an unexpected error and every later send
  waits forever (aio-libs/aiokafka#907 shows the same "Unexpected error in sender routine").
- ``SeekSafeConsumer.on_partitions_revoked`` and ``SourceBoundTransactions.on_rebalance``: nothing
  uncommitted outlives a rebalance (Faust forgets the acks before it commits; the open transaction of a
  partition the worker keeps then went on and took the re-read input's output a second time: issue 44).
- ``SeekSafeConsumer.perform_seek`` with ``behind_own_commits``: the seek after a rebalance goes no further back
  than the worker's own last commit (the broker may still answer the offset from before it: aiokafka's
  OffsetFetch cannot ask for KIP-447's stable offsets).
- ``SourceBoundTransactions.commit``: a commit that fails ends the worker at once (Faust swallows a fenced
  producer, or stops gracefully while still committing, its transactions open meanwhile: issue 44).
- ``BoundedTransactionsProducer.commit_transactions``: the source partitions' transactions commit side by side
  (Faust commits them one after another: an episode in the last waited for all the others).
- ``MarkerAwareRecovery``: table recovery reads a changelog up to its last committed record (Faust waited
  10-15 s for a record at the offset of the final commit marker, which never comes).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict

import aiokafka
import faust
from aiokafka import TopicPartition
from aiokafka.errors import (CoordinatorLoadInProgressError, CoordinatorNotAvailableError, KafkaError,
                             NotCoordinatorError)
from aiokafka.protocol.group import LeaveGroupRequest
from faust import current_event
from faust.tables.manager import TableManager
from faust.tables.recovery import Recovery
from faust.transport.consumer import TransactionManager
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.transport.drivers.aiokafka import Producer as AIOKafkaProducer

log = logging.getLogger("tabloop.streams")
EXIT_UNCOMMITTED = 76
"""The worker's exit code when it holds work it could not commit: a commit failed, or a rebalance found
output in a transaction it keeps (``exit_for_a_clean_start``)."""
TRANSACTION_TIMEOUT_S = 30.0
"""How long the broker lets a transaction of the worker stay open before it aborts it (aiokafka's default is
60 s). A transaction lives one commit interval (0.5 s) when all is well; one left open by a worker that
was killed, paused or cut off holds every read_committed reader of its partitions (the trainer, the
history sink) behind it until its worker's successor fences it or the broker times it out: this bounds
that wait. It must stay above the longest a healthy commit can take (a broker that is back but slow)."""
REVOKE_COMMIT_TIMEOUT_S = 20.0
"""How long the commit before a rebalance may take (a broker that is back but slow) before the worker gives
up on it and exits: under the broker's rebalance timeout, which would otherwise expel the worker."""


LEAVE_GROUP_TIMEOUT_S = 10.0
"""How long a worker about to exit waits for the group coordinator to take its leave (``leave_group``)."""
COORDINATOR_MOVED = {CoordinatorLoadInProgressError.errno, CoordinatorNotAvailableError.errno,
                     NotCoordinatorError.errno}
"""Answers to a group request after which it is sent again, to the coordinator looked up again."""


def exit_for_a_clean_start(why: str, consumer) -> None:
    """Exit at once, as a SIGKILL would, because this process holds state it cannot roll back: table entries
    and an open transaction's output from input it is about to read again. The worker the supervisor starts
    next fences this one's transactional producers (the broker aborts their open transactions), restores its
    tables from what was committed and reads from the committed offsets: nothing lost, nothing twice. It
    leaves the group first (``leave_group``), so that its successor is not kept waiting for its session."""
    log.error("%s; exiting with code %d for a fresh worker to start from what was committed", why,
              EXIT_UNCOMMITTED)
    leave_group(consumer)
    logging.shutdown()
    os._exit(EXIT_UNCOMMITTED)


def leave_group(consumer) -> None:
    """Tell the group coordinator that this member leaves (best effort, ``LEAVE_GROUP_TIMEOUT_S``), before an
    exit that skips Faust's stop. Without it the group keeps the dead member until its session expires
    (Faust's ``broker_session_timeout``, 60 s), and its successor, started at once by the supervisor, gets
    no partition until then: the exit after a broker outage held the whole pipeline a minute (issue 44).

    Only the request is sent: aiokafka's own ``_maybe_leave_group`` also resets the member, and its
    coordination task would then rejoin from this dying process. The request goes through the consumer's
    thread (Faust runs aiokafka's consumer on a loop of its own), which is free: this is called from the
    app's loop, which blocks here until it exits."""
    thread = getattr(consumer, "_thread", None)
    coordinator = getattr(getattr(thread, "_consumer", None), "_coordinator", None)
    if coordinator is None or coordinator.generation <= 0 or not coordinator.member_id:
        return  # never joined: nothing to leave
    try:
        calling_loop = asyncio.get_running_loop()
    except RuntimeError:
        calling_loop = None
    if calling_loop is thread.thread_loop:
        log.warning("not leaving the group: called from the consumer's own loop, which would have to answer")
        return

    async def send_leave():
        # A broker that has just come back may answer "not the coordinator" or "loading" (the fuzzer's
        # kafka-paused-45s: NOT_COORDINATOR at once after the wake): look the coordinator up again and retry.
        while True:
            try:
                await coordinator.ensure_coordinator_known()
                response = await coordinator._send_req(LeaveGroupRequest(coordinator.group_id,
                                                                         coordinator.member_id))
            except KafkaError as exc:
                if not exc.retriable:
                    raise
            else:
                if response.error_code not in COORDINATOR_MOVED:
                    return response.error_code
                coordinator.coordinator_dead()
            await asyncio.sleep(0.1)

    try:
        error_code = asyncio.run_coroutine_threadsafe(send_leave(), thread.thread_loop).result(LEAVE_GROUP_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - best effort: the session's expiry removes the member anyway
        log.warning("could not leave the group (%r): the successor waits for this member's session to expire", exc)
    else:
        log.info("left the group (member %s, generation %d, error code %d)", coordinator.member_id,
                 coordinator.generation, error_code)


def transaction_has_output(kafka_producer) -> bool:
    """Whether an aiokafka transactional producer's open transaction holds anything: records sent (their
    partitions added or being added) or offsets sent to it. Reads aiokafka's transaction manager (0.14)."""
    txn = getattr(kafka_producer, "_txn_manager", None)
    return txn is not None and bool(txn._txn_partitions or txn._pending_txn_partitions
                                    or txn._pending_txn_offsets or txn._txn_consumer_group)


def dead_producers(producer) -> list[str]:
    """The Kafka producers under a Faust producer whose background sender has died, by transactional id
    ("default" for the plain one).

    aiokafka's sender routine ends for good on an error it does not expect (a connection closed during
    a transaction-coordinator lookup: Kafka stopped in the middle of a transaction), and each send after
    that waits forever. Faust does not notice: the worker stays in its group, healthy to every probe,
    and processes nothing (the Kafka-outage drill caught one 1,939 events behind)."""
    found = []
    for name, kafka_producer in {"default": producer._producer, **producer._transaction_producers}.items():
        task = kafka_producer._sender.sender_task if kafka_producer is not None else None  # None: not started
        if (task is not None and task.done() and not task.cancelled() and task.exception() is not None
                and not kafka_producer._closed):
            found.append(name)
    return found


class ChangelogWrites:
    """Table changes waiting for their transaction's commit, one per key: the last value (None: deleted).

    Each change belongs to the transaction of the event that made it (its source partition's producer,
    ``transactional_id_of``). When that transaction commits (``SourceBoundTransactions.commit``), the
    changes go out first, in it, sent straight to the producer: a key written twice between two commits
    (a completion opened and closed, feedback that came first and its completion) costs one record, and
    none pays for Faust's per-message send path. Nothing reads a changelog but a restore, which only
    sees committed records, so a record sent at commit time restores the same table as one sent at
    once. The changes of a transaction that is not committed (its partitions revoked first) are dropped
    with it: its input is read again by the partition's next owner.

    At least once there are no transactions: the agent sends an event's changes (``send([None])``, the
    plain producer) before it acks the event, as stock Faust would send them before their offset."""

    def __init__(self, app: faust.App) -> None:
        self.app = app
        self._by_transaction: dict[str | None, dict[tuple, tuple]] = defaultdict(dict)

    def write(self, table: faust.Table, key, value) -> None:
        tid = current_transaction(self.app, f"table {table.name!r} written")
        self._by_transaction[tid][(table.changelog_topic.get_topic_name(), table.partition_for_key(key), key)] = \
            (table, value)

    async def send(self, transactional_ids) -> None:
        """Send the waiting changes of these transactions into them (None: no transaction, the plain
        producer)."""
        serializers = self.app.serializers
        for tid in transactional_ids:
            changes = self._by_transaction.pop(tid, None)
            for (topic, partition, key), (table, value) in (changes or {}).items():
                await self.app.producer.send(
                    topic, serializers.dumps_key(table.key_type, key, serializer=table.key_serializer),
                    None if value is None else serializers.dumps_value(table.value_type, value,
                                                                       serializer=table.value_serializer),
                    partition, None, None, transactional_id=tid)

    def drop(self, transactional_ids) -> None:
        for tid in transactional_ids:
            self._by_transaction.pop(tid, None)

    def pending(self, transactional_id) -> bool:
        """Whether this transaction has table changes waiting for its commit."""
        return bool(self._by_transaction.get(transactional_id))


async def send_raw(app: faust.App, topic: str, key: bytes, value: bytes | None) -> None:
    """Send one record in the transaction of the event being processed (at least once: the plain producer),
    straight to the producer: what a Faust ``Topic.send`` does there, without its per-message futures,
    callbacks and sensors (0.17 ms a send against 0.04 ms in a cProfile of the worker). The partition is
    the producer's own from the key, as Faust's would be."""
    await app.producer.send(topic, key, value, None, None, None,
                            transactional_id=current_transaction(app, f"a send to {topic!r}"))


def current_transaction(app: faust.App, what: str) -> str | None:
    """The transactional id of the event being processed (None: at least once, no transactions). Every
    table write and send of the worker is made while an event is processed (streams/app.py)."""
    event = current_event()
    if event is None:
        raise RuntimeError(f"{what} outside the processing of an event: there is no transaction to put it in")
    return transactional_id_of(app, event.message.tp) if app.in_transaction else None


def transactional_id_of(app: faust.App, source) -> str:
    """The transactional id of a source partition's producer, as Faust names it (``TransactionManager``)."""
    return f"{app.conf.id}-{app.assignor.group_for_topic(source.topic)}-{source.partition}"


class TransactionalTable(faust.Table):
    """A Faust table whose changelog writes go out in the transaction of the event that made them.

    Stock Faust queues changelog writes in a producer buffer that a background task drains, so a
    commit can carry an event's offset without its state change (or the reverse). Here every write
    waits in ``app.tabloop_changes`` (``ChangelogWrites``) and goes out in its event's transaction
    when that commits: state, outputs and offsets commit together or not at all.
    """

    def on_key_set(self, key, value) -> None:
        self.app.tabloop_changes.write(self, key, value)

    def on_key_del(self, key) -> None:
        self.app.tabloop_changes.write(self, key, None)


class SourceBoundTransactions(TransactionManager):
    """Exactly-once that holds when outputs go to other partitions than their input came from.

    Faust picks the transaction of a send by the *destination* partition, but commits a source
    partition's offsets in the transaction of the *source* partition. Every send of a repartition
    then sits in a transaction that commits on another schedule than its input's offset, and a
    SIGKILL between the two replays input whose output is already out: duplicates. Here a send
    made while processing an event joins that event's source-partition transaction, and a commit
    waits until no event is half-processed.
    """

    async def send(self, topic, key, value, partition, timestamp, headers, *, transactional_id=None):
        event = current_event()
        if event is None:  # not inside an agent: Faust's own rule
            return await super().send(topic, key, value, partition, timestamp, headers)
        return await self.producer.send(
            topic, key, value, self.consumer.key_partition(topic, key, partition), timestamp, headers,
            transactional_id=transactional_id_of(self.app, event.message.tp))

    async def commit(self, offsets, start_new_transaction: bool = True) -> bool:
        """Each source partition's table changes and offsets into its transaction, and the transactions
        committed; a commit that fails exits the worker (``exit_for_a_clean_start``).

        A failed commit leaves transactions in a state the worker cannot know (offsets sent or not, ended or
        not) with output in them. Faust would log a fenced producer and crash the app, or let any other
        error crash it: a graceful stop that went on trying to commit, holding those transactions open and
        every read_committed reader of their partitions behind them (a minute after a Kafka outage in the
        fuzzer, issue 44). An exit at once hands them to the next worker, whose producers fence this one's:
        the broker aborts what was not committed and the input is read again from the committed offsets."""
        async with self.app.tabloop_processing:
            try:
                await self.app.tabloop_changes.send({transactional_id_of(self.app, tp) for tp in offsets})
                by_transaction: dict[str, dict] = defaultdict(dict)
                for tp, offset in offsets.items():
                    by_transaction[transactional_id_of(self.app, tp)][tp] = offset
                if by_transaction:
                    await self.producer.commit_transactions(by_transaction, self.app.conf.id,
                                                            start_new_transaction=start_new_transaction)
            except Exception as exc:  # noqa: BLE001 - any failure leaves transactions in an unknown state
                exit_for_a_clean_start(f"a commit failed ({exc!r})", self.consumer)
            return True

    async def on_rebalance(self, assigned, revoked, newly_assigned) -> None:
        """Faust keeps the producer of a partition the worker keeps and "begins" its transaction again, which
        aiokafka refuses while it is open ("Invalid state transition IN_TRANSACTION -> IN_TRANSACTION",
        swallowed): the open transaction goes on. The consumer committed before the rebalance
        (``SeekSafeConsumer.on_partitions_revoked``), so that transaction is empty unless the commit failed;
        if it holds output, so do the tables, and the partition is about to be read again from its committed
        offset: only a fresh start rolls both back. A revoked partition's open transaction is aborted by its
        next owner's producer (the same transactional id fences this one), its table changes are dropped."""
        self.app.tabloop_changes.drop({transactional_id_of(self.app, tp) for tp in revoked})
        kept = {transactional_id_of(self.app, tp) for tp in set(assigned) - set(newly_assigned)}
        producers = self.producer._transaction_producers
        holding = sorted(tid for tid in kept if (tid in producers and transaction_has_output(producers[tid]))
                         or self.app.tabloop_changes.pending(tid))
        if holding:
            exit_for_a_clean_start(f"a rebalance found uncommitted output in the transactions of {holding}, "
                                   f"partitions this worker keeps and reads again from their committed offsets",
                                   self.consumer)
        # An empty transaction already open is the one to go on with: not begun again (the warning above).
        going_on = {tid for tid in kept if tid in producers and producers[tid]._txn_manager is not None
                    and producers[tid]._txn_manager.is_in_transaction()}
        await super().on_rebalance({tp for tp in assigned if transactional_id_of(self.app, tp) not in going_on},
                                   revoked, newly_assigned)


def behind_own_commits(own_commits: dict, answered: dict) -> dict:
    """The partitions whose committed offset as the broker answered it (None: none) is below the one this
    process committed itself, with the latter.

    A transaction's offsets become readable (OffsetFetch) only when its commit marker reaches the group's
    offsets partition, which happens after the commit call returns: measured here (a local broker, aiokafka's
    ``committed()`` at once after ``commit_transaction``), 244 of 300 answers were the offset before the commit,
    fresh only 9-45 ms later; a broker that has just come back writes its markers later still. KIP-447's
    ``require_stable`` would make the broker wait, but aiokafka's OffsetFetch (v3) cannot ask for it. A worker
    that keeps a partition across a rebalance commits just before it and seeks to the answer just after: a
    stale answer re-reads input whose output is committed, and commits it a second time. Committed offsets only
    move forward while the worker runs, so its own last commit is a floor."""
    return {tp: own_commits[tp] for tp, offset in answered.items()
            if tp in own_commits and (offset or 0) < own_commits[tp]}


class BoundedTransactionsProducer(AIOKafkaProducer):
    """Faust's aiokafka producer whose transactional producers time out after ``TRANSACTION_TIMEOUT_S``
    (Faust passes no transaction timeout, so aiokafka's 60 s applied) and commit side by side."""

    def _settings_extra(self):
        extra = dict(super()._settings_extra())
        if self.app.in_transaction:
            extra["transaction_timeout_ms"] = int(TRANSACTION_TIMEOUT_S * 1000)
        return extra

    async def commit_transactions(self, tid_to_offset_map, group_id, start_new_transaction: bool = True) -> None:
        """Each source partition's transaction committed side by side: Faust commits them one after another,
        three round trips each (offsets to the transaction, its end, the next begin), so an episode in the
        last of them waited for all the others (issue 44's feedback -> episode p99). The transactions are
        independent (one producer each); a failure in any is raised, as before, and ends the worker."""
        await asyncio.gather(*(self._commit_one(transactional_id, offsets, group_id, start_new_transaction)
                               for transactional_id, offsets in tid_to_offset_map.items()))

    async def _commit_one(self, transactional_id: str, offsets, group_id: str, start_new_transaction: bool) -> None:
        async with self._trn_locks[transactional_id]:
            producer = self._transaction_producers.get(transactional_id)
            if producer is None:
                log.warning("commit asked for unknown transaction %s", transactional_id)
                return
            await producer.send_offsets_to_transaction(offsets, group_id)
            await producer.commit_transaction()
            if start_new_transaction:
                await producer.begin_transaction()


class ListedHighwatersThread(AIOKafkaConsumerThread):
    """Highwaters asked of the broker (ListOffsets), never read off the last fetch (see
    ``SeekSafeConsumer``)."""

    async def _highwaters(self, partitions):
        return await self._ensure_consumer().end_offsets(partitions)


class _ReadOffsets(dict):
    """Faust's per-partition read offsets, deaf to the one write that would make them stale (see
    ``SeekSafeConsumer``). Faust seeks write through ``dict.update``, which this class leaves alone."""

    def __init__(self, consumer: "SeekSafeConsumer"):
        super().__init__()
        self.consumer = consumer

    def __missing__(self, tp):
        return None

    def __setitem__(self, tp, offset) -> None:
        if not self.consumer.stale_write(tp, offset):
            super().__setitem__(tp, offset)


class SeekSafeConsumer(AIOKafkaConsumer):
    """A consumer whose commits never stall after a seek, and whose highwaters are asked of the broker.

    **Stalls.** After a rebalance Faust restores the tables, then seeks each stream partition back to its
    committed offset C and re-reads from there. Its fetch loop may meanwhile be half-way through a
    batch fetched *before* the seek: it hands that batch's next message M to the streams and then
    records M's offset as the partition's read offset, overwriting C. The re-read from C then drops
    every message below M as already read, so C..M-1 are never processed, never acked, and the
    contiguous-acks rule never lets the partition commit again: its lag grows forever (seen after a
    SIGKILL and restart of the worker; faust-streaming issue 596 describes the same race).

    Here every fetched batch carries the seek epoch of each partition at fetch time. A message from
    before its partition's latest seek is not handed on (the re-read delivers it again); if it was
    already handed on, its read-offset write is ignored and the agents skip it without counting its
    ack. When a batch is dropped for that reason the partition is sought back to where its latest
    seek put it, so nothing the broker had already moved past is skipped.

    **Highwaters.** Under exactly-once, Faust takes a partition's highwater from aiokafka's
    ``last_stable_offset``, which only a fetch response fills in: for a changelog partition not
    fetched yet it is unknown, Faust counts that as empty and skips the restore. A worker started
    right after a Kafka restart did exactly that, began with empty tables and joined feedback it had
    already joined into a second episode. ListOffsets with the consumer's isolation level
    (read_committed) answers the last stable offset at once (``ListedHighwatersThread``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._resume_after_seek: set = set()
        self.seek_epoch: dict = defaultdict(int)
        self._seek_target: dict = {}
        self._batch_epochs: dict = {}
        self._handed: dict[int, tuple] = {}  # id(message) -> (tp, epoch) of messages handed on
        self._last_handed: dict = {}  # tp -> (offset, epoch) of the message the fetch loop holds
        self._read_offset = _ReadOffsets(self)
        self._own_commits: dict = {}  # tp -> the offset this process last committed; kept across rebalances

    async def on_partitions_revoked(self, revoked) -> None:
        """Commit what was processed, then let Faust forget it. Faust drops every revoked partition's acks
        (all of them: aiokafka's rebalances revoke the whole assignment) before its own commit in
        ``wait_empty``, which so had nothing to commit: the work done since the last commit stayed in the
        open transactions, and a partition the worker kept read it again and sent its output a second time
        (issue 44: episodes twice after a broker outage, and at any rebalance within a commit interval of
        processing). A commit that fails or hangs leaves state the worker cannot roll back: it exits."""
        if self.app.in_transaction and revoked:
            try:
                await asyncio.wait_for(self._commit_all_acked(), REVOKE_COMMIT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure leaves uncommitted state behind
                exit_for_a_clean_start(f"the commit before a rebalance failed ({exc!r})", self)
        await super().on_partitions_revoked(revoked)

    async def _commit_all_acked(self) -> None:
        # A commit already under way (the periodic one) makes ``commit`` wait for it and return: ask again
        # until nothing acked is left to commit.
        for _ in range(5):
            await self.commit()
            if not self._filter_committable_offsets(list(self._acked)):
                return
        raise RuntimeError(f"acked offsets still uncommitted after five commits: "
                           f"{self._filter_committable_offsets(list(self._acked))}")

    async def _commit_offsets(self, offsets, start_new_transaction: bool = True) -> bool:
        did_commit = await super()._commit_offsets(offsets, start_new_transaction)
        if did_commit:
            assignment = self.assignment()
            self._own_commits.update({tp: offset for tp, offset in offsets.items() if tp in assignment})
        return did_commit

    def committed_offset(self, tp) -> int | None:
        """The partition's committed offset as this consumer last set or learned it (the next offset to
        read; None: not known, or 0), without a call to its thread: a commit has taken every record before
        it, so a partition whose committed offset is at its end has nothing left to read."""
        return self._committed_offset.get(tp)

    def _new_consumer_thread(self) -> "ListedHighwatersThread":
        return ListedHighwatersThread(self, loop=self.loop, beacon=self.beacon)

    # -- seeks: each starts a new epoch of its partition ---------------------------------------------

    def resume_partitions(self, tps) -> None:
        """Changelog partitions at once; stream partitions once the seek that follows is done.

        After a rebalance Faust resumes the stream partitions and only then seeks them to their committed
        offsets (``Recovery._resume_streams``), with its fetcher already running for the tables' restore.
        In between, messages were handed on and some processed: those processed stayed done, the others
        were stale after the seek, and where nothing had been committed yet aiokafka's seek does not move
        the position, so they were never read again (the migration test's first worker lost the
        completions that came in during its seek, about one run in seven)."""
        tps = set(tps)
        streams = {tp for tp in tps if not self._is_changelog_tp(tp)}
        self._resume_after_seek |= streams
        super().resume_partitions(tps - streams)

    def pause_partitions(self, tps) -> None:
        tps = set(tps)
        self._resume_after_seek -= tps
        super().pause_partitions(tps)

    async def perform_seek(self) -> None:
        try:
            await super().perform_seek()
            # The broker may answer a committed offset from before this process's own last commit: see
            # ``behind_own_commits``. Read on from what was committed.
            stream_partitions = [tp for tp in self.assignment() if not self._is_changelog_tp(tp)]
            behind = behind_own_commits(self._own_commits, {tp: self.committed_offset(tp) for tp in stream_partitions})
            for tp, offset in behind.items():
                log.info("%s: the broker answered committed offset %s, this worker committed %d: seeking there",
                         tp, self.committed_offset(tp), offset)
                await self.seek(tp, offset)
                self._committed_offset[tp] = offset
            # aiokafka seeks only partitions with an offset committed above 0 and leaves the others where its
            # fetches got to; what it handed over and Faust then skipped (a partition paused as a rebalance
            # began while its fetch was out) would never come again. Nothing committed means nothing
            # was done (under exactly-once nothing of its output committed either): read from the start.
            for tp in self.assignment():
                if not self._is_changelog_tp(tp) and not self.committed_offset(tp):
                    await self._thread.seek_to_beginning(TopicPartition(tp.topic, tp.partition))
                self.seek_epoch[tp] += 1
                self._seek_target[tp] = dict.get(self._read_offset, tp)
            # Forget messages handed on two seeks ago or earlier: one left over from just before this seek
            # may still come out of a queue and must be known as stale; older ones were cleared with the queues.
            self._handed = {k: (tp, e) for k, (tp, e) in self._handed.items() if e >= self.seek_epoch[tp] - 1}
        finally:  # a seek that failed must not leave the streams paused for good
            resumed, self._resume_after_seek = self._resume_after_seek, set()
            super().resume_partitions(resumed & set(self.assignment()))

    async def seek(self, tp, offset: int) -> None:
        await super().seek(tp, offset)
        self.seek_epoch[tp] += 1
        self._seek_target[tp] = offset if offset else None
        dict.__setitem__(self._read_offset, tp, offset if offset else None)  # whatever the fetch loop holds

    # -- fetching: drop what was fetched before its partition's latest seek --------------------------

    async def _getmany(self, active_partitions, timeout: float):
        """Faust hands the consumer thread its live set of active partitions. Paused empty meanwhile (after
        the tables' restore, before the streams resume), aiokafka read "no partitions" as "every partition"
        and returned the stream partitions' prefetched records, which Faust then skipped as not active:
        their positions had moved past them for good (the migration test's first worker, from its first
        tick on). A copy asks for exactly the partitions active when the fetch began."""
        return await super()._getmany(frozenset(active_partitions) if active_partitions is not None else None,
                                      timeout)

    async def _wait_next_records(self, timeout: float):
        if not self.flow_active:  # paused for a rebalance, which ends with a seek: wait for that first
            await self.wait(self.can_resume_flow)
        epochs = dict(self.seek_epoch)  # before the fetch: a seek during it makes its records suspect
        result = await super()._wait_next_records(timeout)
        self._batch_epochs = epochs
        return result

    async def getmany(self, timeout: float):
        epochs, dropped = None, {}
        async for tp, message in super().getmany(timeout):
            epochs = epochs if epochs is not None else self._batch_epochs
            if self._is_changelog_tp(tp):  # table recovery reads these; it does its own seeking
                yield tp, message
                continue
            epoch = epochs.get(tp, 0)
            if epoch != self.seek_epoch[tp]:
                dropped.setdefault(tp, message.offset)
                continue
            self._handed[id(message)] = (tp, epoch)
            self._last_handed[tp] = (message.offset, epoch)
            yield tp, message
        for tp, first in dropped.items():
            if tp not in self.assignment():  # revoked meanwhile: its next owner reads from the commit
                continue
            target = self._seek_target.get(tp)
            log.info("dropped %s from offset %d, fetched before its latest seek; reading again from %s",
                     tp, first, target if target is not None else "the beginning")
            if target is None:  # nothing committed yet: from the start, as auto_offset_reset says
                # Faust's consumer has no seek_to_beginning of its own: its consumer thread (aiokafka's
                # consumer underneath) has, and takes aiokafka's partition type.
                await self._thread.seek_to_beginning(TopicPartition(tp.topic, tp.partition))
                self.seek_epoch[tp] += 1
                dict.__setitem__(self._read_offset, tp, None)
            else:
                await self.seek(tp, min(first, target))

    # -- commits: never past a message still being processed ------------------------------------------

    def _new_offset(self, tp):
        """Faust's offset to commit, but never past a message of ``tp`` that is still in flight.

        Faust lets a head gap of one offset pass (for compacted topics), so with an agent of
        concurrency > 1 (the scoring stage) it could commit past the one message still being scored
        while later ones were done; a crash then would lose that message (faust-streaming issue
        606). Acks above the lowest in-flight offset are held back from this round."""
        in_flight = [m.offset for m in self._unacked_messages if m.tp == tp]
        if not in_flight:
            return super()._new_offset(tp)
        lowest, acked = min(in_flight), self._acked[tp]
        later = [o for o in acked if o > lowest]
        if not later:
            return super()._new_offset(tp)
        acked[:] = [o for o in acked if o < lowest]
        try:
            return super()._new_offset(tp) if acked else None
        finally:
            acked.extend(later)

    async def _add_gap(self, tp, offset_from: int, offset_to: int) -> None:
        """Faust's gap bookkeeping (offsets a read skipped: transaction markers, compacted records), with
        the same intervals kept, in O(log n) a gap instead of a rebuild of the whole tree.

        Faust adds the gap and then calls ``merge_overlaps()``, which sorts and rebuilds every interval of
        the partition since its last commit: under exactly-once every upstream transaction leaves a
        marker, so that was a tenth of the worker's CPU (py-spy, `tabloop bench pipeline`). The tree's
        intervals never overlap one another (each add merges), so the only merge a new gap can cause is
        with the intervals it overlaps: those are replaced by their union, which is what the full merge
        leaves (touching intervals stay apart there too: ``merge_overlaps`` is strict)."""
        committed = self._committed_offset[tp]
        if committed is not None:
            offset_from = max(offset_from, committed + 1)
        if offset_from > offset_to:
            return
        gap_for_tp = self._gap[tp]
        begin, end = offset_from, offset_to + 1  # intervaltree intervals exclude the end
        for overlapping in gap_for_tp.overlap(begin, end):
            begin, end = min(begin, overlapping.begin), max(end, overlapping.end)
            gap_for_tp.remove(overlapping)
        gap_for_tp.addi(begin, end)
        await asyncio.sleep(0)  # as Faust does: other coroutines (health checks) get the loop meanwhile

    def stale_write(self, tp, offset) -> bool:
        """Whether writing ``offset`` as ``tp``'s read offset comes from a message fetched before its
        partition's latest seek (the fetch loop writes the offset of each message it handed on)."""
        last = self._last_handed.get(tp)
        if last is None or last[0] != offset:
            return False
        del self._last_handed[tp]
        if last[1] == self.seek_epoch[tp]:
            return False
        log.info("kept %s's read offset at %s: offset %d was fetched before its latest seek",
                 tp, dict.get(self._read_offset, tp), offset)
        return True

    def stale(self, message) -> bool:
        """A message handed on before its partition's latest seek: the re-read delivers it again."""
        handed = self._handed.get(id(message))
        return handed is not None and handed[0] == message.tp and handed[1] != self.seek_epoch[message.tp]

    def ack(self, message) -> bool:
        if self.stale(message):  # not processed: its offset must not count towards a commit
            self._handed.pop(id(message), None)
            message.acked = True
            self._unacked_messages.discard(message)
            return False
        self._handed.pop(id(message), None)
        return super().ack(message)


CHANGELOG_TAIL_RECORDS = 256
"""How far back from a changelog partition's end ``last_committed_offsets`` reads for its last committed record:
more than one commit interval's table writes to one partition (a key is written once per commit)."""
CHANGELOG_TAIL_TIMEOUT_S = 5.0
"""How long that read may take before recovery falls back to Faust's own wait (below)."""


async def last_committed_offsets(bootstrap: str, ends: dict, *, tail: int = CHANGELOG_TAIL_RECORDS,
                                 timeout_s: float = CHANGELOG_TAIL_TIMEOUT_S) -> dict:
    """The offset of the last record a read_committed reader gets below each partition's end (``ends``: tp ->
    its end, the last stable offset), read from at most ``tail`` records before it. A partition whose tail
    holds no committed record (aborted transactions only), or that is not read to its end in ``timeout_s``,
    is left out."""
    ends = {TopicPartition(tp.topic, tp.partition): end for tp, end in ends.items() if end > 0}
    if not ends:
        return {}
    consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                                         enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        consumer.assign(list(ends))
        for tp, end in ends.items():
            consumer.seek(tp, max(0, end - tail))
        last: dict = {}
        reading = set(ends)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while reading and asyncio.get_running_loop().time() < deadline:
            for tp, records in (await consumer.getmany(*reading, timeout_ms=100)).items():
                below_end = [r.offset for r in records if r.offset < ends[tp]]  # in offset order
                if below_end:
                    last[tp] = below_end[-1]
            for tp in list(reading):
                if await consumer.position(tp) >= ends[tp]:  # read past the end's markers
                    reading.discard(tp)
        return {tp: offset for tp, offset in last.items() if tp not in reading}
    finally:
        await consumer.stop()


class MarkerAwareRecovery(Recovery):
    """Faust's table recovery, told where each active changelog partition's committed records end.

    Faust reads a changelog up to its end minus one, the offset it takes for the last record. Under
    exactly_once the last offset is a transaction's commit marker, which no reader is ever handed, so
    recovery waited for a record that never comes, until two 5 s timeouts of its read loop had passed
    ("Aborted tx until highwater"): 10-15 s without processing after every rebalance and restart (the
    fuzzer's takeovers, issue 44). The end Faust reads to is lowered to the last committed record, found
    by reading the partition's tail; where that read finds none, Faust's own wait stays."""

    async def _build_highwaters(self, consumer, tps, destination, title: str) -> None:
        await super()._build_highwaters(consumer, tps, destination, title)
        if title != "active" or not self.app.in_transaction:
            return
        ends = {tp: destination[tp] + 1 for tp in tps if destination.get(tp) is not None}
        bootstrap = ",".join(f"{url.host}:{url.port or 9092}" for url in self.app.conf.broker)
        try:
            found = await last_committed_offsets(bootstrap, ends)
        except Exception as exc:  # noqa: BLE001 - Faust's own wait is the fallback
            log.warning("could not read the changelogs' last committed records (%r): recovery waits as Faust "
                        "does", exc)
            return
        lowered = {}
        for tp in tps:
            offset = found.get(TopicPartition(tp.topic, tp.partition))
            if offset is not None and offset < destination[tp]:
                destination[tp] = lowered[tp] = offset
        if lowered:
            log.info("changelog partitions whose last committed record comes before their end (a transaction "
                     "marker): recovery reads up to %s",
                     {f"{tp.topic}[{tp.partition}]": offset for tp, offset in lowered.items()})


class MarkerAwareTables(TableManager):
    """Faust's table manager with ``MarkerAwareRecovery`` (its ``recovery`` property builds Faust's own)."""

    @property
    def recovery(self) -> Recovery:
        if self._recovery is None:
            self._recovery = MarkerAwareRecovery(self.app, self, beacon=self.beacon, loop=self.loop)
        return self._recovery


class StreamsApp(faust.App):
    def _new_transport(self):
        transport = super()._new_transport()
        transport.TransactionManager = SourceBoundTransactions
        transport.Consumer = SeekSafeConsumer
        transport.Producer = BoundedTransactionsProducer
        return transport
