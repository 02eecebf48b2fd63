"""How a child's attempts end: its replies, its death, and the jobs of its batch behind the running one.

A child runs the jobs of a batch in order; the master holds that the running
job is the first one not answered yet. Only that job can be judged by a
child's death (``crashed``, a hard timeout, a lost lease): the jobs queued
behind it never started, so they are handed back at once, no attempt spent.
Jobs withdrawn from a child (a stop, a cancel, a lost lease) come back the same
way. Collaborators come from the wiring (``master``: its pool, status,
dispatcher, outcome writer, locks, stop state and ``judge_child``, which
judges an attempt), never imported. ``master/control.py`` acts on lost leases
and cancels with the same rule: only the running job is signalled or killed.
"""
import logging
import select

from .. import logs, protocol
from ..protocol import KILLED_BAD_FRAME, KILLED_CANCEL, KILLED_LEASE_LOST, KILLED_SHUTDOWN, KILLED_TIMEOUT

log = logging.getLogger("tangguh.arbiter")


class Endings:
    def __init__(self, master):
        self.master = master  # the wiring: its parts are read at each call (a reload replaces none of them)

    def on_reply(self, c, reply):
        m = self.master
        if c.job is None or reply.get("job_id") != c.job.id or reply.get("token") != c.job.token:
            return  # late: an answer for a job withdrawn from this child (a job id comes back, a token never)
        cancel_sent = c.cancel_at is not None  # read before the next job of the batch starts
        job, settings = m.pool.finish(c, ran=not reply.get("skipped"))  # the next job of its batch runs from now
        if reply.get("skipped") or job.id in c.lost:
            self.hand_back(c, job, settings)  # never started, or its lease is someone else's
        else:
            if m.locks is not None:
                m.locks.release_child(c.pid)  # a lock the job left behind ends with the job
            m.status.attempt(job, reply)
            m.dispatcher.ran(job.type, reply.get("duration"))
            c.ran_long = m.dispatcher.prefetch.long(reply.get("duration"))  # no batch behind a long job
            m.judge_child(job, settings, c, reply=reply, cancel_sent=cancel_sent)
        # The next prefetched job now: the child need not wait for the ack. Not while a SKIP is
        # out (``withdraw`` may be reading this very reply, and hands back what is queued after).
        if c.job is None and m.pool.after_reply(c) and m.stopping is None and not c.skip_sent:
            m.dispatcher.dispatch()

    def on_child_exit(self, c, how, fields):
        m = self.master
        if m.locks is not None:
            m.locks.release_child(c.pid)  # now, not at their TTL: the retry may need them
        while c.queued:  # behind the running job: never started
            self.hand_back(c, *c.queued.popleft())
        if c.job is None:
            return
        job, settings = c.job, c.settings
        c.job = c.settings = None
        if job.id in c.lost:
            self.hand_back(c, job, settings)
            return
        if c.kill_reason == KILLED_TIMEOUT:
            log.warning("worker %d killed: job over its hard timeout", c.slot,
                        extra=logs.job_fields(job, event="timeout_exit", **fields))
        elif c.kill_reason not in (KILLED_LEASE_LOST, KILLED_SHUTDOWN, KILLED_BAD_FRAME, KILLED_CANCEL):
            log.error("worker %d died mid-job (%s)", c.slot, how, extra=logs.job_fields(job, event="crash", **fields))
            m.status.count("crashed_mid_job")
        m.judge_child(job, settings, c, how=how, cancel_sent=c.cancel_at is not None)

    def hand_back(self, c, job, settings):
        """A job of ``c``'s batch that did not run there (or whose run does not count): released
        untouched; when its lease was lost, only no longer renewed (it is someone else's); when
        it was cancelled while queued, ended ``cancelled`` as if it had waited in the master."""
        m = self.master
        if job.id in c.lost:
            c.lost.discard(job.id)
            c.cancels.pop(job.id, None)
            m.writer.stop_renewing(job)
        elif job.id in c.cancels:
            job.cancel_request = c.cancels.pop(job.id)
            m.control.cancel_unstarted(job, settings)
        else:
            m.writer.release(job)

    def withdraw(self, c):
        """Take back now every job of ``c``'s batch not started yet (a stop, a cancel, a lost lease).

        A SKIP goes first, and the child looks at its pipe before each next job, so
        once the replies it sent before the SKIP are read, no job still queued
        here can start: they are handed back at once. Their "skipped" answers,
        which come later, name no running job and are ignored.
        """
        if not c.queued:
            return
        if not c.skip_sent:
            c.skip_sent = True
            try:
                protocol.send(c.sock, {"op": protocol.SKIP})
            except OSError:
                return  # gone: the jobs are handed back when it is reaped
        for _ in range(64):  # bounded: a dead child's pipe stays readable (EOF)
            if not c.queued or c.sock.fileno() < 0 or not select.select([c.sock], [], [], 0)[0]:
                break
            self.master.pool.read(c)
        while c.queued:
            self.hand_back(c, *c.queued.popleft())
