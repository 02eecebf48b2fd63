"""The master's record of the Redis locks its children hold (``ctx.lock``).

The handler's side (acquire, release, fences) is ``supervisor.toolkit.locks``; this is
the other half: the children report each lock over their pipe, the heartbeat
thread extends them with the job's lease, and a dead child's locks are
released at once so the next attempt does not wait out their TTL.
"""
import logging
import threading
import time

from .. import protocol
from ..toolkit.locks import EXTEND, MAX_TTL, RELEASE

log = logging.getLogger("tangguh.locks")


class MasterLocks:
    """The master's record of the Redis locks its children hold.

    The main loop adds and removes entries as ``lock``/``unlock`` messages
    arrive and calls ``release_child`` when a child dies, which only queues its
    locks: the heartbeat thread, woken by ``queued``, frees them
    (``release_queued``) and calls ``extend_all`` once per beat. Each Redis call
    opens a short-lived connection and closes it before returning, so no socket
    of the master's is open across a fork (and only beats with locks held pay for one).
    """

    def __init__(self, redis_url):
        self.redis_url = redis_url
        # pid -> {(key, token): ttl}. By token too: an acquire whose answer was lost names its token
        # before its try again, which a lock the same job holds under another token refuses; by key
        # alone that token replaced the holder's, whose lock then went unextended and unreleased.
        self.held = {}
        self.mutex = threading.Lock()
        self.released = 0  # locks released for dead children
        self.extended = 0
        # (pid, {(key, token): ttl}, give_up_at): a dead child's locks, freed by the heartbeat thread.
        # Its release waited on Redis in the main loop: a stalled server held the loop seconds per
        # dead child. One that fails is tried again each beat until its TTL has freed it anyway.
        self.releasing = []
        self.queued = threading.Event()  # set: locks to release (the heartbeat thread waits on it)
        self.release_failures = 0
        # Beats whose extension failed in a row: the first is logged, not each one of an outage.
        self.extend_failures = 0

    def _client(self, timeout=None):
        from ..toolkit import open_redis

        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One try, short timeouts: the main loop must not stall on a Redis outage (the TTL covers it).
        connect, answer = (1, 2) if timeout is None else (min(1, timeout), min(2, timeout))
        return open_redis(self.redis_url, socket_connect_timeout=connect, socket_timeout=answer,
                          retry=Retry(NoBackoff(), 0))[0]

    def on_message(self, pid, msg):
        """A child's ``lock`` or ``unlock`` message (a malformed one is logged and ignored)."""
        try:
            key, token = str(msg["key"]), str(msg["token"])
            ttl = protocol.finite(msg.get("ttl") or 0)  # 10**400 or inf would raise here, NaN at each extension
            # Over MAX_TTL its milliseconds may not even be an integer (1e306 * 1000 is inf), and every
            # extension of every child's locks would fail with it: a lock is for minutes, not decades.
            if ttl is None or not 0 <= ttl <= MAX_TTL:
                raise ValueError(msg.get("ttl"))
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring a malformed %s message from child %d", msg.get("op"), pid)
            return
        with self.mutex:
            if msg["op"] == protocol.LOCK:
                self.held.setdefault(pid, {})[key, token] = ttl
            else:
                mine = self.held.get(pid, {})
                mine.pop((key, token), None)
                if not mine:
                    self.held.pop(pid, None)

    def release_child(self, pid):
        """Queue every lock child ``pid`` held (it is dead, or its job ended) for release: how many. Main loop."""
        with self.mutex:
            mine = self.held.pop(pid, None)
            if mine:
                self.releasing.append((pid, mine, time.monotonic() + max(mine.values())))
        if not mine:
            return 0
        self.queued.set()
        return len(mine)

    def release_queued(self, timeout=None):
        """Compare-and-delete the queued locks in one round trip: how many were freed. Heartbeat thread.

        ``timeout`` bounds its connect and its answer each (as ``extend_all``'s). Those whose
        release failed stay queued for the next call, until their TTL has passed."""
        self.queued.clear()
        now = time.monotonic()
        with self.mutex:
            self.releasing = [entry for entry in self.releasing if entry[2] > now]  # the rest expired
            batch = list(self.releasing)
        if not batch:
            return 0
        client = None
        try:
            client = self._client(timeout)
            pipe = client.pipeline(transaction=False)
            for _, mine, _ in batch:
                for key, token in mine:
                    pipe.eval(RELEASE, 1, key, token)
            answers = iter(pipe.execute())
        except Exception as exc:  # noqa: BLE001 - Redis away: tried again next beat, or the TTL frees them
            self.release_failures += 1
            log.log(logging.WARNING if self.release_failures == 1 else logging.DEBUG,
                    "could not release %d lock(s) of dead children yet (tried again until their TTL): %s",
                    sum(len(mine) for _, mine, _ in batch), exc)
            return 0
        finally:
            if client is not None:
                client.close()
        self.release_failures = 0
        with self.mutex:
            self.releasing = [entry for entry in self.releasing if entry not in batch]
        total = 0
        for pid, mine, _ in batch:
            released = sum(1 for _ in mine if next(answers))
            total += released
            log.info("released %d lock(s) of dead child %d", released, pid, extra={"event": "locks_released"})
        self.released += total
        return total

    def extend_all(self, timeout=None):
        """Extend every registered lock by its TTL in one pipelined round trip. Heartbeat thread.

        ``timeout`` bounds its connect and its answer each (seconds; they are 1 and 2 without it)."""
        with self.mutex:
            entries = [(key, token, ttl) for mine in self.held.values() for (key, token), ttl in mine.items()]
        if not entries:
            return
        client = None
        try:
            client = self._client(timeout)
            pipe = client.pipeline(transaction=False)
            for key, token, ttl in entries:
                pipe.eval(EXTEND, 1, key, token, int(ttl * 1000))
            self.extended += sum(1 for r in pipe.execute() if r)
        except Exception as exc:  # noqa: BLE001 - a Redis error must not kill the heartbeat
            self.extend_failures += 1
            log.log(logging.WARNING if self.extend_failures == 1 else logging.DEBUG,
                    "lock extension failed: %s: %s", type(exc).__name__, exc, extra={"event": "lock_extend_failed"})
            return
        finally:
            if client is not None:
                client.close()
        if self.extend_failures:
            log.info("lock extensions work again after %d failed", self.extend_failures,
                     extra={"event": "lock_extend_resumed"})
            self.extend_failures = 0
