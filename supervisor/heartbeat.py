"""The heartbeat thread: renews every lease the master holds, in one call.

It is the only thread besides the main loop, and it is stopped and joined
before every batch of forks (see docs/design.md, process-model rules). It owns its
own broker connection, opened when it starts. Lost leases are handed to the
main loop through a deque and a byte on a wake-up pipe; the thread itself
never touches children.
"""
import collections
import logging
import os
import threading
import time

from .backends import open_broker
from .errors import BrokerError

log = logging.getLogger("tangguh.heartbeat")


class Heartbeat:
    def __init__(self, url, lease_seconds, interval, wake_fd):
        self.url = url
        self.lease_seconds = lease_seconds
        self.interval = interval
        self.wake_fd = wake_fd
        self.held = {}  # job_id -> Lease
        self.lost = collections.deque()
        self.lock = threading.Lock()
        self.thread = None
        self.stopping = threading.Event()
        self.broker = None
        self.locks = None  # locks.MasterLocks: children's Redis locks, extended with the leases
        self.extensions = 0  # leases renewed
        self.errors = 0
        self.lag = 0.0  # how late the last beat ran, seconds
        self.last_beat = time.monotonic()

    def hold(self, lease):
        with self.lock:
            self.held[lease.job_id] = lease

    def drop(self, job_id):
        with self.lock:
            self.held.pop(job_id, None)

    def holding(self):
        with self.lock:
            return list(self.held.values())

    def start(self):
        if self.thread is not None:
            return
        self.stopping.clear()
        self.thread = threading.Thread(target=self._run, name="tangguh-heartbeat", daemon=True)
        self.thread.start()

    def stop(self):
        """Stop and join; the master may fork once this returns."""
        if self.thread is None:
            return
        self.stopping.set()
        self.thread.join()
        self.thread = None

    def close(self):
        self.stop()
        if self.broker is not None:
            self.broker.close()
            self.broker = None

    def _run(self):
        due = time.monotonic() + self.interval
        while not self.stopping.wait(max(0.0, due - time.monotonic())):
            self.lag = max(0.0, time.monotonic() - due)
            due = time.monotonic() + self.interval
            self.beat()

    def beat(self):
        leases = self.holding()
        self.last_beat = time.monotonic()
        if self.locks is not None:
            self.locks.extend_all()  # one pipelined round trip; a lock lives only while its job runs
        if not leases:
            return
        try:
            if self.broker is None:
                self.broker = open_broker(self.url)
            lost = self.broker.extend(leases, self.lease_seconds)
        except BrokerError as exc:
            self.errors += 1
            log.debug("lease renewal failed: %s", exc)
            self._reset_broker()
            return
        except Exception as exc:  # noqa: BLE001 - a driver error must not kill the thread
            self.errors += 1
            log.warning("lease renewal failed: %s: %s", type(exc).__name__, exc)
            self._reset_broker()
            return
        self.extensions += len(leases) - len(lost)
        if lost:
            with self.lock:
                for lease in lost:
                    if self.held.get(lease.job_id) == lease:
                        del self.held[lease.job_id]
                        self.lost.append(lease)
            try:
                os.write(self.wake_fd, b"!")
            except BlockingIOError:
                pass  # the pipe is full: the main loop is awake anyway

    def _reset_broker(self):
        if self.broker is not None:
            try:
                self.broker.close()
            except Exception:  # noqa: BLE001
                pass
            self.broker = None
