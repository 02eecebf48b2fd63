"""The heartbeat thread: renews every lease the master holds, in one call.

It is the only thread besides the main loop, and it is stopped and joined
before every batch of forks (see docs/design.md, process-model rules). It owns its
own broker connection, opened when it starts. Each beat is one ``renew``
(leases, plus the progress the children reported since the last beat: the
latest value per job), one ``paused()`` and one ``write_supervisor`` (the
record the main loop last handed over), and every ``SAMPLE_SECONDS`` or so the
queue gauges' ``stats`` sample. What it learns (lost leases, cancel
requests, a change in the paused queues) goes to the main loop through deques
and a byte on a wake-up pipe; the thread itself never touches children, and
the main loop never waits on these writes.
"""
import collections
import logging
import os
import threading
import time

from .backends import open_broker
from .errors import BrokerError
from .metrics import SAMPLE_SECONDS
from .model import Renewal

log = logging.getLogger("tangguh.heartbeat")

# The queue sample counts every job of each state (dead letters stay until purged): 3 million
# finished jobs took 1.5 s, which the main loop spent deaf when it took the sample itself. Here
# it costs no main-loop time, and a slow one comes less often: at most this share of the time.
SAMPLE_SHARE = 0.05
INTERRUPT_AFTER = 1.0  # seconds stop() lets the sample under way run before it interrupts it
# A lock extension's connect and its answer each wait a quarter of the beat (at least this): the
# next beat's renewal is not held up by a stalled lock Redis by more than twice this.
LOCK_TIMEOUT_FLOOR = 0.1


