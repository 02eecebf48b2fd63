"""A listener in the master's selector that answers one request per connection.

The health socket and the HTTP ``/metrics`` endpoint are both served this way:
no thread (docs/design.md's fork rule), no blocking call, a deadline per client so a
silent or slow client cannot hold the loop or a slot, and a size limit so an
endless request cannot grow the master's memory. A connection that sends
nothing gets ``IDLE_SECONDS``. Idle connections held open (slowloris, or a
flood of them) cannot lock an operator out: a real client writes its request
as soon as it connects, so a new connection is read at once and answered in
the same turn when its request is there; the loop accepts a bounded batch per
wake-up, so it reads every connection it holds before ``max_clients`` newer
ones arrive; and at ``max_clients`` the oldest connection still waiting for
its request makes room. A peer holding more than its share of the table (an
eighth; a UNIX socket's peer is a process, a TCP one's a host) loses its own
connections first, silent or half-written: a flood from one process or host
cannot push out the operator's CLI or a scraper from elsewhere, however long
the scheduler keeps that one from writing its request. (A flood spread over
many processes or addresses still can, as can one that shares the scraper's
host.) A failure while answering one client closes that
client, never the loop. Subclasses say when a request is complete and what to
answer.
"""
import collections
import logging
import selectors
import socket
import struct
import time

log = logging.getLogger("tangguh.socket")

IDLE_SECONDS = 2.0  # before the first byte; a real client writes its request at once


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _peer(conn, address):
    """Who is at the other end: a host (TCP: its address) or a process (UNIX socket: its pid)."""
    if isinstance(address, tuple):
        return address[0]
    try:
        return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[0]
    except (OSError, AttributeError):  # AttributeError: a system without SO_PEERCRED
        return None


class _Client:
    def __init__(self, sock, deadline, peer=None):
        self.sock, self.deadline, self.peer = sock, deadline, peer
        self.fd = sock.fileno()
        self.accepted = time.monotonic()
        self.inbox = bytearray()
        self.outbox = b""


