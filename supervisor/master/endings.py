"""How a child's attempts end: its replies, its death, and the jobs of its batch behind the running one.

A child runs the jobs of a batch in order; the master holds that the running
job is the first one not answered yet. Only that job can be judged by a
child's death (``crashed``, a hard timeout, a lost lease): the jobs queued
behind it never started, so they are handed back at once, no attempt spent.
A job the child was asked to skip (a stop, a lost lease) comes back the same
way. Collaborators come from the wiring (``master``: its pool, status,
dispatcher, outcome writer, locks, stop state and ``settle``, which judges an
attempt), never imported.
"""
import logging

from .. import logs
from ..protocol import KILLED_BAD_FRAME, KILLED_LEASE_LOST, KILLED_SHUTDOWN, KILLED_TIMEOUT

log = logging.getLogger("tangguh.arbiter")


class Endings:
    def __init__(self, master):
        self.master = master  # the wiring: its parts are read at each call (a reload replaces none of them)

    def on_reply(self, c, reply):
        m = self.master
        if c.job is None or reply.get("job_id") != c.job.id:
            return
        job, settings = m.pool.finish(c)  # the next job of its batch, if any, runs from now
        if reply.get("skipped") or job.id in c.lost:
            self.hand_back(c, job)  # never started, or its lease is someone else's now
        else:
            if m.locks is not None:
                m.locks.release_child(c.pid)  # a lock the job left behind ends with the job
            m.status.attempt(job, reply)
            m.dispatcher.ran(job.type, reply.get("duration"))
            c.ran_long = m.dispatcher.prefetch.long(reply.get("duration"))  # no batch behind a long job
            m.settle(job, settings, c, reply=reply)
        if c.job is None and m.pool.after_reply(c) and m.stopping is None:
            m.dispatcher.dispatch()  # the next prefetched job now: the child need not wait for the ack

    def on_child_exit(self, c, how, fields):
        m = self.master
        if m.locks is not None:
            m.locks.release_child(c.pid)  # now, not at their TTL: the retry may need them
        while c.queued:  # behind the running job: never started
            self.hand_back(c, c.queued.popleft()[0])
        if c.job is None:
            return
        job, settings = c.job, c.settings
        c.job = c.settings = None
        if job.id in c.lost:
            self.hand_back(c, job)
            return
        if c.kill_reason == KILLED_TIMEOUT:
            log.warning("worker %d killed: job over its hard timeout", c.slot,
                        extra=logs.job_fields(job, event="timeout_exit", **fields))
        elif c.kill_reason not in (KILLED_LEASE_LOST, KILLED_SHUTDOWN, KILLED_BAD_FRAME):
            log.error("worker %d died mid-job (%s)", c.slot, how, extra=logs.job_fields(job, event="crash", **fields))
            m.status.count("crashed_mid_job")
        m.settle(job, settings, c, how=how)

    def hand_back(self, c, job):
        """A job of ``c``'s batch that did not run there: released untouched, or, when its
        lease was lost, only no longer renewed (it is someone else's)."""
        if job.id in c.lost:
            c.lost.discard(job.id)
            self.master.writer.stop_renewing(job)
        else:
            self.master.writer.release(job)

    def lease_lost(self, lease):
        """The heartbeat found ``lease`` lost: kill the child running its job, or have it skip it."""
        m = self.master
        c, running = m.pool.holder(lease)
        if c is None:
            return
        if not running:
            c.lost.add(lease.job_id)  # dropped when it comes back, run or skipped
            m.pool.skip(c)
            return
        log.warning("lease lost: killing worker %d", c.slot,
                    extra=logs.job_fields(c.job, event="lease_lost", slot=c.slot, pid=c.pid))
        m.pool.kill(c, KILLED_LEASE_LOST)
