"""Messages between the master and a child: 4-byte length + JSON, over a socketpair."""
import json
import struct

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 * 1024 * 1024


class TooLarge(ValueError):
    """A message over ``MAX_MESSAGE`` bytes."""


def encode(obj, limit=None):
    """The frame of ``obj``; ``TooLarge`` if its body is over ``limit`` bytes (when given)."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    if limit is not None and len(body) > limit:
        raise TooLarge(f"message of {len(body)} bytes is over the {limit} byte limit")
    return _HEADER.pack(len(body)) + body


def send(sock, obj):
    sock.sendall(encode(obj))


def recv(sock):
    """Blocking read of one message; None at EOF."""
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    body = _read_exactly(sock, size)
    if body is None:
        return None
    return json.loads(body)


def _read_exactly(sock, n):
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


class Reader:
    """Incremental decoder for the master's non-blocking side."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, data):
        self.buffer += data
        messages = []
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            if size > MAX_MESSAGE:
                raise TooLarge(f"message of {size} bytes is over the {MAX_MESSAGE} byte limit")
            if len(self.buffer) < _HEADER.size + size:
                break
            body = bytes(self.buffer[_HEADER.size:_HEADER.size + size])
            del self.buffer[:_HEADER.size + size]
            messages.append(json.loads(body))
        return messages
