"""A listener in the master's selector that answers one request per connection.

The health socket and the HTTP ``/metrics`` endpoint are both served this way:
no thread (docs/design.md's fork rule), no blocking call, a deadline per client so a
silent or slow client cannot hold the loop or a slot, and a size limit so an
endless request cannot grow the master's memory. Subclasses say when a
request is complete and what to answer.
"""
import selectors
import time


class _Client:
    def __init__(self, sock, deadline):
        self.sock, self.deadline = sock, deadline
        self.inbox = bytearray()
        self.outbox = b""


class OneShotServer:
    max_request = 64 * 1024
    max_clients = 256
    read_size = 65536

    def __init__(self, listener, selector, client_timeout):
        self.listener, self.selector, self.client_timeout = listener, selector, client_timeout
        self.clients = {}
        selector.register(listener, selectors.EVENT_READ, self._accept)

    # -- what a subclass provides ---------------------------------------------------
    def complete(self, inbox):
        """Whether ``inbox`` holds a whole request."""
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
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # BlockingIOError: none left; anything else: try on the next wake-up
                return
            if len(self.clients) >= self.max_clients:
                conn.close()  # a connection storm must not grow the master's memory or fd table
                continue
            conn.setblocking(False)
            client = _Client(conn, time.monotonic() + self.client_timeout)
            self.clients[conn.fileno()] = client
            self.selector.register(conn, selectors.EVENT_READ, lambda mask, c=client: self._io(c, mask))

    def _io(self, client, mask):
        if mask & selectors.EVENT_READ and not client.outbox:
            try:
                data = client.sock.recv(self.read_size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return self._drop(client)
            if not data:
                return self._drop(client)
            client.inbox += data
            if self.complete(client.inbox):
                self._send(client, self.answer(bytes(client.inbox)))
            elif len(client.inbox) > self.max_request:
                self._send(client, self.too_large())
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
        if self.clients.pop(client.sock.fileno(), None) is not None:
            self.selector.unregister(client.sock)
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
