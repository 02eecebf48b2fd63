"""What the heartbeat learns, acted on in the main loop: lost leases, cancels, paused queues.

The heartbeat thread renews the leases and, in the same beat, reads the
paused queues and writes this supervisor's record; it hands what it found to
the main loop (deques, a wake-up byte). Here, in the loop:

* a **lost lease**: the child running the job is killed, a prefetched copy
  forgotten, a pending outcome dropped (someone else holds the job now);
* a **cancel request** of a held job: a running child is told (a CANCEL frame
  and the cancel signal: ``Cancelled`` is raised in the handler at its next
  safe point) and killed if still running ``cancel_grace`` later; a job still
  waiting in the prefetch buffer is ended ``cancelled`` without running;
* a change in the **paused queues**: claims skip them, and jobs of a paused
  queue that no child has started are released at once: prefetched ones, and
  those queued in a child's batch (the batch is withdrawn, every queue's job of it);
* the **record** the heartbeat writes is refreshed once per beat.
"""
import logging
import time

from .. import logs
from ..protocol import KILLED_LEASE_LOST

log = logging.getLogger("tangguh.arbiter")


class JobControl:
    """Collaborators: ``heartbeat``, ``pool``, ``dispatcher``, ``writer``, ``metrics``;
    callbacks ``count(event)``, ``cancel_unstarted(job, settings)`` (judge and store a
    prefetched job as cancelled), ``record()`` (this supervisor's record, a dict) and
    ``withdraw(child)``.

    A child may hold a batch: it runs the first job not answered yet, the others
    wait behind it. Only the running job is ever signalled or killed; a queued
    one is marked on the child (``lost``, ``cancels``) and the rest of the batch
    withdrawn: handed back at once, that one dropped or ended ``cancelled``."""

    def __init__(self, heartbeat, pool, dispatcher, writer, metrics, count, cancel_unstarted, record, withdraw):
        self.heartbeat, self.pool, self.dispatcher, self.writer = heartbeat, pool, dispatcher, writer
        self.metrics, self.count = metrics, count
        self.cancel_unstarted, self.record = cancel_unstarted, record
        self.withdraw = withdraw  # withdraw(child): the jobs of its batch not started yet, handed back now
        self.paused = None  # queues paused in the broker, as of the heartbeat's last beat (None: not set yet)
        self.next_record_at = 0.0

    def run(self, queues, stopping):
        """One loop turn's share: act on what the heartbeat found, refresh the record when due."""
        self.handle_lost_leases()
        self.handle_cancels()
        self.handle_paused(queues)
        if not stopping and time.monotonic() >= self.next_record_at:
            self.next_record_at = time.monotonic() + self.heartbeat.interval
            self.heartbeat.set_record(self.record())

    def handle_lost_leases(self):
        while self.heartbeat.lost:
            lease = self.heartbeat.lost.popleft()
            self.count("lease_lost")
            self.dispatcher.forget(lease)
            self.writer.forget(lease)
            c, running = holder(self.pool, lease)
            if c is not None and not running:
                c.lost.add(lease.job_id)  # dropped, never started
                self.withdraw(c)
            elif c is not None:
                log.warning("lease lost: killing worker %d", c.slot,
                            extra=logs.job_fields(c.job, event="lease_lost", slot=c.slot, pid=c.pid))
                self.pool.kill(c, KILLED_LEASE_LOST)

    def handle_cancels(self):
        """The renewal answers with a held job's request every beat until it ends: act once."""
        while self.heartbeat.cancels:
            lease, request = self.heartbeat.cancels.popleft()
            c, running = holder(self.pool, lease)
            if c is not None and not running:
                c.cancels[lease.job_id] = request
                self.withdraw(c)  # it ends cancelled, never started; the rest of the batch is released
                continue
            if c is not None and c.queued:
                # Once withdrawn, no other job of the batch starts: the signal below can only
                # reach the job it names (or none, if its result crossed the cancel).
                self.withdraw(c)
                c, running = holder(self.pool, lease)
            if c is not None:
                if c.cancel_at is None:
                    c.job.cancel_request = request  # the latency metric starts at the request's time
                    log.info("job cancelled by %s: telling worker %d", (request or {}).get("by"), c.slot,
                             extra=logs.job_fields(c.job, event="cancel", slot=c.slot, pid=c.pid,
                                                   reason=(request or {}).get("reason")))
                    self.pool.cancel(c, request, self.waited(request))
                continue
            entry = self.dispatcher.take(lease)
            if entry is not None:  # claimed, not started: it never runs
                job, settings = entry
                job.cancel_request = request
                self.cancel_unstarted(job, settings)

    def waited(self, request):
        """Seconds since the request was made (the broker's clock), at most one heartbeat: a skewed
        clock must not eat a handler's grace."""
        at = request.get("at") if isinstance(request, dict) else None
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            return 0.0
        return min(max(0.0, time.time() - at), self.heartbeat.interval)

    def handle_paused(self, queues):
        paused = set(self.heartbeat.paused)
        if paused == self.paused:
            return
        first, newly = self.paused is None, paused - (self.paused or set())
        self.paused = paused
        self.dispatcher.paused = paused
        for queue in queues:
            self.metrics.queue_paused.labels(queue).set(1 if queue in paused else 0)
        released = self.dispatcher.take_queues(newly)
        for job in released:
            self.writer.release(job)
        queued = 0
        for c in list(self.pool.children.values()):
            if any(job.queue in newly for job, _ in c.queued):
                queued += len(c.queued)
                self.withdraw(c)  # behind its running job, not started: handed back with the rest of the batch
        if paused or not first:
            log.info("paused queues now: %s (%d prefetched jobs released, %d queued in workers)",
                     ", ".join(sorted(paused)) or "none", len(released), queued, extra={"event": "queues_paused"})


def holder(pool, lease):
    """(the child holding the job of ``lease``, whether it runs it now), or (None, False)."""
    for c in pool.children.values():
        if c.job is not None and c.job.lease == lease:
            return c, True
        if any(job.lease == lease for job, _ in c.queued):
            return c, False  # queued in its batch behind the running job
    return None, False
