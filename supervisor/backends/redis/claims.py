"""The Redis broker's claims: one script call per queue, in the order given.

``claim.lua`` takes back the queue's expired leases, promotes its due delayed jobs, ends its
jobs past their expiry and leases ready ones; under per-type limits ``claim.lua`` leasing
nothing runs first and ``claim_limited.lua`` leases (in one round trip).
"""
import json
import logging
import time

from redis.exceptions import RedisError

from ..limits import active
from .connection import guard

log = logging.getLogger("tangguh.broker")

LIMITED_SCAN = 1000  # ready entries one limited claim looks at per queue (held-back jobs included)
PARTIAL_WARN_EVERY = 60.0  # seconds between warnings of a queue failing its part of claims
TIDY_EVERY = 1.0  # seconds between tidy calls of a queue that claims full before it skip


class Claims:
    @guard
    def claim(self, queues, n, lease_seconds, owner, limits=None):
        lease_us = max(1, int(lease_seconds * 1e6))
        owner_json = json.dumps(owner)
        for queue in queues:
            self.keys.for_scripts(queue)  # a bad name fails the claim before any queue's jobs are leased
        limits = active(limits)

        def tidy(queue):  # claim.lua leasing nothing: take back, promote, end the expired
            self._leased(queue, self._run("claim", queue, [0, lease_us, owner, owner_json]))
        if limits:
            return self._runnable(self._claim_limited(queues, n, lease_us, owner, owner_json, limits, tidy))
        return self._runnable(self._queue_by_queue(queues, n, lambda queue, want: self._leased(
            queue, self._run("claim", queue, [want, lease_us, owner, owner_json])), tidy))

    def _queue_by_queue(self, queues, n, lease, tidy):
        """Up to ``n`` jobs, one script call per queue in order: ``lease(queue, want)`` -> that queue's jobs.

        A queue after the claim is full is only tidied (``tidy(queue)``: its expired leases
        taken back, its due delayed jobs promoted, its jobs past their expiry ended), at most
        every ``TIDY_EVERY`` seconds, as the SQL brokers' claim does for every queue it
        serves: behind a backlog in the queues before it, a dead supervisor's job there would
        stay ``running``, its attempts spent, never dead-lettered, its waiters never told.

        When a queue's call fails (its Cluster node failing over, the connection dropped),
        the jobs the calls before it leased are returned, not lost with the exception: they
        would stay leased to nobody, an attempt spent, until their leases expire. The
        failure is raised when nothing was leased, so an outage still reads as one. A failed
        call whose answer was lost may have leased jobs all the same: it counts in
        ``calls_resent``, so the supervisor looks for them as after a resent claim (orphans.py).
        """
        claimed = []
        for queue in queues:
            if len(claimed) >= n:
                self._tidy_behind(queue, tidy)
                continue
            lost = self._lost()
            try:
                claimed.extend(lease(queue, n - len(claimed)))
            except RedisError as exc:
                if not claimed:
                    raise
                if self._lost() != lost:  # not a connection refused: the call may have run
                    self.calls_resent += 1
                now = time.monotonic()
                if now - self._partial_warned.get(queue, -PARTIAL_WARN_EVERY) >= PARTIAL_WARN_EVERY:
                    self._partial_warned[queue] = now  # a queue on a failing node fails every claim
                    log.warning("claim from queue %r failed; the jobs leased from the queues before it are kept:"
                                " %s: %s", queue, type(exc).__name__, exc,
                                extra={"event": "claim_partial", "queue": queue})
                break
        return claimed

    def _tidy_behind(self, queue, tidy):
        now = time.monotonic()
        if now < self._tidy_due.get(queue, 0.0):
            return
        self._tidy_due[queue] = now + TIDY_EVERY
        try:
            tidy(queue)
        except RedisError:  # the jobs leased from the queues before it are kept; the next round tries again
            pass

    def _claim_limited(self, queues, n, lease_us, owner, owner_json, limits, tidy):
        """Per queue, one round trip: claim.lua with n = 0 (reclaim, promote), then claim_limited.lua."""
        spec = json.dumps({t: [-1 if lim.max_concurrency is None else lim.max_concurrency, int(lim.exclusive),
                               lim.rate[0] if lim.rate else 0, int(lim.rate[1] * 1e6) if lim.rate else 0]
                           for t, lim in limits.items()}, separators=(",", ":"))

        def lease(queue, want):
            calls = [("claim", queue, [0, lease_us, owner, owner_json]),
                     ("claim_limited", queue, [want, lease_us, owner, owner_json, spec, LIMITED_SCAN])]
            expired, leased = self._run_many(calls)
            self._leased(queue, expired)  # records what the plain claim ended expired
            return self._leased(queue, leased)

        return self._queue_by_queue(queues, n, lease, tidy)
