"""The main loop's timed chores: due schedules and pruning old jobs.

Each chore keeps its own next instant; the loop calls ``run()`` every turn and
``due_at()`` tells it when a schedule next needs it. Nothing here blocks
beyond one bounded broker call, and a failed call just waits for its next turn.
The queue gauges' sample is not one of them: its counts grow with the jobs kept
(dead letters stay until purged), so the heartbeat thread takes it (heartbeat.py).
"""
import random
import time

from .. import scheduler
from ..errors import BrokerError

PRUNE_SECONDS = 300  # how often finished jobs past the retention are deleted (jittered: many supervisors)
# Jobs one loop turn deletes at most (SQLite: ~12 us each): a backlog of millions is deleted over
# many turns, each coming back at once, instead of in one turn that leaves the socket unanswered.
PRUNE_BUDGET = 5000
# The longest wait before the broker's clock is read again for the schedules: the wait until
# the next tick is counted on the monotonic clock, which a wall-clock step (NTP, a VM resumed)
# does not move, so a daily tick could otherwise come a day late.
CLOCK_CHECK_SECONDS = 30.0


class Periodic:
    def __init__(self, cfg, handlers, link):
        self.link = link
        self.configure(cfg, handlers)
        self.next_prune_at = time.monotonic() + 60

    def configure(self, cfg, handlers):
        """The periodic jobs of the current config and handlers."""
        self.cfg = cfg
        new = scheduler.from_config(cfg, handlers)
        if getattr(self, "scheduler", None) is not None:
            new.carry_over(self.scheduler)  # a reload: the ticks since the last check are still due
        self.scheduler = new
        self.schedule_at = 0.0  # monotonic instant of the next check

    def due_at(self):
        return self.schedule_at if self.scheduler.schedules else None

    def run(self, schedules=True):
        if schedules:
            self.run_schedules()
        self.prune()

    def run_schedules(self):
        if not self.scheduler.schedules or time.monotonic() < self.schedule_at:
            return

        def check(br):
            self.scheduler.tick(br)
            return br.now()

        try:
            now = self.link.call(check, "schedule")
        except BrokerError:
            self.schedule_at = time.monotonic() + 1.0  # what was not enqueued stays due
            return
        self.schedule_at = time.monotonic() + min(CLOCK_CHECK_SECONDS, max(0.0, self.scheduler.due_at() - now))

    def prune(self):
        now = time.monotonic()
        if now < self.next_prune_at or self.cfg.broker.retention <= 0 or self.link.down:
            return
        self.next_prune_at = now + PRUNE_SECONDS * random.uniform(0.9, 1.1)
        try:
            deleted = self.link.call(lambda br: br.prune(self.cfg.broker.retention, PRUNE_BUDGET), "prune")
        except BrokerError:
            return
        if deleted >= PRUNE_BUDGET:
            self.next_prune_at = now  # more of a backlog: the next turn goes on
