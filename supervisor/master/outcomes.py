"""The outcome writer: every verdict reaches the broker through here.

Acks linger a few milliseconds so that the acks of one loop turn share one
``ack_many`` round trip (and, on SQLite, one commit). A write the broker
refuses is retried on its own backoff; a write that meets ``LeaseLost`` is
dropped (someone else holds the job now), unless the job shows that an earlier
sending of the same write landed (``refused``). A job's lease leaves the
heartbeat's care in exactly one place, ``stop_renewing``.

While the broker is down, or after a write failed while it was up (a
refusal, or the start of an outage), the writes wait, untried and still
renewed: the claimer's next try finds out (a try can wait out a driver's
timeout; a write refused while the broker was fine would hold the claims).
A stopping master has no claims: its writes try the broker themselves, each
time the link's backoff allows.
"""
import collections
import dataclasses
import logging
import socket
import time

from .. import logs
from ..backends.base import Sendings
from ..errors import BrokerError, LeaseLost
from ..model import ACK, CANCELLED, DEAD, DONE, DROP, RELEASE, RETRY, error_info
from ..retry import backoff

log = logging.getLogger("tangguh.arbiter")

# An ack waits this long for others to share its round trip (and its commit, on SQLite).
# Delaying an ack is safe: the effect is durable already and the lease is still renewed.
ACK_LINGER = 0.005
STOP_WRITES_SECONDS = 10.0  # how long a stopping master keeps retrying unstored outcomes
HOST = socket.gethostname()  # once: a syscall per job otherwise
STORED_EVENTS = {ACK: "acked", RETRY: "retry_stored", DEAD: "dead_stored", RELEASE: "released",
                 CANCELLED: "cancelled_stored"}
# The history outcome each write closes its attempt with (a release drops the attempt instead).
CLOSED_AS = {ACK: DONE, RETRY: "retry", DEAD: DEAD, CANCELLED: CANCELLED, RELEASE: None}


@dataclasses.dataclass(eq=False)
class Write:
    """One outcome to store, retried with backoff while the broker refuses it."""

    job: object
    op: str  # ACK, RETRY, DEAD, RELEASE or CANCELLED
    result: object = None  # ACK
    info: dict | None = None  # the attempt's host, pid, slot, duration
    reason: str | None = None  # DEAD
    error: dict | None = None  # RETRY, DEAD
    delay: float = 0.0  # RETRY: seconds from the broker's now
    tries: int = 0
    next_at: float = 0.0

    def apply(self, broker):
        lease = self.job.lease
        if self.op == ACK:
            broker.ack(lease, self.result, self.info)
        elif self.op == RETRY:
            broker.retry(lease, broker.now() + self.delay, self.error, self.info)
        elif self.op == DEAD:
            broker.dead(lease, self.reason, self.error, self.info)
        elif self.op == RELEASE:
            broker.release(lease)
        elif self.op == CANCELLED:
            broker.cancelled(lease, self.info)  # the broker adds the request's by and reason


def attempt_info(child=None, reply=None, max_attempts=None):
    """Where and how long an attempt ran, and the attempts its type allows (the stored
    ``max_attempts`` may be a producer's default: ``model.allowed_attempts``), stored with its outcome."""
    info = {"host": HOST}
    if max_attempts is not None:
        info["max_attempts"] = max_attempts
    if child is not None:
        info["pid"], info["slot"] = child.pid, child.slot
    if reply and "duration" in reply:
        info["duration"] = round(reply["duration"], 6)
    return info


