"""The brokers a ``Client`` keeps for ``wait``, which blocks and so runs on a broker of its own.

A web app that waits in every request would otherwise open a broker per request
(on PostgreSQL two server connections: a query one and a listening one). Up to
``KEPT`` idle ones stay open between waits; more threads waiting at once open
their own and close them after.
"""
import logging

from .backends.base import open_broker
from .errors import BadInput

log = logging.getLogger("tangguh.client")

KEPT = 4


class WaitBrokers:
    def __init__(self, url):
        self.url = url
        self.idle = []  # list.pop and append need no lock: a signal handler's wait cannot deadlock here
        self.closes = 0  # close() calls: a wait that began before one does not keep its broker

    def wait(self, job_id, timeout):
        closes = self.closes
        try:
            broker = self.idle.pop()
        except IndexError:
            broker = open_broker(self.url)
        try:
            job = broker.wait(job_id, timeout)
        except BadInput:
            self.give_back(broker, closes)  # an answer (an unknown id): the broker is fine
            raise
        except BaseException:
            close_quietly(broker)
            raise
        self.give_back(broker, closes)
        return job

    def give_back(self, broker, closes):
        if closes == self.closes and len(self.idle) < KEPT:
            self.idle.append(broker)
        else:
            close_quietly(broker)

    def close(self):
        self.closes += 1
        while self.idle:
            close_quietly(self.idle.pop())

    def after_fork_in_child(self):
        # The kept brokers are the parent's connections: each broker's close, in a child, lets go
        # of them without touching the parent's sessions. Kept open, an inherited SQLite connection
        # left the child's own taking no locks, and the parent's close deleted the WAL the child
        # committed to (backends/sqlite/database.py, let_go_inherited).
        kept, self.idle = self.idle, []
        for broker in kept:
            close_quietly(broker)


def close_quietly(broker):
    try:
        broker.close()
    except Exception:  # noqa: BLE001 - closing a broker already broken must not hide the caller's error
        log.debug("closing a wait broker failed", exc_info=True)
