"""Failed logins, counted per client address: past a limit, the login form answers 429.

A guessing script gets ``FAILURES`` tries per ``WINDOW`` seconds from one address,
then waits; the refused attempts never reach argon2, so a flood costs no CPU
either. A success clears the address. The table is bounded (``MAX_ADDRESSES``,
the least recently failing dropped first), so neither time nor a crowd of
addresses makes it grow without end. The address is the one uvicorn reports: it
takes ``X-Forwarded-For`` from a proxy on 127.0.0.1 only (``app.serve``), so behind
a local reverse proxy it is the browser's.
"""
import collections
import time

FAILURES = 10
WINDOW = 300.0
MAX_ADDRESSES = 10_000


class LoginThrottle:
    def __init__(self, failures=FAILURES, window=WINDOW, max_addresses=MAX_ADDRESSES, clock=time.monotonic):
        self.failures, self.window, self.max_addresses, self.clock = failures, window, max_addresses, clock
        self.recent = collections.OrderedDict()  # address -> deque of failure instants, oldest address first

    def _live(self, address, now):
        times = self.recent.get(address)
        while times and times[0] <= now - self.window:
            times.popleft()
        if times is not None and not times:
            del self.recent[address]
            return None
        return times

    def wait(self, address):
        """Seconds until ``address`` may try again (0: it may now)."""
        now = self.clock()
        times = self._live(address, now)
        if times is None or len(times) < self.failures:
            return 0.0
        return max(0.0, times[0] + self.window - now)

    def failed(self, address):
        now = self.clock()
        times = self._live(address, now)
        if times is None:
            times = self.recent[address] = collections.deque(maxlen=self.failures)
        times.append(now)
        self.recent.move_to_end(address)
        while len(self.recent) > self.max_addresses:
            self.recent.popitem(last=False)

    def succeeded(self, address):
        self.recent.pop(address, None)