class OutcomeWriter:
    def __init__(self, link, unhold, on_stored, on_lost):
        self.link = link  # BrokerLink
        self.unhold = unhold  # unhold(lease): the heartbeat stops renewing that lease
        self.on_stored = on_stored  # on_stored(write): metrics of a stored outcome
        self.on_lost = on_lost  # on_lost(job): the broker refused the write, the lease is someone else's
        # First-try acks, in the order they came (so the first is due first): they go
        # out together in one ack_many. Every other write, and an ack that failed
        # once, waits in ``writes`` and is retried alone.
        self.acks = collections.deque()
        self.writes = collections.deque()
        self.give_up_at = None
        self.stopping = False  # no more claims: the writes probe a broker that is down themselves

    def __len__(self):
        return len(self.acks) + len(self.writes)

    def leases(self):
        """The leases of the outcomes not stored yet (still the broker's running jobs of ours)."""
        return [w.job.lease for queue in (self.acks, self.writes) for w in queue]

    def add(self, job, outcome, info):
        """Queue the store of a verdict (see ``verdict.Outcome``)."""
        if outcome.op == DROP:
            self.stop_renewing(job)
            return
        write = Write(job, outcome.op, info=info)
        if outcome.op == ACK:
            write.result = outcome.result
            write.next_at = time.monotonic() + ACK_LINGER
            self.acks.append(write)
            return
        if outcome.failed:
            write.error = error_info(outcome.reason, outcome.error_class, outcome.message, outcome.traceback)
            write.reason, write.delay = outcome.reason, outcome.delay or 0.0
        self.writes.append(write)

    def release(self, job):
        """Give a claimed job back untouched (a stop, a child killed at shutdown)."""
        self.writes.append(Write(job, RELEASE))

    def forget(self, lease):
        """Drop the pending outcome of a lease the heartbeat found lost.

        The broker would refuse it (LeaseLost) and the loss would be counted a
        second time; the job runs again under its new owner either way.
        """
        for queue in (self.acks, self.writes):
            for write in [w for w in queue if w.job.lease == lease]:
                queue.remove(write)
                log.warning("lease lost before the outcome was stored; the job will run again",
                            extra=logs.job_fields(write.job, event="lease_lost"))

    def due_at(self):
        instants = [w.next_at for w in self.writes]  # few: releases, failures, retried writes
        if self.acks:
            instants.append(self.acks[0].next_at)  # the first ack is due first
        due = min(instants, default=None)
        if due is None or not (self.link.down or self.link.suspect):
            return due
        return max(due, self.link.retry_at) if self.stopping else None  # else the claimer's try comes first

    def waiting_for_broker(self, now):
        """While the broker is down, or a write just failed and no other call has told why yet."""
        return (self.link.down or self.link.suspect) and (not self.stopping or self.link.deferring(now))

    def stop_renewing(self, job):
        self.unhold(job.lease)

    def flush(self, stopping=False):
        now = time.monotonic()
        self.stopping = stopping
        for _ in range(len(self.writes)):
            write = self.writes.popleft()
            if write.next_at > now or self.waiting_for_broker(now):  # a failure below makes the rest wait
                self.writes.append(write)
                continue
            # Stop renewing before the write: a renewal racing a stored outcome would find
            # the job finished and report its lease lost.
            self.stop_renewing(write.job)
            sent = Sendings(write.apply)
            try:
                self.link.call(sent, write.op)
            except LeaseLost:
                # Sent before (a try that failed) or twice (the driver's resend): that may have landed.
                self.refused(write, sent_before=write.tries > 0 or sent.twice)
            except BrokerError as exc:
                self.failed(write, exc, now)
                if self.stopping:
                    break  # its tries are the only probes: one a turn (a silent broker costs each a timeout)
                continue
            else:
                self.stored(write)
        # One due ack takes every first-try ack along (they are only lingering for
        # company). An ack that failed once is retried alone above, so one ack the
        # broker refuses cannot keep failing the others until their leases expire.
        if self.acks and self.acks[0].next_at <= now and not self.waiting_for_broker(now):
            acks = list(self.acks)
            self.acks.clear()
            self.flush_acks(acks, now)

    def flush_acks(self, acks, now):
        """Every due ack in one ``ack_many``: one round trip (one commit on SQLite) per loop turn."""
        for write in acks:
            self.stop_renewing(write.job)  # before the write, as in flush
        sent = Sendings(lambda br: br.ack_many([(w.job.lease, w.result, w.info) for w in acks]))
        try:
            lost = self.link.call(sent, ACK)
        except BrokerError as exc:
            for write in acks:
                self.failed(write, exc, now)
            return
        lost = {(lease.job_id, lease.token) for lease in lost}
        for write in acks:
            if (write.job.id, write.job.token) in lost:
                self.refused(write, sent_before=sent.twice)  # first tries, all of them
            else:
                self.stored(write)

    def failed(self, write, exc, now):
        """Retry an outcome write with backoff, and stop renewing its lease.

        A write the broker keeps refusing while lease renewals still pass would
        leave the job 'running' under a live owner forever (solid_queue #748).
        The outcome has the rest of the lease to land; after that whoever claims
        the job runs it again, and this write meets LeaseLost.
        """
        if write.tries == 0:  # once per outcome, not once per try
            log.warning("%s not stored yet, retrying: %s", write.op, exc,
                        extra=logs.job_fields(write.job, event="write_failed"))
        self.stop_renewing(write.job)
        write.tries += 1
        write.next_at = now + backoff(write.tries + 1, 0.1, 10.0, jitter=0.5)
        self.writes.append(write)

    def refused(self, write, sent_before):
        """The broker refused ``write``: the job is not running under its lease any more.

        Most often someone else holds it now. But when it was ``sent_before``, an earlier
        sending of this very write may have landed, its answer lost: a driver's resend after a
        cut connection (redis-py's one retry), a try that timed out after the server ran it.
        Then the job's history holds this attempt (its number and owner) closed with this
        write's outcome, as the latest entry of it (a retried job may run again by now); after
        a release, that attempt is gone from it. Then it is stored, not lost, and nothing runs
        again. A lease that expired has that attempt closed ``lease_expired``. A write sent
        once is not looked up: after an outage that expired many leases, a read each would
        hold the loop for nothing.
        """
        if sent_before and write.op in CLOSED_AS and self.landed(write):
            log.info("outcome found stored by an earlier sending of the same write (its answer was lost)",
                     extra=logs.job_fields(write.job, event="outcome_confirmed"))
            self.stored(write)
            return
        self.lost(write)

    def landed(self, write):
        try:
            job = self.link.call(lambda br: br.get(write.job.id), "get")
        except BrokerError:
            return False
        if job is None:
            return False
        ours = [e for e in job.history if isinstance(e, dict) and e.get("attempt") == write.job.attempt
                and e.get("owner") == write.job.owner]
        if write.op == RELEASE:
            return not ours
        # Its latest entry, wherever it stands: a retried job may be running again by now.
        return bool(ours) and ours[-1].get("outcome") == CLOSED_AS[write.op]

    def lost(self, write):
        self.on_lost(write.job)
        log.warning("lease lost before the outcome was stored; the job will run again",
                    extra=logs.job_fields(write.job, event="lease_lost"))

    def stored(self, write):
        self.on_stored(write)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("outcome stored: %s", write.op,
                      extra=logs.job_fields(write.job, event=STORED_EVENTS[write.op]))

    def settled(self):
        """At a stop: True once every outcome is stored, or after giving up on the rest.

        Outcomes the broker would not take are abandoned after a while rather
        than hang the stop. Their leases expire and the jobs run again.
        """
        if not self.acks and not self.writes:
            return True
        now = time.monotonic()
        if self.give_up_at is None:
            # From the broker's next try when it is down: every write gets its tries.
            self.give_up_at = max(now, self.link.retry_at if self.link.down else now) + STOP_WRITES_SECONDS
        if now < self.give_up_at:
            return False
        log.error("stopping with %d outcomes not stored; those jobs will run again after their lease",
                  len(self), extra={"event": "writes_abandoned"})
        return True
