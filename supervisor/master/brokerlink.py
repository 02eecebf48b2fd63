"""The main loop's connection to the broker: one ``call()`` for every operation.

A broker call from the main loop either returns or raises ``BrokerError``
(``LeaseLost`` passes through: it is an answer, not a failure). A failure
drops the connection; the next call reconnects. The link logs once when the
broker goes away and once when it is back, not once per try, and tells the
claimer when to try again (``on_down``) with a capped, jittered backoff.

While the broker is down, every call before that instant fails at once,
without touching the network: a server that stops answering makes each try
wait out the driver's timeout, and the loop's claims, outcome writes and
schedules each trying in turn would hold the loop (its status socket, its
children's replies, the watchdog) for all of them. One try per backoff step.

The heartbeat thread has a connection of its own; this one is the main loop's.
"""
import logging
import os
import selectors
import time

from ..backends import open_broker
from ..errors import BrokerError, ConfigError, LeaseLost
from ..retry import backoff

log = logging.getLogger("tangguh.arbiter")

# Outcome writes retry on their own backoff (see OutcomeWriter): their failure
# does not mean the broker is down for the claims.
WRITE_OPS = ("ack", "retry", "dead", "release", "cancelled")


class BrokerLink:
    def __init__(self, url, migrate, selector, metrics, on_wakeup, on_down, pid):
        self.url, self.migrate = url, migrate
        self.selector = selector
        self.metrics = metrics
        # on_wakeup(queues): the broker says new work is due (a notification, an inotify event);
        # queues: the ones it named, None when it cannot tell.
        self.on_wakeup = on_wakeup
        self.on_down = on_down  # on_down(instant): do not claim before this monotonic instant
        self.pid = pid
        self.broker = None
        self.fd = None  # our dup of the broker's wake-up descriptor
        self.down_since = None  # monotonic instant of the first failure of this outage
        self.failures = 0  # failed calls in a row (the reconnect backoff's exponent)
        self.retry_at = 0.0  # while down: the monotonic instant of the next try
        # An outcome write failed while the broker was up: a refusal, or the start of an outage. Writes
        # wait until another call (the claimer's) tells which; each write tried meanwhile could wait
        # out a silent broker's timeout, and could take every turn's try from the claim.
        self.suspect = False
        self.rtt = {}  # op -> its labelled histogram (a handful of ops; labels() per call costs)

    @property
    def down(self):
        return self.down_since is not None

    def deferring(self, now):
        """Whether a call now would fail without trying (the broker is down, its next try ahead)."""
        return self.down_since is not None and now < self.retry_at

    def connect(self):
        if self.broker is None:
            broker = open_broker(self.url)
            if self.migrate:
                broker.migrate()
            fd = broker.wakeup_fd()
            if fd is not None:
                # Our own duplicate: the driver may close its socket behind our back (a
                # Redis restart), and a bare number in the selector could then come to
                # name a child's pipe. A dup stays ours until drop() closes it.
                self.fd = os.dup(fd)
                self.selector.register(self.fd, selectors.EVENT_READ, self._on_wakeup)
            self.broker = broker
        return self.broker

    def _on_wakeup(self, _mask):
        queues = None
        try:
            queues = self.broker.drain_wakeups()  # PostgreSQL: the queues its notifications named
        except Exception:  # noqa: BLE001 - the listener broke: reconnect everything on the next call
            self.drop()
        self.on_wakeup(queues)

    def call(self, fn, op="connect"):
        """Run ``fn(broker)``; on failure mark the broker down and reconnect later.

        ``op`` labels the round-trip time metric.
        """
        now = time.monotonic()
        if self.deferring(now):
            raise BrokerError("broker down, the next try is due later")
        try:
            result = fn(self.connect())
        except LeaseLost:
            self.observe(op, now)
            raise
        except ConfigError:
            self.drop()
            raise  # e.g. the broker's schema is not Tangguh's: no retry can fix that
        except Exception as exc:  # noqa: BLE001 - every driver error means the same: try later
            self.metrics.broker_errors.labels("main").inc()
            self.drop()
            if op in WRITE_OPS and self.down_since is None:
                # A refused outcome write retries on its own backoff. Pausing claims for
                # it could starve the very claim that reclaims its expired lease, which is
                # what finally ends that write (LeaseLost). A real outage fails the claims.
                self.suspect = True
                raise BrokerError(f"{type(exc).__name__}: {exc}") from None
            if self.down_since is None:
                self.down_since = now
                log.error("broker unreachable, pausing claims: %s: %s", type(exc).__name__, exc,
                          extra={"event": "broker_down", "pid": self.pid})
            self.failures += 1
            # From the failure's end: the try itself may have waited out a timeout.
            self.retry_at = time.monotonic() + backoff(self.failures + 1, 0.2, 10.0, jitter=0.5)
            self.on_down(self.retry_at)
            raise BrokerError(str(exc)) from None
        self.observe(op, now)
        if self.down_since is not None:
            log.info("broker reachable again after %.1fs", now - self.down_since,
                     extra={"event": "broker_up", "pid": self.pid})
            self.down_since = None
        self.failures = 0
        self.suspect = False
        return result

    def observe(self, op, since):
        series = self.rtt.get(op)
        if series is None:
            series = self.rtt[op] = self.metrics.broker_rtt.labels(op)
        series.observe(time.monotonic() - since)

    def drop(self):
        if self.fd is not None:
            try:
                self.selector.unregister(self.fd)
            except (KeyError, ValueError):
                pass
            os.close(self.fd)
            self.fd = None
        if self.broker is not None:
            try:
                self.broker.close()
            except Exception:  # noqa: BLE001 - it is being thrown away anyway
                pass
            self.broker = None

    def close_in_child(self):
        if self.fd is not None:
            os.close(self.fd)  # our dup: it would keep the broker's socket alive
