"""Hard timeouts and cancel deadlines: when the loop must be awake, and the kills once they pass.

A child's job has a deadline from the instant it starts there (pool.py,
``Pool.start``): past it, SIGTERM, then SIGKILL after ``kill_grace``, once (a SIGKILL stays
pending until the child dies; the reaping notices it). A job
still running ``cancel_grace`` after its cancel was sent is killed at once.
The pool's reaping then judges the job as it would any death.
"""
import logging
import signal
import time

from .. import logs
from ..protocol import KILLED_CANCEL, KILLED_TIMEOUT

log = logging.getLogger("tangguh.arbiter")


def deadlines(pool):
    """The instants at which a hard timeout or a cancel grace needs the loop awake."""
    grace = pool.cfg.kill_grace
    children = pool.children.values()
    return [c.term_at + grace if c.term_at else c.deadline for c in children if c.deadline is not None] \
        + [c.cancel_deadline for c in children if c.cancel_deadline]


def kill_overdue(pool):
    """Hard timeout: SIGTERM, SIGKILL after the grace. Still running ``cancel_grace`` after a cancel: SIGKILL."""
    now = time.monotonic()
    grace = pool.cfg.kill_grace
    for c in list(pool.children.values()):
        if c.job is not None and c.cancel_deadline is not None and now >= c.cancel_deadline:
            log.warning("job still running %.1fs after its cancel: killing worker %d", pool.cfg.cancel_grace,
                        c.slot, extra=logs.job_fields(c.job, event="cancel_kill", slot=c.slot, pid=c.pid))
            c.cancel_deadline = None
            pool.kill(c, KILLED_CANCEL)
            continue
        if c.job is None or c.deadline is None or now < c.deadline:
            continue
        if c.term_at is None:
            c.term_at = now
            log.warning("job over its hard timeout: SIGTERM to worker %d, SIGKILL after %.1fs", c.slot, grace,
                        extra=logs.job_fields(c.job, event="timeout_kill", slot=c.slot, pid=c.pid,
                                          signal=int(signal.SIGTERM)))
            pool.kill(c, KILLED_TIMEOUT, signal.SIGTERM)
        elif now >= c.term_at + grace:
            log.warning("worker %d still running %.1fs after SIGTERM: SIGKILL", c.slot, grace,
                        extra=logs.job_fields(c.job, event="timeout_sigkill", slot=c.slot, pid=c.pid,
                                              signal=int(signal.SIGKILL)))
            pool.kill(c, KILLED_TIMEOUT, signal.SIGKILL)
            # Sent once: the loop must not wake for this instant again. A child slow to die (in a
            # hung NFS read, a debugger attached) kept it the next wake-up, in the past: the loop
            # spun, a CPU at 100 %, until the child was reaped.
            c.deadline = None
