"""The health socket: one JSON line in, one JSON line out, served by the main loop.

No thread: the listening socket and every client live in the master's
selector. A client gets 2 s for its first byte and ``client_timeout`` seconds
for its whole line; garbage, JSON nested too deep, an unknown command or an
oversize line gets an error reply, and no client can block or stop the loop
(all client I/O is non-blocking, and a failure answering one client closes
only that client).

A daemon runs for months, and its socket file may be removed under it (an
``rm``, a cleaned folder): ``tangguh status`` would find nobody, and a second
``tangguh run`` would start beside it. Once a second the master looks at its
path and binds a removed socket again. A path that names another socket by
then is someone else's: left alone, and not unlinked at the stop.
"""
import contextlib
import errno
import grp
import json
import logging
import os
import selectors
import socket
import stat
import struct
import time

from .errors import ConfigError, TangguhError
from .oneshot import OneShotServer

MAX_LINE = 64 * 1024
PATH_CHECK_SECONDS = 1.0  # how often the master makes sure its socket file is still there

log = logging.getLogger("tangguh.socket")


class AlreadyRunning(TangguhError):
    """Another live supervisor answers on the socket."""


class NoSupervisor(TangguhError):
    """Nobody answers on the socket."""


def request(path, obj, timeout=5.0):
    """Send one request to a supervisor; return its reply (a dict)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # A blocking connect waits (up to SO_SNDTIMEO) for room in a full accept
    # queue; under a timeout, i.e. non-blocking, it failed at once with EAGAIN.
    whole, part = divmod(max(timeout, 0.001), 1.0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(whole), int(part * 1e6)))
    try:
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NoSupervisor(f"no supervisor answering on {path} ({exc.strerror})") from None
        except BlockingIOError:
            raise NoSupervisor(f"supervisor on {path} did not take the connection within {timeout}s") from None
        s.settimeout(timeout)
        s.sendall(json.dumps(obj).encode() + b"\n")
        data = bytearray()
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        raise NoSupervisor(f"supervisor on {path} did not answer within {timeout}s") from None
    finally:
        s.close()
    if not data:
        raise NoSupervisor(f"supervisor on {path} closed the connection without a reply")
    return json.loads(data)


def socket_exists(path):
    """Whether a socket file is at ``path``; ConfigError if anything else is (it is never replaced)."""
    try:
        existing = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(existing):
        raise ConfigError(f"supervisor.socket: {path} exists and is not a socket; not replacing it")
    return True


def claim_path(path, mode, group=""):
    """Bind the socket at ``path``, refusing if a live supervisor owns it.

    A socket file that accepts a connection belongs to a running supervisor;
    one that refuses is left over from a crash and is removed. Anything else
    at ``path`` (a file, a symlink) is refused, never deleted. ``group`` (a
    name) gets the file, so that an ops group can talk to the daemon.
    """
    if socket_exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (BlockingIOError, TimeoutError):
            # A listener whose queue of connections is full (its loop held up, or a flood of
            # clients): alive, not a crash's leftover.
            raise AlreadyRunning(f"another supervisor is running on {path} (not taking connections"
                                 " now: its connection queue is full)") from None
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError) and exc.errno != errno.ECONNREFUSED:
                raise
            with contextlib.suppress(FileNotFoundError):  # gone meanwhile: nothing to remove
                os.unlink(path)
        else:
            raise AlreadyRunning(f"another supervisor is running on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The umask makes the file come into existence with the right mode: a
    # chmod after bind would leave a moment where it is wider.
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if group:
        # After bind, but the file is only as wide as ``mode`` and still in the
        # daemon's own group: handing it to another group widens nothing.
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except (KeyError, PermissionError) as exc:
            sock.close()
            os.unlink(path)
            why = "no such group" if isinstance(exc, KeyError) else (
                "the daemon's user is not a member (SupplementaryGroups= in the unit)")
            raise ConfigError(f"supervisor.socket_group: cannot give {path} to group {group!r}: {why}") from None
    sock.listen(64)
    sock.setblocking(False)
    return sock


class HealthServer(OneShotServer):
    """Registers itself in ``selector``; ``dispatch(request) -> reply`` answers."""

    max_request = MAX_LINE
    eof_ends_request = True  # a request line without its newline, then EOF: still answered

    def __init__(self, path, mode, selector, dispatch, client_timeout=5.0, group=""):
        self.path, self.mode, self.group = path, mode, group
        self.dispatch = dispatch
        super().__init__(claim_path(path, mode, group), selector, client_timeout)
        self.identity = _identity(path)  # of the file we bound: what the path must still name
        self.check_at = time.monotonic() + PATH_CHECK_SECONDS
        self.complained = None  # what the path named when we last logged about it (once per change)

    def expire_clients(self):
        super().expire_clients()
        if time.monotonic() >= self.check_at:
            self.check_at = time.monotonic() + PATH_CHECK_SECONDS
            self.check_path()

    def check_path(self):
        """Bind again if our socket file was removed; leave a path another socket took alone."""
        try:
            found = _identity(self.path)
        except OSError:
            found = None
        if found == self.identity:
            return
        if found is None:
            try:
                listener = claim_path(self.path, self.mode, self.group)
            except (OSError, TangguhError) as exc:  # its folder gone too, or another daemon got there first
                self._complain("gone", "health socket %s was removed and cannot be bound again: %s", self.path, exc)
                return
            self.selector.unregister(self.listener)
            self.listener.close()  # the clients it accepted are sockets of their own: still answered
            self.listener = listener
            self.selector.register(listener, selectors.EVENT_READ, self._accept)
            self.identity, self.complained = _identity(self.path), None
            log.warning("health socket %s was removed while the supervisor ran: bound again", self.path,
                        extra={"event": "socket_rebound"})
            return
        self._complain(found, "health socket %s now names another socket: tangguh status reaches that one,"
                       " not this supervisor (pid %d)", self.path, os.getpid())

    def _complain(self, what, message, *args):
        if self.complained != what:
            self.complained = what
            log.error(message, *args, extra={"event": "socket_lost"})

    def complete(self, inbox):
        return inbox.find(b"\n")

    def answer(self, inbox):
        return self._line(self._reply(inbox.split(b"\n", 1)[0]))

    def too_large(self):
        return self._line({"ok": False, "error": f"request line over {MAX_LINE} bytes"})

    def timed_out(self):
        return self._line({"ok": False, "error": "timed out waiting for a request line"})

    @staticmethod
    def _line(reply):
        return json.dumps(reply, default=str).encode() + b"\n"

    def _reply(self, line):
        try:
            req = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return {"ok": False, "error": "request is not a JSON line"}
        except RecursionError:  # the parser's own depth limit: 64 KiB of "[" passes the size check
            return {"ok": False, "error": "request nests too deep (a request is one flat JSON object)"}
        if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
            return {"ok": False, "error": 'request must be a JSON object with a "cmd" string'}
        try:
            return self.dispatch(req)
        except Exception as exc:  # noqa: BLE001 - a bad request must never take the daemon down
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def close(self, unlink=True):
        super().close()
        try:
            if unlink and _identity(self.path) == self.identity:  # not another supervisor's socket
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _identity(path):
    """(device, inode) of the file at ``path`` (not followed if a link): FileNotFoundError if none."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino
