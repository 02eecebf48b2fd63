"""Jobs a claim given up on leased to us: found once the broker answers again, and handed back.

A claim the master gave up on (the broker did not answer within its timeout)
may still run: a frozen Redis runs the commands left in its socket when it
thaws, and a PostgreSQL backend finishes a statement whose client has gone.
Its jobs are then leased to this supervisor, which never saw them. The same
when a cut connection lost a claim's answer after the server ran it and the
driver sent it again (redis-py's one retry; the broker's ``calls_resent``):
the master saw the second run's jobs, not the first's. Nothing
renews those leases; left alone they would run only once the lease expired,
an attempt spent (a job on its last attempt dead-lettered without running).

So after such a claim, once the broker answers, the master searches the
queues that claim asked for, for running jobs leased to its owner id whose
job it knows nothing of (not held, not lost a moment ago, not in a child, not
prefetched, no outcome pending), and releases them: fenced by their token,
the attempt given back, as if never claimed. A job it does know under another
token (a lease of ours expired during the outage and the late claim gave it
back to us) is left alone: a child may still be running it, and that lease
expires as before. A call given up on may run later than the first look (a
backend still waiting for a lock), so it looks again every heartbeat interval
for one lease period. Nothing of this runs while no claim went unanswered.
"""
import logging
import time

from .. import logs
from ..errors import BrokerError, LeaseLost
from ..jobfilter import MAX_LIMIT, JobFilter

log = logging.getLogger("tangguh.arbiter")

# A look reads at most this many running jobs a queue (pages of MAX_LIMIT): it holds the main loop.
# Past it (a queue with more running jobs than that across every supervisor) an orphan may be
# missed, and expires as it would have without the look.
MOST_PER_QUEUE = 5 * MAX_LIMIT


class Orphans:
    """``known_ids()`` returns the ids of every job this master knows of (see the module's text)."""

    def __init__(self, link, owner, known_ids, count):
        self.link, self.owner, self.known_ids, self.count = link, owner, known_ids, count
        self.queues = set()  # the queues unanswered claims asked for, since the last look window ended
        self.until = None  # monotonic end of the looks (set by the first look that got an answer)
        self.next_at = 0.0
        self.released = 0  # since start, for status
        self.unanswered = 0  # claims given up on since start, for status: each may have leased orphans

    def claim_unanswered(self, queues):
        """A claim of ``queues`` failed after reaching for the broker: it may have leased jobs all the same."""
        if not queues:
            return  # a claim of no queue (every one paused) leased nothing
        self.queues.update(queues)
        self.until, self.next_at = None, 0.0
        self.unanswered += 1

    def due_at(self):
        if not self.queues:
            return None
        # While the broker is down the link's next try comes first: an instant already past would spin the loop.
        return max(self.next_at, self.link.retry_at) if self.link.down else self.next_at

    def run(self, cfg):
        """Look now if a look is due (``cfg``: the ``[broker]`` section)."""
        now = time.monotonic()
        if not self.queues or now < self.next_at or self.link.deferring(now):
            return
        try:
            found = self.link.call(lambda br: self._find(br, sorted(self.queues)), "search")
        except BrokerError:
            return  # down: the next look is at the link's next try (due_at)
        finally:
            self.next_at = time.monotonic() + cfg.heartbeat_seconds  # from the call's end: it may have waited
        if self.until is None:
            self.until = now + cfg.lease_seconds
        known = self.known_ids()
        for job in found:
            if job.id in known:
                continue
            try:
                self.link.call(lambda br, lease=job.lease: br.release(lease), "release")
            except LeaseLost:
                continue  # taken over meanwhile: someone else's now
            except BrokerError:
                return  # looked for again at the next look
            self.released += 1
            self.count("orphan_released", job=job)
            log.warning("released a job a claim given up on had leased to this supervisor (it never ran here)",
                        extra=logs.job_fields(job, event="orphan_released"))
        if now >= self.until:
            self.queues, self.until = set(), None

    def _find(self, broker, queues):
        jobs = []
        for queue in queues:
            cursor = None
            for _ in range(MOST_PER_QUEUE // MAX_LIMIT):
                page = broker.search(JobFilter(state="running", queue=queue), cursor, limit=MAX_LIMIT)
                jobs.extend(j for j in page.jobs if j.owner == self.owner)
                cursor = page.next_cursor
                if cursor is None:
                    break
        return jobs


def known_job_ids(heartbeat, writer, dispatcher, pool):
    """The ids of every job this master knows of: held or just found lost (the heartbeat's), in a
    child (running or queued behind), prefetched, or with an outcome waiting to be stored."""
    ids = heartbeat.job_ids()
    ids.update(lease.job_id for lease in writer.leases())
    ids.update(job.id for job, _ in dispatcher.prefetched)
    for c in pool.children.values():
        ids.update(job.id for job in (c.job, *(j for j, _ in c.queued)) if job is not None)
    return ids