class OneShotServer:
    max_request = 64 * 1024
    max_clients = 256
    read_size = 65536
    # Per wake-up: under a connection storm the loop still gets back to reading
    # the clients it holds, instead of accepting (and shedding) without end.
    accept_batch = 32
    # Bytes of a terminator that may have arrived in part: a request within the limit whose
    # terminator is split across reads must not be refused while it completes.
    terminator_slack = 0
    # Whether a peer that half-closes after an unterminated request has sent the whole of it
    # (a line-oriented socket: ``printf '{...}' | socat``); HTTP's blank line must come.
    eof_ends_request = False

    def __init__(self, listener, selector, client_timeout):
        self.listener, self.selector, self.client_timeout = listener, selector, client_timeout
        self.clients = {}
        selector.register(listener, selectors.EVENT_READ, self._accept)

    # -- what a subclass provides ---------------------------------------------------
    def complete(self, inbox):
        """Where the request in ``inbox`` ends (the offset of its terminator), or -1 when it has not yet."""
        raise NotImplementedError

    def answer(self, inbox):
        """The reply (bytes) to a whole request."""
        raise NotImplementedError

    def too_large(self):
        """The reply to a request over ``max_request`` bytes."""
        raise NotImplementedError

    def timed_out(self):
        """The reply to a client that sent no whole request in time."""
        raise NotImplementedError

    # -- the loop's side -----------------------------------------------------------------
    def _accept(self, _mask):
        for _ in range(self.accept_batch):
            try:
                conn, address = self.listener.accept()
            except OSError:  # BlockingIOError: none left; anything else: try on the next wake-up
                return
            conn.setblocking(False)
            client = _Client(conn, time.monotonic() + min(IDLE_SECONDS, self.client_timeout), _peer(conn, address))
            self.clients[client.fd] = client
            self.selector.register(conn, selectors.EVENT_READ, lambda mask, c=client: self._io(c, mask))
            self._io(client, selectors.EVENT_READ)  # usually the whole request is here: answered now
            if len(self.clients) > self.max_clients:
                self._make_room(client)

    def _make_room(self, newcomer):
        """Back to ``max_clients``: a client still waiting for its request goes: a flooding
        peer's first, then silent ones, then the oldest.

        Not the newcomer: the kernel wakes the loop as a client connects, so a
        real client is usually accepted a moment before its request arrives.
        A bounded batch per wake-up means the loop reads every held connection
        before ``max_clients`` newer ones can push it out; the peers' counts
        protect a client whose request the scheduler delays longer than that.
        """
        held = collections.Counter(c.peer for c in self.clients.values())
        share = max(8, self.max_clients // 8)  # below it a peer is a client, not a flood: age alone decides
        waiting = sorted((c for c in self.clients.values() if c is not newcomer and not c.outbox),
                         key=lambda c: (held[c.peer] <= share, len(c.inbox) > 0, c.accepted))
        for oldest in waiting:  # sorted once: a flood's turn stays linear in the clients held
            if len(self.clients) <= self.max_clients:
                return
            if not oldest.inbox:
                # Its request may have come since its last read (it is ready in this very
                # turn, or was slow to write): answered now, not dropped.
                self._io(oldest, selectors.EVENT_READ)
                if self.clients.get(oldest.fd) is not oldest or oldest.outbox or oldest.inbox:
                    continue
            self._drop(oldest)
        for oldest in waiting:  # every one of them had begun a request: the oldest of those goes
            if len(self.clients) <= self.max_clients:
                return
            if self.clients.get(oldest.fd) is oldest and not oldest.outbox:
                self._drop(oldest)
        if len(self.clients) > self.max_clients:
            self._drop(newcomer)

    def _io(self, client, mask):
        if self.clients.get(client.fd) is not client:
            return  # dropped earlier in this turn (its fd may already be a newer client's)
        try:
            self._serve(client, mask)
        except Exception:  # noqa: BLE001 - one client's request must never stop the master's loop
            log.exception("health/metrics client dropped: answering it failed", extra={"event": "client_error"})
            self._drop(client)

    def _serve(self, client, mask):
        if mask & selectors.EVENT_READ and not client.outbox:
            try:
                data = client.sock.recv(self.read_size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return self._drop(client)
            if not data:
                if client.inbox and self.eof_ends_request:
                    return self._send(client, self.answer(bytes(client.inbox)))
                return self._drop(client)
            if not client.inbox:  # the first bytes: now the whole request gets its time
                client.deadline = client.accepted + self.client_timeout
            client.inbox += data
            end = self.complete(client.inbox)
            # The limit is the request's, not a read's: one that ended within the read past it is refused too.
            if end > self.max_request or (end < 0 and len(client.inbox) > self.max_request + self.terminator_slack):
                self._send(client, self.too_large())
            elif end >= 0:
                self._send(client, self.answer(bytes(client.inbox)))
        if mask & selectors.EVENT_WRITE:
            self._flush(client)

    def _send(self, client, reply):
        client.outbox = reply
        self.selector.modify(client.sock, selectors.EVENT_WRITE, lambda mask, c=client: self._io(c, mask))
        self._flush(client)

    def _flush(self, client):
        try:
            sent = client.sock.send(client.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._drop(client)
        client.outbox = client.outbox[sent:]
        if not client.outbox:
            self._drop(client)

    def _drop(self, client):
        if self.clients.get(client.fd) is client:
            del self.clients[client.fd]
            try:
                self.selector.unregister(client.sock)
            except (KeyError, ValueError):
                pass
        client.sock.close()

    def expire_clients(self):
        """Answer clients past their deadline once, then drop them."""
        now = time.monotonic()
        for client in list(self.clients.values()):
            if now > client.deadline:
                if client.outbox:
                    self._drop(client)
                else:
                    client.deadline = now + 1.0
                    self._send(client, self.timed_out())

    def close(self):
        for client in list(self.clients.values()):
            self._drop(client)
        try:
            self.selector.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.listener.close()

    def close_in_child(self):
        """In a forked child: close our copies of the descriptors."""
        for client in self.clients.values():
            client.sock.close()
        self.listener.close()
