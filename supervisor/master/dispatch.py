"""Claiming work and handing it to free children: prefetch, capacity, claim pacing.

A claim asks for as many jobs as there are free children plus the prefetch
room. Claimed jobs wait in ``prefetched`` with the rules they were claimed
under (``registry.JobSettings``), so a reload between the claim and the
verdict cannot change a running job's rules. While the queue is empty the
claims back off up to ``poll_interval``; a broker wake-up (a notification, an
inotify event) brings the next claim forward at once. Paused queues (as the
heartbeat last read them) come last in the claim: the broker leases nothing
from them (a pause not yet seen here included), but tidies them as the others.

A job with an expiry that waits here past it is handed back untouched, not run:
the next claim ends it ``expired``, as it would have had it waited in the broker
("a job not started by then ends expired"); one queued in a child behind the jobs of its
batch is skipped there and comes back the same way. Its deadline is reckoned on this
machine's monotonic clock from the broker's clock at the claim (its lease's end
less the lease), so the two machines' clocks need not agree.
"""
import collections
import logging
import time

from .. import logs, registry
from ..backends.base import Sendings
from ..errors import BrokerError
from ..retry import backoff

log = logging.getLogger("tangguh.arbiter")


def past_attempts(job, settings):
    """The claim took back the expired lease of this job's last attempt its type allows.

    The broker's claim dead-letters such a job only at the ``max_attempts`` stored with it
    (``tangguh enqueue`` and ``Client.enqueue`` know no decorator): one whose handler took its
    master down ran again on the next supervisor, up to that count, past its type's.
    """
    if len(job.history) < 2 or job.attempt <= settings.max_attempts:  # a first attempt: most jobs
        return False
    before = job.history[-2]  # the entry the claim closed; a hand-edited one may be anything
    return isinstance(before, dict) and before.get("outcome") == "lease_expired"


