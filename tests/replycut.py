"""A TCP relay to a Redis server that can lose one reply after the server ran the request.

What a connection reset, a NAT table flush or a load balancer's idle cut does to
a client between its request and the answer: the server has run the command,
the client never hears of it, and redis-py sends it again on a new connection.
``cut_next(marker)`` arms the relay: the next request holding ``marker`` (a
script's SHA1, say) reaches the server; its reply is read, thrown away, and the
client's connection closed (``hold=True``: left open, the client waits for an answer that
never comes, until its socket timeout). ``refuse_next()`` closes the next connection as
soon as it is accepted, before the client's handshake: a sending that never
reached the server. Every other byte is relayed unchanged.
"""
import collections
import socket
import threading
import urllib.parse


class ReplyCut:
    def __init__(self, host, port):
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.marker = None  # armed: the request that holds it loses its reply
        self.hold = False  # the doomed connection stays open, silent
        self.cut = threading.Event()  # set once a reply was lost
        self.closed = False
        self.sockets = []
        self.accepted = 0
        self.refusing = 0  # connections still to be closed at once
        self.refused = 0
        self.seen = collections.deque(maxlen=20)  # (connection, request's head): for a failure's message
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def of(cls, url):
        """A relay to the Redis server ``url`` names, and that URL through it (its user,
        password, database and options kept)."""
        parts = urllib.parse.urlsplit(url)
        cut = cls(parts.hostname, parts.port or 6379)
        userinfo = parts.netloc.rpartition("@")[0]
        return cut, parts._replace(netloc=f"{userinfo + '@' if userinfo else ''}127.0.0.1:{cut.port}").geturl()

    def cut_next(self, marker, hold=False):
        with self.lock:
            self.marker = marker.encode() if isinstance(marker, str) else marker
            self.hold = hold
            self.cut.clear()

    def refuse_next(self):
        with self.lock:
            self.refusing += 1

    def close(self):
        self.closed = True
        self.listener.close()
        for s in list(self.sockets):
            _close(s)

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                refuse, self.refusing = self.refusing > 0, max(0, self.refusing - 1)
            if refuse:
                self.refused += 1
                _close(client)
                continue
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            self.accepted += 1
            # This connection's next reply is to be lost. Bound to each pump as a default: a closure
            # would read the loop's variable, which the next accepted connection rebinds.
            doomed = threading.Event()
            threading.Thread(target=_pump, args=(client, server, lambda data, n=self.accepted, doomed=doomed:
                                                 self._request(data, doomed, n)), daemon=True).start()
            threading.Thread(target=_pump, args=(server, client, lambda data, doomed=doomed: self._reply(doomed)),
                             daemon=True).start()

    def describe(self):
        """What the relay saw, for the message of a test that waited for a cut in vain."""
        with self.lock:
            armed = self.marker.decode() if self.marker is not None else None
            seen = "\n".join(f"  #{n}: {head!r}" for n, head in self.seen)
        return f"relay: {self.accepted} connections, marker {armed!r}, cut {self.cut.is_set()}; last requests:\n{seen}"

    def _request(self, data, doomed, connection):
        """A request on its way: the armed marker dooms this connection's next reply."""
        with self.lock:
            self.seen.append((connection, bytes(data[:120])))
            if self.marker is not None and self.marker in data:
                self.marker = None
                doomed.set()  # before the server can answer: the reply pump sees it
        return True

    def _reply(self, doomed):
        """A reply on its way: relayed, unless the connection is doomed (the server ran the request)."""
        if doomed.is_set():
            self.cut.set()
            return None if self.hold else False  # the client never hears of it
        return True


def _pump(src, dst, relay):
    """Copy ``src`` to ``dst`` while ``relay(data)`` says so (None: drop this data, go on); then close both ends."""
    while True:
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        verdict = relay(data) if data else False
        if verdict is None:
            continue
        if not verdict:
            break
        try:
            dst.sendall(data)
        except OSError:
            break
    _close(src)
    _close(dst)


def _close(s):
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