class Heartbeat:
    def __init__(self, url, lease_seconds, interval, wake_fd, queues=None, on_sample=None):
        self.url = url
        self.queues = queues  # the served queues (replaced on reload): the only ones whose pause matters here
        self.lease_seconds = lease_seconds
        self.interval = interval
        self.wake_fd = wake_fd
        self.held = {}  # job_id -> Lease
        self.lost = collections.deque()
        self.cancels = collections.deque()  # (lease, request): a held job's cancel request, every beat it stands
        self.progress = {}  # job_id -> (fraction, note), the latest since the last beat
        self.paused = {}  # {queue: {"by", "at"}} as of the last beat
        self.record = None  # this supervisor's record (a dict), refreshed by the main loop
        self.lock = threading.Lock()
        self.thread = None
        self.stopping = threading.Event()
        self.broker = None
        self.locks = None  # locks.MasterLocks: children's Redis locks, extended with the leases
        self.extensions = 0  # leases renewed
        self.errors = 0
        self.lag = 0.0  # how late the last beat ran, seconds
        self.due = None  # monotonic: when the next beat is due (kept across a stop and start)
        self.last_beat = time.monotonic()
        self.on_sample = on_sample  # on_sample({queue: QueueStats}): the queue gauges
        self.queue_stats = {}  # the last stats() sample, for status
        # When it was taken (monotonic), and whether the tries since have failed: a count the broker
        # gives up on leaves the last one standing, which status must not show as today's.
        self.sampled_at, self.sample_failing = None, False
        self.sampled = None  # the queues it was last tried for: a reload that changes them samples at once
        self.next_sample_at = 0.0
        self.sampling = False  # in the broker's count now: stop() interrupts it (a fork waits for stop)
        # Samples failed in a row: the first is logged, not each one of an outage (every 5 s while no
        # job is held, as the beat only skips the sample when a renewal failed).
        self.sample_failures = 0

    def hold(self, lease):
        with self.lock:
            old = self.held.get(lease.job_id)
            if old is not None and old != lease:
                # Our own claim took the job again once our lease on it had expired: the
                # old attempt is lost like any other (its child killed), though no beat
                # will say so now that the job id names the new lease.
                self.lost.append(old)
            self.held[lease.job_id] = lease

    def drop(self, lease):
        """Stop renewing ``lease``; a newer lease on the same job stays held."""
        with self.lock:
            if self.held.get(lease.job_id) == lease:
                del self.held[lease.job_id]

    def holding(self):
        with self.lock:
            return list(self.held.values())

    def job_ids(self):
        """The ids of the jobs held, and of those a beat found lost that the main loop has not acted on."""
        with self.lock:
            return {*self.held, *(lease.job_id for lease in self.lost)}

    def report_progress(self, job_id, fraction, note):
        """A child's progress: kept until the next beat carries it (a later report replaces it)."""
        with self.lock:
            if job_id in self.held:
                self.progress[job_id] = (fraction, note)

    def set_record(self, record):
        with self.lock:
            self.record = record

    def record_ttl(self):
        """How long a record stands without a beat: three missed beats, or the lease."""
        return max(3 * self.interval, self.lease_seconds)

    def start(self):
        if self.thread is not None:
            return
        self.stopping.clear()
        self.thread = threading.Thread(target=self._run, name="tangguh-heartbeat", daemon=True)
        self.thread.start()

    def stop(self):
        """Stop and join; the master may fork once this returns."""
        if self.thread is None:
            return
        self.stopping.set()
        if self.locks is not None:
            self.locks.queued.set()  # the thread may wait on it
        # A count of millions of jobs must not hold up the fork: interrupted past a second (a short
        # one finishes; interrupting every one, frequent forks left the gauges never sampled).
        self.thread.join(INTERRUPT_AFTER)
        if self.thread.is_alive() and self.sampling and self.broker is not None:
            self.broker.interrupt()
        self.thread.join()
        self.thread = None

    def close(self):
        """Stop, and forget this supervisor's record (a clean stop: it is not 'gone', it is done)."""
        self.stop()
        if self.locks is not None:
            self.locks.release_queued(self.lock_timeout())  # bounded: what fails lapses with its TTL
        # No connection: the last call failed (it is reset then), and connecting again to a broker
        # that is down (or frozen: connect_timeout) would only hold up the exit.
        if self.record is not None and self.broker is not None:
            try:
                self.broker.remove_supervisor(self.record["id"])
            except Exception as exc:  # noqa: BLE001 - the record then shows as gone after its ttl
                log.warning("supervisor record not removed: %s: %s", type(exc).__name__, exc)
        if self.broker is not None:
            self.broker.close()
            self.broker = None

    def _run(self):
        # The master stops this thread around every fork. A restart keeps the schedule (a beat
        # overdue is made at once): waiting a whole interval after each restart renewed no
        # lease at all while children were forked more often than that.
        if self.due is None:
            self.due = time.monotonic() + self.interval
        self.sample()  # the first at start (status and the gauges), not a beat later; then when due
        while True:
            # Woken early too by a dead child's locks to free: released here, not in the main loop.
            (self.stopping if self.locks is None else self.locks.queued).wait(max(0.0, self.due - time.monotonic()))
            if self.stopping.is_set():
                break
            if time.monotonic() < self.due:
                self.locks.release_queued(self.lock_timeout())
                continue
            self.lag = max(0.0, time.monotonic() - self.due)
            self.due = time.monotonic() + self.interval
            self.beat()

    def beat(self):
        renewed = self._renew()
        # The locks after the leases, in a bounded share of the beat: their Redis stalled (its
        # timeouts took seconds) held up the renewal, and a lease lapsed under a running job.
        if self.locks is not None:
            self.locks.release_queued(self.lock_timeout())  # those whose release failed: again each beat
            self.locks.extend_all(timeout=max(LOCK_TIMEOUT_FLOOR, self.interval / 4))
        if renewed:
            self.sample()

    def lock_timeout(self):
        return max(LOCK_TIMEOUT_FLOOR, self.interval / 4)

    def _renew(self):
        """The broker's part of a beat: False when the broker failed."""
        leases = self.holding()
        self.last_beat = time.monotonic()
        with self.lock:
            progress, self.progress = self.progress, {}
            record = self.record
        queues = self.queues
        renewal = self._call(lambda br: br.renew(leases, self.lease_seconds, progress, queues)) if leases else Renewal()
        if renewal is None:
            return False
        # Every beat, leases or not: every supervisor sharing the broker learns of a pause
        # within one heartbeat, and its record says it is alive.
        paused = self._call(lambda br: br.paused(queues))
        if record is not None and paused is not None:  # None: the broker failed, the record waits a beat
            record = dict(record, paused_queues=sorted(paused))
            self._call(lambda br: br.write_supervisor(record, self.record_ttl()))
        self.extensions += len(leases) - len(renewal.lost)
        wake = False
        with self.lock:
            for lease in renewal.lost:
                if self.held.get(lease.job_id) == lease:
                    del self.held[lease.job_id]
                    self.lost.append(lease)
                    wake = True
            for job_id, request in renewal.cancel.items():
                lease = self.held.get(job_id)
                if lease is not None:
                    self.cancels.append((lease, request))
                    wake = True
            if paused is not None and paused != self.paused:
                self.paused = paused
                wake = True
        if wake:
            try:
                os.write(self.wake_fd, b"!")
            except BlockingIOError:
                pass  # the pipe is full: the main loop is awake anyway
        return True

    def sample(self, clock=time.monotonic):
        """The queue sample, when due; the time it took sets the next one's (SAMPLE_SHARE).

        Its counts may take half of what a lease has left past a beat, then the broker gives
        up on them: the next beat's renewals come in time whatever the broker holds."""
        queues = self.queues
        started = clock()
        if self.on_sample is None or (started < self.next_sample_at and queues == self.sampled):
            return
        self.sampled, self.sampling = queues, True
        try:
            if self.stopping.is_set():
                self.sampling = False  # not a sample taken
                return  # stop() may have looked before ``sampling`` was set: it would not interrupt
            if self.broker is None:
                self.broker = open_broker(self.url)
            stats = self.broker.stats(queues, within=max(0.1, (self.lease_seconds - self.interval) / 2))
        except Exception as exc:  # noqa: BLE001 - cut off, interrupted, or the broker failed: never the thread's end
            if self.stopping.is_set():
                self.sampling = False
                return  # interrupted for a fork: not a sample taken, due again once restarted
            self.sample_failures += 1
            log.log(logging.WARNING if self.sample_failures == 1 else logging.DEBUG,
                    "queue sample not taken: %s", exc, extra={"event": "sample_failed"})
            stats = None
            self.sample_failing = True
        finally:
            if self.sampling:
                self.sampling = False
                self.next_sample_at = started + max(SAMPLE_SECONDS, (clock() - started) / SAMPLE_SHARE)
        if stats is not None:
            if self.sample_failures:
                log.info("queue sample taken again after %d failed", self.sample_failures,
                         extra={"event": "sample_resumed"})
                self.sample_failures = 0
            self.queue_stats, self.sampled_at, self.sample_failing = stats, time.monotonic(), False
            self.on_sample(stats)

    def _call(self, fn):
        """``fn(broker)`` on the thread's own connection; None (counted, connection reset) on a failure."""
        if self.stopping.is_set():
            return None  # stop() waits for the call under way only (each is bounded: a frozen broker's too)
        try:
            if self.broker is None:
                self.broker = open_broker(self.url)
            return fn(self.broker)
        except BrokerError as exc:
            self.errors += 1
            log.debug("heartbeat broker call failed: %s", exc)
        except Exception as exc:  # noqa: BLE001 - a driver error must not kill the thread
            self.errors += 1
            log.warning("heartbeat broker call failed: %s: %s", type(exc).__name__, exc)
        self._reset_broker()
        return None

    def _reset_broker(self):
        if self.broker is not None:
            try:
                self.broker.close()
            except Exception:  # noqa: BLE001
                pass
            self.broker = None
