"""What one client may hold of the console's connections.

uvicorn bounds the open connections (``limit_concurrency``: past it, a 503 for
every request) but closes an idle one only between requests. A connection that
never sends a request, or sends its head a byte at a time, held its slot for as
long as it stayed open: 200 idle sockets from anyone who could reach the port
answered every request, the login page's included, with 503. Here a connection
whose request head is not complete within ``HEAD_SECONDS`` of its opening, or of
uvicorn's keep-alive wait after its last response (the first byte of a head
cancels that wait), is closed; and one machine other than this one holds at most
``PER_PEER`` connections at once (a proxy on this machine speaks for many users:
it buffers slow clients itself).
"""
import collections

from uvicorn.protocols.http.h11_impl import H11Protocol

from .auth import is_loopback

HEAD_SECONDS = 5.0
PER_PEER = 32


class Bounded(H11Protocol):
    peers = collections.Counter()  # remote address -> open connections (one event loop: no lock)

    def connection_made(self, transport):
        super().connection_made(transport)
        self.peer = self.client[0] if self.client and not is_loopback(str(self.client[0])) else None
        if self.peer is not None:
            self.peers[self.peer] += 1
            if self.peers[self.peer] > PER_PEER:
                transport.close()
                return
        self.head_timer, self.waiting_after = self.loop.call_later(HEAD_SECONDS, self.no_head), None

    def on_response_complete(self):
        super().on_response_complete()
        if not self.transport.is_closing():  # the next head: within the keep-alive wait and HEAD_SECONDS
            self.head_timer.cancel()
            self.waiting_after = self.cycle
            self.head_timer = self.loop.call_later(self.timeout_keep_alive + HEAD_SECONDS, self.no_head)

    def no_head(self):
        # No request begun since the timer started (uvicorn keeps a finished cycle until the next).
        if self.cycle is self.waiting_after and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc):
        timer = getattr(self, "head_timer", None)
        if timer is not None:
            timer.cancel()
        if self.peer is not None:
            self.peers[self.peer] -= 1
            if not self.peers[self.peer]:
                del self.peers[self.peer]
        super().connection_lost(exc)