class Dispatcher:
    """Callbacks: ``hold(lease)`` the heartbeat starts renewing it; ``on_claimed(job)``
    logs a claim; ``on_started(job)`` counts an attempt that starts (a job sent to a child, or
    one no handler takes; not one handed back unstarted, which the broker does not count);
    ``on_unknown(job, settings)`` a job no handler takes, or one ``past_attempts`` (not run);
    ``settings_for(job)`` the rules to claim it under; ``on_expired(job_type)`` a
    job the claim ended ``expired`` (never run); ``give_back(job)`` releases a claimed
    job untouched (no attempt counted). ``prefetch`` is the ``Prefetch`` policy."""

    def __init__(self, cfg, handlers, owner, link, pool, prefetch, hold, settings_for, on_claimed, on_unknown,
                 on_expired, give_back, on_started):
        self.prefetch = prefetch
        self.configure(cfg, handlers)
        self.owner = owner  # "host:pid:suffix", stored with every lease this supervisor takes
        self.link, self.pool = link, pool
        self.hold, self.settings_for = hold, settings_for
        self.on_claimed, self.on_unknown, self.on_expired = on_claimed, on_unknown, on_expired
        self.give_back, self.on_started = give_back, on_started
        self.paused = set()  # queues not to claim from (job control: paused in the broker)
        self.prefetched = collections.deque()  # (job, settings), oldest first
        # job id -> monotonic time its expiry passes, for the prefetched jobs that have one (an entry
        # leaves with its job); the soonest of them, so that a loop turn looks at none before then.
        self.start_by, self.next_late = {}, float("inf")
        # After handing jobs back, claim no more than the idle children can take until a claim
        # brings a job its type lets wait here (short work at the head of the queue). Reopened at
        # each child's end instead, a backlog of long jobs was claimed whole and handed back at
        # every completion: 781 claims for 40 jobs, each job's fencing token up by 18.
        self.room_closed = False
        self.recheck = False  # new jobs waiting, or what a type may keep went down: look for surplus
        self.next_claim_at = 0.0
        self.empty_claims = 0  # empty claims in a row: the idle backoff
        self.empty_polls = 0  # empty claims since start, for status
        self.on_unanswered = lambda queues: None  # a claim failed after reaching for the broker (orphans.py)

    def configure(self, cfg, handlers):
        """The config, handlers and claim limits of the current generation."""
        self.cfg, self.handlers = cfg, handlers
        self.limits = registry.type_limits(cfg, handlers) or None  # enforced by the broker at claim
        self.prefetch.configure(cfg.broker.prefetch, cfg.supervisor.workers, handlers)

    def ran(self, job_type, seconds):
        """A child finished a job of ``job_type`` in ``seconds``: learn its run time; a child is free."""
        if self.recheck or not self.prefetched or not self.prefetch.auto or not self.prefetch.slower(job_type, seconds):
            # No waiting job for a lower keep to hand back, a look due anyway, or a run no longer
            # than the type's average (which then cannot rise, nor ``keep`` fall).
            self.prefetch.ran(job_type, seconds)
        else:
            before = self.prefetch.keep(job_type)
            self.prefetch.ran(job_type, seconds)
            self.recheck = self.prefetch.keep(job_type) < before

    def capacity(self):
        self.prefetch.workers = self.pool.target  # TTIN/TTOU change it between reloads
        prefetch = 0 if self.room_closed else self.prefetch.room()
        if self.prefetched and len(self.prefetched) * 2 > prefetch:
            return 0  # refill the prefetch buffer once it is half empty: fewer, larger claims
        return len(self.pool.free()) + prefetch - len(self.prefetched)

    def due_at(self):
        return self.next_claim_at if self.capacity() > 0 else None

    def wake(self, queues=None):
        """New work may be due: claim on the next loop turn. ``queues``: the ones the broker's
        notifications named (None or empty: it cannot tell)."""
        if queues and not set(queues) & set(self.cfg.broker.queues):
            # PostgreSQL notifies every supervisor of the schema of each enqueue, whatever its
            # queue: each woke and claimed (an empty claim) per job enqueued to queues it never serves.
            return
        self.next_claim_at = time.monotonic()
        self.empty_claims = 0

    def hold_claims_until(self, instant):
        self.next_claim_at = instant

    def claim(self):
        """Claim what the free children and the prefetch room can take."""
        now = time.monotonic()
        want = self.capacity()
        if want <= 0 or now < self.next_claim_at:
            return
        b = self.cfg.broker
        # Paused ones too, last: the broker leases none of their jobs, but takes back their expired
        # leases and ends their jobs past expiry (Redis looks only at the queues a claim names: left
        # out, a dead supervisor's job stayed running there for the whole pause, its waiters untold).
        queues = [q for q in b.queues if q not in self.paused] + [q for q in b.queues if q in self.paused]
        try:
            # take_expired reads what this claim ended ``expired``: no round trip of its own.
            sent = Sendings(lambda br: (br.claim(queues, want, b.lease_seconds, self.owner, self.limits) if queues
                                        else [], br.take_expired()))
            jobs, expired = self.link.call(sent, "claim")
        except BrokerError:
            # Only a claim that reached for the broker may have leased jobs: not one the link deferred
            # or could not open a connection for (a server refusing connections all through an outage).
            if sent.reached and queues:
                self.on_unanswered(queues)
            if self.link.down:
                # Not before the link's next try: a claim woken meanwhile (a late job handed back)
                # and deferred left its instant in the past, and the loop's select() returned at once.
                self.next_claim_at = max(self.next_claim_at, self.link.retry_at)
            return
        if sent.twice:  # its first sending may have leased jobs too, which we never saw
            self.on_unanswered(queues)
        for _job_id, job_type in expired:
            self.on_expired(job_type)
        for job in jobs:
            self.hold(job.lease)
            self.on_claimed(job)
            settings = self.settings_for(job)
            if job.type not in self.handlers or past_attempts(job, settings):
                self.on_started(job)
                self.on_unknown(job, settings)
            else:
                if self.room_closed and self.prefetch.keep(job.type) > 0:
                    self.room_closed = False
                if job.expires_at is not None:
                    at = self.start_by[job.id] = now + job.expires_at - (job.lease_until - b.lease_seconds)
                    self.next_late = min(self.next_late, at)
                self.prefetched.append((job, settings))
                self.recheck = True
        if jobs:
            self.empty_claims = 0
            self.next_claim_at = now
        else:
            # Back off while the queue is empty; the jitter keeps many supervisors
            # from polling a shared broker in lockstep.
            self.empty_claims += 1
            self.empty_polls += 1
            self.next_claim_at = now + backoff(self.empty_claims + 1, 0.005, self.cfg.supervisor.poll_interval,
                                               jitter=0.25)

    def dispatch(self):
        """Hand prefetched jobs to free children, oldest first; give back what may not wait here.

        Consecutive jobs of short types go to a child as one batch. A child takes
        at most its share of the prefetched jobs, an equal part for each child
        that is free or about to be (busy, few jobs queued): the rest wait here
        for whichever child is free first, so one job that turns out long cannot
        hold every waiting job behind it while a sibling child idles. A child
        whose last job ran long gets one job at a time.
        """
        if self.start_by and time.monotonic() >= self.next_late:
            self.give_back_late()
        free = self.pool.free()
        soon = sum(1 for c in self.pool.live() if c.job is not None and len(c.queued) < self.prefetch.refill)
        share = -(-len(self.prefetched) // max(1, len(free) + soon))
        for c in free:
            if not self.prefetched:
                break
            size = 1 if c.ran_long else min(self.prefetch.batch, share)
            most = self.cfg.supervisor.max_jobs_per_child
            if most:
                size = min(size, max(1, most - c.jobs_done))  # a child recycled after N jobs runs N
            self.send(c, self.take_batch(size))
        if self.prefetched:
            self.top_up(share)
        if self.prefetched and self.prefetch.auto and self.recheck:
            self.surplus()
        self.recheck = False

    def give_back_late(self):
        """Hand back the prefetched jobs whose expiry passed while they waited here."""
        now = time.monotonic()
        late = {job_id for job_id, at in self.start_by.items() if at <= now}
        for job_id in late:
            del self.start_by[job_id]
        self.next_late = min(self.start_by.values(), default=float("inf"))
        kept = collections.deque()
        for entry in self.prefetched:
            if entry[0].id in late:
                self.give_back(entry[0])
                self.wake()  # the claim that ends it expired
            else:
                kept.append(entry)
        self.prefetched = kept

    def top_up(self, share):
        """The next batch of short jobs to each busy child whose batch is running low.

        Sent before the child runs out, it never waits for the master between
        batches (the master may be inside a broker call just then). Only a child
        running a short job with nothing else going on (no kill, cancel, skip or
        retirement) is topped up, and only with short jobs; a job of a short type
        that has run too long to be batched by now gets nothing queued behind it.
        Only a child that has answered ``refill`` jobs since its last batch is fed
        so: a flood of short jobs, not a few of which one may hold the rest. As
        in ``dispatch``, a child takes at most its ``share``.
        """
        now = time.monotonic()
        refill = self.prefetch.refill
        hungry = [c for c in self.pool.children.values()
                  if c.job is not None and len(c.queued) < refill <= c.jobs_done - c.done_at_send and not c.ran_long
                  and not self.prefetch.long(now - c.started)
                  and c.generation == self.pool.generation and not c.retiring and c.kill_reason is None
                  and c.term_at is None and c.cancel_at is None and not c.skip_sent
                  and self.prefetch.batchable(c.job.type)]
        most = self.cfg.supervisor.max_jobs_per_child
        for c in hungry:
            if not self.prefetched or not self.prefetch.batchable(self.prefetched[0][0].type):
                return
            size = min(self.prefetch.batch - len(c.queued), share)
            if most:
                size = min(size, most - c.jobs_done - 1 - len(c.queued))  # its running job counts too
            if size > 0:
                left = self.send(c, self.take_batch(size))
                if left:  # more than its pipe takes while it is busy: they wait for a free child
                    self.prefetched.extendleft(reversed(left))
                    return

    def send(self, c, batch):
        """``batch`` to child ``c``; returns what its pipe could not take. The prefetch learns the jobs' sizes."""
        # Their start-by instants go with them: one queued behind a job that turns out long must
        # not start past its expiry in the child either (the child skips it; it comes back here).
        due = {job.id: self.start_by[job.id] for job, _ in batch if job.id in self.start_by} if self.start_by else None
        left = self.pool.run(c, batch, due)
        sent = batch[:len(batch) - len(left)]
        for job, _ in sent:
            self.on_started(job)
            if self.start_by:
                self.start_by.pop(job.id, None)
        if sent:
            types = [job.type for job, _ in sent]
            before = self.prefetch.keep(types[0])
            self.prefetch.weigh(types, c.sent_bytes)
            self.recheck = self.recheck or self.prefetch.keep(types[0]) < before  # large jobs: fewer wait
        return left

    def take_batch(self, size):
        """Up to ``size`` prefetched jobs, oldest first: one, and more only while their types are short."""
        batch = [self.prefetched.popleft()]
        while (len(batch) < size and self.prefetched and self.prefetch.batchable(batch[0][0].type)
               and self.prefetch.batchable(self.prefetched[0][0].type)):
            batch.append(self.prefetched.popleft())
        return batch

    def surplus(self):
        """Hand back the waiting jobs beyond what their type may keep (a long type: all of them).

        A sibling supervisor with an idle child claims them at once; here they
        would wait behind the running jobs. A short type keeps a band above its
        prefetch (``Prefetch.keep``): handing back costs a round trip a job.
        """
        # Within every type's room when no more wait than the least any of their types may keep:
        # the usual case after a claim of short jobs, told without a walk in Python per job.
        keep = self.prefetch.keep
        if len(self.prefetched) <= min((keep(t) for t in {job.type for job, _ in self.prefetched}), default=0):
            return
        kept, room = collections.deque(), {}  # job type -> how many more of it may wait here
        for job, settings in self.prefetched:
            left = room.get(job.type)
            if left is None:
                left = self.prefetch.keep(job.type)
            room[job.type] = left - 1
            if left > 0:
                kept.append((job, settings))
            else:
                self.start_by.pop(job.id, None)
                self.give_back(job)
                self.room_closed = True
        self.prefetched = kept

    def take_all(self):
        """Every prefetched job, removed (to be released at a stop)."""
        jobs = [job for job, _ in self.prefetched]
        self.prefetched.clear()
        self.start_by.clear()
        return jobs

    def take(self, lease):
        """Remove and return the prefetched ``(job, settings)`` of ``lease``, or None."""
        for entry in self.prefetched:
            if entry[0].lease == lease:
                self.prefetched.remove(entry)
                self.start_by.pop(lease.job_id, None)
                return entry
        return None

    def take_queues(self, queues):
        """Remove and return the prefetched jobs of ``queues`` (paused: to be released)."""
        taken = [entry for entry in self.prefetched if entry[0].queue in queues]
        for entry in taken:
            self.prefetched.remove(entry)
            self.start_by.pop(entry[0].id, None)
        return [job for job, _ in taken]

    def forget(self, lease):
        """Drop the prefetched job of a lost ``lease``; True if there was one."""
        for entry in list(self.prefetched):
            if entry[0].lease == lease:
                self.prefetched.remove(entry)
                self.start_by.pop(lease.job_id, None)
                log.warning("lease lost on a prefetched job", extra=logs.job_fields(entry[0], event="lease_lost"))
                return True
        return False
