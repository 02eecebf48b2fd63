"""The broker from the console's event loop.

A broker instance is not thread-safe, so each of a few worker threads holds its
own connection, opened on first use and dropped after a BrokerError (the next
call reopens it: an outage ends by itself). ``Fetch`` turns an outage or an
operation the broker does not offer into a line for the page's banner instead
of an error page, so every page renders while the broker is down.
"""
import asyncio
import concurrent.futures
import logging
import threading

from ..backends.base import open_broker
from ..errors import BadInput, BrokerError

log = logging.getLogger("tangguh.web")


class BrokerPool:
    def __init__(self, url, threads=4):
        self.url = url
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tangguh-web-broker")
        self.local = threading.local()
        self.opened = []  # every connection, for close()
        self.lock = threading.Lock()

    def _broker(self):
        broker = getattr(self.local, "broker", None)
        if broker is None:
            broker = self.local.broker = open_broker(self.url)
            with self.lock:
                self.opened.append(broker)
        return broker

    def _drop(self):
        broker = getattr(self.local, "broker", None)
        self.local.broker = None
        if broker is not None:
            with self.lock:
                if broker in self.opened:
                    self.opened.remove(broker)
            try:
                broker.close()
            except Exception:  # noqa: BLE001 - it is broken already; a fresh one is opened next time
                pass

    def _run(self, fn, args):
        try:
            return fn(self._broker(), *args)
        except BadInput:
            raise
        except BrokerError:
            self._drop()
            raise
        except (OSError, ConnectionError) as exc:  # a driver error a backend did not wrap
            self._drop()
            raise BrokerError(f"{type(exc).__name__}: {exc}") from exc

    async def call(self, fn, *args):
        """``fn(broker, *args)`` on a worker thread; BrokerError, BadInput and NotImplementedError propagate."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._run, fn, args)

    def close(self):
        # Wait for the calls already running: closing a connection another thread is
        # using crashes the process (sqlite3 frees it under the running statement).
        # Cancelling an awaiting task does not stop its thread, so this wait is needed
        # at every shutdown; it is bounded by the broker's own timeouts.
        self.executor.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            for broker in self.opened:
                try:
                    broker.close()
                except Exception:  # noqa: BLE001
                    pass
            self.opened.clear()


def unreachable(exc):
    why = " ".join(str(exc).split())[:300].rstrip(".")  # a driver's message often ends a sentence already
    return f"The broker is unreachable: {why}. Figures shown may be missing or stale."


def unsupported(what):
    return f"This broker does not offer {what} yet."


class Fetch:
    """Calls for one page; collects what went wrong as banner lines instead of raising."""

    def __init__(self, pool):
        self.pool = pool
        self.problems = []

    async def __call__(self, what, fn, *args, default=None):
        try:
            return await self.pool.call(fn, *args)
        except BrokerError as exc:
            self.note(unreachable(exc))
        except NotImplementedError:
            self.note(unsupported(what))
        return default

    def note(self, line):
        if line not in self.problems:
            self.problems.append(line)
